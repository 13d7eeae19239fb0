"""Tests of backends.faults: the fault-injecting system-call layer."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from backends.faults import FaultInjector
from tiering.errors import InvalidArgumentError


def _write(faults: FaultInjector, path: Path, data: bytes) -> int:
    fd = faults.open(str(path), os.O_WRONLY | os.O_CREAT)
    try:
        return faults.pwritev(fd, [memoryview(data)], 0)
    finally:
        faults.close(fd)


def test_calls_pass_through_without_rules(tmp_path: Path) -> None:
    faults = FaultInjector()
    assert _write(faults, tmp_path / "f", b"hello") == 5
    assert (tmp_path / "f").read_bytes() == b"hello"
    assert faults.calls["open"] == 1 and faults.calls["pwritev"] == 1


def test_fail_raises_the_chosen_errno(tmp_path: Path) -> None:
    faults = FaultInjector()
    faults.fail("pwritev", errno.ENOSPC)
    with pytest.raises(OSError, match="injected") as caught:
        _write(faults, tmp_path / "f", b"x")
    assert caught.value.errno == errno.ENOSPC
    assert (tmp_path / "f").read_bytes() == b""


def test_fail_matches_fd_calls_by_the_opened_path(tmp_path: Path) -> None:
    faults = FaultInjector()
    faults.fail("pwritev", errno.EIO, path="bad")
    assert _write(faults, tmp_path / "good", b"ok") == 2
    with pytest.raises(OSError) as caught:
        _write(faults, tmp_path / "bad", b"no")
    assert caught.value.errno == errno.EIO


def test_times_limits_how_often_a_rule_fires(tmp_path: Path) -> None:
    faults = FaultInjector()
    rule = faults.fail("open", errno.EIO, times=1)
    with pytest.raises(OSError):
        _write(faults, tmp_path / "f", b"a")
    assert _write(faults, tmp_path / "f", b"b") == 1
    assert rule.hits == 1


def test_after_lets_matching_calls_pass_first(tmp_path: Path) -> None:
    faults = FaultInjector()
    faults.fail("open", errno.EIO, after=2)
    _write(faults, tmp_path / "a", b"a")
    _write(faults, tmp_path / "b", b"b")
    with pytest.raises(OSError):
        _write(faults, tmp_path / "c", b"c")


def test_short_read_really_reads_fewer_bytes(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"0123456789")
    faults = FaultInjector()
    faults.short_read(max_bytes=4)
    buffer = bytearray(10)
    fd = faults.open(str(tmp_path / "f"), os.O_RDONLY)
    try:
        assert faults.preadv(fd, [memoryview(buffer)], 0) == 4
    finally:
        faults.close(fd)
    assert bytes(buffer) == b"0123" + bytes(6)


def test_short_write_really_writes_fewer_bytes_across_buffers(tmp_path: Path) -> None:
    faults = FaultInjector()
    faults.short_write(max_bytes=5)
    fd = faults.open(str(tmp_path / "f"), os.O_WRONLY | os.O_CREAT)
    try:
        written = faults.pwritev(fd, [memoryview(b"abc"), memoryview(b"defgh")], 0)
    finally:
        faults.close(fd)
    assert written == 5
    assert (tmp_path / "f").read_bytes() == b"abcde"


def test_report_free_bytes_changes_only_the_available_space(tmp_path: Path) -> None:
    faults = FaultInjector()
    real = os.statvfs(tmp_path)
    faults.report_free_bytes(10 * real.f_frsize)
    fake = faults.statvfs(str(tmp_path))
    assert fake.f_bavail * fake.f_frsize == 10 * real.f_frsize
    assert fake.f_blocks == real.f_blocks


def test_remove_and_clear_restore_normal_calls(tmp_path: Path) -> None:
    faults = FaultInjector()
    rule = faults.fail("open", errno.EIO)
    faults.remove(rule)
    _write(faults, tmp_path / "a", b"a")
    faults.fail("open", errno.EIO)
    faults.clear()
    _write(faults, tmp_path / "b", b"b")


def test_unknown_operation_is_refused() -> None:
    with pytest.raises(InvalidArgumentError, match="unknown operation 'write'"):
        FaultInjector().fail("write", errno.EIO)


@pytest.mark.parametrize("times", [0, -1])
def test_non_positive_times_is_refused(times: int) -> None:
    with pytest.raises(InvalidArgumentError, match="times must be positive"):
        FaultInjector().fail("open", errno.EIO, times=times)
