"""TieringEngine end to end on CPU tensors: real bytes through real tiers.

Shared helpers (hashes, the device KV cache, block contents, gated tiers, settling) come
from :mod:`tests._engine_helpers`, as in the acceptance tests of issue 7.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import random
import threading
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest
import torch

from backends.example import ExampleSecondaryTier
from tests._engine_helpers import (
    DEVICE_BLOCKS,
    KeyGatedMemoryTier,
    assert_holds,
    assert_no_leaks,
    corrupt_block,
    h,
    holds,
    key_gated,
    make_kv,
    nvme_spec,
    put,
    result_of,
    settle,
    wipe,
)
from tests._faults import FaultInjector
from tiering import (
    BlockNotFoundError,
    ClosedError,
    JobMetadata,
    JobResult,
    OffloadingEvent,
    TieringEngine,
)
from tiering.core.policies import LRUPolicy
from tiering.lifecycle import Lifecycle
from tiering.tiers.block_record import HEADER_BYTES


def rows(kv: list[torch.Tensor], ids: list[int]) -> list[torch.Tensor]:
    """A copy of device blocks ``ids`` of every layer (what a load must bring back)."""
    return [layer[ids].clone() for layer in kv]


def assert_rows(kv: list[torch.Tensor], ids: list[int], expected: list[torch.Tensor]) -> None:
    for layer, want in zip(kv, expected, strict=True):
        assert torch.equal(layer[ids], want)


@contextlib.asynccontextmanager
async def leak_checked(
    kv: list[torch.Tensor], num_cpu_blocks: int, **options: Any
) -> AsyncIterator[TieringEngine]:
    """An open engine that must settle with no job, pin or fill left once the body ends."""
    async with TieringEngine(kv, num_cpu_blocks, **options) as engine:
        yield engine
        await settle(engine)
        assert_no_leaks(engine)


class FailingMemoryTier(KeyGatedMemoryTier):
    """A memory tier whose load hook raises while ``fail_loads`` is set."""

    fail_loads = False

    async def _do_load(self, job: JobMetadata) -> JobResult:
        if self.fail_loads:
            raise OSError("injected tier fault")
        return await super()._do_load(job)


async def store_and_evict(engine: TieringEngine, keys: list[bytes], ids: list[int]) -> None:
    """Store ``keys`` through every tier, then push them out of the CPU tier."""
    job = engine.store(keys, ids)
    assert (await job).success and await job.cascaded
    filler = [h(1000 + i) for i in range(engine.manager.num_blocks)]
    job = engine.store(filler, list(range(len(filler))))
    assert (await job).success and await job.cascaded
    assert engine.manager.lookup(keys) == 0


# ------------------------------------------------------------------ round trips


async def test_store_then_load_from_cpu_is_byte_exact() -> None:
    kv = make_kv()
    async with leak_checked(kv, 8) as engine:
        expected = rows(kv, [0, 1, 2])
        result = await engine.store([h(1), h(2), h(3)], [0, 1, 2])
        assert result.success
        assert engine.lookup([h(1), h(2), h(3), h(4)]) == 3
        result = await engine.load([h(1), h(2), h(3)], [10, 11, 12])
        assert result.success
        assert_rows(kv, [10, 11, 12], expected)
        assert_no_leaks(engine)  # at once: a load's pins end with its copy


@pytest.mark.parametrize("tier", ["memory", "nvme"])
async def test_round_trip_after_cpu_eviction_is_byte_exact(tier: str, tmp_path) -> None:
    kv = make_kv(1)
    spec = nvme_spec(tmp_path) if tier == "nvme" else {"type": "memory"}
    keys, ids = [h(i) for i in range(3)], [20, 21, 22]
    expected = rows(kv, ids)
    async with leak_checked(kv, 4, secondary_tiers=[spec]) as engine:
        await store_and_evict(engine, keys, ids)
        wipe(kv, ids)
        assert engine.lookup(keys) == 3
        result = await engine.load(keys, [25, 26, 27])
        assert result.success
        assert_rows(kv, [25, 26, 27], expected)
        assert engine.statistics().counters["promoted_blocks"] == 3
        assert engine.manager.lookup(keys) == 3  # promoted into CPU


async def test_write_through_cascades_every_stored_block() -> None:
    factory, made = key_gated()
    async with leak_checked(make_kv(), 8, secondary_tiers=[factory]) as engine:
        job = engine.store([h(1), h(2)], [0, 1])
        await job
        assert await job.cascaded
        assert made[0].lookup(h(1)) and made[0].lookup(h(2))


async def test_write_through_blocks_reach_the_tier_before_they_can_be_evicted() -> None:
    factory, made = key_gated()
    async with leak_checked(make_kv(16), 2, secondary_tiers=[factory]) as engine:
        first = engine.store([h(2), h(3)], [0, 1])
        assert (await first).success  # ready in CPU; its cascade has not run yet
        second = engine.store([h(4)], [2])  # needs a slot: must not take h2's or h3's
        assert (await second).success
        assert await first.cascaded and await second.cascaded
        assert all(made[0].lookup(h(i)) for i in (2, 3, 4))


async def test_write_back_cascades_only_on_eviction_and_data_survives() -> None:
    kv = make_kv(2)
    factory, made = key_gated()
    async with leak_checked(kv, 2, secondary_tiers=[factory], write_policy="write_back") as engine:
        expected = rows(kv, [0, 1])
        job = engine.store([h(1), h(2)], [0, 1])
        assert (await job).success and await job.cascaded
        assert not made[0].lookup(h(1)), "write-back must not cascade at store time"
        assert (await engine.store([h(3), h(4)], [2, 3])).success  # evicts h1, h2
        assert made[0].lookup(h(1)) and made[0].lookup(h(2))
        assert engine.statistics().counters["written_back_blocks"] == 2
        wipe(kv, [0, 1])
        assert (await engine.load([h(1), h(2)], [5, 6])).success
        assert_rows(kv, [5, 6], expected)


async def test_concurrent_loads_promote_a_block_once() -> None:
    kv = make_kv(3)
    factory, made = key_gated()
    async with leak_checked(kv, 2, secondary_tiers=[factory]) as engine:
        expected = rows(kv, [0])
        await store_and_evict(engine, [h(1)], [0])
        gate = made[0].gate(h(1))
        first = engine.load([h(1)], [10])
        second = engine.load([h(1)], [11])
        await asyncio.sleep(0.01)
        gate.set()
        assert (await first).success and (await second).success
        assert made[0].loading == [[h(1)]]
        assert_rows(kv, [10], expected)
        assert_rows(kv, [11], expected)


async def test_a_load_waits_for_a_store_in_flight_of_the_same_block() -> None:
    kv = make_kv(4)
    async with leak_checked(kv, 4) as engine:
        expected = rows(kv, [3])
        store = engine.store([h(1)], [3])
        load = engine.load([h(1)], [9])  # the block is not ready yet
        assert (await store).success
        assert (await load).success
        assert_rows(kv, [9], expected)
        assert_no_leaks(engine)


# ------------------------------------------------------------------ cancellation


@pytest.mark.parametrize("ticks", [0, 1, 2, 3, 5, 8])
async def test_cancelling_an_awaiter_leaks_no_pin_or_slot(ticks: int) -> None:
    kv = make_kv(5)
    async with leak_checked(kv, 3, secondary_tiers=[{"type": "memory"}]) as engine:
        expected = rows(kv, [0, 1])
        await store_and_evict(engine, [h(1), h(2)], [0, 1])

        job = engine.load([h(1), h(2)], [20, 21])
        task = asyncio.create_task(result_of(job))
        for _ in range(ticks):
            await asyncio.sleep(0)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):  # it may have finished first
            await task
        await settle(engine)
        assert_no_leaks(engine)
        # The job itself ran to completion: the bytes landed.
        assert_rows(kv, [20, 21], expected)
        results = engine.get_finished()
        assert results[-1].success


async def test_cancelling_a_store_awaiter_still_completes_the_store() -> None:
    kv = make_kv(6)
    async with leak_checked(kv, 4) as engine:
        expected = rows(kv, [1])
        # Hold the copy workers so the store is certainly in flight when we cancel.
        gate = threading.Event()
        backend = engine._copier.backend
        for _ in range(backend.max_workers):
            backend.executor.submit(gate.wait)
        job = engine.store([h(2)], [1])
        waiter = asyncio.create_task(result_of(job))
        await asyncio.sleep(0.01)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert not job.done()
        gate.set()
        await settle(engine)
        assert job.done() and job.result().success
        wipe(kv, [1])
        assert (await engine.load([h(2)], [7])).success
        assert_rows(kv, [7], expected)


# -------------------------------------------------------------------- faults


async def test_a_tier_that_raises_fails_that_load_only() -> None:
    made: list[FailingMemoryTier] = []

    def factory(view: memoryview, block_bytes: int) -> FailingMemoryTier:
        made.append(FailingMemoryTier(view, block_bytes))
        return made[-1]

    async with leak_checked(make_kv(7), 2, secondary_tiers=[factory]) as engine:
        await store_and_evict(engine, [h(1)], [0])
        made[0].fail_loads = True
        result = await engine.load([h(1)], [10])
        assert not result.success and result.failed_keys == (h(1),)
        assert "injected tier fault" in result.error
        await settle(engine)
        assert_no_leaks(engine)
        assert engine.manager.lookup([h(1)]) == 0  # the failed promotion left nothing behind
        made[0].fail_loads = False
        assert (await engine.load([h(1)], [11])).success
        assert (await engine.store([h(9)], [5])).success


async def test_a_full_tier_inbox_is_back_pressure_not_failure() -> None:
    factory, made = key_gated(inbox_size=1, max_inflight=1)
    async with leak_checked(make_kv(8), 16, secondary_tiers=[factory]) as engine:
        made[0].store_gate.clear()
        jobs = [engine.store([h(i)], [i]) for i in range(6)]
        for job in jobs:
            assert (await job).success
        await asyncio.sleep(0.01)
        made[0].store_gate.set()
        assert all([await job.cascaded for job in jobs])
        assert all(made[0].lookup(h(i)) for i in range(6))


async def test_close_with_jobs_in_flight_reports_them_failed() -> None:
    factory, made = key_gated()
    engine = TieringEngine(make_kv(9), 2, secondary_tiers=[factory], close_timeout=0.05)
    async with engine:
        await store_and_evict(engine, [h(1)], [0])
        made[0].gate(h(1))
        load = engine.load([h(1)], [10])
    result = await load
    assert not result.success
    with pytest.raises(ClosedError):
        engine.store([h(5)], [5])


# -------------------------------------------------------------------- bad input


async def test_a_load_of_a_block_no_tier_holds_raises_and_changes_nothing() -> None:
    # Every other bad input: tests/test_engine_input.py.
    async with TieringEngine(make_kv(), 4, secondary_tiers=[{"type": "memory"}]) as engine:
        await engine.store([h(1)], [0]).cascaded
        with pytest.raises(BlockNotFoundError):
            engine.load([h(1), h(77)], [2, 3])
        assert len(engine.manager) == 1 and engine.manager.num_pinned == 0
        assert len(engine.get_finished()) == 1  # only the store finished


async def test_use_after_close_raises_closed_error() -> None:
    engine = TieringEngine(make_kv(), 4)
    with pytest.raises(ClosedError):
        engine.lookup([h(1)])
    async with engine:
        pass
    with pytest.raises(ClosedError):
        engine.load([h(1)], [0])


# ------------------------------------------------------------------ reporting


async def test_get_finished_reports_every_job_once() -> None:
    async with leak_checked(make_kv(), 4) as engine:
        a = engine.store([h(1)], [0])
        b = engine.store([h(2)], [1])
        await a
        await b
        await (load := engine.load([h(1)], [5]))
        ids = [r.job_id for r in engine.get_finished()]
        assert sorted(ids) == sorted([a.job_id, b.job_id, load.job_id])
        assert engine.get_finished() == []


async def test_events_name_the_medium_of_each_tier() -> None:
    tiers = [{"type": "memory"}]
    async with leak_checked(make_kv(), 1, secondary_tiers=tiers, enable_events=True) as engine:
        job = engine.store([h(1)], [0])
        await job
        await job.cascaded
        await engine.store([h(2)], [1])
        events = [(e.medium, e.removed, e.block_hashes) for e in engine.take_events()]
        assert ("CPU", False, [h(1)]) in events
        assert ("CPU", True, [h(1)]) in events
        assert ("MEMORY", False, [h(1)]) in events


async def test_the_seed_example_tier_works_through_the_polling_path() -> None:
    made: list[ExampleSecondaryTier] = []

    def factory(view: memoryview, block_bytes: int) -> ExampleSecondaryTier:
        made.append(ExampleSecondaryTier(view, block_bytes, simulate_async=True))
        return made[0]

    async with leak_checked(make_kv(), 2, secondary_tiers=[factory]) as engine:
        job = engine.store([h(1), h(2)], [0, 1])
        await job
        assert await job.cascaded
        assert made[0].lookup(h(1)) and made[0].get_num_blocks() == 2
        await engine.store([h(3), h(4)], [2, 3])  # h1, h2 leave the CPU tier
        # The example tier records presence only: loading from it would serve garbage.
        assert engine.lookup([h(1)]) == 0
        with pytest.raises(BlockNotFoundError):
            engine.load([h(1)], [9])


# ------------------------------------------------------------ with the NVMe tier


@pytest.mark.parametrize("write_policy", ["write_through", "write_back"])
async def test_a_restarted_engine_finds_its_nvme_blocks(write_policy: str, tmp_path) -> None:
    """Write-through cascades at store time; write-back's graceful close flushes."""
    kv = make_kv(11)
    expected = rows(kv, [3, 4])
    options = {"secondary_tiers": [nvme_spec(tmp_path)], "cache_identity": "model-a"}
    async with TieringEngine(kv, 4, write_policy=write_policy, **options) as engine:
        job = engine.store([h(1), h(2)], [3, 4])
        assert (await job).success and await job.cascaded
        if write_policy == "write_back":
            assert engine.tiers[0].lookup(h(1)) is not True  # not cascaded yet
    wipe(kv, [3, 4])
    async with TieringEngine(kv, 4, **options) as engine:
        assert engine.lookup([h(1), h(2)]) == 2
        assert (await engine.load([h(1), h(2)], [8, 9])).success
        assert_rows(kv, [8, 9], expected)


