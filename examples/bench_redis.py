"""Benchmark the Redis tier against a plain pipelined redis-py loop on the same server.

Usage::

    python examples/bench_redis.py [URL] [--block-sizes 2M] [--size-mib 256] [--cluster]
        [--no-encryption]

Without URL it starts its own ``redis-server`` on a free loopback port (no persistence),
or with ``--cluster`` a three-node Redis Cluster, and stops it at the end (run it from a
checkout: that server is the tests' own, tests/_redis_servers.py). With
``--cluster`` both sides use redis-py's cluster clients. For each block size,
``--repeat`` rounds of the baseline, the tier and the tier with encryption, in turn
(which goes first rotates from round to round), each on an emptied database:

* baseline: redis-py's asyncio client, ``--concurrency`` pipelines at a time, each
  ``SET``-ing (then ``GET``-ting) ``--job-blocks`` values of the block size, sent from
  memoryviews of one buffer (no copies on the client side either);
* tier: :class:`backends.redis.RedisTier` (pipelines of at most ``--pipeline-mib``)
  store jobs of ``--job-blocks`` keys from a host-pool-like buffer (``--concurrency``
  running at once), then load jobs of them back into other slots, every load verified
  (header and checksum) by the tier, and one block in 16 compared byte for byte by the
  benchmark. The event loop's lag is sampled while the tier runs.
* encrypted (unless ``--no-encryption``): the same tier with ``encryption`` (one random
  AES-256 key for the run): every block sealed with AES-GCM on the way to Redis and
  opened straight into its slot on the way back.

Figures are medians over the rounds. Since the sides take turns going first, it takes
at least as many rounds as sides (3, or 2 with ``--no-encryption``) for each to run in
every place once, and each phase runs at least two jobs per ``--concurrency`` slot so
that it measures throughput, not one job's latency: settings short of either are
refused (exit status 2) before anything runs. The host buffer the tier loads into is
written once before the first round, so no side pays its first-touch page faults.

The last line of output is one JSON object: the figures of the first block size at its
top level, and every block size's in ``runs``::

    {"block_bytes": ..., "store_GBps": ..., "load_GBps": ..., "baseline_store_GBps": ...,
     "baseline_load_GBps": ..., "store_ratio": ..., "load_ratio": ...,
     "loop_lag_p99_ms": ..., "encrypted_store_GBps": ..., "encrypted_load_GBps": ...,
     "encrypted_store_ratio": ..., "encrypted_load_ratio": ...,
     "encryption_store_cost_pct": ..., "encryption_load_cost_pct": ...,
     "encrypted_loop_lag_p99_ms": ..., "runs": [{"block_bytes": ..., ...}, ...]}

``encrypted_*_ratio`` is the median over the rounds of encrypted / plain tier
throughput within each round (the two ran next to each other, so a round's noise
mostly cancels), and ``encryption_*_cost_pct`` is ``100 * (1 - ratio)``: the share of
the plain tier's throughput that encryption costs.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import itertools
import json
import mmap
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from tiering.cli_args import Progress, make_parser, positive_int, run_main, size_list
from tiering.loop_lag import LoopLagMonitor
from tiering.secondary import JobMetadata

_job_ids = itertools.count(1)


@dataclass
class Round:
    store_GBps: float
    load_GBps: float
    loop_lag_p99_ms: float = 0.0


async def _in_batches(count: int, batch: int, concurrency: int, run) -> None:
    """Run ``run(first, last)`` over ``range(count)`` in batches, ``concurrency`` at once."""
    limit = asyncio.Semaphore(concurrency)

    async def one(first: int) -> None:
        async with limit:
            await run(first, min(count, first + batch))

    async with asyncio.TaskGroup() as group:
        for first in range(0, count, batch):
            group.create_task(one(first))


def _client(url: str, args: argparse.Namespace, **options: object):
    """redis-py's asyncio client, or its cluster client with ``--cluster``."""
    if args.cluster:
        from redis.asyncio.cluster import RedisCluster

        return RedisCluster.from_url(url, **options)
    import redis.asyncio as aioredis

    return aioredis.Redis.from_url(url, **options)


async def baseline_round(url: str, view: memoryview, block: int, args: argparse.Namespace):
    count = view.nbytes // block
    names = [b"bench:%d" % i for i in range(count)]
    client = _client(url, args, max_connections=args.concurrency + 1)
    try:
        await client.flushdb()

        async def store(first: int, last: int) -> None:
            pipe = client.pipeline(transaction=False)
            for i in range(first, last):
                pipe.set(names[i], view[i * block : (i + 1) * block])
            await pipe.execute()

        async def load(first: int, last: int) -> None:
            pipe = client.pipeline(transaction=False)
            for i in range(first, last):
                pipe.get(names[i])
            values = await pipe.execute()
            if any(value is None or len(value) != block for value in values):
                raise SystemExit("baseline: a value came back missing or short")

        start = time.perf_counter()
        await _in_batches(count, args.job_blocks, args.concurrency, store)
        stored = time.perf_counter() - start
        start = time.perf_counter()
        await _in_batches(count, args.job_blocks, args.concurrency, load)
        loaded = time.perf_counter() - start
        await client.flushdb()
    finally:
        await client.aclose()
    return Round(view.nbytes / stored / 1e9, view.nbytes / loaded / 1e9)


