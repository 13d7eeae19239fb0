"""Benchmark the engine: the scheduler's hot path, event-loop health, round-trip overhead,
device copy speed.

Usage::

    python examples/bench_engine.py [--gib 1] [--loop uvloop|asyncio] [--policy NAME]
                                    [--hot-tier-steps N]

Four measurements, in one run (the hot path last, so that the others run as they did
before it existed):

0. Hot path: what a serving scheduler pays per call. Each step issues 200 ``store``
   calls (one 4 KiB block each, so copies cost next to nothing), awaits them, then 200
   ``lookup`` + ``load`` calls of the same blocks into other device blocks and awaits
   those. Every call is timed on its own (``call_us_p50``, ``call_us_p99`` over all
   calls; ``store_call_us_*`` and ``load_call_us_*`` apart); ``jobs_per_s`` is jobs over
   the wall time of the steps, completions included. It runs with the garbage
   collector as it is and after ``gc.freeze()`` (what serving frameworks do once their
   start-up allocations are done), three times each, alternating; figures are medians,
   the headline ones are the frozen runs (``*_gc_default`` the others). Two more runs
   with 16 blocks per call, GC frozen, give ``call_us_*_16`` (medians). The CPU tier
   holds every step's blocks, so it never evicts; with ``--hot-tier-steps N`` it holds
   N steps' blocks, so from step N on every step's stores evict (a serving tier's steady
   state).

1. Loop lag: the engine streams ``--gib`` GiB of 2 MiB blocks device -> CPU -> memory
   tier (write-through; ``streamed_bytes``) and promotes a quarter of them back memory
   tier -> CPU -> device, while a 1 ms ticker measures how late the loop wakes
   (``loop_lag_p99_ms``). ``bytes_moved`` counts every hop (2.5 times what is streamed)
   and ``moved_GBps`` is that over the run's seconds.
2. Overhead: a store + load round trip of one 2 MiB block through the CPU-only path,
   against a plain ``tensor.copy_`` of the same bytes there and back (medians;
   ``roundtrip_ratio`` = engine / plain), cycling through a 128 MiB working set as a
   server's KV blocks would; ``roundtrip_hot_ratio`` repeats it on one cache-hot block.
3. On CUDA only: device <-> host copies of 256 KiB .. 2 MiB blocks through the
   DeviceCopier, one-tensor and per-layer layouts, against one large pinned copy
   (``device_copy_ratio``: the worst of those ratios; null without CUDA).
4. Admission off the hot path: item 0's runs (one block a call, GC frozen) over a memory
   tier of four times the CPU tier's blocks, admitting everything and admitting
   adaptively, alternating, three runs each: ``admission_<rule>_call_us_p50`` (``_p99``,
   ``jobs_per_s``), medians, and ``admission_ratio_call_us_p50`` (``_p99``), adaptive
   over everything.

Every engine evicts its CPU tier by ``--policy`` (the default policy unless named).

A progress line shows on stderr while it runs, when stderr is a terminal. The last line
of output is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import statistics
import time

import torch
import uvloop

from tiering import TieringEngine
from tiering.cli_args import Progress, make_parser, positive_float, positive_int, run_main
from tiering.core.policies import DEFAULT_POLICY, policy_name, policy_names
from tiering.device.copier import DeviceCopier
from tiering.device.host_pool import HostPool
from tiering.observe.loop_lag import LoopLagMonitor

MIB = 1 << 20
BLOCK = 2 * MIB
BATCH = 16  # blocks per store job


def key(i: int) -> bytes:
    return b"bench-engine:" + i.to_bytes(8, "big")


def device_kv(num_blocks: int, block_bytes: int, device: str) -> torch.Tensor:
    kv = torch.empty((num_blocks, block_bytes // 2), dtype=torch.float16, device=device)
    kv.view(torch.int16).random_()
    return kv


async def loop_lag_run(total_bytes: int, policy: str, progress: Progress) -> dict[str, float]:
    """Stream ``total_bytes`` (whole 2 MiB blocks of it) device -> CPU -> memory tier and
    a quarter of it back, under a lag monitor."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    device_blocks = 4 * BATCH
    kv = device_kv(device_blocks, BLOCK, device)
    count = total_bytes // BLOCK
    tiers = [{"type": "memory", "max_blocks": count}]
    async with TieringEngine(kv, 4 * BATCH, policy=policy, secondary_tiers=tiers) as engine:
        async with LoopLagMonitor() as lag:
            start = time.perf_counter()
            cascades = []
            for first in range(0, count, BATCH):
                n = min(BATCH, count - first)
                ids = [(first + i) % device_blocks for i in range(n)]
                job = engine.store([key(first + i) for i in range(n)], ids)
                result = await job
                if not result.success:
                    raise SystemExit(f"store failed: {result.error}")
                cascades.append(job.cascaded)
                progress.update(f"loop lag: stored {first + n}/{count} blocks")
                if len(cascades) > 2:  # keep a couple of cascades in flight
                    await cascades.pop(0)
            for pending in cascades:
                await pending
            for first in range(0, count // 4, BATCH):  # promote a quarter back
                n = min(BATCH, count // 4 - first)
                result = await engine.load([key(first + i) for i in range(n)], list(range(n)))
                if not result.success:
                    raise SystemExit(f"load failed: {result.error}")
                progress.update(f"loop lag: loaded {first + n}/{count // 4} blocks")
            seconds = time.perf_counter() - start
        stats = engine.statistics().counters
    moved = (
        stats["bytes_to_host"]
        + stats["cascaded_blocks"] * BLOCK
        + stats["promoted_blocks"] * BLOCK
        + stats["bytes_to_device"]
    )
    return {
        "loop_lag_p99_ms": round(lag.p99_ms, 3),
        "loop_lag_max_ms": round(lag.max_ms, 3),
        "streamed_bytes": count * BLOCK,
        "bytes_moved": moved,
        "moved_GBps": round(moved / seconds / 1e9, 3),
        "seconds": round(seconds, 3),
    }


def loop_lag_summary(lag: dict[str, float]) -> str:
    """The line that reports :func:`loop_lag_run`'s figures."""
    return (
        f"loop lag while streaming {lag['streamed_bytes'] / 2**30:.2f} GiB of "
        f"{BLOCK >> 20} MiB blocks device -> CPU -> memory tier and a quarter of it back "
        f"({lag['bytes_moved'] / 2**30:.2f} GiB over all hops, {lag['moved_GBps']} GB/s): "
        f"p99 {lag['loop_lag_p99_ms']} ms, max {lag['loop_lag_max_ms']} ms"
    )


async def roundtrip_run(
    repeats: int, blocks: int, policy: str, progress: Progress
) -> dict[str, float]:
    """Median store+load of one 2 MiB block through the engine vs. two plain copies.

    Both sides cycle through ``blocks`` device blocks and host slots (``blocks`` = 1:
    the same, cache-hot bytes every time; 64: 128 MiB, more than the CPU caches hold,
    like KV blocks a real server moves).
    """
    kv = device_kv(2 * blocks, BLOCK, "cpu")
    host = HostPool(blocks, BLOCK, pin=False)
    plain = []
    for i in range(repeats):
        src, dst = kv[i % blocks].view(torch.uint8), host.tensor[i % blocks]
        t0 = time.perf_counter()
        dst.copy_(src)
        kv[blocks + i % blocks].view(torch.uint8).copy_(dst)
        plain.append(time.perf_counter() - t0)
    host.close()
    engine_times = []
    async with TieringEngine(kv, blocks, policy=policy) as engine:
        for i in range(repeats):
            t0 = time.perf_counter()
            stored = await engine.store([key(i)], [i % blocks])
            loaded = await engine.load([key(i)], [blocks + i % blocks])
            engine_times.append(time.perf_counter() - t0)
            progress.update(f"round trips ({blocks} blocks): {i + 1}/{repeats}")
            if not (stored.success and loaded.success):
                raise SystemExit("round trip failed")
        n = min(repeats, blocks)  # the blocks that made the trip
        if not torch.equal(kv[:n].view(torch.int16), kv[blocks : blocks + n].view(torch.int16)):
            raise SystemExit("round trip changed the bytes")
    return {
        "engine_ms": statistics.median(engine_times) * 1e3,
        "plain_ms": statistics.median(plain) * 1e3,
    }


SMALL_BLOCK = 4 << 10
STEP_REQUESTS = 200
HOT_STEPS = 20
ADMISSION_AB = ("all", "adaptive")  # baseline first
ADMISSION_REPEATS = 3


def quantile_us(samples_ns: list[int], q: float) -> float:
    ordered = sorted(samples_ns)
    return round(ordered[int(q * (len(ordered) - 1))] / 1000, 2)


async def hot_path_run(
    blocks_per_job: int,
    freeze: bool,
    policy: str,
    tier_steps: int = HOT_STEPS + 1,
    admission: str | None = None,
) -> dict[str, float]:
    """Steps of ``STEP_REQUESTS`` stores then lookup+loads of small blocks, on a CPU tier
    of ``tier_steps`` steps' blocks (with ``admission``: over a memory tier of four times
    its blocks, admitting by that rule); see items 0 and 4."""
    per_step = STEP_REQUESTS * blocks_per_job
    kv = torch.zeros((2 * per_step, SMALL_BLOCK // 2), dtype=torch.float16)
    kv[:per_step].view(torch.int16).random_()
    stores: list[int] = []
    loads: list[int] = []
    jobs = 0
    cpu_blocks = tier_steps * per_step
    tiers = []
    if admission is not None:
        tiers = [{"type": "memory", "max_blocks": 4 * cpu_blocks, "admission": admission}]
    async with TieringEngine(kv, cpu_blocks, policy=policy, secondary_tiers=tiers) as engine:
        if freeze:
            gc.freeze()
        n = 0
        start = 0.0
        for step in range(HOT_STEPS + 1):  # step 0 warms up, untimed
            if step == 1:
                stores.clear()
                loads.clear()
                start = time.perf_counter()
            pending = []
            for r in range(STEP_REQUESTS):
                hashes = [key(n + b) for b in range(blocks_per_job)]
                n += blocks_per_job
                ids = list(range(r * blocks_per_job, (r + 1) * blocks_per_job))
                t0 = time.perf_counter_ns()
                job = engine.store(hashes, ids)
                stores.append(time.perf_counter_ns() - t0)
                pending.append((job, hashes))
            for job, _ in pending:
                if not (await job).success:
                    raise SystemExit("hot path: a store failed")
            loaded = []
            for r, (_, hashes) in enumerate(pending):
                ids = list(
                    range(per_step + r * blocks_per_job, per_step + (r + 1) * blocks_per_job)
                )
                t0 = time.perf_counter_ns()
                hit = engine.lookup(hashes)
                job = engine.load(hashes[:hit], ids[:hit])
                loads.append(time.perf_counter_ns() - t0)
                loaded.append(job)
            for job in loaded:
                if not (await job).success:
                    raise SystemExit("hot path: a load failed")
            jobs += 2 * STEP_REQUESTS
        seconds = time.perf_counter() - start
        if not torch.equal(kv[:per_step].view(torch.int16), kv[per_step:].view(torch.int16)):
            raise SystemExit("hot path: loads did not bring back the stored bytes")
    if freeze:
        gc.unfreeze()
    jobs -= 2 * STEP_REQUESTS  # the warm-up step
    calls = stores + loads
    return {
        "call_us_p50": quantile_us(calls, 0.5),
        "call_us_p99": quantile_us(calls, 0.99),
        "store_call_us_p50": quantile_us(stores, 0.5),
        "store_call_us_p99": quantile_us(stores, 0.99),
        "load_call_us_p50": quantile_us(loads, 0.5),
        "load_call_us_p99": quantile_us(loads, 0.99),
        "jobs_per_s": round(jobs / seconds),
    }


async def hot_path_figures(policy: str, tier_steps: int, progress: Progress) -> dict[str, float]:
    """Item 0: alternating default-GC and frozen runs, medians; then 16 blocks a call."""
    runs: dict[bool, list[dict[str, float]]] = {False: [], True: []}
    for i in range(6):
        progress.update(f"hot path run {i + 1}/8", force=True)
        runs[i % 2 == 1].append(await hot_path_run(1, i % 2 == 1, policy, tier_steps))
    wide = []
    for i in range(2):
        progress.update(f"hot path run {7 + i}/8 (16 blocks a call)", force=True)
        wide.append(await hot_path_run(16, True, policy, tier_steps))

    def median(rows: list[dict[str, float]], name: str) -> float:
        return round(statistics.median(row[name] for row in rows), 2)

    names = list(runs[True][0])
    figures = {name: median(runs[True], name) for name in names}
    figures.update({f"{name}_gc_default": median(runs[False], name) for name in names})
    figures.update(
        {
            "call_us_p50_16": median(wide, "call_us_p50"),
            "call_us_p99_16": median(wide, "call_us_p99"),
            "jobs_per_s_16": median(wide, "jobs_per_s"),
        }
    )
    return figures


async def admission_figures(policy: str, tier_steps: int, progress: Progress) -> dict[str, float]:
    """Item 4: the hot path over a memory tier admitting everything, then adaptively,
    alternating, three runs each (GC frozen); medians and the adaptive/all ratios."""
    runs: dict[str, list[dict[str, float]]] = {rule: [] for rule in ADMISSION_AB}
    for i in range(2 * ADMISSION_REPEATS):
        rule = ADMISSION_AB[i % 2]
        progress.update(f"admission A/B run {i + 1}/{2 * ADMISSION_REPEATS} ({rule})", force=True)
        runs[rule].append(await hot_path_run(1, True, policy, tier_steps, admission=rule))
    figures: dict[str, float] = {}
    for rule, rows in runs.items():
        for name in ("call_us_p50", "call_us_p99", "jobs_per_s"):
            figures[f"admission_{rule}_{name}"] = round(statistics.median(r[name] for r in rows), 2)
    for name in ("call_us_p50", "call_us_p99"):
        all_, adaptive = (figures[f"admission_{rule}_{name}"] for rule in ADMISSION_AB)
        figures[f"admission_ratio_{name}"] = round(adaptive / all_, 3)
    return figures


def pinned_copy_speed(total_bytes: int) -> tuple[float, float]:
    """Bytes/s of one large device->pinned and pinned->device copy (best of 3)."""
    dev = torch.empty(total_bytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(total_bytes, dtype=torch.uint8, pin_memory=True)

    def best(dst: torch.Tensor, src: torch.Tensor) -> float:
        times = []
        for _ in range(4):  # the first is a warm-up
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        return total_bytes / min(times[1:])

    return best(host, dev), best(dev, host)


def block_image(kv: list[torch.Tensor], block: int) -> torch.Tensor:
    """The host-slot bytes of device block ``block``: its rows, layer after layer."""
    return torch.cat([t[block].view(torch.uint8).flatten() for t in kv]).cpu()


async def device_copy_run(total_bytes: int, progress: Progress) -> dict[str, object]:
    """CUDA only: DeviceCopier throughput vs. one large pinned copy, each direction.

    Both directions are warmed up first (staging buffers, lazily loaded kernels), then
    timed best of 3, like the pinned baseline; the bytes are checked after each direction.
    """
    d2h, h2d = pinned_copy_speed(total_bytes)
    rows = []
    for block in (256 << 10, 512 << 10, 1 << 20, 2 << 20):
        n = total_bytes // block
        for layout, layers in (("one-tensor", 1), ("per-layer", 32)):
            progress.update(f"device copies: {block >> 10} KiB {layout}", force=True)
            kv = [device_kv(n, block // layers, "cuda") for _ in range(layers)]
            probes = (0, n // 2, n - 1)
            with HostPool(n, block) as pool:
                async with DeviceCopier(kv if layers > 1 else kv[0], pool) as copier:
                    ids = list(range(n))
                    await copier.to_host(ids, ids)  # warm-up
                    await copier.to_device(ids, ids)  # warm-up: same bytes back
                    to_host = to_device = 0.0
                    for _ in range(3):
                        t0 = time.perf_counter()
                        await copier.to_host(ids, ids)
                        to_host = max(to_host, total_bytes / (time.perf_counter() - t0))
                    want = [block_image(kv, b) for b in probes]
                    if not all(
                        torch.equal(pool.tensor[b], w) for b, w in zip(probes, want, strict=True)
                    ):
                        raise SystemExit(f"device -> host copy changed the bytes ({layout})")
                    for _ in range(3):
                        for t in kv:
                            t.zero_()
                        torch.cuda.synchronize()  # not timed: the copy would wait for it
                        t0 = time.perf_counter()
                        await copier.to_device(ids, ids)
                        to_device = max(to_device, total_bytes / (time.perf_counter() - t0))
                    if not all(
                        torch.equal(block_image(kv, b), w)
                        for b, w in zip(probes, want, strict=True)
                    ):
                        raise SystemExit(f"host -> device copy changed the bytes ({layout})")
            rows.append(
                {
                    "block_bytes": block,
                    "layout": layout,
                    "to_host_GBps": round(to_host / 1e9, 2),
                    "to_device_GBps": round(to_device / 1e9, 2),
                    "ratio": round(min(to_host / d2h, to_device / h2d), 3),
                }
            )
            progress.clear()
            print(f"  {block >> 10:5d} KiB {layout:10s} {rows[-1]}")
            del kv
    return {
        "pinned_copy_d2h_GBps": round(d2h / 1e9, 2),
        "pinned_copy_h2d_GBps": round(h2d / 1e9, 2),
        "device_copy_ratio": min(r["ratio"] for r in rows),
        "device_copies": rows,
    }


async def main_async(args: argparse.Namespace, progress: Progress) -> dict[str, object]:
    figures: dict[str, object] = {
        "loop": args.loop,
        "policy": args.policy,
        "hot_tier_steps": args.hot_tier_steps,
        "block_bytes": BLOCK,
    }
    lag = await loop_lag_run(int(args.gib * (1 << 30)), args.policy, progress)
    progress.clear()
    print(loop_lag_summary(lag))
    figures.update(lag)
    cold = await roundtrip_run(args.repeats, 64, args.policy, progress)
    hot = await roundtrip_run(args.repeats, 1, args.policy, progress)
    progress.clear()
    figures.update(
        roundtrip_engine_ms=round(cold["engine_ms"], 3),
        roundtrip_plain_ms=round(cold["plain_ms"], 3),
        roundtrip_ratio=round(cold["engine_ms"] / cold["plain_ms"], 3),
        roundtrip_hot_engine_ms=round(hot["engine_ms"], 3),
        roundtrip_hot_plain_ms=round(hot["plain_ms"], 3),
        roundtrip_hot_ratio=round(hot["engine_ms"] / hot["plain_ms"], 3),
    )
    for name, rt in (("128 MiB working set", cold), ("one cache-hot block", hot)):
        print(
            f"2 MiB round trip, {name}: engine {rt['engine_ms']:.3f} ms, plain copies "
            f"{rt['plain_ms']:.3f} ms, ratio {rt['engine_ms'] / rt['plain_ms']:.2f}"
        )
    hot_path = await hot_path_figures(args.policy, args.hot_tier_steps, progress)
    progress.clear()
    evicting = " (CPU tier full)" if args.hot_tier_steps <= HOT_STEPS else ""
    print(
        f"hot path{evicting}, 1 x 4 KiB block a call: p50 {hot_path['call_us_p50']} us, p99 "
        f"{hot_path['call_us_p99']} us, {hot_path['jobs_per_s']} jobs/s (gc frozen); "
        f"p50 {hot_path['call_us_p50_gc_default']} us, p99 "
        f"{hot_path['call_us_p99_gc_default']} us, {hot_path['jobs_per_s_gc_default']} "
        f"jobs/s (gc as it is); 16 blocks a call: p50 {hot_path['call_us_p50_16']} us, "
        f"p99 {hot_path['call_us_p99_16']} us"
    )
    figures.update(hot_path)
    admission = await admission_figures(args.policy, args.hot_tier_steps, progress)
    progress.clear()
    print(
        f"hot path over a memory tier, adaptive admission / admitting everything: p50 "
        f"{admission['admission_ratio_call_us_p50']}x, p99 "
        f"{admission['admission_ratio_call_us_p99']}x (medians of {ADMISSION_REPEATS} runs "
        "each, alternating)"
    )
    figures.update(admission)
    if torch.cuda.is_available():
        print("device copies (CUDA):")
        figures.update(await device_copy_run(1 << 30, progress))
    else:
        print("device copies: skipped, no CUDA")
        figures["device_copy_ratio"] = None
    return figures


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, fully checked: a bad value exits with status 2 and a message
    naming the option, before anything is measured."""
    parser = make_parser(__doc__)
    parser.add_argument(
        "--gib",
        type=positive_float,
        default=1.0,
        help="GiB of 2 MiB blocks to stream device -> CPU -> memory tier for the loop-lag "
        "figure (a quarter of it then comes back)",
    )
    parser.add_argument(
        "--repeats", type=positive_int, default=200, help="round trips to time (medians)"
    )
    parser.add_argument(
        "--loop", choices=("uvloop", "asyncio"), default="uvloop", help="event loop to run on"
    )
    parser.add_argument(
        "--policy",
        type=policy_name,
        choices=policy_names(),
        default=DEFAULT_POLICY,
        help="the CPU tier's eviction policy, in every engine it runs",
    )
    parser.add_argument(
        "--hot-tier-steps",
        type=positive_int,
        default=HOT_STEPS + 1,
        metavar="N",
        help=f"the hot path's CPU tier, in steps of blocks; at most {HOT_STEPS} make its "
        "stores evict",
    )
    args = parser.parse_args(argv)
    if args.gib * (1 << 30) < BLOCK:
        parser.error(f"argument --gib: {args.gib} GiB holds no {BLOCK >> 20} MiB block")
    return args


def main() -> None:
    args = parse_args()
    runner = uvloop.run if args.loop == "uvloop" else asyncio.run
    with Progress() as progress:
        figures = runner(main_async(args, progress))
    print(json.dumps(figures))


if __name__ == "__main__":
    run_main(main)
