"""Inbox: two bounded FIFO lanes, loads first, back-pressure, cancellation and close."""

from __future__ import annotations

import asyncio

import pytest

from tiering.errors import ClosedError, InvalidArgumentError, TierBusyError
from tiering.tiers.inbox import Inbox, InboxStatistics


async def _spin(iterations: int = 10) -> None:
    for _ in range(iterations):
        await asyncio.sleep(0)


def test_loads_come_out_before_stores_and_each_lane_in_order() -> None:
    inbox: Inbox[str] = Inbox(4)
    for item in ("s1", "s2"):
        inbox.put_nowait("store", item)
    for item in ("l1", "l2"):
        inbox.put_nowait("load", item)
    assert [inbox.get_nowait() for _ in range(5)] == ["l1", "l2", "s1", "s2", None]


def test_a_full_lane_raises_tier_busy_and_leaves_the_other_lane_open() -> None:
    inbox: Inbox[int] = Inbox(2, owner="t")
    inbox.put_nowait("store", 1)
    inbox.put_nowait("store", 2)
    stats = inbox.statistics()
    assert (stats.queued_stores, stats.queued_loads, stats.max_size) == (2, 0, 2)
    with pytest.raises(TierBusyError, match="t: store inbox is full"):
        inbox.put_nowait("store", 3)
    inbox.put_nowait("load", 4)
    assert inbox.drain() == [4, 1, 2]
    stats = inbox.statistics()
    assert (stats.queued_stores, stats.queued_loads) == (0, 0)


@pytest.mark.parametrize("size", [0, -1, 1.5, True, "4"])
def test_a_bad_size_is_rejected(size: object) -> None:
    with pytest.raises(InvalidArgumentError, match="max_size"):
        Inbox(size)  # type: ignore[arg-type]


def test_an_unknown_lane_is_rejected_and_nothing_is_queued() -> None:
    inbox: Inbox[int] = Inbox(2)
    with pytest.raises(InvalidArgumentError, match="'copy'"):
        inbox.put_nowait("copy", 1)  # type: ignore[arg-type]
    stats = inbox.statistics()
    assert (stats.queued_loads, stats.queued_stores) == (0, 0)


async def test_put_waits_for_room_and_waiting_putters_are_admitted_in_order() -> None:
    inbox: Inbox[int] = Inbox(1)
    inbox.put_nowait("store", 0)
    puts = [asyncio.create_task(inbox.put("store", i)) for i in (1, 2, 3)]
    await _spin()
    assert not any(p.done() for p in puts)
    assert inbox.statistics().tasks_waiting_put == 3
    # A non-blocking put may not jump the queue of waiting putters.
    inbox.get_nowait()
    with pytest.raises(TierBusyError):
        inbox.put_nowait("store", 99)
    got = []
    for _ in range(3):
        await _spin()
        got.append(inbox.get_nowait())
    await _spin()
    got.append(inbox.get_nowait())
    assert got == [1, 2, 3, None]
    assert all(p.done() and p.exception() is None for p in puts)


async def test_a_cancelled_put_admits_nothing_and_passes_room_on() -> None:
    inbox: Inbox[int] = Inbox(1)
    inbox.put_nowait("load", 0)
    first = asyncio.create_task(inbox.put("load", 1))
    second = asyncio.create_task(inbox.put("load", 2))
    await _spin()
    assert inbox.get_nowait() == 0  # wakes `first`...
    first.cancel()  # ...which is cancelled before it can use the room
    with pytest.raises(asyncio.CancelledError):
        await first
    async with asyncio.timeout(5):
        await second
    assert inbox.drain() == [2]
    assert inbox.statistics().tasks_waiting_put == 0


async def test_room_that_appears_as_a_cancelled_putter_unwinds_goes_to_the_next_one() -> None:
    inbox: Inbox[int] = Inbox(1)
    inbox.put_nowait("store", 0)
    first = asyncio.create_task(inbox.put("store", 1))
    second = asyncio.create_task(inbox.put("store", 2))
    await _spin()
    first.cancel()  # its waiter is cancelled now; the task unwinds on its next step
    assert inbox.get_nowait() == 0  # the room appears before `first` has left the line
    async with asyncio.timeout(5):
        await second
    assert first.cancelled() and inbox.drain() == [2]


async def test_unpark_leaves_a_waiting_putter_in_line() -> None:
    inbox: Inbox[int] = Inbox(1)
    inbox.put_nowait("store", 0)
    putter = asyncio.create_task(inbox.put("store", 1))
    await _spin()
    assert not inbox.park("store", 2)
    assert inbox.unpark() == [2]
    assert inbox.get_nowait() == 0
    async with asyncio.timeout(5):
        await putter
    assert inbox.get_nowait() == 1
    inbox.put_nowait("store", 3)  # the lane is empty and nobody waits: room at once
    assert inbox.drain() == [3] and inbox.statistics().tasks_waiting_put == 0


async def test_close_fails_waiting_putters_but_keeps_queued_items_gettable() -> None:
    inbox: Inbox[int] = Inbox(1)
    inbox.put_nowait("store", 1)
    put = asyncio.create_task(inbox.put("store", 2))
    await _spin()
    inbox.close()
    with pytest.raises(ClosedError, match="closed while a store job waited"):
        await put
    with pytest.raises(ClosedError):
        inbox.put_nowait("load", 3)
    with pytest.raises(ClosedError):
        await inbox.put("load", 3)
    assert inbox.get_nowait() == 1
    assert inbox.get_nowait() is None
    inbox.close()  # idempotent
    assert inbox.statistics().closed


def test_statistics_is_a_frozen_snapshot() -> None:
    inbox: Inbox[int] = Inbox(3)
    inbox.put_nowait("load", 1)
    inbox.put_nowait("store", 2)
    inbox.put_nowait("store", 3)
    stats = inbox.statistics()
    assert stats == InboxStatistics(
        queued_loads=1,
        queued_stores=2,
        max_size=3,
        tasks_waiting_put=0,
        closed=False,
    )
    inbox.get_nowait()
    assert stats.queued_loads == 1
    with pytest.raises(AttributeError):
        stats.queued_loads = 0  # type: ignore[misc]
    assert "1 loads" not in repr(inbox) and "2 stores" in repr(inbox)


def test_parked_items_are_queued_in_order_as_room_appears_and_unpark_takes_the_rest() -> None:
    inbox: Inbox[int] = Inbox(1)
    assert inbox.park("store", 1)
    assert not inbox.park("store", 2)
    assert not inbox.park("store", 3)
    assert inbox.statistics().parked == 2
    with pytest.raises(TierBusyError):
        inbox.put_nowait("store", 9)  # parked items keep their turn
    assert inbox.get_nowait() == 1  # its room goes to 2
    assert (inbox.statistics().queued_stores, inbox.statistics().parked) == (1, 1)
    inbox.close()
    with pytest.raises(ClosedError):
        inbox.park("load", 4)
    assert inbox.unpark() == [3]
    assert [inbox.get_nowait(), inbox.get_nowait()] == [2, None]
