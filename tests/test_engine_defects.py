"""Regression tests of the seven engine defects of issue 7, and of its close semantics.

Each test reproduces one defect as the issue describes it, through the public API only,
with CPU tensors and real tiers (memory, NVMe under ``tmp_path``). A slow or failing
tier is made with a :class:`tests._faults.FaultInjector` as the NVMe tier's
``os_calls`` or with a memory tier whose loads wait at a gate. Where the defect is a
wrong block served, the test compares the BYTES on the device, not only ``success``.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
from pathlib import Path

import pytest

from tests._engine_helpers import (
    assert_holds,
    assert_no_leaks,
    corrupt_block,
    engine_tasks,
    h,
    holds,
    key_gated,
    make_kv,
    nvme_spec,
    poll,
    put,
    reached,
    settle,
    spin,
    until,
    wipe,
)
from tests._faults import FaultInjector
from tiering import ClosedError, InvalidArgumentError, TieringEngine, TieringError
from tiering.lifecycle import Lifecycle

WRITE_POLICIES = ["write_through", "write_back"]


async def _reopened_holds(tmp_path: Path, keys: list[bytes]) -> None:
    """A new engine on the same NVMe root finds ``keys`` and loads them byte-exact."""
    kv = make_kv(99)
    async with TieringEngine(kv, 8, secondary_tiers=[nvme_spec(tmp_path)]) as engine:
        assert engine.lookup(keys) == len(keys)
        ids = list(range(20, 20 + len(keys)))
        wipe(kv, ids)
        result = await engine.load(keys, ids)
        assert result.success, result
        assert_holds(kv, keys, ids)


# ------------------------------------------------------------------------------ 1


@pytest.mark.parametrize("write_policy", WRITE_POLICIES)
async def test_1_graceful_close_keeps_stores_still_in_flight(
    tmp_path: Path, write_policy: str
) -> None:
    """Defect 1: a store issued and not awaited before a graceful close is not lost."""
    kv = make_kv(1)
    keys = [h(i) for i in range(4)]
    put(kv, keys, [0, 1, 2, 3])
    spec = nvme_spec(tmp_path)
    async with TieringEngine(kv, 8, secondary_tiers=[spec], write_policy=write_policy) as engine:
        job = engine.store(keys, [0, 1, 2, 3])  # not awaited: the close comes first
    assert engine.state is Lifecycle.CLOSED
    result = await job
    assert result.success, result
    assert await job.cascaded, "no tier failed, so the blocks must have reached it"
    await _reopened_holds(tmp_path, keys)


# ------------------------------------------------------------------------------ 2


async def test_2_write_back_load_of_a_looked_up_block_never_evicts_it() -> None:
    """Defect 2: CPU tier of 2, lower tier full at 2; a load of a block ``lookup``
    just reported must not write back its CPU victim into that block's place."""
    kv = make_kv(2)
    a, b, c, d = h(1), h(2), h(3), h(4)
    put(kv, [a, b, c, d], [0, 1, 2, 3])
    tiers = [{"type": "memory", "max_blocks": 2}]
    async with TieringEngine(kv, 2, secondary_tiers=tiers, write_policy="write_back") as engine:
        assert (await engine.store([a, b], [0, 1])).success
        assert (await engine.store([c, d], [2, 3])).success  # a and b are written back
        assert engine.lookup([a]) == 1
        wipe(kv, [10])
        result = await engine.load([a], [10])
        assert result.success, result
        assert_holds(kv, [a], [10])
        await settle(engine)
        assert engine.lookup([a]) == 1, "the loaded block left every tier"
        assert_no_leaks(engine)


# ------------------------------------------------------------------------------ 3


@pytest.mark.parametrize("ticks", [1, 2, 5, 20])
async def test_3_a_cancelled_aclose_still_releases_the_tiers(ticks: int) -> None:
    """Defect 3: 8 stores whose cascades are still in the memory tier, ``aclose()``
    cancelled while it waits for them, then ``aclose(); close()``: no task of the
    engine or its tiers is left, and the host pool is released."""
    before = set(asyncio.all_tasks())
    kv = make_kv(3)
    keys = [h(i) for i in range(8)]
    put(kv, keys, list(range(8)))
    factory, made = key_gated()
    engine = TieringEngine(kv, 16, secondary_tiers=[factory])
    await engine.__aenter__()
    made[0].store_gate.clear()
    jobs = [engine.store([k], [i]) for i, k in enumerate(keys)]
    await until(lambda: made[0].storing_jobs > 0, "a cascade to reach the memory tier")
    closing = asyncio.create_task(engine.aclose())
    await spin(ticks)
    assert not closing.done()  # it waits for the cascades
    closing.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await closing
    made[0].store_gate.set()
    await engine.aclose()
    engine.close()
    await spin()
    await until(lambda: not engine_tasks(before), "the engine's and tiers' tasks to end", 5.0)
    assert engine.state is Lifecycle.CLOSED
    with pytest.raises(ClosedError):
        engine.host_pool  # noqa: B018 -- the property raises once closed
    assert all(job.done() for job in jobs), "a job was left without a result"
    assert len(engine.get_finished()) == len(jobs)


