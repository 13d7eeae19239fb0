"""Regenerate the README's figures: each row's command, run several times, interleaved.

Usage::

    python3 examples/readme_figures.py [--runs 3] [--rows hot-path,nvme,...] [--dir DIR]

Each row of the README's Figures table shows its command; :data:`ROWS` holds the same
commands (``tests/test_readme.py`` checks that they match; ``tiering`` commands run with
``--json``) and which figures of each command's last JSON line the row shows. Round
``r`` runs every chosen row once, in an order rotated by ``r`` (so that no row always
runs first, on a cooler machine), then the next round; this machine's noise (its load,
its disk from minute to minute) thus falls on every row alike. It prints each row's
figures as their spread over the runs (``min-max``, what the README shows; one value
when every run agreed) and their medians, and ends with one JSON object: ``{"runs": N,
"rows": {ROW: {"command": ..., "figures": {FIGURE: {"values": [...], "min": ..,
"median": .., "max": ..}}}}}``.

``{dir}`` in a command (``DIR`` in the README) is a fresh directory under ``--dir``
(default: a temporary one) for each run; ``{redis}`` (``URL``) the URL of a redis-server
this script starts, empty, for each run; ``{trace}`` the Mooncake trace the repository
holds (traces/README.md). A row whose run fails stops the script with status 1, naming
the row and its output's last lines.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT / "traces" / "mooncake_synthetic_trace.jsonl"
README_NAMES = {"dir": "DIR", "redis": "URL", "trace": "traces/mooncake_synthetic_trace.jsonl"}
"""How the README writes each placeholder of a row's command."""
sys.path.insert(0, str(ROOT / "tests"))  # the tests' own redis-server starter

from _redis_servers import LocalRedisServer  # noqa: E402

from tiering.cli_args import make_parser, positive_int, run_main  # noqa: E402

Figures = Callable[[dict[str, Any]], dict[str, float | None]]


@dataclass(frozen=True)
class Row:
    """One row of the README's Figures table: its ``command`` as the README shows it,
    and the ``figures`` its last JSON line gives."""

    name: str
    command: str
    figures: Figures


def _by_block(runs: list[dict[str, Any]], block: int) -> dict[str, Any]:
    return next(run for run in runs if run["block_bytes"] == block)


def _nvme(out: dict[str, Any]) -> dict[str, float | None]:
    run = _by_block(out["runs"], 2 << 20)
    return {
        "store / fio": run["store_ratio"],
        "load / fio": run["load_ratio"],
        "store GB/s": run["store_GBps"],
        "load GB/s": run["load_GBps"],
        "fio store GB/s": run["baseline_store_GBps"],
        "fio load GB/s": run["baseline_load_GBps"],
    }


def _vllm(out: dict[str, Any]) -> dict[str, float | None]:
    figures: dict[str, float | None] = {}
    for block, label in ((2 << 20, "2 MiB"), (128 << 10, "128 KiB")):
        run = _by_block(out["runs"], block)
        figures[f"store {label}"] = run["store_ratio"]
        figures[f"load {label}"] = run["load_ratio"]
    return figures


def _suite(out: dict[str, Any]) -> dict[str, float | None]:
    at_one_percent = [
        point["hit_ratio"]["adaptive"] / max(point["hit_ratio"][r] for r in ("lru", "arc"))
        for point in out["points"]
        if point["workload"] in ("synthetic", str(TRACE)) and point["capacity_fraction"] == 0.01
    ]  # the synthetic chat and the Mooncake trace, all blocks and full blocks only
    return {
        "worst ratio": out["worst_ratio"]["adaptive"],
        "1 % lowest": round(min(at_one_percent), 3),
        "1 % highest": round(max(at_one_percent), 3),
    }


def _admission(out: dict[str, Any]) -> dict[str, float | None]:
    return {
        "worst hit ratio": out["worst_hit_ratio"]["adaptive"],
        "writes": out["total_writes_ratio"]["adaptive"],
    }


def _sglang(out: dict[str, Any]) -> dict[str, float | None]:
    figures: dict[str, float | None] = {}
    for run in out["runs"]:
        label = f"{run['page_bytes'] >> 20} MiB pages"
        figures[f"store {label}"] = run["store_ratio"]
        figures[f"load {label}"] = run["load_ratio"]
    return figures


def _redis(out: dict[str, Any]) -> dict[str, float | None]:
    figures: dict[str, float | None] = {}
    for block, label in ((2 << 20, "2 MiB"), (128 << 10, "128 KiB")):
        run = _by_block(out["runs"], block)
        figures[f"store / redis-py {label}"] = run["store_ratio"]
        figures[f"load / redis-py {label}"] = run["load_ratio"]
        figures[f"store / LMCache {label}"] = run.get("store_vs_lmcache")
        figures[f"load / LMCache {label}"] = run.get("load_vs_lmcache")
    return figures


