"""Tests of backends.nvme.tier.NVMeTier's segments: placement, checkpoint, recovery, eviction."""

from __future__ import annotations

import asyncio
import errno
import os
import signal
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from backends.nvme.segment_format import (
    CHECKPOINT_FILE,
    IDENTITY_FILE,
    SEGMENTS_DIR,
    namespace_dirname,
)
from backends.nvme.segments import SegmentFiles
from backends.nvme.tier import NVMeTier
from tests._engine_helpers import make_kv
from tests._faults import FaultInjector
from tests._nvme_helpers import checkpoint_read, next_job_id, random_pool
from tests._nvme_helpers import load_job as load
from tests._nvme_helpers import store_job as store
from tiering import TieringEngine
from tiering.errors import InvalidArgumentError, TieringError
from tiering.security.encryption import Keyring
from tiering.tiers.block_record import HEADER_BYTES, namespace_digest
from tiering.tiers.registry import make_tier
from tiering.tiers.tier_api import JobMetadata

BLOCK = 16 << 10
RECORD = HEADER_BYTES + BLOCK
SLOTS = 16
NAMESPACE = "model=tiny;layout=segments"
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def pool() -> Iterator[memoryview]:
    with random_pool(BLOCK, SLOTS) as view:
        yield view


def tier(pool: memoryview, root: Path, **kwargs: Any) -> NVMeTier:
    options: dict[str, Any] = {
        "root": root,
        "namespace": NAMESPACE,
        "capacity_bytes": 64 * RECORD,
        "min_free_bytes": 0,
        "segment_bytes": HEADER_BYTES + 8 * RECORD,  # 8 records a segment
    }
    options.update(kwargs)
    return NVMeTier(pool, BLOCK, **options)


def slot(pool: memoryview, i: int) -> bytes:
    return bytes(pool[i * BLOCK : (i + 1) * BLOCK])


def keys(n: int, tag: str = "k") -> list[bytes]:
    return [f"{tag}-{i}-".encode() + os.urandom(16) for i in range(n)]


def flip_byte(path: str, offset: int) -> None:
    with open(path, "r+b") as file:
        file.seek(offset)
        byte = file.read(1)
        file.seek(offset)
        file.write(bytes([byte[0] ^ 1]))


def start_writer(script: str, root: Path, where: str) -> subprocess.Popen[bytes]:
    """A child process running ``script`` with the root, the block size and ``where``."""
    return subprocess.Popen(
        [sys.executable, "-c", script, str(root), str(BLOCK), where],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )


def kill_9(child: subprocess.Popen[bytes]) -> None:
    """SIGKILL ``child``, wait for it, and close its pipes."""
    child.send_signal(signal.SIGKILL)
    child.wait(10)
    assert child.stdout is not None and child.stderr is not None
    child.stdout.close()
    child.stderr.close()


def segment_files(t: NVMeTier) -> list[str]:
    return sorted(os.listdir(os.path.join(t.directory, SEGMENTS_DIR)))


@pytest.mark.parametrize("gil_pause_bytes", [0, 1, 128 << 10])  # never, every record, default
async def test_store_then_load_is_byte_exact_and_blocks_share_segment_files(
    pool: memoryview, tmp_path: Path, gil_pause_bytes: int
) -> None:
    names = keys(10)
    expected = [slot(pool, i) for i in range(10)]
    async with tier(pool, tmp_path, gil_pause_bytes=gil_pause_bytes) as t:
        assert (await store(t, names, range(10))).success
        assert all(t.lookup(k) for k in names) and t.lookup(b"other") is False
        pool[: 10 * BLOCK] = bytes(10 * BLOCK)
        assert (await load(t, names, range(10))).success
        assert [slot(pool, i) for i in range(10)] == expected
        assert len(segment_files(t)) == 2  # 8 records, then 2
        assert t.get_num_blocks() == 10 and t.used_bytes == 10 * RECORD


@pytest.mark.parametrize("sealed", [False, True])
async def test_staged_io_round_trips_byte_exact_and_still_verifies(
    pool: memoryview, tmp_path: Path, sealed: bool
) -> None:
    """With ``staging_bytes`` (three records a call here) blocks move through the I/O
    threads' staging buffers, encrypted or not, and a damaged record is still a miss."""
    encryption = Keyring({1: os.urandom(32)}, 1) if sealed else None
    names = keys(10)
    expected = [slot(pool, i) for i in range(10)]
    async with tier(pool, tmp_path, staging_bytes=3 * RECORD, encryption=encryption) as t:
        if not t.o_direct:
            pytest.skip("staging applies to direct I/O only")
        assert t.staging_bytes == 3 * RECORD
        assert (await store(t, names, range(10))).success
        pool[: 10 * BLOCK] = bytes(10 * BLOCK)
        assert (await load(t, names, range(10))).success
        assert [slot(pool, i) for i in range(10)] == expected
        first = os.path.join(t.directory, SEGMENTS_DIR, segment_files(t)[0])
        flip_byte(first, HEADER_BYTES + 2 * RECORD + HEADER_BYTES + 7)  # record 2's payload
        result = await load(t, names[:4], range(4))
        assert set(result.failed_keys) == {names[2]}
        assert [slot(pool, i) for i in (0, 1, 3)] == [expected[i] for i in (0, 1, 3)]
        assert t.lookup(names[2]) is False


async def test_a_store_job_is_one_write_per_segment_it_touches(
    pool: memoryview, tmp_path: Path
) -> None:
    faults = FaultInjector()
    async with tier(pool, tmp_path, os_calls=faults, fsync="none") as t:
        faults.calls.clear()
        assert (await store(t, keys(6), range(6))).success
        assert faults.calls["pwritev"] == 2  # the new segment's header, then six records
        assert faults.calls["open"] == 1


