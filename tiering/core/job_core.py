"""The engine's job state machine, without I/O: every rule about fills, pins and order.

Calls and completions go in; the effects the shell must carry out, in order, come out. The
calls, the effects and the rules it keeps: docs/job-lifecycle.md."""

from __future__ import annotations

import enum
import logging
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import partial
from types import MappingProxyType
from typing import Any, NamedTuple, Protocol

from tiering.core.admission import Admission, WriteGate
from tiering.core.cpu_tier import CPUOffloadingManager
from tiering.core.scheduler_api import BlockHash, OffloadingEvent, PrepareStoreOutput
from tiering.errors import BlockNotFoundError, ClosedError, InvalidArgumentError
from tiering.lifecycle import Lifecycle
from tiering.observe.statistics import FailureLog
from tiering.security.tenancy import MAX_TENANT_LABELS, OTHER_TENANTS, TenantLookups
from tiering.tiers.client import TierOutcome
from tiering.tiers.tier_api import JobResult
from tiering.validation import check_distinct, device_id_list, hash_list

logger = logging.getLogger(__name__)

WRITE_POLICIES = ("write_through", "write_back")
COUNTERS = (
    "bytes_to_host",
    "bytes_to_device",
    "stored_blocks",
    "loaded_blocks",
    "promoted_blocks",
    "cascaded_blocks",
    "written_back_blocks",
    "flushed_blocks",
    "failed_jobs",
    "evicted_blocks",
    "declined_blocks",
    "lost_blocks",
)
"""The core's monotonic counters (docs/metrics.md describes each); lookups are counted
apart (:class:`LookupStatistics`)."""
FLUSH_BATCH = 64
"""Blocks per tier job when flushing: a large CPU tier becomes many bounded jobs."""
ASKED_AGAIN = 4096
"""Lookups remembered so that one asked again (a scheduler's poll) is seen once by the
tiers' admission rules: each is forgotten when a store or load names its last block."""
LEFT_EVERY_TIER = "block left every tier"
"""Why a load that waited for room fails when a block it names was evicted from every
tier meanwhile (the cause, and the start of each key's reason): a miss under pressure."""


@dataclass(frozen=True, slots=True)
class LookupStatistics:
    """What :meth:`JobCore.lookup` has answered so far (monotonic totals); hits by where
    each was found: ``[0]`` the CPU tier, ``[t + 1]`` tier ``t``."""

    lookups: int = 0
    blocks: int = 0
    hit_blocks: int = 0
    first_misses: int = 0
    hits_by_tier: tuple[int, ...] = ()


# The effects (docs/job-lifecycle.md#effects-out says what the shell does with each).


class CopyToHost(NamedTuple):
    """Copy device blocks ``device_ids[i]`` into CPU ``slots[i]``; then ``copy_done``."""

    op: int
    device_ids: list[int]
    slots: list[int]


class CopyToDevice(NamedTuple):
    """Copy CPU ``slots[i]`` into device blocks ``device_ids[i]``; then ``copy_done``.
    For load ``job``; ``whole`` unless a block of it failed and is left out."""

    op: int
    slots: list[int]
    device_ids: list[int]
    job: int = 0
    whole: bool = True


class TierStore(NamedTuple):
    """Store CPU ``slots[i]`` as ``keys[i]`` in tier ``tier``; then ``tier_done``."""

    op: int
    tier: int
    keys: list[BlockHash]
    slots: list[int]


class TierLoad(NamedTuple):
    """Load ``keys[i]`` from tier ``tier`` into CPU ``slots[i]``; then ``tier_done``."""

    op: int
    tier: int
    keys: list[BlockHash]
    slots: list[int]


class Resolve(NamedTuple):
    """Job ``job`` has its one result."""

    job: int
    result: JobResult


class Cascaded(NamedTuple):
    """Store job ``job`` reached every secondary tier (``ok``) or not; its last word."""

    job: int
    ok: bool


class FlushDone(NamedTuple):
    """Flush ``flush`` ended; ``ok`` if every tier took every block."""

    flush: int
    ok: bool


class WaitForRoom(NamedTuple):
    """Job ``job`` waits for CPU room: ``room_expired(job)`` after ``seconds``."""

    job: int
    seconds: float


class Drained(NamedTuple):
    """Closing: no job, cascade, write-back or flush is left; the tiers may close."""


Effect = (
    CopyToHost
    | CopyToDevice
    | TierStore
    | TierLoad
    | Resolve
    | Cascaded
    | FlushDone
    | WaitForRoom
    | Drained
)


class TierView(Protocol):
    """What the core asks of a secondary tier (all synchronous and cheap)."""

    name: str
    servable: bool

    def lookup(self, key: BlockHash) -> bool | None: ...
    def hold(self, keys: Sequence[BlockHash]) -> None: ...
    def release(self, keys: Sequence[BlockHash]) -> None: ...


_CLOSED_BEFORE_COPY = "the engine closed before the copy started"
_NONE_FAILED: Mapping[BlockHash, str] = MappingProxyType({})
_NO_TIER_HITS: list[tuple[int, int]] = []  # shared, never changed: a lookup's hits all in CPU
_NO_PROMOTIONS: Mapping[int, tuple[list[BlockHash], list[int]]] = MappingProxyType({})


class Phase(enum.Enum):
    """Where a store or load is; a job only moves forward. A hard close gives a job its
    result in any phase; its I/O still ends through the phases that follow (its pins)."""

    WAITING = "waiting for CPU room"
    MOVING = "moving"  # planned: its copy into CPU, promotions and joined fills run
    COPYING_OUT = "copying out"  # a load: its copy to the device runs
    CASCADING = "cascading"  # a store: resolved; its blocks go to the secondary tiers
    DONE = "done"  # its result (and a store's cascaded answer) is given


