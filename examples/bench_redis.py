"""Benchmark the Redis tier against a plain pipelined redis-py loop, and against
LMCache's ``resp`` adapter when it is installed, on the same server.

Usage::

    python examples/bench_redis.py [URL] [--block-sizes 2M] [--size-mib 256] [--cluster]
        [--no-encryption] [--lmcache auto|on|off]

Without URL it starts its own ``redis-server`` on a free loopback port (no persistence),
or with ``--cluster`` a three-node Redis Cluster, and stops it at the end (run it from a
checkout: that server is the tests' own, tests/_redis_servers.py). With
``--cluster`` the baseline uses redis-py's cluster client. For each block size,
``--repeat`` rounds of every side, in turn (which goes first rotates from round to
round), each starting from the same server state: none of the run's keys on it. The
benchmark deletes only what it wrote, so a server others use keeps their data: every
key of a run carries a random token of that run (the baseline's names, the tier's
namespace, LMCache's model name), and before each side's round, and at the end of the
run (interrupted or failed too), the keys matching the run's patterns are found with
``SCAN ... MATCH`` and ``UNLINK``-ed. Every side stores the round's data
with one client, then a new client loads it twice: *cold* (its first calls:
connections are made as they go) and *warm* (the same again):

* baseline: redis-py's asyncio client, ``--concurrency`` pipelines at a time, each
  ``SET``-ing (then ``GET``-ting) ``--job-blocks`` values of the block size, sent from
  memoryviews of one buffer (no copies on the client side either);
* tier: :class:`backends.redis.tier.RedisTier` (pipelines of at most ``--pipeline-mib``,
  ``--io-threads`` threads, by default the tier's) store jobs of ``--job-blocks``
  keys from a host-pool-like buffer (``--concurrency`` running at once), then load
  jobs of them back into other slots, every load verified (header and checksum) by
  the tier, and one block in 16 compared byte for byte by the benchmark. The event
  loop's lag is sampled while the tier runs.
* encrypted (unless ``--no-encryption``): the same tier with ``encryption`` (one random
  AES-256 key for the run): every block sealed with AES-GCM on the way to Redis and
  opened straight into its slot on the way back.
* lmcache (``--lmcache auto``, the default, when ``import lmcache`` works and
  ``--repeat`` gives it a turn first; ``on`` requires it): LMCache's ``resp`` L2
  adapter (its C++ RESP client under ``NativeConnectorL2Adapter``,
  ``--lmcache-workers`` workers) storing and loading the same jobs from and into the
  same buffer, completions awaited on its event fds from the loop. It verifies
  nothing it loads; the benchmark compares one block in 16 as for the tier. The
  loop's lag is sampled while it runs too: what the machine alone costs the loop,
  with no Python thread of ours moving bytes. Plain ``redis://`` servers only (no
  TLS, no cluster): elsewhere it is skipped with a note.

Figures are medians over the rounds. Since the sides take turns going first, it takes
at least as many rounds as sides for each to run in every place once, and each phase
runs at least two jobs per ``--concurrency`` slot so that it measures throughput, not
one job's latency: settings short of either are refused (exit status 2) before
anything runs. The host buffer the sides load into is written once before the first
round, so no side pays its first-touch page faults, and then the garbage collector's
heap is frozen (``gc.freeze()``, as vLLM's engine does once it has started): a full
collection of the many objects torch and LMCache bring would otherwise land in
whichever round its count came due.

The last line of output is one JSON object: the figures of the first block size at its
top level, and every block size's in ``runs``::

    {"block_bytes": ..., "store_GBps": ..., "load_GBps": ..., "warm_load_GBps": ...,
     "baseline_store_GBps": ..., "baseline_load_GBps": ..., "baseline_warm_load_GBps": ...,
     "store_ratio": ..., "load_ratio": ..., "loop_lag_p99_ms": ...,
     "cpu_s_per_GB": ..., "baseline_cpu_s_per_GB": ...,
     "encrypted_store_GBps": ..., "encrypted_load_GBps": ...,
     "encrypted_store_ratio": ..., "encrypted_load_ratio": ...,
     "encryption_store_cost_pct": ..., "encryption_load_cost_pct": ...,
     "encrypted_loop_lag_p99_ms": ...,
     "lmcache_store_GBps": ..., "lmcache_load_GBps": ..., "lmcache_warm_load_GBps": ...,
     "store_vs_lmcache": ..., "load_vs_lmcache": ..., "warm_load_vs_lmcache": ...,
     "lmcache_loop_lag_p99_ms": ..., "lmcache_cpu_s_per_GB": ...,
     "runs": [{"block_bytes": ..., ...}, ...]}

``*_ratio`` (baseline) is the tier's median over the baseline's; ``encrypted_*_ratio``
and ``*_vs_lmcache`` are the medians over the rounds of the two sides' throughputs
within each round (they ran next to each other, so a round's noise mostly cancels),
and ``encryption_*_cost_pct`` is ``100 * (1 - ratio)``: the share of the plain tier's
throughput that encryption costs. ``load`` figures are the cold loads.
``cpu_s_per_GB`` is the CPU time of this process (all its threads: the loop, the
tier's, LMCache's) over a round's store and two loads, per GB moved. The
``lmcache_*`` keys appear only when that side ran.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import gc
import itertools
import json
import mmap
import os
import secrets
import statistics
import sys
import tempfile
import time
import urllib.parse
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from tiering.cli_args import Progress, make_parser, positive_int, run_main, size_list
from tiering.observe.loop_lag import LoopLagMonitor
from tiering.tiers.tier_api import JobMetadata

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
# Test aids, from the checkout: the local servers, and the deletion of a run's keys.
from _redis_servers import LocalRedisCluster, LocalRedisServer, unlink_matching

_job_ids = itertools.count(1)


@dataclass
class Round:
    store_GBps: float
    load_GBps: float
    warm_load_GBps: float
    loop_lag_p99_ms: float = 0.0
    cpu_s_per_GB: float = 0.0  # this process's CPU time (every thread) per GB moved


async def _in_batches(count: int, batch: int, concurrency: int, run) -> None:
    """Run ``run(first, last)`` over ``range(count)`` in batches, ``concurrency`` at once."""
    limit = asyncio.Semaphore(concurrency)

    async def one(first: int) -> None:
        async with limit:
            await run(first, min(count, first + batch))

    async with asyncio.TaskGroup() as group:
        for first in range(0, count, batch):
            group.create_task(one(first))


async def _timed(count: int, args: argparse.Namespace, run) -> float:
    """Seconds to run ``run`` over ``count`` blocks in jobs, as every side does."""
    start = time.perf_counter()
    await _in_batches(count, args.job_blocks, args.concurrency, run)
    return time.perf_counter() - start


def _rates(nbytes: int, *seconds: float) -> list[float]:
    return [nbytes / s / 1e9 for s in seconds]


def _per_gb(cpu_s: float, nbytes: int) -> float:
    """CPU seconds per GB over a round's three phases (a store and two loads)."""
    return cpu_s / (3 * nbytes / 1e9)


