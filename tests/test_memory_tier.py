"""MemoryTier: byte-exact round trips, LRU eviction, pinning and concurrent jobs."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Sequence

import numpy as np
import pytest

from backends.memory import MemoryTier
from tiering.errors import InvalidArgumentError
from tiering.tiers.tier_api import JobMetadata, JobResult

BLOCK = 4096
SLOTS = 64


def _pool() -> memoryview:
    return memoryview(bytearray(SLOTS * BLOCK))


def _slot(view: memoryview, block_id: int) -> memoryview:
    return view[block_id * BLOCK : (block_id + 1) * BLOCK]


def _fill_random(view: memoryview, block_ids: Sequence[int]) -> list[bytes]:
    payloads = [os.urandom(BLOCK) for _ in block_ids]
    for block_id, payload in zip(block_ids, payloads, strict=True):
        _slot(view, block_id)[:] = payload
    return payloads


def _job(job_id: int, keys: Sequence[bytes], block_ids: Sequence[int]) -> JobMetadata:
    return JobMetadata(job_id, list(keys), list(block_ids))


async def _run(tier: MemoryTier, job: JobMetadata, *, load: bool) -> JobResult:
    (tier.submit_load if load else tier.submit_store)(job)
    async with asyncio.timeout(10):
        return await tier.result(job.job_id)


class GatedMemoryTier(MemoryTier):
    """Holds every load's copy on its io thread until ``load_gate`` is set."""

    def __init__(self, view: memoryview, block_bytes: int, **kwargs: int) -> None:
        super().__init__(view, block_bytes, **kwargs)
        self.load_entered = threading.Event()
        self.load_gate = threading.Event()

    def _copy(self, into: np.ndarray, source: np.ndarray, rows: Sequence[tuple[int, int]]) -> None:
        if into is self._pool:  # a load's copy
            self.load_entered.set()
            if not self.load_gate.wait(timeout=10):
                raise TimeoutError("test gate never opened")
        super()._copy(into, source, rows)


async def _wait_load_entered(tier: GatedMemoryTier) -> None:
    assert await asyncio.to_thread(tier.load_entered.wait, 10)


async def test_stored_blocks_load_back_byte_exact_into_other_slots() -> None:
    view = _pool()
    keys = [b"k%d" % i for i in range(4)]
    payloads = _fill_random(view, [0, 1, 2, 3])
    async with MemoryTier(view, BLOCK, max_blocks=8) as tier:
        assert await _run(tier, _job(1, keys, [0, 1, 2, 3]), load=False) == JobResult(1, True)
        view[:] = bytes(len(view))  # clobber the host pool
        targets = [40, 12, 63, 7]
        assert await _run(tier, _job(2, keys, targets), load=True) == JobResult(2, True)
    for target, payload in zip(targets, payloads, strict=True):
        assert bytes(_slot(view, target)) == payload


async def test_a_load_of_a_missing_key_fails_that_key_only_and_lands_the_others() -> None:
    view = _pool()
    payloads = _fill_random(view, [0, 1])
    async with MemoryTier(view, BLOCK, max_blocks=8) as tier:
        await _run(tier, _job(1, [b"a", b"b"], [0, 1]), load=False)
        _slot(view, 6)[:] = b"\x5a" * BLOCK
        result = await _run(tier, _job(2, [b"a", b"nope", b"b"], [5, 6, 7]), load=True)
    assert not result.success
    assert result.failed_keys == (b"nope",)
    assert bytes(_slot(view, 5)) == payloads[0]
    assert bytes(_slot(view, 7)) == payloads[1]
    assert bytes(_slot(view, 6)) == b"\x5a" * BLOCK


async def test_eviction_removes_the_least_recently_used_key() -> None:
    view = _pool()
    payloads = _fill_random(view, [0, 1, 2, 3])
    async with MemoryTier(view, BLOCK, max_blocks=3) as tier:
        await _run(tier, _job(1, [b"A", b"B", b"C"], [0, 1, 2]), load=False)
        tier.touch([b"A"])  # LRU order now B, C, A
        assert await _run(tier, _job(2, [b"D"], [3]), load=False) == JobResult(2, True)
        assert [tier.lookup(k) for k in (b"A", b"B", b"C", b"D")] == [True, False, True, True]
        assert tier.get_num_blocks() == 3
        view[:] = bytes(len(view))
        await _run(tier, _job(3, [b"A", b"C", b"D"], [10, 11, 12]), load=True)
    assert bytes(_slot(view, 10)) == payloads[0]
    assert bytes(_slot(view, 11)) == payloads[2]
    assert bytes(_slot(view, 12)) == payloads[3]


