"""Fill an NVMe tier with many blocks, then time a cold restart and weigh its index.

Usage::

    python examples/bench_nvme_scale.py [--blocks 100000] [--block-size 16K] [--root DIR]
    python examples/bench_nvme_scale.py --blocks 1000000   # the docs' size: ~20 GiB on disk
    python examples/bench_nvme_scale.py --root DIR --keep    # fill once and keep it ...
    python examples/bench_nvme_scale.py --root DIR --reuse   # ... then measure it again

While it runs, a progress line shows on stderr when stderr is a terminal.

Only the tier's public API is used. The phases:

1. Fill, in a child process (so the process that measures the restarts never held the
   fill's index, as after a real restart): ``--blocks`` blocks, block ``i`` under the
   key sha256(i as 8 little-endian bytes), stored through the actor API (``put_store``
   jobs of ``--blocks-per-job`` blocks, at most ``--jobs-in-flight`` without a result)
   from a host pool of ``--pool-slots`` slots filled once with seeded pseudo-random
   bytes: block ``i`` comes from slot ``i % --pool-slots``. ``fill_GBps`` is payload
   bytes over the seconds from the first submit to the last result. A marker file
   (``bench_nvme_scale.json``) in the root records the fill; ``--reuse`` skips the fill
   when the marker says the root holds a complete fill of the same size.
2. The fill's tier closes gracefully; then, as ``--drop-cache`` says, ``fadvise`` (the
   default): every file under the root is synced and dropped from the page cache
   (``fsync``, then ``posix_fadvise(DONTNEED)``; other processes' cached pages stay);
   ``system``: the whole machine's caches are dropped, every process's
   (``/proc/sys/vm/drop_caches`` 3: data, directory entries and inodes; root only);
   ``none``: a ``sync``, nothing dropped. ``cold_restart`` is true only after
   ``system``: fadvise drops the files' data pages but not the cached directory entries
   and inodes that a restart's scan walks (``page_cache_drop`` says which was done).
3. Cold restart: a NEW tier on the same root and namespace, built and
   started (``await tier.start()``: it serves when that returns), timed without
   tracemalloc -> ``restart_s``. The growth of this process's VmRSS over construction
   and start (after ``gc.collect()``), divided by the blocks -> ``rss_bytes_per_block``
   (it also counts the I/O threads' stacks and what the allocator keeps). Then the
   checks: ``get_num_blocks()`` must equal ``--blocks``, a sample of keys must look up
   True (and an unstored key False), and a sample of blocks is loaded and compared byte
   for byte with what was stored.
4. Warm restart, timed the same way -> ``warm_restart_s`` (the scan with everything
   cached: what the restart costs without the disk).
5. Traced restart: the same under ``tracemalloc`` (started before construction); the
   traced memory after start minus before, both after ``gc.collect()``, divided by the
   blocks -> ``index_bytes_per_block``; the peak during start ->
   ``start_peak_bytes_per_block``. Not timed: tracemalloc slows every allocation.

Disk: each block takes a 4096-byte header page plus the payload, a record of a segment
file; the defaults (100,000 blocks of 16 KiB) need about 2 GiB, and the benchmark
refuses (exit status 2) a file system with less free.
Without ``--keep`` everything it put under the root is removed at the end.

The last line of output is one JSON object::

    {"blocks": ..., "block_bytes": ..., "restart_s": ..., "warm_restart_s": ...,
     "index_bytes_per_block": ..., "start_peak_bytes_per_block": ...,
     "rss_bytes_per_block": ..., "fill_s": ..., "fill_GBps": ..., "cold_restart": ...,
     "page_cache_drop": "fadvise"|"system"|"none", "recovered_blocks": ...,
     "verified_loads": ..., "reused": ..., "fsync": ..., "o_direct": ...,
     "root": ...}

``fill_s`` and ``fill_GBps`` are null when the fill was reused; ``root`` is null when
it was removed. Exit status 1 (after the JSON line, with the reason on stderr) when a
check failed: a wrong block count, a lookup, or a load that failed or differed.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import gc
import hashlib
import json
import multiprocessing
import os
import random
import shutil
import sys
import tempfile
import time
import tracemalloc
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from backends.nvme.tier import NVMeTier
from tiering.cli_args import (
    Progress,
    ensure_directory,
    make_parser,
    parse_size,
    positive_int,
    run_main,
)
from tiering.device.host_pool import HostPool
from tiering.tiers.tier_api import JobMetadata

sys.path.insert(0, str(Path(__file__).resolve().parent))  # imported by the tests too
from bench_nvme import (
    DROP_CACHES,
    drop_page_cache,
    drop_system_caches,
    files_under,
    may_drop_system_caches,
)

_ALIGN = 4096
"""Block sizes must be multiples of this (O_DIRECT needs aligned transfers)."""
_HEADER_BYTES = 4096
"""The header page in front of each block's payload in its file (docs/nvme.md)."""
_MIN_FREE_BYTES = 64 << 20
"""The tier's free-space floor: small, so the fill never reaches it."""
_DISK_SLACK_BYTES = 256 << 20
"""Room asked for beyond the records: directories, the namespace, the marker."""
_MARKER = "bench_nvme_scale.json"
_SEED = 20240805
_LOOKUP_SAMPLE = 1000
_LOAD_SAMPLE = 64