async def tier_round(
    url: str, pool: memoryview, block: int, args: argparse.Namespace, encryption: str | None
):
    from backends.redis import RedisTier

    half = pool.nbytes // block // 2  # store from the first half, load into the second
    tier = RedisTier(
        pool,
        block,
        url=url,
        namespace=f"bench-redis-{os.getpid()}",
        max_inflight=args.concurrency,
        max_connections=args.concurrency + 1,
        cluster=args.cluster,
        pipeline_bytes=args.pipeline_mib << 20,
        encryption=encryption,
    )
    keys = [b"block-%d" % i for i in range(half)]
    flusher = _client(url, args)
    try:
        await flusher.flushdb()  # every side starts on an emptied database
    finally:
        await flusher.aclose()

    async def job(kind: str, first: int, last: int) -> None:
        slots = range(first, last) if kind == "store" else range(half + first, half + last)
        meta = JobMetadata(next(_job_ids), keys[first:last], list(slots))
        (tier.submit_store if kind == "store" else tier.submit_load)(meta)
        result = await tier.result(meta.job_id)
        if not result.success:
            raise SystemExit(f"tier: a {kind} job failed: {result.error}")

    await tier.start()
    try:
        async with LoopLagMonitor() as lag:
            start = time.perf_counter()
            await _in_batches(half, args.job_blocks, args.concurrency, partial(job, "store"))
            stored = time.perf_counter() - start
            start = time.perf_counter()
            await _in_batches(half, args.job_blocks, args.concurrency, partial(job, "load"))
            loaded = time.perf_counter() - start
        for i in range(0, half, 16):
            if (
                pool[i * block : (i + 1) * block]
                != pool[(half + i) * block : (half + i + 1) * block]
            ):
                raise SystemExit(f"tier: block {i} came back with other bytes")
    finally:
        await tier.aclose()
    nbytes = half * block
    return Round(nbytes / stored / 1e9, nbytes / loaded / 1e9, lag.p99_ms)


