"""Replay a Mooncake-format KV trace through CPUOffloadingManager, per capacity and policy.

Usage: python examples/bench_manager.py TRACE CAPACITIES [--policies lru,arc,s3fifo]
    [--full-blocks-only]

CAPACITIES: CPU tier sizes, comma-separated, in blocks (10000) or as percentages of the
trace's footprint, its distinct blocks (1%,2%,5%,10%,25%,50%).

The public Mooncake trace is in the repository: ``traces/mooncake_synthetic_trace.jsonl``
(its source and license: traces/README.md).

Per request, in this order: ``touch`` all of its blocks, ``lookup`` the prefix,
``prepare_load``/``complete_load`` the hit prefix, ``prepare_store``/``complete_store``
the rest. Prints the prefix hit ratio (hit blocks / requested blocks) and block-ops
per second (hashes each manager call examined / seconds spent in the calls, trace
parsing excluded), each policy's hit ratio also as a ratio to LRU's. The last line is
one JSON object: ``{"trace", "full_blocks_only", "requests", "footprint_blocks",
"runs": [{"capacity", "capacity_fraction", "policy", "hit_ratio", "vs_lru",
"block_ops_per_s"}, ...]}``.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path

from tiering.cli_args import Progress, choice_list, make_parser, run_main
from tiering.core.cpu_tier import CPUOffloadingManager
from tiering.core.policies import policy_name, policy_names
from tiering.errors import InvalidArgumentError
from tiering.lab.sweep import capacities_from
from tiering.lab.workloads import TraceError, read_mooncake


def load_trace(path: Path, *, full_blocks_only: bool = False) -> list[list[bytes]]:
    """Each request's block keys (:meth:`tiering.lab.workloads.Request.keys`), without the
    partial last block with ``full_blocks_only``.

    Raises:
        TraceError: as :func:`tiering.lab.workloads.read_mooncake`.
    """
    return [r.keys(full_blocks_only=full_blocks_only) for r in read_mooncake(path)]


def replay(requests: list[list[bytes]], capacity: int, policy: str) -> dict[str, float]:
    """Run the trace through a fresh manager; returns hit ratio and block-ops per second."""
    manager = CPUOffloadingManager(capacity, policy=policy)
    touch, lookup = manager.touch, manager.lookup
    prepare_load, complete_load = manager.prepare_load, manager.complete_load
    prepare_store, complete_store = manager.prepare_store, manager.complete_store
    hits = total = ops = rejected = 0
    gc.disable()
    start = time.perf_counter()
    for hashes in requests:
        touch(hashes)
        n = lookup(hashes)
        if n:
            prepare_load(hashes[:n])
            complete_load(hashes[:n])
        rest = hashes[n:]
        out = prepare_store(rest)
        if out is None:
            rejected += 1
        else:
            complete_store(out.block_hashes_to_store)
            ops += len(out.block_hashes_to_store)
        hits += n
        total += len(hashes)
        # touch + the hashes lookup examined + load pins and releases + store requests
        ops += len(hashes) + min(n + 1, len(hashes)) + 2 * n + len(rest)
    elapsed = time.perf_counter() - start
    gc.enable()
    return {
        "hit_ratio": round(hits / total, 4) if total else 0.0,
        "block_ops_per_s": round(ops / elapsed),
        "block_ops": ops,
        "seconds": round(elapsed, 4),
        "rejected_stores": rejected,
    }


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[list[bytes]]]:
    """The checked command line and the parsed trace; a bad value or an unreadable trace
    exits with status 2 and a message naming the argument, before any replay starts."""
    parser = make_parser(__doc__)
    parser.add_argument("trace", type=Path, help="JSONL trace in the Mooncake format")
    parser.add_argument(
        "capacities", help="CPU tier sizes: blocks or %% of the footprint, comma-separated"
    )
    parser.add_argument(
        "--policies",
        type=choice_list(policy_names(), policy_name),
        default=",".join(policy_names()),
        help="comma-separated eviction policies to replay, in order",
    )
    parser.add_argument(
        "--full-blocks-only",
        action="store_true",
        help="leave out each prompt's partial last block (vLLM never offloads one)",
    )
    args = parser.parse_args(argv)
    try:
        requests = load_trace(args.trace, full_blocks_only=args.full_blocks_only)
    except TraceError as exc:
        parser.error(f"argument trace: {exc}")
    args.footprint = len({k for keys in requests for k in keys})
    try:
        args.capacities = capacities_from(args.capacities, args.footprint)
    except InvalidArgumentError as exc:
        parser.error(f"argument capacities: {exc}")
    return args, requests


def main() -> None:
    args, requests = parse_args()
    runs: list[dict[str, object]] = []
    with Progress() as progress:
        for capacity in args.capacities:
            lru_ratio = None
            for policy in args.policies:
                progress.update(f"replaying {capacity} blocks with {policy}", force=True)
                r = replay(requests, capacity, policy)
                if policy == "lru":
                    lru_ratio = r["hit_ratio"]
                progress.clear()
                runs.append(
                    {
                        "capacity": capacity,
                        "capacity_fraction": round(capacity / args.footprint, 4),
                        "policy": policy,
                        "hit_ratio": r["hit_ratio"],
                        "block_ops_per_s": r["block_ops_per_s"],
                    }
                )
                print(
                    f"{capacity:>7} blocks ({capacity / args.footprint:6.1%}) {policy:>10}: "
                    f"hit ratio {r['hit_ratio']:.4f}  "
                    f"{r['block_ops_per_s'] / 1e6:.2f} M block-ops/s  "
                    f"({r['block_ops']} ops in {r['seconds']:.3f} s)"
                )
            for run in runs:
                if run["capacity"] == capacity:
                    run["vs_lru"] = round(run["hit_ratio"] / lru_ratio, 3) if lru_ratio else None
    summary = {
        "trace": str(args.trace),
        "full_blocks_only": args.full_blocks_only,
        "requests": len(requests),
        "footprint_blocks": args.footprint,
        "runs": runs,
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    run_main(main)
