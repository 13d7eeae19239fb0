"""Replay a workload through a real engine (:func:`replay`: every loaded byte checked), or
as bookkeeping only (:class:`CacheModel`, :func:`simulate`: fast enough for a capacity sweep).
docs/replay.md gives a request's steps and when the two agree block for block."""

from __future__ import annotations

import asyncio
import hashlib
import statistics
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar, Protocol

import numpy as np
import torch

from tiering.core.admission import make_gates
from tiering.core.cpu_tier import CPUOffloadingManager
from tiering.core.job_core import LEFT_EVERY_TIER
from tiering.core.policies import DEFAULT_POLICY
from tiering.engine import TieringEngine
from tiering.errors import BlockNotFoundError, InvalidArgumentError
from tiering.lab.workloads import Request
from tiering.observe.loop_lag import LoopLagMonitor
from tiering.observe.statistics import CAPACITY_CAUSES
from tiering.security.tenancy import Tenancy
from tiering.tiers.registry import replay_model
from tiering.tiers.tier_api import JobResult, tier_capacity_blocks
from tiering.validation import positive_int

CPU = "cpu"  # the CPU tier's name in hit and byte figures
# How the engine's causes for blocks lost under write-back end (evicted, or at a close):
# each is a tier's store that failed or found no room, which the tier counts itself.
_LOST_WITH_A_TRANSFER = "no tier took its write-back"
_KINDS = ("load", "store")  # a tier transfer's kinds, as the engine names its failures
ASK_AGAIN_S = 1.0  # how long a replay asks a lookup again while a tier answers "ask again"


@dataclass(frozen=True, slots=True)
class SegmentLayout:
    """The NVMe tier as the bookkeeping models it (:func:`tier_layout` reads it off one).
    Raises InvalidArgumentError for a bad field."""

    tier: ClassVar[str] = "nvme"  # whose replay model (tiering.tiers.registry) runs it
    capacity_records: int
    records_per_segment: int
    hot_fraction: float  # the fraction of recent uses an evicted segment writes again
    moves_per_job: int  # the most records one store job moves

    def __post_init__(self) -> None:
        for name in ("capacity_records", "records_per_segment", "moves_per_job"):
            positive_int(name, getattr(self, name))
        if type(self.hot_fraction) not in (int, float) or not 0 <= self.hot_fraction <= 1:
            raise InvalidArgumentError(f"hot_fraction must be in [0, 1], got {self.hot_fraction!r}")


TierLayout = int | SegmentLayout | None
"""A secondary tier in the model: blocks (LRU), a layout, or None (unbounded)."""


class _TierModel(Protocol):
    """A secondary tier in :class:`CacheModel`: ``add`` is one store job of keys it lacks."""

    def __contains__(self, key: bytes) -> bool: ...
    def touch(self, hashes: Sequence[bytes]) -> None: ...
    def loaded(self, hashes: Sequence[bytes]) -> None: ...
    def add(self, hashes: Sequence[bytes]) -> None: ...


class _LRUSet:
    """A tier that evicts the least recently used key: its keys, least recent first."""

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
        keys = self.keys
        for h in hashes:
            keys[h] = None
        if self.capacity is not None:
            while len(keys) > self.capacity:
                keys.popitem(last=False)


