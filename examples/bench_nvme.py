"""Benchmark the NVMe tier against a raw baseline on the same directory.

Usage::

    apt-get install -y fio          # optional: the baseline uses fio when it is installed
    python examples/bench_nvme.py [DIR] [--size-gib 1] [--block-sizes 2M,128K]

While it runs, a progress line shows on stderr when stderr is a terminal.

For each block size, in one run: a raw baseline writes then reads ``--size-gib`` of data
sequentially in one file of DIR (fio with ``ioengine=psync``, or a plain ``os.pwritev``/
``os.preadv`` loop when fio is missing), then the tier stores the same amount as blocks
through its actor API (``put_store`` jobs of ``--job-mib`` each, at most
``--max-inflight`` running) and loads it all back, from an asyncio loop on which a 1 ms
ticker measures loop lag. Both sides use O_DIRECT when the tier's probe found it usable
(so loads are cold); otherwise the page cache is dropped before each read phase
(``/proc/sys/vm/drop_caches`` if permitted, else ``posix_fadvise(DONTNEED)`` per file)
and ``cold_load`` says whether that worked. The baseline's write ends with one fsync
when the tier's fsync policy is not ``none``. Throughput counts payload bytes only.

The last line of output is one JSON object::

    {"runs": [{"block_bytes": ..., "store_GBps": ..., "load_GBps": ...,
               "baseline_store_GBps": ..., "baseline_load_GBps": ...,
               "store_ratio": ..., "load_ratio": ..., "loop_lag_p99_ms": ...,
               "idle_loop_lag_p99_ms": ..., "cold_load": true|false}, ...]}

``loop_lag_p99_ms`` is the worst round's; ``idle_loop_lag_p99_ms`` is the worst round's
lag of the same loop with nothing running (what the machine adds by itself). Each round
stores into a tier of its own; the rounds' files are removed after the last round of a
block size (see :func:`bench_tier` for why not between rounds).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import mmap
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from _cli import (
    Progress,
    ensure_directory,
    make_parser,
    positive_float,
    positive_int,
    size_list,
)

from backends.nvme import NVMeTier
from backends.nvme_files import probe_o_direct
from tiering.host_pool import HostPool
from tiering.loop_lag import LoopLagMonitor
from tiering.secondary import JobMetadata

# O_DIRECT (used by the baseline and the tier when the probe allows it) needs
# block-aligned transfers; 4 KiB covers every common logical block size.
_ALIGN = 4096


@dataclass
class Phase:
    seconds: float
    lag_p99_ms: float


@dataclass
class TierFigures:
    store_GBps: float
    load_GBps: float
    loop_lag_p99_ms: float
    cold_load: bool
    o_direct: bool
    idle_lag_p99_ms: float
    """The same loop's lag with nothing running: what the machine adds by itself."""


# -- page cache ---------------------------------------------------------------------------