async def test_a_graceful_restart_reads_the_checkpoint_not_the_records(
    pool: memoryview, tmp_path: Path
) -> None:
    names = keys(12)
    expected = [slot(pool, i) for i in range(12)]
    async with tier(pool, tmp_path) as t:
        assert (await store(t, names, range(12))).success
    assert (tmp_path / namespace_dirname(NAMESPACE) / CHECKPOINT_FILE).exists()
    faults = FaultInjector()
    async with tier(pool, tmp_path, os_calls=faults) as t:
        assert faults.calls["preadv"] <= 2  # the O_DIRECT probe; no record header read
        assert t.metrics.recovered_blocks == 12 and all(t.lookup(k) for k in names)
        pool[: 12 * BLOCK] = bytes(12 * BLOCK)
        assert (await load(t, names, range(12))).success
        assert [slot(pool, i) for i in range(12)] == expected


async def test_records_written_after_the_checkpoint_are_found_by_scanning(
    pool: memoryview, tmp_path: Path
) -> None:
    first, later = keys(4, "first"), keys(5, "later")
    async with tier(pool, tmp_path) as t:
        assert (await store(t, first, range(4))).success
    t = tier(pool, tmp_path)
    await t.start()
    assert (await store(t, later, range(4, 9))).success
    t.shutdown()  # a hard stop: no checkpoint of `later`
    await asyncio.sleep(0.05)
    async with tier(pool, tmp_path) as again:
        assert again.metrics.recovered_blocks == 9
        assert (await load(again, first + later, range(9))).success