def tier_layout(tier: object) -> TierLayout:
    """``tier`` (open or closed) in the model: a :class:`SegmentLayout` for the NVMe tier,
    else its capacity in blocks, or None (unbounded)."""
    records = getattr(tier, "records_per_segment", None)
    stats = tier.statistics()  # type: ignore[attr-defined]
    block_bytes = int(getattr(tier, "block_bytes", 0))
    if isinstance(records, int) and stats.capacity_blocks:
        return SegmentLayout(
            capacity_records=stats.capacity_blocks,
            records_per_segment=records,
            hot_fraction=float(getattr(tier, "hot_fraction", 0.0)),
            moves_per_job=int(getattr(tier, "moves_per_job", 1)),
        )
    if stats.capacity_blocks:
        return int(stats.capacity_blocks)
    if stats.capacity_bytes and block_bytes:
        return max(1, stats.capacity_bytes // block_bytes)
    return None


class CacheModel:
    """The bookkeeping of a replay, without bytes: what each request would hit, where. A
    CPU tier of ``cpu_blocks`` evicting by ``policy``, and one :data:`TierLayout` per
    secondary tier, fastest first, written through what its ``tier_admission`` rule
    admits (:mod:`tiering.core.admission`; default ``all``) within its ``tier_budget``
    (blocks a second of arrival time; None or left out: unbounded), named ``tier0``,
    ``tier1``... in :attr:`hits`, :attr:`written` and :attr:`refused`. Raises
    InvalidArgumentError or UnknownPolicyError."""

    def __init__(
        self,
        cpu_blocks: int,
        policy: str = DEFAULT_POLICY,
        tier_blocks: Sequence[TierLayout] = (),
        tier_admission: Sequence[str] | None = None,
        tier_budget: Sequence[float | None] = (),
    ) -> None:
        self.manager = CPUOffloadingManager(positive_int("cpu_blocks", cpu_blocks), policy=policy)
        tiers: list[_TierModel] = []
        capacities: list[int | None] = []
        for i, layout in enumerate(tier_blocks):
            if isinstance(layout, SegmentLayout):  # the tier's own index, from its package
                tiers.append(replay_model(layout.tier)(**asdict(layout)))
                capacities.append(layout.capacity_records)
                continue
            if layout is not None:
                positive_int(f"tier_blocks[{i}]", layout)
            tiers.append(_LRUSet(layout))
            capacities.append(layout)
        rules = ["all"] * len(tiers) if tier_admission is None else list(tier_admission)
        if len(rules) != len(tiers):
            raise InvalidArgumentError(
                f"tier_admission names {len(rules)} rules for {len(tiers)} tiers"
            )
        self.now = 0.0
        """The clock write budgets count on: the arrival of the request being served."""
        self.gates = make_gates(rules, capacities, cpu_blocks, tier_budget, clock=lambda: self.now)
        self.tier_names = [f"tier{i}" for i in range(len(tier_blocks))]
        self._tiers = tiers
        self.hits: dict[str, int] = dict.fromkeys([CPU, *self.tier_names], 0)
        self.blocks = 0

    @property
    def written(self) -> dict[str, int]:
        """Blocks each secondary tier wrote (admitted)."""
        return {n: g.admitted_blocks for n, g in zip(self.tier_names, self.gates, strict=True)}

    @property
    def refused(self) -> dict[str, int]:
        """Blocks offered to each secondary tier that it did not write when offered (its
        rule refused them, or they were over its budget, some written later)."""
        return {
            n: g.refused_blocks + g.over_budget_blocks
            for n, g in zip(self.tier_names, self.gates, strict=True)
        }

    def request(self, hashes: Sequence[bytes], now: float = 0.0) -> int:
        """One request's blocks, arriving at ``now`` seconds: returns how many leading
        ones hit (and counts where)."""
        manager, tiers = self.manager, self._tiers
        self.now = now
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
        # As the engine's lookup notes it: a tier's "above" is the hit prefix's blocks
        # the CPU tier or a faster secondary tier held.
        for i, gate in enumerate(self.gates):
            if gate.observes:
                lower = {h for t, keys in promoted.items() if t >= i for h in keys}
                gate.observe(hashes, {h for h in hashes[:n] if h not in lower}.__contains__)
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
                for tier, gate in zip(tiers, self.gates, strict=True):
                    missing = [h for h in ready if h not in tier]
                    if missing or gate.backlog:  # and what its backlog writes now
                        missing = gate.admit(
                            missing, lambda h, t=tier: manager.is_ready(h) and h not in t
                        )
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
    policy: str = DEFAULT_POLICY,
    tier_blocks: Sequence[TierLayout] = (),
    full_blocks_only: bool = False,
    tenants: int = 1,
    tier_admission: Sequence[str] | None = None,
    tier_budget: Sequence[float | None] = (),
) -> CacheModel:
    """A fresh :class:`CacheModel` that ran ``requests`` once per tenant at their arrival
    times, as :func:`replay` sends them. Raises as :class:`CacheModel`."""
    model = CacheModel(cpu_blocks, policy, tier_blocks, tier_admission, tier_budget)
    names = tenant_names(tenants)
    tenancy = Tenancy()
    for request in requests:
        keys = request.keys(full_blocks_only=full_blocks_only)
        for name in names:
            model.request(keys if name is None else tenancy.keys(keys, name), request.arrival_s)
    return model