def _fleet(out: dict[str, Any]) -> dict[str, float | None]:
    shared, alone = out["shared"]["hit_ratio"], out["baseline"]["hit_ratio"]
    return {"shared": shared, "alone": alone, "gain": round(shared / alone, 2)}


ROWS = [
    Row(
        "hot-path",
        "python3 examples/bench_engine.py",
        lambda out: {"p50 µs": out["call_us_p50"], "p99 µs": out["call_us_p99"]},
    ),
    Row("nvme", "python3 examples/bench_nvme.py {dir} --block-sizes 2M", _nvme),
    Row("vllm", "python3 examples/bench_vllm_tiers.py {dir}", _vllm),
    Row(
        "policy",
        "tiering sweep --suite {trace} --policies adaptive --plot {dir}/suite.png",
        _suite,
    ),
    Row(
        "admission",
        "tiering sweep --suite {trace} --admission seen-twice,adaptive --policies lru",
        _admission,
    ),
    Row(
        "sglang",
        "python3 examples/bench_sglang_tiers.py --ours "
        "tiering.integrations.sglang:NVMeHiCacheStorage --set root={dir} "
        "--set capacity_bytes=20000000000",
        _sglang,
    ),
    Row("redis", "python3 examples/bench_redis.py --block-sizes 2M,128K", _redis),
    Row(
        "fleet",
        "tiering replay {trace} --nodes 4 --cpu 1098 --block-bytes 4K --redis {redis}",
        _fleet,
    ),
]


def _argv(command: str, scratch: Path, redis: str | None) -> list[str]:
    words = shlex.split(command)
    if words[0] == "tiering":  # its summary as one JSON line, like the benchmarks'
        words = [sys.executable, "-m", "tiering", *words[1:], "--json"]
    elif words[0] == "python3":
        words[0] = sys.executable
    values = {"dir": str(scratch), "trace": str(TRACE), "redis": redis or ""}
    return [word.format(**values) for word in words]


def run_row(row: Row, scratch: Path) -> dict[str, float | None]:
    """Run ``row``'s command once in ``scratch`` (and against a fresh redis-server if it
    names one); its figures. Raises RuntimeError naming the row if the run fails."""
    server = None
    if "{redis}" in row.command:
        server = LocalRedisServer(scratch)
        server.start()
    try:
        argv = _argv(row.command, scratch, server.url if server else None)
        done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, check=False)
    finally:
        if server is not None:
            server.stop()
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-8:])
        raise RuntimeError(f"{row.name}: exit {done.returncode}: {shlex.join(argv)}\n{tail}")
    return row.figures(json.loads(lines[-1]))


def spread(values: Sequence[float]) -> str:
    """``min-max`` of ``values`` (one value when they agree), as the README shows it."""
    low, high = min(values), max(values)
    return f"{low:g}" if low == high else f"{low:g}-{high:g}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, fully checked: an unknown row exits with status 2 naming it."""
    parser = make_parser(__doc__)
    parser.add_argument("--runs", type=positive_int, default=3, help="runs of each row")
    parser.add_argument(
        "--rows",
        default=",".join(row.name for row in ROWS),
        help="the rows to run, comma-separated",
    )
    parser.add_argument("--dir", type=Path, default=None, help="where the runs' files go")
    args = parser.parse_args(argv)
    known = [row.name for row in ROWS]
    args.rows = [name for name in args.rows.split(",") if name]
    if unknown := [name for name in args.rows if name not in known]:
        parser.error(f"--rows: no row {', '.join(unknown)}; choose from {', '.join(known)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rows = [row for name in args.rows for row in ROWS if row.name == name]
    values: dict[str, dict[str, list[float]]] = {row.name: {} for row in rows}
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="readme-figures-") as base:
        for r in range(args.runs):
            for row in rows[r % len(rows) :] + rows[: r % len(rows)]:
                scratch = Path(base) / f"{row.name}-{r}"
                scratch.mkdir()
                try:
                    figures = run_row(row, scratch)
                except RuntimeError as exc:
                    print(f"readme_figures: {exc}", file=sys.stderr)
                    return 1
                print(f"run {r + 1}/{args.runs} {row.name}: {figures}", flush=True)
                for label, value in figures.items():
                    if value is not None:
                        values[row.name].setdefault(label, []).append(value)
    result: dict[str, Any] = {"runs": args.runs, "rows": {}}
    for row in rows:
        print(f"\n{row.name}: {row.command}")
        figures = {}
        for label, found in values[row.name].items():
            median = statistics.median(found)
            print(f"  {label:<26} {spread(found):>16}   median {median:g}")
            figures[label] = {"values": found, "min": min(found), "median": median,
                              "max": max(found)}  # fmt: skip
        result["rows"][row.name] = {"command": row.command, "figures": figures}
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    run_main(main)
