"""Tests of tests._faults: the fault-injecting system-call layer."""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path

import pytest

import tests._faults
from tests._faults import FaultInjector
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


def test_each_operation_names_the_threads_that_called_it(tmp_path: Path) -> None:
    faults = FaultInjector()
    writer = threading.Thread(target=_write, args=(faults, tmp_path / "f", b"x"), name="writer")
    writer.start()
    writer.join(10)
    faults.unlink(str(tmp_path / "f"))
    assert faults.threads["pwritev"] == {"writer"}
    assert faults.threads["unlink"] == {threading.current_thread().name}


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


def test_hold_blocks_a_matching_call_until_opened(tmp_path: Path) -> None:
    faults = FaultInjector()
    rule = faults.hold("pwritev", path="slow")
    outcome: list[int] = []
    writer = threading.Thread(
        target=lambda: outcome.append(_write(faults, tmp_path / "slow", b"ab"))
    )
    writer.start()
    assert rule.wait_reached(10)
    # The call is held: nothing is written while the gate is shut.
    writer.join(0.05)
    assert writer.is_alive() and outcome == []
    assert (tmp_path / "slow").read_bytes() == b""
    # Other paths are not held meanwhile.
    assert _write(faults, tmp_path / "fast", b"xyz") == 3
    rule.open()
    writer.join(10)
    assert outcome == [2] and (tmp_path / "slow").read_bytes() == b"ab"
    assert rule.hits == 1


def test_hold_holds_times_calls_then_lets_the_rest_pass(tmp_path: Path) -> None:
    faults = FaultInjector()
    rule = faults.hold("open", times=1)
    rule.open()  # an opened gate lets the held call through at once
    _write(faults, tmp_path / "a", b"a")
    _write(faults, tmp_path / "b", b"b")
    assert rule.hits == 1 and rule.times == 0


def test_remove_and_clear_open_the_gates_of_held_calls(tmp_path: Path) -> None:
    faults = FaultInjector()
    for drop in (faults.remove, lambda _rule: faults.clear()):
        rule = faults.hold("pwritev")
        writer = threading.Thread(target=_write, args=(faults, tmp_path / "f", b"abc"))
        writer.start()
        assert rule.wait_reached(10)
        drop(rule)
        writer.join(10)
        assert not writer.is_alive()
        assert (tmp_path / "f").read_bytes() == b"abc"


def test_hold_after_lets_earlier_calls_pass(tmp_path: Path) -> None:
    faults = FaultInjector()
    rule = faults.hold("open", after=1)
    _write(faults, tmp_path / "first", b"1")  # passes: not held
    assert not rule.reached.is_set()
    writer = threading.Thread(target=_write, args=(faults, tmp_path / "second", b"2"))
    writer.start()
    assert rule.wait_reached(10)
    assert not (tmp_path / "second").exists()  # held before the file was opened
    rule.open()
    writer.join(10)
    assert (tmp_path / "second").read_bytes() == b"2"


def test_a_rule_added_while_a_call_is_held_does_not_apply_to_it(tmp_path: Path) -> None:
    faults = FaultInjector()
    rule = faults.hold("preadv")
    (tmp_path / "f").write_bytes(b"data")
    errors: list[BaseException] = []

    def read() -> None:
        fd = faults.open(str(tmp_path / "f"), os.O_RDONLY)
        try:
            faults.preadv(fd, [memoryview(bytearray(4))], 0)
        except OSError as exc:
            errors.append(exc)
        finally:
            faults.close(fd)

    reader = threading.Thread(target=read)
    reader.start()
    assert rule.wait_reached(10)
    faults.fail("preadv", errno.EIO)  # a later rule does not apply to the held call
    rule.open()
    reader.join(10)
    assert errors == []


def test_delay_sleeps_then_runs_the_call(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    slept: list[float] = []
    monkeypatch.setattr(tests._faults.time, "sleep", slept.append)
    faults = FaultInjector()
    rule = faults.delay("pwritev", 0.02, path="f", times=2)
    assert _write(faults, tmp_path / "f", b"abc") == 3
    assert slept == [0.02]
    assert (tmp_path / "f").read_bytes() == b"abc"
    assert rule.hits == 1 and rule.times == 1
    assert rule.delay_s == 0.02


@pytest.mark.parametrize("seconds", [-1, float("nan"), float("inf"), "1", True])
def test_bad_delay_is_refused_with_its_value(seconds: object) -> None:
    with pytest.raises(InvalidArgumentError, match="seconds must be a finite number") as caught:
        FaultInjector().delay("open", seconds)  # type: ignore[arg-type]
    assert repr(seconds) in str(caught.value)