class TraceClock:
    """A clock that reads the trace's time (seconds): the arrival of the request being
    served, which :func:`replay` sets. Write budgets counted on it mean bytes a second of
    the traffic, however fast the replay runs."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def tenant_names(tenants: int) -> list[str | None]:
    """The tenants a replay sends each request for: ``tenant-0``, ``tenant-1``... (one
    tenant: None, the untenanted calls). Raises InvalidArgumentError for a bad count."""
    tenants = positive_int("tenants", tenants)
    return [f"tenant-{i}" for i in range(tenants)] if tenants > 1 else [None]


@dataclass
class ReplaySummary:
    """What a replay did, tiers named by :func:`tier_labels`; stable form: :meth:`to_json`."""

    requests: int = 0
    blocks: int = 0
    hit_blocks: int = 0
    hits_by_tier: dict[str, int] = field(default_factory=dict)
    mismatches: int = 0
    failed_loads: int = 0
    failed_stores: int = 0
    evicted_loads: int = 0
    """Loads that failed because a block left every tier after the lookup: not failures."""
    seconds: float = 0.0
    bytes_by_path: dict[str, int] = field(default_factory=dict)
    store_latency_s: list[float] = field(default_factory=list, repr=False)
    load_latency_s: list[float] = field(default_factory=list, repr=False)
    loop_lag_p99_ms: float = 0.0
    tier_counters: dict[str, dict[str, int]] = field(default_factory=dict, repr=False)
    capacity_blocks: dict[str, int] = field(default_factory=dict, repr=False)
    tier_layouts: dict[str, TierLayout] = field(default_factory=dict, repr=False)
    failed_blocks_by_tier: dict[str, dict[str, int]] = field(default_factory=dict)
    """Per tier type: blocks whose ``store`` or ``load`` failed, but those refused for room."""
    refused_blocks_by_tier: dict[str, int] = field(default_factory=dict)
    """Per tier type: blocks it had no room for (:data:`CAPACITY_CAUSES`): not failures."""
    failure_causes: dict[str, int] = field(default_factory=dict)
    """What failed, by cause: the tiers' (but want of room) and the engine's own (but
    tier transfers', which the tiers say, and write-back's lost blocks)."""
    tier_failures: dict[str, dict[str, int]] = field(default_factory=dict, repr=False)
    """Per secondary tier, its failures by cause; under ``cpu``, the engine's."""
    tier_types: dict[str, str] = field(default_factory=dict, repr=False)
    warm_blocks: dict[str, int] = field(default_factory=dict)
    """Blocks each secondary tier held when the first request came (only those held)."""
    warm_hits: int = 0
    """Hit blocks no request of this replay stored (in a fleet, nor this node)."""
    tenants: int = 1
    cross_tenant_hits: int = 0
    """Hit blocks a tenant never stored but another tenant did: 0 unless isolation broke."""
    admission_by_tier: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Per secondary tier: its admission ``rule``, ``write_budget_bytes_per_s`` (None:
    unbounded) and the blocks offered to it that it admitted, that the rule refused and
    that were over the budget (:meth:`~tiering.engine.TieringEngine.admission_counters`)."""

    @property
    def hit_ratio(self) -> float:
        return self.hit_blocks / self.blocks if self.blocks else 0.0

    def to_json(self) -> dict[str, Any]:
        """The summary as plain JSON values (the ``--json`` line of ``tiering replay``)."""
        copied = asdict(self)
        return {name: copied[name] for name in _JSON_FIELDS} | {
            "hit_ratio": round(self.hit_ratio, 4),
            "hit_ratio_by_tier": {
                tier: round(hits / self.blocks, 4) if self.blocks else 0.0
                for tier, hits in self.hits_by_tier.items()
            },
            "seconds": round(self.seconds, 3),
            "requests_per_s": round(self.requests / self.seconds, 1) if self.seconds else 0.0,
            "job_latency_ms": {
                "store": percentiles_ms(self.store_latency_s),
                "load": percentiles_ms(self.load_latency_s),
            },
            "loop_lag_p99_ms": round(self.loop_lag_p99_ms, 3),
        }


# The fields :meth:`ReplaySummary.to_json` gives as they are (copies).
_JSON_FIELDS = (
    "requests", "blocks", "mismatches", "failed_loads", "failed_stores", "evicted_loads",
    "failed_blocks_by_tier", "refused_blocks_by_tier", "failure_causes", "warm_blocks",
    "warm_hits", "bytes_by_path", "tenants", "cross_tenant_hits", "admission_by_tier",
)  # fmt: skip


# The counts :func:`combined` adds up (the latency lists: joined).
_ADDED_UP = (
    "requests", "blocks", "hit_blocks", "mismatches", "failed_loads", "failed_stores",
    "evicted_loads", "store_latency_s", "load_latency_s",
)  # fmt: skip


def combined(summaries: Iterable[ReplaySummary], seconds: float) -> ReplaySummary:
    """Several engines' summaries (a fleet's nodes) as one of ``seconds``: counts added up."""
    total = ReplaySummary(seconds=seconds)
    for summary in summaries:
        for name in _ADDED_UP:
            setattr(total, name, getattr(total, name) + getattr(summary, name))
        for name in ("hits_by_tier", "refused_blocks_by_tier", "failure_causes", "bytes_by_path"):
            setattr(total, name, summed([getattr(total, name), getattr(summary, name)]))
        for tier, counts in summary.failed_blocks_by_tier.items():
            _add(total.failed_blocks_by_tier, tier, counts)
        for tier, figures in summary.admission_by_tier.items():
            before = total.admission_by_tier.get(tier, {})
            added = {k: before.get(k, 0) + n for k, n in figures.items() if k.endswith("_blocks")}
            total.admission_by_tier[tier] = figures | added
    return total


def percentiles_ms(samples: list[float]) -> dict[str, float]:
    """p50 and p99 of latencies in seconds, as milliseconds, and their count."""
    if not samples:
        return {"p50": 0.0, "p99": 0.0, "count": 0}
    ordered = sorted(samples)
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    median = statistics.median(ordered)
    return {"p50": round(median * 1e3, 3), "p99": round(p99 * 1e3, 3), "count": len(ordered)}


def tier_labels(engine: TieringEngine) -> list[str]:
    """Each secondary tier's name in the figures: its type, numbered when two share one."""
    types = [tier.get_tier_type() for tier in engine.tiers]
    return [f"{t}{types[:i].count(t)}" if types.count(t) > 1 else t for i, t in enumerate(types)]


