"""Benchmark a storage backend against SGLang's own ``file`` backend, both driven by
SGLang 0.5.23's HiCache controller.

Usage::

    python examples/bench_sglang_tiers.py [--dir DIR] [--ours MODULE:CLASS]
        [--set KEY=VALUE ...] [--shapes small,large,hybrid] [--pages 64] [--rounds 4] [--json]

Needs SGLang 0.5.23 (``.ci/install-sglang``). For each model shape (``small``: 8 layers,
``large``: 32 layers as an 8B Llama; both 8 KV heads x 128, bf16, 64 tokens a page,
``page_first``, what SGLang recommends with a storage backend; ``hybrid``: ``small``'s
attention layers beside 24 Mamba layers whose state, a float32 SSM state of 16 heads x
128 x 128 and a bf16 conv state of 6144 x 3 per layer, about 24.8 MiB, as a scaled-down
Qwen3-Next's, SGLang keeps once per radix node of 16 pages), each subject gets SGLang's
real controller (driven by the tests' ``tests/_sglang_cpu.py``) and a host pool of its own, then
``--rounds`` rounds alternate the subjects ABBA (``file`` first in rounds 1, 4, 5, 8, ...)
so that neither always meets the disk first:

1. Store: SGLang's backup thread writes ``--pages`` pages (new keys every round) from the
   host pool through the backend (``hybrid``: node by node, each node's state through
   the v2 call before its KV pages); timed until its ack, and then through an
   ``os.sync()`` so that a store counts once its bytes are on the disk (SGLang's
   ``file`` backend never syncs). ``*_store_gbps`` include the sync and make
   ``store_ratio``; ``*_store_unsynced_gbps`` do not.
2. Cold: each of the subject's files synced and dropped from the page cache
   (``bench_nvme.drop_page_cache``: ``fsync``, then ``posix_fadvise(DONTNEED)``; no
   other file's pages); ``cold`` in the JSON says so.
3. Load: SGLang's prefetch (its hit query, then the transfer in batches of 128 pages,
   ``wait_complete``; ``hybrid``: then the last node's state) into other host slots;
   timed until its last ack. One page in 16, and the state, are checked against the
   bytes stored; the slots are then zeroed and freed.
4. Hit queries: 25 more prefetches of the round's pages that stop after SGLang's hit
   query (one ``batch_exists`` of every page on its prefetch thread), so that the
   ``batch_exists`` percentiles rest on 25 samples a round.

Subjects: ``file`` is SGLang's ``HiCacheFile``; ``ours`` (only with ``--ours``) is the
class ``MODULE:CLASS`` loaded by SGLang's ``dynamic`` factory with the extra config
``{"interface_v1": 1, KEY: VALUE, ...}`` from ``--set`` (values parsed as JSON when they
are, e.g. numbers; ``{dir}`` in a value stands for the subject's directory). Both
subjects' directories lie under ``--dir`` (default: a temporary one under /var/tmp,
removed at the end), on the same disk.

Every call SGLang's threads make into a backend (``batch_exists``, ``batch_get_v1``,
``batch_set_v1``, ``batch_get``, ``batch_set`` and the v2 calls) is timed on the backend
object SGLang built; ``<subject>_<method>_p50_us`` and ``_p99_us`` cover all rounds. GB/s
figures are medians over the rounds; the ratios are ours over file, of those medians.
For ``hybrid``, ``<subject>_kv_{store,load}_gbps`` are the KV bytes over the time in the
KV calls and ``<subject>_state_{store,load}_gbps`` the state bytes over the time in the
v2 calls, per round; ``state_over_kv_{store,load}_ratio`` is ours' state figure over its
KV figure (per byte, the state path against the v1 path). As SGLang's KV calls carry up
to 128 pages and a state call one state, ours' v1 and v2 calls are also timed directly
on equal bytes each round (``ours_equal_{kv,state}_{store,load}_gbps``: as many new KV
pages as a state holds bytes, and a new state, each through an ``os.sync()``; then,
cold, the round's first such pages and its first node's state; alternated), whose
ratio is ``state_over_kv_equal_bytes_{store,load}_ratio``. The last line of output is
one JSON object::

    {"runs": [{"shape": "small", "layers": 8, "page_bytes": ..., "pages": ..., "rounds": ...,
               "file_store_gbps": ..., "file_store_unsynced_gbps": ..., "file_load_gbps": ...,
               "ours_store_gbps": ..., "ours_store_unsynced_gbps": ..., "ours_load_gbps": ...,
               "store_ratio": ..., "load_ratio": ...,
               "file_batch_exists_p50_us": ..., "file_batch_exists_p99_us": ..., ...,
               "ours_batch_exists_p99_us": ..., ...}, ...],
     "cold": "each file synced and dropped from the page cache (fsync, posix_fadvise)"}
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from bench_engine import quantile_us  # sys.path[0]
from bench_nvme import drop_page_cache, files_under

from tiering.cli_args import ensure_directory, make_parser, positive_int, run_main

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
try:
    import _sglang_cpu as sglang_cpu  # a test aid: tests/ is on sys.path now
except ImportError as exc:  # SGLang is an optional extra
    sglang_cpu = None  # type: ignore[assignment]
    _MISSING = str(exc)

PAGE_TOKENS = 64
SHAPES = {"small": 8, "large": 32, "hybrid": 8}  # attention layers; 8 KV heads x 128, bf16
MAMBA = {"layers": 24, "temporal": (16, 128, 128), "conv": ((6144, 3),)}  # the hybrid state
NODE_PAGES = 16  # the hybrid shape's radix nodes: one state each
HEADS, HEAD_DIM = 8, 128
COLD = "each file synced and dropped from the page cache (fsync, posix_fadvise)"
_SAMPLE_EVERY = 16  # one loaded page in this many is byte-checked
_SPACE_MARGIN = 1.1  # disk bytes per payload byte, at most
_PREFETCH_THRESHOLD = 256  # tokens: SGLang's default prefetch_threshold
_HIT_QUERIES = 25  # per round, for batch_exists' percentiles
_KV_CALLS = ("batch_set_v1", "batch_get_v1", "batch_set", "batch_get")
_V2_CALLS = ("batch_exists_v2", "batch_set_v2", "batch_get_v2")


@dataclass
class Subject:
    """One backend under SGLang's controller for one shape, and its rounds' figures."""

    name: str
    ctrl: sglang_cpu.Controller
    directory: str
    stored: torch.Tensor  # the filled host slots every round stores from
    fill_tokens: list[int]
    log: sglang_cpu.CallLog
    states: torch.Tensor | None = None  # hybrid: the filled state slot of each node
    store_gbps: list[float] = field(default_factory=list)
    store_unsynced_gbps: list[float] = field(default_factory=list)
    load_gbps: list[float] = field(default_factory=list)
    per_call_gbps: dict[str, list[float]] = field(default_factory=dict)

    @property
    def state_pool(self) -> Any:
        return self.ctrl.sglang.mem_pool_host.entry_map[sglang_cpu.PoolName.MAMBA].host_pool

    def note(self, name: str, value: float) -> None:
        self.per_call_gbps.setdefault(name, []).append(value)


def _store(subject: Subject, tokens: list[int]) -> int:
    """SGLang's backup of the round's pages (node by node, with each node's state, for
    a hybrid subject); the tokens it counted as written."""
    ctrl = subject.ctrl
    if subject.states is None:
        return sglang_cpu.backup(ctrl, subject.stored, tokens)
    keys = sglang_cpu.get_storage_hash_str(tokens, None, page_size=PAGE_TOKENS)
    written, node = 0, NODE_PAGES * PAGE_TOKENS
    for i in range(len(keys) // NODE_PAGES):
        last = (i + 1) * NODE_PAGES
        state = sglang_cpu.state_transfer("mamba", [keys[last - 1]], subject.states[i : i + 1])
        written += sglang_cpu.backup(
            ctrl, subject.stored[i * node : (i + 1) * node], tokens[i * node : (i + 1) * node],
            prior_hash=keys[i * NODE_PAGES - 1] if i else None, extra_pools=[state],
        )  # fmt: skip
    return written


def _placeholders(subject: Subject) -> list[Any] | None:
    if subject.states is None:
        return None
    return [sglang_cpu.state_transfer("mamba", ["__placeholder__"])]


def _per_call(subject: Subject, first_call: int, page_bytes: int) -> None:
    """A hybrid round's KV and state GB/s: bytes over the time in their calls."""
    calls = subject.log.calls[first_call:]
    state_bytes = subject.state_pool.size_per_token
    for what, kv_calls, state_call in (
        ("store", ("batch_set_v1", "batch_set"), "batch_set_v2"),
        ("load", ("batch_get_v1", "batch_get"), "batch_get_v2"),
    ):
        kv = [c for c in calls if c.name in kv_calls]
        state = [c for c in calls if c.name == state_call and c.keys]
        subject.note(f"kv_{what}", sum(c.keys for c in kv) * page_bytes / sum(c.ns for c in kv))
        subject.note(
            f"state_{what}", sum(c.keys for c in state) * state_bytes / sum(c.ns for c in state)
        )


