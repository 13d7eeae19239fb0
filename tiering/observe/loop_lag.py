"""Event-loop health: how late the loop wakes a periodic ticker (a coroutine that sleeps
``interval`` and wakes ``interval + lag`` later measures ``lag``)."""

from __future__ import annotations

import asyncio
import time

from tiering.lifecycle import AsyncService, Lifecycle
from tiering.validation import seconds


class LoopLagMonitor(AsyncService):
    """Samples event-loop lag every ``interval`` seconds (InvalidArgumentError unless
    positive) from :meth:`start` to :meth:`aclose`; read ``p99_ms`` during or after."""

    def __init__(self, interval: float = 0.001) -> None:
        self.interval = seconds("interval", interval, allow_zero=False)
        self.samples: list[float] = []
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._state = Lifecycle.OPEN
        self._task = asyncio.create_task(self._tick(), name="loop-lag-monitor")
        await asyncio.sleep(0)  # let the ticker take its first timestamp

    async def aclose(self) -> None:
        self._state = Lifecycle.CLOSED
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                # Re-raise only if our own caller is being cancelled, not the ticker.
                current = asyncio.current_task()
                if current is not None and current.cancelling():
                    raise
            self._task = None

    async def _tick(self) -> None:
        interval = self.interval
        last = time.perf_counter()
        while True:
            await asyncio.sleep(interval)
            now = time.perf_counter()
            self.samples.append(max(0.0, now - last - interval))
            last = now

    @property
    def p99_ms(self) -> float:
        """The 99th percentile lag in ms (0.0 without samples)."""
        ordered = sorted(self.samples)
        return ordered[int(len(ordered) * 0.99)] * 1e3 if ordered else 0.0

    @property
    def max_ms(self) -> float:
        """The largest lag seen, in ms."""
        return max(self.samples, default=0.0) * 1e3