async def replay(
    requests: Sequence[Request],
    make_engine: Callable[[torch.Tensor], TieringEngine],
    *,
    device_blocks: int | None = None,
    block_bytes: int,
    pace: float | None = None,
    full_blocks_only: bool = False,
    verify: bool = True,
    settle: bool = False,
    tenants: int = 1,
    on_request: Callable[[int, ReplaySummary], None] | None = None,
    on_open: Callable[[TieringEngine, LoopLagMonitor], AbstractContextManager[object]]
    | None = None,
    clock: TraceClock | None = None,
) -> ReplaySummary:
    """Replay ``requests`` through the engine ``make_engine(device_kv)`` builds around a
    device KV cache (a CPU tensor) of ``device_blocks`` blocks (default: the longest
    request's) of ``block_bytes`` bytes, and close it (docs/replay.md: the steps).

    ``pace``: None (as fast as possible) or a speed-up of the arrival times. ``verify``:
    count wrong loaded blocks. ``settle``: let each store's cascade end before the next
    request. ``tenants``: send each request once per tenant. ``on_request(number,
    summary)`` runs after each request; ``on_open(engine, loop_lag)`` once the engine is
    open, its context left at the end. ``clock`` (given to ``make_engine`` for its write
    budgets) reads each request's arrival while it is served, as the bookkeeping replay's
    does. Raises InvalidArgumentError (nothing ran) for a bad
    argument or a request longer than ``device_blocks``, TieringError if the engine could
    not start."""
    keyed = [r.keys(full_blocks_only=full_blocks_only) for r in requests]
    device_blocks = device_blocks_for(keyed, device_blocks)
    nbytes = positive_int("block_bytes", block_bytes)
    if pace is not None and (type(pace) not in (int, float) or not pace > 0):
        raise InvalidArgumentError(f"pace must be None or a positive number, got {pace!r}")
    names = tenant_names(tenants)
    node = ReplayNode(make_engine, device_blocks, nbytes, verify=verify, settle=settle)
    async with node.engine, LoopLagMonitor() as lag:
        with on_open(node.engine, lag) if on_open is not None else nullcontext():
            start = time.perf_counter()
            for number, (request, keys) in enumerate(zip(requests, keyed, strict=True)):
                if pace is not None:
                    delay = start + request.arrival_s / pace - time.perf_counter()
                    if delay > 0:
                        await asyncio.sleep(delay)
                if clock is not None:
                    clock.now = request.arrival_s
                for tenant in names:
                    await node.request(keys, tenant)
                if on_request is not None:
                    on_request(number + 1, node.summary)
            node.summary.seconds = time.perf_counter() - start
    node.closed()
    node.summary.loop_lag_p99_ms = lag.p99_ms
    node.summary.tenants = tenants
    return node.summary