@pytest.mark.parametrize("damage", ["flip", "truncate", "garbage"])
async def test_a_damaged_checkpoint_costs_nothing_but_a_scan(
    pool: memoryview, tmp_path: Path, damage: str
) -> None:
    names = keys(10)
    expected = [slot(pool, i) for i in range(10)]
    async with tier(pool, tmp_path) as t:
        assert (await store(t, names, range(10))).success
    path = tmp_path / namespace_dirname(NAMESPACE) / CHECKPOINT_FILE
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[len(data) - 3] ^= 0x40
    elif damage == "truncate":
        del data[len(data) // 2 :]
    else:
        data = bytearray(os.urandom(len(data)))
    path.write_bytes(bytes(data))
    async with tier(pool, tmp_path) as t:
        assert t.metrics.recovered_blocks == 10
        pool[: 10 * BLOCK] = bytes(10 * BLOCK)
        assert (await load(t, names, range(10))).success
        assert [slot(pool, i) for i in range(10)] == expected


async def test_a_stale_checkpoint_never_serves_wrong_bytes(
    pool: memoryview, tmp_path: Path
) -> None:
    names = keys(8)
    async with tier(pool, tmp_path) as t:
        assert (await store(t, names, range(8))).success
    directory = tmp_path / namespace_dirname(NAMESPACE)
    stale = (directory / CHECKPOINT_FILE).read_bytes()
    async with tier(pool, tmp_path) as t:
        t.clear()  # every block dropped; the close deletes the segments
    (directory / CHECKPOINT_FILE).write_bytes(stale)  # as if the new one never landed
    async with tier(pool, tmp_path) as t:
        assert t.get_num_blocks() == 0
        assert not any(t.lookup(k) for k in names)
        result = await load(t, names[:2], [0, 1])
        assert not result.success and set(result.failed_keys) == set(names[:2])


async def test_a_truncated_segment_keeps_the_records_before_the_cut(
    pool: memoryview, tmp_path: Path
) -> None:
    names = keys(6)
    expected = [slot(pool, i) for i in range(6)]
    async with tier(pool, tmp_path) as t:
        assert (await store(t, names, range(6))).success
        [segment] = segment_files(t)
        path = os.path.join(t.directory, SEGMENTS_DIR, segment)
    os.truncate(path, HEADER_BYTES + 3 * RECORD + 100)  # records 3.. torn or gone
    async with tier(pool, tmp_path) as t:
        assert [bool(t.lookup(k)) for k in names[:3]] == [True] * 3
        pool[: 6 * BLOCK] = bytes(6 * BLOCK)
        assert (await load(t, names[:3], range(3))).success
        assert [slot(pool, i) for i in range(3)] == expected[:3]
        result = await load(t, names[3:], range(3, 6))
        assert set(result.failed_keys) == set(names[3:])
        assert not any(t.lookup(k) for k in names[3:])  # now misses


async def test_a_flipped_byte_is_a_failed_key_and_then_a_miss(
    pool: memoryview, tmp_path: Path
) -> None:
    names = keys(3)
    async with tier(pool, tmp_path) as t:
        assert (await store(t, names, range(3))).success
        [segment] = segment_files(t)
        flip_byte(
            os.path.join(t.directory, SEGMENTS_DIR, segment),
            HEADER_BYTES + RECORD + HEADER_BYTES + 7,
        )
        result = await load(t, names, [8, 9, 10])
        assert result.failed_keys == (names[1],) and "checksum" in str(result.error)
        assert t.lookup(names[1]) is False and t.lookup(names[0])
        assert t.metrics.corrupt_blocks == 1


async def test_the_cap_evicts_the_oldest_segment_whole(pool: memoryview, tmp_path: Path) -> None:
    async with tier(pool, tmp_path, capacity_bytes=16 * RECORD) as t:
        old, mid, new = keys(8, "old"), keys(8, "mid"), keys(8, "new")
        for batch in (old, mid, new):
            assert (await store(t, batch, range(8))).success
        assert not any(t.lookup(k) for k in old)
        assert all(t.lookup(k) for k in mid + new)
        assert len(segment_files(t)) == 2 and t.metrics.evicted_blocks == 8


async def test_removals_name_the_evicted_keys_once_asked_for(
    pool: memoryview, tmp_path: Path
) -> None:
    async with tier(pool, tmp_path, capacity_bytes=16 * RECORD) as t:
        old, mid, new = keys(8, "old"), keys(8, "mid"), keys(8, "new")
        assert (await store(t, old, range(8))).success
        assert (await store(t, mid, range(8))).success
        assert (await store(t, new[:4], range(4))).success  # evicts old, unasked
        assert t.take_removed() == []
        t.report_removals()
        assert (await store(t, new[4:], range(4, 8))).success  # fills the third segment
        assert (await store(t, keys(1, "last"), [0])).success  # evicts mid
        assert sorted(t.take_removed()) == sorted(mid)
        assert t.take_removed() == []  # each key is taken once


async def test_removals_name_the_hot_blocks_that_could_not_be_moved_and_skip_moved_ones(
    pool: memoryview, tmp_path: Path
) -> None:
    async with tier(pool, tmp_path, capacity_bytes=16 * RECORD, hot_fraction=0.25) as t:
        t.report_removals()
        old, mid = keys(8, "old"), keys(8, "mid")
        assert (await store(t, old, range(8))).success
        assert (await store(t, mid, range(8, 16))).success
        assert (await load(t, old[:2], [14, 15])).success  # old[0] and old[1] are hot now
        assert (await store(t, keys(6, "new"), range(8, 14))).success  # evicts old
        assert sorted(t.take_removed()) == sorted(old[2:])  # the hot two were moved


async def test_a_block_that_fails_verification_is_a_removal(
    pool: memoryview, tmp_path: Path
) -> None:
    names = keys(3)
    async with tier(pool, tmp_path) as t:
        t.report_removals()
        assert (await store(t, names, range(3))).success
        [segment] = segment_files(t)
        flip_byte(
            os.path.join(t.directory, SEGMENTS_DIR, segment),
            HEADER_BYTES + RECORD + HEADER_BYTES + 7,
        )
        assert not (await load(t, names, [8, 9, 10])).success
        assert t.take_removed() == [names[1]]


async def test_a_segment_being_read_is_not_evicted_under_the_read(
    pool: memoryview, tmp_path: Path
) -> None:
    faults = FaultInjector()
    async with tier(pool, tmp_path, capacity_bytes=16 * RECORD, os_calls=faults) as t:
        old = keys(8, "old")
        assert (await store(t, old, range(8))).success
        expected = slot(pool, 0)
        gate = faults.hold("preadv", path=SEGMENTS_DIR)
        reading = JobMetadata(next_job_id(), [old[0]], [15])
        t.submit_load(reading)
        await asyncio.to_thread(gate.wait_reached, 10)
        # Two more segments' worth: the oldest one is pinned, so only one fits.
        first = await store(t, keys(8, "a"), range(8))
        second = await store(t, keys(8, "b"), range(8))
        assert first.success and not second.success
        assert "in use" in str(second.error)
        gate.open()
        assert (await t.result(reading.job_id)).success
        assert slot(pool, 15) == expected
        third = await store(t, keys(8, "c"), range(8))  # the read ended: now it goes
        assert third.success and not t.lookup(old[1])


async def test_disk_full_turns_stores_read_only_and_loads_go_on(
    pool: memoryview, tmp_path: Path
) -> None:
    faults = FaultInjector()
    async with tier(pool, tmp_path, os_calls=faults, enospc_retry_s=3600) as t:
        kept = keys(2)
        assert (await store(t, kept, [0, 1])).success
        faults.fail("pwritev", errno.ENOSPC)
        result = await store(t, keys(2), [2, 3])
        assert not result.success and t.read_only
        refused = await store(t, keys(1), [4])
        assert "full" in str(refused.error)
        assert (await load(t, kept, [8, 9])).success


async def test_clear_drops_everything_and_close_deletes_the_segments(
    pool: memoryview, tmp_path: Path
) -> None:
    async with tier(pool, tmp_path) as t:
        names = keys(10)
        assert (await store(t, names, range(10))).success
        t.clear()
        assert t.get_num_blocks() == 0 and not t.lookup(names[0])
        assert (await store(t, names[:1], [0])).success  # the log goes on after a clear
    async with tier(pool, tmp_path) as t:
        assert t.get_num_blocks() == 1 and len(segment_files(t)) == 1


async def test_registered_as_nvme_and_round_trips_through_the_engine(
    tmp_path: Path,
) -> None:
    spec = {"type": "nvme", "root": str(tmp_path), "capacity_bytes": 1 << 24}
    kv = make_kv(1)
    ids = [20, 21, 22]
    expected = kv[0][ids].clone()
    names = [f"engine-{i}".encode() for i in range(3)]
    async with TieringEngine(kv, 4, secondary_tiers=[spec]) as engine:
        assert (await engine.store(names, ids)).success
        assert isinstance(engine.tiers[0], NVMeTier)
    kv[0][ids] = 0
    async with TieringEngine(kv, 4, secondary_tiers=[spec]) as engine:
        assert engine.lookup(names) == 3
        assert (await engine.load(names, [25, 26, 27])).success
    assert torch.equal(kv[0][[25, 26, 27]], expected)


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("segment_bytes", 0),
        ("checkpoint_every", -1),
        ("hot_fraction", 1.5),
        ("block_bytes", 0),
        ("gil_pause_bytes", -1),
        ("staging_bytes", -1),
    ],
)
def test_a_bad_option_is_refused_naming_it_and_its_value(
    pool: memoryview, tmp_path: Path, name: str, value: object
) -> None:
    spec = {"type": "nvme", "root": str(tmp_path), "namespace": "x", "capacity_bytes": 1 << 20}
    block = BLOCK
    if name == "block_bytes":
        block = 0
    else:
        spec[name] = value
    with pytest.raises(InvalidArgumentError, match=f"{name}.*{value}"):
        make_tier(spec, pool, block)
    assert not (tmp_path / namespace_dirname("x")).exists()  # nothing was created


