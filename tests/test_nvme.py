"""Tests of backends.nvme.tier: the NVMe tier through its actor API, on real files.

The tier here keeps one record a segment and moves no record again on eviction, so that
it evicts block by block, oldest first; tests/test_nvme_tier_segments.py checks segments
of many records, reinsertion and recovery.
"""

from __future__ import annotations

import asyncio
import errno
import gc
import logging
import os
import re
import shutil
import stat
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from backends.nvme.os_calls import OsCalls, owner_alive
from backends.nvme.segment_format import SEGMENTS_DIR, namespace_dirname
from backends.nvme.segment_index import key_digest
from backends.nvme.tier import InflightBytes, NVMeTier
from tests._faults import FaultInjector
from tests._nvme_helpers import load_job as _load
from tests._nvme_helpers import next_job_id, random_pool
from tests._nvme_helpers import store_job as _store
from tiering.device.host_pool import HostPool
from tiering.errors import (
    ClosedError,
    InvalidArgumentError,
)
from tiering.tiers.actor import TierActor
from tiering.tiers.block_record import HEADER_BYTES
from tiering.tiers.registry import make_tier
from tiering.tiers.tier_api import JobMetadata, JobResult, SecondaryTierManager

BLOCK = 16 << 10
FILE = HEADER_BYTES + BLOCK
SLOTS = 16
NAMESPACE = "model=tiny;dtype=bf16;block=16x2x64;layout=v1"
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def pool() -> Iterator[memoryview]:
    with random_pool(BLOCK, SLOTS) as view:
        yield view


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _tier(pool: memoryview, root: Path, **kwargs: Any) -> NVMeTier:
    # One record a segment and no reinsertion: eviction is per block, oldest first.
    options: dict[str, Any] = {
        "root": root,
        "namespace": NAMESPACE,
        "capacity_bytes": 64 * FILE,
        "min_free_bytes": 0,
        "segment_bytes": HEADER_BYTES + FILE,
        "hot_fraction": 0.0,
    }
    options.update(kwargs)
    return NVMeTier(pool, BLOCK, **options)


@pytest.fixture
async def tier(pool: memoryview, tmp_path: Path) -> AsyncIterator[NVMeTier]:
    async with _tier(pool, tmp_path) as running:
        yield running


def _slot(pool: memoryview, i: int) -> bytes:
    return bytes(pool[i * BLOCK : (i + 1) * BLOCK])


def _keys(n: int, tag: str = "k") -> list[bytes]:
    return [f"{tag}-{i}".encode() + os.urandom(16) for i in range(n)]


def _exists(path: str) -> bool:
    return os.path.exists(path)


def _segment_files(tier: NVMeTier) -> list[str]:
    return sorted(os.listdir(os.path.join(tier.directory, SEGMENTS_DIR)))


def _record(tier: NVMeTier, key: bytes) -> tuple[str, int]:
    """The path of the segment file holding ``key``'s record, and the record's offset."""
    where = tier._index.locate(key_digest(key))
    assert where is not None, key
    return tier._segments.path_of(where[0]), tier._segments.offset_of(where[1])


# -- the basic contract ------------------------------------------------------------------


async def test_store_then_load_is_byte_exact(tier: NVMeTier, pool: memoryview) -> None:
    keys = _keys(4)
    expected = [_slot(pool, i) for i in range(4)]
    assert (await _store(tier, keys, range(4))).success
    assert all(tier.lookup(k) for k in keys)
    result = await _load(tier, keys, range(8, 12))
    assert result == JobResult(result.job_id, True)
    assert [_slot(pool, i) for i in range(8, 12)] == expected
    assert tier.metrics.stored_blocks == 4 and tier.metrics.loaded_blocks == 4
    assert tier.get_num_blocks() == 4 and tier.used_bytes == 4 * FILE


async def test_lookup_is_none_while_a_store_is_queued(tier: NVMeTier) -> None:
    key = b"pending"
    tier.submit_store(JobMetadata(next_job_id(), [key], [0]))
    assert tier.lookup(key) is None
    assert tier.lookup(b"other") is False


async def test_lookup_all_answers_as_lookup_does_for_each_key(tier: NVMeTier) -> None:
    stored = _keys(3)
    await _store(tier, stored, [0, 1, 2])
    tier.submit_store(JobMetadata(next_job_id(), [b"pending"], [3]))
    keys = [b"absent", *stored, b"pending"]
    assert (
        tier.lookup_all(keys)
        == [tier.lookup(key) for key in keys]
        == [False, True, True, True, None]
    )


async def test_lookup_rejects_a_non_bytes_key(tier: NVMeTier) -> None:
    with pytest.raises(InvalidArgumentError, match="bytes"):
        tier.lookup("text")  # type: ignore[arg-type]


async def test_load_of_unknown_keys_is_partial(tier: NVMeTier, pool: memoryview) -> None:
    (known,) = _keys(1)
    await _store(tier, [known], [0])
    expected = _slot(pool, 0)
    result = await _load(tier, [b"unknown", known], [1, 2])
    assert not result.success and result.failed_keys == (b"unknown",)
    assert _slot(pool, 2) == expected


async def test_one_key_loaded_into_two_slots_lands_in_both(
    tier: NVMeTier, pool: memoryview
) -> None:
    await _store(tier, [b"twice"], [0])
    expected = _slot(pool, 0)
    assert (await _load(tier, [b"twice", b"twice"], [1, 2])).success
    assert _slot(pool, 1) == _slot(pool, 2) == expected
    assert tier.lookup(b"twice")


