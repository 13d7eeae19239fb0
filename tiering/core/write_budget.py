"""A tier's write budget (sans-I/O): a token bucket of blocks that refills at the budget's
rate on an injected clock. Over budget a tier admits fewer blocks; nothing ever waits on
the bucket, so the engine's calls never slow down for it."""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from tiering.validation import positive_int, real

BURST_S = 1.0
"""Seconds of budget the bucket holds at most (at least one block): what a quiet spell
saves up. Any window of ``T`` seconds then writes at most ``(T + BURST_S) * rate`` (a
minute: within 1.7 % of the budget), flushes aside."""


class WriteBudget:
    """At most ``bytes_per_s`` bytes a second written in blocks of ``block_bytes``,
    counted on ``clock`` (seconds, never going back; a step back counts as no time).
    Raises InvalidArgumentError for a budget that is not a positive number or a block
    size that is not a positive int."""

    def __init__(
        self,
        bytes_per_s: float,
        block_bytes: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        real("write_budget", bytes_per_s, "a positive finite number", lambda b: 0 < b < math.inf)
        positive_int("block_bytes", block_bytes)
        self.bytes_per_s = float(bytes_per_s)
        self.rate = self.bytes_per_s / block_bytes  # blocks per second
        self.capacity = max(1.0, self.rate * BURST_S)
        self.clock = clock
        self.tokens = self.capacity  # blocks it may write now; negative after a flush
        self._last = clock()

    def available(self) -> int:
        """Whole blocks the budget lets be written now."""
        self._refill()
        return int(self.tokens) if self.tokens >= 1 else 0

    def spend(self, blocks: int) -> None:
        """``blocks`` written: the bucket may go below zero (a flush writes past the
        budget), and then lets nothing be written until it has earned them back."""
        self.tokens -= blocks

    def _refill(self) -> None:
        now = self.clock()
        if now > self._last:
            self.tokens = min(self.capacity, self.tokens + (now - self._last) * self.rate)
        self._last = max(now, self._last)