def _client(url: str, args: argparse.Namespace, **options: object):
    """redis-py's asyncio client, or its cluster client with ``--cluster``."""
    if args.cluster:
        from redis.asyncio.cluster import RedisCluster

        return RedisCluster.from_url(url, **options)
    import redis.asyncio as aioredis

    return aioredis.Redis.from_url(url, **options)


def own_patterns(token: str) -> list[bytes]:
    """Glob patterns that match every key a run of token ``token`` writes, and no key
    of anyone else (the token is random): the baseline's names, the tier's namespace
    (:func:`tier_namespace`) and LMCache's model name (:func:`lmcache_model`)."""
    from backends.redis.tier import namespace_prefix

    return [
        baseline_prefix(token) + b"*",
        namespace_prefix(tier_namespace(token)) + b"*",
        b"*" + lmcache_model(token).encode() + b"*",  # in LMCache's key, whatever its form
    ]


def baseline_prefix(token: str) -> bytes:
    """How the baseline's key names start in a run of token ``token``."""
    return b"bench-redis:%s:" % token.encode()


def tier_namespace(token: str) -> str:
    """The tier sides' namespace in a run of token ``token``."""
    return f"bench-redis-{token}"


def lmcache_model(token: str) -> str:
    """The LMCache side's model name (part of each of its keys) in a run of ``token``."""
    return f"bench-redis-lmcache-{token}"


def delete_own(url: str, args: argparse.Namespace) -> None:
    """Delete every key this run wrote on the server at ``url``, and no other."""
    for pattern in own_patterns(args.token):
        unlink_matching(url, pattern, cluster=args.cluster)


