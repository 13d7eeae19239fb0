"""The engine's decisions, tested without an event loop."""

import pytest

from tiering import BlockNotFoundError, InvalidArgumentError
from tiering.manager import CPUOffloadingManager
from tiering.planner import TransferPlanner


def h(i: int) -> bytes:
    return i.to_bytes(4, "big")


class FakeTierIndex:
    """A secondary tier's presence index: the planner only asks ``lookup``."""

    def __init__(self, keys=()) -> None:
        self.keys = set(keys)

    def lookup(self, key: bytes) -> bool:
        return key in self.keys


def planner(capacity: int = 4, *tiers: FakeTierIndex) -> TransferPlanner:
    return TransferPlanner(CPUOffloadingManager(capacity), [t.lookup for t in tiers])


def stored(p: TransferPlanner, keys: list[bytes]) -> None:
    plan = p.plan_store(keys, list(range(len(keys))))
    p.finish_fill(plan.hashes, [])


def test_store_plan_pairs_new_blocks_with_their_device_ids() -> None:
    p = planner()
    stored(p, [h(1)])
    plan = p.plan_store([h(1), h(2), h(3)], [10, 11, 12])
    assert plan.hashes == [h(2), h(3)]
    assert plan.device_ids == [11, 12]
    assert len(set(plan.slots)) == 2


def test_store_plan_rejects_a_length_mismatch_without_change() -> None:
    p = planner()
    with pytest.raises(InvalidArgumentError, match="2 block hashes but 1"):
        p.plan_store([h(1), h(2)], [0])
    assert len(p.manager) == 0


def test_store_plan_reports_victims_and_their_slots() -> None:
    p = planner(2)
    stored(p, [h(1), h(2)])
    slot = p.manager.slot_of(h(1))
    plan = p.plan_store([h(3)], [0])
    assert plan.evicted == [h(1)] and plan.evicted_slots == [slot] and plan.slots == [slot]


def test_store_plan_without_room_is_none() -> None:
    p = planner(1)
    p.plan_store([h(1)], [0])  # in flight, so not evictable
    assert p.plan_store([h(2)], [0]) is None


def test_lookup_counts_blocks_held_by_secondary_tiers() -> None:
    p = planner(4, FakeTierIndex([h(2)]))
    stored(p, [h(1)])
    assert p.lookup([h(1), h(2), h(3)]) == 2


def test_load_of_cpu_blocks_pins_them() -> None:
    p = planner()
    stored(p, [h(1), h(2)])
    plan = p.plan_load([h(2), h(1)], [7, 8])
    assert plan.pinned == [h(2), h(1)] and plan.awaited == [] and plan.promotions == {}
    assert plan.slots == [p.manager.slot_of(h(2)), p.manager.slot_of(h(1))]
    assert p.manager.num_pinned == 2


def test_load_of_a_block_no_tier_holds_raises_and_changes_nothing() -> None:
    p = planner(4, FakeTierIndex([h(2)]))
    stored(p, [h(1)])
    with pytest.raises(BlockNotFoundError, match=h(3).hex()):
        p.plan_load([h(1), h(2), h(3)], [0, 1, 2])
    assert p.manager.num_pinned == 0 and len(p.manager) == 1


def test_load_promotes_from_the_first_tier_holding_the_block() -> None:
    fast, slow = FakeTierIndex([h(1)]), FakeTierIndex([h(1), h(2)])
    p = planner(4, fast, slow)
    plan = p.plan_load([h(1), h(2)], [0, 1])
    assert {t: [k for k, _ in items] for t, items in plan.promotions.items()} == {
        0: [h(1)],
        1: [h(2)],
    }
    assert plan.awaited == [h(1), h(2)]
    assert not p.manager.is_ready(h(1)) and h(1) in p.manager


def test_a_promoted_block_is_handed_to_every_waiting_load_on_success() -> None:
    p = planner(4, FakeTierIndex([h(1)]))
    first = p.plan_load([h(1)], [0])
    second = p.plan_load([h(1)], [1])
    assert second.promotions == {}, "the second load must not promote the block again"
    assert second.awaited == [h(1)] and p.waiters(h(1)) == 2
    p.finish_fill(ok=[h(1)], failed=[])
    assert p.manager.block_state(h(1)).ref_count == 2
    p.release(first.hashes)
    p.release(second.hashes)
    assert p.manager.num_evictable == 1


def test_a_failed_fill_drops_the_block_and_its_waiters() -> None:
    p = planner(4, FakeTierIndex([h(1)]))
    p.plan_load([h(1)], [0])
    p.finish_fill(ok=[], failed=[h(1)])
    assert h(1) not in p.manager and p.waiters(h(1)) == 0 and p.manager.num_free == 4


def test_a_load_waits_for_a_block_whose_store_is_in_flight() -> None:
    p = planner()
    p.plan_store([h(1)], [0])
    plan = p.plan_load([h(1)], [5])
    assert plan.awaited == [h(1)] and plan.pinned == []
    p.finish_fill([h(1)], [])
    assert p.manager.block_state(h(1)).ref_count == 1


def test_promotion_never_evicts_blocks_of_the_same_load() -> None:
    p = planner(2, FakeTierIndex([h(9)]))
    stored(p, [h(1), h(2)])
    plan = p.plan_load([h(1), h(9)], [0, 1])
    assert plan.evicted == [h(2)]
    assert p.manager.block_state(h(1)).ref_count == 1


def test_promotion_without_room_is_none_and_changes_nothing() -> None:
    p = planner(1, FakeTierIndex([h(9)]))
    stored(p, [h(1)])
    p.plan_load([h(1)], [0])
    assert p.plan_load([h(9)], [0]) is None
    assert p.manager.block_state(h(1)).ref_count == 1 and h(9) not in p.manager


def test_cascade_pins_only_blocks_the_tier_lacks() -> None:
    tier = FakeTierIndex([h(1)])
    p = planner(4, tier)
    stored(p, [h(1), h(2), h(3)])
    items = p.plan_cascade([h(1), h(2), h(3)], 0)
    assert [k for k, _ in items] == [h(2), h(3)]
    assert p.manager.num_pinned == 2
    p.release([k for k, _ in items])
    assert p.manager.num_pinned == 0


def test_a_withdrawn_waiter_gets_no_pin_when_the_fill_lands() -> None:
    p = planner(4, FakeTierIndex([h(1)]))
    p.plan_load([h(1)], [0])
    p.plan_load([h(1)], [1])
    p.cancel_wait(h(1))
    p.finish_fill([h(1)], [])
    assert p.manager.block_state(h(1)).ref_count == 1


def test_a_tier_that_holds_no_bytes_is_never_a_load_source() -> None:
    presence_only = FakeTierIndex([h(1)])
    p = TransferPlanner(CPUOffloadingManager(4), [presence_only.lookup], servable=[False])
    assert p.lookup([h(1)]) == 0
    with pytest.raises(BlockNotFoundError):
        p.plan_load([h(1)], [0])