def _round(subject: Subject, round_no: int, pages: int, page_bytes: int) -> None:
    """One store and one cold load of ``pages`` new pages; see the module docstring."""
    ctrl = subject.ctrl
    tokens = sglang_cpu.page_tokens(pages, PAGE_TOKENS, seed=round_no + 1)
    total = pages * page_bytes
    if subject.states is not None:  # the state of every node, and the last one loaded
        total += pages // NODE_PAGES * subject.state_pool.size_per_token
    first_call = len(subject.log.calls)
    start = time.perf_counter()
    written = _store(subject, tokens)
    unsynced = time.perf_counter() - start
    os.sync()
    synced = time.perf_counter() - start
    if written != pages * PAGE_TOKENS:
        raise SystemExit(f"{subject.name}: SGLang wrote {written} of {pages * PAGE_TOKENS} tokens")
    drop_page_cache(list(files_under(subject.directory)))
    start = time.perf_counter()
    got = sglang_cpu.prefetch(
        ctrl, tokens, policy="wait_complete", extra_pools=_placeholders(subject)
    )
    loaded = time.perf_counter() - start
    if got.tokens != pages * PAGE_TOKENS or not got.usable:
        raise SystemExit(f"{subject.name}: SGLang loaded {got.tokens} of {pages * PAGE_TOKENS}")
    sglang_cpu.check_pages(
        ctrl.host_pool, got.host_indices, subject.fill_tokens, every=_SAMPLE_EVERY
    )
    sglang_cpu.evict(ctrl, got.host_indices)
    if subject.states is not None:
        _check_state(subject, got, pages // NODE_PAGES - 1)
        _per_call(subject, first_call, page_bytes)
        if subject.name == "ours":
            _equal_bytes(subject, round_no, tokens, page_bytes)
    for query in range(_HIT_QUERIES):
        operation, hit = sglang_cpu.hit_query(
            ctrl, tokens, f"query-{round_no}-{query}", extra_pools=_placeholders(subject)
        )
        ctrl.sglang.terminate_prefetch(operation)
        if hit != pages * PAGE_TOKENS:
            raise SystemExit(f"{subject.name}: SGLang's hit query found {hit} tokens")
    subject.store_gbps.append(total / synced / 1e9)
    subject.store_unsynced_gbps.append(total / unsynced / 1e9)
    subject.load_gbps.append(total / loaded / 1e9)
    print(
        f"  round {round_no + 1} {subject.name}: store {total / synced / 1e9:.2f} GB/s "
        f"({total / unsynced / 1e9:.2f} before the sync), load {total / loaded / 1e9:.2f} GB/s",
        file=sys.stderr,
    )


def _equal_bytes(subject: Subject, round_no: int, tokens: list[int], page_bytes: int) -> None:
    """Ours' v1 and v2 calls on the same bytes, called directly and alternated (v1 first
    in even rounds): a store of as many new KV pages as a state holds bytes and of one new
    state, each through an ``os.sync()``; then, cold, a load of the round's first such
    pages and of its first node's state."""
    backend, pool = subject.ctrl.backend, subject.state_pool
    state_bytes = pool.size_per_token
    n = max(1, round(state_bytes / page_bytes))
    keys = sglang_cpu.get_storage_hash_str(tokens, None, page_size=PAGE_TOKENS)
    kv_slots = subject.stored[: n * PAGE_TOKENS]
    state_slot = subject.states[:1]

    def v1_store() -> float:
        fresh = [f"equal-{round_no}-{i}" for i in range(n)]
        return _timed_synced(lambda: backend.batch_set_v1(fresh, kv_slots), n * page_bytes)

    def v2_store() -> float:
        fresh = sglang_cpu.state_transfer("mamba", [f"equal-{round_no}"], state_slot)
        return _timed_synced(lambda: backend.batch_set_v2([fresh])["mamba"], state_bytes)

    def v1_load() -> float:
        into = subject.ctrl.host_pool.alloc(n * PAGE_TOKENS)
        try:
            return _timed_cold(
                subject, lambda: backend.batch_get_v1(keys[:n], into), n * page_bytes
            )
        finally:
            subject.ctrl.host_pool.free(into)

    def v2_load() -> float:
        into = pool.alloc(1)
        state = sglang_cpu.state_transfer("mamba", [keys[NODE_PAGES - 1]], into)
        try:
            return _timed_cold(subject, lambda: backend.batch_get_v2([state])["mamba"], state_bytes)
        finally:
            pool.free(into)

    pairs = [("store", v1_store, v2_store), ("load", v1_load, v2_load)]
    for what, v1, v2 in pairs:
        for name, call in (
            (("kv", v1), ("state", v2)) if round_no % 2 == 0 else (("state", v2), ("kv", v1))
        ):
            subject.note(f"equal_{name}_{what}", call())


def _timed_synced(call: Any, nbytes: int) -> float:
    start = time.perf_counter()
    if not all(call()):
        raise SystemExit("ours: a store of the equal-bytes comparison failed")
    os.sync()
    return nbytes / (time.perf_counter() - start) / 1e9


def _timed_cold(subject: Subject, call: Any, nbytes: int) -> float:
    drop_page_cache(list(files_under(subject.directory)))
    start = time.perf_counter()
    if not all(call()):
        raise SystemExit("ours: a load of the equal-bytes comparison failed")
    return nbytes / (time.perf_counter() - start) / 1e9


def _check_state(subject: Subject, got: Any, node: int) -> None:
    """The loaded state holds the bytes of node ``node``'s state slot; its slot is freed."""
    pool, slot = subject.state_pool, got.states["mamba"].host_indices
    expected = pool.get_data_page(int(subject.states[node]), flat=True)
    if not torch.equal(pool.get_data_page(int(slot[0]), flat=True), expected):
        raise SystemExit(f"{subject.name}: the loaded state holds other bytes than were stored")
    pool.free(slot)


def _subjects(
    stack: ExitStack, args: argparse.Namespace, directory: str, shape: str
) -> Iterator[Subject]:
    layers, hybrid = SHAPES[shape], shape == "hybrid"
    nodes = args.pages // NODE_PAGES
    for name in ("file", "ours") if args.ours else ("file",):
        root = os.path.join(directory, name)
        os.makedirs(root)
        if name == "file":
            backend, extra = "file", {"file_storage_path": root}
        else:
            module_path, class_name = args.ours.split(":")
            options = {k: v.replace("{dir}", root) if isinstance(v, str) else v
                       for k, v in args.set.items()}  # fmt: skip
            extra = sglang_cpu.dynamic_config(
                module_path, class_name, **{"interface_v1": 1, **options}
            )
            backend = "dynamic"
        # Twice the pages: the stored slots stay filled, loads land in the others.
        pool = sglang_cpu.make_host_pool(
            "page_first", pages=2 * args.pages, page_size=PAGE_TOKENS, layers=layers,
            heads=HEADS, head_dim=HEAD_DIM,
        )  # fmt: skip
        sidecars = {}
        if hybrid:  # a slot per node for the stores, one more for the load
            mamba = MAMBA["layers"], MAMBA["temporal"], MAMBA["conv"]
            sidecars["mamba"] = sglang_cpu.make_mamba_pool(
                slots=nodes + 1, layers=mamba[0], temporal=mamba[1], conv=mamba[2]
            )
        ctrl = stack.enter_context(sglang_cpu.controller(pool, backend, extra, sidecars=sidecars))
        stored = pool.alloc(args.pages * PAGE_TOKENS)
        fill_tokens = sglang_cpu.page_tokens(args.pages, PAGE_TOKENS)
        sglang_cpu.fill_pages(pool, stored, fill_tokens)
        states = None
        if hybrid:
            states = sidecars["mamba"].alloc(nodes)
            sglang_cpu.fill_states(
                sidecars["mamba"], states, [f"node {i}" for i in range(nodes)], name
            )
        calls = sglang_cpu.STORAGE_CALLS + (_V2_CALLS if hybrid else ())
        log = sglang_cpu.record_calls(ctrl.backend, calls)
        yield Subject(name, ctrl, root, stored, fill_tokens, log, states)


def run_shape(args: argparse.Namespace, shape: str, directory: str) -> dict[str, Any]:
    """Every round of one shape, the subjects ABBA; its row of the JSON line."""
    layers = SHAPES[shape]
    page_bytes = 2 * layers * PAGE_TOKENS * HEADS * HEAD_DIM * 2
    row: dict[str, Any] = {"shape": shape, "layers": layers, "kv_heads": HEADS,
                           "head_dim": HEAD_DIM, "page_tokens": PAGE_TOKENS,
                           "page_bytes": page_bytes, "pages": args.pages,
                           "rounds": args.rounds}  # fmt: skip
    print(f"{shape}: {layers} layers, {page_bytes >> 20} MiB pages x {args.pages}", file=sys.stderr)
    with ExitStack() as stack:
        subjects = list(_subjects(stack, args, directory, shape))
        for round_no in range(args.rounds):
            order = subjects if round_no % 4 in (0, 3) else subjects[::-1]
            for subject in order:
                _round(subject, round_no, args.pages, page_bytes)
    for subject in subjects:
        for what in ("store", "store_unsynced", "load"):
            median = statistics.median(getattr(subject, f"{what}_gbps"))
            row[f"{subject.name}_{what}_gbps"] = round(median, 3)
        for what, values in subject.per_call_gbps.items():
            row[f"{subject.name}_{what}_gbps"] = round(statistics.median(values), 3)
        for method in sglang_cpu.STORAGE_CALLS + _V2_CALLS:
            durations = subject.log.durations_ns(method)
            if durations:
                row[f"{subject.name}_{method}_p50_us"] = quantile_us(durations, 0.5)
                row[f"{subject.name}_{method}_p99_us"] = quantile_us(durations, 0.99)
    if args.ours:
        for what in ("store", "load"):
            row[f"{what}_ratio"] = round(row[f"ours_{what}_gbps"] / row[f"file_{what}_gbps"], 3)
            if shape == "hybrid":
                ratio = row[f"ours_state_{what}_gbps"] / row[f"ours_kv_{what}_gbps"]
                row[f"state_over_kv_{what}_ratio"] = round(ratio, 3)
                equal = row[f"ours_equal_state_{what}_gbps"] / row[f"ours_equal_kv_{what}_gbps"]
                row[f"state_over_kv_equal_bytes_{what}_ratio"] = round(equal, 3)
    return row


def _summary(row: dict[str, Any]) -> str:
    lines = [f"{row['shape']} ({row['layers']} layers, {row['page_bytes'] >> 20} MiB pages x "
             f"{row['pages']}, {row['rounds']} rounds ABBA, medians; cold loads):"]  # fmt: skip
    for name in ("file", "ours"):
        if f"{name}_store_gbps" not in row:
            continue
        calls = ", ".join(
            f"{m} p50 {row[f'{name}_{m}_p50_us']} / p99 {row[f'{name}_{m}_p99_us']} us"
            for m in sglang_cpu.STORAGE_CALLS
            if f"{name}_{m}_p99_us" in row
        )
        lines.append(
            f"  {name}: store {row[f'{name}_store_gbps']} GB/s "
            f"({row[f'{name}_store_unsynced_gbps']} before the sync), "
            f"load {row[f'{name}_load_gbps']} GB/s; {calls}"
        )
        if f"{name}_state_store_gbps" in row:
            lines.append(
                f"  {name} in its calls: KV store {row[f'{name}_kv_store_gbps']}, load "
                f"{row[f'{name}_kv_load_gbps']} GB/s; state store "
                f"{row[f'{name}_state_store_gbps']}, load {row[f'{name}_state_load_gbps']} GB/s"
            )
    if "store_ratio" in row:
        lines.append(f"  ours / file: store {row['store_ratio']}x, load {row['load_ratio']}x")
    if "state_over_kv_store_ratio" in row:
        lines.append(
            f"  ours, state per byte / KV per byte: store {row['state_over_kv_store_ratio']}x, "
            f"load {row['state_over_kv_load_ratio']}x in SGLang's calls; store "
            f"{row['state_over_kv_equal_bytes_store_ratio']}x, load "
            f"{row['state_over_kv_equal_bytes_load_ratio']}x in calls of equal bytes"
        )
    return "\n".join(lines)


def _setting(text: str) -> tuple[str, Any]:
    """An argparse type: ``KEY=VALUE``, the value parsed as JSON when it is JSON."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def _shapes(text: str) -> list[str]:
    names = [n for n in text.split(",") if n]
    unknown = [n for n in names if n not in SHAPES]
    if not names or unknown or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"expected some of {','.join(SHAPES)}, got {text!r}")
    return names


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, fully checked: a bad value exits with status 2 and a message
    naming the option, before anything is written."""
    parser = make_parser(__doc__)
    parser.add_argument(
        "--dir", help="where both subjects write (default: a temp dir under /var/tmp)"
    )
    parser.add_argument("--ours", metavar="MODULE:CLASS", help="the dynamic backend to compare")
    parser.add_argument(
        "--set",
        type=_setting,
        action="append",
        metavar="KEY=VALUE",
        help="an extra-config option of --ours; repeatable",
    )
    parser.add_argument("--shapes", type=_shapes, default="small,large", help="model shapes")
    parser.add_argument("--pages", type=positive_int, default=64, help="pages per round")
    parser.add_argument("--rounds", type=positive_int, default=4, help="rounds, ABBA")
    parser.add_argument("--json", action="store_true", help="print only the JSON line on stdout")
    args = parser.parse_args(argv)
    if args.ours is not None and args.ours.count(":") != 1:
        parser.error(f"argument --ours: expected MODULE:CLASS, got {args.ours!r}")
    if args.set and args.ours is None:
        parser.error("argument --set: needs --ours")
    args.set = dict(args.set or [])
    if args.pages * PAGE_TOKENS < _PREFETCH_THRESHOLD:
        parser.error(
            f"argument --pages: SGLang does not prefetch under {_PREFETCH_THRESHOLD} tokens "
            f"({_PREFETCH_THRESHOLD // PAGE_TOKENS} pages), got {args.pages}"
        )
    if "hybrid" in args.shapes and args.pages % NODE_PAGES:
        parser.error(
            f"argument --pages: the hybrid shape stores nodes of {NODE_PAGES} pages, "
            f"got {args.pages}"
        )
    if args.dir is not None:
        ensure_directory(parser, "--dir", args.dir)
    where = args.dir if args.dir is not None else "/var/tmp"
    subjects = 2 if args.ours else 1
    need = (
        _SPACE_MARGIN
        * subjects
        * args.rounds
        * args.pages
        * max(2 * SHAPES[s] * PAGE_TOKENS * HEADS * HEAD_DIM * 2 for s in args.shapes)
    )
    free = shutil.disk_usage(where).free
    if free < need:
        parser.error(
            f"argument --pages: {args.rounds} rounds x {args.pages} pages need about "
            f"{need / (1 << 30):.1f} GiB under {where}, which has {free / (1 << 30):.1f} GiB "
            "free; lower --rounds or --pages"
        )
    return args


def main() -> None:
    args = parse_args()
    if sglang_cpu is None:
        raise SystemExit(f"bench_sglang_tiers needs SGLang 0.5.23: {_MISSING}")
    runs = []
    with ExitStack() as stack:
        directory = args.dir
        if directory is None:
            directory = stack.enter_context(
                tempfile.TemporaryDirectory(prefix="bench-sglang-tiers-", dir="/var/tmp")
            )
        for shape in args.shapes:
            shape_dir = tempfile.mkdtemp(prefix=f"{shape}-", dir=directory)
            try:
                row = run_shape(args, shape, shape_dir)
            finally:
                shutil.rmtree(shape_dir, ignore_errors=True)
            runs.append(row)
            if not args.json:
                print(_summary(row))
    print(json.dumps({"runs": runs, "cold": COLD}))


if __name__ == "__main__":
    run_main(main)