async def test_another_model_never_sees_the_blocks(tmp_path) -> None:
    kv = make_kv(12)
    spec = nvme_spec(tmp_path)
    async with TieringEngine(kv, 4, secondary_tiers=[spec], cache_identity="model-a") as engine:
        await engine.store([h(1)], [0]).cascaded
    async with TieringEngine(kv, 4, secondary_tiers=[spec], cache_identity="model-b") as engine:
        assert engine.lookup([h(1)]) == 0
        with pytest.raises(BlockNotFoundError):
            engine.load([h(1)], [5])


async def test_a_corrupted_nvme_block_is_a_failed_key_never_served(tmp_path) -> None:
    kv = make_kv(13)
    async with leak_checked(kv, 4, secondary_tiers=[nvme_spec(tmp_path)]) as engine:
        await store_and_evict(engine, [h(1), h(2)], [0, 1])
        for key in (h(1), h(2)):  # every stored copy's checksum stops matching
            corrupt_block(tmp_path, key)
        before = rows(kv, [10, 11])
        result = await engine.load([h(1), h(2)], [10, 11])
        assert not result.success and set(result.failed_keys) == {h(1), h(2)}
        assert_rows(kv, [10, 11], before)  # nothing was written to the device
        assert engine.lookup([h(1)]) == 0  # a miss from now on, not an endless retry