async def test_storing_held_keys_again_is_a_no_op(tier: NVMeTier) -> None:
    keys = _keys(2)
    await _store(tier, keys, [0, 1])
    assert (await _store(tier, [*keys, keys[0]], [2, 3, 4])).success
    assert tier.metrics.stored_blocks == 2
    assert tier.used_bytes == 2 * FILE and len(_segment_files(tier)) == 2


async def test_key_too_long_for_the_header_fails_alone(tier: NVMeTier) -> None:
    good, bad = b"good", b"x" * 5000
    result = await _store(tier, [good, bad], [0, 1])
    assert result.failed_keys == (bad,) and "key length" in (result.error or "")
    assert tier.lookup(good)


async def test_tier_is_registered_and_speaks_the_plain_protocol(
    pool: memoryview, tmp_path: Path
) -> None:
    tier = make_tier(
        {
            "type": "nvme",
            "root": str(tmp_path),
            "namespace": NAMESPACE,
            "capacity_bytes": 8 * FILE,
            "min_free_bytes": 0,
        },
        pool,
        BLOCK,
    )
    assert isinstance(tier, NVMeTier) and isinstance(tier, SecondaryTierManager)
    assert tier.get_tier_type() == "nvme"
    assert isinstance(tier, TierActor)
    await tier.start()
    try:
        tier.submit_store(JobMetadata(7, [b"a"], [0]))
        await tier.result(7)
        assert tier.get_finished() == [JobResult(7, True)]
    finally:
        await tier.aclose()


async def test_works_over_a_host_pool(tmp_path: Path) -> None:
    with HostPool(8, BLOCK, pin=False) as host:
        host.view[:] = os.urandom(8 * BLOCK)
        expected = bytes(host.view[:BLOCK])
        async with _tier(host.view, tmp_path) as tier:
            await _store(tier, [b"h"], [0])
            assert (await _load(tier, [b"h"], [5])).success
            assert bytes(host.view[5 * BLOCK : 6 * BLOCK]) == expected
            assert tier.o_direct is not None


async def test_unaligned_block_size_works_with_buffered_io(tmp_path: Path) -> None:
    block = 1000
    buffer = bytearray(os.urandom(block * 4))
    view = memoryview(buffer)
    async with NVMeTier(
        view, block, root=tmp_path, namespace="odd", capacity_bytes=1 << 20, min_free_bytes=0
    ) as tier:
        await _store(tier, [b"a", b"b"], [0, 1])
        expected = bytes(view[: 2 * block])
        assert (await _load(tier, [b"a", b"b"], [2, 3])).success
        assert bytes(view[2 * block :]) == expected


# -- namespaces, restart, recovery -------------------------------------------------------


async def test_restart_keeps_the_cache_warm(pool: memoryview, tmp_path: Path) -> None:
    keys = _keys(5)
    expected = [_slot(pool, i) for i in range(5)]
    async with _tier(pool, tmp_path) as first:
        await _store(first, keys, range(5))
    async with _tier(pool, tmp_path) as second:
        assert second.metrics.recovered_blocks == 5
        assert all(second.lookup(k) for k in keys)
        assert (await _load(second, keys, range(10, 15))).success
        assert [_slot(pool, i) for i in range(10, 15)] == expected


async def test_other_namespace_never_sees_our_blocks(pool: memoryview, tmp_path: Path) -> None:
    key = b"shared-prefix-block"
    async with _tier(pool, tmp_path) as ours:
        await _store(ours, [key], [0])
    async with _tier(pool, tmp_path, namespace=NAMESPACE + ";dtype=fp8") as theirs:
        assert theirs.lookup(key) is False
        assert not (await _load(theirs, [key], [1])).success
        assert theirs.directory != ours.directory


async def test_a_foreign_segment_planted_in_our_directory_is_removed_at_start(
    pool: memoryview, tmp_path: Path
) -> None:
    key = b"planted"
    async with _tier(pool, tmp_path, namespace="other") as other:
        await _store(other, [key], [0])
        source, _ = _record(other, key)
    ours_dir = tmp_path / namespace_dirname(NAMESPACE) / SEGMENTS_DIR
    ours_dir.mkdir(parents=True)
    shutil.copy(source, ours_dir / os.path.basename(source))
    async with _tier(pool, tmp_path) as ours:
        assert ours.lookup(key) is False
        assert ours.metrics.removed_on_recovery["corrupt segment"] == 1
        assert _segment_files(ours) == []


async def test_directory_of_another_identity_is_refused(pool: memoryview, tmp_path: Path) -> None:
    directory = tmp_path / namespace_dirname(NAMESPACE)
    directory.mkdir()
    (directory / "NAMESPACE").write_text('{"namespace": "somebody else"}')
    tier = _tier(pool, tmp_path)
    with pytest.raises(InvalidArgumentError, match="somebody else"):
        await tier.start()
    await tier.aclose()


async def test_restart_with_a_smaller_cap_evicts_the_oldest(
    pool: memoryview, tmp_path: Path
) -> None:
    keys = _keys(6)
    async with _tier(pool, tmp_path) as first:
        for i, key in enumerate(keys):
            await _store(first, [key], [i])
    async with _tier(pool, tmp_path, capacity_bytes=4 * FILE) as second:
        assert [second.lookup(k) for k in keys] == [False, False, True, True, True, True]
        assert len(_segment_files(second)) == 4