# ------------------------------------------------------------------------------ 4


@pytest.mark.parametrize(
    ("name", "call"),
    [
        ("block_hashes", lambda e: e.store(None, [0])),
        ("device_block_ids", lambda e: e.store([h(1)], 5)),
        ("device_block_ids", lambda e: e.load([h(1)], None)),
        ("block_hashes", lambda e: e.lookup(None)),
        ("block_hashes", lambda e: e.touch(None)),
    ],
    ids=["store-None", "store-5", "load-None", "lookup-None", "touch-None"],
)
async def test_4_non_iterable_arguments_raise_a_tiering_error(name: str, call) -> None:
    """Defect 4: non-iterable arguments raise a TieringError subclass, not a TypeError."""
    kv = make_kv(4)
    put(kv, [h(1)], [0])
    async with TieringEngine(kv, 4) as engine:
        assert (await engine.store([h(1)], [0])).success
        engine.get_finished()
        with pytest.raises(TieringError) as caught:
            call(engine)
        assert isinstance(caught.value, InvalidArgumentError)
        assert name in str(caught.value)
        assert engine.lookup([h(1)]) == 1 and engine.get_finished() == []


# ------------------------------------------------------------------------------ 5


async def test_5_a_failed_promotion_never_fails_a_later_fill_of_the_same_hash(
    tmp_path: Path,
) -> None:
    """Defect 5: a load whose promotion of H failed (a corrupt NVMe file) must not, when
    it ends, fail the fill that a later load of H started meanwhile; if it did, that
    fill's slot would be freed and given to X while the promotion still writes H's
    bytes into it, and ``load(X)`` would serve H's bytes with ``success=True``."""
    kv = make_kv(5)
    hh, k, f1, f2, x = h(10), h(11), h(12), h(13), h(14)
    put(kv, [hh, k, f1, f2, x], [0, 1, 2, 3, 4])
    faults = FaultInjector()
    keep_out = faults.fail("pwritev", errno.EIO, key=k)  # K: memory tier only
    factory, made = key_gated()
    async with TieringEngine(
        kv,
        2,
        secondary_tiers=[nvme_spec(tmp_path, faults, one_record_segments=True), factory],
        write_policy="write_back",
    ) as engine:
        nvme, memory = engine.tiers
        assert (await engine.store([hh, k], [0, 1])).success
        assert (await engine.store([f1, f2], [2, 3])).success  # H and K are written back
        await settle(engine)
        assert nvme.lookup(hh) is True and memory.lookup(hh) is True
        assert nvme.lookup(k) is False and memory.lookup(k) is True
        faults.remove(keep_out)
        corrupt_block(tmp_path, hh)

        k_gate, h_gate = made[0].gate(k), made[0].gate(hh)
        wipe(kv, [10, 11, 12, 13])
        first = engine.load([hh, k], [10, 11])  # H from NVMe (corrupt), K from memory (held)
        await until(lambda: nvme.lookup(hh) is False, "the corrupt H to leave the NVMe tier")
        await asyncio.sleep(0.05)  # let the engine take in H's failed promotion
        assert not first.done()
        second = engine.load([hh], [12])  # H again, now from the memory tier (held)
        k_gate.set()
        result = await first
        assert k not in result.failed_keys
        assert_holds(kv, [k], [11])
        if hh not in result.failed_keys:  # an engine may fall back to the memory tier
            assert_holds(kv, [hh], [10])
        stored = await engine.store([x], [4])
        assert stored.success, stored
        h_gate.set()
        again = await second
        if again.success:
            assert_holds(kv, [hh], [12])
        wipe(kv, [13])
        loaded = await engine.load([x], [13])
        assert loaded.success, loaded
        assert holds(kv, x, 13), "load(X) served another block's bytes with success=True"
        await settle(engine)
        assert_no_leaks(engine)
        if again.success:
            assert engine.lookup([hh]) == 1