def test_the_namespace_covers_identity_and_layout() -> None:
    a = TieringEngine(make_kv(), 4, cache_identity="m")
    b = TieringEngine(make_kv(), 4, cache_identity="n")
    c = TieringEngine(make_kv(), 4, cache_identity="m", block_size=32)
    assert len({a.namespace, b.namespace, c.namespace}) == 3
    assert '"float16"' in a.namespace


async def test_close_cancels_jobs_that_started_while_closing() -> None:
    factory, made = key_gated()
    engine = TieringEngine(make_kv(14), 1, secondary_tiers=[factory], close_timeout=0.05)
    async with engine:
        made[0].store_gate.clear()
        first = engine.store([h(1)], [0])  # its cascade holds the only CPU slot
        await first
        second = engine.store([h(2)], [1])  # waits for room, then starts during the close
    assert (await first).success
    assert not await first.cascaded
    assert not (await second).success


async def test_hard_close_then_leaving_the_block_releases_everything() -> None:
    factory, made = key_gated()
    engine = TieringEngine(make_kv(15), 2, secondary_tiers=[factory], close_timeout=0.05)
    async with engine:
        made[0].store_gate.clear()
        job = engine.store([h(1)], [0])
        engine.close()
        engine.close()  # idempotent
        with pytest.raises(ClosedError):
            engine.store([h(2)], [1])
    assert job.done() and not await job.cascaded
    assert engine.state is Lifecycle.CLOSED
    with pytest.raises(ClosedError):
        _ = engine.host_pool


