"""Benchmark the NVMe tier against the disk's best raw throughput on the same directory,
and against vLLM's own file-system tier when vLLM is installed.

Usage::

    apt-get install -y fio          # optional: the baseline uses fio when it is installed
    python examples/bench_nvme.py [DIR] [--size-gib 1] [--block-sizes 2M,128K]

While it runs, a progress line shows on stderr when stderr is a terminal.

For each block size, ``--repeat`` rounds, each of them in this order:

1. The raw baseline: fio writes then reads ``--size-gib`` of data sequentially, at the
   tier's block size, once for every point of ``--baseline-grid`` (``numjobs`` streams,
   each writing its own file of DIR, ``iodepth`` I/Os in flight per stream). fio runs
   with ``ioengine=io_uring`` when fio and the kernel accept it here, else ``libaio``,
   else ``psync`` (where only ``iodepth=1`` is meaningful), and reports in JSON. The
   grid ``quick`` (the default) is numjobs 1,4 x iodepth 1,16; ``full`` is numjobs 1,2,4 x
   iodepth 1,8,32; any other grid is written ``NUMJOBSxIODEPTHS``, e.g. ``1,2x4,64``.
   Without fio (or with ``--baseline python``) the baseline is one plain ``os.pwritev``/
   ``os.preadv`` stream instead.
2. The tier stores the same amount as blocks through its actor API (``put_store`` jobs
   of ``--job-mib`` each, at most ``--max-inflight`` running) and loads it all back,
   from an asyncio loop on which a 1 ms ticker measures loop lag.
3. When ``import vllm.v1.kv_offload.tiering.fs`` works (and ``--vllm-fs`` is ``auto``):
   vLLM's file-system tier (``FileSystemTierManager``, built by vLLM's own
   ``SecondaryTierFactory`` as type ``fs``, ``--vllm-fs-threads`` read and write threads)
   stores the same blocks from the same kind of page-aligned host buffer into DIR and
   loads them back, with jobs of the same size, at most ``--max-inflight`` in flight,
   its results polled every 0.2 ms the way vLLM's scheduler polls ``get_finished_jobs``.
   Without CUDA libraries vLLM's tier moves bytes with Python file I/O instead of its C
   extension; ``vllm_fs_native_io`` says which ran. vLLM's tier never fsyncs: compare it
   with ``--fsync none`` for like against like.

Every side uses O_DIRECT when the tier's probe found it usable (so loads are cold);
otherwise, before each read phase, the files that side wrote are synced and dropped from
the page cache (``fsync``, then ``posix_fadvise(DONTNEED)``, file by file: other
processes' cached pages stay), and ``cold_load`` says whether that was done for every
load. ``--drop-cache system`` drops the whole machine's page cache instead
(``/proc/sys/vm/drop_caches``, every process's; root only). The baseline's writes end
with one fsync per stream when the tier's fsync policy is not ``none``. Throughput
counts payload bytes only; fio's is the bytes of all streams over the slowest stream's
runtime.

The baseline figure is the grid point with the best median over the rounds, taken
separately for writing and for reading. The last line of output is one JSON object::

    {"runs": [{"block_bytes": ..., "store_GBps": ..., "load_GBps": ...,
               "baseline_store_GBps": ..., "baseline_load_GBps": ...,
               "baseline_store_point": "numjobs=4,iodepth=16,io_uring",
               "baseline_load_point": ..., "store_ratio": ..., "load_ratio": ...,
               "vllm_fs_store_GBps": ..., "vllm_fs_load_GBps": ...,
               "store_vs_vllm_fs": ..., "load_vs_vllm_fs": ...,
               "vllm_fs_native_io": true|false, "loop_lag_p99_ms": ...,
               "idle_loop_lag_p99_ms": ..., "cold_load": true|false}, ...]}

Figures are medians over the rounds. The ``vllm_fs_*`` and ``*_vs_vllm_fs`` keys are
null when vLLM's tier did not run (one line before the results says why).
With ``--encryption`` the tier also runs with encryption at rest (AES-256-GCM, a
fresh key), right before or after its plain run (the order alternates by round), and
adds ``encrypted_store_GBps``, ``encrypted_load_GBps``, ``encrypted_loop_lag_p99_ms``
and ``encryption_store_cost`` / ``encryption_load_cost``: one minus the median over the
rounds of encrypted / plain throughput (0.05: encryption costs 5 %).
``loop_lag_p99_ms`` is the worst round's; ``idle_loop_lag_p99_ms`` is the worst round's
lag of the same loop with nothing running (what the machine adds by itself). Each round
stores into a tier (and a vLLM root) of its own; the rounds' files are removed after the
last round of a block size (see :func:`bench_tier` for why not between rounds).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import importlib
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
from typing import Any

from backends.nvme.os_calls import probe_o_direct
from backends.nvme.tier import NVMeTier
from tiering.cli_args import (
    Progress,
    ensure_directory,
    make_parser,
    positive_float,
    positive_int,
    run_main,
    size_list,
)
from tiering.device.host_pool import HostPool
from tiering.observe.loop_lag import LoopLagMonitor
from tiering.security.encryption import Keyring
from tiering.tiers.tier_api import JobMetadata

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

DROP_CACHES = "/proc/sys/vm/drop_caches"
"""Where the kernel takes a request to drop the whole machine's clean caches (root)."""


