"""Bad input to the engine: every case of issue 7's "Bad input" (scope item 7, "Also seen").

Each bad call raises a :class:`tiering.errors.TieringError` subclass whose message names
the argument and the value, and changes nothing: ``statistics()``, ``lookup`` and
``get_finished()`` read the same afterwards. Constructor options are checked at
construction (or, for what needs the tiers, when the engine starts).
"""

from __future__ import annotations

import asyncio
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests._engine_helpers import (
    DEVICE_BLOCKS,
    assert_holds,
    engine_tasks,
    h,
    make_kv,
    nvme_spec,
    put,
    settle,
    spin,
    wipe,
)
from tiering import ClosedError, InvalidArgumentError, TieringEngine, TieringError
from tiering.lifecycle import Lifecycle

STORED = [h(1), h(2)]


def _names(error: BaseException, argument: str, value: object) -> None:
    """The error is a TieringError naming ``argument`` and showing ``value``."""
    assert isinstance(error, TieringError), f"{type(error).__name__}: {error}"
    message = str(error)
    named = argument in message or argument.replace("_", " ") in message
    assert named, f"{argument!r} not named in: {message}"
    shown = {repr(value), str(value)}
    if isinstance(value, bytes):
        shown.add(value.hex())
    if isinstance(value, int) and not isinstance(value, bool):
        shown |= {f"{value:_}", f"{value:,}"}
    assert any(s in message for s in shown), f"value {value!r} not shown in: {message}"


def _snapshot(engine: TieringEngine) -> tuple[Any, ...]:
    return (engine.statistics(), engine.lookup(STORED), engine.lookup([h(3)]))


# ------------------------------------------------------------------ calls


CALLS: list[tuple[str, Callable[[TieringEngine], object], str, object]] = [
    # Non-iterable arguments (defect 4).
    ("store-hashes-None", lambda e: e.store(None, [0]), "block_hashes", None),
    ("store-ids-5", lambda e: e.store([h(3)], 5), "device_block_ids", 5),
    ("load-ids-None", lambda e: e.load([h(1)], None), "device_block_ids", None),
    ("load-hashes-None", lambda e: e.load(None, [0]), "block_hashes", None),
    ("lookup-None", lambda e: e.lookup(None), "block_hashes", None),
    ("touch-None", lambda e: e.touch(None), "block_hashes", None),
    # One hash where a list is expected.
    ("store-one-hash", lambda e: e.store(h(3), [0]), "block_hashes", h(3)),
    ("load-one-hash", lambda e: e.load(h(1), [0]), "block_hashes", h(1)),
    ("lookup-one-hash", lambda e: e.lookup(h(1)), "block_hashes", h(1)),
    ("touch-one-hash", lambda e: e.touch(h(1)), "block_hashes", h(1)),
    # A store names each block once, by hash and by device block; a load each device block.
    ("store-repeated-ids", lambda e: e.store([h(3), h(4)], [5, 5]), "device_block_ids", 5),
    ("store-repeated-hashes", lambda e: e.store([h(3), h(3)], [4, 5]), "block_hashes", h(3)),
    ("load-repeated-ids", lambda e: e.load([h(1), h(2)], [6, 6]), "device_block_ids", 6),
    # Elements of the wrong type or range.
    ("store-str-hash", lambda e: e.store(["abc"], [0]), "block_hashes", "abc"),
    ("store-id-out-of-range", lambda e: e.store([h(3)], [DEVICE_BLOCKS]), "device_block_ids", 32),
    ("load-negative-id", lambda e: e.load([h(1)], [-1]), "device_block_ids", -1),
    ("store-float-id", lambda e: e.store([h(3)], [1.0]), "device_block_ids", 1.0),
]


@pytest.mark.parametrize(
    ("call", "argument", "value"), [c[1:] for c in CALLS], ids=[c[0] for c in CALLS]
)
async def test_a_bad_call_raises_naming_the_argument_and_changes_nothing(
    call: Callable[[TieringEngine], object], argument: str, value: object
) -> None:
    kv = make_kv(1)
    put(kv, STORED, [0, 1])
    async with TieringEngine(kv, 4, secondary_tiers=[{"type": "memory"}]) as engine:
        assert (await engine.store(STORED, [0, 1])).success
        await settle(engine)
        engine.get_finished()
        before = _snapshot(engine)
        with pytest.raises(TieringError) as caught:
            call(engine)
        _names(caught.value, argument, value)
        assert _snapshot(engine) == before
        assert engine.get_finished() == []


async def test_length_mismatch_names_both_arguments() -> None:
    async with TieringEngine(make_kv(), 4) as engine:
        with pytest.raises(InvalidArgumentError) as caught:
            engine.store([h(1), h(2)], [0])
        assert "device_block_ids" in str(caught.value) or "device block ids" in str(caught.value)
        assert engine.statistics().jobs_in_flight == 0 and engine.get_finished() == []


async def test_a_load_may_name_one_hash_for_several_device_blocks() -> None:
    kv = make_kv(2)
    put(kv, [h(7)], [0])
    async with TieringEngine(kv, 4) as engine:
        result = await engine.store([h(7)], [0])
        assert result.success, result
        wipe(kv, [10, 11])
        result = await engine.load([h(7), h(7)], [10, 11])
        assert result.success, result
        assert_holds(kv, [h(7), h(7)], [10, 11])
        await settle(engine)