def device_blocks_for(keyed: Sequence[Sequence[bytes]], device_blocks: int | None) -> int:
    """``device_blocks`` (None: the longest request's); InvalidArgumentError if too few."""
    longest = max(map(len, keyed), default=0)
    if device_blocks is None:
        return max(1, longest)
    positive_int("device_blocks", device_blocks)
    for number, keys in enumerate(keyed):
        if len(keys) > device_blocks:
            raise InvalidArgumentError(
                f"device_blocks ({device_blocks}) is smaller than request {number}, which "
                f"has {len(keys)} blocks; give at least {longest}"
            )
    return device_blocks


class ReplayNode:
    """One engine under replay, from ``make_engine(device_kv)``, with its device cache
    (staging) and summary: enter ``node.engine`` around the requests, then :meth:`closed`."""

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
        """Serve one request for ``tenant``: look up, load and check the hit prefix, compute
        and store the rest. Returns the blocks that hit."""
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
                result = JobResult(0, False, tuple(keys[:n]), LEFT_EVERY_TIER)
            summary.load_latency_s.append(time.perf_counter() - began)
            if not result.success:
                # Evicted meanwhile: each key's reason starts with LEFT_EVERY_TIER.
                error = result.error or ""
                if LEFT_EVERY_TIER in error and "; " not in error:
                    summary.evicted_loads += 1
                else:
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
            failed = set() if result.success else set(result.failed_keys or keys[n:])
            own.update(key for key in keys[n:] if key not in failed)  # the others landed
            if not result.success:
                summary.failed_stores += 1
            elif self.settle:
                await job.cascaded
        return n

    async def _lookup(self, keys: list[bytes], held: list[bytes], tenant: str | None) -> int:
        """``engine.lookup``, asked again for up to :data:`ASK_AGAIN_S` while a tier answers
        "ask again" (None) for the first miss, as a scheduler does each step."""
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
        """A node with a fresh engine from the same factory, carrying on this summary."""
        blocks, nbytes = self.staging.shape
        node = ReplayNode(self._make_engine, blocks, nbytes, verify=self.verify, settle=self.settle)
        node.summary = self.summary
        return node

    def closed(self) -> None:
        """Add the closed engine's figures to the summary."""
        engine, summary = self.engine, self.summary
        labels, size = tier_labels(engine), engine.block_bytes
        engine_stats = engine.statistics()
        moved, failures = engine_stats.counters, engine_stats.failures
        paths = {"device->cpu": moved["bytes_to_host"], "cpu->device": moved["bytes_to_device"]}
        summary.capacity_blocks[CPU] = engine.manager.num_blocks
        _add(summary.tier_failures, CPU, failures)
        refused: Counter[str] = Counter()
        causes: Counter[str] = Counter()
        admissions = engine.admission_counters()
        for label, tier, counts in zip(labels, engine.tiers, admissions, strict=True):
            settings = {
                "rule": getattr(tier, "admission", "all"),
                "write_budget_bytes_per_s": getattr(tier, "write_budget", None),
            }
            before = summary.admission_by_tier.get(label, {})  # a restarted node's
            # Counts add up across a restart; what waits now is this engine's alone.
            added = {k: before.get(k, 0) + n for k, n in counts.items() if k != "backlog_blocks"}
            added["backlog_blocks"] = counts["backlog_blocks"]
            summary.admission_by_tier[label] = settings | added
            stats = tier.statistics()
            paths[f"cpu->{label}"] = stats.counters.get("stored_blocks", 0) * size
            paths[f"{label}->cpu"] = stats.counters.get("loaded_blocks", 0) * size
            _add(summary.tier_counters, label, stats.counters)
            _add(summary.tier_failures, label, stats.failures)
            summary.tier_layouts[label] = tier_layout(tier)
            summary.tier_types[label] = tier.get_tier_type()
            if capacity := tier_capacity_blocks(tier):
                summary.capacity_blocks[label] = capacity
            for cause, count in stats.failures.items():
                if cause in CAPACITY_CAUSES:
                    refused[tier.get_tier_type()] += count
                else:
                    causes[cause] += count
        names = list(dict.fromkeys(t.get_tier_type() for t in engine.tiers))  # as the engine
        transfers = {f"{name} tier {kind} failed" for name in names for kind in _KINDS}
        for name in names:
            load, store = (failures.get(f"{name} tier {kind} failed", 0) for kind in _KINDS)
            # The engine counts a refused block as a failed store to the tier; the tier
            # counts it once under its cause too.
            failed = {"load": load, "store": max(0, store - refused[name])}
            _add(summary.failed_blocks_by_tier, name, failed)
            refused_before = summary.refused_blocks_by_tier.get(name, 0)
            summary.refused_blocks_by_tier[name] = refused_before + refused[name]
        for cause, count in failures.items():  # LEFT_EVERY_TIER: counted as evicted_loads
            lost = cause.endswith(_LOST_WITH_A_TRANSFER)
            if cause not in transfers and cause != LEFT_EVERY_TIER and not lost:
                causes[cause] += count
        summary.failure_causes = summed([summary.failure_causes, causes])
        summary.bytes_by_path = paths


