"""Replay a workload: through a real engine, or as bookkeeping only.

:func:`replay` drives a real :class:`~tiering.engine.TieringEngine`: real bytes through
its host pool and tiers, with a simulated device KV cache of ``device_blocks`` blocks
used as staging. Per request, in order:

1. ``touch`` the prompt's blocks and ``lookup`` how many leading ones the tiers hold;
2. ``load`` that prefix into device blocks and compare every loaded block with the
   bytes its hash stands for (:func:`expected_bytes`): a difference is a *mismatch*;
3. "compute" the rest: fill their device blocks with the bytes their hashes stand for;
4. ``store`` them.

A key a load could not bring (a tier failed, or lost it) ends the hit there: it and
the blocks after it are computed and stored again, as a server would.

:class:`CacheModel` is the bookkeeping-only replay of the same steps (no bytes): the CPU
tier's own :class:`~tiering.manager.CPUOffloadingManager`, called exactly as the engine
calls it, and per secondary tier either a least-recently-used set (a memory tier) or,
for the segment-layout NVMe tier, that tier's own index driven as the tier drives it
(:class:`SegmentLayout`). When each store's cascade ends before the next request
(``settle``) its hit ratio is the engine's, block for block, evicting tiers included;
:func:`simulate` runs it over a workload, fast enough for a capacity sweep.
"""

from __future__ import annotations

import asyncio
import hashlib
import statistics
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from tiering.engine import TieringEngine
from tiering.errors import BlockNotFoundError, InvalidArgumentError
from tiering.loop_lag import LoopLagMonitor
from tiering.manager import CPUOffloadingManager
from tiering.secondary import JobResult
from tiering.tenancy import Tenancy
from tiering.validation import positive_int
from tiering.workloads import Request

CPU = "cpu"
"""The CPU tier's name in hit and byte figures."""
ASK_AGAIN_S = 1.0
"""How long a replay asks a lookup again while a tier answers "ask again"."""


def expected_bytes(key: bytes, nbytes: int) -> np.ndarray:
    """The bytes block ``key`` stands for in a replay: a 64-byte BLAKE2b digest of the
    key, repeated to ``nbytes`` (a uint8 array). Distinct keys give distinct blocks."""
    digest = np.frombuffer(hashlib.blake2b(key, digest_size=64).digest(), dtype=np.uint8)
    return np.resize(digest, nbytes)


# ------------------------------------------------------------------ bookkeeping


@dataclass(frozen=True, slots=True)
class SegmentLayout:
    """An NVMe tier in the segment layout (``"nvme"``) as the bookkeeping models it: its
    capacity in records, the records a segment takes, the fraction of recent uses whose
    blocks an evicted segment writes again, and the most records one store job moves.
    :func:`tier_layout` reads them off a tier."""

    capacity_records: int
    records_per_segment: int
    hot_fraction: float
    moves_per_job: int

    def __post_init__(self) -> None:
        """Raises: InvalidArgumentError for a count that is not a positive int, or a
        ``hot_fraction`` outside [0, 1]."""
        for name in ("capacity_records", "records_per_segment", "moves_per_job"):
            positive_int(name, getattr(self, name))
        fraction = self.hot_fraction
        if (
            isinstance(fraction, bool)
            or not isinstance(fraction, int | float)
            or not 0 <= fraction <= 1
        ):
            raise InvalidArgumentError(f"hot_fraction must be in [0, 1], got {fraction!r}")


TierLayout = int | SegmentLayout | None
"""A secondary tier in the model: a capacity in blocks (least recently used evicted), a
:class:`SegmentLayout`, or None (unbounded)."""