async def test_host_pool_after_close_raises_closed_error() -> None:
    engine = TieringEngine(make_kv(), 2)
    with pytest.raises(ClosedError):
        engine.host_pool  # noqa: B018 -- not open yet
    async with engine:
        assert engine.host_pool is not None
    assert engine.state is Lifecycle.CLOSED
    with pytest.raises(ClosedError):
        engine.host_pool  # noqa: B018


# ------------------------------------------------------------ constructor


OPTIONS: list[tuple[str, dict[str, Any], str, object]] = [
    ("tiers-str", {"secondary_tiers": "memory"}, "secondary_tiers", "memory"),
    ("tiers-bytes", {"secondary_tiers": b"memory"}, "secondary_tiers", b"memory"),
    ("tier-int", {"secondary_tiers": [42]}, "secondary_tiers", 42),
    ("tier-unknown", {"secondary_tiers": [{"type": "tape"}]}, "tape", "tape"),
    ("room-negative", {"room_timeout": -1}, "room_timeout", -1),
    ("room-nan", {"room_timeout": math.nan}, "room_timeout", math.nan),
    ("tier-timeout-str", {"tier_timeout": "x"}, "tier_timeout", "x"),
    ("tier-timeout-negative", {"tier_timeout": -0.5}, "tier_timeout", -0.5),
    ("close-nan", {"close_timeout": math.nan}, "close_timeout", math.nan),
    ("close-negative", {"close_timeout": -1.0}, "close_timeout", -1.0),
    ("close-bool", {"close_timeout": True}, "close_timeout", True),
    ("block-size-zero", {"block_size": 0}, "block_size", 0),
    ("write-policy", {"write_policy": "write_around"}, "write_policy", "write_around"),
    ("policy-unknown", {"policy": "fifo-ish"}, "fifo-ish", "fifo-ish"),
]


async def _refused(options: dict[str, Any], blocks: object = 4) -> TieringError:
    """The error of an engine built with ``options``: raised at construction or, for
    what needs the tiers, on entering it. Fails the test if it starts or raises
    anything else."""
    try:
        engine = TieringEngine(make_kv(), blocks, **options)  # type: ignore[arg-type]
    except TieringError as error:
        return error
    try:
        async with engine:
            pass
    except TieringError as error:
        assert engine.state is not Lifecycle.OPEN
        with pytest.raises(ClosedError):
            engine.host_pool  # noqa: B018
        return error
    pytest.fail(f"an engine with {options} started")


@pytest.mark.parametrize(
    ("options", "argument", "value"), [o[1:] for o in OPTIONS], ids=[o[0] for o in OPTIONS]
)
async def test_a_bad_option_is_refused(
    options: dict[str, Any], argument: str, value: object
) -> None:
    _names(await _refused(options), argument, value)


@pytest.mark.parametrize("blocks", [0, -1, "4", 2.0, True, 10**12])
async def test_a_bad_cpu_tier_size_is_refused(blocks: object) -> None:
    """``num_cpu_blocks=10**12`` (512 TB here) included: a TieringError at construction
    or at the latest when the engine starts, never a bare MemoryError."""
    try:
        error = await _refused({}, blocks)
    except MemoryError as bare:  # the defect: not a TieringError
        pytest.fail(f"bare MemoryError: {bare!r}")
    _names(error, "num_cpu_blocks", blocks)


# --------------------------------------------------------- NVMe at start


async def test_nvme_floor_above_the_disk_size_fails_at_start(tmp_path: Path) -> None:
    """A free-space floor larger than the whole file system can never be met: the
    engine must refuse to start, not accept and then refuse every store silently."""
    disk = os.statvfs(tmp_path)
    floor = disk.f_blocks * disk.f_frsize + (1 << 30)
    error = await _refused({"secondary_tiers": [nvme_spec(tmp_path, min_free_bytes=floor)]})
    _names(error, "min_free_bytes", floor)


async def test_nvme_capacity_below_one_block_fails_at_start(tmp_path: Path) -> None:
    error = await _refused({"secondary_tiers": [nvme_spec(tmp_path, capacity_bytes=100)]})
    _names(error, "capacity_bytes", 100)


async def test_a_failed_start_leaves_no_task_behind(tmp_path: Path) -> None:
    before = set(asyncio.all_tasks())
    spec = nvme_spec(tmp_path, capacity_bytes=100)
    engine = TieringEngine(make_kv(), 4, secondary_tiers=[{"type": "memory"}, spec])
    with pytest.raises(TieringError):
        await engine.__aenter__()
    await spin()
    assert engine_tasks(before) == set()


async def test_results_nobody_drains_stay_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    import tiering.core.job

    monkeypatch.setattr(tiering.core.job, "FINISHED_KEPT", 8)
    async with TieringEngine(make_kv(), 32) as engine:
        jobs = [engine.store([h(i)], [i]) for i in range(20)]
        for job in jobs:
            assert (await job).success  # awaiting is how this caller gets its results
        finished = engine.get_finished()
        assert [r.job_id for r in finished] == [job.job_id for job in jobs[-8:]]
        assert engine.get_finished() == []
