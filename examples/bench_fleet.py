"""Benchmark a fleet on one shared Redis tier: every router, with and without it.

Usage::

    python examples/bench_fleet.py [TRACE] [--url URL] [--nodes 4] [--cpu-fraction 0.025]
        [--block-bytes 4K] [--limit N] [--plot FILE.png]

Without TRACE it replays synthetic chat traffic; without --url it starts its own
redis-server on a free loopback port (no persistence) and stops it at the end. Each node
gets a CPU tier of ``--cpu-fraction`` of the workload's footprint (its distinct blocks),
and at least the longest request's blocks (a store stages a request's blocks in the CPU
tier at once). For each router (round-robin, affinity, least-loaded, kv-aware) the fleet
runs with the shared Redis tier and without it, every loaded block checked. The shared
tier starts each router's run empty of the run's blocks: they live under a namespace of
the run's own (a random token in it), whose keys, and only they, are deleted before
each router and at the end (``SCAN ... MATCH`` and ``UNLINK``), so a server others use
keeps their data. Prints a table; with --plot draws hit ratio by router, with and without
the shared tier (matplotlib). Runs from a checkout: its local server is the tests'
(tests/_redis_servers.py).
The last line is one JSON object::

    {"nodes": ..., "cpu_blocks": ..., "runs": [{"router": ..., "shared_hit_ratio": ...,
      "baseline_hit_ratio": ..., "gain": ..., "redis_hit_ratio": ...,
      "mismatches": ..., "shared_requests_per_s": ...}, ...]}
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import sys
import tempfile
from pathlib import Path

import torch

from backends.redis.tier import namespace_prefix
from tiering import TieringEngine
from tiering.cli_args import Progress, make_parser, parse_size, positive_int, run_main
from tiering.errors import TraceError
from tiering.lab.fleet import ROUTERS, FleetSummary, NodeOutage, replay_fleet
from tiering.lab.sweep import footprint
from tiering.lab.workloads import Request, read_mooncake, synthetic_requests

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
# Test aids, from the checkout: the local server, and the deletion of a run's keys.
from _redis_servers import LocalRedisServer, unlink_matching


def run_namespace() -> str:
    """The Redis tier's namespace for one run of the benchmark: its own, so that the
    run's keys are found, and deleted, by :func:`delete_own` alone."""
    return f"bench-fleet-{secrets.token_hex(8)}"


def delete_own(url: str, namespace: str) -> None:
    """Delete the keys of ``namespace``'s blocks on the server at ``url``, and no other."""
    unlink_matching(url, namespace_prefix(namespace) + b"*")


async def one_run(
    requests: list[Request],
    url: str | None,
    namespace: str,
    router: str,
    cpu_blocks: int,
    args: argparse.Namespace,
) -> FleetSummary:
    tiers = [{"type": "redis", "url": url, "namespace": namespace}] if url is not None else []

    def make(node: int, kv: torch.Tensor) -> TieringEngine:
        return TieringEngine(
            kv, cpu_blocks, secondary_tiers=tiers, cache_identity="bench-fleet",
            enable_events=True,
        )  # fmt: skip

    longest = max(len(r.keys()) for r in requests)
    return await replay_fleet(
        requests, make, nodes=args.nodes, router=router, device_blocks=longest,
        block_bytes=args.block_bytes,
    )  # fmt: skip


def run(url: str, args: argparse.Namespace, requests: list[Request]) -> dict:
    """Every router with and without the shared tier on the server at ``url``; the
    figures. The keys it wrote are deleted at the end, also when it failed."""
    namespace = run_namespace()
    try:
        return _routers(url, namespace, args, requests)
    finally:
        delete_own(url, namespace)


def _routers(url: str, namespace: str, args: argparse.Namespace, requests: list[Request]) -> dict:
    # A store goes through the CPU tier whole: it must fit a request's blocks.
    longest = max(len(r.keys()) for r in requests)
    cpu_blocks = max(longest, round(footprint(requests) * args.cpu_fraction))
    rows = []
    with Progress() as progress:
        for router in ROUTERS:
            progress.update(f"{router}: with the shared tier", force=True)
            delete_own(url, namespace)  # the shared tier starts empty of the run's blocks
            shared = asyncio.run(
                one_run(requests, url, namespace, router, cpu_blocks, args)
            ).to_json()
            progress.update(f"{router}: without it", force=True)
            alone = asyncio.run(
                one_run(requests, None, namespace, router, cpu_blocks, args)
            ).to_json()
            progress.clear()
            row = {
                "router": router,
                "shared_hit_ratio": shared["hit_ratio"],
                "baseline_hit_ratio": alone["hit_ratio"],
                "gain": round(shared["hit_ratio"] / alone["hit_ratio"], 3)
                if alone["hit_ratio"]
                else None,
                "redis_hit_ratio": shared["hit_ratio_by_source"].get("redis", 0.0),
                "mismatches": shared["mismatches"] + alone["mismatches"],
                "shared_requests_per_s": shared["requests_per_s"],
            }
            rows.append(row)
            print(
                f"{router:>13}: hit ratio {row['shared_hit_ratio']:.4f} with the shared tier "
                f"(redis {row['redis_hit_ratio']:.4f}), {row['baseline_hit_ratio']:.4f} "
                f"without: {row['gain']}x; mismatches {row['mismatches']}"
            )
    return {"nodes": args.nodes, "cpu_blocks": cpu_blocks, "runs": rows}


