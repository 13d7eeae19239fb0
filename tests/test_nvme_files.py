"""Tests of backends.nvme_files: the blocking core of the NVMe tier (no event loop)."""

from __future__ import annotations

import errno
import mmap
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from backends.nvme_files import BlockFiles
from backends.nvme_format import HEADER_BYTES, fanout_dirs, namespace_digest
from backends.nvme_os import (
    OWNERS_DIR,
    REAL_OS,
    OsCalls,
    OwnerLock,
    free_bytes,
    is_aligned,
    owner_alive,
    probe_o_direct,
)
from tests._faults import FaultInjector
from tests._nvme_helpers import random_pool
from tiering.errors import InvalidArgumentError

BLOCK = 16 << 10
SLOTS = 8
NS = namespace_digest("ns-a")


class RecordingOs(OsCalls):
    """Real calls; remembers the flags of every open."""

    def __init__(self) -> None:
        self.open_flags: list[tuple[str, int]] = []

    def open(self, path: str, flags: int, mode: int = 0o644) -> int:
        self.open_flags.append((path, flags))
        return super().open(path, flags, mode)


@pytest.fixture
def pool() -> Iterator[memoryview]:
    with random_pool(BLOCK, SLOTS) as view:
        yield view


def _slot(pool: memoryview, i: int) -> memoryview:
    return pool[i * BLOCK : (i + 1) * BLOCK]


def _namespace_dir(tmp_path: Path) -> str:
    directory = tmp_path / "ns"
    for sub in (*fanout_dirs(), OWNERS_DIR):
        (directory / sub).mkdir(parents=True, exist_ok=True)
    return str(directory)


def _files(
    tmp_path: Path,
    *,
    os_calls: OsCalls = REAL_OS,
    ns: bytes = NS,
    fsync: str = "none",
    o_direct: bool = False,
) -> BlockFiles:
    return BlockFiles(
        _namespace_dir(tmp_path),
        block_bytes=BLOCK,
        ns_digest=ns,
        instance_id=uuid.uuid4().hex,
        fsync=fsync,  # type: ignore[arg-type]
        o_direct=o_direct,
        os_calls=os_calls,
    )


def _keys(n: int) -> list[bytes]:
    return [os.urandom(32) for _ in range(n)]


def _all_files(files: BlockFiles) -> list[str]:
    return sorted(
        os.path.join(d, f)
        for d, _, names in os.walk(files.directory)
        for f in names
        if OWNERS_DIR not in d
    )


def _round_trip(files: BlockFiles, pool: memoryview, keys: list[bytes]) -> None:
    expected = [bytes(_slot(pool, i)) for i in range(len(keys))]
    report = files.store([(k, _slot(pool, i)) for i, k in enumerate(keys)])
    assert report.stored == keys and not report.failed
    pool[:] = bytes(pool.nbytes)
    loaded = files.load([(k, _slot(pool, i)) for i, k in enumerate(keys)])
    assert loaded.loaded == keys and not loaded.failed
    assert [bytes(_slot(pool, i)) for i in range(len(keys))] == expected


# -- data path ---------------------------------------------------------------------------


def test_store_then_load_is_byte_exact_buffered(tmp_path: Path, pool: memoryview) -> None:
    _round_trip(_files(tmp_path), pool, _keys(4))


def test_store_then_load_is_byte_exact_with_o_direct(tmp_path: Path, pool: memoryview) -> None:
    directory = _namespace_dir(tmp_path)
    reason = probe_o_direct(directory)
    if reason is not None:
        pytest.skip(f"this file system refuses O_DIRECT: {reason}")
    recording = RecordingOs()
    files = _files(tmp_path, os_calls=recording, o_direct=True)
    _round_trip(files, pool, _keys(4))
    data_opens = [flags for path, flags in recording.open_flags if path.endswith((".kvb", ".tmp"))]
    assert data_opens and all(flags & os.O_DIRECT for flags in data_opens)


def test_unaligned_slots_fall_back_to_buffered_io(tmp_path: Path) -> None:
    buffer = mmap.mmap(-1, BLOCK * 2)
    with memoryview(buffer) as whole:
        slot = whole[512 : 512 + BLOCK]
        slot[:] = os.urandom(BLOCK)
        expected = bytes(slot)
        assert not is_aligned(slot)
        recording = RecordingOs()
        files = _files(tmp_path, os_calls=recording, o_direct=True)
        key = b"unaligned"
        assert files.store([(key, slot)]).stored == [key]
        slot[:] = bytes(BLOCK)
        assert files.load([(key, slot)]).loaded == [key]
        assert bytes(slot) == expected
        assert not any(flags & getattr(os, "O_DIRECT", 0) for _, flags in recording.open_flags)
        slot.release()
    buffer.close()