async def _fresh_start(url: str, args: argparse.Namespace) -> None:
    """None of the run's keys on the server (what the side before wrote is deleted):
    every side's round starts from there."""
    await asyncio.to_thread(delete_own, url, args)


def _compare(pool: memoryview, block: int, half: int, side: str) -> None:
    """One block in 16 of the second half against the first, byte for byte."""
    for i in range(0, half, 16):
        if pool[i * block : (i + 1) * block] != pool[(half + i) * block : (half + i + 1) * block]:
            raise SystemExit(f"{side}: block {i} came back with other bytes")


async def baseline_round(url: str, view: memoryview, block: int, args: argparse.Namespace):
    count = view.nbytes // block
    names = [baseline_prefix(args.token) + b"%d" % i for i in range(count)]
    await _fresh_start(url, args)

    async def store(client, first: int, last: int) -> None:
        pipe = client.pipeline(transaction=False)
        for i in range(first, last):
            pipe.set(names[i], view[i * block : (i + 1) * block])
        await pipe.execute()

    async def load(client, first: int, last: int) -> None:
        pipe = client.pipeline(transaction=False)
        for i in range(first, last):
            pipe.get(names[i])
        values = await pipe.execute()
        if any(value is None or len(value) != block for value in values):
            raise SystemExit("baseline: a value came back missing or short")

    times, cpu = [], time.process_time()
    for phases in ((store,), (load, load)):
        client = _client(url, args, max_connections=args.concurrency + 1)
        try:
            for phase in phases:
                times.append(await _timed(count, args, partial(phase, client)))
        finally:
            await client.aclose()
    cpu = time.process_time() - cpu
    return Round(*_rates(view.nbytes, *times), 0.0, _per_gb(cpu, view.nbytes))


async def tier_round(url: str, pool: memoryview, block: int, args: argparse.Namespace, side: str):
    from backends.redis.tier import RedisTier

    half = pool.nbytes // block // 2  # store from the first half, load into the second
    options = dict(
        url=url,
        namespace=tier_namespace(args.token),
        max_inflight=args.concurrency,
        **({} if args.io_threads is None else {"io_threads": args.io_threads}),
        max_connections=args.concurrency + 1,
        cluster=args.cluster,
        pipeline_bytes=args.pipeline_mib << 20,
        encryption=args.keyring if side == "encrypted" else None,
    )
    keys = [b"block-%d" % i for i in range(half)]
    await _fresh_start(url, args)

    async def job(tier: RedisTier, kind: str, first: int, last: int) -> None:
        slots = range(first, last) if kind == "store" else range(half + first, half + last)
        meta = JobMetadata(next(_job_ids), keys[first:last], list(slots))
        (tier.submit_store if kind == "store" else tier.submit_load)(meta)
        result = await tier.result(meta.job_id)
        if not result.success:
            raise SystemExit(f"{side}: a {kind} job failed: {result.error}")

    times, cpu = [], time.process_time()
    async with LoopLagMonitor() as lag:
        for kinds in (("store",), ("load", "load")):
            tier = RedisTier(pool, block, **options)
            await tier.start()
            try:
                for kind in kinds:
                    times.append(await _timed(half, args, partial(job, tier, kind)))
            finally:
                await tier.aclose()
    cpu = time.process_time() - cpu
    _compare(pool, block, half, side)
    return Round(*_rates(half * block, *times), lag.p99_ms, _per_gb(cpu, half * block))