def drop_page_cache(paths: Iterable[str], *, system: bool = False) -> bool:
    """Make the next reads of the files ``paths`` come from the device: each file's
    dirty pages are written (``fsync``) and its pages dropped from the page cache
    (``posix_fadvise(DONTNEED)``); other files' cached pages stay. A file removed
    meanwhile is skipped. With ``system`` the whole machine's page cache is dropped
    instead, every process's (:func:`drop_system_caches`). True if done; False where
    ``posix_fadvise`` is missing (nothing dropped). Raises OSError if a file cannot be
    read or synced."""
    if system:
        drop_system_caches(1)
        return True
    if not hasattr(os, "posix_fadvise"):
        return False
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            continue
        try:
            os.fsync(fd)  # dirty pages are not dropped: written first, they are
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return True


def drop_system_caches(what: int) -> None:
    """Drop the whole machine's clean caches, every process's: ``what`` 1 the page
    cache, 2 directory entries and inodes, 3 both (after a ``sync``, so that the dirty
    pages are clean first). Only for a benchmark asked to (an option): other programs
    pay for it. Exits (SystemExit, naming the file) where not permitted."""
    os.sync()
    try:
        with open(DROP_CACHES, "w") as f:
            f.write(f"{what}\n")
    except OSError as exc:
        raise SystemExit(f"--drop-cache system: cannot write {DROP_CACHES}: {exc}") from None


def may_drop_system_caches() -> bool:
    """Whether this process may write :data:`DROP_CACHES` (checked before any work)."""
    return os.access(DROP_CACHES, os.W_OK)


def files_under(directory: str) -> Iterator[str]:
    for parent, _, names in os.walk(directory):
        for name in names:
            yield os.path.join(parent, name)


# -- baseline -----------------------------------------------------------------------------

# Named grids for --baseline-grid: NUMJOBS x IODEPTHS.
GRIDS = {"quick": "1,4x1,16", "full": "1,2,4x1,8,32"}

# The fio engines tried, best first; psync is what remains when neither runs here.
_ASYNC_ENGINES = ("io_uring", "libaio")

Baseline = dict[str, tuple[float, float]]
"""One round of a baseline: (write GB/s, read GB/s) for each point's label."""


@dataclass(frozen=True)
class Grid:
    """The fio points to try: every ``numjobs`` with every ``iodepth``."""

    numjobs: tuple[int, ...]
    iodepths: tuple[int, ...]
    text: str


@dataclass(frozen=True)
class FioPoint:
    numjobs: int
    iodepth: int
    engine: str

    @property
    def label(self) -> str:
        return f"numjobs={self.numjobs},iodepth={self.iodepth},{self.engine}"


def baseline_grid(text: str) -> Grid:
    """An argparse type: ``quick``, ``full``, or ``NUMJOBSxIODEPTHS`` (``1,2,4x1,8,32``)."""
    spec = GRIDS.get(text.strip(), text.strip())
    jobs_text, sep, depths_text = spec.partition("x")
    try:
        if not sep:
            raise ValueError
        numjobs = tuple(positive_int(part) for part in jobs_text.split(","))
        iodepths = tuple(positive_int(part) for part in depths_text.split(","))
    except (ValueError, argparse.ArgumentTypeError):
        raise argparse.ArgumentTypeError(
            f"must be quick, full or NUMJOBSxIODEPTHS like 1,2,4x1,8,32, got {text!r}"
        ) from None
    if len(set(numjobs)) != len(numjobs) or len(set(iodepths)) != len(iodepths):
        raise argparse.ArgumentTypeError(f"values repeat in {text!r}")
    return Grid(numjobs, iodepths, text.strip())