def test_a_block_file_is_header_page_plus_payload_and_no_temp_remains(
    tmp_path: Path, pool: memoryview
) -> None:
    files = _files(tmp_path)
    key = b"k" * 32
    files.store([(key, _slot(pool, 0))])
    assert _all_files(files) == [files.path_of(key)]
    assert os.path.getsize(files.path_of(key)) == HEADER_BYTES + BLOCK
    with open(files.path_of(key), "rb") as f:
        assert f.read()[HEADER_BYTES:] == bytes(_slot(pool, 0))


def test_storing_a_key_again_replaces_its_file_atomically(tmp_path: Path, pool: memoryview) -> None:
    files = _files(tmp_path)
    key = b"same"
    files.store([(key, _slot(pool, 0))])
    files.store([(key, _slot(pool, 1))])
    expected = bytes(_slot(pool, 1))
    assert files.load([(key, _slot(pool, 2))]).loaded == [key]
    assert bytes(_slot(pool, 2)) == expected
    assert len(_all_files(files)) == 1


def test_store_removes_the_named_files_first(tmp_path: Path, pool: memoryview) -> None:
    files = _files(tmp_path)
    old, new = b"old", b"new"
    files.store([(old, _slot(pool, 0))])
    report = files.store([(new, _slot(pool, 1))], remove=[old])
    assert report.removed == 1
    assert _all_files(files) == [files.path_of(new)]


def test_payload_of_the_wrong_size_is_refused(tmp_path: Path, pool: memoryview) -> None:
    with pytest.raises(InvalidArgumentError, match="payload is"):
        _files(tmp_path).store([(b"k", pool[:100])])


# -- verification ------------------------------------------------------------------------


def _stored(tmp_path: Path, pool: memoryview, n: int = 3) -> tuple[BlockFiles, list[bytes]]:
    files = _files(tmp_path)
    keys = _keys(n)
    files.store([(k, _slot(pool, i)) for i, k in enumerate(keys)])
    return files, keys


def _flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x01]))


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (lambda p: _flip(p, HEADER_BYTES + 777), "payload checksum mismatch"),
        (lambda p: _flip(p, 70), "header checksum mismatch"),
        (lambda p: _flip(p, 0), "bad magic"),
        (lambda p: os.truncate(p, HEADER_BYTES + BLOCK - 1), "file is"),
        (lambda p: os.truncate(p, 100), "file is"),
        (lambda p: os.truncate(p, HEADER_BYTES + BLOCK + 4096), "file is"),
    ],
    ids=["payload-byte", "header-byte", "magic", "truncated-by-1", "truncated", "extended"],
)
def test_damaged_block_fails_alone_and_is_removed(
    tmp_path: Path, pool: memoryview, damage: object, reason: str
) -> None:
    files, keys = _stored(tmp_path, pool)
    bad = files.path_of(keys[1])
    damage(bad)  # type: ignore[operator]
    expected = [bytes(_slot(pool, 0)), bytes(_slot(pool, 2))]
    pool[:] = bytes(pool.nbytes)
    report = files.load([(k, _slot(pool, i)) for i, k in enumerate(keys)])
    assert report.loaded == [keys[0], keys[2]]
    assert report.corrupt == [keys[1]]
    assert reason in report.failed[keys[1]]
    assert [bytes(_slot(pool, 0)), bytes(_slot(pool, 2))] == expected
    assert not os.path.exists(bad)


def test_block_of_another_namespace_is_refused(tmp_path: Path, pool: memoryview) -> None:
    ours = _files(tmp_path)
    theirs = BlockFiles(
        ours.directory,
        block_bytes=BLOCK,
        ns_digest=namespace_digest("ns-b"),
        instance_id="other",
        fsync="none",
    )
    key = b"shared-key"
    theirs.store([(key, _slot(pool, 0))])
    report = ours.load([(key, _slot(pool, 1))])
    assert "another namespace" in report.failed[key]
    assert report.corrupt == [key]


def test_block_of_another_key_at_our_name_is_refused(tmp_path: Path, pool: memoryview) -> None:
    files, keys = _stored(tmp_path, pool, 2)
    os.replace(files.path_of(keys[0]), files.path_of(keys[1]))
    report = files.load([(keys[1], _slot(pool, 3))])
    assert "another key" in report.failed[keys[1]]


def test_missing_file_is_a_failure_not_corruption(tmp_path: Path, pool: memoryview) -> None:
    report = _files(tmp_path).load([(b"never-stored", _slot(pool, 0))])
    assert report.failed == {b"never-stored": "block file is missing"}
    assert report.corrupt == []


