"""Running the example scripts and the ``tiering`` command from tests, as a user runs them."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
TRACE = ROOT / "traces" / "mooncake_synthetic_trace.jsonl"
"""The public Mooncake trace the repository carries (traces/README.md)."""


def script_env(**extra: str) -> dict[str, str]:
    """The environment of a script run by a test: this checkout's packages first on the
    path (a script's own directory, examples/, would otherwise leave ``tiering`` to
    whichever copy is installed), plus ``extra``."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}


def run_script(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``python3 <argv>`` from the repository root; output captured, never raising."""
    return subprocess.run(
        [sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
        check=False, env=script_env(),
    )  # fmt: skip


def interrupt_script(
    *argv: str, ready: str, to_group: bool = True, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    """``python3 <argv>`` from the repository root, sent SIGINT once ``ready`` appears
    in its stdout; its whole output captured.

    With ``to_group`` the signal goes to the process's group, as a terminal's Ctrl-C
    does (the script runs in a session of its own); else to the process alone. Fails if
    the script ends before ``ready`` shows, or either wait exceeds ``timeout``.
    """
    process = subprocess.Popen(
        [sys.executable, *argv], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        env=script_env(PYTHONUNBUFFERED="1"), start_new_session=True,
    )  # fmt: skip
    assert process.stdout is not None
    seen = b""
    deadline = time.monotonic() + timeout
    try:
        while ready.encode() not in seen:
            left = deadline - time.monotonic()
            assert left > 0, f"no {ready!r} on stdout within {timeout} s: {seen!r}"
            if select.select([process.stdout], [], [], left)[0]:
                chunk = os.read(process.stdout.fileno(), 65536)
                assert chunk, f"ended before {ready!r} showed: {seen!r}"
                seen += chunk
        if to_group:
            os.killpg(process.pid, signal.SIGINT)
        else:
            process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=timeout)
    except BaseException as exc:
        os.killpg(process.pid, signal.SIGKILL)  # the script and any process it started
        _, err = process.communicate()
        raise AssertionError(f"{exc}; the script's stderr: {err.decode()}") from exc
    return subprocess.CompletedProcess(
        process.args, process.returncode, (seen + out).decode(), err.decode()
    )


def last_json(done: subprocess.CompletedProcess[str]) -> Any:
    """The JSON object on a benchmark's last stdout line (after checking it succeeded)."""
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


_STALL_TORCH = """
import importlib.abc, sys, time

class StallTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            sys.stdout.write("importing torch\\n")  # one write: the test waits for the line
            sys.stdout.flush()
            time.sleep(600)
        return None

sys.meta_path.insert(0, StallTorch())
"""


def stall_torch_imports(directory: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """Make every script a test starts from now on stall in its import of torch: it
    prints the line returned (wait for it with :func:`interrupt_script`'s ``ready``),
    then waits for the test's signal. (A ``sitecustomize`` in ``directory``, put on the
    scripts' ``PYTHONPATH``, which every Python process runs first.)"""
    (directory / "sitecustomize.py").write_text(_STALL_TORCH)
    monkeypatch.setenv("PYTHONPATH", str(directory))
    return "importing torch\n"


_GUARD_PAGE_CACHE = """
import errno, os, sys

_LOG = {log!r}
_REFUSE_DIRECT = {refuse_o_direct!r}
_O_DIRECT = getattr(os, "O_DIRECT", 0)


def _guard(event, args):
    if event != "open" or not isinstance(args[0], (str, bytes, os.PathLike)):
        return
    path = os.fsdecode(args[0])
    if path.endswith("drop_caches") and os.path.realpath(path) == "/proc/sys/vm/drop_caches":
        with open(_LOG, "a") as log:
            log.write(f"{{os.getpid()}} {{args!r}}\\n")
        raise PermissionError(errno.EACCES, "refused by the test", path)
    if _REFUSE_DIRECT and isinstance(args[2], int) and args[2] & _O_DIRECT:
        raise OSError(errno.EINVAL, "O_DIRECT refused by the test", path)


sys.addaudithook(_guard)
"""


def guard_page_cache(
    directory: Path, monkeypatch: pytest.MonkeyPatch, *, refuse_o_direct: bool = False
) -> Path:
    """Keep every script a test starts from now on (and the processes it spawns) from
    dropping the machine's page cache: an open of ``/proc/sys/vm/drop_caches`` is refused
    (PermissionError) and recorded in the file returned, which exists only if one was
    tried. With ``refuse_o_direct`` an open with O_DIRECT fails with EINVAL, as on a file
    system without it. (An audit hook, installed by a ``sitecustomize`` in ``directory``
    put first on the scripts' ``PYTHONPATH``, which every Python process runs first.)"""
    directory.mkdir(parents=True, exist_ok=True)
    log = directory / "drop_caches-attempts.log"
    hook = _GUARD_PAGE_CACHE.format(log=str(log), refuse_o_direct=refuse_o_direct)
    (directory / "sitecustomize.py").write_text(hook)
    path = os.pathsep.join(p for p in (str(directory), os.environ.get("PYTHONPATH")) if p)
    monkeypatch.setenv("PYTHONPATH", path)
    return log
