"""A tier actor's inbox: two bounded FIFO lanes, loads handed out before stores.

A load is on a request's critical path while a store only saves work for later, so
:meth:`Inbox.get` always takes the oldest queued load before any store. Each lane holds
at most ``max_size`` items; a full lane is back-pressure: :meth:`Inbox.put_nowait`
raises :class:`~tiering.errors.TierBusyError` and :meth:`Inbox.put` waits for room.

Closing stops admission at once (waiting putters raise
:class:`~tiering.errors.ClosedError`) while what is queued stays gettable, so a graceful
close drains it; :meth:`Inbox.get` returns ``None`` once the inbox is closed and empty.
Everything runs on one event loop; nothing here is thread-safe.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass
from typing import Generic, Literal, TypeVar

from tiering.errors import ClosedError, InvalidArgumentError, TierBusyError
from tiering.validation import positive_int

Lane = Literal["load", "store"]
_LANES: tuple[Lane, Lane] = ("load", "store")

_T = TypeVar("_T")


@dataclass(frozen=True, slots=True)
class InboxStatistics:
    """A snapshot of an :class:`Inbox` (as trio's memory channels report).

    ``queued_loads``/``queued_stores``: items in each lane now; ``max_size``: the bound of
    each lane; ``tasks_waiting_put``: :meth:`Inbox.put` calls waiting for room (both
    lanes); ``tasks_waiting_get``: :meth:`Inbox.get` calls waiting for an item.
    """

    queued_loads: int
    queued_stores: int
    max_size: int
    tasks_waiting_put: int
    tasks_waiting_get: int
    closed: bool


class Inbox(Generic[_T]):
    """Two bounded FIFO lanes (``"load"`` and ``"store"``) feeding one or more getters.

    Guarantees: items of one lane come out in the order they went in; a queued load
    always comes out before any queued store; a lane never holds more than ``max_size``
    items; a put that raises (or is cancelled while waiting) admits nothing.
    """

    def __init__(self, max_size: int, *, owner: str = "inbox") -> None:
        """Raises: InvalidArgumentError if ``max_size`` is not a positive int."""
        self.max_size = positive_int("max_size", max_size)
        self._owner = owner
        self._lanes: dict[Lane, deque[_T]] = {lane: deque() for lane in _LANES}
        self._putters: dict[Lane, deque[asyncio.Future[None]]] = {lane: deque() for lane in _LANES}
        self._getters: deque[asyncio.Future[None]] = deque()
        self._closed = False

    # -- putting ----------------------------------------------------------------------

    def put_nowait(self, lane: Lane, item: _T) -> None:
        """Queue ``item`` in ``lane`` now.

        Raises:
            InvalidArgumentError: ``lane`` is not ``"load"`` or ``"store"``.
            ClosedError: the inbox is closed.
            TierBusyError: the lane is full (or putters are already waiting for room in
                it: they go first).
        """
        queue = self._lane(lane)
        if self._closed:
            raise ClosedError(f"{self._owner}: inbox is closed; nothing more is admitted")
        if len(queue) >= self.max_size or self._putters[lane]:
            raise TierBusyError(
                f"{self._owner}: {lane} inbox is full ({self.max_size} jobs queued); "
                "drain get_finished() and retry"
            )
        self._append(lane, item)

    async def put(self, lane: Lane, item: _T) -> None:
        """Queue ``item`` in ``lane``, waiting for room if the lane is full.

        Waiting putters of a lane are admitted in arrival order. When this returns the
        item is queued; when it raises, nothing was admitted.

        Raises:
            InvalidArgumentError: ``lane`` is not ``"load"`` or ``"store"``.
            ClosedError: the inbox is closed, or closes while this waits.
            asyncio.CancelledError: the caller was cancelled while waiting.
        """
        queue = self._lane(lane)
        if self._closed:
            raise ClosedError(f"{self._owner}: inbox is closed; nothing more is admitted")
        putters = self._putters[lane]
        if len(queue) < self.max_size and not putters:
            self._append(lane, item)
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        putters.append(waiter)
        try:
            while True:
                await waiter
                if self._closed:
                    raise ClosedError(
                        f"{self._owner}: inbox closed while a {lane} job waited for room"
                    )
                if len(queue) < self.max_size:
                    break
                # Woken, but the room is gone (a drain raced it): wait again, first in line.
                putters.remove(waiter)
                waiter = asyncio.get_running_loop().create_future()
                putters.appendleft(waiter)
        except BaseException:
            # Pass a wake-up this waiter received but cannot use on to the next one.
            woken = waiter.done() and not waiter.cancelled()
            if waiter in putters:
                putters.remove(waiter)
            if woken:
                self._wake_putter(lane)
            raise
        putters.remove(waiter)
        self._append(lane, item)
        # Room may remain for the next waiter too.
        self._wake_putter(lane)

    # -- getting ----------------------------------------------------------------------

    def get_nowait(self) -> _T | None:
        """The oldest queued load, else the oldest queued store, else ``None``."""
        for lane in _LANES:
            queue = self._lanes[lane]
            if queue:
                item = queue.popleft()
                self._wake_putter(lane)
                return item
        return None

    async def get(self) -> _T | None:
        """Wait for and take the next item (loads first); ``None`` once closed and empty.

        Raises:
            asyncio.CancelledError: the caller was cancelled; nothing was taken.
        """
        while True:
            item = self.get_nowait()
            if item is not None or self._closed:
                return item
            waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._getters.append(waiter)
            try:
                await waiter
            except BaseException:
                woken = waiter.done() and not waiter.cancelled()
                if waiter in self._getters:
                    self._getters.remove(waiter)
                if woken:
                    self._wake_getter()
                raise

    def drain(self) -> list[_T]:
        """Take every queued item at once (loads first, each lane in order)."""
        items: list[_T] = []
        for lane in _LANES:
            items.extend(self._lanes[lane])
            self._lanes[lane].clear()
            self._wake_putter(lane)
        return items

    # -- closing and state ------------------------------------------------------------

    def close(self) -> None:
        """Admit nothing more; wake every waiter. Queued items stay gettable. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for lane in _LANES:
            for waiter in self._putters[lane]:
                if not waiter.done():
                    waiter.set_result(None)
        for waiter in self._getters:
            if not waiter.done():
                waiter.set_result(None)

    def statistics(self) -> InboxStatistics:
        """A snapshot of the lanes and the tasks waiting on them."""
        return InboxStatistics(
            queued_loads=len(self._lanes["load"]),
            queued_stores=len(self._lanes["store"]),
            max_size=self.max_size,
            tasks_waiting_put=sum(
                1 for lane in _LANES for w in self._putters[lane] if not w.done()
            ),
            tasks_waiting_get=sum(1 for w in self._getters if not w.done()),
            closed=self._closed,
        )

    def __repr__(self) -> str:
        s = self.statistics()
        return (
            f"Inbox({self._owner}: {s.queued_loads} loads, {s.queued_stores} stores queued "
            f"of {s.max_size} each; {s.tasks_waiting_put} putting, {s.tasks_waiting_get} "
            f"getting{'; closed' if s.closed else ''})"
        )

    # -- internals --------------------------------------------------------------------

    def _lane(self, lane: object) -> deque[_T]:
        if lane not in self._lanes:
            raise InvalidArgumentError(f"lane must be 'load' or 'store', got {lane!r}")
        return self._lanes[lane]  # type: ignore[index]

    def _append(self, lane: Lane, item: _T) -> None:
        self._lanes[lane].append(item)
        self._wake_getter()

    def _wake_putter(self, lane: Lane) -> None:
        putters = self._putters[lane]
        if len(self._lanes[lane]) >= self.max_size:
            return
        for waiter in putters:
            if not waiter.done():
                waiter.set_result(None)
                return

    def _wake_getter(self) -> None:
        for waiter in self._getters:
            if not waiter.done():
                waiter.set_result(None)
                return


__all__ = ["Inbox", "InboxStatistics", "Lane"]