def faults(server: LocalRedisServer, args: argparse.Namespace, requests: list[Request]) -> dict:
    """Round robin with node 1 crashed and restarted, and Redis killed and restarted
    (empty): the timeline of the hit ratio shows the dips and the recoveries."""
    count = len(requests)
    kill_at, back_at = 2 * count // 3, 2 * count // 3 + count // 12

    def restart(done: int, _summary: FleetSummary) -> None:
        if done == kill_at:
            server.kill()
        elif done == back_at:
            server.start()

    longest = max(len(r.keys()) for r in requests)
    cpu_blocks = max(longest, round(footprint(requests) * args.cpu_fraction))
    namespace = run_namespace()
    tiers = [
        {"type": "redis", "url": server.url, "namespace": namespace, "timeout_s": 0.5,
         "breaker_backoff_s": 0.2}
    ]  # fmt: skip

    def make(node: int, kv: torch.Tensor) -> TieringEngine:
        return TieringEngine(kv, cpu_blocks, secondary_tiers=tiers, cache_identity="bench-fleet")

    outage = NodeOutage(node=1 % args.nodes, at=count // 3, requests=count // 6)
    summary = asyncio.run(
        replay_fleet(
            requests,
            make,
            nodes=args.nodes,
            router="round-robin",
            device_blocks=longest,
            block_bytes=args.block_bytes,
            outages=[outage],
            on_request=restart,
        )
    ).to_json()
    print(
        f"faults: node {outage.node} down for requests {outage.at}-{outage.at + outage.requests}"
        f", redis down for {kill_at}-{back_at}; mismatches {summary['mismatches']}; hit ratio "
        "by window: " + " ".join(f"{p['hit_ratio']:.2f}" for p in summary["timeline"])
    )
    return {
        "node_down": [outage.at, outage.at + outage.requests],
        "redis_down": [kill_at, back_at],
        "mismatches": summary["mismatches"],
        "hit_ratio": summary["hit_ratio"],
        "timeline": summary["timeline"],
    }


def plot(result: dict, path: str) -> None:
    """Hit ratio by router, with and without the shared tier, as grouped bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["runs"]
    figure, axes = plt.subplots(figsize=(7, 4.2), dpi=110)
    positions = range(len(rows))
    axes.bar([p - 0.2 for p in positions], [r["baseline_hit_ratio"] for r in rows], 0.4,
             label="each node's own tiers")  # fmt: skip
    axes.bar([p + 0.2 for p in positions], [r["shared_hit_ratio"] for r in rows], 0.4,
             label="plus the shared Redis tier")  # fmt: skip
    axes.set_xticks(list(positions), [r["router"] for r in rows])
    axes.set_ylabel("prefix hit ratio")
    axes.set_title(f"{result['nodes']} nodes, CPU tier of {result['cpu_blocks']} blocks each")
    axes.set_ylim(0, 1)  # room for the legend above the bars
    axes.legend(loc="upper left")
    axes.grid(True, axis="y", alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, format="png")
    plt.close(figure)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, checked: a bad value exits with status 2 naming it."""
    parser = make_parser(__doc__)
    parser.add_argument("trace", nargs="?", help="a Mooncake JSONL trace (default: synthetic)")
    parser.add_argument("--url", help="redis:// URL (default: start a local server)")
    parser.add_argument("--nodes", type=positive_int, default=4, help="engines in the fleet")
    parser.add_argument(
        "--cpu-fraction", type=float, default=0.025, help="each CPU tier, of the footprint"
    )
    parser.add_argument("--block-bytes", type=parse_size, default="4K", help="bytes per block")
    parser.add_argument("--limit", type=positive_int, help="replay the first N requests")
    parser.add_argument("--plot", metavar="FILE.png", help="draw hit ratio by router")
    parser.add_argument(
        "--faults",
        action="store_true",
        help="also replay round robin with node 1 down for a sixth of the requests from a "
        "third on, and Redis killed at two thirds and restarted (empty) a twelfth later "
        "(needs the bench's own server: no --url)",
    )
    args = parser.parse_args(argv)
    if args.faults and args.url is not None:
        parser.error("argument --faults: restarts the bench's own server; leave out --url")
    if not 0 < args.cpu_fraction <= 1:
        parser.error(f"argument --cpu-fraction: must be in (0, 1], got {args.cpu_fraction}")
    return args


def main() -> None:
    args = parse_args()
    try:
        requests = read_mooncake(args.trace, limit=args.limit) if args.trace else None
    except TraceError as exc:
        raise SystemExit(f"bench_fleet: argument trace: {exc}") from None
    if requests is None:
        requests = synthetic_requests()[: args.limit] if args.limit else synthetic_requests()
    if args.url is not None:
        result = run(args.url, args, requests)
    else:
        with tempfile.TemporaryDirectory(prefix="bench-fleet-") as directory:
            server = LocalRedisServer(Path(directory))
            server.start()
            try:
                result = run(server.url, args, requests)
                if args.faults:
                    result["faults"] = faults(server, args, requests)
            finally:
                server.stop()
    if args.plot:
        plot(result, args.plot)
        print(f"plot: {args.plot}", file=sys.stderr)
    print(json.dumps(result))


if __name__ == "__main__":
    run_main(main)