def summed(mappings: Iterable[Mapping[str, int]]) -> dict[str, int]:
    """The counts of ``mappings`` added up by name (a name counted 0 kept)."""
    total: Counter[str] = Counter()
    for mapping in mappings:
        total.update(mapping)
    return dict(total)


def _add(table: dict[str, dict[str, int]], name: str, counts: Mapping[str, int]) -> None:
    table[name] = summed([table.get(name, {}), counts])


# Whole-request array operations: NumPy lets go of the GIL, a loop per block would not.


def _count_mismatches(staging: np.ndarray, keys: list[bytes]) -> int:
    """How many of the first ``len(keys)`` device blocks differ from their keys' bytes."""
    whole, tail, digests = _blocks(staging, keys, 0)
    good = (whole == digests[:, None, :]).all(axis=(1, 2))
    good &= (tail == digests[:, : tail.shape[1]]).all(axis=1)
    return len(keys) - int(good.sum())


def _compute(staging: np.ndarray, keys: list[bytes], first: int) -> None:
    """Fill device blocks ``first..`` with their keys' bytes, as a model would compute them."""
    whole, tail, digests = _blocks(staging, keys, first)
    whole[...] = digests[:, None, :]
    tail[...] = digests[:, : tail.shape[1]]


def _blocks(
    staging: np.ndarray, keys: list[bytes], first: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Views of device blocks ``first..len(keys)``: their whole 64-byte repeats (blocks,
    repeats, 64) and the bytes after them; and each key's 64-byte BLAKE2b digest, a row."""
    last, repeats = len(keys), staging.shape[1] // 64
    whole = np.lib.stride_tricks.as_strided(
        staging[first:last],
        shape=(last - first, repeats, 64),
        strides=(staging.strides[0], 64, 1),
        writeable=True,
    )
    joined = b"".join(hashlib.blake2b(key, digest_size=64).digest() for key in keys[first:])
    digests = np.frombuffer(joined, dtype=np.uint8).reshape(last - first, 64)
    return whole, staging[first:last, repeats * 64 :], digests


def _source(engine: TieringEngine, labels: list[str], key: bytes) -> str:
    """Where a hit block is served from: the CPU tier, or the first tier holding it."""
    if engine.manager.is_ready(key):
        return CPU
    for label, tier in zip(labels, engine.tiers, strict=True):
        if tier.lookup(key):
            return label
    return "gone"  # it left every tier between the lookup and now