# ------------------------------------------------------- randomized concurrency


@pytest.mark.parametrize("write_policy", ["write_through", "write_back"])
@pytest.mark.parametrize("seed", range(4))
async def test_random_concurrent_jobs_never_serve_wrong_bytes(write_policy: str, seed: int) -> None:
    """Rounds of concurrent stores and loads over a small CPU tier and a memory tier.

    Stores read device blocks holding their key's rows; loads write other device
    blocks (wiped first). Every key a load reports as landed must hold exactly its
    key's rows; at the end no pin, fill or waiter is left.
    """
    rng = random.Random(seed)
    kv = make_kv(seed)
    tiers = [{"type": "memory", "max_blocks": 12}]
    async with leak_checked(kv, 5, secondary_tiers=tiers, write_policy=write_policy) as engine:
        for _ in range(25):
            blocks = list(range(DEVICE_BLOCKS))
            rng.shuffle(blocks)
            jobs = []
            for _ in range(rng.randint(1, 4)):
                keys = list(dict.fromkeys(h(rng.randrange(24)) for _ in range(rng.randint(1, 3))))
                if rng.random() < 0.4:
                    ids = [blocks.pop() for _ in keys]
                    put(kv, keys, ids)
                    jobs.append(("store", engine.store(keys, ids), keys, ids))
                else:
                    keys = keys[: engine.lookup(keys)]
                    if keys:
                        ids = [blocks.pop() for _ in keys]
                        wipe(kv, ids)
                        jobs.append(("load", engine.load(keys, ids), keys, ids))
            for kind, job, keys, ids in jobs:
                result = await job
                if kind == "load":
                    for k, i in zip(keys, ids, strict=True):
                        if k not in result.failed_keys:
                            assert holds(kv, k, i), f"wrong bytes for {k.hex()}"
        await settle(engine)
        landed = engine.statistics().counters["bytes_to_device"]
        assert landed > 0, "no load landed: the test checked nothing"