async def test_5_a_failed_promotion_never_fails_a_later_store_of_the_same_hash(
    tmp_path: Path,
) -> None:
    """Defect 5, the store variant of the issue: after ``load(H)`` failed on a corrupt
    NVMe file, ``store(H)`` (held while its CPU victim is written back) and ``store(X)``
    succeed; ``load(X)`` must hold X's bytes and H must be stored after its success."""
    kv = make_kv(55)
    hh, k, f1, f2, d, z, x = (h(i) for i in range(60, 67))
    put(kv, [hh, k, f1, f2, d, z, x], [0, 1, 2, 3, 4, 5, 6])
    faults = FaultInjector()
    keep_out = faults.fail("pwritev", errno.EIO, key=k)  # K: memory tier only
    factory, made = key_gated()
    async with TieringEngine(
        kv,
        3,
        secondary_tiers=[nvme_spec(tmp_path, faults, one_record_segments=True), factory],
        write_policy="write_back",
    ) as engine:
        nvme, memory = engine.tiers
        assert (await engine.store([hh, k], [0, 1])).success
        assert (await engine.store([f1, f2], [2, 3])).success
        assert (await engine.store([d], [4])).success  # H, K leave the CPU tier
        await settle(engine)
        assert nvme.lookup(hh) is True and memory.lookup(k) is True and nvme.lookup(k) is False
        faults.remove(keep_out)
        corrupt_block(tmp_path, hh)
        k_gate = made[0].gate(k)
        wipe(kv, [10, 11, 12, 13])
        first = engine.load([hh, k], [10, 11])  # H from NVMe (corrupt), K from memory (held)
        await until(lambda: nvme.lookup(hh) is False, "the corrupt H to leave the NVMe tier")
        await asyncio.sleep(0.05)  # let the engine take in H's failed promotion
        assert not first.done()
        dirty = [key for key in (f1, f2, d) if engine.lookup([key]) == 1]
        gates = [faults.hold("pwritev", key=key) for key in dirty]  # write-backs wait
        filler = engine.store([z], [5])
        again = engine.store([hh], [0])  # a new fill of H while the old load is running
        await spin()
        k_gate.set()
        result = await first
        assert k not in result.failed_keys
        assert_holds(kv, [k], [11])
        stored_x = engine.store([x], [6])
        for gate in gates:
            gate.open()
        assert (await filler).success
        stored_h = await again
        assert (await stored_x).success
        await settle(engine)
        loaded = await engine.load([x], [12])
        assert loaded.success, loaded
        assert holds(kv, x, 12), "load(X) served another block's bytes with success=True"
        if stored_h.success:
            assert engine.lookup([hh]) == 1, "H vanished after its successful store"
            wipe(kv, [13])
            assert (await engine.load([hh], [13])).success
            assert_holds(kv, [hh], [13])
        await settle(engine)
        assert_no_leaks(engine)


# ------------------------------------------------------------------------------ 6


async def test_6_cancelling_flush_keeps_pins_while_the_tier_reads_the_slots(
    tmp_path: Path,
) -> None:
    """Defect 6: after ``wait_for(flush(), 0.05)`` times out, the slots the tier is still
    writing from must stay pinned; refilling them would put other blocks' bytes in the
    NVMe files of the flushed keys (served later with a valid checksum, or lost)."""
    kv = make_kv(6)
    a0, a1, b0, b1 = h(20), h(21), h(22), h(23)
    put(kv, [a0, a1, b0, b1], [0, 1, 2, 3])
    faults = FaultInjector()
    spec = nvme_spec(tmp_path, faults)
    async with TieringEngine(kv, 2, secondary_tiers=[spec], room_timeout=60.0) as engine:
        failing = faults.fail("pwritev", errno.EIO)
        job = engine.store([a0, a1], [0, 1])
        assert (await job).success
        assert not await job.cascaded  # the write-through cascade failed: CPU only
        faults.remove(failing)
        # The first block write of the flush waits; the second block's checksum is taken
        # only after it, over whatever its slot holds then.
        gate = faults.hold("pwritev")
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(engine.flush(), 0.05)
        await reached(gate)
        refill = engine.store([b0, b1], [2, 3])  # needs the two slots being written from
        await asyncio.sleep(0.05)
        gate.open()
        assert (await refill).success
        await settle(engine)
        assert_no_leaks(engine)
        await until(lambda: engine.lookup([a0, a1]) == 2, "the flushed keys to reach NVMe")
        wipe(kv, [10, 11])
        result = await engine.load([a0, a1], [10, 11])
        for key, i in ((a0, 10), (a1, 11)):
            if key not in result.failed_keys:
                assert holds(kv, key, i), "a flushed key came back with another block's bytes"
        assert result.success, result
    await _reopened_holds(tmp_path, [a0, a1, b0, b1])


# ------------------------------------------------------------------------------ 7