def _fio_report(stdout: str) -> dict[str, Any]:
    """fio's JSON report (fio may print a warning line before it)."""
    return json.loads(stdout[stdout.index("{") :])


def fio_engine(directory: str, direct: bool) -> str:
    """The first of io_uring and libaio that this fio build and this kernel run in
    ``directory`` (a 64 KiB write at depth 2), else psync."""
    for engine in _ASYNC_ENGINES:
        with tempfile.TemporaryDirectory(dir=directory, prefix="fio-probe-") as probe:
            done = subprocess.run(
                [
                    "fio",
                    "--name=probe",
                    f"--directory={probe}",
                    "--rw=write",
                    "--bs=4k",
                    "--size=64k",
                    "--iodepth=2",
                    f"--ioengine={engine}",
                    f"--direct={int(direct)}",
                    "--output-format=json",
                ],
                capture_output=True,
                text=True,
                check=False,
            )
        try:
            if done.returncode == 0 and _fio_report(done.stdout)["jobs"][0]["error"] == 0:
                return engine
        except (ValueError, KeyError, IndexError):
            pass
    return "psync"


def fio_points(grid: Grid, engine: str, block: int, total: int) -> list[FioPoint]:
    """The grid's points for one block size: a point needs a block per stream, and a
    synchronous engine has one I/O in flight per stream whatever ``iodepth`` says."""
    depths = grid.iodepths if engine in _ASYNC_ENGINES else (1,)
    return [
        FioPoint(numjobs, depth, engine)
        for numjobs in grid.numjobs
        if total // block >= numjobs
        for depth in depths
    ]


def fio_point(
    directory: str,
    point: FioPoint,
    block: int,
    total: int,
    direct: bool,
    fsync: bool,
    system_drop: bool = False,
) -> tuple[float, float]:
    """(write GB/s, read GB/s): ``point.numjobs`` fio streams, each writing then reading
    its own file of ``total / numjobs`` bytes (whole blocks) in a fresh subdirectory.
    Without ``direct`` the reads are made cold by :func:`drop_page_cache` (``system``:
    ``system_drop``)."""
    per_job = total // point.numjobs // block * block
    with tempfile.TemporaryDirectory(dir=directory, prefix="baseline-") as where:

        def run(rw: str) -> float:
            command = [
                "fio",
                "--name=baseline",
                f"--directory={where}",
                f"--rw={rw}",
                f"--bs={block}",
                f"--size={per_job}",
                f"--numjobs={point.numjobs}",
                f"--iodepth={point.iodepth}",
                f"--ioengine={point.engine}",
                f"--direct={int(direct)}",
                "--output-format=json",
            ]
            if rw == "write" and fsync:
                command.append("--end_fsync=1")
            done = subprocess.run(command, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                raise SystemExit(f"fio failed ({point.label}, {rw}): {done.stderr.strip()[-500:]}")
            jobs = _fio_report(done.stdout)["jobs"]
            moved = sum(job[rw]["io_bytes"] for job in jobs)
            runtime_ms = max(job[rw]["runtime"] for job in jobs)
            return moved / max(runtime_ms, 1) / 1e6

        written = run("write")
        if not direct:
            drop_page_cache(files_under(where), system=system_drop)
        return written, run("read")


def fio_baseline(
    directory: str,
    points: list[FioPoint],
    block: int,
    total: int,
    direct: bool,
    fsync: bool,
    report: Callable[[str], None],
    system_drop: bool = False,
) -> Baseline:
    """One round: every point of the grid, in order."""
    figures: Baseline = {}
    for point in points:
        report(f"baseline fio {point.label}")
        figures[point.label] = fio_point(directory, point, block, total, direct, fsync, system_drop)
    return figures


def python_baseline(
    directory: str, block: int, total: int, direct: bool, fsync: bool, system_drop: bool = False
) -> Baseline:
    """One round: a sequential os.pwritev / os.preadv loop on one file (one stream)."""
    path = os.path.join(directory, f"baseline-{block}.dat")
    buffer = mmap.mmap(-1, block)
    buffer.write(os.urandom(block))
    view = memoryview(buffer)
    flags = os.O_DIRECT if direct else 0
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | flags, 0o644)
        start = time.perf_counter()
        for offset in range(0, total, block):
            os.pwritev(fd, [view], offset)
        if fsync:
            os.fsync(fd)
        written = total / (time.perf_counter() - start) / 1e9
        os.close(fd)
        if not direct:
            drop_page_cache([path], system=system_drop)
        fd = os.open(path, os.O_RDONLY | flags)
        start = time.perf_counter()
        for offset in range(0, total, block):
            os.preadv(fd, [view], offset)
        read = total / (time.perf_counter() - start) / 1e9
        os.close(fd)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        view.release()
        buffer.close()
    return {"numjobs=1,iodepth=1,python": (written, read)}