async def test_touch_makes_the_first_key_the_most_recent() -> None:
    view = _pool()
    _fill_random(view, range(5))
    async with MemoryTier(view, BLOCK, max_blocks=3) as tier:
        await _run(tier, _job(1, [b"A", b"B", b"C"], [0, 1, 2]), load=False)
        tier.touch([b"B", b"A", b"unknown"])  # LRU order now C, A, B
        await _run(tier, _job(2, [b"D"], [3]), load=False)
        assert tier.lookup(b"C") is False
        await _run(tier, _job(3, [b"E"], [4]), load=False)
        assert tier.lookup(b"A") is False
        assert tier.lookup(b"B") is True


async def test_lookup_is_none_while_a_store_is_pending_then_true() -> None:
    view = _pool()
    _fill_random(view, [0])
    async with MemoryTier(view, BLOCK) as tier:
        tier.submit_store(_job(1, [b"A"], [0]))
        assert tier.lookup(b"A") is None
        assert tier.lookup(b"other") is False
        await tier.result(1)
        assert tier.lookup(b"A") is True
        with pytest.raises(InvalidArgumentError, match="bytes"):
            tier.lookup("A")  # type: ignore[arg-type]


async def test_storing_a_key_already_held_keeps_the_first_bytes() -> None:
    view = _pool()
    first, second = _fill_random(view, [0, 1])
    async with MemoryTier(view, BLOCK) as tier:
        await _run(tier, _job(1, [b"A"], [0]), load=False)
        assert await _run(tier, _job(2, [b"A"], [1]), load=False) == JobResult(2, True)
        await _run(tier, _job(3, [b"A"], [2]), load=True)
        assert tier.get_num_blocks() == 1
    assert bytes(_slot(view, 2)) == first != second


async def test_a_key_repeated_in_one_store_job_keeps_its_first_slot() -> None:
    view = _pool()
    first, _ = _fill_random(view, [0, 1])
    async with MemoryTier(view, BLOCK) as tier:
        await _run(tier, _job(1, [b"A", b"A"], [0, 1]), load=False)
        await _run(tier, _job(2, [b"A"], [2]), load=True)
        assert tier.get_num_blocks() == 1
    assert bytes(_slot(view, 2)) == first


async def test_a_store_that_cannot_fit_stores_the_leading_keys_and_fails_the_rest() -> None:
    view = _pool()
    _fill_random(view, [0, 1, 2])
    async with MemoryTier(view, BLOCK, max_blocks=2) as tier:
        result = await _run(tier, _job(1, [b"A", b"B", b"C"], [0, 1, 2]), load=False)
        assert not result.success
        assert result.failed_keys == (b"C",)
        assert [tier.lookup(k) for k in (b"A", b"B", b"C")] == [True, True, False]


async def test_evicted_keys_are_reported_as_removals_once_asked_for() -> None:
    view = _pool()
    async with MemoryTier(view, BLOCK, max_blocks=2) as tier:
        await _run(tier, _job(1, [b"A", b"B"], [0, 1]), load=False)
        await _run(tier, _job(2, [b"C"], [2]), load=False)  # evicts A, unasked
        assert tier.take_removed() == []
        tier.report_removals()
        await _run(tier, _job(3, [b"D"], [3]), load=False)  # evicts B
        assert tier.take_removed() == [b"B"]


async def test_a_key_being_loaded_is_not_evicted_mid_copy() -> None:
    view = _pool()
    payloads = _fill_random(view, [0, 1, 2])
    async with GatedMemoryTier(view, BLOCK, max_blocks=2) as tier:
        try:
            await _run(tier, _job(1, [b"A", b"B"], [0, 1]), load=False)
            tier.submit_load(_job(2, [b"A"], [20]))  # A is the LRU key
            await _wait_load_entered(tier)
            assert await _run(tier, _job(3, [b"C"], [2]), load=False) == JobResult(3, True)
            assert [tier.lookup(k) for k in (b"A", b"B", b"C")] == [True, False, True]
        finally:
            tier.load_gate.set()
        assert await tier.result(2) == JobResult(2, True)
    assert bytes(_slot(view, 20)) == payloads[0]


