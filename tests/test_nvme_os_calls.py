"""Tests of backends.nvme.os_calls: the NVMe tier's system-call layer, on real files."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from backends.nvme.os_calls import (
    OWNERS_DIR,
    REAL_OS,
    OwnerLock,
    advance_buffers,
    describe_os_error,
    free_bytes,
    fsync_dir,
    owner_alive,
    probe_o_direct,
    write_all,
)
from tests._faults import FaultInjector


def _owners(tmp_path: Path) -> str:
    (tmp_path / OWNERS_DIR).mkdir()
    return str(tmp_path)


def test_owner_lock_marks_a_writer_alive_until_released(tmp_path: Path) -> None:
    directory = _owners(tmp_path)
    lock = OwnerLock(directory, "w1")
    assert owner_alive(directory, "w1")
    lock.release()
    lock.release()
    assert not owner_alive(directory, "w1")
    assert os.listdir(os.path.join(directory, OWNERS_DIR)) == []


def test_a_lock_file_left_by_a_dead_writer_is_not_alive(tmp_path: Path) -> None:
    directory = _owners(tmp_path)
    (tmp_path / OWNERS_DIR / "dead.lock").write_bytes(b"")
    assert not owner_alive(directory, "dead")
    assert not owner_alive(directory, "never-started")


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


def test_a_short_write_is_completed_by_the_next_write(tmp_path: Path) -> None:
    faults = FaultInjector()
    faults.short_write(max_bytes=1000, times=1)
    data = [memoryview(os.urandom(3000)), memoryview(os.urandom(5000))]
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        write_all(faults, fd, data, 100)
    finally:
        os.close(fd)
    assert faults.calls["pwritev"] == 2
    assert (tmp_path / "f").read_bytes() == bytes(100) + bytes(data[0]) + bytes(data[1])


def test_a_write_that_makes_no_progress_is_an_eio(tmp_path: Path) -> None:
    class NoProgress(type(REAL_OS)):  # type: ignore[misc]
        def pwritev(self, fd: int, buffers: object, offset: int) -> int:
            return 0

    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        with pytest.raises(OSError) as raised:
            write_all(NoProgress(), fd, [memoryview(b"x")], 0)
    finally:
        os.close(fd)
    assert raised.value.errno == errno.EIO


def test_advance_buffers_drops_what_moved() -> None:
    a, b = memoryview(b"abcd"), memoryview(b"efgh")
    assert [bytes(v) for v in advance_buffers([a, b], 0)] == [b"abcd", b"efgh"]
    assert [bytes(v) for v in advance_buffers([a, b], 6)] == [b"gh"]
    assert advance_buffers([a, b], 8) == []


def test_a_failed_directory_sync_raises_and_closes_the_directory(tmp_path: Path) -> None:
    faults = FaultInjector()
    faults.fail("fsync", errno.EIO)
    with pytest.raises(OSError):
        fsync_dir(faults, str(tmp_path))
    assert faults.calls["close"] == faults.calls["open"] == 1


def test_os_errors_are_described_by_name() -> None:
    assert describe_os_error(OSError(errno.ENOSPC, "x")) == "ENOSPC: x"
    assert describe_os_error(OSError("plain")) == "plain"
