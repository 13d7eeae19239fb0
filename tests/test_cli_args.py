"""The argument types, parser and progress line of the command and the examples
(``tiering.cli_args``)."""

from __future__ import annotations

import argparse
import io
import os
import select
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests._scripts import script_env
from tiering import cli_args as _cli


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("4096", 4096),
        ("128K", 128 << 10),
        ("2M", 2 << 20),
        ("2MiB", 2 << 20),
        ("2mb", 2 << 20),
        (" 1.5G ", 3 << 29),
        ("1T", 1 << 40),
    ],
)
def test_parse_size(text: str, size: int) -> None:
    assert _cli.parse_size(text) == size


@pytest.mark.parametrize("text", ["", "2X", "M", "0", "-4K", "0.3", "1e400", "nan", "B"])
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(ValueError, match=r"size|bytes"):
        _cli.parse_size(text)


def test_size_list() -> None:
    assert _cli.size_list("2M,128K") == [2 << 20, 128 << 10]
    with pytest.raises(argparse.ArgumentTypeError, match="'2X'"):
        _cli.size_list("2M,2X")
    with pytest.raises(argparse.ArgumentTypeError, match="comma-separated"):
        _cli.size_list("2M,")


def test_positive_numbers() -> None:
    assert _cli.positive_int("7") == 7
    assert _cli.positive_float("0.25") == 0.25
    for bad in ("0", "-1", "1.0", "x", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="positive integer"):
            _cli.positive_int(bad)
    for bad in ("0", "-0.5", "nan", "inf", "x"):
        with pytest.raises(argparse.ArgumentTypeError, match="positive number"):
            _cli.positive_float(bad)


def test_choice_list() -> None:
    parse = _cli.choice_list(["lru", "arc"])
    assert parse("arc,lru") == ["arc", "lru"]
    with pytest.raises(argparse.ArgumentTypeError, match=r"'fifo'.*arc, lru"):
        parse("lru,fifo")
    with pytest.raises(argparse.ArgumentTypeError, match="repeat"):
        parse("lru,lru")


def test_choice_list_resolves_aliases_and_counts_an_alias_and_its_name_once() -> None:
    aliases = {"old": "arc"}
    parse = _cli.choice_list(["lru", "arc"], lambda name: aliases.get(name, name))
    assert parse("old,lru") == ["arc", "lru"]
    assert parse("arc,old") == ["arc"]
    with pytest.raises(argparse.ArgumentTypeError, match="repeat"):
        parse("old,old")


def test_progress_is_silent_on_a_pipe() -> None:
    read_fd, write_fd = os.pipe()
    with os.fdopen(write_fd, "w") as pipe, _cli.Progress(pipe) as progress:
        assert not progress.enabled
        progress.update("working", force=True)
    with os.fdopen(read_fd, "rb") as reader:
        assert reader.read() == b""
    buffer = io.StringIO()
    with _cli.Progress(buffer) as progress:
        progress.update("working", force=True)
    assert buffer.getvalue() == ""


def test_progress_draws_and_clears_on_a_terminal() -> None:
    primary, secondary = os.openpty()
    try:
        tty = os.fdopen(secondary, "w", closefd=False)
        with tty, _cli.Progress(tty, interval=3600) as progress:
            assert progress.enabled
            progress.update("step 1/3", force=True)
            progress.update("step 2/3")  # within the interval: not drawn
            progress.update("step 3", force=True)
        # Step 2 fell within the interval; the shorter step 3 blanks step 1's tail;
        # leaving the block blanks the line and returns to its start.
        expected = "\rstep 1/3" + "\rstep 3  " + "\r      \r"
        shown = _read_pty(primary, len(expected))
    finally:
        os.close(secondary)
        os.close(primary)
    assert shown == expected


def _read_pty(fd: int, size: int, timeout_s: float = 10.0) -> str:
    """What a pseudo-terminal shows, read until ``size`` characters came or nothing more
    came for ``timeout_s`` (a pty may hand over one write in several reads)."""
    data = b""
    while len(data) < size:
        ready, _, _ = select.select([fd], [], [], timeout_s)
        if not ready:
            break
        data += os.read(fd, 4096)
    return data.decode()


_SLOW_EXIT = """
import atexit, time
from tiering.cli_args import run_main

def slow_exit() -> None:  # as a script's thread pools and finalizers take their time
    print("exiting", flush=True)
    time.sleep(3)

def main() -> None:
    atexit.register(slow_exit)
    print("ready", flush=True)
    time.sleep(60)

run_main(main, "slow")
"""


def test_a_second_ctrl_c_while_the_script_exits_prints_nothing_more(tmp_path: Path) -> None:
    # `tiering bench` sends SIGINT once more when a benchmark has not ended 2 s after a
    # Ctrl-C; one still exiting must not print a traceback for it.
    script = tmp_path / "slow.py"
    script.write_text(_SLOW_EXIT)
    process = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        env=script_env(PYTHONUNBUFFERED="1"), text=True,
    )  # fmt: skip
    try:
        assert process.stdout is not None
        assert process.stdout.readline() == "ready\n"
        process.send_signal(signal.SIGINT)
        assert process.stdout.readline() == "exiting\n"
        process.send_signal(signal.SIGINT)
        _, err = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode == _cli.EXIT_INTERRUPTED
    assert err == "slow: interrupted\n"
