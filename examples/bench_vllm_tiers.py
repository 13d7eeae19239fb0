"""Benchmark our NVMe tier against vLLM's file-system tier, both driven by vLLM's own
tiering manager.

Usage::

    python examples/bench_vllm_tiers.py [DIR] [--size-gib 0.5] [--block-sizes 2M,128K]

Needs vLLM 0.33 (``pip install --no-deps vllm==0.33.0`` plus what its kv_offload
modules import: ``.ci/install-vllm``). For each block size, ``--repeat`` rounds, each
running vLLM's ``TieringOffloadingManager`` (a CPU primary tier of ``--cpu-mib``) twice: once
with our tier (``NVMeTierManager`` from ``tiering.integrations.vllm``) and once with
vLLM's ``fs`` tier, each with a root of its own under DIR. The order alternates ABBA
(ours first in rounds 1, 4, 5, 8, ...; vLLM's first in the others), so that neither
tier always runs first, or always after the other, in a window of the disk's speed:

1. Store: the script plays vLLM's connector scheduler. Requests of ``--request-mib``
   each store their chunks into the CPU tier (``prepare_store``, ``complete_store``, one
   ``on_schedule_end`` a step), which cascades them to the secondary tier; when the CPU
   tier is full of chunks still being cascaded, it steps until one frees. Timed until
   no tier job is in flight, and then through an ``os.sync()``, so that a store counts
   once its bytes are on the disk: vLLM's tier never syncs, and its writes may end in
   the page cache (ours use O_DIRECT). ``*_store_GBps`` include the sync (and make
   ``store_ratio``), ``*_store_unsynced_GBps`` do not.
2. ``reset_cache`` empties the CPU tier, and the tier's files are dropped from the page
   cache when it does not use O_DIRECT (``bench_nvme.drop_page_cache``: each synced,
   then ``posix_fadvise(DONTNEED)``; ``cold_load`` says whether every load was cold).
3. Load: requests look their chunks up, step by step, as the scheduler does, until
   every chunk is a HIT in the CPU tier again (promoted from the secondary tier). At
   most as many requests are in flight as the CPU tier holds. Like vLLM's scheduler,
   each step looks up every chunk of every waiting request, and a step takes
   ``--step-ms`` (standing for the model's forward pass; real ones take 10-50 ms). Do
   not set it far below that: a spinning scheduler spends the loads' time in vLLM's own
   lookups, for either tier alike (0.2 ms steps measured 0.30 GB/s for both at 128 KiB).

Every root stays on disk until the last round of its block size (then all are removed):
deleting thousands of vLLM's block files just before the next side's stores made those
stores slower on ext4 (freshly freed inodes are skipped), whichever tier came next.

The primary's bytes are random; one chunk in 16 is checked after its promotion against
the bytes it was stored from. ``submit_us_p99`` is the 99th percentile of the time
vLLM's thread spent inside one call of our tier (``submit_store``, ``submit_load``,
``lookup``, ``get_finished_jobs``), over the rounds; ``vllm_fs_submit_us_p99`` is the
same for vLLM's tier. Without CUDA libraries vLLM's tier uses Python file I/O instead
of its C extension (``vllm_fs_native_io``). vLLM's tier never fsyncs; ours runs with
``--fsync`` (default ``none``, like against like).

Each round's figures go to stderr as they come. Figures are medians over the rounds,
with their spread (``_min``/``_max``); ``store_ratio`` and ``load_ratio`` are ratios of
those medians, and ``*_ratio_pairs_*`` the median, least and most of the rounds' own
ratios (ours over vLLM's in the same round). The last line of output is one JSON
object::

    {"runs": [{"block_bytes": ..., "rounds": ...,
               "ours_store_GBps": ..., "ours_store_GBps_min": ..., "ours_store_GBps_max": ...,
               "ours_load_GBps": ..., ..._min, ..._max,
               "vllm_fs_store_GBps": ..., ..._min, ..._max,
               "vllm_fs_load_GBps": ..., ..._min, ..._max,
               "ours_store_unsynced_GBps": ..., "vllm_fs_store_unsynced_GBps": ...,
               "store_ratio": ..., "load_ratio": ...,
               "store_ratio_pairs_median": ..., "store_ratio_pairs_min": ...,
               "store_ratio_pairs_max": ..., "load_ratio_pairs_median": ...,
               "load_ratio_pairs_min": ..., "load_ratio_pairs_max": ...,
               "submit_us_p99": ..., "vllm_fs_submit_us_p99": ...,
               "cold_load": true|false, "vllm_fs_native_io": true|false}, ...]}
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from bench_nvme import VllmFs, drop_page_cache, files_under, load_vllm_fs

from backends.nvme.os_calls import probe_o_direct
from tiering.cli_args import (
    Progress,
    ensure_directory,
    make_parser,
    positive_float,
    positive_int,
    run_main,
    size_list,
)

_ALIGN = 4096
_SAMPLE_EVERY = 16  # one promoted chunk in this many is byte-checked
_SETTLE_S = 600.0  # a hang guard, far beyond any phase's time
_SPACE_MARGIN = 1.1  # disk bytes per payload byte, at most: our record headers, vLLM's files


@dataclass
class Side:
    """One tier's figures from one round."""

    store_GBps: float  # until the bytes are on the disk (the sync included)
    store_unsynced_GBps: float  # until the tier reported the stores done
    load_GBps: float
    cold: bool
    call_ns: list[int] = field(default_factory=list)