async def test_a_store_fails_rather_than_evict_keys_being_loaded() -> None:
    view = _pool()
    payloads = _fill_random(view, [0, 1, 2])
    async with GatedMemoryTier(view, BLOCK, max_blocks=2) as tier:
        try:
            await _run(tier, _job(1, [b"A", b"B"], [0, 1]), load=False)
            tier.submit_load(_job(2, [b"A", b"B"], [20, 21]))
            await _wait_load_entered(tier)
            result = await _run(tier, _job(3, [b"C"], [2]), load=False)
            assert (result.success, result.failed_keys) == (False, (b"C",))
            assert tier.lookup(b"C") is False
        finally:
            tier.load_gate.set()
        assert await tier.result(2) == JobResult(2, True)
        assert await _run(tier, _job(4, [b"C"], [2]), load=False) == JobResult(4, True)
        assert tier.lookup(b"A") is False  # unpinned now, and the LRU key
    assert bytes(_slot(view, 20)) == payloads[0]
    assert bytes(_slot(view, 21)) == payloads[1]


async def test_clear_drops_every_block_but_not_rows_still_being_read() -> None:
    view = _pool()
    payloads = _fill_random(view, [0, 1, 2, 3])
    async with GatedMemoryTier(view, BLOCK, max_blocks=2) as tier:
        try:
            await _run(tier, _job(1, [b"A", b"B"], [0, 1]), load=False)
            tier.submit_load(_job(2, [b"A"], [20]))
            await _wait_load_entered(tier)
            tier.clear()
            assert tier.get_num_blocks() == 0
            assert tier.lookup(b"A") is False
            # Only B's row is free: A's row is still being read.
            result = await _run(tier, _job(3, [b"C", b"D"], [2, 3]), load=False)
            assert result.failed_keys == (b"D",)
        finally:
            tier.load_gate.set()
        assert await tier.result(2) == JobResult(2, True)
        assert await _run(tier, _job(4, [b"D"], [3]), load=False) == JobResult(4, True)
        assert tier.get_num_blocks() == 2
    assert bytes(_slot(view, 20)) == payloads[0]


async def test_concurrent_stores_and_loads_keep_every_block_intact() -> None:
    view = _pool()
    first_half = _fill_random(view, range(32))
    async with MemoryTier(view, BLOCK, max_blocks=64, max_inflight=4, io_threads=4) as tier:
        for j in range(8):
            tier.submit_store(
                _job(j, [b"a%d" % (4 * j + i) for i in range(4)], range(4 * j, 4 * j + 4))
            )
        assert all(r.success for r in [await tier.result(j) for j in range(8)])
        second_half = _fill_random(view, range(32, 64))
        # Loads of the first half (into slots 0..31, reversed) race stores of the second.
        for j in range(8):
            keys = [b"a%d" % (4 * j + i) for i in range(4)]
            tier.submit_load(_job(100 + j, keys, [31 - (4 * j + i) for i in range(4)]))
            keys = [b"b%d" % (4 * j + i) for i in range(4)]
            tier.submit_store(_job(200 + j, keys, range(32 + 4 * j, 36 + 4 * j)))
        async with asyncio.timeout(10):
            results = [await tier.result(j) for j in [*range(100, 108), *range(200, 208)]]
        assert all(r.success for r in results)
        view[32 * BLOCK :] = bytes(32 * BLOCK)
        for j in range(8):
            keys = [b"b%d" % (4 * j + i) for i in range(4)]
            tier.submit_load(_job(300 + j, keys, range(32 + 4 * j, 36 + 4 * j)))
        assert all(r.success for r in [await tier.result(300 + j) for j in range(8)])
        assert len({r.job_id for r in tier.get_finished()}) == 32
    for i in range(32):
        assert bytes(_slot(view, 31 - i)) == first_half[i]
        assert bytes(_slot(view, 32 + i)) == second_half[i]


async def test_memory_tier_reports_its_type_and_rejects_bad_sizes() -> None:
    assert MemoryTier.get_tier_type() == "memory"
    with pytest.raises(InvalidArgumentError, match="max_blocks"):
        MemoryTier(_pool(), BLOCK, max_blocks=0)
    with pytest.raises(InvalidArgumentError, match="max_inflight"):
        MemoryTier(_pool(), BLOCK, max_inflight=0)
    with pytest.raises(InvalidArgumentError, match="takes no option 'max_inflght'"):
        MemoryTier(_pool(), BLOCK, max_inflght=2)


# -- holds and usage ---------------------------------------------------------------------