# -- blocks -------------------------------------------------------------------------------


def block_key(number: int) -> bytes:
    """The key of block ``number``: a 32-byte digest."""
    return hashlib.sha256(number.to_bytes(8, "little")).digest()


def pool_bytes(seed: int, slots: int, block: int) -> bytes:
    """The fill's host pool contents: block ``i`` is stored from slot ``i % slots``."""
    return random.Random(seed).randbytes(slots * block)


def namespace_for(block: int) -> str:
    # Unchanged, so that a root kept by an earlier run can be reused.
    return f"bench-nvme-scale;block={block};layout=segments"


def capacity_for(blocks: int, block: int) -> int:
    """A cap that never binds (the index is sized by it): what the records take plus
    1 % and a few segments."""
    per_block = block + _HEADER_BYTES
    return blocks * per_block + blocks // 100 * per_block + 8 * (256 << 20)


def sample(count: int, size: int) -> list[int]:
    """Up to ``size`` block numbers spread evenly over ``range(count)``, ends included."""
    if count <= size:
        return list(range(count))
    step = (count - 1) / (size - 1)
    return sorted({round(i * step) for i in range(size)})


def _duration(seconds: float) -> str:
    if seconds >= 90:
        return f"{seconds / 60:.1f} min"
    return f"{seconds:.1f} s"


# -- the fill (in a child process) -------------------------------------------------------


def fill(
    *,
    root: str,
    blocks: int,
    block: int,
    pool_slots: int,
    seed: int,
    fsync: str,
    blocks_per_job: int,
    jobs_in_flight: int,
    io_threads: int,
) -> dict[str, Any]:
    """Store ``blocks`` blocks into a new tier under ``root``; returns its figures."""
    with Progress() as progress:
        pool = HostPool(pool_slots, block, pin=False)
        try:
            view = pool.view
            view[:] = pool_bytes(seed, pool_slots, block)
            return asyncio.run(
                _fill(
                    view,
                    root=root,
                    blocks=blocks,
                    block=block,
                    pool_slots=pool_slots,
                    fsync=fsync,
                    blocks_per_job=blocks_per_job,
                    jobs_in_flight=jobs_in_flight,
                    io_threads=io_threads,
                    progress=progress,
                )
            )
        finally:
            pool.close()