class _Timed:
    """Wraps a tier's scheduler-facing calls to record how long each one takes (a
    generator of results is drained inside the timing: that is the call's work)."""

    CALLS = ("submit_store", "submit_load", "lookup", "get_finished_jobs")

    def __init__(self, tier: Any, samples: list[int]) -> None:
        for name in self.CALLS:
            drain = name == "get_finished_jobs"
            setattr(tier, name, self._timed(getattr(tier, name), samples, drain))

    @staticmethod
    def _timed(call: Callable[..., Any], samples: list[int], drain: bool) -> Callable[..., Any]:
        @functools.wraps(call)
        def timed(*args: Any) -> Any:
            start = time.perf_counter_ns()
            try:
                result = call(*args)
                return list(result) if drain else result
            finally:
                samples.append(time.perf_counter_ns() - start)

        return timed


class _Driver:
    """vLLM's connector scheduler (and its worker's copies) around one manager."""

    def __init__(
        self, vllm: VllmFs, manager: Any, progress: Progress, label: str, step_s: float
    ) -> None:
        self.vllm = vllm
        self.step_s = step_s
        self.manager = manager
        self.progress = progress
        self.label = label
        view = manager.primary_tier.get_kv_memoryview()
        self.stride = view.strides[0]
        self.flat = view.cast("B")
        self.ids = 0

    def context(self) -> Any:
        self.ids += 1
        context = self.vllm.base.ReqContext(req_id=f"{self.label}-{self.ids}")
        with self.manager.lock:
            self.manager.on_new_request(context)
        return context

    def step(self) -> None:
        with self.manager.lock:
            self.manager.on_schedule_end(self.vllm.base.ScheduleEndContext((), ()))

    def chunk(self, chunk_id: int) -> bytes:
        return bytes(self.flat[chunk_id * self.stride : (chunk_id + 1) * self.stride])

    def store(self, requests: list[list[bytes]], sampled: dict[bytes, bytes]) -> float:
        """Seconds to store every request's chunks and cascade them all."""
        deadline = time.monotonic() + _SETTLE_S
        start = time.perf_counter()
        for n, keys in enumerate(requests):
            context = self.context()
            while True:
                with self.manager.lock:
                    out = self.manager.prepare_store(keys, context)
                if out is not None:
                    break
                self._wait(deadline, "room in the CPU tier")
            for k, chunk in zip(out.keys_to_store, out.store_spec.chunk_ids, strict=True):
                if k in sampled:
                    sampled[k] = self.chunk(int(chunk))
            with self.manager.lock:
                self.manager.complete_store(out.keys_to_store, context)
                self.manager.on_request_finished(context)
            self.step()
            self.progress.update(f"{self.label}: stored {n + 1}/{len(requests)} requests")
        while self._pending():
            self._wait(deadline, "the cascades to end")
        return time.perf_counter() - start

    def load(self, requests: list[list[bytes]], window: int, sampled: dict[bytes, bytes]) -> float:
        """Seconds to bring every request's chunks back into the CPU tier."""
        lookup_result = self.vllm.base.LookupResult
        deadline = time.monotonic() + _SETTLE_S
        todo = list(reversed(requests))
        active: list[tuple[Any, list[bytes]]] = []
        done = 0
        start = time.perf_counter()
        while todo or active:
            while todo and len(active) < window:
                active.append((self.context(), list(todo.pop())))
            still = []
            for context, keys in active:
                left = []
                for k in keys:
                    with self.manager.lock:
                        answer = self.manager.lookup(k, context)
                    if answer is lookup_result.MISS:
                        raise SystemExit(f"{self.label}: chunk {k.hex()} came back as a MISS")
                    if answer is not lookup_result.HIT:
                        left.append(k)
                    elif k in sampled:
                        self._check(k, context, sampled[k])
                if left:
                    still.append((context, left))
                else:
                    with self.manager.lock:
                        self.manager.on_request_finished(context)
                    done += 1
                    self.progress.update(f"{self.label}: loaded {done}/{len(requests)} requests")
            active = still
            if active:
                self._wait(deadline, "promotions")
        return time.perf_counter() - start

    def _check(self, k: bytes, context: Any, expected: bytes) -> None:
        with self.manager.lock:
            spec = self.manager.prepare_load([k], context)
        got = self.chunk(int(spec.chunk_ids[0]))
        with self.manager.lock:
            self.manager.complete_load([k], context)
        if got != expected:
            raise SystemExit(f"{self.label}: chunk {k.hex()} came back with other bytes")

    def _pending(self) -> bool:
        with self.manager.lock:
            return bool(self.manager.has_pending_work())

    def _wait(self, deadline: float, what: str) -> None:
        if time.monotonic() > deadline:
            raise SystemExit(f"{self.label}: gave up waiting for {what}")
        self.step()
        time.sleep(self.step_s)