@pytest.mark.parametrize(
    "options",
    [
        {"capacity_bytes": 16 * RECORD, "segment_bytes": HEADER_BYTES + 16 * RECORD},
        {"capacity_bytes": 16 * RECORD, "segment_bytes": 256 << 20},
        {"capacity_bytes": 23 * RECORD, "segment_bytes": HEADER_BYTES + 12 * RECORD},
    ],
)
def test_a_cap_of_fewer_than_two_segments_is_refused_naming_both_options(
    pool: memoryview, tmp_path: Path, options: dict[str, int]
) -> None:
    spec = {"type": "nvme", "root": str(tmp_path), "namespace": "x", **options}
    with pytest.raises(InvalidArgumentError, match=r"capacity_bytes=.*segment_bytes="):
        make_tier(spec, pool, BLOCK)
    assert not (tmp_path / namespace_dirname("x")).exists()  # nothing was created


def test_a_cap_of_one_record_is_refused_without_segment_bytes(
    pool: memoryview, tmp_path: Path
) -> None:
    spec = {"type": "nvme", "root": str(tmp_path), "namespace": "x", "capacity_bytes": RECORD}
    with pytest.raises(InvalidArgumentError, match="capacity_bytes="):
        make_tier(spec, pool, BLOCK)


async def test_without_segment_bytes_a_small_cap_holds_eight_segments_and_keeps_storing(
    pool: memoryview, tmp_path: Path
) -> None:
    options = {"capacity_bytes": 16 * RECORD, "min_free_bytes": 0}
    t = NVMeTier(pool, BLOCK, root=tmp_path, namespace=NAMESPACE, **options)
    assert t.records_per_segment == 2
    async with t:
        t.report_removals()
        stored: list[bytes] = []
        for _ in range(24):  # six caps' worth, a quarter of the cap a job
            batch = keys(4)
            assert (await store(t, batch, range(4))).success
            stored += batch
        held = [k for k in stored if t.lookup(k)]
        assert len(held) == 16 and held == stored[-16:]
        assert sorted(t.take_removed()) == sorted(stored[:-16])  # every other one is named
        assert len(segment_files(t)) == 8


_CRASHING_WRITER = textwrap.dedent(
    """
    import asyncio, mmap, sys
    from backends.nvme.tier import NVMeTier
    from backends.nvme.os_calls import OsCalls
    from tiering.tiers.tier_api import JobMetadata

    BLOCK = int(sys.argv[2])
    WHERE = sys.argv[3]  # "records" or "checkpoint"

    class HangMidWrite(OsCalls):
        armed = False
        paths = {}
        def open(self, path, flags, mode=0o644):
            fd = super().open(path, flags, mode)
            self.paths[fd] = path
            return fd
        def pwritev(self, fd, buffers, offset):
            target = WHERE == "records" or self.paths.get(fd, "").endswith(".tmp")
            if self.armed and target:
                done = super().pwritev(fd, buffers[:1], offset)  # one buffer, then hang
                print("MID-WRITE", flush=True)
                import time; time.sleep(60)
                return done
            return super().pwritev(fd, buffers, offset)

    async def main():
        buffer = mmap.mmap(-1, BLOCK * 4)
        for i in range(4):
            buffer[i * BLOCK:(i + 1) * BLOCK] = bytes([i + 1]) * BLOCK
        calls = HangMidWrite()
        tier = NVMeTier(memoryview(buffer), BLOCK, root=sys.argv[1], namespace="crash",
                               capacity_bytes=1 << 24, min_free_bytes=0, fsync="none",
                               checkpoint_every=2, os_calls=calls)
        await tier.start()
        tier.submit_store(JobMetadata(1, [b"done-1", b"done-2"], [0, 1]))
        assert (await tier.result(1)).success  # and a checkpoint of both was written
        if WHERE == "records":
            calls.armed = True
            tier.submit_store(JobMetadata(2, [b"torn-1", b"torn-2"], [2, 3]))
            await tier.result(2)
        else:
            tier.submit_store(JobMetadata(2, [b"more-1"], [2]))
            await tier.result(2)
            calls.armed = True  # the next checkpoint (after more-2) hangs half written
            tier.submit_store(JobMetadata(3, [b"more-2"], [3]))
            await tier.result(3)

    asyncio.run(main())
    """
)


@pytest.mark.parametrize("where", ["records", "checkpoint"])
async def test_kill_9_mid_write_keeps_every_block_stored_before(
    pool: memoryview, tmp_path: Path, where: str
) -> None:
    child = start_writer(_CRASHING_WRITER, tmp_path, where)
    try:
        line = await asyncio.wait_for(asyncio.to_thread(child.stdout.readline), 60)  # type: ignore[union-attr]
        assert line.strip() == b"MID-WRITE", child.stderr.read() if child.stderr else line  # type: ignore[union-attr]
    finally:
        kill_9(child)
    directory = tmp_path / namespace_dirname("crash")
    if where == "checkpoint":
        assert list(directory.glob("*.tmp")), "the child should have died mid-checkpoint"
    async with NVMeTier(
        pool, BLOCK, root=tmp_path, namespace="crash", capacity_bytes=1 << 24, min_free_bytes=0
    ) as t:
        stored = [b"done-1", b"done-2"] + ([b"more-1", b"more-2"] if where == "checkpoint" else [])
        assert all(t.lookup(k) for k in stored)
        assert not t.lookup(b"torn-1") and not t.lookup(b"torn-2")
        assert (await load(t, stored, range(len(stored)))).success
        assert [slot(pool, i) for i in range(len(stored))] == [
            bytes([i + 1]) * BLOCK for i in range(len(stored))
        ]
        assert not list(directory.glob("*.tmp"))  # a dead writer's checkpoint temp is gone