def best_point(rounds: list[Baseline], direction: int) -> tuple[str, float, list[float]]:
    """The point whose median over ``rounds`` is highest in ``direction`` (0 write,
    1 read): its label, that median, and its figure in each round."""
    by_point = {label: [figures[label][direction] for figures in rounds] for label in rounds[0]}
    label = max(by_point, key=lambda name: statistics.median(by_point[name]))
    return label, statistics.median(by_point[label]), by_point[label]


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
    *,
    sealed: bool = False,
) -> TierFigures:
    """One round: store ``total`` bytes into a new tier, then load them back.

    ``sealed``: with encryption at rest (a fresh AES-256 key).
    Each round uses its own namespace (so it starts empty). Its
    directory is appended to ``keep_dirs`` for the caller to remove after the last
    round. Removing it between rounds would time the next round's
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
        namespace=f"bench;block={block};round={round_no};sealed={sealed}",
        encryption=Keyring({1: os.urandom(32)}, 1) if sealed else None,
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
            cold = bool(tier.o_direct) or drop_page_cache(
                files_under(tier.directory), system=args.drop_cache == "system"
            )
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


# -- vLLM's file-system tier --------------------------------------------------------------

VLLM_FS_MODULE = "vllm.v1.kv_offload.tiering.fs"

# How often the driver polls vLLM's tier for finished jobs, as vLLM's scheduler does once
# per step (seconds).
_VLLM_POLL_S = 0.0002


@dataclass
class VllmFigures:
    store_GBps: float
    load_GBps: float
    cold_load: bool


class VllmFs:
    """What the comparison needs from vLLM, imported once (importing vLLM takes seconds).

    Raises whatever the import raises: ImportError without vLLM, or any error of its
    import chain on this machine.
    """

    def __init__(self) -> None:
        # vLLM logs to stdout by default; keep stdout for figures and the JSON line.
        os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
        importlib.import_module(VLLM_FS_MODULE)
        import numpy
        from vllm.v1.kv_offload import base, config
        from vllm.v1.kv_offload.tiering import base as tiering_base
        from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
        from vllm.v1.kv_offload.tiering.fs import io as fs_io
        from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

        self.numpy = numpy
        self.base = base
        self.config = config
        self.TransferJob = tiering_base.TransferJob
        self.factory = SecondaryTierFactory
        self.Spec = TieringOffloadingSpec
        self.probe_o_direct = fs_io.probe_o_direct
        # vLLM's C file I/O (vllm.fs_io_C) needs CUDA libraries; without them its tier
        # falls back to Python os.write / os.readv.
        self.native_io = bool(getattr(fs_io, "_HAS_FSIO_C", False))

    def spec(
        self, block: int, slots: int, name: str, secondary_tiers: list[dict[str, Any]] = ()
    ) -> Any:
        """vLLM's tiering spec for a one-group model whose block is ``block`` bytes, with
        ``slots`` chunks in its CPU tier and these secondary tiers (built by
        ``spec.get_manager()``)."""
        c = self.config
        return self.Spec(
            c.OffloadingConfig(
                groups=(c.OffloadingGroupConfig(16, ("layers.0",), 0),),
                worker_kv_bytes_per_block=block,
                enable_kv_cache_events=False,
                extra_config={
                    "cpu_bytes_to_use": slots * block,
                    "secondary_tiers": list(secondary_tiers),
                },
                engine_id=f"bench-{os.getpid()}-{name}",
                model=c.OffloadingModelConfig(name=name, dtype="float16"),
                cache=c.OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
                parallel=c.OffloadingParallelConfig(
                    rank=0,
                    world_size=1,
                    tp_size=1,
                    pp_size=1,
                    pcp_size=1,
                    dcp_size=1,
                    data_parallel_index=0,
                    data_parallel_size=1,
                    data_parallel_rank_local=None,
                    is_parallelism_agnostic=True,
                ),
            )
        )

    def key(self, text: str) -> bytes:
        """An offload key as vLLM makes one: a 32-byte block hash and group 0."""
        return self.base.make_offload_key(hashlib.sha256(text.encode()).digest(), 0)


def load_vllm_fs() -> tuple[VllmFs | None, str]:
    """vLLM's pieces, or None and why not."""
    try:
        return VllmFs(), ""
    except Exception as exc:  # missing, or its import chain fails here: skip, say why
        return None, f"import {VLLM_FS_MODULE} failed: {type(exc).__name__}: {exc}"