async def test_flush_copies_what_a_tier_lacks() -> None:
    factory, made = key_gated()
    kv = make_kv(18)
    async with leak_checked(kv, 4, secondary_tiers=[factory], write_policy="write_back") as engine:
        await engine.store([h(1), h(2)], [0, 1])
        assert not made[0].lookup(h(1))
        assert await engine.flush()
        assert made[0].lookup(h(1)) and made[0].lookup(h(2))
        assert_no_leaks(engine)  # at once: the flush's pins ended with its tier jobs


class _SecondSight(LRUPolicy):
    """LRU admitting only blocks that an earlier request named too (the second sight that
    ``adaptive`` follows when its shadow leads, here always)."""

    def __init__(self) -> None:
        super().__init__()
        self.requests: Counter[bytes] = Counter()

    def touch(self, keys: Sequence[bytes]) -> None:
        self.requests.update(keys)
        super().touch(keys)

    def admit(self, key: bytes) -> bool:
        return self.requests[key] >= 2


async def test_a_block_the_policy_declines_is_not_stored_and_the_store_succeeds() -> None:
    kv = make_kv()
    async with TieringEngine(kv, 8, policy=_SecondSight()) as engine:
        seen, first_time = [h(1), h(2)], [h(3)]
        put(kv, seen + first_time, [0, 1, 2])
        engine.touch(seen)
        engine.touch(seen + first_time)  # 1 and 2 requested before; 3 never
        result = await engine.store(seen + first_time, [0, 1, 2])
        assert result.success and result.failed_keys == ()
        assert engine.lookup(seen + first_time) == 2  # 3 was not admitted
        assert engine.statistics().counters["declined_blocks"] == 1
        assert (await engine.load(seen, [5, 6])).success
        assert_holds(kv, seen, [5, 6])


# -------------------------------------- write-back over a small NVMe cap (issue 24)

RECORD = HEADER_BYTES + 4096
"""A make_kv block (512 bytes) in a segment: its header page and one page of payload."""


def nvme_removals(events: list[OffloadingEvent]) -> set[bytes]:
    """The keys that removal events of the NVMe tier name."""
    return {k for e in events if e.removed and e.medium == "NVME" for k in e.block_hashes}