def test_short_read_is_detected(tmp_path: Path, pool: memoryview) -> None:
    faults = FaultInjector()
    files, keys = _stored(tmp_path, pool, 2)
    files.os = faults
    faults.short_read(max_bytes=HEADER_BYTES + 100, path=keys[0].hex())
    report = files.load([(k, _slot(pool, i + 2)) for i, k in enumerate(keys)])
    assert "short read" in report.failed[keys[0]]
    assert report.loaded == [keys[1]]


def test_read_error_fails_only_that_key(tmp_path: Path, pool: memoryview) -> None:
    faults = FaultInjector()
    files, keys = _stored(tmp_path, pool, 3)
    files.os = faults
    faults.fail("preadv", errno.EIO, path=keys[1].hex())
    report = files.load([(k, _slot(pool, i + 3)) for i, k in enumerate(keys)])
    assert report.loaded == [keys[0], keys[2]]
    assert report.failed[keys[1]].startswith("read failed: EIO")
    assert report.corrupt == []


# -- write faults ------------------------------------------------------------------------


def test_enospc_fails_the_rest_of_the_job_and_leaves_no_temp_file(
    tmp_path: Path, pool: memoryview
) -> None:
    faults = FaultInjector()
    files = _files(tmp_path, os_calls=faults)
    keys = _keys(4)
    faults.fail("pwritev", errno.ENOSPC, after=1)
    report = files.store([(k, _slot(pool, i)) for i, k in enumerate(keys)])
    assert report.disk_full
    assert report.stored == [keys[0]]
    assert set(report.failed) == set(keys[1:])
    assert faults.calls["pwritev"] == 2  # the last two were not attempted
    assert _all_files(files) == [files.path_of(keys[0])]


def test_write_error_fails_only_that_key(tmp_path: Path, pool: memoryview) -> None:
    faults = FaultInjector()
    files = _files(tmp_path, os_calls=faults)
    keys = _keys(3)
    faults.fail("pwritev", errno.EIO, path=keys[1].hex())
    report = files.store([(k, _slot(pool, i)) for i, k in enumerate(keys)])
    assert report.stored == [keys[0], keys[2]]
    assert report.failed[keys[1]].startswith("write failed: EIO")
    assert not report.disk_full
    assert len(_all_files(files)) == 2


def test_short_write_is_completed_by_the_next_write(tmp_path: Path, pool: memoryview) -> None:
    faults = FaultInjector()
    files = _files(tmp_path, os_calls=faults)
    faults.short_write(max_bytes=HEADER_BYTES + 1000, times=1)
    _round_trip(files, pool, _keys(1))
    assert faults.calls["pwritev"] == 2


def test_rename_failure_leaves_no_block_and_no_temp(tmp_path: Path, pool: memoryview) -> None:
    faults = FaultInjector()
    files = _files(tmp_path, os_calls=faults)
    faults.fail("replace", errno.EIO)
    report = files.store([(b"k", _slot(pool, 0))])
    assert report.failed and not report.stored
    assert _all_files(files) == []


def test_failed_close_of_a_written_file_leaves_no_block_and_no_temp(
    tmp_path: Path, pool: memoryview
) -> None:
    faults = FaultInjector()
    files = _files(tmp_path, os_calls=faults)
    faults.fail("close", errno.EIO, path=".tmp", times=1)
    report = files.store([(b"k", _slot(pool, 0))])
    assert report.failed[b"k"].startswith("write failed: EIO") and not report.stored
    assert _all_files(files) == []


def test_failed_directory_fsync_with_always_leaves_no_untracked_block(
    tmp_path: Path, pool: memoryview
) -> None:
    faults = FaultInjector()
    files = _files(tmp_path, os_calls=faults, fsync="always")
    faults.fail("fsync", errno.EIO, times=1)
    report = files.store([(b"k", _slot(pool, 0))])
    assert report.failed[b"k"].startswith("write failed: EIO") and not report.stored
    assert _all_files(files) == []


@pytest.mark.parametrize(
    ("fsync", "expected"),
    [
        ("none", {"syncfs": 0, "fdatasync": 0, "fsync": 0}),
        ("batch", {"syncfs": 1, "fdatasync": 0, "fsync": 0}),
        ("always", {"syncfs": 0, "fdatasync": 3, "fsync": 3}),
    ],
)
def test_fsync_policy_decides_the_sync_calls(
    tmp_path: Path, pool: memoryview, fsync: str, expected: dict[str, int]
) -> None:
    faults = FaultInjector()
    files = _files(tmp_path, os_calls=faults, fsync=fsync)
    files.store([(k, _slot(pool, i)) for i, k in enumerate(_keys(3))])
    assert {op: faults.calls[op] for op in expected} == expected


