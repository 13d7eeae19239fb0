"""JobCore, one behaviour per test, driven by hand: calls in, effects out, no loop."""

from __future__ import annotations

from collections import Counter

import pytest

from tiering.core.cpu_tier import CPUOffloadingManager
from tiering.core.job_core import (
    LEFT_EVERY_TIER,
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
from tiering.errors import BlockNotFoundError, ClosedError, InvalidArgumentError
from tiering.tiers.client import TierOutcome


def h(i: int) -> bytes:
    return i.to_bytes(4, "big")


class Tier:
    """A tier's index as the core sees it: keys, a capacity, holds that stop eviction."""

    def __init__(self, capacity: int | None = None, name: str = "memory") -> None:
        self.name = name
        self.servable = True
        self.capacity = capacity
        self.keys: list[bytes] = []  # oldest first
        self.holds: Counter[bytes] = Counter()

    def lookup(self, key: bytes) -> bool:
        return key in self.keys

    def hold(self, keys: list[bytes]) -> None:
        self.holds.update(keys)

    def release(self, keys: list[bytes]) -> None:
        self.holds.subtract(keys)
        self.holds += Counter()  # drop zeros

    def store(self, keys: list[bytes]) -> dict[bytes, str]:
        failed = {}
        for key in keys:
            if key in self.keys:
                continue
            if self.capacity is not None and len(self.keys) >= self.capacity:
                victim = next((k for k in self.keys if not self.holds[k]), None)
                if victim is None:
                    failed[key] = "tier full"
                    continue
                self.keys.remove(victim)
            self.keys.append(key)
        return failed


def core(blocks: int = 4, tiers: tuple[Tier, ...] = (), policy: str = "write_through") -> JobCore:
    return JobCore(
        CPUOffloadingManager(blocks),
        list(tiers),
        num_device_blocks=16,
        block_bytes=1,
        write_policy=policy,
    )


def of(kind: type, effects: list) -> list:
    return [e for e in effects if isinstance(e, kind)]


def ok(keys: list[bytes]) -> TierOutcome:
    return TierOutcome(tuple(keys))


def finish_tier_stores(c: JobCore, tiers: list[Tier], effects: list) -> list:
    """Complete every TierStore in ``effects`` (and those they start) successfully."""
    out = []
    todo = list(effects)
    while todo:
        effect = todo.pop(0)
        out.append(effect)
        if isinstance(effect, TierStore):
            failed = tiers[effect.tier].store(effect.keys)
            landed = tuple(k for k in effect.keys if k not in failed)
            todo += c.tier_done(effect.op, TierOutcome(landed, failed))
        elif isinstance(effect, CopyToHost | CopyToDevice):
            todo += c.copy_done(effect.op)
    return out


def stored(c: JobCore, keys: list[bytes], tiers: list[Tier] = ()) -> list:
    """Store ``keys`` and complete everything it starts; all effects seen."""
    _, effects = c.store(keys, list(range(len(keys))))
    return finish_tier_stores(c, list(tiers), effects)


def test_a_store_copies_then_resolves_then_cascades() -> None:
    tier = Tier()
    c = core(tiers=(tier,))
    job, effects = c.store([h(1), h(2)], [3, 4])
    (copy,) = effects
    assert isinstance(copy, CopyToHost) and copy.device_ids == [3, 4]
    effects = c.copy_done(copy.op)
    assert isinstance(effects[0], Resolve) and effects[0].result.success
    (cascade,) = of(TierStore, effects)
    assert c.manager.num_pinned == 2  # the tier reads the slots: pinned until it ends
    assert c.tier_done(cascade.op, ok(cascade.keys)) == [Cascaded(job, True)]
    assert c.manager.num_pinned == 0 and c.jobs_in_flight == 0


def test_a_second_store_of_a_block_being_filled_joins_that_fill() -> None:
    c = core()
    first, (copy,) = c.store([h(1)], [0])
    second, effects = c.store([h(1)], [1])
    assert effects == []  # nothing to copy, and no success before the block exists
    effects = c.copy_done(copy.op, "device lost")
    results = {e.job: e.result for e in of(Resolve, effects)}
    assert not results[first].success and not results[second].success
    assert results[second].failed_keys == (h(1),)


def test_a_load_waits_for_a_fill_and_is_pinned_in_the_step_it_lands() -> None:
    c = core()
    _, (copy,) = c.store([h(1)], [0])
    load, effects = c.load([h(1)], [5])
    assert effects == []
    effects = c.copy_done(copy.op)
    (to_device,) = of(CopyToDevice, effects)
    assert c.manager.block_state(h(1)).ref_count == 1
    (result,) = of(Resolve, c.copy_done(to_device.op))
    assert result.job == load and result.result.success
    assert c.manager.num_pinned == 0


def test_a_failed_promotion_does_not_touch_a_later_fill_of_the_same_block() -> None:
    tier = Tier()
    c = core(blocks=1, tiers=(tier,))
    stored(c, [h(1)], [tier])
    stored(c, [h(2)], [tier])  # h1 leaves the CPU tier; the tier keeps it
    _, effects = c.load([h(1)], [5])
    (promotion,) = of(TierLoad, effects)
    effects = c.tier_done(promotion.op, TierOutcome((), {h(1): "checksum mismatch"}))
    assert not of(Resolve, effects)[0].result.success
    # A new store of h1 gets a new fill; nothing of the old promotion can end it.
    _, (copy,) = c.store([h(1)], [7])
    assert c.filling_blocks == 1
    (result,) = of(Resolve, c.copy_done(copy.op))
    assert result.result.success and c.manager.is_ready(h(1))


def test_a_promoted_block_is_held_in_its_tier_until_the_promotion_ends() -> None:
    # Write-back, CPU of 2, a tier full at 2: the victim's write-back needs room in the
    # very tier the load reads from, and must not take the block being loaded.
    tier = Tier(capacity=2)
    c = core(blocks=2, tiers=(tier,), policy="write_back")
    stored(c, [h(1), h(2)], [tier])
    stored(c, [h(3), h(4)], [tier])  # h1, h2 written back: the tier is full
    assert c.lookup([h(1)]) == 1
    _, effects = c.load([h(1)], [10])
    (write_back,) = of(TierStore, effects)
    assert tier.holds[h(1)] == 1
    failed = tier.store(write_back.keys)
    effects = c.tier_done(write_back.op, TierOutcome((), failed) if failed else ok(write_back.keys))
    (promotion,) = of(TierLoad, effects)
    assert promotion.keys == [h(1)] and h(1) in tier.keys  # h2 was evicted instead
    effects = c.tier_done(promotion.op, ok([h(1)]))
    assert not tier.holds
    (to_device,) = of(CopyToDevice, effects)
    assert of(Resolve, c.copy_done(to_device.op))[0].result.success


def test_write_back_writes_the_victim_before_refilling_its_slot() -> None:
    tier = Tier()
    c = core(blocks=1, tiers=(tier,), policy="write_back")
    stored(c, [h(1)])
    slot = c.manager.slot_of(h(1))
    _, effects = c.store([h(2)], [1])
    (write_back,) = effects
    assert isinstance(write_back, TierStore) and write_back.slots == [slot]
    (copy,) = c.tier_done(write_back.op, ok([h(1)]))
    assert isinstance(copy, CopyToHost) and copy.slots == [slot]


def test_cancelled_waiting_does_not_release_a_flush_before_its_tier_job_ends() -> None:
    tier = Tier()
    c = core(tiers=(tier,), policy="write_back")
    stored(c, [h(1)])
    _, (store,) = c.flush()
    assert c.manager.num_pinned == 1
    c.hard_close()  # whoever stops waiting: the slot is still being read
    assert c.manager.num_pinned == 1
    effects = c.tier_done(store.op, ok([h(1)]))
    assert c.manager.num_pinned == 0 and Drained() in effects


def test_graceful_close_lets_the_cascade_finish_then_drains() -> None:
    tier = Tier()
    c = core(tiers=(tier,))
    job, (copy,) = c.store([h(1)], [0])
    assert c.begin_close() == []
    with pytest.raises(ClosedError):
        c.store([h(2)], [1])
    effects = c.copy_done(copy.op)
    (cascade,) = of(TierStore, effects)
    assert c.tier_done(cascade.op, ok([h(1)])) == [Cascaded(job, True), Drained()]


def test_graceful_close_under_write_back_flushes_before_draining() -> None:
    tier = Tier()
    c = core(tiers=(tier,), policy="write_back")
    stored(c, [h(1), h(2)])
    (flush,) = c.begin_close()
    assert isinstance(flush, TierStore) and sorted(flush.keys) == [h(1), h(2)]
    assert c.tier_done(flush.op, ok(flush.keys)) == [Drained()]


def test_a_victim_whose_write_back_a_tier_refuses_is_counted_lost() -> None:
    tier = Tier(capacity=0)
    c = core(blocks=1, tiers=(tier,), policy="write_back")
    stored(c, [h(1)])
    _, (write_back,) = c.store([h(2)], [1])
    (copy,) = c.tier_done(write_back.op, TierOutcome((), {h(1): "tier full"}))
    assert isinstance(copy, CopyToHost)  # the slot is refilled: h1 is gone
    assert c.counters["lost_blocks"] == 1
    assert c.failures.counts["evicted block lost: no tier took its write-back"] == 1


def test_a_close_names_the_blocks_its_write_back_could_not_hand_over() -> None:
    tier = Tier()
    c = core(tiers=(tier,), policy="write_back")
    stored(c, [h(1), h(2)])
    assert c.close_result().success  # nothing lost before a close
    (flush,) = c.begin_close()
    assert c.tier_done(flush.op, TierOutcome((h(1),), {h(2): "tier full"})) == [Drained()]
    result = c.close_result()
    assert not result.success and result.failed_keys == (h(2),)
    assert result.error == "1 block(s) failed: tier full (1)"
    assert c.counters["lost_blocks"] == 1
    c.hard_close()  # after the drain: nothing more is lost
    assert c.close_result() == result and c.counters["lost_blocks"] == 1


def test_hard_close_resolves_every_job_once_and_starts_nothing() -> None:
    tier = Tier()
    c = core(blocks=1, tiers=(tier,), policy="write_back")
    stored(c, [h(1)])
    job, (write_back,) = c.store([h(2)], [1])
    effects = c.hard_close()
    assert of(Resolve, effects)[0].job == job and not of(Resolve, effects)[0].result.success
    assert of(Cascaded, effects) == [Cascaded(job, False)]
    effects = c.tier_done(write_back.op, ok([h(1)]))
    assert not of(CopyToHost, effects) and not of(Resolve, effects)
    assert effects == [Drained()] and c.jobs_in_flight == 0 and c.filling_blocks == 0


def test_a_job_waits_for_room_then_starts_when_a_pin_drops() -> None:
    tier = Tier()
    c = core(blocks=1, tiers=(tier,))
    _, (copy,) = c.store([h(1)], [0])
    waiting, effects = c.store([h(2)], [1])
    assert effects == [WaitForRoom(waiting, 5.0)]
    effects = c.copy_done(copy.op)  # h1 ready, but its cascade pins it
    (cascade,) = of(TierStore, effects)
    effects = c.tier_done(cascade.op, ok([h(1)]))
    assert of(CopyToHost, effects), "the waiting store starts once the pin drops"
    assert c.room_expired(waiting) == []  # a stale timer changes nothing


def test_a_job_that_waits_too_long_fails_and_one_that_never_fits_fails_at_once() -> None:
    c = core(blocks=1)
    c.store([h(1)], [0])
    waiting, _ = c.store([h(2)], [1])
    (result,) = of(Resolve, c.room_expired(waiting))
    assert "no CPU slot freed up" in result.result.error
    _, effects = c.store([h(3), h(4)], [2, 3])
    assert "needs 2 CPU slots" in of(Resolve, effects)[0].result.error


def test_a_waiting_load_whose_block_left_every_tier_fails_saying_so() -> None:
    tier = Tier()
    tier.keys.append(h(9))
    c = core(blocks=1, tiers=(tier,))
    _, (copy,) = c.store([h(1)], [0])
    waiting, effects = c.load([h(9)], [1])
    assert effects == [WaitForRoom(waiting, 5.0)]
    tier.keys.remove(h(9))  # evicted from the tier while the load waits for a CPU slot
    (_, result) = of(Resolve, c.copy_done(copy.op))  # the store's, then the load's
    assert result.job == waiting and result.result.failed_keys == (h(9),)
    assert result.result.error.split(": ", 1)[1].startswith(LEFT_EVERY_TIER)
    assert c.failures.counts[LEFT_EVERY_TIER] == 1


def test_a_flush_answers_once_with_every_tier_job() -> None:
    tiers = [Tier(), Tier(name="nvme")]
    c = core(tiers=tuple(tiers), policy="write_back")
    stored(c, [h(1)])
    flush, effects = c.flush()
    assert len(of(TierStore, effects)) == 2
    answers = finish_tier_stores(c, tiers, effects)
    assert of(FlushDone, answers) == [FlushDone(flush, True)]


@pytest.mark.parametrize(
    ("hashes", "ids", "named"),
    [
        (None, [0], "block_hashes"),
        (b"abcd", [0], "block_hashes"),
        ([h(1)], 5, "device_block_ids"),
        ([h(1)], [16], "device_block_ids"),
        ([h(1), h(2)], [3, 3], "device_block_ids"),
        ([h(1), h(2)], [3], "device_block_ids"),
        (["x"], [0], "block_hashes"),
    ],
)
def test_bad_input_names_the_argument_and_changes_nothing(hashes, ids, named: str) -> None:
    c = core()
    for call in (c.store, c.load):
        with pytest.raises(InvalidArgumentError, match=named):
            call(hashes, ids)
    assert len(c.manager) == 0 and c.jobs_in_flight == 0


def test_a_load_of_a_block_no_tier_holds_raises_and_changes_nothing() -> None:
    c = core()
    stored(c, [h(1)])
    with pytest.raises(BlockNotFoundError):
        c.load([h(1), h(9)], [4, 5])
    assert c.manager.num_pinned == 0 and c.jobs_in_flight == 0


def test_a_store_keeps_its_copied_block_while_it_waits_for_a_joined_fill() -> None:
    tier = Tier()
    c = core(blocks=2, tiers=(tier,))
    _, (copy_a,) = c.store([h(1)], [0])
    job_b, (copy_b,) = c.store([h(1), h(2)], [1, 2])  # joins h1's fill, copies h2
    c.copy_done(copy_b.op)  # h2 is ready; B still waits for h1
    waiting, effects = c.store([h(0)], [3])
    assert effects == [WaitForRoom(waiting, 5.0)], "h2 must not be evicted before B cascades"
    effects = c.copy_done(copy_a.op)
    cascades = of(TierStore, effects)
    assert any(h(2) in e.keys for e in cascades)
    answers = finish_tier_stores(c, [tier], cascades)
    assert Cascaded(job_b, True) in answers and h(2) in tier.keys