async def test_write_back_over_a_small_nvme_cap_keeps_or_reports_every_stored_block(
    tmp_path,
) -> None:
    """Three caps' worth of blocks through a CPU tier of four: after a graceful close and
    a reopen, each block whose store succeeded loads byte-exact or was named by a
    removal event of the NVMe tier (the close's included, taken after it)."""
    kv = make_kv(30)
    spec = nvme_spec(tmp_path, capacity_bytes=16 * RECORD)  # segment_bytes follows the cap
    keys = [h(3000 + i) for i in range(48)]
    options: dict[str, Any] = {"secondary_tiers": [spec], "write_policy": "write_back"}
    async with TieringEngine(kv, 4, enable_events=True, **options) as engine:
        events: list[OffloadingEvent] = []
        for key in keys:
            put(kv, [key], [0])
            assert (await engine.store([key], [0])).success
            events += engine.take_events()
        closed = await engine.aclose()
        events += engine.take_events()
    removed = nvme_removals(events)
    async with TieringEngine(kv, 4, **options) as engine:
        kept = [key for key in keys if engine.lookup([key]) == 1]
        for key in kept:
            wipe(kv, [1])
            assert (await engine.load([key], [1])).success
            assert holds(kv, key, 1), f"{key.hex()} came back with other bytes"
    assert set(keys) - set(kept) - removed == set(), "stored, then gone without a word"
    assert len(kept) == 16 and not removed & set(kept)
    assert closed.success and closed.failed_keys == ()


async def test_a_close_whose_write_back_fails_names_counts_and_logs_the_lost_blocks(
    tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    kv = make_kv(31)
    faults = FaultInjector()
    keys = [h(1), h(2), h(3)]
    engine = TieringEngine(
        kv, 8, secondary_tiers=[nvme_spec(tmp_path, faults)], write_policy="write_back"
    )
    async with engine:
        assert (await engine.store(keys, [0, 1, 2])).success  # in CPU only, under write-back
        faults.fail("pwritev", errno.EIO)  # every write of the close's flush fails
        with caplog.at_level(logging.WARNING, logger="tiering.engine"):
            closed = await engine.aclose()
    faults.clear()
    assert not closed.success and sorted(closed.failed_keys) == keys
    assert closed.error is not None and closed.error.startswith("3 block(s) failed")
    assert engine.statistics().counters["lost_blocks"] == 3
    assert "lost" in caplog.text and "3 block(s) failed" in caplog.text
    assert await engine.aclose() == closed  # every call answers the same
    async with TieringEngine(kv, 8, secondary_tiers=[nvme_spec(tmp_path)]) as reopened:
        assert all(reopened.lookup([key]) == 0 for key in keys)  # lost, as the result said


async def test_an_evicted_block_whose_write_back_fails_is_counted_lost(tmp_path) -> None:
    kv = make_kv(32)
    faults = FaultInjector()
    spec = nvme_spec(tmp_path, faults)
    async with TieringEngine(
        kv, 2, secondary_tiers=[spec], write_policy="write_back", enable_events=True
    ) as engine:
        assert (await engine.store([h(1), h(2)], [0, 1])).success
        faults.fail("pwritev", errno.EIO, times=1)
        assert (await engine.store([h(3)], [2])).success  # evicts one; its write-back fails
        await settle(engine)
        stats = engine.statistics()
        assert stats.counters["lost_blocks"] == 1
        assert stats.failures["evicted block lost: no tier took its write-back"] == 1
        events = engine.take_events()
        (victim,) = [k for e in events if e.removed and e.medium == "CPU" for k in e.block_hashes]
        assert engine.lookup([victim]) == 0  # in no tier: the CPU tier's removal says so
        assert not [e for e in events if e.medium == "NVME" and victim in e.block_hashes]


async def test_a_hard_close_under_write_back_names_the_cpu_blocks_it_drops(tmp_path) -> None:
    kv = make_kv(33)
    spec = nvme_spec(tmp_path)
    engine = TieringEngine(kv, 4, secondary_tiers=[spec], write_policy="write_back")
    async with engine:
        assert (await engine.store([h(1), h(2)], [0, 1])).success
        closed = engine.close()
    assert not closed.success and sorted(closed.failed_keys) == [h(1), h(2)]
    assert engine.statistics().counters["lost_blocks"] == 2
    assert await engine.aclose() == closed