def test_batch_without_syncfs_syncs_each_file_and_directory(
    tmp_path: Path, pool: memoryview
) -> None:
    faults = FaultInjector()
    faults.fail("syncfs", errno.ENOSYS)
    files = _files(tmp_path, os_calls=faults, fsync="batch")
    keys = _keys(3)
    report = files.store([(k, _slot(pool, i)) for i, k in enumerate(keys)])
    assert report.stored == keys
    assert faults.calls["fdatasync"] == 3
    dirs = {os.path.dirname(files.path_of(k)) for k in keys}
    assert faults.calls["fsync"] == len(dirs)


def test_failed_batch_sync_fails_the_job_and_removes_its_files(
    tmp_path: Path, pool: memoryview
) -> None:
    faults = FaultInjector()
    faults.fail("syncfs", errno.EIO)
    files = _files(tmp_path, os_calls=faults, fsync="batch")
    keys = _keys(2)
    report = files.store([(k, _slot(pool, i)) for i, k in enumerate(keys)])
    assert report.stored == []
    assert all(reason.startswith("fsync failed: EIO") for reason in report.failed.values())
    assert _all_files(files) == []


# -- recovery scan -----------------------------------------------------------------------


def test_scan_lists_valid_blocks_oldest_first(tmp_path: Path, pool: memoryview) -> None:
    files, keys = _stored(tmp_path, pool, 3)
    for age, key in zip((30, 10, 20), keys, strict=True):
        os.utime(files.path_of(key), (1_000_000 - age, 1_000_000 - age))
    report = files.scan()
    assert [key for key, _ in report.blocks] == [keys[0], keys[2], keys[1]]
    assert not report.removed


def test_scan_removes_torn_foreign_corrupt_and_misplaced_files(
    tmp_path: Path, pool: memoryview
) -> None:
    files, keys = _stored(tmp_path, pool, 5)
    os.truncate(files.path_of(keys[0]), 5000)
    _flip(files.path_of(keys[1]), 40)
    other = BlockFiles(
        files.directory, block_bytes=BLOCK, ns_digest=namespace_digest("b"), instance_id="x"
    )
    foreign_key = b"foreign"
    other.store([(foreign_key, _slot(pool, 0))])
    os.replace(files.path_of(keys[2]), files.path_of(b"elsewhere"))
    unrelated = os.path.join(files.directory, "00", "notes.txt")
    Path(unrelated).write_text("keep me")
    report = files.scan()
    assert sorted(key for key, _ in report.blocks) == sorted([keys[3], keys[4]])
    assert report.removed == {"torn": 1, "corrupt": 1, "foreign": 1, "misplaced": 1}
    assert os.path.exists(unrelated)


def test_scan_removes_temp_files_of_dead_writers_only(tmp_path: Path) -> None:
    directory = _namespace_dir(tmp_path)
    live = OwnerLock(directory, "live0000")
    dead_lock = os.path.join(directory, OWNERS_DIR, "dead0000.lock")
    Path(dead_lock).write_text("")
    live_temp = os.path.join(directory, "0a", "abcd.live0000-3.tmp")
    dead_temp = os.path.join(directory, "0b", "abcd.dead0000-7.tmp")
    orphan_temp = os.path.join(directory, "0c", "abcd.gone0000-1.tmp")
    for path in (live_temp, dead_temp, orphan_temp):
        Path(path).write_bytes(b"partial")
    files = BlockFiles(directory, block_bytes=BLOCK, ns_digest=NS, instance_id="me000000")
    report = files.scan()
    assert os.path.exists(live_temp)
    assert not os.path.exists(dead_temp) and not os.path.exists(orphan_temp)
    assert not os.path.exists(dead_lock)
    assert report.removed == {"temporary": 2, "owner lock": 1}
    live.release()


def test_owner_lock_marks_a_writer_alive_until_released(tmp_path: Path) -> None:
    directory = _namespace_dir(tmp_path)
    lock = OwnerLock(directory, "w1")
    assert owner_alive(directory, "w1")
    lock.release()
    lock.release()
    assert not owner_alive(directory, "w1")
    assert os.listdir(os.path.join(directory, OWNERS_DIR)) == []


# -- probes ------------------------------------------------------------------------------


def test_o_direct_probe_reports_a_refusal(tmp_path: Path) -> None:
    faults = FaultInjector()
    faults.fail("open", errno.EINVAL, path="odirect-probe")
    reason = probe_o_direct(str(tmp_path), faults)
    assert reason is not None and "Invalid argument" in reason
    assert os.listdir(tmp_path) == []


def test_o_direct_probe_leaves_nothing_behind(tmp_path: Path) -> None:
    probe_o_direct(str(tmp_path))
    assert os.listdir(tmp_path) == []


def test_free_bytes_is_zero_when_inodes_run_out(tmp_path: Path) -> None:
    fields = list(os.statvfs(tmp_path))
    fields[5], fields[7] = 1000, 0  # f_files, f_favail
    assert free_bytes(os.statvfs_result(fields)) == 0