async def test_recently_used_blocks_of_an_evicted_segment_are_moved_not_dropped(
    pool: memoryview, tmp_path: Path
) -> None:
    async with tier(pool, tmp_path, capacity_bytes=16 * RECORD, hot_fraction=0.25) as t:
        old, mid = keys(8, "old"), keys(8, "mid")
        expected = [slot(pool, i) for i in range(8)]
        assert (await store(t, old, range(8))).success
        assert (await store(t, mid, range(8, 16))).success
        assert (await load(t, old[:2], [14, 15])).success  # old[0] and old[1] are hot now
        new = keys(6, "new")
        assert (await store(t, new, range(8, 14))).success  # evicts the oldest segment
        assert t.metrics.relocated_blocks == 2
        assert [bool(t.lookup(k)) for k in old] == [True, True] + [False] * 6
        pool[: 2 * BLOCK] = bytes(2 * BLOCK)
        assert (await load(t, old[:2], [0, 1])).success
        assert [slot(pool, 0), slot(pool, 1)] == expected[:2]
        assert all(t.lookup(k) for k in mid + new)


async def test_without_a_hot_fraction_eviction_drops_every_block_of_the_segment(
    pool: memoryview, tmp_path: Path
) -> None:
    async with tier(pool, tmp_path, capacity_bytes=16 * RECORD, hot_fraction=0) as t:
        old = keys(8, "old")
        assert (await store(t, old, range(8))).success
        assert (await store(t, keys(8, "mid"), range(8))).success
        assert (await load(t, old[:2], [14, 15])).success
        assert (await store(t, keys(6, "new"), range(6))).success
        assert t.metrics.relocated_blocks == 0 and not any(t.lookup(k) for k in old)


async def test_two_live_tiers_on_one_root_share_blocks_and_never_evict_each_others_segments(
    pool: memoryview, tmp_path: Path
) -> None:
    ours, theirs = keys(8, "ours"), keys(8, "theirs")
    expected = [slot(pool, i) for i in range(8)]
    async with tier(pool, tmp_path) as first:
        assert (await store(first, theirs, range(8))).success  # a full segment of `first`
        async with tier(pool, tmp_path, capacity_bytes=24 * RECORD, hot_fraction=0) as second:
            assert all(second.lookup(k) for k in theirs)  # indexed at its start
            assert (await store(second, ours, range(8))).success
            shared = keys(2, "shared")
            both = await asyncio.gather(store(first, shared, [0, 1]), store(second, shared, [0, 1]))
            assert all(r.success for r in both)
            # Full: the oldest segment is first's, alive, so second evicts its own.
            assert (await store(second, keys(8, "more"), range(8))).success
            assert all(second.lookup(k) for k in theirs)
            assert not any(second.lookup(k) for k in ours)
            pool[: 8 * BLOCK] = bytes(8 * BLOCK)
            assert (await load(second, theirs, range(8))).success
            assert [slot(pool, i) for i in range(8)] == expected
            assert (await load(first, shared, [8, 9])).success
            assert (await load(second, shared, [10, 11])).success
            assert slot(pool, 8) == slot(pool, 10) and slot(pool, 9) == slot(pool, 11)


async def test_compaction_waits_for_a_load_of_the_segment_and_keeps_its_live_block(
    pool: memoryview, tmp_path: Path
) -> None:
    faults = FaultInjector()
    options = {"capacity_bytes": 24 * RECORD, "hot_fraction": 0, "os_calls": faults}
    async with tier(pool, tmp_path, **options) as t:
        a, b = keys(8, "a"), keys(8, "b")
        assert (await store(t, a, range(8))).success
        assert (await store(t, b, range(8))).success
        expected = slot(pool, 7)  # b[7]'s bytes
        assert (await store(t, keys(4, "c"), range(4))).success
        sparse = os.path.join(t.directory, SEGMENTS_DIR, segment_files(t)[1])
        for record in range(7):  # b[0..6] stop verifying, and leave the index when read
            flip_byte(sparse, HEADER_BYTES + record * RECORD + HEADER_BYTES + 5)
        assert set((await load(t, b[:7], range(7))).failed_keys) == set(b[:7])
        gate = faults.hold("preadv", path=SEGMENTS_DIR)
        reading = JobMetadata(next_job_id(), [b[7]], [15])
        t.submit_load(reading)
        await asyncio.to_thread(gate.wait_reached, 10)
        # The sparse segment is being read: the oldest one goes instead.
        assert (await store(t, keys(8, "d"), range(8))).success
        assert not any(t.lookup(k) for k in a) and t.lookup(b[7])
        gate.open()
        assert (await t.result(reading.job_id)).success and slot(pool, 15) == expected
        # Now it is compacted: b[7] moves to the head of the log.
        assert (await store(t, keys(8, "e"), range(8))).success
        assert t.metrics.relocated_blocks == 1
        assert os.path.basename(sparse) not in segment_files(t)
        pool[15 * BLOCK :] = bytes(BLOCK)
        assert (await load(t, [b[7]], [15])).success and slot(pool, 15) == expected


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def test_the_free_space_floor_evicts_segments_before_the_cap_binds(
    pool: memoryview, tmp_path: Path
) -> None:
    faults, clock = FaultInjector(), FakeClock()
    options = {"os_calls": faults, "clock": clock, "min_free_bytes": 100 * RECORD}
    async with tier(pool, tmp_path, hot_fraction=0, **options) as t:
        old, mid = keys(8, "old"), keys(8, "mid")
        assert (await store(t, old, range(8))).success
        assert (await store(t, mid, range(8))).success
        faults.report_free_bytes(104 * RECORD)  # four records above the floor
        clock.now += 10  # the figure measured by the last job is stale now
        new = keys(8, "new")
        assert (await store(t, new, range(8))).success  # needs the oldest segment's room
        assert not any(t.lookup(k) for k in old)
        assert all(t.lookup(k) for k in mid + new)