class _LRUSet:
    """A secondary tier in the model: the keys it holds, least recently used first (a
    memory tier, or any tier that evicts the least recently used block)."""

    __slots__ = ("capacity", "keys")

    def __init__(self, capacity: int | None) -> None:
        self.capacity = capacity
        self.keys: OrderedDict[bytes, None] = OrderedDict()

    def __contains__(self, key: bytes) -> bool:
        return key in self.keys

    def touch(self, hashes: Sequence[bytes]) -> None:
        keys = self.keys
        for h in reversed(hashes):  # the first hash ends most recent
            if h in keys:
                keys.move_to_end(h)

    def loaded(self, hashes: Sequence[bytes]) -> None:
        """A load from the tier changes no recency."""

    def add(self, hashes: Sequence[bytes]) -> None:
        """One store job of keys the tier lacks."""
        keys = self.keys
        for h in hashes:
            keys[h] = None
        if self.capacity is not None:
            while len(keys) > self.capacity:
                keys.popitem(last=False)


class _SegmentLog:
    """The NVMe tier in the model: the tier's own index (:class:`backends.
    nvme_segment_index.SegmentIndex`), driven as the tier drives it: touches and loads
    mark keys used in the order given, and a store job makes room with the tier's own
    :meth:`~backends.nvme_segment_index.SegmentIndex.plan_room`."""

    __slots__ = ("_digest", "_index", "_moves_per_job")

    def __init__(self, layout: SegmentLayout) -> None:
        # Imported here: tiering never imports backends at import time.
        from backends.nvme_segment_index import SegmentIndex, key_digest

        self._digest = key_digest
        self._index = SegmentIndex(
            layout.capacity_records,
            records_per_segment=layout.records_per_segment,
            writer="0",
            hot_fraction=layout.hot_fraction,
        )
        self._moves_per_job = layout.moves_per_job

    def __contains__(self, key: bytes) -> bool:
        return self._digest(key) in self._index

    def touch(self, hashes: Sequence[bytes]) -> None:
        self._index.touch(map(self._digest, hashes))

    def loaded(self, hashes: Sequence[bytes]) -> None:
        self._index.touch(map(self._digest, hashes))

    def add(self, hashes: Sequence[bytes]) -> None:
        """One store job of keys the tier lacks."""
        index = self._index
        wanted = list(dict.fromkeys(map(self._digest, hashes)))
        plan = index.plan_room(len(wanted), most_moves=self._moves_per_job)
        for digest, placement in zip(wanted[: plan.fit], plan.placed[: plan.fit], strict=True):
            index.commit(digest, placement)
        for (_, _, digest), placement in zip(plan.moves, plan.placed[plan.fit :], strict=True):
            if digest in index:  # stored again meanwhile: the newer record wins
                index.abandon(placement)
            else:
                index.commit(digest, placement)


