"""The one lifecycle every long-lived object of kv-tiering goes through."""

from __future__ import annotations

import asyncio
import enum
from typing import Any, Self


class Lifecycle(enum.Enum):
    """Where an engine, tier or copier is in its life; only ever moves forward.
    ``CLOSING`` from the moment a close begins (nothing new is admitted), ``CLOSED`` once
    its work is answered and its threads and buffers are released."""

    NEW = "new"
    OPEN = "open"
    CLOSING = "closing"
    CLOSED = "closed"

    def __str__(self) -> str:
        return self.value


class AsyncService:
    """``async with`` for an object with ``start()`` and ``aclose()``: entering starts it,
    leaving closes it gracefully (whatever the block raised); ``state`` is its ``_state``."""

    _state: Lifecycle = Lifecycle.NEW

    @property
    def state(self) -> Lifecycle:
        return self._state

    @property
    def closed(self) -> bool:
        """True once closing or closed: it admits nothing new."""
        return self.state in (Lifecycle.CLOSING, Lifecycle.CLOSED)

    async def start(self) -> None:
        raise NotImplementedError

    async def aclose(self) -> Any:
        raise NotImplementedError

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


def running_loop() -> asyncio.AbstractEventLoop | None:
    """The event loop running in this thread, or None outside one."""
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