async def test_blocks_over_the_cap_are_removed_before_the_tier_takes_jobs(
    pool: memoryview, tmp_path: Path
) -> None:
    old, mid, new = _keys(3)
    async with _tier(pool, tmp_path) as first:
        for i, key in enumerate((old, mid, new)):
            await _store(first, [key], [i])
    tier = _tier(pool, tmp_path, capacity_bytes=2 * FILE)  # `old` is over the cap now
    starting = asyncio.create_task(tier.start())
    store = JobMetadata(next_job_id(), [old], [4])
    while True:  # store `old` again as soon as the tier takes jobs
        try:
            tier.submit_store(store)
            break
        except ClosedError:
            await asyncio.sleep(0.001)
    try:
        assert (await tier.result(store.job_id)).success
        await starting
        expected = _slot(pool, 4)
        assert (await _load(tier, [old], [5])).success
        assert _slot(pool, 5) == expected
    finally:
        await tier.aclose()


@pytest.mark.parametrize(
    ("under_a_file", "why"),
    [(False, "is not a directory"), (True, "cannot be created: Not a directory")],
    ids=["root-is-a-file", "parent-is-a-file"],
)
async def test_a_root_that_is_or_lies_under_a_file_is_refused_naming_root(
    pool: memoryview, tmp_path: Path, under_a_file: bool, why: str
) -> None:
    # Works as root too: no permission bit can make a regular file a directory.
    blocker = tmp_path / "file-not-dir"
    blocker.write_text("x")
    root = blocker / "cache" if under_a_file else blocker
    tier = _tier(pool, root)
    with pytest.raises(InvalidArgumentError, match=f"^root: {re.escape(repr(str(root)))} {why}$"):
        await tier.start()
    await tier.aclose()
    assert blocker.read_text() == "x"


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc")
async def test_a_root_nobody_may_write_in_is_refused_naming_root(pool: memoryview) -> None:
    # /proc/self: a directory of this process's user, mode 555, that takes no new entry
    # from any user, root included (which no permission bit can stop).
    root = Path("/proc/self")
    tier = _tier(pool, root, o_direct=False)
    with pytest.raises(InvalidArgumentError, match=r"^root: '/proc/self' is not writable: "):
        await tier.start()
    await tier.aclose()


async def test_a_floor_at_or_above_the_file_system_size_fails_start(
    pool: memoryview, tmp_path: Path
) -> None:
    stat = os.statvfs(tmp_path)
    size = stat.f_blocks * stat.f_frsize
    tier = _tier(pool, tmp_path, min_free_bytes=size)
    with pytest.raises(InvalidArgumentError, match=f"min_free_bytes={size}.*could never store"):
        await tier.start()
    await tier.aclose()
    assert not os.listdir(os.path.join(tier.directory, "owners"))  # no lock left behind
    async with _tier(pool, tmp_path, min_free_bytes=size - 1) as fine:
        assert fine.get_num_blocks() == 0


def test_a_cap_below_one_block_file_is_refused_naming_the_value(
    pool: memoryview, tmp_path: Path
) -> None:
    with pytest.raises(InvalidArgumentError, match=f"capacity_bytes={FILE - 1}.*one block file"):
        _tier(pool, tmp_path, capacity_bytes=FILE - 1)
    assert _tier(pool, tmp_path, capacity_bytes=2 * FILE).capacity_blocks == 2


# -- verify before serving ---------------------------------------------------------------


def _flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x80]))


@pytest.mark.parametrize(
    "damage",
    [
        lambda path, at: _flip(path, at + HEADER_BYTES + 5),
        lambda path, at: _flip(path, at + 60),
        lambda path, at: os.truncate(path, at + FILE - 4096),
    ],
    ids=["payload-byte", "header-byte", "truncated"],
)
async def test_corrupt_block_is_never_served_and_becomes_a_miss(
    tier: NVMeTier, pool: memoryview, damage: Any
) -> None:
    keys = _keys(3)
    await _store(tier, keys, range(3))
    expected = [_slot(pool, 0), _slot(pool, 2)]
    damage(*_record(tier, keys[1]))
    result = await _load(tier, keys, [4, 5, 6])
    assert not result.success and result.failed_keys == (keys[1],)
    assert [_slot(pool, 4), _slot(pool, 6)] == expected
    assert tier.metrics.corrupt_blocks == 1
    assert tier.lookup(keys[1]) is False
    again = await _load(tier, [keys[1]], [7])
    assert again.error and "not in the nvme tier" in again.error
    assert tier.metrics.corrupt_blocks == 1


async def test_short_read_is_never_served(pool: memoryview, tmp_path: Path) -> None:
    faults = FaultInjector()
    async with _tier(pool, tmp_path, os_calls=faults) as tier:
        (key,) = _keys(1)
        await _store(tier, [key], [0])
        path, _ = _record(tier, key)
        faults.short_read(max_bytes=FILE - 4096, path=os.path.basename(path))  # aligned
        result = await _load(tier, [key], [1])
        assert result.failed_keys == (key,) and "short read" in (result.error or "")
        assert tier.lookup(key) is False


async def test_read_eio_fails_that_job_only(pool: memoryview, tmp_path: Path) -> None:
    faults = FaultInjector()
    async with _tier(pool, tmp_path, os_calls=faults) as tier:
        keys = _keys(2)
        await _store(tier, keys, [0, 1])
        expected = _slot(pool, 1)
        faults.fail("preadv", errno.EIO, path=os.path.basename(_record(tier, keys[0])[0]))
        first = await _load(tier, [keys[0]], [2])
        second = await _load(tier, [keys[1]], [3])
        assert not first.success and "EIO" in (first.error or "")
        assert second.success and _slot(pool, 3) == expected
        assert tier.metrics.read_errors == 1