class LmcacheResp:
    """LMCache's ``resp`` L2 adapter (lmcache/v1/distributed/l2_adapters), driven
    from the event loop: jobs submitted as tasks, completions read off its event fds."""

    def __init__(self) -> None:
        os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
        import torch
        from lmcache.v1.distributed.api import ObjectKey
        from lmcache.v1.distributed.l2_adapters import create_l2_adapter
        from lmcache.v1.distributed.l2_adapters.config import get_l2_adapter_config_class
        from lmcache.v1.memory_management import (
            MemoryFormat,
            MemoryObjMetadata,
            TensorMemoryObj,
        )
        from lmcache.v1.platform.event_notifier import consume_fd

        self.torch, self.ObjectKey, self.consume_fd = torch, ObjectKey, consume_fd
        self.create = create_l2_adapter
        self.config = get_l2_adapter_config_class("resp")
        self.MemoryFormat, self.Metadata, self.TensorMemoryObj = (
            MemoryFormat,
            MemoryObjMetadata,
            TensorMemoryObj,
        )

    def adapter(self, url: str, workers: int):
        parts = urllib.parse.urlsplit(url)
        spec = {"type": "resp", "host": parts.hostname, "port": parts.port or 6379,
                "num_workers": workers}  # fmt: skip
        if parts.password:
            spec.update(username=parts.username or "", password=parts.password)
        return self.create(self.config.from_dict(spec))

    def objects(self, pool: memoryview, block: int) -> list:
        torch = self.torch
        data = torch.frombuffer(pool, dtype=torch.uint8)
        metadata = partial(
            self.Metadata,
            shape=torch.Size([block]),
            dtype=torch.uint8,
            address=0,
            phy_size=block,
            ref_count=1,
            fmt=self.MemoryFormat.KV_2LTD,
        )
        return [
            self.TensorMemoryObj(data[i * block : (i + 1) * block], metadata(), None)
            for i in range(pool.nbytes // block)
        ]


async def lmcache_round(
    lmcache: LmcacheResp, url: str, pool: memoryview, block: int, args: argparse.Namespace
):
    half = pool.nbytes // block // 2
    objects = lmcache.objects(pool, block)
    model = lmcache_model(args.token)
    keys = [lmcache.ObjectKey(b"block-%d" % i, model, 0) for i in range(half)]
    loop = asyncio.get_running_loop()
    await _fresh_start(url, args)

    async def run_phase(adapter, kind: str) -> float:
        waiting: dict[int, asyncio.Future] = {}

        def store_done() -> None:
            lmcache.consume_fd(adapter.get_store_event_fd())
            for task_id, result in adapter.pop_completed_store_tasks().items():
                waiting.pop(task_id).set_result(int(result) >= 0)

        def load_done() -> None:
            lmcache.consume_fd(adapter.get_load_event_fd())
            for task_id in list(waiting):
                bitmap = adapter.query_load_result(task_id)
                if bitmap is not None:
                    waiting.pop(task_id).set_result(bitmap)

        async def job(first: int, last: int) -> None:
            if kind == "store":
                task_id = adapter.submit_store_task(keys[first:last], objects[first:last])
            else:
                into = objects[half + first : half + last]
                task_id = adapter.submit_load_task(keys[first:last], into)
            waiting[task_id] = future = loop.create_future()
            outcome = await future
            if outcome is False or (kind == "load" and outcome.popcount() != last - first):
                raise SystemExit(f"lmcache: a {kind} job failed")

        fd = adapter.get_store_event_fd() if kind == "store" else adapter.get_load_event_fd()
        loop.add_reader(fd, store_done if kind == "store" else load_done)
        try:
            return await _timed(half, args, job)
        finally:
            loop.remove_reader(fd)

    times, cpu = [], time.process_time()
    async with LoopLagMonitor() as lag:
        for kinds in (("store",), ("load", "load")):
            adapter = lmcache.adapter(url, args.lmcache_workers)
            try:
                for kind in kinds:
                    times.append(await run_phase(adapter, kind))
            finally:
                adapter.close()
    cpu = time.process_time() - cpu
    objects.clear()  # views of the pool: gone before it is released
    _compare(pool, block, half, "lmcache")
    return Round(*_rates(half * block, *times), lag.p99_ms, _per_gb(cpu, half * block))


def load_lmcache(args: argparse.Namespace, url: str) -> tuple[LmcacheResp | None, str]:
    """LMCache's adapter if ``--lmcache``, the server and ``--repeat`` allow it (with
    ``auto``, a side too many for the rounds is left out), else why not."""
    if args.lmcache == "off":
        return None, "--lmcache off"
    others = 2 + (not args.no_encryption)
    if args.lmcache == "auto" and args.repeat <= others:
        return None, f"{others + 1} sides need --repeat {others + 1} or more"
    if args.cluster or not url.startswith("redis://"):
        why = "LMCache's resp adapter takes a plain redis:// server (no TLS, unix or cluster)"
    else:
        try:
            return LmcacheResp(), ""
        except ImportError as exc:
            why = f"import lmcache failed ({type(exc).__name__}: {exc})"
    if args.lmcache == "on":
        raise SystemExit(f"--lmcache on: {why}")
    return None, why


async def run(url: str, args: argparse.Namespace, progress: Progress) -> list[dict]:
    runs = []
    lmcache, skipped = load_lmcache(args, url)
    if skipped:
        print(f"lmcache side skipped: {skipped}", file=sys.stderr)
    sides = (
        ("baseline", "tier")
        + (() if args.no_encryption else ("encrypted",))
        + (("lmcache",) if lmcache is not None else ())
    )
    args.keyring = f"1:{base64.b64encode(os.urandom(32)).decode()}"  # this run's only key
    for block in args.block_sizes:
        count = max(1, (args.size_mib << 20) // block)
        buffer = mmap.mmap(-1, 2 * count * block)
        pool = memoryview(buffer)
        pool[: count * block] = os.urandom(count * block)
        # Fault in the half the sides load into now: otherwise the first side that
        # loads pays the page faults of fresh memory, and in the first round that is
        # always the same side.
        zeros = bytes(1 << 20)
        for offset in range(count * block, 2 * count * block, len(zeros)):
            end = min(offset + len(zeros), 2 * count * block)
            pool[offset:end] = zeros[: end - offset]
        gc.collect()
        gc.freeze()
        rounds: dict[str, list[Round]] = {side: [] for side in sides}
        try:
            for round_no in range(args.repeat):
                turn = round_no % len(sides)
                for side in sides[turn:] + sides[:turn]:
                    progress.update(f"{block >> 10} KiB round {round_no + 1}: {side}", force=True)
                    if side == "baseline":
                        result = await baseline_round(url, pool[: count * block], block, args)
                    elif side == "lmcache":
                        assert lmcache is not None
                        result = await lmcache_round(lmcache, url, pool, block, args)
                    else:
                        result = await tier_round(url, pool, block, args, side)
                    rounds[side].append(result)
                    progress.clear()
                    print(
                        f"{block >> 10} KiB round {round_no + 1}: {side} store "
                        f"{result.store_GBps:.2f} GB/s, load {result.load_GBps:.2f} GB/s "
                        f"(warm {result.warm_load_GBps:.2f})",
                        file=sys.stderr,
                    )
        except BaseException:
            # An interrupted round's frames, which the traceback keeps, still hold views
            # of the buffer: closing it would fail; it is unmapped once they go.
            pool.release()
            raise
        pool.release()
        buffer.close()
        gc.unfreeze()
        runs.append(_row(block, rounds))
        _print_row(runs[-1], args)
    return runs


def _median(rounds: list[Round], what: str) -> float:
    return round(statistics.median(getattr(r, what) for r in rounds), 3)


def _row(block: int, rounds: dict[str, list[Round]]) -> dict[str, float]:
    """One block size's figures (the module docstring names them)."""
    tier, baseline = rounds["tier"], rounds["baseline"]
    row: dict[str, float] = {"block_bytes": block}
    for what in ("store_GBps", "load_GBps", "warm_load_GBps"):
        row[what] = _median(tier, what)
        row[f"baseline_{what}"] = _median(baseline, what)
    row["loop_lag_p99_ms"] = round(max(r.loop_lag_p99_ms for r in tier), 3)
    row["cpu_s_per_GB"] = _median(tier, "cpu_s_per_GB")
    row["baseline_cpu_s_per_GB"] = _median(baseline, "cpu_s_per_GB")
    row["store_ratio"] = round(row["store_GBps"] / row["baseline_store_GBps"], 3)
    row["load_ratio"] = round(row["load_GBps"] / row["baseline_load_GBps"], 3)
    if "encrypted" in rounds:
        row.update(_encryption_figures(tier, rounds["encrypted"]))
    if "lmcache" in rounds:
        for what, key in (("store", "store"), ("load", "load"), ("warm_load", "warm_load")):
            row[f"lmcache_{what}_GBps"] = _median(rounds["lmcache"], f"{what}_GBps")
            row[f"{key}_vs_lmcache"] = _paired(tier, rounds["lmcache"], f"{what}_GBps")
        row["lmcache_loop_lag_p99_ms"] = round(max(r.loop_lag_p99_ms for r in rounds["lmcache"]), 3)
        row["lmcache_cpu_s_per_GB"] = _median(rounds["lmcache"], "cpu_s_per_GB")
    return row


def _paired(ours: list[Round], theirs: list[Round], attr: str) -> float:
    """The median over rounds of ours / theirs within each round."""
    pairs = zip(ours, theirs, strict=True)
    return round(statistics.median(getattr(o, attr) / getattr(t, attr) for o, t in pairs), 3)


def _print_row(row: dict[str, float], args: argparse.Namespace) -> None:
    kib = int(row["block_bytes"]) >> 10
    print(
        f"{kib} KiB blocks (medians of {args.repeat}): store {row['store_GBps']} vs "
        f"{row['baseline_store_GBps']} GB/s ({row['store_ratio']}x), load "
        f"{row['load_GBps']} vs {row['baseline_load_GBps']} GB/s ({row['load_ratio']}x), "
        f"warm load {row['warm_load_GBps']} vs {row['baseline_warm_load_GBps']} GB/s; "
        f"loop lag p99 (worst round) {row['loop_lag_p99_ms']} ms; CPU {row['cpu_s_per_GB']} "
        f"s/GB vs {row['baseline_cpu_s_per_GB']}"
    )
    if "encrypted_store_GBps" in row:
        print(
            f"{kib} KiB blocks, encrypted: store {row['encrypted_store_GBps']} GB/s "
            f"(costs {row['encryption_store_cost_pct']}%), load "
            f"{row['encrypted_load_GBps']} GB/s (costs {row['encryption_load_cost_pct']}%); "
            f"loop lag p99 (worst round) {row['encrypted_loop_lag_p99_ms']} ms"
        )
    if "lmcache_store_GBps" in row:
        print(
            f"{kib} KiB blocks, LMCache resp: store {row['lmcache_store_GBps']} GB/s "
            f"(ours {row['store_vs_lmcache']}x), load {row['lmcache_load_GBps']} GB/s "
            f"(ours {row['load_vs_lmcache']}x), warm load {row['lmcache_warm_load_GBps']} "
            f"GB/s (ours {row['warm_load_vs_lmcache']}x); loop lag p99 (worst round) "
            f"{row['lmcache_loop_lag_p99_ms']} ms; CPU {row['lmcache_cpu_s_per_GB']} s/GB"
        )


def _encryption_figures(plain: list[Round], sealed: list[Round]) -> dict[str, float]:
    """The encrypted tier's medians, and its throughput against the plain tier's round
    by round (see the module docstring)."""
    figures: dict[str, float] = {}
    for what in ("store", "load"):
        attr = f"{what}_GBps"
        ratio = _paired(sealed, plain, attr)
        figures[f"encrypted_{attr}"] = _median(sealed, attr)
        figures[f"encrypted_{what}_ratio"] = ratio
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
    parser.add_argument("--repeat", type=positive_int, default=5, help="rounds; medians reported")
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
    parser.add_argument(
        "--lmcache",
        choices=("auto", "on", "off"),
        default="auto",
        help="LMCache's resp adapter as a side (auto: when installed)",
    )
    parser.add_argument(
        "--io-threads", type=positive_int, default=None, help="the tier's io_threads (its default)"
    )
    parser.add_argument(
        "--lmcache-workers", type=positive_int, default=4, help="LMCache's resp num_workers"
    )
    args = parser.parse_args(argv)
    if args.url is not None and not args.url.startswith(("redis://", "rediss://", "unix://")):
        parser.error("argument url: must start with redis://, rediss:// or unix://")
    if args.cluster and args.url is not None and args.url.startswith("unix://"):
        parser.error("argument --cluster: needs a redis:// or rediss:// url")
    sides = 2 + (not args.no_encryption) + (args.lmcache == "on")
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
    args.token = secrets.token_hex(8)  # this run's keys carry it (see own_patterns)
    with Progress() as progress:
        if args.url is not None:
            runs = measure(args.url, args, progress)
        else:
            with tempfile.TemporaryDirectory(prefix="bench-redis-") as directory:
                server = (LocalRedisCluster if args.cluster else LocalRedisServer)(Path(directory))
                server.start()
                try:
                    runs = measure(server.url, args, progress)
                finally:
                    server.stop()
    print(json.dumps({**runs[0], "runs": runs}))


def measure(url: str, args: argparse.Namespace, progress: Progress) -> list[dict]:
    """:func:`run` on the server at ``url``; at the end, whether it succeeded, failed or
    was interrupted, the keys it wrote are deleted (and only they)."""
    try:
        return asyncio.run(run(url, args, progress))
    finally:
        progress.update("deleting the run's keys", force=True)
        delete_own(url, args)
        progress.clear()


if __name__ == "__main__":
    run_main(main)