async def run(url: str, args: argparse.Namespace, progress: Progress) -> list[dict]:
    runs = []
    sides = ("baseline", "tier") + (() if args.no_encryption else ("encrypted",))
    keyring = f"1:{base64.b64encode(os.urandom(32)).decode()}"  # this run's only key
    for block in args.block_sizes:
        count = max(1, (args.size_mib << 20) // block)
        buffer = mmap.mmap(-1, 2 * count * block)
        pool = memoryview(buffer)
        pool[: count * block] = os.urandom(count * block)
        # Fault in the half the tier loads into now: otherwise the first side that loads
        # pays the page faults of fresh memory, and in the first round that is always
        # the same side.
        zeros = bytes(1 << 20)
        for offset in range(count * block, 2 * count * block, len(zeros)):
            end = min(offset + len(zeros), 2 * count * block)
            pool[offset:end] = zeros[: end - offset]
        rounds: dict[str, list[Round]] = {side: [] for side in sides}
        try:
            for round_no in range(args.repeat):
                turn = round_no % len(sides)
                for side in sides[turn:] + sides[:turn]:
                    progress.update(f"{block >> 10} KiB round {round_no + 1}: {side}", force=True)
                    if side == "baseline":
                        result = await baseline_round(url, pool[: count * block], block, args)
                    else:
                        sealed = keyring if side == "encrypted" else None
                        result = await tier_round(url, pool, block, args, sealed)
                    rounds[side].append(result)
                    progress.clear()
                    print(
                        f"{block >> 10} KiB round {round_no + 1}: {side} store "
                        f"{result.store_GBps:.2f} GB/s, load {result.load_GBps:.2f} GB/s",
                        file=sys.stderr,
                    )
        except BaseException:
            # An interrupted round's frames, which the traceback keeps, still hold views
            # of the buffer: closing it would fail; it is unmapped once they go.
            pool.release()
            raise
        pool.release()
        buffer.close()
        client = _client(url, args)
        try:
            await client.flushdb()
        finally:
            await client.aclose()

        def median(side: str, what: str, rounds: dict[str, list[Round]] = rounds) -> float:
            return round(statistics.median(getattr(r, what) for r in rounds[side]), 3)

        row = {
            "block_bytes": block,
            "store_GBps": median("tier", "store_GBps"),
            "load_GBps": median("tier", "load_GBps"),
            "baseline_store_GBps": median("baseline", "store_GBps"),
            "baseline_load_GBps": median("baseline", "load_GBps"),
            "loop_lag_p99_ms": round(max(r.loop_lag_p99_ms for r in rounds["tier"]), 3),
        }
        row["store_ratio"] = round(row["store_GBps"] / row["baseline_store_GBps"], 3)
        row["load_ratio"] = round(row["load_GBps"] / row["baseline_load_GBps"], 3)
        if "encrypted" in rounds:
            row.update(_encryption_figures(rounds["tier"], rounds["encrypted"]))
        runs.append(row)
        print(
            f"{block >> 10} KiB blocks (medians of {args.repeat}): store {row['store_GBps']} vs "
            f"{row['baseline_store_GBps']} GB/s ({row['store_ratio']}x), load "
            f"{row['load_GBps']} vs {row['baseline_load_GBps']} GB/s ({row['load_ratio']}x); "
            f"loop lag p99 (worst round) {row['loop_lag_p99_ms']} ms"
        )
        if "encrypted" in rounds:
            print(
                f"{block >> 10} KiB blocks, encrypted: store {row['encrypted_store_GBps']} GB/s "
                f"(costs {row['encryption_store_cost_pct']}%), load "
                f"{row['encrypted_load_GBps']} GB/s (costs {row['encryption_load_cost_pct']}%); "
                f"loop lag p99 (worst round) {row['encrypted_loop_lag_p99_ms']} ms"
            )
    return runs


def _encryption_figures(plain: list[Round], sealed: list[Round]) -> dict[str, float]:
    """The encrypted tier's medians, and its throughput against the plain tier's round
    by round (see the module docstring)."""
    figures: dict[str, float] = {}
    for what in ("store", "load"):
        attr = f"{what}_GBps"
        ratio = statistics.median(
            getattr(s, attr) / getattr(p, attr) for p, s in zip(plain, sealed, strict=True)
        )
        figures[f"encrypted_{attr}"] = round(statistics.median(getattr(s, attr) for s in sealed), 3)
        figures[f"encrypted_{what}_ratio"] = round(ratio, 3)
        figures[f"encryption_{what}_cost_pct"] = round(100 * (1 - ratio), 1)
    figures["encrypted_loop_lag_p99_ms"] = round(max(r.loop_lag_p99_ms for r in sealed), 3)
    return figures


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, fully checked: a bad value exits with status 2 naming it."""
    parser = make_parser(__doc__)
    parser.add_argument(
        "url", nargs="?", help="redis:// URL of the server (default: start a local one)"
    )
    parser.add_argument("--block-sizes", type=size_list, default="2M", help="block sizes")
    parser.add_argument("--size-mib", type=positive_int, default=256, help="data per round, MiB")
    parser.add_argument("--job-blocks", type=positive_int, default=8, help="blocks per job")
    parser.add_argument(
        "--concurrency", type=positive_int, default=4, help="jobs (and pipelines) at once"
    )
    parser.add_argument("--repeat", type=positive_int, default=3, help="rounds; medians reported")
    parser.add_argument(
        "--pipeline-mib", type=positive_int, default=2, help="the tier's pipeline_bytes, MiB"
    )
    parser.add_argument(
        "--cluster", action="store_true", help="a Redis Cluster (without URL: start one)"
    )
    parser.add_argument(
        "--no-encryption",
        action="store_true",
        help="skip the tier with encryption (needs the 'cryptography' package)",
    )
    args = parser.parse_args(argv)
    if args.url is not None and not args.url.startswith(("redis://", "rediss://", "unix://")):
        parser.error("argument url: must start with redis://, rediss:// or unix://")
    if args.cluster and args.url is not None and args.url.startswith("unix://"):
        parser.error("argument --cluster: needs a redis:// or rediss:// url")
    sides = 2 if args.no_encryption else 3
    if args.repeat < sides:
        parser.error(
            f"argument --repeat: {sides} sides take turns going first, so the figures need "
            f"at least {sides} rounds, got {args.repeat}"
        )
    jobs_needed = 2 * args.concurrency
    for block in args.block_sizes:
        jobs = -(-max(1, (args.size_mib << 20) // block) // args.job_blocks)
        if jobs < jobs_needed:
            need_mib = -(-jobs_needed * args.job_blocks * block // (1 << 20))
            parser.error(
                f"argument --size-mib: {args.size_mib} MiB of {block >> 10} KiB blocks makes "
                f"{jobs} jobs of --job-blocks {args.job_blocks}, fewer than the "
                f"{jobs_needed} (2 x --concurrency {args.concurrency}) a throughput needs; "
                f"use --size-mib {need_mib} or more, or a smaller --job-blocks"
            )
    return args


def main() -> None:
    args = parse_args()
    try:
        import redis  # noqa: F401
    except ImportError:
        raise SystemExit("bench_redis needs redis-py: pip install 'kv-tiering[redis]'") from None
    with Progress() as progress:
        if args.url is not None:
            runs = asyncio.run(run(args.url, args, progress))
        else:
            sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
            from _redis_servers import LocalRedisCluster, LocalRedisServer

            with tempfile.TemporaryDirectory(prefix="bench-redis-") as directory:
                server = (LocalRedisCluster if args.cluster else LocalRedisServer)(Path(directory))
                server.start()
                try:
                    runs = asyncio.run(run(server.url, args, progress))
                finally:
                    server.stop()
    print(json.dumps({**runs[0], "runs": runs}))


if __name__ == "__main__":
    run_main(main)