def run_side(
    vllm: VllmFs,
    ours: bool,
    root: str,
    block: int,
    args: argparse.Namespace,
    round_no: int,
    progress: Progress,
) -> Side:
    """One tier through vLLM's manager: store ``--size-gib`` then load it all back."""
    label = f"{'ours' if ours else 'vllm-fs'} {block >> 10} KiB round {round_no}"
    total = int(args.size_gib * (1 << 30))
    count = total // block
    per_request = max(1, (args.request_mib << 20) // block)
    slots = max(per_request, (args.cpu_mib << 20) // block)
    name = f"{'ours' if ours else 'fs'}-{block}-{round_no}"
    keys = [vllm.key(f"bench-vllm-tiers;{name};{i}") for i in range(count)]
    requests = [keys[i : i + per_request] for i in range(0, count, per_request)]
    tier_config: dict[str, Any]
    if ours:
        tier_config = {
            "type": "NVMeTierManager",
            "module_path": "tiering.integrations.vllm",
            "root": root,
            "capacity_bytes": 2 * total + (256 << 20),
            "fsync": args.fsync,
        }
    else:
        tier_config = {
            "type": "fs",
            "root_dir": root,
            "n_read_threads": args.vllm_fs_threads,
            "n_write_threads": args.vllm_fs_threads,
        }
    cold = probe_o_direct(root) is None if ours else bool(vllm.probe_o_direct(root))
    manager = vllm.spec(block, slots, name, [tier_config]).get_manager()
    samples: list[int] = []
    try:
        _Timed(manager.secondary_tiers[0], samples)
        driver = _Driver(vllm, manager, progress, label, args.step_ms / 1000)
        view = driver.flat
        for offset in range(0, view.nbytes, 1 << 20):  # random bytes, written once
            end = min(offset + (1 << 20), view.nbytes)
            view[offset:end] = os.urandom(end - offset)
        sampled = dict.fromkeys(keys[::_SAMPLE_EVERY], b"")
        store_s = driver.store(requests, sampled)
        started = time.perf_counter()
        os.sync()  # a store counts once its bytes are on the disk (see the docstring)
        synced_s = store_s + time.perf_counter() - started
        with manager.lock:
            manager.reset_cache()
            manager.on_reset_flushed()
        if not cold:
            progress.update(f"{label}: dropping the page cache", force=True)
            cold = drop_page_cache(list(files_under(root)))
        load_s = driver.load(requests, max(1, slots // per_request), sampled)
        driver.flat.release()
    finally:
        manager.shutdown()
    return Side(total / synced_s / 1e9, total / store_s / 1e9, total / load_s / 1e9, cold, samples)


def _p99_us(samples: list[int]) -> float | None:
    if not samples:
        return None
    ordered = sorted(samples)
    return round(ordered[int(0.99 * (len(ordered) - 1))] / 1000, 1)


def _ours_first(round_no: int) -> bool:
    """ABBA: ours first in rounds 0, 3, 4, 7, 8, ... (counted from 0)."""
    return round_no % 4 in (0, 3)


def _spread(values: list[float]) -> tuple[float, float, float]:
    """Median, least and most."""
    return statistics.median(values), min(values), max(values)


def _figures(block: int, sides: dict[bool, list[Side]], native_io: bool) -> dict[str, Any]:
    """One block size's row of the JSON line from its rounds (see the module docstring)."""
    row: dict[str, Any] = {"block_bytes": block, "rounds": len(sides[True])}
    for ours, prefix in ((True, "ours"), (False, "vllm_fs")):
        for what in ("store", "load"):
            mid, low, high = _spread([getattr(side, f"{what}_GBps") for side in sides[ours]])
            row[f"{prefix}_{what}_GBps"] = round(mid, 3)
            row[f"{prefix}_{what}_GBps_min"] = round(low, 3)
            row[f"{prefix}_{what}_GBps_max"] = round(high, 3)
        unsynced = statistics.median(side.store_unsynced_GBps for side in sides[ours])
        row[f"{prefix}_store_unsynced_GBps"] = round(unsynced, 3)
    for what in ("store", "load"):
        row[f"{what}_ratio"] = round(row[f"ours_{what}_GBps"] / row[f"vllm_fs_{what}_GBps"], 3)
        pairs = [
            getattr(a, f"{what}_GBps") / getattr(b, f"{what}_GBps")
            for a, b in zip(sides[True], sides[False], strict=True)
        ]
        mid, low, high = _spread(pairs)
        row[f"{what}_ratio_pairs_median"] = round(mid, 3)
        row[f"{what}_ratio_pairs_min"] = round(low, 3)
        row[f"{what}_ratio_pairs_max"] = round(high, 3)
    row["submit_us_p99"] = _p99_us([s for side in sides[True] for s in side.call_ns])
    row["vllm_fs_submit_us_p99"] = _p99_us([s for side in sides[False] for s in side.call_ns])
    row["cold_load"] = all(side.cold for side in sides[True] + sides[False])
    row["vllm_fs_native_io"] = native_io
    return row


def _rounds_text(sides: list[Side], what: str) -> str:
    return " ".join(f"{getattr(side, what):.2f}" for side in sides)


def run(directory: str, vllm: VllmFs, args: argparse.Namespace, progress: Progress) -> list[dict]:
    """Every block size: ``--repeat`` rounds, ours and vLLM's in ABBA order; medians."""
    runs = []
    for block in args.block_sizes:
        sides: dict[bool, list[Side]] = {True: [], False: []}
        roots: list[str] = []
        try:
            for round_no in range(args.repeat):
                first = _ours_first(round_no)
                for ours in (first, not first):
                    root = tempfile.mkdtemp(prefix="ours-" if ours else "fs-", dir=directory)
                    roots.append(root)
                    sides[ours].append(run_side(vllm, ours, root, block, args, round_no, progress))
                    side = sides[ours][-1]
                    print(
                        f"{block >> 10} KiB round {round_no + 1}: "
                        f"{'ours' if ours else 'vLLM fs'} store {side.store_GBps:.2f} GB/s "
                        f"({side.store_unsynced_GBps:.2f} before the sync), "
                        f"load {side.load_GBps:.2f} GB/s",
                        file=sys.stderr,
                    )
        finally:
            for root in roots:
                shutil.rmtree(root, ignore_errors=True)
        row = _figures(block, sides, vllm.native_io)
        runs.append(row)
        print(
            f"{block >> 10} KiB blocks, {args.repeat} rounds (ABBA), GB/s, median [min-max]:\n"
            f"  store: ours {row['ours_store_GBps']} [{row['ours_store_GBps_min']}-"
            f"{row['ours_store_GBps_max']}], vLLM fs {row['vllm_fs_store_GBps']} "
            f"[{row['vllm_fs_store_GBps_min']}-{row['vllm_fs_store_GBps_max']}]: "
            f"{row['store_ratio']}x (rounds' own ratios {row['store_ratio_pairs_median']} "
            f"[{row['store_ratio_pairs_min']}-{row['store_ratio_pairs_max']}])\n"
            f"  load:  ours {row['ours_load_GBps']} [{row['ours_load_GBps_min']}-"
            f"{row['ours_load_GBps_max']}], vLLM fs {row['vllm_fs_load_GBps']} "
            f"[{row['vllm_fs_load_GBps_min']}-{row['vllm_fs_load_GBps_max']}]: "
            f"{row['load_ratio']}x (rounds' own ratios {row['load_ratio_pairs_median']} "
            f"[{row['load_ratio_pairs_min']}-{row['load_ratio_pairs_max']}])\n"
            f"  rounds, ours load:    {_rounds_text(sides[True], 'load_GBps')}\n"
            f"  rounds, vLLM fs load: {_rounds_text(sides[False], 'load_GBps')}\n"
            f"  our calls p99 {row['submit_us_p99']} us (vLLM fs {row['vllm_fs_submit_us_p99']})",
        )
    return runs


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, fully checked: a bad value exits with status 2 and a message
    naming the option, before anything is written."""
    parser = make_parser(__doc__)
    parser.add_argument("directory", nargs="?", help="directory to test (default: a temp dir)")
    parser.add_argument(
        "--size-gib", type=positive_float, default=0.5, help="data per tier per round, GiB"
    )
    parser.add_argument(
        "--block-sizes", type=size_list, default="2M,128K", help="chunk sizes (K, M suffixes)"
    )
    parser.add_argument("--cpu-mib", type=positive_int, default=256, help="vLLM's CPU tier, MiB")
    parser.add_argument(
        "--request-mib", type=positive_int, default=16, help="chunks per request, in MiB"
    )
    parser.add_argument(
        "--fsync", choices=("none", "batch", "always"), default="none", help="our tier's fsync"
    )
    parser.add_argument(
        "--vllm-fs-threads", type=positive_int, default=16, help="vLLM fs tier threads each way"
    )
    parser.add_argument(
        "--step-ms",
        type=positive_float,
        default=5.0,
        help="how long one scheduler step takes (the model's forward pass) while the "
        "driver waits on tier jobs",
    )
    parser.add_argument(
        "--repeat",
        type=positive_int,
        default=8,
        help="rounds per block size, each tier once a round in ABBA order; medians reported",
    )
    args = parser.parse_args(argv)
    total = int(args.size_gib * (1 << 30))
    for block in args.block_sizes:
        if block % _ALIGN:
            parser.error(f"argument --block-sizes: {block} is not a multiple of {_ALIGN}")
        if total < block:
            parser.error(f"argument --size-gib: {args.size_gib} GiB holds no {block}-byte block")
    if len(set(args.block_sizes)) != len(args.block_sizes):
        parser.error("argument --block-sizes: sizes repeat")
    if args.directory is not None:
        ensure_directory(parser, "directory", args.directory)
    where = args.directory if args.directory is not None else tempfile.gettempdir()
    need = 2 * args.repeat * total * _SPACE_MARGIN  # every root stays until the last round
    free = shutil.disk_usage(where).free
    if free < need:
        parser.error(
            f"argument --repeat: {args.repeat} rounds of two tiers x {args.size_gib} GiB need "
            f"about {need / (1 << 30):.1f} GiB under {where}, which has "
            f"{free / (1 << 30):.1f} GiB free; lower --repeat or --size-gib"
        )
    return args


def main() -> None:
    args = parse_args()
    vllm, why = load_vllm_fs()
    if vllm is None:
        raise SystemExit(f"bench_vllm_tiers needs vLLM 0.33: {why}")
    with Progress() as progress:
        if args.directory is None:
            with tempfile.TemporaryDirectory(prefix="bench-vllm-tiers-") as directory:
                runs = run(directory, vllm, args, progress)
        else:
            runs = run(args.directory, vllm, args, progress)
    print(json.dumps({"runs": runs}))


if __name__ == "__main__":
    run_main(main)
