"""Run one benchmark from two checkouts in alternation and compare their figures.

Usage::

    python examples/bench_ab.py BASE SUBJECT bench_engine.py [--rounds 3] [-- BENCH ARGS]

``BASE`` and ``SUBJECT`` are checkouts of this project (e.g. a ``git worktree`` of the
commit before a change, and this one). Each round runs ``examples/BENCH`` of the base,
then of the subject (ABBA order from the second round on, so that neither side always
runs first), each in a fresh interpreter that imports that checkout's ``tiering`` and
``backends``, and reads the one JSON object every benchmark prints last. It prints, for
every numeric figure both sides report, the median of each side and their ratio
(subject / base), and ends with one JSON object:
``{"rounds": N, "figures": {KEY: {"base": .., "subject": .., "ratio": ..}}}``.
A failed run of either side stops it with status 1.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from tiering.cli_args import make_parser, positive_int, run_main


def _run(checkout: Path, bench: str, args: list[str]) -> dict[str, object]:
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    done = subprocess.run(
        [sys.executable, str(checkout / "examples" / bench), *args],
        cwd=checkout,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        sys.stderr.write(done.stderr[-2000:])
        print(f"{bench} failed in {checkout} (exit {done.returncode})", file=sys.stderr)
        raise SystemExit(1)
    figures: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return figures


def _numbers(figures: dict[str, object] | list[object], prefix: str = "") -> dict[str, float]:
    """The numeric leaves of a JSON object, keyed by their dotted path (list items by index)."""
    out: dict[str, float] = {}
    items = figures.items() if isinstance(figures, dict) else enumerate(figures)
    for key, value in items:
        if isinstance(value, dict | list):
            out.update(_numbers(value, f"{prefix}{key}."))
        elif isinstance(value, int | float) and not isinstance(value, bool):
            out[f"{prefix}{key}"] = float(value)
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = make_parser(__doc__)
    parser.add_argument("base", type=Path, help="checkout of the code before the change")
    parser.add_argument("subject", type=Path, help="checkout of the code after it")
    parser.add_argument("bench", help="benchmark script under examples/, e.g. bench_engine.py")
    parser.add_argument("--rounds", type=positive_int, default=3, help="runs of each side")
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:split])
    args.bench_args = argv[split + 1 :]  # what follows "--" goes to the benchmark
    return args


def main() -> None:
    args = parse_args()
    runs: dict[str, list[dict[str, float]]] = {"base": [], "subject": []}
    sides = {"base": args.base.resolve(), "subject": args.subject.resolve()}
    for round_ in range(args.rounds):
        order = ["base", "subject"] if round_ % 2 == 0 else ["subject", "base"]
        for side in order:
            runs[side].append(_numbers(_run(sides[side], args.bench, args.bench_args)))
            print(f"round {round_ + 1}: {side} done", file=sys.stderr)
    keys = sorted(set.intersection(*(set(r) for rs in runs.values() for r in rs)))
    figures = {}
    print(f"{'figure':<40} {'base':>12} {'subject':>12} {'ratio':>7}")
    for key in keys:
        base = statistics.median(r[key] for r in runs["base"])
        subject = statistics.median(r[key] for r in runs["subject"])
        ratio = subject / base if base else float("nan")
        figures[key] = {"base": base, "subject": subject, "ratio": round(ratio, 3)}
        print(f"{key:<40} {base:>12.4g} {subject:>12.4g} {ratio:>7.3f}")
    print(json.dumps({"rounds": args.rounds, "figures": figures}))


if __name__ == "__main__":
    run_main(main)