async def test_a_held_key_is_never_evicted_until_released() -> None:
    view = _pool()
    _fill_random(view, range(6))
    a, b, c, d = b"A", b"B", b"C", b"D"
    async with MemoryTier(view, BLOCK, max_blocks=2) as tier:
        assert (await _run(tier, _job(1, [a, b], [0, 1]), load=False)).success
        tier.touch([b])  # A is now the least recently used: the natural victim
        tier.hold([a])
        assert (await _run(tier, _job(2, [c], [2]), load=False)).success
        assert tier.lookup(a) and not tier.lookup(b)  # B went, not A
        tier.hold([c])  # everything is held now: a store must fail rather than evict
        refused = await _run(tier, _job(3, [d], [3]), load=False)
        assert refused.failed_keys == (d,) and "memory tier full" in (refused.error or "")
        assert tier.statistics().failures == {"no room": 1}  # capacity's cause, as NVMe's
        assert tier.lookup(a) and tier.lookup(c)
        tier.release([a])
        assert (await _run(tier, _job(4, [d], [3]), load=False)).success
        assert not tier.lookup(a) and tier.lookup(c) and tier.lookup(d)
        tier.release([c])


async def test_a_hold_of_a_key_not_yet_stored_protects_it_once_stored() -> None:
    view = _pool()
    payloads = _fill_random(view, range(3))
    async with MemoryTier(view, BLOCK, max_blocks=2) as tier:
        tier.hold([b"A", b"A"])  # holds count
        assert (await _run(tier, _job(1, [b"A", b"B"], [0, 1]), load=False)).success
        assert (await _run(tier, _job(2, [b"C"], [2]), load=False)).success
        assert tier.lookup(b"A") and not tier.lookup(b"B")
        tier.release([b"A"])
        assert (await _run(tier, _job(3, [b"B"], [1]), load=False)).success
        assert tier.lookup(b"A") and not tier.lookup(b"C")  # still held once
        tier.release([b"A"])
        assert (await _run(tier, _job(4, [b"A"], [9]), load=True)).success
        assert bytes(_slot(view, 9)) == payloads[0]


async def test_releasing_more_than_held_names_the_key_and_releases_nothing() -> None:
    async with MemoryTier(_pool(), BLOCK, max_blocks=2) as tier:
        tier.hold([b"\x01\x02"])
        with pytest.raises(InvalidArgumentError, match="0102"):
            tier.release([b"\x01\x02", b"\x01\x02"])
        with pytest.raises(InvalidArgumentError, match="keys"):
            tier.hold(None)  # type: ignore[arg-type]
        tier.release([b"\x01\x02"])
        with pytest.raises(InvalidArgumentError, match="0102"):
            tier.release([b"\x01\x02"])


async def test_usage_counts_blocks_bytes_pins_and_failures_by_cause() -> None:
    view = _pool()
    _fill_random(view, range(4))
    async with GatedMemoryTier(view, BLOCK, max_blocks=3) as tier:
        assert (await _run(tier, _job(1, [b"a", b"b"], [0, 1]), load=False)).success
        tier.submit_load(_job(2, [b"a", b"x", b"y"], [10, 11, 12]))
        await _wait_load_entered(tier)
        tier.hold([b"b"])
        stats = tier.statistics()
        assert stats.used_blocks == 2 and stats.capacity_blocks == 3
        assert stats.used_bytes == 2 * BLOCK and stats.capacity_bytes == 3 * BLOCK
        assert stats.pinned_blocks == 2  # a being read, b held
        assert stats.jobs_in_flight == 1 and "2 pinned" in repr(tier)
        tier.load_gate.set()
        assert (await tier.result(2)).failed_keys == (b"x", b"y")
        tier.release([b"b"])
        stats = tier.statistics()
        assert stats.pinned_blocks == 0
        assert dict(stats.counters) == {
            "stored_blocks": 2,
            "loaded_blocks": 1,
            "evicted_blocks": 0,
        }
        assert dict(stats.failures) == {"not in the memory tier": 2}


async def test_failures_are_logged_once_per_cause(caplog: pytest.LogCaptureFixture) -> None:
    async with MemoryTier(_pool(), BLOCK, max_blocks=2) as tier:
        with caplog.at_level("WARNING", logger="backends.memory"):
            for job_id in range(3):
                await _run(tier, _job(job_id, [b"m1", b"m2"], [0, 1]), load=True)
    assert len([r for r in caplog.records if "not in the memory tier" in r.getMessage()]) == 1
    assert dict(tier.statistics().failures) == {"not in the memory tier": 6}


def test_memory_tier_takes_its_options_as_one_model_or_as_keywords() -> None:
    from backends.memory import MemoryOptions

    tier = MemoryTier(_pool(), BLOCK, MemoryOptions(max_blocks=3, max_inflight=2), max_blocks=5)
    assert (tier.max_blocks, tier.max_inflight) == (5, 2)  # the keywords win
    tier.shutdown()
    with pytest.raises(InvalidArgumentError, match=r"max_blocks = 2\.5"):
        MemoryTier(_pool(), BLOCK, max_blocks=2.5)