async def _fill(
    view: memoryview,
    *,
    root: str,
    blocks: int,
    block: int,
    pool_slots: int,
    fsync: str,
    blocks_per_job: int,
    jobs_in_flight: int,
    io_threads: int,
    progress: Progress,
) -> dict[str, Any]:
    tier = NVMeTier(
        view,
        block,
        root=root,
        namespace=namespace_for(block),
        capacity_bytes=capacity_for(blocks, block),
        min_free_bytes=_MIN_FREE_BYTES,
        fsync=fsync,  # type: ignore[arg-type]
        max_inflight=jobs_in_flight,
        io_threads=io_threads,
        max_inflight_bytes=jobs_in_flight * blocks_per_job * block,
    )
    window = asyncio.Semaphore(jobs_in_flight)
    failures: list[str] = []
    stored = 0

    async def finish(job_id: int, count: int, start: float) -> None:
        nonlocal stored
        result = await tier.result(job_id)
        tier.get_finished()
        window.release()
        if not result.success:
            failures.append(f"store job {job_id}: {result.error}")
            return
        stored += count
        elapsed = time.perf_counter() - start
        rate = stored / elapsed if elapsed > 0 else 0.0
        eta = (blocks - stored) / rate if rate else 0.0
        progress.update(
            f"fill: {stored}/{blocks} blocks, {stored * block / elapsed / 1e9:.3f} GB/s, "
            f"about {_duration(eta)} left"
        )

    async with tier:
        if tier.get_num_blocks():
            raise SystemExit(f"fill: {tier.directory} already holds {tier.get_num_blocks()} blocks")
        progress.update(f"fill: 0/{blocks} blocks", force=True)
        start = time.perf_counter()
        async with asyncio.TaskGroup() as jobs:
            for job_id, first in enumerate(range(0, blocks, blocks_per_job), 1):
                await window.acquire()
                if failures:
                    break
                numbers = range(first, min(first + blocks_per_job, blocks))
                keys = [block_key(i) for i in numbers]
                slots = [i % pool_slots for i in numbers]
                await tier.put_store(JobMetadata(job_id, keys, slots))
                jobs.create_task(finish(job_id, len(keys), start))
        seconds = time.perf_counter() - start
        held = tier.get_num_blocks()
        o_direct = bool(tier.o_direct)
    progress.clear()
    if failures:
        raise SystemExit(f"fill: {len(failures)} store jobs failed; first: {failures[0]}")
    if held != blocks:
        raise SystemExit(f"fill: the tier holds {held} blocks after storing {blocks}")
    return {"fill_s": seconds, "o_direct": o_direct}


def run_fill(args: argparse.Namespace, progress: Progress) -> dict[str, Any]:
    """Run :func:`fill` in a fresh (spawned) process and return its figures."""
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=context) as pool:
        job = pool.submit(
            fill,
            root=args.root,
            blocks=args.blocks,
            block=args.block_size,
            pool_slots=args.pool_slots,
            seed=_SEED,
            fsync=args.fsync,
            blocks_per_job=args.blocks_per_job,
            jobs_in_flight=args.jobs_in_flight,
            io_threads=args.io_threads,
        )
        return job.result()


# -- page cache ---------------------------------------------------------------------------


def cool_down(root: str, how: str, progress: Progress) -> str:
    """Make the restart's reads of the root cold as ``how`` (``--drop-cache``) says;
    returns what was done: ``"fadvise"`` (the root's files synced and their data pages
    dropped, no other file's), ``"system"`` (the whole machine's caches, directory
    entries and inodes included) or ``"none"`` (a sync; also where ``posix_fadvise`` is
    missing). Exits (SystemExit) if ``system`` is refused."""
    if how == "system":
        progress.update(f"dropping the whole machine's caches ({DROP_CACHES})", force=True)
        drop_system_caches(3)
        return "system"
    if how == "fadvise":
        progress.update("syncing the root's files, dropping them from the page cache", force=True)
        if drop_page_cache(files_under(root)):
            return "fadvise"
    progress.update("flushing dirty pages (sync)", force=True)
    os.sync()
    return "none"


# -- restarts (in this process) ----------------------------------------------------------


