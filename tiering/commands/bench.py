"""Run one of the project's benchmarks (examples/bench_*.py), or list them.

The benchmarks live in the source tree's examples/ directory, next to the tiering
package: a clone (or an editable install of one) has them, a wheel install does not.
Each prints its figures and ends with one JSON object on its last line. Any arguments
after the name go to the benchmark (use -- before ones that start with a dash). The exit
code is the benchmark's.

Examples:
  tiering bench                      # list them
  tiering bench engine
  tiering bench nvme -- /var/tmp/bench --size-gib 0.5
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from tiering.errors import InvalidArgumentError

NAME = "bench"
HELP = "run one of the project's benchmarks (examples/bench_*.py), or list them"
ORDER = 30

EXAMPLES = Path(__file__).resolve().parent.parent.parent / "examples"
"""Where the benchmarks are: the source tree's examples/, beside the package."""


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
        for name, path in found.items():
            doc = path.read_text(encoding="utf-8").split('"""')[1].strip().splitlines()[0]
            print(f"{name:<14} {doc}")
        return 0
    if args.name not in found:
        raise InvalidArgumentError(
            f"name: no benchmark {args.name!r}; choose one of {', '.join(found)}"
        )
    extra = args.args[1:] if args.args[:1] == ["--"] else args.args
    return subprocess.run([sys.executable, str(found[args.name]), *extra], check=False).returncode
