"""A hypothesis state machine over JobCore: random calls and completions against a model.

The model world carries out the core's effects the way real I/O would, adversarially
late: a copy or a tier store reads its source slot when it *completes*, a load writes
its slot when it completes, and a failed copy or a corrupt block leaves garbage behind.
Every slot holds a tag naming whose bytes it holds, so serving another block's bytes
shows up as a wrong tag on the device.

Checked after every step:

* every slot an effect in flight reads is pinned or being filled, and every slot it
  writes is being filled by that very block (pins follow I/O; a fill is ended only by
  its owner; no slot has two owners);
* every key a load reports as landed holds exactly its own bytes on the device;
* a load issued right after ``lookup`` reported its blocks succeeds unless a fault was
  injected or it had to wait for CPU room or the engine closed;
* after a graceful close of a fault-free run, the durable tier holds every block whose
  store succeeded;
* once everything has drained: one result per job, one cascaded answer per store, one
  answer per flush, no pin, no fill, no tier hold left.
"""

from __future__ import annotations

import os
from collections import Counter, OrderedDict

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from tiering.core.cpu_tier import CPUOffloadingManager
from tiering.core.job_core import (
    Cascaded,
    CopyToDevice,
    CopyToHost,
    Drained,
    FlushDone,
    JobCore,
    Resolve,
    TierLoad,
    TierStore,
    WaitForRoom,
)
from tiering.lifecycle import Lifecycle
from tiering.tiers.client import TierOutcome

KEYS = [bytes([i]) * 4 for i in range(5)]
DEVICE_BLOCKS = 12
GARBAGE = b"garbage"


def outcome(keys: list[bytes], failed: dict[bytes, str]) -> TierOutcome:
    return TierOutcome(tuple(k for k in keys if k not in failed), failed)


class ModelTier:
    """A secondary tier as the core sees it, holding tags; honours holds when evicting."""

    def __init__(self, name: str, capacity: int | None, servable: bool = True) -> None:
        self.name = name
        self.servable = servable
        self.capacity = capacity
        self.data: OrderedDict[bytes, bytes] = OrderedDict()
        self.holds: Counter[bytes] = Counter()
        self.storing: Counter[bytes] = Counter()

    def lookup(self, key: bytes) -> bool | None:
        if key in self.data:
            return True
        return None if self.storing[key] else False

    def hold(self, keys) -> None:
        self.holds.update(keys)

    def release(self, keys) -> None:
        for key in keys:
            assert self.holds[key] > 0, f"release of {key!r}, which is not held"
            self.holds[key] -= 1
            if not self.holds[key]:
                del self.holds[key]

    def store(self, keys: list[bytes], tags: list[bytes]) -> dict[bytes, str]:
        failed: dict[bytes, str] = {}
        for key, tag in zip(keys, tags, strict=True):
            if key in self.data:
                continue
            if self.capacity is not None and len(self.data) >= self.capacity:
                victim = next((k for k in self.data if not self.holds[k] and k not in keys), None)
                if victim is None:
                    failed[key] = "tier full"
                    continue
                del self.data[victim]
            self.data[key] = tag
        return failed