def rss_bytes() -> int | None:
    """This process's resident set size (VmRSS), or None where /proc does not say."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


@dataclass
class Restarts:
    restart_s: float
    warm_restart_s: float
    rss_growth: int | None
    traced_growth: int
    traced_peak: int
    recovered: int
    verified_loads: int
    o_direct: bool
    page_cache_drop: str
    failures: list[str]


async def restarts(
    args: argparse.Namespace, seed: int, pool_slots: int, progress: Progress
) -> Restarts:
    """Drop the page cache, then start a new tier on the filled root three times: cold
    and timed (then the checks), warm and timed, traced."""
    pool = HostPool(min(_LOAD_SAMPLE, args.blocks), args.block_size, pin=False)
    view = pool.view

    def new_tier() -> NVMeTier:
        return NVMeTier(
            view,
            args.block_size,
            root=args.root,
            namespace=namespace_for(args.block_size),
            capacity_bytes=capacity_for(args.blocks, args.block_size),
            min_free_bytes=_MIN_FREE_BYTES,
            fsync=args.fsync,
            io_threads=args.io_threads,
        )

    try:
        page_cache_drop = cool_down(args.root, args.drop_cache, progress)
        progress.update(f"restart (cold): scanning {args.blocks} blocks", force=True)
        gc.collect()
        rss_before = rss_bytes()
        start = time.perf_counter()
        tier = new_tier()
        await tier.start()
        restart_s = time.perf_counter() - start
        gc.collect()
        rss_after = rss_bytes()
        async with tier:
            recovered = tier.get_num_blocks()
            o_direct = bool(tier.o_direct)
            progress.update("checking lookups and loads", force=True)
            failures, verified = await check(tier, view, args, seed, pool_slots)

        progress.update(f"restart (warm): scanning {args.blocks} blocks", force=True)
        gc.collect()
        start = time.perf_counter()
        tier = new_tier()
        await tier.start()
        warm_restart_s = time.perf_counter() - start
        await tier.aclose()
        del tier

        progress.update(f"restart (traced): scanning {args.blocks} blocks", force=True)
        gc.collect()
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            tier = new_tier()
            await tier.start()
            gc.collect()
            after, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        await tier.aclose()
    finally:
        pool.close()
    return Restarts(
        restart_s=restart_s,
        warm_restart_s=warm_restart_s,
        rss_growth=None if rss_before is None or rss_after is None else rss_after - rss_before,
        traced_growth=after - before,
        traced_peak=peak - before,
        recovered=recovered,
        verified_loads=verified,
        o_direct=o_direct,
        page_cache_drop=page_cache_drop,
        failures=failures,
    )


async def check(
    tier: NVMeTier, view: memoryview, args: argparse.Namespace, seed: int, pool_slots: int
) -> tuple[list[str], int]:
    """The restarted tier's count, lookups and loads; returns (failures, blocks verified)."""
    failures: list[str] = []
    blocks, block = args.blocks, args.block_size
    held = tier.get_num_blocks()
    if held != blocks:
        failures.append(f"the restarted tier holds {held} blocks, not {blocks}")
    missed = [i for i in sample(blocks, _LOOKUP_SAMPLE) if tier.lookup(block_key(i)) is not True]
    if missed:
        failures.append(f"{len(missed)} sampled keys do not look up True, e.g. block {missed[0]}")
    if tier.lookup(block_key(blocks)) is not False:
        failures.append(f"block {blocks}, never stored, does not look up False")

    numbers = sample(blocks, len(view) // block)
    keys = [block_key(i) for i in numbers]
    await tier.put_load(JobMetadata(1, keys, range(len(numbers))))
    result = await tier.result(1)
    tier.get_finished()
    bad = set(result.failed_keys)
    if not result.success:
        failures.append(f"the sample load failed: {result.error}")
    expected = pool_bytes(seed, pool_slots, block)
    verified, differ = 0, []
    for slot, (number, key) in enumerate(zip(numbers, keys, strict=True)):
        if key in bad:
            continue
        source = (number % pool_slots) * block
        if view[slot * block : (slot + 1) * block] != expected[source : source + block]:
            differ.append(number)
        else:
            verified += 1
    if differ:
        failures.append(
            f"{len(differ)} of {len(numbers)} loaded blocks differ from the bytes stored, "
            f"e.g. blocks {', '.join(map(str, differ[:3]))}"
        )
    if not result.success and not bad:
        verified = 0  # a job failed as a whole counts no key as loaded
    return failures, verified


# -- main ---------------------------------------------------------------------------------


def run(args: argparse.Namespace, progress: Progress) -> dict[str, Any]:
    marker = os.path.join(args.root, _MARKER)
    seed, pool_slots, fill_s, o_direct_fill = _SEED, args.pool_slots, None, None
    if args.reusing:
        with open(marker) as f:
            recorded = json.load(f)
        seed, pool_slots = recorded["seed"], recorded["pool_slots"]
    else:
        _write_marker(marker, args, complete=False)
        figures = run_fill(args, progress)
        fill_s, o_direct_fill = figures["fill_s"], figures["o_direct"]
        _write_marker(marker, args, complete=True, fill_s=fill_s)

    found = asyncio.run(restarts(args, seed, pool_slots, progress))
    progress.clear()
    blocks, block = args.blocks, args.block_size
    summary: dict[str, Any] = {
        "blocks": blocks,
        "block_bytes": block,
        "restart_s": round(found.restart_s, 4),
        "warm_restart_s": round(found.warm_restart_s, 4),
        "index_bytes_per_block": round(found.traced_growth / blocks, 1),
        "start_peak_bytes_per_block": round(found.traced_peak / blocks, 1),
        "rss_bytes_per_block": (
            None if found.rss_growth is None else round(found.rss_growth / blocks, 1)
        ),
        "fill_s": None if fill_s is None else round(fill_s, 3),
        "fill_GBps": None if fill_s is None else round(blocks * block / fill_s / 1e9, 4),
        "cold_restart": found.page_cache_drop == "system",
        "page_cache_drop": found.page_cache_drop,
        "recovered_blocks": found.recovered,
        "verified_loads": found.verified_loads,
        "reused": args.reusing,
        "fsync": args.fsync,
        "o_direct": found.o_direct if o_direct_fill is None else o_direct_fill,
        "root": args.root if args.keep else None,
    }
    fill_text = (
        "fill reused"
        if fill_s is None
        else f"filled in {_duration(fill_s)} ({summary['fill_GBps']:.3f} GB/s)"
    )
    rss = summary["rss_bytes_per_block"]
    print(
        f"{blocks} blocks of {block >> 10} KiB, fsync={args.fsync}, "
        f"{'O_DIRECT' if summary['o_direct'] else 'buffered'}: {fill_text}; "
        f"restart {found.restart_s:.3f} s "
        f"({'cold' if summary['cold_restart'] else 'page cache: ' + found.page_cache_drop}), "
        f"warm {found.warm_restart_s:.3f} s; index {summary['index_bytes_per_block']} B/block "
        f"(tracemalloc), RSS {'?' if rss is None else rss} B/block; "
        f"{found.recovered} blocks recovered, {found.verified_loads} loads byte-exact",
        flush=True,
    )
    summary["failures"] = found.failures
    return summary


def _write_marker(path: str, args: argparse.Namespace, **fields: Any) -> None:
    record = {
        "blocks": args.blocks,
        "block_bytes": args.block_size,
        "namespace": namespace_for(args.block_size),
        "seed": _SEED,
        "pool_slots": args.pool_slots,
        "fsync": args.fsync,
        **fields,
    }
    temp = f"{path}.tmp"
    with open(temp, "w") as f:
        json.dump(record, f, sort_keys=True)
    os.replace(temp, path)


def remove_ours(root: str, before: set[str] | None) -> None:
    """Remove the root (``before`` None: we made it) or the entries we added to it."""
    if before is None:
        shutil.rmtree(root, ignore_errors=True)
        return
    for name in set(os.listdir(root)) - before:
        path = os.path.join(root, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


def block_size(text: str) -> int:
    """An argparse type: one size (``16K``), a multiple of 4096 bytes."""
    try:
        size = parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if size % _ALIGN:
        raise argparse.ArgumentTypeError(
            f"{size} bytes is not a multiple of {_ALIGN} (O_DIRECT needs aligned blocks)"
        )
    return size


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, fully checked: a bad value exits with status 2 and a message
    naming the option, before any block is written. Sets ``args.reusing`` (the root
    holds a complete fill to measure) and ``args.made_root`` (no ``--root``: a temporary
    one is to be made)."""
    parser = make_parser(__doc__)
    parser.add_argument(
        "--root", help="the tier's root directory (default: a new temporary directory)"
    )
    parser.add_argument(
        "--blocks",
        type=positive_int,
        default=100_000,
        help="blocks to fill (100000 of 16K: 1.5 GiB of payload, about 2 GiB on disk; the "
        "docs' figures are at 1000000: about 20 GiB on disk)",
    )
    parser.add_argument(
        "--block-size",
        type=block_size,
        default="16K",
        help="bytes per block (K, M, G suffixes; a multiple of 4K)",
    )
    parser.add_argument(
        "--fsync",
        choices=("none", "batch", "always"),
        default="none",
        help="the tier's fsync policy during the fill",
    )
    parser.add_argument(
        "--jobs-in-flight",
        type=positive_int,
        default=4,
        help="store jobs submitted and without a result at once (also the tier's max_inflight)",
    )
    parser.add_argument(
        "--blocks-per-job", type=positive_int, default=256, help="blocks per store job"
    )
    parser.add_argument("--io-threads", type=positive_int, default=4, help="tier I/O threads")
    parser.add_argument(
        "--pool-slots",
        type=positive_int,
        default=256,
        help="host pool slots holding the payload; the blocks cycle through them",
    )
    parser.add_argument(
        "--drop-cache",
        choices=("fadvise", "system", "none"),
        default="fadvise",
        help="before the cold restart: fadvise = the root's files synced and dropped from "
        "the page cache (nothing else); system = the whole machine's caches, every "
        f"process's ({DROP_CACHES}, root only); none = keep the cache",
    )
    parser.add_argument(
        "--keep", action="store_true", help="keep the filled root (printed as 'root')"
    )
    parser.add_argument(
        "--reuse",
        action="store_true",
        help="skip the fill when --root already holds a complete fill of the same "
        "--blocks and --block-size (recorded in its bench_nvme_scale.json); implies --keep",
    )
    args = parser.parse_args(argv)
    if args.drop_cache == "system" and not may_drop_system_caches():
        parser.error(f"argument --drop-cache: system needs write access to {DROP_CACHES} (root)")
    if args.reuse:
        if args.root is None:
            parser.error("argument --reuse: needs --root (a temporary root starts empty)")
        args.keep = True
    args.made_root = args.root is None
    args.reusing = False
    where = tempfile.gettempdir() if args.root is None else args.root
    if args.root is not None:
        ensure_directory(parser, "--root", args.root)
        args.reusing = _check_marker(parser, args)
    if not args.reusing:
        _check_space(parser, args, where)
    return args


def _check_marker(parser: argparse.ArgumentParser, args: argparse.Namespace) -> bool:
    """True if the root holds a complete fill to reuse; exits (status 2) when the root
    holds a fill that cannot be used as asked."""
    path = os.path.join(args.root, _MARKER)
    try:
        with open(path) as f:
            recorded = json.load(f)
    except FileNotFoundError:
        return False
    except (OSError, ValueError) as exc:
        parser.error(f"argument --root: cannot read {path!r}: {exc}; remove {args.root!r}")
    if not args.reuse:
        parser.error(
            f"argument --root: {args.root!r} already holds a fill by this benchmark ({path}); "
            "pass --reuse to measure it again, or remove it"
        )
    if not isinstance(recorded, dict) or not recorded.get("complete"):
        parser.error(f"argument --root: {args.root!r} holds an incomplete fill ({path}); remove it")
    asked = {
        "blocks": args.blocks,
        "block_bytes": args.block_size,
        "namespace": namespace_for(args.block_size),
    }
    found = {name: recorded.get(name) for name in asked}
    if found != asked:
        parser.error(
            f"argument --root: {args.root!r} holds a fill of {found['blocks']} blocks of "
            f"{found['block_bytes']} bytes in namespace {found['namespace']!r}, not "
            f"{args.blocks} of {args.block_size}; use those or another root"
        )
    return True


def _check_space(parser: argparse.ArgumentParser, args: argparse.Namespace, where: str) -> None:
    """Refuse a file system without room (bytes and inodes) for the fill."""
    stats = os.statvfs(where)
    unit = stats.f_frsize or 4096
    per_block = -(-(args.block_size + _HEADER_BYTES) // unit) * unit
    need = args.blocks * per_block + _DISK_SLACK_BYTES + _MIN_FREE_BYTES
    free = stats.f_bavail * stats.f_frsize
    if free < need:
        parser.error(
            f"argument --blocks: {args.blocks} blocks of {args.block_size} bytes need about "
            f"{need / (1 << 30):.2f} GiB on the file system of {where!r}, which has "
            f"{free / (1 << 30):.2f} GiB free; use fewer or smaller blocks, or another --root"
        )


def main() -> None:
    args = parse_args()
    before: set[str] | None = None
    if args.made_root:
        args.root = tempfile.mkdtemp(prefix="bench-nvme-scale-")
    elif not args.reusing:
        before = set(os.listdir(args.root))
    with Progress() as progress:
        try:
            summary = run(args, progress)
        finally:
            if not args.keep:
                progress.update(f"removing the blocks under {args.root}", force=True)
                remove_ours(args.root, before)
    failures = summary.pop("failures")
    print(json.dumps(summary))
    if failures:
        sys.stdout.flush()
        raise SystemExit("bench_nvme_scale: check failed: " + "; ".join(failures))


if __name__ == "__main__":
    run_main(main)