async def test_write_eio_fails_that_job_only(pool: memoryview, tmp_path: Path) -> None:
    faults = FaultInjector()
    async with _tier(pool, tmp_path, os_calls=faults) as tier:
        bad, good = _keys(2)
        faults.fail("pwritev", errno.EIO, times=1)
        assert not (await _store(tier, [bad], [0])).success
        assert (await _store(tier, [good], [1])).success
        assert not tier.read_only
        assert tier.lookup(bad) is False and tier.lookup(good) is True


# -- capacity ----------------------------------------------------------------------------


async def test_byte_cap_evicts_the_oldest(pool: memoryview, tmp_path: Path) -> None:
    keys = _keys(6)
    async with _tier(pool, tmp_path, capacity_bytes=4 * FILE) as tier:
        await _store(tier, keys[:4], range(4))
        await _store(tier, keys[4:], [4, 5])
        assert [tier.lookup(k) for k in keys] == [False, False, True, True, True, True]
        assert tier.metrics.evicted_blocks == 2
        assert len(_segment_files(tier)) == 4


async def test_removals_name_evicted_and_corrupt_blocks(pool: memoryview, tmp_path: Path) -> None:
    keys = _keys(5)
    async with _tier(pool, tmp_path, capacity_bytes=4 * FILE) as tier:
        tier.report_removals()
        await _store(tier, keys[:4], range(4))
        await _store(tier, keys[4:], [4])  # evicts the oldest: keys[0]
        path, at = _record(tier, keys[2])
        _flip(path, at + HEADER_BYTES + 5)
        assert not (await _load(tier, keys[2:3], [6])).success
        assert tier.take_removed() == [keys[0], keys[2]]
        assert tier.take_removed() == []


async def test_store_larger_than_the_cap_stores_what_fits(pool: memoryview, tmp_path: Path) -> None:
    async with _tier(pool, tmp_path, capacity_bytes=3 * FILE) as tier:
        keys = _keys(5)
        result = await _store(tier, keys, range(5))
        assert result.failed_keys == tuple(keys[3:])
        assert "capacity" in (result.error or "")
        assert tier.get_num_blocks() == 3


async def test_free_space_floor_evicts_before_the_cap_is_reached(
    pool: memoryview, tmp_path: Path
) -> None:
    faults = FaultInjector()
    clock = FakeClock()
    options = {"os_calls": faults, "clock": clock, "min_free_bytes": 10 * FILE}
    async with _tier(pool, tmp_path, **options) as tier:
        keys = _keys(4)
        await _store(tier, keys[:2], [0, 1])
        faults.report_free_bytes(11 * FILE)  # room for one more above the floor
        clock.now += 1  # the figure measured by the last job is now stale
        assert (await _store(tier, keys[2:], [2, 3])).success
        assert tier.metrics.evicted_blocks == 1
        assert [tier.lookup(k) for k in keys] == [False, True, True, True]


async def test_free_space_floor_refuses_what_eviction_cannot_cover(
    pool: memoryview, tmp_path: Path
) -> None:
    faults = FaultInjector()
    faults.report_free_bytes(11 * FILE)
    async with _tier(pool, tmp_path, os_calls=faults, min_free_bytes=10 * FILE) as tier:
        keys = _keys(2)
        result = await _store(tier, keys, [0, 1])
        assert result.failed_keys == (keys[1],)
        assert "free space would fall below" in (result.error or "")
        assert tier.lookup(keys[0]) and tier.metrics.refused_blocks == 1


@pytest.mark.parametrize("hold_oldest", [False, True])
async def test_crossed_floor_evicts_to_restore_it(
    pool: memoryview, tmp_path: Path, hold_oldest: bool
) -> None:
    faults = FaultInjector()
    clock = FakeClock()
    options = {"os_calls": faults, "clock": clock, "min_free_bytes": 10 * FILE}
    async with _tier(pool, tmp_path, **options) as tier:
        keys = _keys(5)
        if hold_oldest:
            tier.hold([keys[0]])  # held before it is stored: the floor must spare it
        await _store(tier, keys[:4], range(4))
        faults.report_free_bytes(9 * FILE)  # one record below the floor
        clock.now += 1
        result = await _store(tier, keys[4:], [4])
        assert result.success
        assert tier.metrics.evicted_blocks == 2  # one for the floor, one for the new block
        expected = [True, False, False] if hold_oldest else [False, False, True]
        assert [tier.lookup(k) for k in keys] == [*expected, True, True]


class GatedReads(OsCalls):
    """Real calls, but reads wait for ``gate`` once ``armed``; ``entered`` is set inside."""

    def __init__(self) -> None:
        self.armed = False
        self.entered = threading.Event()
        self.gate = threading.Event()

    def preadv(self, fd: int, buffers: Sequence[memoryview], offset: int) -> int:
        if self.armed:
            self.entered.set()
            self.gate.wait(10)
        return super().preadv(fd, buffers, offset)


async def _until(flag: threading.Event) -> None:
    assert await asyncio.to_thread(flag.wait, 10)


async def test_blocks_being_read_are_never_evicted(pool: memoryview, tmp_path: Path) -> None:
    gated = GatedReads()
    async with _tier(pool, tmp_path, os_calls=gated, capacity_bytes=3 * FILE) as tier:
        oldest, newer, newest, incoming = _keys(4)
        await _store(tier, [oldest, newer, newest], [0, 1, 2])
        expected = _slot(pool, 0)
        gated.armed = True
        load = JobMetadata(next_job_id(), [oldest], [5])
        tier.submit_load(load)
        await _until(gated.entered)
        stored = await _store(tier, [incoming], [3])  # the oldest is being read
        gated.gate.set()
        assert (await tier.result(load.job_id)).success
        assert stored.success
        assert tier.lookup(oldest) and not tier.lookup(newer) and tier.lookup(newest)
        assert _slot(pool, 5) == expected