async def test_lookup_is_none_while_a_store_is_queued_and_other_namespaces_see_nothing(
    pool: memoryview, tmp_path: Path
) -> None:
    async with tier(pool, tmp_path) as t:
        key = b"pending"
        job = JobMetadata(next_job_id(), [key], [0])
        t.submit_store(job)
        assert t.lookup(key) is None and t.lookup(b"other") is False
        assert (await t.result(job.job_id)).success and t.lookup(key)
    async with tier(pool, tmp_path, namespace="another model") as other:
        assert other.lookup(key) is False and other.get_num_blocks() == 0


async def test_a_checkpoint_is_written_while_serving_and_a_hard_stop_loses_nothing(
    pool: memoryview, tmp_path: Path
) -> None:
    checkpoint = tmp_path / namespace_dirname(NAMESPACE) / CHECKPOINT_FILE
    names = keys(12)
    t = tier(pool, tmp_path, checkpoint_every=8)
    await t.start()
    assert (await store(t, names[:8], range(8))).success
    assert checkpoint.exists()  # written by the store job that reached 8 records
    assert (await store(t, names[8:], range(8, 12))).success
    t.shutdown()
    await asyncio.sleep(0.05)
    async with tier(pool, tmp_path) as again:
        assert again.metrics.recovered_blocks == 12
        assert (await load(again, names, range(12))).success


_OVERLAPPING_WRITER = textwrap.dedent(
    """
    import asyncio, mmap, sys
    from backends.nvme.tier import NVMeTier
    from tests._faults import FaultInjector
    from tiering.tiers.tier_api import JobMetadata

    ROOT, BLOCK, POINT = sys.argv[1], int(sys.argv[2]), sys.argv[3]

    def say(line):
        print(line, flush=True)

    async def wait_reached(rule):
        assert await asyncio.to_thread(rule.wait_reached, 30)

    async def main():
        buffer = mmap.mmap(-1, BLOCK * 8)
        for i in range(8):
            buffer[i * BLOCK:(i + 1) * BLOCK] = bytes([i + 1]) * BLOCK
        faults = FaultInjector()
        tier = NVMeTier(memoryview(buffer), BLOCK, root=ROOT, namespace="overlap",
                        capacity_bytes=1 << 24, min_free_bytes=0, checkpoint_every=2,
                        os_calls=faults)
        await tier.start()
        tier.submit_store(JobMetadata(1, [b"early-0", b"early-1"], [0, 1]))
        assert (await tier.result(1)).success  # a checkpoint of both follows
        say("STORED early-0 early-1")
        # Job 2 is held in its hop; job 3 overlaps it, lands and checkpoints first.
        op = "fdatasync" if POINT == "a-sync-held" else "pwritev"
        held = faults.hold(op, key=b"a-0" if op == "pwritev" else None)
        tier.submit_store(JobMetadata(2, [b"a-0"], [2]))  # short of a checkpoint
        await wait_reached(held)
        if POINT == "checkpoint-held":
            checkpoint = faults.hold("pwritev", path=".tmp")
            tier.submit_store(JobMetadata(3, [b"b-0", b"b-1"], [3, 4]))
            await wait_reached(checkpoint)
            say("READY")
            await asyncio.sleep(60)
        tier.submit_store(JobMetadata(3, [b"b-0", b"b-1"], [3, 4]))
        assert (await tier.result(3)).success  # its checkpoint is written by now
        say("STORED b-0 b-1")
        if POINT == "a-stored":
            held.open()
            assert (await tier.result(2)).success  # one block: no checkpoint follows
            say("STORED a-0")
        say("READY")
        await asyncio.sleep(60)

    asyncio.run(main())
    """
)


@pytest.mark.parametrize("point", ["a-write-held", "a-sync-held", "a-stored", "checkpoint-held"])
async def test_kill_9_while_store_jobs_overlap_keeps_every_block_stored_before(
    pool: memoryview, tmp_path: Path, point: str
) -> None:
    """Two store jobs overlap: the second lands and writes a checkpoint while the first
    is still in its hop (at ``point``). After a kill -9, every block whose store was
    reported before the kill is found and loads byte-exact; a block still in flight is
    a miss or loads byte-exact, never wrong."""
    child = start_writer(_OVERLAPPING_WRITER, tmp_path, point)
    stored: list[bytes] = []
    try:
        assert child.stdout is not None
        while True:
            line = await asyncio.wait_for(asyncio.to_thread(child.stdout.readline), 60)
            if not line or line.strip() == b"READY":
                break
            stored += line.split()[1:]
        assert line, child.stderr.read() if child.stderr else "the child ended early"
    finally:
        kill_9(child)
    content = {b"early-0": 1, b"early-1": 2, b"a-0": 3, b"b-0": 4, b"b-1": 5}
    expected = {
        "a-stored": [b"early-0", b"early-1", b"b-0", b"b-1", b"a-0"],
        "checkpoint-held": [b"early-0", b"early-1"],
    }.get(point, [b"early-0", b"early-1", b"b-0", b"b-1"])
    assert [k.decode() for k in stored] == [k.decode() for k in expected]
    async with NVMeTier(
        pool, BLOCK, root=tmp_path, namespace="overlap", capacity_bytes=1 << 24, min_free_bytes=0
    ) as t:
        assert [k for k in stored if not t.lookup(k)] == []  # nothing stored is lost
        found = [k for k in content if t.lookup(k)]
        assert (await load(t, found, range(len(found)))).success
        for i, key in enumerate(found):  # a block in flight at the kill: whole, or a miss
            assert slot(pool, i) == bytes([content[key]]) * BLOCK, key


