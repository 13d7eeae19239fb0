"""Run one of the project's benchmarks (examples/bench_*.py), or list them.

The benchmarks live in the source tree's examples/ directory, next to the tiering
package: a clone (or an editable install of one) has them, a wheel install does not.
Each prints its figures and ends with one JSON object on its last line. Any arguments
after the name go to the benchmark (use -- before ones that start with a dash). The exit
code is the benchmark's; Ctrl-C stops the benchmark, which says so in one line, and
exits 130.

Examples:
  tiering bench                      # list them
  tiering bench engine
  tiering bench nvme -- /var/tmp/bench --size-gib 0.5
"""

from __future__ import annotations

import argparse
import ast
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from tiering.errors import InvalidArgumentError

EXAMPLES = Path(__file__).resolve().parent.parent.parent / "examples"
"""Where the benchmarks are: the source tree's examples/, beside the package."""
INTERRUPT_GRACE_S = 2.0
"""After Ctrl-C, how long the benchmark has to stop by itself before it is sent SIGINT."""

# Through run_path, so that a Ctrl-C while it still imports (torch) ends it with one line
# too; -P keeps the current directory off its import path, as running the script would.
_RUN_PATH = "import sys; from tiering.cli_args import run_path; run_path(sys.argv[1], sys.argv[2:])"


def benchmarks() -> dict[str, Path]:
    """The benchmarks by name (``examples/bench_NAME.py``); empty when the package was
    installed without its source tree."""
    if not EXAMPLES.is_dir():
        return {}
    return {p.stem.removeprefix("bench_"): p for p in sorted(EXAMPLES.glob("bench_*.py"))}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", nargs="?", help="the benchmark (without it: list them)")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")


def run(args: argparse.Namespace) -> int:
    found = benchmarks()
    if not found:
        raise InvalidArgumentError(
            f"no benchmarks here: they ship with the source tree (examples/bench_*.py), "
            f"not with the installed package, and {str(EXAMPLES)!r} is not there; run them "
            "from a clone of the repository (python3 -m pip install -e . in it)"
        )
    if args.name is None:
        print("\n".join(listing(found)))
        return 0
    if args.name not in found:
        raise InvalidArgumentError(
            f"name: no benchmark {args.name!r}; choose one of {', '.join(found)}"
        )
    extra = args.args[1:] if args.args[:1] == ["--"] else args.args
    return run_benchmark([sys.executable, "-P", "-c", _RUN_PATH, str(found[args.name]), *extra])


def listing(found: dict[str, Path], width: int | None = None) -> list[str]:
    """The benchmarks' names, each beside the whole first paragraph of its docstring,
    wrapped to ``width`` columns (default: the terminal's, at most 100)."""
    width = width or min(100, shutil.get_terminal_size().columns)
    column = max(len(name) for name in found) + 2
    lines = []
    for name, path in found.items():
        doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
        summary = " ".join(doc.partition("\n\n")[0].split())
        lines += textwrap.wrap(
            summary,
            width=max(width, column + 20),
            initial_indent=name.ljust(column),
            subsequent_indent=" " * column,
        ) or [name]
    return lines


def run_benchmark(command: list[str]) -> int:
    """Run ``command``; its exit status (128 + the signal's number if a signal ended it).
    After Ctrl-C (which the benchmark receives too) it has ``INTERRUPT_GRACE_S`` to stop
    by itself before it is sent SIGINT, once; a Ctrl-C pressed again only waits on."""
    child = subprocess.Popen(command)
    interrupted = False
    deadline: float | None = None  # the grace time's end, until SIGINT is sent
    while True:
        try:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            status = child.wait(timeout=left)
            return status if status >= 0 else 128 - status
        except subprocess.TimeoutExpired:
            child.send_signal(signal.SIGINT)
            deadline = None
        except KeyboardInterrupt:
            if not interrupted:
                interrupted, deadline = True, time.monotonic() + INTERRUPT_GRACE_S