class JobCoreMachine(RuleBasedStateMachine):
    @initialize(
        write_policy=st.sampled_from(["write_through", "write_back"]),
        cpu_blocks=st.sampled_from([2, 2, 3, 4]),  # small tiers evict most
        tiers=st.sampled_from(["durable", "small+durable", "small", "small"]),
        faults=st.sampled_from([False, False, True]),
        policy=st.sampled_from(["lru", "arc", "s3fifo"]),
    )
    def setup(self, write_policy, cpu_blocks, tiers, faults, policy) -> None:
        self.durable = ModelTier("durable", None) if "durable" in tiers else None
        small = [ModelTier("small", 2)] if "small" in tiers else []
        self.tiers = small + ([self.durable] if self.durable else [])
        self.manager = CPUOffloadingManager(cpu_blocks, policy=policy)
        self.core = JobCore(
            self.manager,
            self.tiers,
            num_device_blocks=DEVICE_BLOCKS,
            block_bytes=1,
            write_policy=write_policy,
            room_timeout=1.0,
        )
        self.faults_allowed = faults
        self.faulted = False  # a fault was injected (or the engine closed) at some point
        self.device: dict[int, bytes] = {}
        self.slots: dict[int, bytes] = {}
        self.pending: dict[int, object] = {}  # op -> effect in flight
        self.busy_devices: dict[int, int] = {}  # device id -> job using it
        self.jobs: dict[int, tuple[str, list[bytes], list[int]]] = {}
        self.results: Counter[int] = Counter()
        self.cascaded: Counter[int] = Counter()
        self.flushes: set[int] = set()
        self.flush_answers: Counter[int] = Counter()
        self.entitled: set[int] = set()  # loads that must succeed if nothing goes wrong
        self.waited: set[int] = set()
        self.waiting: set[int] = set()
        self.stored_ok: set[bytes] = set()
        self.graceful = False
        self.drained = False

    # ------------------------------------------------------------ effects

    def apply(self, effects) -> None:
        for effect in effects:
            if isinstance(effect, CopyToHost | CopyToDevice):
                self.pending[effect.op] = effect
            elif isinstance(effect, TierStore):
                self.pending[effect.op] = effect
                self.tiers[effect.tier].storing.update(effect.keys)
            elif isinstance(effect, TierLoad):
                self.pending[effect.op] = effect
            elif isinstance(effect, Resolve):
                self.on_result(effect.job, effect.result)
            elif isinstance(effect, Cascaded):
                self.cascaded[effect.job] += 1
            elif isinstance(effect, FlushDone):
                self.flush_answers[effect.flush] += 1
            elif isinstance(effect, WaitForRoom):
                self.waited.add(effect.job)
                self.waiting.add(effect.job)
            elif isinstance(effect, Drained):
                self.on_drained()
            else:  # pragma: no cover - a new effect type must be modelled
                raise AssertionError(f"unknown effect {effect!r}")

    def on_result(self, job_id: int, result) -> None:
        self.results[job_id] += 1
        self.waiting.discard(job_id)
        kind, keys, ids = self.jobs[job_id]
        for d in ids:
            self.busy_devices.pop(d, None)
        if kind == "store":
            if result.success:
                self.stored_ok.update(keys)
            return
        for key, d in zip(keys, ids, strict=True):
            if key not in result.failed_keys:
                assert self.device[d] == key, f"load {job_id} served {self.device[d]!r} as {key!r}"
        if (
            job_id in self.entitled
            and job_id not in self.waited
            and not self.faulted
            and self.core.state is Lifecycle.OPEN
        ):
            assert result.success, f"load {job_id} of looked-up blocks failed: {result.error}"

    def on_drained(self) -> None:
        self.drained = True
        if self.graceful and not self.faulted and self.durable is not None:
            missing = [k for k in self.stored_ok if k not in self.durable.data]
            assert not missing, f"graceful close lost {missing}"
            for key in self.stored_ok:
                assert self.durable.data[key] == key, f"durable tier holds wrong bytes for {key!r}"

    def free_devices(self, n: int) -> list[int] | None:
        free = [d for d in range(DEVICE_BLOCKS) if d not in self.busy_devices]
        return free[:n] if len(free) >= n else None

    # ------------------------------------------------------------ calls

    @precondition(lambda self: self.core.state is Lifecycle.OPEN)
    @rule(picks=st.lists(st.sampled_from(KEYS), min_size=1, max_size=3, unique=True))
    def store(self, picks) -> None:
        ids = self.free_devices(len(picks))
        if ids is None:
            return
        for key, d in zip(picks, ids, strict=True):
            self.device[d] = key
        job_id, effects = self.core.store(picks, ids)
        self.jobs[job_id] = ("store", [k for k in dict.fromkeys(picks)], [])
        for d in ids:
            self.busy_devices[d] = job_id
        self.jobs[job_id] = ("store", list(dict.fromkeys(picks)), ids)
        self.apply(effects)

    @precondition(lambda self: self.core.state is Lifecycle.OPEN and not self.pending)
    @rule(order=st.permutations(KEYS))
    def store_each_and_settle(self, order) -> None:
        """Fill every tier: each key stored on its own, everything completed. Gets the
        search to full CPU and full secondary tiers (where eviction rules bite) fast."""
        for key in order:
            self.store([key])
            self.settle()

    @precondition(lambda self: self.core.state is Lifecycle.OPEN)
    @rule(picks=st.lists(st.sampled_from(KEYS), min_size=2, max_size=3, unique=True))
    def stores_that_share_a_block(self, picks) -> None:
        """One store of a block, then another of it and more: the second joins the
        first's fill (the interleavings of joined fills are where ownership bites)."""
        self.store(picks[:1])
        self.store(picks)

    @precondition(lambda self: self.core.state is Lifecycle.OPEN)
    @rule(picks=st.lists(st.sampled_from(KEYS), min_size=1, max_size=3))
    def lookup_then_load(self, picks) -> None:
        n = self.core.lookup(picks)
        keys = picks[:n]
        ids = self.free_devices(len(keys))
        if not keys or ids is None:
            return
        for d in ids:
            self.device[d] = GARBAGE
        job_id, effects = self.core.load(keys, ids)
        self.jobs[job_id] = ("load", keys, ids)
        for d in ids:
            self.busy_devices[d] = job_id
        if not self.faulted and len(set(keys)) <= self.manager.num_blocks:
            self.entitled.add(job_id)
        self.apply(effects)

    @precondition(lambda self: self.core.state is Lifecycle.OPEN)
    @rule()
    def flush(self) -> None:
        flush_id, effects = self.core.flush()
        self.flushes.add(flush_id)
        self.apply(effects)

    @precondition(lambda self: self.core.state is Lifecycle.OPEN)
    @rule()
    def close_gracefully(self) -> None:
        self.graceful = True
        self.apply(self.core.begin_close())

    @precondition(lambda self: self.core.state is not Lifecycle.CLOSED)
    @rule()
    def close_hard(self) -> None:
        self.faulted = True  # jobs may fail now; nothing is lost that was promised
        self.graceful = False
        self.apply(self.core.hard_close())

    @precondition(lambda self: bool(self.waiting))
    @rule(data=st.data())
    def room_timer_fires(self, data) -> None:
        job_id = data.draw(st.sampled_from(sorted(self.waiting)))
        self.waiting.discard(job_id)
        self.apply(self.core.room_expired(job_id))

    @rule(picks=st.lists(st.sampled_from(KEYS), max_size=3))
    def lookup_is_a_prefix_of_held_blocks(self, picks) -> None:
        n = self.core.lookup(picks)
        for key in picks[:n]:
            assert self.manager.is_ready(key) or any(t.lookup(key) is True for t in self.tiers)

    # ------------------------------------------------------------ completions

    @precondition(lambda self: bool(self.pending))
    @rule()
    def settle(self) -> None:
        """Every effect in flight (and those they start) completes, oldest first."""
        for _ in range(200):
            if not self.pending:
                return
            self.finish(min(self.pending), "none")

    @precondition(lambda self: bool(self.pending))
    @rule(data=st.data())
    def complete(self, data) -> None:
        ops = sorted(self.pending)
        # Newest first as often as any: completions out of order are where races live.
        op = data.draw(st.one_of(st.just(ops[-1]), st.sampled_from(ops)))
        fault = self.faults_allowed and data.draw(
            st.sampled_from(["none", "none", "none", "fail", "partial", "corrupt"])
        )
        self.finish(op, fault or "none")

    def finish(self, op: int, fault: str) -> None:
        effect = self.pending.pop(op)
        copy_error = None if fault == "none" else "injected copy failure"
        if fault != "none":
            self.faulted = True
        if isinstance(effect, CopyToHost):
            for d, s in zip(effect.device_ids, effect.slots, strict=True):
                self.slots[s] = GARBAGE if fault != "none" else self.device[d]
            self.apply(self.core.copy_done(op, copy_error))
        elif isinstance(effect, CopyToDevice):
            for s, d in zip(effect.slots, effect.device_ids, strict=True):
                self.device[d] = GARBAGE if fault != "none" else self.slots.get(s, GARBAGE)
            self.apply(self.core.copy_done(op, copy_error))
        elif isinstance(effect, TierStore):
            tier = self.tiers[effect.tier]
            tier.storing.subtract(effect.keys)
            keys, tags = effect.keys, [self.slots.get(s, GARBAGE) for s in effect.slots]
            if fault == "fail":
                self.apply(self.core.tier_done(op, None))
                return
            cut = len(keys) // 2 if fault in ("partial", "corrupt") else len(keys)
            failed = tier.store(keys[:cut], tags[:cut])
            failed.update(dict.fromkeys(keys[cut:], "injected store failure"))
            self.apply(self.core.tier_done(op, outcome(keys, failed)))
        elif isinstance(effect, TierLoad):
            tier = self.tiers[effect.tier]
            failed: dict[bytes, str] = {}
            for i, (key, s) in enumerate(zip(effect.keys, effect.slots, strict=True)):
                if fault == "fail" or (fault == "partial" and i == 0):
                    failed[key] = "injected read error"
                    self.slots[s] = GARBAGE
                elif fault == "corrupt" and i == 0:
                    failed[key] = "checksum mismatch"
                    tier.data.pop(key, None)
                    self.slots[s] = GARBAGE
                elif key in tier.data:
                    self.slots[s] = tier.data[key]
                else:
                    failed[key] = "not in the tier"
            self.apply(self.core.tier_done(op, outcome(effect.keys, failed)))

    # ------------------------------------------------------------ invariants

    def slot_owners(self) -> dict[int, tuple[bytes, object]]:
        owners: dict[int, tuple[bytes, object]] = {}
        for key in KEYS:
            state = self.manager.block_state(key)
            if state is not None:
                assert state.slot not in owners, f"slot {state.slot} has two owners"
                owners[state.slot] = (key, state)
        return owners

    @invariant()
    def io_in_flight_is_protected(self) -> None:
        if not hasattr(self, "core"):
            return
        owners = self.slot_owners()
        for effect in self.pending.values():
            if isinstance(effect, CopyToHost | TierLoad):  # writes: the slot's own fill
                keys = effect.keys if isinstance(effect, TierLoad) else None
                for i, s in enumerate(effect.slots):
                    assert s in owners, f"{effect} writes slot {s}, which no block owns"
                    key, state = owners[s]
                    assert not state.ready, f"{effect} writes slot {s} of ready block {key!r}"
                    if keys is not None:
                        assert key == keys[i], f"{effect} writes {keys[i]!r} into {key!r}'s slot"
            elif isinstance(effect, CopyToDevice | TierStore):  # reads: pinned or filling
                for s in effect.slots:
                    assert s in owners, f"{effect} reads slot {s}, which was freed"
                    key, state = owners[s]
                    assert state.ref_count > 0 or not state.ready, (
                        f"{effect} reads slot {s} of {key!r}, neither pinned nor filling"
                    )

    @invariant()
    def nothing_stored_is_lost(self) -> None:
        """Fault-free, every block whose store succeeded is ready in CPU, in the durable
        tier, or in a store to it that is still in flight."""
        if not hasattr(self, "core") or self.faulted or self.durable is None:
            return
        durable = self.tiers.index(self.durable)
        in_flight = {
            key
            for effect in self.pending.values()
            if isinstance(effect, TierStore) and effect.tier == durable
            for key in effect.keys
        }
        for key in self.stored_ok:
            assert self.manager.is_ready(key) or key in self.durable.data or key in in_flight, (
                f"block {key!r} was stored and is now nowhere"
            )

    def teardown(self) -> None:
        if not hasattr(self, "core"):
            return
        for _ in range(500):  # finish everything without faults
            if self.pending:
                self.finish(min(self.pending), "none")
            elif self.waiting:
                job_id = min(self.waiting)
                self.waiting.discard(job_id)
                self.apply(self.core.room_expired(job_id))
            else:
                break
        assert not self.pending and not self.waiting
        assert all(self.results[j] == 1 for j in self.jobs), "a job has no or two results"
        stores = [j for j, (kind, _, _) in self.jobs.items() if kind == "store"]
        assert all(self.cascaded[j] == 1 for j in stores), "a store lacks its cascaded answer"
        assert all(self.flush_answers[f] == 1 for f in self.flushes)
        assert self.core.jobs_in_flight == 0 and self.core.blocks_in_flight == 0
        assert self.core.filling_blocks == 0
        assert self.manager.num_pinned == 0
        assert len(self.manager.ready_hashes()) == len(self.manager)
        assert all(not tier.holds for tier in self.tiers), "a tier hold was never released"
        if self.core.state is not Lifecycle.OPEN:
            assert self.drained, "a close never drained"


JobCoreMachine.TestCase.settings = settings(
    # KVT_MODEL_EXAMPLES=5000 for a long run; CI keeps it to a few seconds.
    max_examples=int(os.environ.get("KVT_MODEL_EXAMPLES", "1000")),
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestJobCoreModel = JobCoreMachine.TestCase