async def test_a_held_block_is_never_evicted_until_released(
    pool: memoryview, tmp_path: Path
) -> None:
    # The newest segment is the one being written: never evicted either.
    async with _tier(pool, tmp_path, capacity_bytes=3 * FILE) as tier:
        a, b, c, d, e = _keys(5)
        await _store(tier, [a, b, e], [0, 1, 4])
        tier.hold([a])  # a is the oldest: the eviction's pick
        assert (await _store(tier, [c], [2])).success
        expected = _slot(pool, 2)  # c's bytes
        assert tier.lookup(a) and not tier.lookup(b)
        tier.hold([e])
        refused = await _store(tier, [d], [3])
        assert refused.failed_keys == (d,) and "in use" in (refused.error or "")
        assert tier.statistics().pinned_blocks == 2
        tier.release([a])
        assert (await _store(tier, [d], [3])).success
        assert not tier.lookup(a) and tier.lookup(c) and tier.lookup(d) and tier.lookup(e)
        with pytest.raises(InvalidArgumentError, match=a.hex()):
            tier.release([a])
        tier.release([e])
        assert (await _load(tier, [c], [6])).success
        assert _slot(pool, 6) == expected


async def test_usage_reports_counters_and_failures_by_cause_logged_once(
    pool: memoryview, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async with _tier(pool, tmp_path, capacity_bytes=4 * FILE) as tier:
        keys = _keys(2)
        await _store(tier, keys, [0, 1])
        for path, at in [_record(tier, k) for k in keys]:
            _flip(path, at + HEADER_BYTES + 7)
        with caplog.at_level(logging.WARNING, logger="backends.nvme.tier"):
            result = await _load(tier, keys, [4, 5])
            await _load(tier, [b"absent"], [6])
        assert set(result.failed_keys) == set(keys)
        assert "checksum" in (result.error or "")
        stats = tier.statistics()
    assert stats.used_blocks == 0 and stats.capacity_blocks == 4
    # A dead record keeps its room until its segment goes.
    assert stats.used_bytes == 2 * FILE and stats.capacity_bytes == 4 * FILE
    assert stats.counters["stored_blocks"] == 2
    assert stats.counters["corrupt_blocks"] == 2
    assert dict(stats.failures) == {"corrupt block": 2, "not in the tier": 1}
    corrupt_lines = [r for r in caplog.records if "corrupt block" in r.getMessage()]
    assert len(corrupt_lines) == 1


async def test_store_fails_when_every_block_is_being_read(pool: memoryview, tmp_path: Path) -> None:
    gated = GatedReads()
    async with _tier(pool, tmp_path, os_calls=gated, capacity_bytes=2 * FILE) as tier:
        held = _keys(2)
        (incoming,) = _keys(1, "incoming")
        await _store(tier, held, [0, 1])
        gated.armed = True
        load = JobMetadata(next_job_id(), held, [5, 6])
        tier.submit_load(load)
        await _until(gated.entered)
        stored = await _store(tier, [incoming], [2])
        gated.gate.set()
        assert (await tier.result(load.job_id)).success
        assert stored.failed_keys == (incoming,)
        assert "in use (read, written or held)" in (stored.error or "")


# -- disk full ---------------------------------------------------------------------------


async def test_enospc_makes_stores_read_only_until_space_returns(
    pool: memoryview, tmp_path: Path
) -> None:
    faults = FaultInjector()
    clock = FakeClock()
    async with _tier(pool, tmp_path, os_calls=faults, clock=clock, enospc_retry_s=5) as tier:
        stored, blocked, later = _keys(3)
        await _store(tier, [stored], [0])
        expected = _slot(pool, 0)
        full = faults.fail("pwritev", errno.ENOSPC)
        assert not (await _store(tier, [blocked], [1])).success
        assert tier.read_only and tier.metrics.disk_full_events == 1

        opens = faults.calls["open"]
        refused = await _store(tier, [blocked], [1])
        assert "read-only" in (refused.error or "")
        assert faults.calls["open"] == opens  # refused without touching the disk

        assert (await _load(tier, [stored], [2])).success  # loads go on
        assert _slot(pool, 2) == expected

        faults.remove(full)
        clock.now += 5
        assert (await _store(tier, [later], [3])).success
        assert not tier.read_only
        assert (await _store(tier, [blocked], [1])).success


async def test_enospc_probe_that_fails_again_stays_read_only(
    pool: memoryview, tmp_path: Path
) -> None:
    faults = FaultInjector()
    clock = FakeClock()
    async with _tier(pool, tmp_path, os_calls=faults, clock=clock, enospc_retry_s=5) as tier:
        faults.fail("pwritev", errno.ENOSPC)
        await _store(tier, [b"a"], [0])
        clock.now += 5
        writes = faults.calls["pwritev"]
        assert not (await _store(tier, [b"b"], [1])).success
        assert faults.calls["pwritev"] == writes + 1  # the probe really tried
        assert tier.read_only and tier.metrics.disk_full_events == 1


def _mount_tmpfs(target: Path, size: str) -> str | None:
    """Mount a small tmpfs; returns why not when that is not permitted here."""
    if not sys.platform.startswith("linux"):
        return "tmpfs mounts need Linux"
    try:
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(target)],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"cannot run mount: {exc}"
    return None if done.returncode == 0 else f"mount refused: {done.stderr.strip()}"