# Module constants: the hot path compares phases without an attribute lookup.
_WAITING, _MOVING, _COPYING_OUT, _CASCADING, _DONE = Phase


class _Fanout:
    """Tier stores of ``owner`` started together (a cascade, a write-back, a flush), each
    counted in ``counter`` and holding a CPU pin (``pinned``) on its blocks until it ends;
    ``then(self)`` is called once the last has reported back."""

    __slots__ = ("counter", "failed", "failures", "owner", "pending", "pinned", "then")

    def __init__(self, owner: Any, then: Callable[[Any], None], counter: str, pinned: bool) -> None:
        self.owner = owner
        self.then = then
        self.counter = counter
        self.pinned = pinned
        self.pending = 0
        self.failed: dict[BlockHash, str] = {}  # keys a tier did not take, first reason
        # Made at the first failure: most fan-outs (a cascade per store) have none.
        self.failures: Counter[BlockHash] | None = None  # tiers that did not take each key

    def part_done(self, failed: Mapping[BlockHash, str]) -> None:
        self.pending -= 1
        if failed:
            if self.failures is None:
                self.failures = Counter()
            self.failures.update(failed.keys())
            for k, reason in failed.items():
                self.failed.setdefault(k, reason)
        if self.pending == 0:
            self.then(self)

    def failed_in(self, tiers: int) -> dict[BlockHash, str]:
        """The keys that ``tiers`` stores failed."""
        failures = self.failures or {}
        return {k: self.failed[k] for k, n in failures.items() if n == tiers}


class _Flush(_Fanout):
    __slots__ = ("closing", "id", "internal")

    def __init__(self, flush_id: int, then: Callable[[Any], None], closing: bool) -> None:
        super().__init__(self, then, "flushed_blocks", True)
        self.id = flush_id
        self.closing = closing  # the close's write-back: what it fails, close_result names
        self.internal = closing  # no FlushDone (the close's own, or already answered)


class _Job:
    """One store or load. Containers are made when first needed: most jobs never fail,
    promote or join."""

    __slots__ = (
        "awaiting",
        "device_ids",
        "failed",
        "fills",
        "hashes",
        "id",
        "io",
        "is_load",
        "phase",
        "pinned",
        "promotions",
        "resolved",
        "slots",
    )

    def __init__(self, job_id: int, is_load: bool, hashes: list[BlockHash], ids: list[int]) -> None:
        self.id = job_id
        self.is_load = is_load
        self.hashes = hashes  # a store: each distinct hash once (once planned); a load: as called
        self.device_ids = ids
        self.phase = _WAITING
        self.io = 0  # this job's effects in flight
        self.resolved = False
        self.awaiting = 0  # fills it waits for (a store's own copy counts as one)
        self.failed: Mapping[BlockHash, str] = _NONE_FAILED
        self.fills: list[BlockHash] | tuple[()] = ()  # a store: the blocks whose fill it owns
        self.slots: list[int] | tuple[()] = ()  # a store: its fills' slots; a load: each block's
        # One CPU pin each, owned by this job: a load's until its copy to the device ends;
        # a cascading store's until its cascade has pinned the blocks per tier.
        self.pinned: list[BlockHash] | tuple[()] = ()
        # A load: tier -> the blocks it promotes from there, and their slots.
        self.promotions: Mapping[int, tuple[list[BlockHash], list[int]]] = _NO_PROMOTIONS

    def fail(self, key: BlockHash, reason: str) -> None:
        if self.failed is _NONE_FAILED:
            self.failed = {}
        self.failed.setdefault(key, reason)  # type: ignore[attr-defined]