def _drive_vllm(
    vllm: VllmFs,
    tier: Any,
    batches: list[list[bytes]],
    windows: int,
    job_blocks: int,
    *,
    first_job_id: int,
    load: bool,
    report: Callable[[str], None],
    placed: dict[bytes, int],
) -> float:
    """Seconds to run one job per batch through vLLM's tier, ``windows`` at most in flight,
    each owning a disjoint range of primary chunks until its result is polled. ``placed``
    gets each key's chunk (the last one, for a key moved twice)."""
    free = [window * job_blocks for window in range(windows)]
    running: dict[int, int] = {}  # job id -> first chunk of its window
    context = vllm.base.ReqContext(req_id="bench-nvme")
    submit = tier.submit_load if load else tier.submit_store
    todo = iter(enumerate(batches, first_job_id))
    failed, finished = [], 0
    start = time.perf_counter()
    while finished < len(batches):
        while free and len(running) + finished < len(batches):
            job_id, keys = next(todo)
            base = free.pop()
            running[job_id] = base
            placed.update(zip(keys, range(base, base + len(keys)), strict=True))
            chunks = vllm.numpy.arange(base, base + len(keys), dtype=vllm.numpy.int64)
            submit(vllm.TransferJob(job_id, list(keys), chunks, load, context))
        results = list(tier.get_finished_jobs())
        if not results:
            time.sleep(_VLLM_POLL_S)
        for result in results:
            free.append(running.pop(result.job_id))
            finished += 1
            if not result.success:
                failed.append(result)
        if results:
            report(f"vLLM fs {'load' if load else 'store'} jobs {finished}/{len(batches)}")
    seconds = time.perf_counter() - start
    if failed:
        kind = "load" if load else "store"
        raise SystemExit(f"{len(failed)} vLLM fs {kind} jobs failed: {failed[0]}")
    return seconds