async def test_checkpoints_due_at_once_are_written_one_at_a_time(
    pool: memoryview, tmp_path: Path
) -> None:
    """A store job whose checkpoint is due while another job's is being written skips
    its own (they would share the temporary file); the next one due writes it."""
    faults = FaultInjector()
    t = tier(pool, tmp_path, checkpoint_every=1, os_calls=faults)
    await t.start()
    try:
        held = faults.hold("pwritev", path=".tmp")
        first = JobMetadata(next_job_id(), keys(1, "first"), [0])
        t.submit_store(first)
        assert await asyncio.to_thread(held.wait_reached, 30)
        assert (await store(t, keys(1, "second"), [1])).success
        held.open()
        assert (await t.result(first.job_id)).success
        assert (await store(t, keys(1, "third"), [2])).success  # due again: written
        assert "checkpoint failed" not in t.statistics().failures
    finally:
        faults.clear()
        await t.aclose()
    async with tier(pool, tmp_path) as again:
        assert again.metrics.recovered_blocks == 3


async def test_touch_makes_its_first_key_the_most_recent(pool: memoryview, tmp_path: Path) -> None:
    """As the tier contract says (``keys[0]`` most recently): with room to keep the two
    most recently used blocks of an evicted segment, those are the first two touched."""
    t = tier(pool, tmp_path, capacity_bytes=16 * RECORD, hot_fraction=1 / 16)  # window: 1
    async with t:
        names = keys(16)
        assert (await store(t, names, range(16))).success  # two segments of 8, full
        t.touch([names[1], names[2], names[3]])
        assert (await store(t, keys(1, "new"), [0])).success  # evicts the first segment
        assert [t.lookup(k) for k in names[:8]] == [False, True, True] + [False] * 5


async def test_a_checkpoint_is_renamed_and_synced_neither_on_the_loop_nor_on_an_io_thread(
    pool: memoryview, tmp_path: Path
) -> None:
    """The checkpoint's body (the snapshot, written and synced) is one call on the tier's
    I/O threads; its rename and the directory's sync are awaited through aiofiles, on
    the loop's executor."""
    faults = FaultInjector()
    async with tier(pool, tmp_path, fsync="none", checkpoint_every=2, os_calls=faults) as t:
        io_threads = {thread.name for thread in t._executor._threads}  # type: ignore[attr-defined]
        assert (await store(t, keys(2), [0, 1])).success  # and its checkpoint is written
        # fsync="none": only a checkpoint syncs a file (its body) or a directory.
        body, rename, sync = (set(faults.threads[op]) for op in ("fdatasync", "replace", "fsync"))
    assert body and body <= io_threads
    loop_thread = threading.current_thread().name
    assert rename and sync and not (rename | sync) & (io_threads | {loop_thread})


async def test_a_load_is_served_while_a_checkpoint_waits_on_its_directory_sync(
    pool: memoryview, tmp_path: Path
) -> None:
    """A checkpoint's rename and directory sync hold no I/O thread: with one, a load runs
    while that sync is held."""
    faults = FaultInjector()
    t = tier(pool, tmp_path, io_threads=1, fsync="none", checkpoint_every=2, os_calls=faults)
    await t.start()
    try:
        first = keys(1, "first")
        assert (await store(t, first, [0])).success
        held = faults.hold("fsync")  # fsync="none": only a checkpoint syncs a directory
        job = JobMetadata(next_job_id(), keys(1, "second"), [1])
        t.submit_store(job)  # reaches checkpoint_every
        assert await asyncio.to_thread(held.wait_reached, 30)
        assert (await asyncio.wait_for(load(t, first, [2]), 30)).success
        held.open()
        assert (await t.result(job.job_id)).success
    finally:
        faults.clear()
        await t.aclose()
    assert slot(pool, 2) == slot(pool, 0)


@pytest.mark.parametrize("op", ["pwritev", "fdatasync", "replace", "fsync"])
async def test_a_failed_checkpoint_is_counted_keeps_the_old_one_and_leaves_no_temporary(
    pool: memoryview, tmp_path: Path, op: str
) -> None:
    faults = FaultInjector()
    directory = tmp_path / namespace_dirname(NAMESPACE)
    names = keys(4)
    async with tier(pool, tmp_path, checkpoint_every=2, os_calls=faults) as t:
        assert (await store(t, names[:2], [0, 1])).success  # checkpoint 1: two blocks
        before = (directory / CHECKPOINT_FILE).read_bytes()
        path = str(directory) if op == "fsync" else CHECKPOINT_FILE
        faults.fail(op, errno.EIO, path=path, times=1)
        assert (await store(t, names[2:], [2, 3])).success  # its checkpoint fails
        assert t.statistics().failures["checkpoint failed"] == 1
        if op != "fsync":  # renamed already when the directory sync failed
            assert (directory / CHECKPOINT_FILE).read_bytes() == before
        assert not list(directory.glob("*.tmp"))
    async with tier(pool, tmp_path) as again:
        assert again.metrics.recovered_blocks == 4