async def test_7_a_store_cut_short_by_close_never_reports_success(tmp_path: Path) -> None:
    """Defect 7: write_back; a store waits for its victim's write-back (held at the
    NVMe write) when a graceful close passes its deadline: the store's copy never ran,
    so it must be answered at the deadline, and not with success."""
    kv = make_kv(7)
    v, s = h(30), h(31)
    put(kv, [v, s], [0, 1])
    faults = FaultInjector()
    spec = nvme_spec(tmp_path, faults, one_record_segments=True)
    engine = TieringEngine(
        kv, 1, secondary_tiers=[spec], write_policy="write_back", close_timeout=0.2
    )
    await engine.__aenter__()
    assert (await engine.store([v], [0])).success  # dirty: only the CPU tier holds it
    gate = faults.hold("pwritev", key=v)
    store = engine.store([s], [1])  # evicts v: its write-back waits at the gate
    await reached(gate)
    closing = asyncio.create_task(engine.aclose())
    # The close deadline (0.2 s), then a generous margin.
    decided_while_held = await poll(store.done, 0.2 + 10.0)
    gate.open()
    await closing
    result = await store
    assert decided_while_held, "the close deadline passed and the store had no result"
    assert not result.success, "the store's copy could not have run, yet it succeeded"
    assert s in result.failed_keys


# ---------------------------------------------------------------- close semantics


@pytest.mark.parametrize("write_policy", WRITE_POLICIES)
async def test_graceful_close_lets_loads_and_cascades_finish(
    tmp_path: Path, write_policy: str
) -> None:
    """Scope 6: jobs in flight at a graceful close finish; their blocks are flushed."""
    kv = make_kv(8)
    keys = [h(i) for i in range(40, 48)]
    put(kv, keys, list(range(8)))
    spec = nvme_spec(tmp_path)
    async with TieringEngine(kv, 3, secondary_tiers=[spec], write_policy=write_policy) as engine:
        first = engine.store(keys[:3], [0, 1, 2])
        assert (await first).success and await first.cascaded
        second = engine.store(keys[3:6], [3, 4, 5])  # evicts the first three
        assert (await second).success
        wipe(kv, [10, 11, 12])
        load = engine.load(keys[:3], [10, 11, 12])  # in flight as the close begins
        third = engine.store(keys[6:], [6, 7])  # so is this one
    assert (await load).success
    assert_holds(kv, keys[:3], [10, 11, 12])
    assert (await third).success
    assert await second.cascaded and await third.cascaded
    await _reopened_holds(tmp_path, keys)


async def test_hard_close_after_anything_is_a_prompt_complete_stop(tmp_path: Path) -> None:
    """Scope 6: ``close()`` with jobs waiting on a stalled tier resolves every job at
    once, admits nothing more, and (once the stalled call returns) leaves no task."""
    before = set(asyncio.all_tasks())
    kv = make_kv(9)
    keys = [h(i) for i in range(50, 54)]
    put(kv, keys, [0, 1, 2, 3])
    faults = FaultInjector()
    engine = TieringEngine(kv, 2, secondary_tiers=[nvme_spec(tmp_path, faults)])
    await engine.__aenter__()
    gate = faults.hold("pwritev", times=None)  # after start: its O_DIRECT probe writes too
    first = engine.store(keys[:2], [0, 1])
    await reached(gate)  # its cascade is stuck in the tier
    second = engine.store(keys[2:], [2, 3])  # waits for room: both slots are pinned
    engine.close()
    assert engine.state in (Lifecycle.CLOSING, Lifecycle.CLOSED)
    assert first.done() and second.done(), "close() left a job without a result"
    assert not (await second).success
    with pytest.raises(ClosedError):
        engine.store([h(60)], [5])
    with pytest.raises(ClosedError):
        engine.lookup([h(60)])
    engine.close()  # idempotent
    gate.open()
    await engine.aclose()
    await engine.aclose()
    engine.close()
    assert engine.state is Lifecycle.CLOSED
    with pytest.raises(ClosedError):
        engine.host_pool  # noqa: B018
    await spin()
    await until(lambda: not engine_tasks(before), "the engine's and tiers' tasks to end", 5.0)
    results = engine.get_finished()
    assert sorted(r.job_id for r in results) == sorted([first.job_id, second.job_id])


async def test_close_is_idempotent_in_every_order() -> None:
    for order in (
        ("aclose", "aclose"),
        ("close", "close"),
        ("close", "aclose"),
        ("aclose", "close"),
    ):
        engine = TieringEngine(make_kv(), 2, secondary_tiers=[{"type": "memory"}])
        await engine.__aenter__()
        for step in order:
            if step == "close":
                engine.close()
            else:
                await engine.aclose()
        await engine.aclose()
        assert engine.state is Lifecycle.CLOSED, order
        with pytest.raises(ClosedError):
            engine.host_pool  # noqa: B018


async def test_closing_a_never_opened_engine_is_a_no_op() -> None:
    engine = TieringEngine(make_kv(), 2)
    engine.close()
    await engine.aclose()
    assert engine.state is Lifecycle.CLOSED
    with pytest.raises(ClosedError):
        await engine.__aenter__()