def bench_vllm_fs(
    vllm: VllmFs,
    directory: str,
    block: int,
    total: int,
    args: argparse.Namespace,
    report: Callable[[str], None],
    round_no: int,
    keep_dirs: list[str],
) -> VllmFigures:
    """One round of vLLM's file-system tier: store ``total`` bytes of blocks from a host
    buffer into a root of its own under ``directory``, then load them all back (cold).

    The primary view is a HostPool like our tier's, shaped as vLLM's primary tier shapes
    it (one row per chunk). Jobs are as large as our tier's; at most ``--max-inflight``
    run at once. vLLM's tier verifies nothing, so once the load phase is timed, the
    blocks still in the primary (the last job of each window) are compared with the
    bytes they were stored from. The root is appended to ``keep_dirs`` for the caller to
    remove after the last round, as for our tier.
    """
    job_blocks = max(1, (args.job_mib << 20) // block)
    windows = args.max_inflight
    slots = job_blocks * windows
    count = total // block
    keys = [vllm.key(f"bench-nvme;block={block};round={round_no};{i}") for i in range(count)]
    batches = [keys[first : first + job_blocks] for first in range(0, count, job_blocks)]
    root = os.path.join(directory, f"vllm-fs-{block}-round{round_no}")
    os.makedirs(root, exist_ok=True)
    keep_dirs.append(root)
    cold = bool(vllm.probe_o_direct(root))  # what the tier's own probe will find
    pool = HostPool(slots, block, pin=False)
    try:
        view = pool.view
        for offset in range(0, slots * block, 1 << 20):
            chunk = min(1 << 20, slots * block - offset)
            view[offset : offset + chunk] = os.urandom(chunk)
        stored_from: dict[bytes, int] = {}
        loaded_to: dict[bytes, int] = {}
        original = bytes(view)
        with view.cast("B", (slots, block)) as primary:
            tier = vllm.factory.create_secondary_tier(
                {
                    "type": "fs",
                    "root_dir": root,
                    "n_read_threads": args.vllm_fs_threads,
                    "n_write_threads": args.vllm_fs_threads,
                },
                primary,
                vllm.spec(block, slots, f"bench-nvme-{block}-round{round_no}"),
            )
            try:
                store = _drive_vllm(
                    vllm, tier, batches, windows, job_blocks,
                    first_job_id=1, load=False, report=report, placed=stored_from,
                )  # fmt: skip
                if not cold:
                    report("vLLM fs: dropping the page cache")
                    cold = drop_page_cache(files_under(root), system=args.drop_cache == "system")
                load = _drive_vllm(
                    vllm, tier, batches, windows, job_blocks,
                    first_job_id=len(batches) + 1, load=True, report=report, placed=loaded_to,
                )  # fmt: skip
            finally:
                tier.shutdown()
                del tier  # it holds the primary view, released on leaving this block
        in_primary = {chunk: key for key, chunk in loaded_to.items()}  # the last one wins
        wrong = sum(
            view[chunk * block : (chunk + 1) * block]
            != original[stored_from[key] * block : (stored_from[key] + 1) * block]
            for chunk, key in in_primary.items()
        )
    finally:
        pool.close()
    if wrong:
        raise SystemExit(f"vLLM fs: {wrong} of {len(in_primary)} loaded blocks differ")
    return VllmFigures(total / store / 1e9, total / load / 1e9, cold)


# -- main ---------------------------------------------------------------------------------


def run(directory: str, args: argparse.Namespace, progress: Progress) -> list[dict[str, object]]:
    """Every block size: ``--repeat`` rounds of baseline, tier, vLLM's tier; medians."""
    runs: list[dict[str, object]] = []
    total = int(args.size_gib * (1 << 30))
    use_fio = args.baseline == "fio" or (args.baseline == "auto" and shutil.which("fio"))
    direct = probe_o_direct(directory) is None  # the tier's own probe decides the same
    engine = ""
    if use_fio:
        progress.update("probing fio's I/O engines", force=True)
        engine = fio_engine(directory, direct)
    vllm: VllmFs | None = None
    if args.vllm_fs == "auto":
        progress.update(f"importing {VLLM_FS_MODULE}", force=True)
        vllm, why = load_vllm_fs()
    else:
        why = "--vllm-fs off"
    progress.clear()
    if vllm is None:
        print(f"vLLM fs comparison skipped: {why}", flush=True)
    loop_factory = None
    if args.loop == "uvloop":
        import uvloop

        loop_factory = uvloop.new_event_loop
    for block in args.block_sizes:
        size = total // block * block
        points = fio_points(args.baseline_grid, engine, block, size) if use_fio else []
        baselines: list[Baseline] = []
        tiers: list[TierFigures] = []
        sealed: list[TierFigures] = []
        vllms: list[VllmFigures] = []
        tier_dirs: list[str] = []  # removed once every round of this size has run
        try:
            for round_no in range(1, args.repeat + 1):
                where = f"block {_size_text(block)}, round {round_no}/{args.repeat}"

                def report(status: str, where: str = where) -> None:
                    progress.update(f"{where}: {status}")

                progress.update(f"{where}: baseline", force=True)
                fsync = args.fsync != "none"
                system = args.drop_cache == "system"
                if use_fio:
                    baselines.append(
                        fio_baseline(directory, points, block, size, direct, fsync, report, system)
                    )
                else:
                    baselines.append(python_baseline(directory, block, size, direct, fsync, system))
                # With --encryption the tier runs plain and sealed back to back,
                # which one first alternating by round, so neither always meets the
                # disk in the state the other left it in.
                kinds = [False, True] if args.encryption else [False]
                if round_no % 2 == 0:
                    kinds.reverse()
                for kind in kinds:
                    name = "encrypted" if kind else "plain"
                    with asyncio.Runner(loop_factory=loop_factory) as runner:
                        (sealed if kind else tiers).append(
                            runner.run(
                                bench_tier(
                                    directory,
                                    block,
                                    size,
                                    args,
                                    lambda status, report=report, name=name: report(
                                        f"tier ({name}) {status}"
                                    ),
                                    round_no,
                                    tier_dirs,
                                    sealed=kind,
                                )
                            )
                        )
                if vllm is not None:
                    progress.update(f"{where}: vLLM fs", force=True)
                    vllms.append(
                        bench_vllm_fs(
                            vllm, directory, block, size, args, report, round_no, tier_dirs
                        )
                    )
        finally:
            progress.update(f"block {_size_text(block)}: removing the tiers' files", force=True)
            for tier_dir in tier_dirs:
                shutil.rmtree(tier_dir, True)
        entry = _summarize(block, size, args, baselines, tiers, vllms, vllm, progress)
        if args.encryption:
            entry.update(_encryption_cost(block, tiers, sealed))
        runs.append(entry)
    return runs


def _summarize(
    block: int,
    size: int,
    args: argparse.Namespace,
    baselines: list[Baseline],
    tiers: list[TierFigures],
    vllms: list[VllmFigures],
    vllm: VllmFs | None,
    progress: Progress,
) -> dict[str, object]:
    """One block size's JSON entry (medians over the rounds), and its lines of text."""
    store = statistics.median(t.store_GBps for t in tiers)
    load = statistics.median(t.load_GBps for t in tiers)
    write_point, base_write, base_writes = best_point(baselines, 0)
    read_point, base_read, base_reads = best_point(baselines, 1)
    vllm_store = statistics.median(v.store_GBps for v in vllms) if vllms else None
    vllm_load = statistics.median(v.load_GBps for v in vllms) if vllms else None
    entry: dict[str, object] = {
        "block_bytes": block,
        "store_GBps": round(store, 3),
        "load_GBps": round(load, 3),
        "baseline_store_GBps": round(base_write, 3),
        "baseline_load_GBps": round(base_read, 3),
        "baseline_store_point": write_point,
        "baseline_load_point": read_point,
        "store_ratio": round(store / base_write, 3),
        "load_ratio": round(load / base_read, 3),
        "vllm_fs_store_GBps": _rounded(vllm_store),
        "vllm_fs_load_GBps": _rounded(vllm_load),
        "store_vs_vllm_fs": _rounded(store / vllm_store if vllm_store else None),
        "load_vs_vllm_fs": _rounded(load / vllm_load if vllm_load else None),
        "vllm_fs_native_io": vllm.native_io if vllm is not None else None,
        "loop_lag_p99_ms": round(max(t.loop_lag_p99_ms for t in tiers), 3),
        "idle_loop_lag_p99_ms": round(max(t.idle_lag_p99_ms for t in tiers), 3),
        "cold_load": all(t.cold_load for t in tiers) and all(v.cold_load for v in vllms),
    }
    progress.clear()
    points = "; ".join(
        f"{label} {statistics.median(f[label][0] for f in baselines):.2f}/"
        f"{statistics.median(f[label][1] for f in baselines):.2f}"
        for label in baselines[0]
    )
    print(
        f"block {_size_text(block)} x {size / (1 << 30):.2f} GiB, median of {args.repeat}, "
        f"baseline points (write/read GB/s): {points}",
        flush=True,
    )
    vllm_text = ""
    if vllms:
        vllm_text = (
            f", vLLM fs ({'C' if vllm is not None and vllm.native_io else 'Python'} I/O, "
            f"{args.vllm_fs_threads}+{args.vllm_fs_threads} threads) store {vllm_store:.3f} "
            f"{_list(v.store_GBps for v in vllms)}, load {vllm_load:.3f} "
            f"{_list(v.load_GBps for v in vllms)}"
        )
    print(
        f"block {_size_text(block)}, tier: "
        f"{'O_DIRECT' if tiers[0].o_direct else 'buffered'}, fsync={args.fsync}: "
        f"store {store:.3f} GB/s (baseline {base_write:.3f} at {write_point}; each run "
        f"{_list(t.store_GBps for t in tiers)} vs {_list(base_writes)}), "
        f"load {load:.3f} GB/s (baseline {base_read:.3f} at {read_point}; each run "
        f"{_list(t.load_GBps for t in tiers)} vs {_list(base_reads)}){vllm_text}, "
        f"loop lag p99 {_list(t.loop_lag_p99_ms for t in tiers)} ms "
        f"(idle loop {_list(t.idle_lag_p99_ms for t in tiers)} ms)",
        flush=True,
    )
    return entry


def _encryption_cost(
    block: int, plain: list[TierFigures], sealed: list[TierFigures]
) -> dict[str, object]:
    """The sealed runs' figures and the cost of sealing: one minus the median over the
    rounds of sealed / plain throughput (each round's pair ran back to back)."""
    store_cost = 1 - statistics.median(
        s.store_GBps / p.store_GBps for p, s in zip(plain, sealed, strict=True)
    )
    load_cost = 1 - statistics.median(
        s.load_GBps / p.load_GBps for p, s in zip(plain, sealed, strict=True)
    )
    print(
        f"block {_size_text(block)}, encrypted: store "
        f"{_list(s.store_GBps for s in sealed)} vs plain {_list(p.store_GBps for p in plain)}"
        f" GB/s, load {_list(s.load_GBps for s in sealed)} vs plain "
        f"{_list(p.load_GBps for p in plain)} GB/s: cost {store_cost:.1%} store, "
        f"{load_cost:.1%} load (median of the rounds' ratios); loop lag p99 "
        f"{_list(s.loop_lag_p99_ms for s in sealed)} ms",
        flush=True,
    )
    return {
        "encrypted_store_GBps": round(statistics.median(s.store_GBps for s in sealed), 3),
        "encrypted_load_GBps": round(statistics.median(s.load_GBps for s in sealed), 3),
        "encrypted_loop_lag_p99_ms": round(max(s.loop_lag_p99_ms for s in sealed), 3),
        "encryption_store_cost": round(store_cost, 3),
        "encryption_load_cost": round(load_cost, 3),
    }


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


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
        help="the tier's fsync policy (each baseline stream fsyncs once unless none)",
    )
    parser.add_argument("--io-threads", type=positive_int, default=4, help="tier I/O threads")
    parser.add_argument(
        "--max-inflight",
        type=positive_int,
        default=4,
        help="jobs running at once, in the tier and in vLLM's",
    )
    parser.add_argument(
        "--baseline",
        choices=("auto", "fio", "python"),
        default="auto",
        help="raw baseline: fio, a Python pwritev/preadv loop, or fio when installed",
    )
    parser.add_argument(
        "--baseline-grid",
        type=baseline_grid,
        default="quick",
        help=(
            "fio points, NUMJOBSxIODEPTHS: quick (1,4x1,16), full (1,2,4x1,8,32), "
            "or your own such as 1,2x8,64"
        ),
    )
    parser.add_argument(
        "--vllm-fs",
        choices=("auto", "off"),
        default="auto",
        help=f"compare with vLLM's file-system tier when {VLLM_FS_MODULE} imports",
    )
    parser.add_argument(
        "--vllm-fs-threads",
        type=positive_int,
        default=16,
        help="read threads and write threads of vLLM's fs tier (16 each is vLLM's default)",
    )
    parser.add_argument(
        "--loop", choices=("asyncio", "uvloop"), default="asyncio", help="event loop to run on"
    )
    parser.add_argument(
        "--repeat", type=positive_int, default=3, help="rounds per block size; medians reported"
    )
    parser.add_argument(
        "--drop-cache",
        choices=("fadvise", "system"),
        default="fadvise",
        help="how loads are made cold where O_DIRECT is not usable: fadvise = the files "
        "each side wrote, synced and dropped from the page cache one by one (nothing "
        f"else); system = the whole machine's page cache, every process's ({DROP_CACHES}, "
        "root only)",
    )
    parser.add_argument(
        "--encryption",
        action="store_true",
        help="also run the tier with encryption at rest, back to back with it off, "
        "and report the cost",
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
        if args.baseline != "python" and total // block < min(args.baseline_grid.numjobs):
            parser.error(
                f"argument --baseline-grid: every numjobs of {args.baseline_grid.text!r} "
                f"needs more than the {total // block} blocks of {block} bytes in "
                f"--size-gib {args.size_gib}"
            )
    if len(set(args.block_sizes)) != len(args.block_sizes):
        parser.error("argument --block-sizes: sizes repeat")
    if args.baseline == "fio" and not shutil.which("fio"):
        parser.error("argument --baseline: fio is not installed (use auto or python)")
    if args.drop_cache == "system" and not may_drop_system_caches():
        parser.error(f"argument --drop-cache: system needs write access to {DROP_CACHES} (root)")
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
    run_main(main)