class JobCore:
    """Stores, loads, cascades, write-back, flush and close as one synchronous machine.

    ``tiers`` are the secondary tiers, fastest first, each writing what its ``gates``
    entry admits (left out: everything; an explicit flush, and the close's under
    write-back, write past them). A job waits ``room_timeout`` seconds for CPU room at
    most. With ``enable_events`` it records the tiers' store events, and ``take_removed``
    (one callable per tier) their removals. Every public method raises before changing
    anything or returns the effects of the change, in order. Raises InvalidArgumentError
    for an unknown write policy, or ``take_removed`` or ``gates`` not one per tier."""

    def __init__(
        self,
        manager: CPUOffloadingManager,
        tiers: Sequence[TierView],
        *,
        num_device_blocks: int,
        block_bytes: int,
        write_policy: str = "write_through",
        room_timeout: float = 5.0,
        enable_events: bool = False,
        take_removed: Sequence[Callable[[], Sequence[BlockHash]]] = (),
        gates: Sequence[WriteGate] = (),
    ) -> None:
        if write_policy not in WRITE_POLICIES:
            raise InvalidArgumentError(
                f"write_policy must be 'write_through' or 'write_back', got {write_policy!r}"
            )
        self.write_back = write_policy == "write_back"
        self.manager = manager
        self.tiers = list(tiers)
        if take_removed and len(take_removed) != len(self.tiers):
            raise InvalidArgumentError(
                f"take_removed has {len(take_removed)} callables for {len(self.tiers)} tiers"
            )
        if gates and len(gates) != len(self.tiers):
            raise InvalidArgumentError(f"gates has {len(gates)} gates for {len(self.tiers)} tiers")
        self.gates = list(gates) or [WriteGate(Admission()) for _ in self.tiers]
        """What each tier admits, and its counts (:class:`~tiering.core.admission.WriteGate`)."""
        self._observing = [t for t, gate in enumerate(self.gates) if gate.observes]
        # Lookups seen, by last block (ASKED_AGAIN); dropped oldest first.
        self._asked: OrderedDict[BlockHash, None] = OrderedDict()
        # Lookups (blocks, hit, tier hits) and stores or loads (their last block) in
        # order, for observe_requests.
        self._unobserved: list[tuple[list[BlockHash], int, list[tuple[int, int]]] | bytes] = []
        self.num_device_blocks = num_device_blocks
        self.block_bytes = block_bytes
        self.room_timeout = room_timeout
        self.enable_events = enable_events
        self.state = Lifecycle.OPEN
        self.counters: Counter[str] = Counter(dict.fromkeys(COUNTERS, 0))
        self.failures = FailureLog(logger, "engine")
        self.blocks_in_flight = 0  # moved by copies and tier jobs in flight
        # Plain ints and one list, not the counters: the lookup path stays cheap.
        self._lookups = self._lookup_blocks = self._lookup_first_misses = 0
        self._lookup_hits = [0] * (1 + len(self.tiers))
        self._tenant_lookups: dict[str, TenantLookups] = {}
        self._take_removed = list(take_removed) if enable_events else []
        self._tier_events: list[OffloadingEvent] = []
        self._servable = [t for t, tier in enumerate(self.tiers) if tier.servable]
        self._jobs: dict[int, _Job] = {}  # planned, not yet done
        self._waiting: dict[int, tuple[_Job, Callable[[], bool]]] = {}  # no room yet, FIFO
        self._flushes: dict[int, _Flush] = {}
        # I/O in flight by op, column-wise (no object per op): its owner, the blocks it
        # moves, and on_end(owner, result).
        self._op_owner: dict[int, Any] = {}
        self._op_blocks: dict[int, int] = {}
        self._op_end: dict[int, Callable[[Any, object], None]] = {}
        # Bound once: a bound method made per call is one more object for the collector.
        self._on_store_copied = self._store_copied
        self._on_copied_out = self._copied_out
        self._on_cascaded = self._cascaded
        # The job owning the fill of each slot being filled, indexed by slot: a dict every
        # block enters and leaves would now and then be rebuilt inside a caller's store.
        self._fill_owner: list[_Job | None] = [None] * manager.num_blocks
        self.filling_blocks = 0  # CPU blocks being written by a copy or a promotion
        self._fill_waiters: dict[BlockHash, list[_Job]] = {}  # made as the first one joins
        self._out: list[Effect] = []
        self._next_id = 0
        self._close_id: int | None = None
        self._close_flushed = self._drained = False
        self._close_failed: dict[BlockHash, str] = {}  # not written back to every tier
        self._close_lost: set[BlockHash] = set()  # of those, held by no tier: counted lost
        self._writing_back: Counter[BlockHash] = Counter()  # victims with write-backs in flight

    def lookup(self, block_hashes: object, tenant: str | None = None) -> int:
        """Leading hashes ready in the CPU tier or stored in a servable secondary tier
        (counted under the ``tenant`` label, if given). Raises InvalidArgumentError if
        ``block_hashes`` is not an iterable of bytes."""
        hashes = hash_list("block_hashes", block_hashes)
        is_ready = self.manager.is_ready
        hits = self._lookup_hits
        n = in_tiers = 0
        held_below: list[tuple[int, int]] | None = None  # (position, tier) of tier hits
        for h in hashes:
            if not is_ready(h):
                t = self._holder(h)
                if t is None:
                    self._lookup_first_misses += 1
                    self._ask_ahead(hashes, n)
                    break
                hits[t + 1] += 1
                in_tiers += 1
                if held_below is None:
                    held_below = []
                held_below.append((n, t))
            n += 1
        hits[0] += n - in_tiers  # counted per call: the CPU path stays one check per hash
        if self._observing and hashes:  # inline: the rest waits for observe_requests
            self._unobserved.append((hashes, n, held_below or _NO_TIER_HITS))
        self._lookups += 1
        self._lookup_blocks += len(hashes)
        if tenant is not None:
            lookups = self._tenant_lookups
            if tenant not in lookups and len(lookups) >= MAX_TENANT_LABELS:
                tenant = OTHER_TENANTS
            counts = lookups.setdefault(tenant, TenantLookups())
            counts.lookups += 1
            counts.blocks += len(hashes)
            counts.hit_blocks += n
        return n

    def _note_ran(self, last: BlockHash) -> None:
        unobserved = self._unobserved
        unobserved.append(last)
        if len(unobserved) > ASKED_AGAIN:  # stores and loads without lookups: keep it bounded
            self.observe_requests()

    @property
    def observations_pending(self) -> bool:
        """True while requests wait for :meth:`observe_requests`."""
        return bool(self._unobserved)

    def observe_requests(self) -> None:
        """Show the requests looked up since the last call to each admission rule that
        watches them, in order, once per request (a lookup asked again before its request
        stored or loaded is not): the bookkeeping kept off the calls' path. A request's
        blocks above tier ``t`` are those of its hit prefix that the CPU tier or a faster
        tier held at its lookup. Runs before any admission decision, so the shell may call
        it whenever it likes."""
        pending, self._unobserved = self._unobserved, []
        asked = self._asked
        for note in pending:
            if isinstance(note, bytes):  # its request ran
                asked.pop(note, None)
                continue
            hashes, hit, held_below = note
            if hashes[-1] in asked:
                continue
            asked[hashes[-1]] = None
            if len(asked) > ASKED_AGAIN:
                asked.popitem(last=False)
            prefix = hashes[:hit]
            for t in self._observing:
                lower = {i for i, holder in held_below if holder >= t}
                above = {h for i, h in enumerate(prefix) if i not in lower} if hit else ()
                self.gates[t].observe(hashes, above.__contains__)

    def _ask_ahead(self, hashes: list[BlockHash], n: int) -> None:
        # A tier answering "ask again" (None) for the first miss is asked about the rest
        # too, so a remote tier checks them in one batched round trip.
        for t in self._servable:
            tier = self.tiers[t]
            if tier.lookup(hashes[n]) is None:
                for h in hashes[n + 1 :]:
                    tier.lookup(h)

    def lookup_statistics(self) -> LookupStatistics:
        """What :meth:`lookup` has answered so far."""
        hits = tuple(self._lookup_hits)
        return LookupStatistics(
            self._lookups, self._lookup_blocks, sum(hits), self._lookup_first_misses, hits
        )

    def tenant_statistics(self) -> dict[str, TenantLookups]:
        """Copies of the lookups per tenant label (past ``MAX_TENANT_LABELS``: ``"other"``)."""
        return {label: replace(counts) for label, counts in self._tenant_lookups.items()}

    @property
    def jobs_in_flight(self) -> int:
        """Jobs (waiting, running or cascading) and flushes that have not ended."""
        return len(self._jobs) + len(self._waiting) + len(self._flushes)

    def take_tier_events(self) -> list[OffloadingEvent]:
        """Secondary-tier events since the last call (with ``enable_events``): what tier
        jobs stored and, given ``take_removed``, what tiers dropped, in order per tier."""
        for t in range(len(self._take_removed)):
            self._removal_event(t)
        events, self._tier_events = self._tier_events, []
        return events

    def _removal_event(self, t: int) -> None:
        if removed := self._take_removed[t]():
            self._tier_event(t, list(removed), True)

    def _tier_event(self, t: int, keys: list[BlockHash], removed: bool) -> None:
        medium = self.tiers[t].name.upper()
        self._tier_events.append(OffloadingEvent(keys, self.manager.block_size, medium, removed))

    # Stores (docs/job-lifecycle.md#a-store-step-by-step).

    def store(self, block_hashes: object, device_block_ids: object) -> tuple[int, list[Effect]]:
        """Admit a store of device blocks into the CPU tier; returns ``(job id, effects)``.
        Raises ClosedError unless open, InvalidArgumentError for malformed arguments
        (docs/job-lifecycle.md#calls: a store names each block once)."""
        hashes, ids = self._arguments(block_hashes, device_block_ids)
        check_distinct("block_hashes", hashes)
        if self._observing and hashes:  # a later lookup of this request is a new one
            self._note_ran(hashes[-1])
        job = _Job(self._new_id(), False, hashes, ids)
        if not self._plan_store(job, hashes, ids):
            needed = len({h for h in hashes if h not in self.manager})
            self._wait_for_room(job, needed, partial(self._plan_store, job, hashes, ids))
        return job.id, self._take()

    def _plan_store(self, job: _Job, hashes: list[BlockHash], ids: list[int]) -> bool:
        """Start the store; False without room."""
        manager = self.manager
        out = manager.prepare_store(hashes)
        if out is None:
            return False
        new = out.block_hashes_to_store
        if len(new) != len(hashes):  # some were resident or declined
            fresh = set(new)
            device_id = dict(zip(hashes, ids, strict=True))
            job.device_ids = [device_id[h] for h in new]
            job.hashes = [h for h in hashes if h in fresh or h in manager]
            self.counters["declined_blocks"] += len(hashes) - len(job.hashes)
            for h in job.hashes:
                if h not in fresh and not manager.is_ready(h):
                    self._join(h, job)  # another job's fill
        job.slots = slots = out.store_spec.block_ids
        fill_owner = self._fill_owner
        for slot in slots:
            fill_owner[slot] = job
        self.filling_blocks += len(slots)
        job.phase = _MOVING
        job.awaiting += 1  # its own copy
        job.fills = job.hashes if len(new) == len(hashes) else new  # all new: the same keys
        self._jobs[job.id] = job
        if out.block_hashes_evicted:  # a store that evicts nothing skips the write-back
            self._write_back(job, out, self._copy_in)
        else:
            self._copy_in(job)
        return True

    def _copy_in(self, job: _Job) -> None:
        """Victims written back: copy the device blocks into the new slots."""
        if not job.fills:
            self._store_copied(job, None)
        elif self.state is Lifecycle.CLOSED:
            self._store_copied(job, _CLOSED_BEFORE_COPY)
        else:
            op = self._start(job, len(job.fills), self._on_store_copied)
            self._out.append(CopyToHost(op, job.device_ids, job.slots))

    def _store_copied(self, job: _Job, error: object) -> None:
        job.awaiting -= 1
        reason = None
        if error is not None:
            reason = self._copy_failed(job, job.fills, "device to CPU", error)
        self._end_fills(job, job.fills, reason)
        if reason is None:
            if self._cascading():  # keep them until the cascade has pinned them itself
                self._hold(job, list(job.fills))
            self.counters["bytes_to_host"] += len(job.fills) * self.block_bytes
            self.counters["stored_blocks"] += len(job.fills)
        self._settled(job)

    def _cascading(self) -> bool:
        return not self.write_back and bool(self.tiers) and self.state is not Lifecycle.CLOSED

    def _hold(self, job: _Job, keys: list[BlockHash]) -> None:
        """Pin ``keys`` for ``job`` (see :attr:`_Job.pinned`)."""
        self.manager.prepare_load(keys)
        if not job.pinned:
            job.pinned = keys
        elif job.pinned is job.hashes:  # shared with the job's keys: never grow it in place
            job.pinned = [*job.pinned, *keys]
        else:
            job.pinned.extend(keys)  # type: ignore[union-attr]

    def _release_held(self, job: _Job) -> None:
        if job.pinned:
            self.manager.complete_load(job.pinned)
            job.pinned = ()

    def _cascade(self, job: _Job) -> None:
        if not job.failed and (self.write_back or not self.tiers):
            self._answer_cascaded(job, True)  # nothing to cascade at store time
            return
        if job.failed or self.state is Lifecycle.CLOSED:
            self._release_held(job)
            self._answer_cascaded(job, False)
            return
        cascade = _Fanout(job, self._on_cascaded, "cascaded_blocks", True)
        for t in range(len(self.tiers)):
            self._tier_store(cascade, t, *self._pin_for_tier(job.hashes, t))
        self._release_held(job)  # each tier job holds its own pins now
        if cascade.pending:
            job.phase = _CASCADING
        else:
            self._answer_cascaded(job, True)

    def _cascaded(self, cascade: _Fanout) -> None:
        self._answer_cascaded(cascade.owner, not cascade.failed)

    def _answer_cascaded(self, job: _Job, ok: bool) -> None:
        if job.phase is not _DONE:
            job.phase = _DONE
            self._out.append(Cascaded(job.id, ok))
        self._forget_if_done(job)

    # Loads (docs/job-lifecycle.md#a-load-step-by-step).

    def load(self, block_hashes: object, device_block_ids: object) -> tuple[int, list[Effect]]:
        """Admit a load of blocks into device blocks; returns ``(job id, effects)``.
        Raises as :meth:`store`, except that a hash may repeat (its block lands in each
        device block named for it), and BlockNotFoundError for a hash no tier holds."""
        hashes, ids = self._arguments(block_hashes, device_block_ids)
        sources = self._sources(hashes)  # raises before anything changes
        if self._observing and hashes:  # a later lookup of this request is a new one
            self._note_ran(hashes[-1])
        job = _Job(self._new_id(), True, hashes, ids)
        if not self._plan_load(job, sources):
            retry = partial(self._plan_load, job, None)  # a retry asks the tiers again
            self._wait_for_room(job, len(set(hashes)), retry)
        return job.id, self._take()

    def _plan_load(self, job: _Job, sources: dict[BlockHash, int] | None) -> bool:
        """Start the load; False without room. Raises BlockNotFoundError if a block left
        every tier."""
        manager = self.manager
        hashes = job.hashes
        found = self._sources(hashes) if sources is None else sources
        out = manager.prepare_store(hashes, admission=False) if found else None  # must land
        if found and out is None:
            return False
        self._jobs[job.id] = job
        job.phase = _MOVING
        ready = []
        for h in hashes if len(hashes) == 1 else dict.fromkeys(hashes):
            if h in found:
                continue
            if manager.is_ready(h):
                ready.append(h)
            else:
                self._join(h, job)  # another job's fill
        if ready:
            manager.prepare_load(ready)
            job.pinned = hashes if len(ready) == len(hashes) else ready  # all: the same keys
        # Every block has its slot now, kept until the load has copied it out.
        job.slots = [manager.slot_of(h) for h in hashes]
        if out is None:
            self._promote(job)
            return True
        promotions: dict[int, tuple[list[BlockHash], list[int]]] = {}
        job.promotions = promotions
        fill_owner = self._fill_owner
        self.filling_blocks += len(out.block_hashes_to_store)
        for h, slot in zip(out.block_hashes_to_store, out.store_spec.block_ids, strict=True):
            fill_owner[slot] = job
            self._join(h, job)  # its own fill: it gets its pin when the block lands
            keys, slots = promotions.setdefault(found[h], ([], []))
            keys.append(h)
            slots.append(slot)
        for t, (promoted, _) in promotions.items():
            self.tiers[t].hold(promoted)  # released as the promotion ends
        self._write_back(job, out, self._promote)
        return True

    def _sources(self, hashes: list[BlockHash]) -> dict[BlockHash, int]:
        """The tier to promote each non-resident hash from (BlockNotFoundError if none)."""
        manager = self.manager
        sources: dict[BlockHash, int] = {}
        for h in hashes:
            if h in manager or h in sources:
                continue
            if (tier := self._holder(h)) is None:
                raise BlockNotFoundError(f"cannot load block {h!r} ({h.hex()}): no tier holds it")
            sources[h] = tier
        return sources

    def _promote(self, job: _Job) -> None:
        """Victims written back: read each promoted block from its tier."""
        for t, (keys, slots) in job.promotions.items():
            if self.state is Lifecycle.CLOSED:
                self._promoted(job, None, t=t, keys=keys)
                continue
            op = self._start(job, len(keys), partial(self._promoted, t=t, keys=keys))
            self._out.append(TierLoad(op, t, keys, slots))
        self._settled(job)

    def _promoted(self, job: _Job, outcome: object, *, t: int, keys: list[BlockHash]) -> None:
        self.tiers[t].release(keys)
        failed = self._tier_failed(t, "load", outcome, keys)
        self.counters["promoted_blocks"] += len(keys) - len(failed)
        self._end_fills(job, [k for k in keys if k not in failed], None)
        for k, reason in failed.items():
            self._end_fills(job, [k], reason)

    def _settled(self, job: _Job) -> None:
        """Once no fill (a store's own copy included) is awaited: resolve and cascade a
        store; copy every block of a load that is there to the device."""
        if job.awaiting or job.phase is not _MOVING:
            return
        if not job.is_load:
            self._resolve(job)
            self._cascade(job)
            return
        job.phase = _COPYING_OUT
        slots, ids, failed = job.slots, job.device_ids, job.failed
        if failed:
            kept = [i for i, h in enumerate(job.hashes) if h not in failed]
            slots, ids = [slots[i] for i in kept], [ids[i] for i in kept]
        if not slots:
            self._copied_out(job, None)
        elif self.state is Lifecycle.CLOSED:
            self._copied_out(job, _CLOSED_BEFORE_COPY)
        else:
            op = self._start(job, len(slots), self._on_copied_out)
            self._out.append(CopyToDevice(op, slots, ids, job.id, not failed))

    def _copied_out(self, job: _Job, error: object) -> None:
        job.phase = _DONE
        self._release_held(job)  # the copy has ended: its pins may go
        if error is None:
            copied = sum(1 for h in job.hashes if h not in job.failed)
            self.counters["bytes_to_device"] += copied * self.block_bytes
            self.counters["loaded_blocks"] += copied
        else:
            self._copy_failed(job, job.hashes, "CPU to device", error)
        self._resolve(job)

    def _copy_failed(self, job: _Job, keys: list[BlockHash], what: str, error: object) -> str:
        reason = f"{what} copy failed: {error}"
        self.failures.record(f"{what} copy failed", 1, str(error))
        for h in keys:
            job.fail(h, reason)
        return reason

    # Fills: only the job that reserved a slot (its _fill_owner) ends its fill.

    def _join(self, key: BlockHash, job: _Job) -> None:
        if (waiters := self._fill_waiters.get(key)) is None:
            self._fill_waiters[key] = [job]
        else:
            waiters.append(job)
        job.awaiting += 1

    def _end_fills(self, owner: _Job, keys: list[BlockHash], failure: str | None) -> None:
        """``owner``'s I/O into these slots ended: publish (``failure`` None) or drop the blocks
        it still owns, pinning each for its waiters then (docs/job-lifecycle.md#rules-it-keeps)."""
        manager = self.manager
        slot_of, fill_owner = manager.resident_slot, self._fill_owner
        ended = []
        for k in keys:
            slot = slot_of(k)
            if slot is not None and fill_owner[slot] is owner:
                fill_owner[slot] = None
                ended.append(k)
        if not ended:
            return
        self.filling_blocks -= len(ended)
        manager.complete_store(ended, success=failure is None)
        woken: list[_Job] = []
        for k in ended:
            for waiter in self._fill_waiters.pop(k, ()):
                waiter.awaiting -= 1
                if failure is not None:
                    waiter.fail(k, failure)
                elif waiter.is_load or self._cascading():
                    self._hold(waiter, [k])  # in the step that makes it ready: no eviction
                if not waiter.awaiting:
                    woken.append(waiter)
        for waiter in woken:
            self._settled(waiter)

    # Tier stores: cascades, write-backs and flushes.

    def _write_back(self, job: _Job, out: PrepareStoreOutput, then: Callable[[_Job], None]) -> None:
        """Count ``out``'s victims; under write-back store them to every tier lacking them
        (docs/job-lifecycle.md#write-policies), then call ``then(job)``; at once if none."""
        victims, slots = out.block_hashes_evicted, out.evicted_block_ids
        self.counters["evicted_blocks"] += len(victims)
        if not (victims and self.write_back and self.tiers) or self.state is Lifecycle.CLOSED:
            then(job)
            return
        writing = self._writing_back

        def written(fanout: _Fanout) -> None:
            writing.subtract(victims)
            for k in victims:
                if writing[k] <= 0:
                    del writing[k]
            # Failed in every tier (one that held it was not asked); a hard close has
            # counted those it found still being written.
            lost = fanout.failed_in(len(self.tiers))
            for k in self._close_lost.intersection(lost):
                del lost[k]
            if lost:
                self._lose(lost, "evicted block lost: no tier took its write-back")
            then(job)

        fanout = _Fanout(job, written, "written_back_blocks", False)  # the job owns the slots
        slot_of = dict(zip(victims, slots, strict=True))
        if self._unobserved:
            self.observe_requests()
        for t, tier in enumerate(self.tiers):
            look = tier.lookup
            lacking = [k for k in victims if look(k) is not True]
            if lacking:
                lacking = self.gates[t].admit(lacking)
            self._tier_store(fanout, t, lacking, [slot_of[k] for k in lacking])
        if fanout.pending:
            writing.update(victims)
        else:
            then(job)

    def _pin_for_tier(
        self, keys: Iterable[BlockHash], t: int, *, flush: bool = False
    ) -> tuple[list[BlockHash], list[int]]:
        """Pin the ready CPU blocks of ``keys`` that tier ``t`` lacks and admits, with
        those of its backlog it writes now (all of ``keys``' for a ``flush``, which its
        budget pays for); their keys and slots."""
        is_ready = self.manager.is_ready
        ready = [h for h in dict.fromkeys(keys) if is_ready(h)]
        look = self.tiers[t].lookup
        chosen = [h for h in ready if look(h) is not True]
        if self._unobserved:
            self.observe_requests()
        gate = self.gates[t]
        if flush:
            gate.flushed(len(chosen))
        elif chosen or gate.backlog:
            chosen = gate.admit(chosen, lambda h: is_ready(h) and look(h) is not True)
        return chosen, self.manager.prepare_load(chosen).block_ids

    def _tier_store(self, fanout: _Fanout, t: int, keys: list[BlockHash], slots: list[int]) -> None:
        """Submit one store of ``keys`` (if any) from CPU ``slots`` to tier ``t`` for ``fanout``.
        When it ends: unpin, count, record events, report the keys that failed."""
        if not keys:
            return

        def ended(_owner: object, outcome: object) -> None:
            if fanout.pinned:
                self.manager.complete_load(keys)
            failed = self._tier_failed(t, "store", outcome, keys)
            landed = [k for k in keys if k not in failed]
            self.counters[fanout.counter] += len(landed)
            if landed and self.enable_events:
                # Removals first, then the stored keys the tier still holds, so a router
                # that applies events in order ends up with what the tier holds.
                if self._take_removed:
                    self._removal_event(t)
                look = self.tiers[t].lookup
                if held := [k for k in landed if look(k) is not False]:
                    self._tier_event(t, held, False)
            fanout.part_done(failed)

        fanout.pending += 1
        op = self._start(fanout.owner, len(keys), ended)
        self._out.append(TierStore(op, t, keys, slots))

    def flush(self) -> tuple[int, list[Effect]]:
        """Copy every ready CPU block to each secondary tier that lacks it; returns
        ``(flush id, effects)``, and a :class:`FlushDone` follows. Raises ClosedError
        unless open."""
        self._check_open()
        return self._start_flush().id, self._take()

    def _start_flush(self, closing: bool = False) -> _Flush:
        flush = _Flush(self._new_id(), self._flush_done, closing)
        self._flushes[flush.id] = flush
        ready = self.manager.ready_hashes()
        for t in range(len(self.tiers)):
            keys, slots = self._pin_for_tier(ready, t, flush=True)
            for i in range(0, len(keys), FLUSH_BATCH):
                self._tier_store(flush, t, keys[i : i + FLUSH_BATCH], slots[i : i + FLUSH_BATCH])
        if flush.pending == 0:
            self._flush_done(flush)
        return flush

    def _flush_done(self, flush: _Flush) -> None:
        del self._flushes[flush.id]
        if flush.closing and flush.failed:  # failed in every tier: each lacked it
            self._lose_at_close(flush.failed, flush.failed_in(len(self.tiers)))
        if not flush.internal:
            self._out.append(FlushDone(flush.id, not flush.failed))

    # Close (docs/job-lifecycle.md#close).

    def begin_close(self) -> list[Effect]:
        """Graceful close: admit nothing more; :class:`Drained` follows once all work has ended
        (docs/job-lifecycle.md#close: under write-back, a final flush too). Idempotent."""
        if self.state is Lifecycle.OPEN:
            self.state = Lifecycle.CLOSING
            self._close_id = self._new_id()
            self._check_drained()
        return self._take()

    def hard_close(self) -> list[Effect]:
        """Resolve every job and flush now as failed and start no new I/O; pins and fills go
        only as the I/O in flight reports back, then :class:`Drained`. Idempotent."""
        if self.state is Lifecycle.CLOSED:
            return self._take()
        self.state = Lifecycle.CLOSED
        if self._close_id is None:
            self._close_id = self._new_id()
        if self.write_back and self.tiers and not self._drained:
            self._lose_unwritten()
        waiting, self._waiting = self._waiting, {}
        for job in [*(job for job, _ in waiting.values()), *self._jobs.values()]:
            self._fail(job, "engine closed", "the engine closed before the job finished")
        for flush in self._flushes.values():
            if not flush.internal:
                self._out.append(FlushDone(flush.id, False))
                flush.internal = True  # its one answer is given
        self._check_drained()
        return self._take()

    def _check_drained(self) -> None:
        if self._drained or self.state is Lifecycle.OPEN:
            return
        if self.state is Lifecycle.CLOSING:
            if self._jobs or self._waiting or self._flushes:
                return
            if self.write_back and self.tiers and not self._close_flushed:
                self._close_flushed = True
                if self._start_flush(closing=True).pending:
                    return
        elif self._op_owner:
            return
        self._drained = True
        self._out.append(Drained())

    def close_result(self) -> JobResult:
        """The close's write-back as a :class:`JobResult` of its own id (docs/job-lifecycle.md,
        what the close lost); final once :class:`Drained` was said or :meth:`hard_close`
        called, a success before."""
        job_id = self._close_id or 0  # ids start at 1
        if not (failed := self._close_failed):
            return JobResult(job_id, True)
        return JobResult(job_id, False, tuple(failed), _summary(tuple(failed), failed))

    def _lose_at_close(self, failed: Mapping[BlockHash, str], lost: Iterable[BlockHash]) -> None:
        """The close did not write ``failed`` back everywhere; ``lost`` are in no tier."""
        for k, reason in failed.items():
            self._close_failed.setdefault(k, reason)
        if new := {k: failed[k] for k in lost if k not in self._close_lost}:
            self._close_lost.update(new)
            self._lose(new, "block lost at close: no tier took its write-back")

    def _lose_unwritten(self) -> None:
        """A hard close under write-back: every ready or being-written-back block that
        some tier lacks was not written back; held by none, it is lost."""
        held_by = {
            h: sum(tier.lookup(h) is True for tier in self.tiers)
            for h in dict.fromkeys((*self.manager.ready_hashes(), *self._writing_back))
        }
        reason = "the engine stopped before it was written back"
        unwritten = {h: reason for h, n in held_by.items() if n < len(self.tiers)}
        self._lose_at_close(unwritten, [h for h, n in held_by.items() if n == 0])

    def _lose(self, lost: Mapping[BlockHash, str], cause: str) -> None:
        self.counters["lost_blocks"] += len(lost)
        self.failures.record(cause, len(lost), next(iter(lost.values())))

    # Completions.

    def copy_done(self, op: int, error: object = None) -> list[Effect]:
        """A copy effect ended; ``error`` is None on success, else why it failed.
        Raises InvalidArgumentError if ``op`` is not an effect in flight."""
        self._end_op(op, error)
        return self._take()

    def tier_done(self, op: int, outcome: TierOutcome | None) -> list[Effect]:
        """A tier effect ended: ``outcome.failed`` names the keys that did not land, with
        reasons (``None``: none landed); as :meth:`copy_done`."""
        self._end_op(op, outcome)
        return self._take()

    def room_expired(self, job_id: int) -> list[Effect]:
        """A waiting job's room timeout passed: it fails if it is still waiting."""
        if (entry := self._waiting.pop(job_id, None)) is not None:
            seconds = f"{self.room_timeout:g}"
            self._fail(entry[0], "no CPU room", f"no CPU slot freed up within {seconds} s")
            self._retry_waiting()
            self._check_drained()
        return self._take()

    def _end_op(self, op: int, result: object) -> None:
        if (owner := self._op_owner.pop(op, None)) is None:
            raise InvalidArgumentError(f"no effect {op!r} is in flight")
        on_end = self._op_end.pop(op)
        self.blocks_in_flight -= self._op_blocks.pop(op)
        if type(owner) is _Job:
            owner.io -= 1
            on_end(owner, result)
            self._forget_if_done(owner)
        else:
            on_end(owner, result)
        if self._waiting:
            self._retry_waiting()
        if self.state is not Lifecycle.OPEN:
            self._check_drained()

    def _start(self, owner: Any, blocks: int, on_end: Callable[[Any, object], None]) -> int:
        """Register an I/O effect of ``owner`` (a job or a flush); returns its op."""
        op = self._new_id()
        self.blocks_in_flight += blocks
        if type(owner) is _Job:
            owner.io += 1
        self._op_owner[op] = owner
        self._op_blocks[op] = blocks
        self._op_end[op] = on_end
        return op

    def _tier_failed(
        self, t: int, kind: str, outcome: object, keys: list[BlockHash]
    ) -> dict[BlockHash, str]:
        """The keys of tier ``t``'s ``kind`` job that did not land (all for ``None``),
        recorded as failures."""
        if outcome is None:
            what = "promotion" if kind == "load" else "tier store"
            failed = dict.fromkeys(keys, f"the engine closed before the {what}")
        else:
            assert isinstance(outcome, TierOutcome)
            if outcome.ok:
                return {}
            failed = {k: outcome.failed[k] for k in keys if k in outcome.failed}
        if failed:
            cause = f"{self.tiers[t].name} tier {kind} failed"
            self.failures.record(cause, len(failed), next(iter(failed.values())))
        return failed

    def _forget_if_done(self, job: _Job) -> None:
        if job.resolved and job.io == 0 and (job.is_load or job.phase is _DONE):
            self._jobs.pop(job.id, None)

    def _resolve(self, job: _Job) -> None:
        if job.resolved:
            return
        job.resolved = True
        result = JobResult(job.id, True)
        if job.failed and (keys := tuple(dict.fromkeys(h for h in job.hashes if h in job.failed))):
            self.counters["failed_jobs"] += 1
            result = JobResult(job.id, False, keys, _summary(keys, job.failed))
        self._out.append(Resolve(job.id, result))
        self._forget_if_done(job)

    def _fail(self, job: _Job, cause: str, reason: str) -> None:
        """Resolve ``job`` now with every key failed; its I/O in flight keeps its pins and fills."""
        if not job.resolved:
            self.failures.record(cause, 1, reason.removeprefix(f"{cause}: "))
            for h in job.hashes:
                job.fail(h, reason)
            self._resolve(job)
        if not job.is_load:
            self._release_held(job)  # a store's holds guard no I/O: they may go now
            self._answer_cascaded(job, False)

    def _wait_for_room(self, job: _Job, needed: int, plan: Callable[[], bool]) -> None:
        if needed > self.manager.num_blocks:
            kind = "load" if job.is_load else "store"
            room = self.manager.num_blocks
            reason = f"the {kind} needs {needed} CPU slots at once; the CPU tier has {room}"
            self._fail(job, "job larger than the CPU tier", reason)
            return
        self._waiting[job.id] = (job, plan)
        self._out.append(WaitForRoom(job.id, self.room_timeout))

    def _retry_waiting(self) -> None:
        # Oldest first, while they fit: later ones wait their turn.
        while self._waiting and self.state is not Lifecycle.CLOSED:
            job, plan = next(iter(self._waiting.values()))
            try:
                started = plan()
            except BlockNotFoundError as exc:  # its block left every tier meanwhile
                del self._waiting[job.id]
                self._fail(job, LEFT_EVERY_TIER, f"{LEFT_EVERY_TIER}: {exc}")
                continue
            if not started:
                return
            del self._waiting[job.id]

    def _holder(self, h: BlockHash) -> int | None:
        for t in self._servable:
            if self.tiers[t].lookup(h) is True:
                return t
        return None

    def _arguments(
        self, block_hashes: object, device_block_ids: object
    ) -> tuple[list[BlockHash], list[int]]:
        self._check_open()
        hashes = hash_list("block_hashes", block_hashes)
        ids = device_id_list("device_block_ids", device_block_ids, self.num_device_blocks)
        if len(ids) != len(hashes):
            raise InvalidArgumentError(
                f"block_hashes has {len(hashes)} hashes but device_block_ids has {len(ids)} ids"
            )
        return hashes, ids

    def _check_open(self) -> None:
        if self.state is not Lifecycle.OPEN:
            raise ClosedError(f"the engine is {self.state}; no new jobs are accepted")

    def _new_id(self) -> int:
        self._next_id += 1
        return self._next_id

    def _take(self) -> list[Effect]:
        out, self._out = self._out, []
        return out


def _summary(keys: Sequence[BlockHash], failed: Mapping[BlockHash, str]) -> str:
    """``<n> block(s) failed: <reason> (<count>); …``, the three most common reasons."""
    reasons = Counter(failed[k] for k in keys)
    summary = "; ".join(f"{r} ({n})" for r, n in reasons.most_common(3))
    return f"{len(keys)} block(s) failed: {summary}"
