"""A tier's inbox (docs/architecture.md#tiers-are-actors). One event loop; not thread-safe."""

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
    """A snapshot of an :class:`Inbox`, as trio's memory channels report."""

    queued_loads: int
    queued_stores: int
    max_size: int
    tasks_waiting_put: int
    closed: bool
    parked: int = 0


@dataclass(slots=True)
class _Parked(Generic[_T]):
    item: _T


class Inbox(Generic[_T]):
    """Two bounded FIFO lanes (``"load"`` and ``"store"``): a lane's items come out of
    :meth:`get_nowait` in the order queued, loads (on a request's critical path) before
    any store; a lane never holds more than ``max_size``; a put that raises (or is
    cancelled) admits nothing. When a lane is full, :meth:`put_nowait` raises, :meth:`put`
    waits and :meth:`park` leaves the item in line, queued as room appears. Closing stops
    admission; queued and parked items stay gettable."""

    def __init__(self, max_size: int, *, owner: str = "inbox") -> None:
        """Raises: InvalidArgumentError if ``max_size`` is not a positive int."""
        self.max_size = positive_int("max_size", max_size)
        self._owner = owner
        self._lanes: dict[Lane, deque[_T]] = {lane: deque() for lane in _LANES}
        # Who waits for room in each lane, in order: putters' futures and parked items.
        self._waiting: dict[Lane, deque[asyncio.Future[None] | _Parked[_T]]] = {
            lane: deque() for lane in _LANES
        }
        self.closed = False
        """Whether :meth:`close` was called."""

    def put_nowait(self, lane: Lane, item: _T) -> None:
        """Queue ``item`` in ``lane`` now. Raises InvalidArgumentError for an unknown
        lane, ClosedError once closed, TierBusyError if the lane is full (or others
        already wait for room in it)."""
        if not self._queued(lane, item):
            raise TierBusyError(
                f"{self._owner}: {lane} inbox is full ({self.max_size} jobs queued); "
                "drain get_finished() and retry"
            )

    def park(self, lane: Lane, item: _T) -> bool:
        """Queue ``item`` now if ``lane`` has room (then True), else park it in the lane's
        waiting line. Raises as :meth:`put_nowait`, never TierBusyError."""
        if self._queued(lane, item):
            return True
        self._waiting[lane].append(_Parked(item))
        return False

    async def put(self, lane: Lane, item: _T) -> None:
        """Queue ``item`` in ``lane``, waiting in line for room if the lane is full.
        Raises as :meth:`put_nowait` (ClosedError also if the inbox closes meanwhile),
        never TierBusyError."""
        if self._queued(lane, item):
            return
        waiting = self._waiting[lane]
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        waiting.append(waiter)
        try:
            # Woken in line order by _admit_waiting, which keeps the room for every woken
            # putter until it runs (or by close).
            await waiter
            if self.closed:
                raise ClosedError(f"{self._owner}: inbox closed while a {lane} job waited for room")
        except BaseException:
            # Pass a wake-up this waiter received but cannot use on to the next one.
            woken = waiter.done() and not waiter.cancelled()
            if waiter in waiting:
                waiting.remove(waiter)
            if woken:
                self._admit_waiting(lane)
            raise
        waiting.remove(waiter)
        self._lanes[lane].append(item)
        self._admit_waiting(lane)  # room may remain for the next in line too

    def get_nowait(self) -> _T | None:
        """The oldest queued load, else the oldest queued store, else ``None``."""
        for lane in _LANES:
            queue = self._lanes[lane]
            if queue:
                item = queue.popleft()
                self._admit_waiting(lane)
                return item
        return None

    def drain(self) -> list[_T]:
        """Take every queued item (loads first, each lane in order); parked items move up
        into the room."""
        items: list[_T] = []
        for lane in _LANES:
            items.extend(self._lanes[lane])
            self._lanes[lane].clear()
            self._admit_waiting(lane)
        return items

    def unpark(self) -> list[_T]:
        """Take every parked item (loads first, each lane in order); none gets queued."""
        items: list[_T] = []
        for lane in _LANES:
            waiting = self._waiting[lane]  # in place: a waiting put() holds this line
            parked = [entry for entry in waiting if isinstance(entry, _Parked)]
            for entry in parked:
                waiting.remove(entry)
            items.extend(entry.item for entry in parked)
        return items

    def close(self) -> None:
        """Admit nothing more; wake every waiting putter. Queued and parked items stay
        gettable. Idempotent."""
        if self.closed:
            return
        self.closed = True
        for lane in _LANES:
            for waiter in self._waiting[lane]:
                if isinstance(waiter, asyncio.Future) and not waiter.done():
                    waiter.set_result(None)

    def statistics(self) -> InboxStatistics:
        waiting = [w for lane in _LANES for w in self._waiting[lane]]
        return InboxStatistics(
            queued_loads=len(self._lanes["load"]),
            queued_stores=len(self._lanes["store"]),
            max_size=self.max_size,
            tasks_waiting_put=sum(isinstance(w, asyncio.Future) and not w.done() for w in waiting),
            closed=self.closed,
            parked=sum(isinstance(w, _Parked) for w in waiting),
        )

    def __repr__(self) -> str:
        s = self.statistics()
        return (
            f"Inbox({self._owner}: {s.queued_loads} loads, {s.queued_stores} stores queued "
            f"of {s.max_size} each, {s.parked} parked; {s.tasks_waiting_put} putting"
            f"{'; closed' if s.closed else ''})"
        )

    def _queued(self, lane: Lane, item: _T) -> bool:
        """Queue ``item`` if ``lane`` has room and nobody waits for it; whether it did."""
        if lane not in self._lanes:
            raise InvalidArgumentError(f"lane must be 'load' or 'store', got {lane!r}")
        if self.closed:
            raise ClosedError(f"{self._owner}: inbox is closed; nothing more is admitted")
        if len(self._lanes[lane]) >= self.max_size or self._waiting[lane]:
            return False
        self._lanes[lane].append(item)
        return True

    def _admit_waiting(self, lane: Lane) -> None:
        """Give the room in ``lane`` to those waiting, in order: queue parked items, wake
        the first putter not woken yet (a woken putter takes its room when it runs)."""
        waiting, queue = self._waiting[lane], self._lanes[lane]
        room = self.max_size - len(queue)
        i = 0
        while room > 0 and i < len(waiting):
            entry = waiting[i]
            if isinstance(entry, _Parked):
                del waiting[i]
                queue.append(entry.item)
            elif entry.cancelled():  # its putter leaves the line as it unwinds: no room
                i += 1
                continue
            elif not entry.done():
                entry.set_result(None)
                return
            else:
                i += 1
            room -= 1