def drop_page_cache(paths: list[str]) -> bool:
    """Evict ``paths`` from the page cache; True if it is known to have worked."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return True
    except OSError:
        pass
    if not hasattr(os, "posix_fadvise"):
        return False
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return True


def files_under(directory: str) -> Iterator[str]:
    for parent, _, names in os.walk(directory):
        for name in names:
            yield os.path.join(parent, name)


# -- baseline -----------------------------------------------------------------------------


def fio_baseline(
    path: str, block: int, total: int, direct: bool, fsync: bool
) -> tuple[float, float]:
    """(write GB/s, read GB/s) of one sequential fio stream."""

    def run(rw: str) -> float:
        command = [
            "fio",
            "--name=baseline",
            f"--filename={path}",
            f"--rw={rw}",
            f"--bs={block}",
            f"--size={total}",
            f"--direct={int(direct)}",
            "--ioengine=psync",
            "--numjobs=1",
            "--output-format=json",
        ]
        if rw == "write" and fsync:
            command.append("--end_fsync=1")
        done = subprocess.run(command, capture_output=True, text=True, check=True)
        report = json.loads(done.stdout[done.stdout.index("{") :])
        return report["jobs"][0][rw]["bw_bytes"] / 1e9

    written = run("write")
    if not direct:
        drop_page_cache([path])
    return written, run("read")


def python_baseline(
    path: str, block: int, total: int, direct: bool, fsync: bool
) -> tuple[float, float]:
    """(write GB/s, read GB/s) of a sequential os.pwritev / os.preadv loop."""
    buffer = mmap.mmap(-1, block)
    buffer.write(os.urandom(block))
    view = memoryview(buffer)
    flags = os.O_DIRECT if direct else 0
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | flags, 0o644)
    start = time.perf_counter()
    for offset in range(0, total, block):
        os.pwritev(fd, [view], offset)
    if fsync:
        os.fsync(fd)
    written = total / (time.perf_counter() - start) / 1e9
    os.close(fd)
    if not direct:
        drop_page_cache([path])
    fd = os.open(path, os.O_RDONLY | flags)
    start = time.perf_counter()
    for offset in range(0, total, block):
        os.preadv(fd, [view], offset)
    read = total / (time.perf_counter() - start) / 1e9
    os.close(fd)
    view.release()
    buffer.close()
    return written, read


# -- the tier -----------------------------------------------------------------------------


async def _drive(
    tier: NVMeTier,
    batches: list[list[bytes]],
    windows: int,
    job_blocks: int,
    *,
    load: bool,
    report: Callable[[str], None],
) -> Phase:
    """Run one job per batch; each job owns one of ``windows`` disjoint slot ranges until
    its result arrives, so no two jobs in flight ever touch the same slot. ``report``
    gets a short status after each job finishes."""
    free: asyncio.Queue[int] = asyncio.Queue()
    for window in range(windows):
        free.put_nowait(window * job_blocks)
    results = []

    async def finish(job_id: int, base: int) -> None:
        results.append(await tier.result(job_id))
        free.put_nowait(base)
        report(f"{'load' if load else 'store'} jobs {len(results)}/{len(batches)}")

    async with LoopLagMonitor() as lag:
        start = time.perf_counter()
        async with asyncio.TaskGroup() as jobs:
            for job_id, keys in enumerate(batches, 1):
                base = await free.get()
                job = JobMetadata(job_id, keys, range(base, base + len(keys)))
                await (tier.put_load(job) if load else tier.put_store(job))
                jobs.create_task(finish(job_id, base))
        seconds = time.perf_counter() - start
        tier.get_finished()
    failed = [r for r in results if not r.success]
    if failed:
        raise SystemExit(f"{len(failed)} {'load' if load else 'store'} jobs failed: {failed[0]}")
    return Phase(seconds, lag.p99_ms)


async def bench_tier(
    directory: str,
    block: int,
    total: int,
    args: argparse.Namespace,
    report: Callable[[str], None],
    round_no: int,
    keep_dirs: list[str],
) -> TierFigures:
    """One round: store ``total`` bytes into a new tier, then load them back.

    Each round uses its own namespace (so it starts empty). Its directory is appended
    to ``keep_dirs`` for the caller to remove after the last round. Removing it between
    rounds would time the next round's
    stores against a file system that has just freed thousands of inodes: ext4 without
    a journal then skips every recently freed inode when it allocates one (measured:
    about 0.2 ms of kernel CPU per file created), which makes the rounds unequal.
    """
    job_blocks = max(1, (args.job_mib << 20) // block)
    windows = args.max_inflight + 2  # a couple queued beyond those running
    slots = job_blocks * windows
    pool = HostPool(slots, block, pin=False)  # the CPU tier's own page-aligned buffer
    view = pool.view
    for offset in range(0, slots * block, 1 << 20):
        chunk = min(1 << 20, slots * block - offset)
        view[offset : offset + chunk] = os.urandom(chunk)
    count = total // block
    keys = [f"bench-{block}-{i}".encode().ljust(32, b".") for i in range(count)]
    batches = [keys[first : first + job_blocks] for first in range(0, count, job_blocks)]

    tier = NVMeTier(
        view,
        block,
        root=directory,
        namespace=f"bench;block={block};round={round_no}",
        capacity_bytes=count * (block + 4096) * 2,
        min_free_bytes=0,
        fsync=args.fsync,
        io_threads=args.io_threads,
        max_inflight=args.max_inflight,
        max_inflight_bytes=args.max_inflight * job_blocks * block,
    )
    async with LoopLagMonitor() as idle:
        await asyncio.sleep(1.0)
    try:
        async with tier:
            store = await _drive(tier, batches, windows, job_blocks, load=False, report=report)
            report("dropping the page cache")
            cold = bool(tier.o_direct) or drop_page_cache(list(files_under(tier.directory)))
            load = await _drive(tier, batches, windows, job_blocks, load=True, report=report)
            o_direct = bool(tier.o_direct)
            corrupt = tier.metrics.corrupt_blocks
    finally:
        keep_dirs.append(tier.directory)
        pool.close()
    if corrupt:
        raise SystemExit(f"{corrupt} blocks failed verification")
    return TierFigures(
        store_GBps=total / store.seconds / 1e9,
        load_GBps=total / load.seconds / 1e9,
        loop_lag_p99_ms=max(store.lag_p99_ms, load.lag_p99_ms),
        cold_load=cold,
        o_direct=o_direct,
        idle_lag_p99_ms=idle.p99_ms,
    )


# -- main ---------------------------------------------------------------------------------


def run(directory: str, args: argparse.Namespace, progress: Progress) -> list[dict[str, object]]:
    """Every block size: ``--repeat`` rounds of baseline then tier; medians reported."""
    runs: list[dict[str, object]] = []
    total = int(args.size_gib * (1 << 30))
    use_fio = args.baseline == "fio" or (args.baseline == "auto" and shutil.which("fio"))
    baseline = fio_baseline if use_fio else python_baseline
    direct = probe_o_direct(directory) is None  # the tier's own probe decides the same
    loop_factory = None
    if args.loop == "uvloop":
        import uvloop

        loop_factory = uvloop.new_event_loop
    for block in args.block_sizes:
        size = total // block * block
        base_writes, base_reads, tiers = [], [], []
        tier_dirs: list[str] = []  # removed once every round of this size has run
        try:
            for round_no in range(1, args.repeat + 1):
                where = f"block {_size_text(block)}, round {round_no}/{args.repeat}"

                def report(status: str, where: str = where) -> None:
                    progress.update(f"{where}: tier {status}")

                progress.update(f"{where}: baseline write and read", force=True)
                path = os.path.join(directory, f"baseline-{block}.dat")
                try:
                    written, read = baseline(path, block, size, direct, args.fsync != "none")
                finally:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(path)
                base_writes.append(written)
                base_reads.append(read)
                with asyncio.Runner(loop_factory=loop_factory) as runner:
                    tiers.append(
                        runner.run(
                            bench_tier(directory, block, size, args, report, round_no, tier_dirs)
                        )
                    )
        finally:
            progress.update(f"block {_size_text(block)}: removing the tier's files", force=True)
            for tier_dir in tier_dirs:
                shutil.rmtree(tier_dir, True)
        store = statistics.median(t.store_GBps for t in tiers)
        load = statistics.median(t.load_GBps for t in tiers)
        base_write = statistics.median(base_writes)
        base_read = statistics.median(base_reads)
        entry: dict[str, object] = {
            "block_bytes": block,
            "store_GBps": round(store, 3),
            "load_GBps": round(load, 3),
            "baseline_store_GBps": round(base_write, 3),
            "baseline_load_GBps": round(base_read, 3),
            "store_ratio": round(store / base_write, 3),
            "load_ratio": round(load / base_read, 3),
            "loop_lag_p99_ms": round(max(t.loop_lag_p99_ms for t in tiers), 3),
            "idle_loop_lag_p99_ms": round(max(t.idle_lag_p99_ms for t in tiers), 3),
            "cold_load": all(t.cold_load for t in tiers),
        }
        progress.clear()
        print(
            f"block {block >> 10} KiB x {size / (1 << 30):.2f} GiB, "
            f"{'O_DIRECT' if tiers[0].o_direct else 'buffered'}, fsync={args.fsync}, "
            f"baseline={'fio' if use_fio else 'python'}, median of {args.repeat}: "
            f"store {store:.3f} GB/s (baseline {base_write:.3f}; each run "
            f"{_list(t.store_GBps for t in tiers)} vs {_list(base_writes)}), "
            f"load {load:.3f} GB/s (baseline {base_read:.3f}; each run "
            f"{_list(t.load_GBps for t in tiers)} vs {_list(base_reads)}), "
            f"loop lag p99 {_list(t.loop_lag_p99_ms for t in tiers)} ms "
            f"(idle loop {_list(t.idle_lag_p99_ms for t in tiers)} ms)",
            flush=True,
        )
        runs.append(entry)
    return runs


def _list(values: Iterable[float]) -> str:
    return "[" + ", ".join(f"{v:.2f}" for v in values) + "]"


def _size_text(size: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if size >= 1 << shift and size % (1 << shift) == 0:
            return f"{size >> shift} {unit}"
    return f"{size} B"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, fully checked: a bad value exits with status 2 and a message
    naming the option, before any directory is created or any byte written."""
    parser = make_parser(__doc__)
    parser.add_argument("directory", nargs="?", help="directory to test (default: a temp dir)")
    parser.add_argument("--size-gib", type=positive_float, default=1.0, help="data per run, GiB")
    parser.add_argument(
        "--block-sizes",
        type=size_list,
        default="2M,128K",
        help="comma-separated block sizes (K, M, G suffixes; multiples of 4K)",
    )
    parser.add_argument(
        "--job-mib", type=positive_int, default=32, help="payload per store/load job, MiB"
    )
    parser.add_argument(
        "--fsync",
        choices=("none", "batch", "always"),
        default="batch",
        help="the tier's fsync policy (the baseline fsyncs once unless none)",
    )
    parser.add_argument("--io-threads", type=positive_int, default=4, help="tier I/O threads")
    parser.add_argument("--max-inflight", type=positive_int, default=4, help="tier jobs running")
    parser.add_argument(
        "--baseline",
        choices=("auto", "fio", "python"),
        default="auto",
        help="raw baseline: fio, a Python pwritev/preadv loop, or fio when installed",
    )
    parser.add_argument(
        "--loop", choices=("asyncio", "uvloop"), default="asyncio", help="event loop to run on"
    )
    parser.add_argument(
        "--repeat", type=positive_int, default=3, help="rounds per block size; medians reported"
    )
    args = parser.parse_args(argv)
    total = int(args.size_gib * (1 << 30))
    for block in args.block_sizes:
        if block % _ALIGN:
            parser.error(
                f"argument --block-sizes: {block} bytes is not a multiple of {_ALIGN} "
                "(O_DIRECT needs aligned blocks)"
            )
        if total < block:
            parser.error(
                f"argument --size-gib: {args.size_gib} GiB holds no block of {block} bytes"
            )
    if len(set(args.block_sizes)) != len(args.block_sizes):
        parser.error("argument --block-sizes: sizes repeat")
    if args.baseline == "fio" and not shutil.which("fio"):
        parser.error("argument --baseline: fio is not installed (use auto or python)")
    if args.directory is not None:
        ensure_directory(parser, "directory", args.directory)
    return args


def main() -> None:
    args = parse_args()
    with Progress() as progress:
        if args.directory:
            runs = run(args.directory, args, progress)
        else:
            with tempfile.TemporaryDirectory(prefix="bench-nvme-") as directory:
                runs = run(directory, args, progress)
    print(json.dumps({"runs": runs}))


if __name__ == "__main__":
    main()