async def test_a_checkpoint_that_fails_at_close_is_logged_and_leaves_no_temporary(
    pool: memoryview, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    faults = FaultInjector()
    directory = tmp_path / namespace_dirname(NAMESPACE)
    t = tier(pool, tmp_path, os_calls=faults)
    await t.start()
    assert (await store(t, keys(2), [0, 1])).success
    faults.fail("replace", errno.EIO, path=CHECKPOINT_FILE)
    with caplog.at_level("WARNING", logger="backends.nvme.tier"):
        await t.aclose()
    assert any("could not write the index checkpoint" in r.getMessage() for r in caplog.records)
    assert not (directory / CHECKPOINT_FILE).exists() and not list(directory.glob("*.tmp"))


async def test_a_store_job_cancelled_in_its_checkpoint_still_renames_it(
    pool: memoryview, tmp_path: Path
) -> None:
    """A checkpoint once begun runs to its end: shut down while its rename is held, the
    job's checkpoint is still renamed and synced, whole, and no temporary is left."""
    faults = FaultInjector()
    directory = tmp_path / namespace_dirname(NAMESPACE)
    t = tier(pool, tmp_path, fsync="none", checkpoint_every=2, os_calls=faults)
    await t.start()
    try:
        renamed = faults.hold("replace", path=CHECKPOINT_FILE)
        synced = faults.hold("fsync")  # fsync="none": only a checkpoint syncs a directory
        t.submit_store(JobMetadata(next_job_id(), keys(2), [0, 1]))
        assert await asyncio.to_thread(renamed.wait_reached, 30)
        t.shutdown()
        for _ in range(20):  # the cancellation reaches the job, whose checkpoint goes on
            await asyncio.sleep(0)
        renamed.open()
        assert await asyncio.to_thread(synced.wait_reached, 30)  # renamed, then synced
        assert not list(directory.glob("*.tmp"))
        files = SegmentFiles(
            str(directory), block_bytes=BLOCK, ns_digest=namespace_digest(NAMESPACE)
        )
        checkpoint, why = await checkpoint_read(files)
        assert why is None and checkpoint is not None and len(checkpoint.digests) == 2
    finally:
        faults.clear()
        await t.aclose()


async def test_an_unreadable_identity_file_fails_start_naming_the_root(
    pool: memoryview, tmp_path: Path
) -> None:
    directory = tmp_path / namespace_dirname(NAMESPACE)
    directory.mkdir(mode=0o700)
    (directory / IDENTITY_FILE).mkdir()  # read as a file, it fails (EISDIR), even as root
    t = tier(pool, tmp_path)
    with pytest.raises(TieringError, match=r"root=.* cannot be used.*Is a directory"):
        await t.start()
    await t.aclose()
    assert os.listdir(directory / "owners") == []


async def test_a_store_cut_short_in_its_hop_by_a_hard_stop_still_names_what_it_evicted(
    pool: memoryview, tmp_path: Path
) -> None:
    """The hop ran (it read the evicted keys, deleted the segment, wrote), but the job
    never committed: the evicted blocks, and the recently used ones it was moving, are
    still removals."""
    faults = FaultInjector()
    t = tier(pool, tmp_path, capacity_bytes=16 * RECORD, os_calls=faults)
    await t.start()
    t.report_removals()
    old, mid, last = keys(8, "old"), keys(8, "mid"), keys(1, "last")
    assert (await store(t, old, range(8))).success
    assert (await store(t, mid, range(8))).success  # the cap: two segments of 8
    t.touch(old[:2])  # recently used: moved, not dropped, when their segment goes
    held = faults.hold("pwritev", key=last[0])
    t.submit_store(JobMetadata(next_job_id(), last, [0]))  # evicts the segment of old
    assert await asyncio.to_thread(held.wait_reached, 30)
    t.shutdown()  # the job is cancelled inside its hop, which runs to its end
    held.open()
    await t.aclose()
    assert sorted(t.take_removed()) == sorted(old)


async def test_a_store_whose_hop_a_close_deadline_withdrew_still_names_what_it_evicted(
    pool: memoryview, tmp_path: Path
) -> None:
    """The hop never ran: the segments it was to delete go at the close, which first
    reads which keys they held and names them."""
    faults = FaultInjector()
    t = tier(pool, tmp_path, capacity_bytes=16 * RECORD, io_threads=1, os_calls=faults)
    await t.start()
    t.report_removals()
    old, mid, first, more = keys(8, "old"), keys(8, "mid"), keys(1, "first"), keys(8, "more")
    assert (await store(t, old, range(8))).success
    assert (await store(t, mid, range(8))).success  # the cap: two segments of 8
    held = faults.hold("pwritev", key=first[0])
    t.submit_store(JobMetadata(next_job_id(), first, [0]))  # evicts old; held in its hop
    assert await asyncio.to_thread(held.wait_reached, 30)
    behind = JobMetadata(next_job_id(), more, range(8))
    t.submit_store(behind)  # evicts mid; its hop waits for the one I/O thread
    closing = asyncio.create_task(t.aclose(0))
    assert not (await t.result(behind.job_id)).success  # withdrawn before it ran
    held.open()
    await closing
    assert sorted(t.take_removed()) == sorted(old + mid)
    async with tier(pool, tmp_path) as again:  # and no block of either is there
        assert not any(again.lookup(k) for k in old + mid)