def tier_layout(tier: object) -> TierLayout:
    """How the model represents ``tier`` (an open or closed secondary tier): a
    :class:`SegmentLayout` for the segment-layout NVMe tier, else its capacity in blocks
    from its statistics (``capacity_blocks``, or ``capacity_bytes`` over its block
    size), or None where it reports neither."""
    records = getattr(tier, "records_per_segment", None)
    stats = tier.statistics()  # type: ignore[attr-defined]
    block_bytes = int(getattr(tier, "block_bytes", 0))
    if isinstance(records, int) and stats.capacity_blocks:
        from backends.nvme_space import MOVE_BYTES_PER_JOB

        return SegmentLayout(
            capacity_records=stats.capacity_blocks,
            records_per_segment=records,
            hot_fraction=float(getattr(tier, "hot_fraction", 0.0)),
            moves_per_job=max(1, MOVE_BYTES_PER_JOB // max(1, block_bytes)),
        )
    if stats.capacity_blocks:
        return int(stats.capacity_blocks)
    if stats.capacity_bytes and block_bytes:
        return max(1, stats.capacity_bytes // block_bytes)
    return None


class CacheModel:
    """The bookkeeping of a replay, without bytes: what each request would hit, where.

    Args:
        cpu_blocks: the CPU tier's capacity.
        policy: its eviction policy's name.
        tier_blocks: one :data:`TierLayout` per secondary tier, fastest first: a
            capacity in blocks (least recently used evicted), a :class:`SegmentLayout`,
            or None (unbounded). Stores go to every tier that lacks the block
            (write-through).
        tier_names: their names in :attr:`hits` (default ``tier0``, ``tier1``...).

    Raises:
        InvalidArgumentError / UnknownPolicyError: a bad capacity or policy name.
    """

    def __init__(
        self,
        cpu_blocks: int,
        policy: str = "lru",
        tier_blocks: Sequence[TierLayout] = (),
        tier_names: Sequence[str] | None = None,
    ) -> None:
        self.manager = CPUOffloadingManager(positive_int("cpu_blocks", cpu_blocks), policy=policy)
        tiers: list[_LRUSet | _SegmentLog] = []
        for i, layout in enumerate(tier_blocks):
            if isinstance(layout, SegmentLayout):
                tiers.append(_SegmentLog(layout))
                continue
            if layout is not None:
                positive_int(f"tier_blocks[{i}]", layout)
            tiers.append(_LRUSet(layout))
        names = list(tier_names) if tier_names is not None else []
        if tier_names is not None and len(names) != len(tier_blocks):
            raise InvalidArgumentError(
                f"tier_names must name each of the {len(tier_blocks)} tiers, got {names!r}"
            )
        self.tier_names = names or [f"tier{i}" for i in range(len(tier_blocks))]
        self._tiers = tiers
        self.hits: dict[str, int] = dict.fromkeys([CPU, *self.tier_names], 0)
        self.blocks = 0

    def request(self, hashes: Sequence[bytes]) -> int:
        """One request's blocks: returns how many leading ones hit (and counts where)."""
        manager, tiers = self.manager, self._tiers
        manager.touch(hashes)
        for tier in tiers:
            tier.touch(hashes)
        n = 0
        promoted: dict[int, list[bytes]] = {}
        for h in hashes:
            if manager.is_ready(h):
                self.hits[CPU] += 1
            else:
                holder = next((i for i, t in enumerate(tiers) if h in t), None)
                if holder is None:
                    break
                self.hits[self.tier_names[holder]] += 1
                promoted.setdefault(holder, []).append(h)
            n += 1
        if promoted:  # the engine gives the promoted blocks CPU slots, as a store does
            out = manager.prepare_store(hashes[:n], admission=False)
            if out is not None:
                manager.complete_store(out.block_hashes_to_store)
            for i, keys in promoted.items():
                tiers[i].loaded(keys)
        rest = hashes[n:]
        if rest:
            out = manager.prepare_store(rest)
            if out is not None:
                manager.complete_store(out.block_hashes_to_store)
                # Write-through: the request's blocks now ready go to each tier lacking them.
                ready = [h for h in dict.fromkeys(rest) if manager.is_ready(h)]
                for tier in tiers:
                    missing = [h for h in ready if h not in tier]
                    if missing:
                        tier.add(missing)
        self.blocks += len(hashes)
        return n

    @property
    def hit_ratio(self) -> float:
        """Hit blocks / requested blocks so far (0 before any)."""
        return sum(self.hits.values()) / self.blocks if self.blocks else 0.0


def simulate(
    requests: Sequence[Request],
    *,
    cpu_blocks: int,
    policy: str = "lru",
    tier_blocks: Sequence[TierLayout] = (),
    full_blocks_only: bool = False,
    tenants: int = 1,
) -> CacheModel:
    """Run ``requests`` through a fresh :class:`CacheModel`; returns it, with its hit
    figures. With ``tenants`` above 1 each request is sent once per tenant, under that
    tenant's keys, as :func:`replay` sends it.

    Raises:
        InvalidArgumentError / UnknownPolicyError: as :class:`CacheModel`, or a bad
            ``tenants``.
    """
    model = CacheModel(cpu_blocks, policy, tier_blocks)
    names = tenant_names(tenants)
    tenancy = Tenancy()
    for request in requests:
        keys = request.keys(full_blocks_only=full_blocks_only)
        for name in names:
            model.request(keys if name is None else tenancy.keys(keys, name))
    return model


def tenant_names(tenants: int) -> list[str | None]:
    """The tenants a replay sends each request for: ``tenant-0``, ``tenant-1``... (one
    tenant: None, the untenanted calls).

    Raises:
        InvalidArgumentError: ``tenants`` is not a positive int.
    """
    tenants = positive_int("tenants", tenants)
    return [f"tenant-{i}" for i in range(tenants)] if tenants > 1 else [None]


# ------------------------------------------------------------------ engine replay


@dataclass
class ReplaySummary:
    """What a replay through the engine did; :meth:`to_json` is its stable form.

    Hit ratios are hit blocks / requested blocks, overall and by the tier each hit came
    from (``cpu``, then the secondary tiers by type). ``bytes_by_path`` counts payload
    bytes per direction (``device->cpu``, ``cpu->device``, ``cpu-><tier>``,
    ``<tier>->cpu``), from the engine's and the tiers' counters.
    """

    requests: int = 0
    blocks: int = 0
    hit_blocks: int = 0
    hits_by_tier: dict[str, int] = field(default_factory=dict)
    mismatches: int = 0
    failed_loads: int = 0
    failed_stores: int = 0
    seconds: float = 0.0
    bytes_by_path: dict[str, int] = field(default_factory=dict)
    store_latency_s: list[float] = field(default_factory=list, repr=False)
    load_latency_s: list[float] = field(default_factory=list, repr=False)
    loop_lag_p99_ms: float = 0.0
    tier_counters: dict[str, dict[str, int]] = field(default_factory=dict, repr=False)
    capacity_blocks: dict[str, int] = field(default_factory=dict, repr=False)
    tier_layouts: dict[str, TierLayout] = field(default_factory=dict, repr=False)
    """How the bookkeeping model represents each secondary tier (:func:`tier_layout`)."""
    failed_blocks_by_tier: dict[str, dict[str, int]] = field(default_factory=dict)
    """Per secondary tier type: blocks whose ``store`` to it or ``load`` from it failed."""
    tier_failures: dict[str, dict[str, int]] = field(default_factory=dict, repr=False)
    """Per secondary tier: its own failures by cause (``statistics().failures``); under
    ``cpu``, the engine's (which count the failed tier blocks too)."""
    tier_types: dict[str, str] = field(default_factory=dict, repr=False)
    """Each secondary tier's type, by its name in the figures."""
    warm_blocks: dict[str, int] = field(default_factory=dict)
    """Blocks each secondary tier held when the first request came (a reused NVMe
    root, say); only tiers that held some."""
    warm_hits: int = 0
    """Hit blocks that no request of this replay stored: the tiers held them before (in
    a fleet, also those another node stored in a shared tier)."""
    tenants: int = 1
    cross_tenant_hits: int = 0
    """Hit blocks a tenant never stored itself but another tenant of this replay did:
    zero unless isolation broke."""

    @property
    def hit_ratio(self) -> float:
        return self.hit_blocks / self.blocks if self.blocks else 0.0

    def to_json(self) -> dict[str, Any]:
        """The summary as plain JSON values (the ``--json`` line of ``tiering replay``)."""
        return {
            "requests": self.requests,
            "blocks": self.blocks,
            "hit_ratio": round(self.hit_ratio, 4),
            "hit_ratio_by_tier": {
                tier: round(hits / self.blocks, 4) if self.blocks else 0.0
                for tier, hits in self.hits_by_tier.items()
            },
            "mismatches": self.mismatches,
            "failed_loads": self.failed_loads,
            "failed_stores": self.failed_stores,
            "failed_blocks_by_tier": {t: dict(n) for t, n in self.failed_blocks_by_tier.items()},
            "warm_blocks": dict(self.warm_blocks),
            "warm_hits": self.warm_hits,
            "seconds": round(self.seconds, 3),
            "requests_per_s": round(self.requests / self.seconds, 1) if self.seconds else 0.0,
            "bytes_by_path": dict(self.bytes_by_path),
            "job_latency_ms": {
                "store": percentiles_ms(self.store_latency_s),
                "load": percentiles_ms(self.load_latency_s),
            },
            "loop_lag_p99_ms": round(self.loop_lag_p99_ms, 3),
            "tenants": self.tenants,
            "cross_tenant_hits": self.cross_tenant_hits,
        }


def percentiles_ms(samples: list[float]) -> dict[str, float]:
    """p50 and p99 of latencies in seconds, as milliseconds, and their count."""
    if not samples:
        return {"p50": 0.0, "p99": 0.0, "count": 0}
    ordered = sorted(samples)
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    return {
        "p50": round(statistics.median(ordered) * 1e3, 3),
        "p99": round(p99 * 1e3, 3),
        "count": len(ordered),
    }


def tier_labels(engine: TieringEngine) -> list[str]:
    """Each secondary tier's name in the figures: its type, numbered when two share one."""
    types = [tier.get_tier_type() for tier in engine.tiers]
    return [f"{t}{types[:i].count(t)}" if types.count(t) > 1 else t for i, t in enumerate(types)]


async def replay(
    requests: Sequence[Request],
    make_engine: Callable[[torch.Tensor], TieringEngine],
    *,
    device_blocks: int,
    block_bytes: int,
    pace: float | None = None,
    full_blocks_only: bool = False,
    verify: bool = True,
    settle: bool = False,
    tenants: int = 1,
    on_request: Callable[[int, ReplaySummary], None] | None = None,
    on_open: Callable[[TieringEngine, LoopLagMonitor], AbstractContextManager[object]]
    | None = None,
) -> ReplaySummary:
    """Replay ``requests`` through the engine ``make_engine(device_kv)`` builds around a
    device KV cache of ``device_blocks`` blocks of ``block_bytes`` bytes (a CPU tensor),
    and close it.

    Args:
        pace: None to run as fast as possible; otherwise a speed-up of the workload's
            own arrival times (1.0: as recorded, 2.0: twice as fast).
        verify: compare every loaded block with its expected bytes (mismatches).
        settle: let each store's cascade to the secondary tiers end before the next
            request. The CPU tier never evicts a block still being written to a tier,
            so without it the engine may evict other blocks than the bookkeeping model
            does when the tiers are slow; with it the two agree block for block.
        tenants: with more than one, every request is sent once by each of that many
            tenants (``tenant-0``, ``tenant-1``, ...), in turn: identical prompts from
            tenants the engine must keep apart. Each tenant's blocks carry bytes of
            their own (those of the tenant's keys, :meth:`TieringEngine.tenant_keys`),
            so a block served across tenants is a mismatch, and every hit on a block
            the tenant never stored but another did counts in ``cross_tenant_hits``
            (one nobody stored in this replay, in ``warm_hits``).
        on_request: called after each request with its number and the summary so far.
        on_open: called once the engine is open, with it and the loop-lag monitor; the
            context manager it returns is left when the replay ends (serve metrics
            with it, say).

    Returns:
        The summary; ``mismatches`` counts loaded blocks whose bytes were wrong, which
        never happens unless a tier served wrong bytes.

    Raises:
        InvalidArgumentError: a bad argument, or a request longer than ``device_blocks``
            (naming the request); nothing ran.
        TieringError: the engine could not start.
    """
    device_blocks = positive_int("device_blocks", device_blocks)
    nbytes = positive_int("block_bytes", block_bytes)
    if pace is not None and (
        isinstance(pace, bool) or not isinstance(pace, int | float) or not pace > 0
    ):
        raise InvalidArgumentError(f"pace must be None or a positive number, got {pace!r}")
    names = tenant_names(tenants)
    keyed = [r.keys(full_blocks_only=full_blocks_only) for r in requests]
    for number, keys in enumerate(keyed):
        if len(keys) > device_blocks:
            raise InvalidArgumentError(
                f"device_blocks ({device_blocks}) is smaller than request {number}, which "
                f"has {len(keys)} blocks; give at least {max(map(len, keyed))}"
            )
    node = ReplayNode(make_engine, device_blocks, nbytes, verify=verify, settle=settle)
    async with node.engine, LoopLagMonitor() as lag:
        with on_open(node.engine, lag) if on_open is not None else nullcontext():
            start = time.perf_counter()
            for number, (request, keys) in enumerate(zip(requests, keyed, strict=True)):
                if pace is not None:
                    delay = start + request.arrival_s / pace - time.perf_counter()
                    if delay > 0:
                        await asyncio.sleep(delay)
                for tenant in names:
                    await node.request(keys, tenant)
                if on_request is not None:
                    on_request(number + 1, node.summary)
            node.summary.seconds = time.perf_counter() - start
    node.closed()
    node.summary.loop_lag_p99_ms = lag.p99_ms
    node.summary.tenants = tenants
    return node.summary


class ReplayNode:
    """One engine under replay: its device cache (staging), its tiers' names and its
    summary. ``make_engine(device_kv)`` builds the engine; enter ``node.engine`` (``async
    with``) around the requests, and call :meth:`closed` after it closed.

    Raises (constructor): what ``make_engine`` raises.
    """

    def __init__(
        self,
        make_engine: Callable[[torch.Tensor], TieringEngine],
        device_blocks: int,
        block_bytes: int,
        *,
        verify: bool = True,
        settle: bool = False,
    ) -> None:
        device = torch.zeros((device_blocks, block_bytes), dtype=torch.uint8)
        self.staging = device.numpy()  # the same memory: the engine copies from and into it
        self._make_engine = make_engine
        self.engine = make_engine(device)
        self.verify = verify
        self.settle = settle
        self.summary = ReplaySummary()
        self._labels: list[str] | None = None
        self._stored_by: dict[str | None, set[bytes]] = {}  # which tenant stored what

    async def request(self, keys: list[bytes], tenant: str | None = None) -> int:
        """Serve one request's blocks (the engine open) for ``tenant``: look up, load and
        check the hit prefix, compute and store the rest. Returns the blocks that hit."""
        engine, staging, summary = self.engine, self.staging, self.summary
        if self._labels is None:
            self._labels = tier_labels(engine)
            summary.hits_by_tier = dict.fromkeys([CPU, *self._labels], 0)
            for label, tier in zip(self._labels, engine.tiers, strict=True):
                held_before = tier.statistics().used_blocks
                if held_before and not summary.requests:  # not a restarted node's
                    summary.warm_blocks[label] = held_before
        # What the tiers hold, and so the bytes each block stands for: the tenant's keys.
        held = keys if tenant is None else engine.tenant_keys(keys, tenant)
        engine.touch(keys, tenant=tenant)
        n = await self._lookup(keys, held, tenant)
        sources = [_source(engine, self._labels, key) for key in held[:n]]
        if n:
            began = time.perf_counter()
            try:
                result = await engine.load(keys[:n], range(n), tenant=tenant)
            except BlockNotFoundError:  # a tier let one go between the lookup and now
                result = JobResult(0, False, tuple(keys[:n]), "left every tier")
            summary.load_latency_s.append(time.perf_counter() - began)
            if not result.success:
                summary.failed_loads += 1
                failed = set(result.failed_keys)
                # The hit ends at the first key that did not land (all if none is named).
                n = next((i for i, key in enumerate(keys[:n]) if key in failed), 0)
            if self.verify:  # the whole request's blocks in one hop off the loop
                summary.mismatches += await asyncio.to_thread(_count_mismatches, staging, held[:n])
        own = self._stored_by.setdefault(tenant, set())
        for key in keys[:n]:
            if key in own:
                continue
            if any(key in keys_of for other, keys_of in self._stored_by.items() if other != tenant):
                summary.cross_tenant_hits += 1
            else:  # no request of this replay stored it: a tier held it before
                summary.warm_hits += 1
        for source in sources[:n]:
            summary.hits_by_tier[source] = summary.hits_by_tier.get(source, 0) + 1
        summary.hit_blocks += n
        summary.blocks += len(keys)
        summary.requests += 1
        if n < len(keys):
            await asyncio.to_thread(_compute, staging, held, n)  # the "model", off the loop
            began = time.perf_counter()
            job = engine.store(keys[n:], range(n, len(keys)), tenant=tenant)
            result = await job
            summary.store_latency_s.append(time.perf_counter() - began)
            if result.success:
                own.update(keys[n:])
            else:  # a failed job's keys not named failed did land
                failed = set(result.failed_keys) if result.failed_keys else set(keys[n:])
                own.update(k for k in keys[n:] if k not in failed)
            if not result.success:
                summary.failed_stores += 1
            elif self.settle:
                await job.cascaded
        return n

    async def _lookup(self, keys: list[bytes], held: list[bytes], tenant: str | None) -> int:
        """``engine.lookup``, asked again (as a scheduler does each step) while a tier
        answers "ask again" (None) for the first block that missed (asked under the key
        it holds, ``held``), for up to :data:`ASK_AGAIN_S`: a remote tier checks
        presence in the background."""
        engine = self.engine
        n = engine.lookup(keys, tenant=tenant)
        deadline = time.monotonic() + ASK_AGAIN_S
        while (
            n < len(keys)
            and any(tier.lookup(held[n]) is None for tier in engine.tiers)
            and time.monotonic() < deadline
        ):
            await asyncio.sleep(0.001)
            n = engine.lookup(keys, tenant=tenant)
        return n

    def restarted(self) -> ReplayNode:
        """A node with a fresh engine from the same factory (its tiers' persistent data,
        an NVMe root, comes back), carrying on this node's summary."""
        node = ReplayNode(
            self._make_engine,
            self.staging.shape[0],
            self.staging.shape[1],
            verify=self.verify,
            settle=self.settle,
        )
        node.summary = self.summary
        return node

    def closed(self) -> None:
        """Take the bytes moved per path, each tier's counters, failures, layout and
        capacity in blocks, and the blocks that failed per tier, from the closed engine
        (every cascade counted)."""
        engine, summary = self.engine, self.summary
        labels = tier_labels(engine)
        summary.bytes_by_path = _bytes_by_path(engine, labels)
        summary.capacity_blocks[CPU] = engine.manager.num_blocks
        engine_failures = engine.statistics().failures
        causes = summary.tier_failures.setdefault(CPU, {})
        for cause, count in engine_failures.items():
            causes[cause] = causes.get(cause, 0) + count
        for name in dict.fromkeys(t.get_tier_type() for t in engine.tiers):  # as the engine
            failed = summary.failed_blocks_by_tier.setdefault(name, {"load": 0, "store": 0})
            for kind in ("load", "store"):  # a restarted node adds up
                failed[kind] += engine_failures.get(f"{name} tier {kind} failed", 0)
        for label, tier in zip(labels, engine.tiers, strict=True):
            stats = tier.statistics()
            counters = summary.tier_counters.setdefault(label, {})
            for name, value in stats.counters.items():  # a restarted node adds up
                counters[name] = counters.get(name, 0) + value
            causes = summary.tier_failures.setdefault(label, {})
            for cause, count in stats.failures.items():
                causes[cause] = causes.get(cause, 0) + count
            summary.tier_layouts[label] = tier_layout(tier)
            summary.tier_types[label] = tier.get_tier_type()
            if stats.capacity_blocks:
                summary.capacity_blocks[label] = stats.capacity_blocks
            elif stats.capacity_bytes:
                summary.capacity_blocks[label] = stats.capacity_bytes // engine.block_bytes


def _count_mismatches(staging: np.ndarray, keys: list[bytes]) -> int:
    """How many of the first ``len(keys)`` device blocks differ from their keys' bytes."""
    if not keys:
        return 0
    matches = _blocks_view(staging, 0, len(keys)) == _digests(keys)[:, None, :]
    tail = _tail(staging, 0, len(keys))
    good = matches.all(axis=(1, 2))
    if tail is not None:
        good &= (tail == _digests(keys)[:, : tail.shape[1]]).all(axis=1)
    return int(len(keys) - good.sum())


def _compute(staging: np.ndarray, keys: list[bytes], first: int) -> None:
    """Fill device blocks ``first..`` with their keys' bytes, as a model would compute them."""
    rest = keys[first:]
    digests = _digests(rest)
    _blocks_view(staging, first, len(keys))[...] = digests[:, None, :]
    tail = _tail(staging, first, len(keys))
    if tail is not None:
        tail[...] = digests[:, : tail.shape[1]]


# Whole-request array operations, not a loop per block: NumPy lets go of the GIL while it
# copies or compares, and a Python loop holding it would delay the event loop by up to a
# switch interval (5 ms) at a time.


def _digests(keys: list[bytes]) -> np.ndarray:
    """Each key's 64-byte digest, one row per key (the pattern :func:`expected_bytes`
    repeats)."""
    joined = b"".join(hashlib.blake2b(key, digest_size=64).digest() for key in keys)
    return np.frombuffer(joined, dtype=np.uint8).reshape(len(keys), 64)


def _blocks_view(staging: np.ndarray, first: int, last: int) -> np.ndarray:
    """Blocks ``first..last`` as (blocks, repeats, 64): the whole 64-byte repeats."""
    repeats = staging.shape[1] // 64
    # A view, never a copy (a reshape of a row slice would copy when a tail is left).
    return np.lib.stride_tricks.as_strided(
        staging[first:last],
        shape=(last - first, repeats, 64),
        strides=(staging.strides[0], 64, 1),
        writeable=True,
    )


def _tail(staging: np.ndarray, first: int, last: int) -> np.ndarray | None:
    """The bytes after the last whole repeat of blocks ``first..last`` (None if none)."""
    start = staging.shape[1] // 64 * 64
    return staging[first:last, start:] if start < staging.shape[1] else None


def _source(engine: TieringEngine, labels: list[str], key: bytes) -> str:
    """Where a hit block is served from: the CPU tier, or the first tier holding it."""
    if engine.manager.is_ready(key):
        return CPU
    for label, tier in zip(labels, engine.tiers, strict=True):
        if tier.lookup(key):
            return label
    return "gone"  # it left every tier between the lookup and now


def _bytes_by_path(engine: TieringEngine, labels: list[str]) -> dict[str, int]:
    size = engine.block_bytes
    counters = engine.statistics().counters
    paths = {
        "device->cpu": counters["bytes_to_host"],
        "cpu->device": counters["bytes_to_device"],
    }
    for label, tier in zip(labels, engine.tiers, strict=True):
        tier_counters = tier.statistics().counters
        paths[f"cpu->{label}"] = tier_counters.get("stored_blocks", 0) * size
        paths[f"{label}->cpu"] = tier_counters.get("loaded_blocks", 0) * size
    return paths


__all__ = [
    "CPU",
    "CacheModel",
    "ReplayNode",
    "ReplaySummary",
    "SegmentLayout",
    "TierLayout",
    "expected_bytes",
    "percentiles_ms",
    "replay",
    "simulate",
    "tenant_names",
    "tier_labels",
    "tier_layout",
]