async def test_real_full_file_system_turns_read_only_and_recovers(
    pool: memoryview, tmp_path: Path
) -> None:
    root = tmp_path / "small"
    root.mkdir()
    reason = _mount_tmpfs(root, "1m")
    if reason is not None:
        pytest.skip(f"no small real file system for ENOSPC: {reason}")
    try:
        clock = FakeClock()
        async with _tier(pool, root, clock=clock, enospc_retry_s=1) as tier:
            filler = root / "filler"
            room = os.statvfs(root).f_bavail * os.statvfs(root).f_frsize
            filler.write_bytes(bytes(room - 3 * FILE - FILE // 2))
            keys = _keys(6)
            result = await _store(tier, keys, range(6))
            assert 1 <= tier.get_num_blocks() <= 3
            assert tier.read_only and not result.success
            held = [k for k in keys if tier.lookup(k)]
            assert (await _load(tier, held, range(8, 8 + len(held)))).success
            filler.unlink()
            clock.now += 1
            missing = [k for k in keys if not tier.lookup(k)]
            assert (await _store(tier, missing, range(6, 6 + len(missing)))).success
            assert not tier.read_only and tier.get_num_blocks() == 6
    finally:
        _umount(root)


def _umount(target: Path) -> None:
    subprocess.run(["umount", "-l", str(target)], check=False, timeout=10)


# -- two engines, crashes ----------------------------------------------------------------


class GatedWrites(OsCalls):
    """Real calls, but the first write once ``armed`` writes its first buffer, then waits."""

    def __init__(self) -> None:
        self.armed = True
        self.entered = threading.Event()
        self.gate = threading.Event()

    def pwritev(self, fd: int, buffers: Sequence[memoryview], offset: int) -> int:
        if self.armed and not self.entered.is_set():
            written = super().pwritev(fd, [buffers[0]], offset)
            self.entered.set()
            self.gate.wait(10)
            return written
        return super().pwritev(fd, buffers, offset)


async def test_two_engines_on_one_root_never_corrupt_each_other(
    pool: memoryview, tmp_path: Path
) -> None:
    (slow_key,) = _keys(1, "slow")
    gated = GatedWrites()
    async with _tier(pool, tmp_path, os_calls=gated) as first:
        write = JobMetadata(next_job_id(), [slow_key], [0])
        first.submit_store(write)
        await _until(gated.entered)  # a half-written record of `first` is on disk
        async with _tier(pool, tmp_path) as second:
            # The half-written segment is a live writer's: left alone.
            assert sum(second.metrics.removed_on_recovery.values()) == 0
            shared = _keys(3, "shared")
            both = await asyncio.gather(
                _store(second, shared, [1, 2, 3]), _store(first, shared, [1, 2, 3])
            )
            assert all(r.success for r in both)
            gated.gate.set()
            assert (await first.result(write.job_id)).success
            expected = [_slot(pool, i) for i in range(4)]
            assert (await _load(second, shared, [5, 6, 7])).success
            assert (await _load(first, [slow_key, *shared], [8, 9, 10, 11])).success
            assert [_slot(pool, i) for i in (8, 9, 10, 11)] == expected
            assert [_slot(pool, i) for i in (5, 6, 7)] == expected[1:]


# -- clear, close, options ---------------------------------------------------------------


async def test_clear_drops_everything_and_close_removes_the_files(
    pool: memoryview, tmp_path: Path
) -> None:
    async with _tier(pool, tmp_path) as tier:
        keys = _keys(3)
        await _store(tier, keys, range(3))
        tier.clear()
        assert tier.get_num_blocks() == 0 and not any(tier.lookup(k) for k in keys)
        assert not (await _load(tier, keys[:1], [5])).success
    assert _segment_files(tier) == []
    assert os.listdir(os.path.join(tier.directory, "owners")) == []


async def test_clear_then_store_again_keeps_the_new_block(tier: NVMeTier, pool: memoryview) -> None:
    (key,) = _keys(1)
    await _store(tier, [key], [0])
    tier.clear()
    await _store(tier, [key], [1])
    await _store(tier, [b"other"], [2])  # purges the trash in its hop
    expected = _slot(pool, 1)
    assert (await _load(tier, [key], [3])).success
    assert _slot(pool, 3) == expected


async def test_a_cleared_key_refused_for_room_still_has_its_file_removed(
    pool: memoryview, tmp_path: Path
) -> None:
    cleared = _keys(2, "cleared")
    fresh = _keys(2, "fresh")
    async with _tier(pool, tmp_path, capacity_bytes=2 * FILE) as tier:
        await _store(tier, cleared, [0, 1])
        tier.clear()
        result = await _store(tier, [*fresh, cleared[0]], [2, 3, 0])
        assert result.failed_keys == (cleared[0],)
        kept = sorted(os.path.basename(_record(tier, k)[0]) for k in fresh)
    assert _segment_files(tier) == kept


async def test_clear_while_a_store_runs_keeps_its_keys_out(
    pool: memoryview, tmp_path: Path
) -> None:
    (key,) = _keys(1)
    gated = GatedWrites()
    async with _tier(pool, tmp_path, os_calls=gated) as tier:
        job = JobMetadata(next_job_id(), [key], [0])
        tier.submit_store(job)
        await _until(gated.entered)
        tier.clear()
        gated.gate.set()
        await tier.result(job.job_id)
        assert tier.lookup(key) is False and tier.get_num_blocks() == 0
    assert _segment_files(tier) == []


async def test_concurrent_starts_open_the_directory_once(pool: memoryview, tmp_path: Path) -> None:
    tier = _tier(pool, tmp_path)
    await asyncio.gather(tier.start(), tier.start())
    try:
        assert len(os.listdir(os.path.join(tier.directory, "owners"))) == 1
    finally:
        await tier.aclose()


async def test_a_cancelled_start_holds_no_lock_and_leaves_no_file_half_made(
    pool: memoryview, tmp_path: Path
) -> None:
    faults = FaultInjector()
    probing = faults.hold("open", path="odirect-probe")  # the owner lock is taken by then
    tier = _tier(pool, tmp_path, os_calls=faults)
    starting = asyncio.create_task(tier.start())
    assert await asyncio.to_thread(probing.wait_reached, 30)
    starting.cancel()
    probing.open()
    with pytest.raises(asyncio.CancelledError):
        await starting
    await tier.aclose()
    assert os.listdir(os.path.join(tier.directory, "owners")) == []
    assert sorted(os.listdir(tier.directory)) == ["NAMESPACE", "owners", "segments"]
    async with _tier(pool, tmp_path) as again:
        assert again.get_num_blocks() == 0


class CountingHops(NVMeTier):
    hops = 0

    async def run_blocking(self, fn: Any, /, *args: Any) -> Any:
        self.hops += 1
        return await super().run_blocking(fn, *args)


async def test_each_job_is_one_executor_hop(pool: memoryview, tmp_path: Path) -> None:
    tier = CountingHops(
        pool,
        BLOCK,
        root=tmp_path,
        namespace=NAMESPACE,
        capacity_bytes=64 * FILE,
        min_free_bytes=0,
        clock=FakeClock(),
    )
    async with tier:
        keys = _keys(8)
        before = tier.hops
        assert (await _store(tier, keys, range(8))).success
        assert (await _load(tier, keys, range(8, 16))).success
        assert tier.hops - before == 2


async def test_start_brings_up_every_io_thread_before_serving(
    pool: memoryview, tmp_path: Path
) -> None:
    # Started lazily, a thread would start inside a job: the loop waits for its start
    # handshake and shares the GIL with its initializer in the middle of the data path.
    async with _tier(pool, tmp_path, io_threads=3) as tier:
        started = set(tier._executor._threads)  # type: ignore[attr-defined]
        assert len(started) == 3
        keys = _keys(8)
        assert (await _store(tier, keys, range(8))).success
        assert set(tier._executor._threads) == started  # type: ignore[attr-defined]


async def test_closed_tier_refuses_jobs(pool: memoryview, tmp_path: Path) -> None:
    tier = _tier(pool, tmp_path)
    await tier.start()
    await tier.aclose()
    with pytest.raises(ClosedError):
        tier.submit_store(JobMetadata(1, [b"a"], [0]))
    with pytest.raises(ClosedError):
        await tier.start()


async def test_shutdown_releases_the_owner_lock(pool: memoryview, tmp_path: Path) -> None:
    tier = _tier(pool, tmp_path)
    await tier.start()
    tier.shutdown()
    tier.shutdown()
    assert os.listdir(os.path.join(tier.directory, "owners")) == []


async def test_shutdown_from_another_thread_keeps_the_owner_lock_until_the_loop_stops(
    pool: memoryview, tmp_path: Path
) -> None:
    (key,) = _keys(1)
    gated = GatedWrites()
    tier = _tier(pool, tmp_path, os_calls=gated)
    await tier.start()
    job = JobMetadata(next_job_id(), [key], [0])
    tier.submit_store(job)
    await _until(gated.entered)  # our temp file is on disk, mid-write
    lock_held_after_call: list[bool] = []

    def stop_from_another_thread() -> None:
        tier.shutdown()
        lock_held_after_call.append(owner_alive(tier.directory, tier._instance_id))

    # Join on the loop thread, so the stop the call schedules cannot run before the check.
    thread = threading.Thread(target=stop_from_another_thread)
    thread.start()
    thread.join(10)
    gated.gate.set()
    assert lock_held_after_call == [True]
    assert not (await tier.result(job.job_id)).success
    assert not owner_alive(tier.directory, tier._instance_id)
    await asyncio.to_thread(tier._executor.shutdown, True)  # the write ends before the pool
    gc.collect()  # the cancelled hop's frames still reference slots of the pool


async def test_o_direct_refusal_falls_back_with_one_log_line(
    pool: memoryview, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    faults = FaultInjector()
    faults.fail("open", errno.EINVAL, path="odirect-probe")
    with caplog.at_level(logging.WARNING, logger="backends.nvme.tier"):
        async with _tier(pool, tmp_path, os_calls=faults) as tier:
            assert tier.o_direct is False
            await _store(tier, [b"a"], [0])
            assert (await _load(tier, [b"a"], [1])).success
    lines = [r for r in caplog.records if "O_DIRECT" in r.getMessage()]
    assert len(lines) == 1 and "buffered" in lines[0].getMessage()


async def test_required_o_direct_that_is_refused_fails_start(
    pool: memoryview, tmp_path: Path
) -> None:
    faults = FaultInjector()
    faults.fail("open", errno.EINVAL, path="odirect-probe")
    tier = _tier(pool, tmp_path, os_calls=faults, o_direct=True)
    with pytest.raises(InvalidArgumentError, match="o_direct=True"):
        await tier.start()
    await tier.aclose()
    assert os.listdir(os.path.join(tier.directory, "owners")) == []


class RecordingOpens(OsCalls):
    def __init__(self) -> None:
        self.paths: list[str] = []

    def open(self, path: str, flags: int, mode: int = 0o644) -> int:
        self.paths.append(path)
        return super().open(path, flags, mode)


async def test_o_direct_false_is_never_probed(pool: memoryview, tmp_path: Path) -> None:
    recording = RecordingOpens()
    async with _tier(pool, tmp_path, os_calls=recording, o_direct=False) as tier:
        await _store(tier, [b"a"], [0])
        assert tier.o_direct is False
    assert recording.paths and not any("odirect-probe" in p for p in recording.paths)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"namespace": ""}, "namespace"),
        ({"capacity_bytes": FILE - 1}, "capacity_bytes"),
        ({"capacity_bytes": "lots"}, "capacity_bytes"),
        ({"min_free_bytes": 1.5}, "min_free_bytes"),
        ({"enospc_retry_s": float("nan")}, "enospc_retry_s"),
        ({"min_free_bytes": -1}, "min_free_bytes"),
        ({"fsync": "sometimes"}, "fsync"),
        ({"o_direct": "yes"}, "o_direct"),
        ({"max_inflight_bytes": 0}, "max_inflight_bytes"),
        ({"enospc_retry_s": -1}, "enospc_retry_s"),
        ({"io_threads": 0}, "io_threads"),
    ],
)
def test_bad_options_are_refused(
    pool: memoryview, tmp_path: Path, kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        _tier(pool, tmp_path, **kwargs)


def test_a_root_that_is_not_a_path_is_refused(pool: memoryview) -> None:
    with pytest.raises(InvalidArgumentError, match=r"^root = 42: Input should be a valid string"):
        NVMeTier(pool, BLOCK, root=42, namespace="n", capacity_bytes=64 * FILE)  # type: ignore[arg-type]


# -- the byte budget ---------------------------------------------------------------------


async def test_byte_budget_admits_waiting_loads_before_stores() -> None:
    budget = InflightBytes(100)
    await budget.acquire(100, is_load=False)
    order: list[str] = []

    async def take(name: str, is_load: bool) -> None:
        await budget.acquire(60, is_load=is_load)
        order.append(name)

    store = asyncio.create_task(take("store", False))
    await asyncio.sleep(0)
    load = asyncio.create_task(take("load", True))
    await asyncio.sleep(0)
    budget.release(100)
    await load
    assert order == ["load"] and not store.done()
    budget.release(60)
    await store
    assert order == ["load", "store"] and budget.used == 60


async def test_byte_budget_lets_an_oversized_job_run_alone() -> None:
    budget = InflightBytes(10)
    await budget.acquire(1000, is_load=True)
    assert budget.used == 1000
    budget.release(1000)
    assert budget.used == 0


async def test_cancelled_budget_waiter_gives_its_place_back() -> None:
    budget = InflightBytes(10)
    await budget.acquire(10, is_load=False)
    waiter = asyncio.create_task(budget.acquire(10, is_load=True))
    await asyncio.sleep(0)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    budget.release(10)
    assert budget.used == 0
    await budget.acquire(10, is_load=False)
    assert budget.used == 10


# -- private by default -----------------------------------------------------------------


def _modes(root: Path) -> tuple[set[int], set[int]]:
    """The permission bits of every directory and every file under ``root``."""
    dirs, files = set(), set()
    for path in root.rglob("*"):
        (dirs if path.is_dir() else files).add(stat.S_IMODE(path.stat().st_mode))
    return dirs, files


async def test_the_tier_keeps_its_files_and_directories_to_its_user(
    pool: memoryview, tmp_path: Path
) -> None:
    spec = {"type": "nvme", "root": str(tmp_path / "kv"), "namespace": NAMESPACE,
            "capacity_bytes": 64 * FILE, "min_free_bytes": 0}  # fmt: skip
    tier = make_tier(spec, pool, BLOCK)
    await tier.start()
    try:
        assert (await _store(tier, _keys(3), range(3))).success
    finally:
        await tier.aclose()
    dirs, files = _modes(tmp_path / "kv")
    assert dirs == {0o700} and files and files <= {0o600}
    assert stat.S_IMODE((tmp_path / "kv").stat().st_mode) == 0o700


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o1777])
async def test_a_root_others_can_write_to_is_refused(
    pool: memoryview, tmp_path: Path, mode: int
) -> None:
    root = tmp_path / "shared"
    root.mkdir()
    root.chmod(mode)
    tier = _tier(pool, root)
    with pytest.raises(InvalidArgumentError, match=rf"root: .*has mode {mode:o}"):
        await tier.start()
    assert list(root.iterdir()) == []  # nothing made in it


async def test_a_namespace_directory_that_is_a_link_out_of_the_root_is_refused(
    pool: memoryview, tmp_path: Path
) -> None:
    root, elsewhere = tmp_path / "root", tmp_path / "elsewhere"
    root.mkdir(mode=0o700)
    elsewhere.mkdir(mode=0o700)
    (root / namespace_dirname(NAMESPACE)).symlink_to(elsewhere)
    with pytest.raises(InvalidArgumentError, match="symbolic link"):
        await _tier(pool, root).start()
    assert list(elsewhere.iterdir()) == []  # nothing written through the link


async def test_a_segment_swapped_for_a_link_is_not_followed(
    pool: memoryview, tmp_path: Path
) -> None:
    keys = _keys(2)
    async with _tier(pool, tmp_path) as tier:
        assert (await _store(tier, keys, [0, 1])).success
        second, _ = _record(tier, keys[1])
        decoy = tmp_path / "decoy"
        shutil.copy(second, decoy)  # the same segment, outside the root
        os.unlink(second)
        os.symlink(decoy, second)
        result = await _load(tier, keys, [5, 6])
        assert result.failed_keys == (keys[1],)  # never read through the link
