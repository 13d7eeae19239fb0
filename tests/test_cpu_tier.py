import pytest

from tiering import (
    BlockNotFoundError,
    CPULoadStoreSpec,
    InvalidArgumentError,
    LRUPolicy,
    NotLoadingError,
    OffloadingEvent,
    TieringError,
    UnknownPolicyError,
)
from tiering.core.cpu_tier import CPUOffloadingManager


def h(i: int) -> bytes:
    return i.to_bytes(4, "big")


def stored(capacity: int, keys: list[bytes], **kwargs) -> CPUOffloadingManager:
    """A manager holding ``keys`` ready, inserted in order."""
    m = CPUOffloadingManager(capacity, **kwargs)
    out = m.prepare_store(keys)
    assert out is not None
    m.complete_store(keys)
    return m


def snapshot(m: CPUOffloadingManager) -> dict:
    return {
        "blocks": {k: m.block_state(k) for k in list(m._slot_of)},
        "free": sorted(m._free_slots),
        "evictable": m.num_evictable,
        "events": list(m._events),
    }


# --------------------------------------------------------------- construction


@pytest.mark.parametrize("num_blocks", [0, -1, 2.5, True, "8"])
def test_num_blocks_must_be_a_positive_int(num_blocks) -> None:
    with pytest.raises(InvalidArgumentError, match="num_blocks"):
        CPUOffloadingManager(num_blocks)


def test_unknown_policy_name_is_rejected() -> None:
    with pytest.raises(UnknownPolicyError, match="no-such-policy"):
        CPUOffloadingManager(4, policy="no-such-policy")


def test_policy_instance_is_accepted() -> None:
    policy = LRUPolicy()
    m = CPUOffloadingManager(4, policy=policy)
    assert m.policy is policy and policy.capacity == 4


# --------------------------------------------------------------------- lookup


def test_lookup_counts_the_leading_ready_run() -> None:
    m = stored(8, [h(1), h(2), h(3)])
    assert m.lookup([h(1), h(2), h(9), h(3)]) == 2
    assert m.lookup([h(9), h(1)]) == 0


def test_lookup_stops_at_a_block_still_being_stored() -> None:
    m = stored(8, [h(1)])
    m.prepare_store([h(2)])
    assert m.lookup([h(1), h(2)]) == 1


def test_lookup_has_no_side_effects() -> None:
    m = stored(8, [h(1), h(2)])
    before = snapshot(m)
    m.lookup([h(2), h(1)])
    assert snapshot(m) == before
    # Recency unchanged: h(1) is still the first victim.
    m.prepare_store([h(i) for i in range(3, 10)])
    assert h(1) not in m and h(2) in m


# ---------------------------------------------------------------------- loads


def test_prepare_load_returns_slots_in_order_and_pins() -> None:
    m = stored(8, [h(1), h(2), h(3)])
    spec = m.prepare_load([h(3), h(1)])
    assert isinstance(spec, CPULoadStoreSpec) and spec.medium() == "CPU"
    assert spec.block_ids == [m.block_state(h(3)).slot, m.block_state(h(1)).slot]
    assert m.block_state(h(3)).ref_count == 1 and m.num_pinned == 2


def test_prepare_load_of_a_missing_hash_raises_keyerror_naming_it() -> None:
    m = stored(8, [h(1), h(2)])
    before = snapshot(m)
    with pytest.raises(BlockNotFoundError) as info:
        m.prepare_load([h(1), h(7)])
    assert isinstance(info.value, KeyError) and isinstance(info.value, TieringError)
    assert h(7).hex() in str(info.value) and repr(h(7)) in str(info.value)
    assert snapshot(m) == before


def test_prepare_load_of_a_block_in_flight_raises_and_changes_nothing() -> None:
    m = stored(8, [h(1)])
    m.prepare_store([h(2)])
    before = snapshot(m)
    with pytest.raises(BlockNotFoundError, match="being stored"):
        m.prepare_load([h(1), h(2)])
    assert snapshot(m) == before


def test_complete_load_removes_one_reader() -> None:
    m = stored(8, [h(1)])
    m.prepare_load([h(1)])
    m.prepare_load([h(1)])
    m.complete_load([h(1)])
    assert m.block_state(h(1)).ref_count == 1
    m.complete_load([h(1)])
    assert m.block_state(h(1)).ref_count == 0 and m.num_evictable == 1


def test_complete_load_without_a_reader_raises_and_changes_nothing() -> None:
    m = stored(8, [h(1), h(2)])
    m.prepare_load([h(1)])
    before = snapshot(m)
    with pytest.raises(NotLoadingError, match=h(2).hex()):
        m.complete_load([h(1), h(2)])
    assert isinstance(NotLoadingError("x"), TieringError)
    assert snapshot(m) == before


def test_complete_load_of_an_unknown_block_raises() -> None:
    m = stored(8, [h(1)])
    with pytest.raises(NotLoadingError):
        m.complete_load([h(5)])


# --------------------------------------------------------------------- stores


def test_prepare_store_skips_present_blocks_ready_or_in_flight() -> None:
    m = stored(8, [h(1)])
    m.prepare_store([h(2)])
    out = m.prepare_store([h(1), h(2), h(3)])
    assert out.block_hashes_to_store == [h(3)]
    assert len(out.store_spec.block_ids) == 1


def test_prepare_store_with_everything_present_returns_empty_output() -> None:
    m = stored(8, [h(1), h(2)])
    out = m.prepare_store([h(2), h(1)])
    assert out is not None
    assert out.block_hashes_to_store == [] and out.block_hashes_evicted == []
    assert out.store_spec.block_ids == []


def test_prepare_store_hands_out_distinct_slots_in_range() -> None:
    m = CPUOffloadingManager(6)
    out = m.prepare_store([h(i) for i in range(6)])
    assert sorted(out.store_spec.block_ids) == list(range(6))


def test_a_hash_repeated_in_one_store_gets_one_slot() -> None:
    m = CPUOffloadingManager(4)
    out = m.prepare_store([h(1), h(1), h(2)])
    assert out.block_hashes_to_store == [h(1), h(2)] and len(m) == 2


def test_prepare_store_without_room_returns_none_and_changes_nothing() -> None:
    m = stored(3, [h(1), h(2), h(3)])
    m.prepare_load([h(1)])
    before = snapshot(m)
    assert m.prepare_store([h(4), h(5), h(6)]) is None
    assert snapshot(m) == before


def test_prepare_store_larger_than_the_tier_returns_none() -> None:
    m = CPUOffloadingManager(2)
    assert m.prepare_store([h(1), h(2), h(3)]) is None
    assert len(m) == 0
    assert m.prepare_store([h(1), h(2)]).store_spec.block_ids == [0, 1]


def test_pinned_blocks_are_never_evicted() -> None:
    m = stored(3, [h(1), h(2), h(3)])
    m.prepare_load([h(1)])
    out = m.prepare_store([h(4)])
    assert out.block_hashes_evicted == [h(2)]
    assert h(1) in m


def test_blocks_in_flight_are_never_evicted() -> None:
    m = stored(3, [h(1)])
    m.prepare_store([h(2), h(3)])
    assert m.prepare_store([h(4), h(5)]) is None
    out = m.prepare_store([h(4)])
    assert out.block_hashes_evicted == [h(1)]


def test_siblings_in_the_same_store_are_never_evicted() -> None:
    m = stored(3, [h(1), h(2), h(3)])
    # h(1) is the LRU victim but is named in the call.
    out = m.prepare_store([h(1), h(4)])
    assert out.block_hashes_evicted == [h(2)]
    assert m.prepare_store([h(1), h(3), h(4), h(5)]) is None


def test_eviction_frees_the_victims_slot_for_the_new_block() -> None:
    m = stored(2, [h(1), h(2)])
    slot_of_1 = m.block_state(h(1)).slot
    out = m.prepare_store([h(3)])
    assert out.block_hashes_evicted == [h(1)]
    assert out.store_spec.block_ids == [slot_of_1]


def test_complete_store_makes_blocks_ready() -> None:
    m = CPUOffloadingManager(4)
    m.prepare_store([h(1), h(2)])
    m.complete_store([h(1)])
    assert m.block_state(h(1)).ready and not m.block_state(h(2)).ready
    assert m.lookup([h(1), h(2)]) == 1


def test_failed_store_removes_only_blocks_not_yet_ready() -> None:
    m = stored(4, [h(1)])
    m.prepare_store([h(2), h(3)])
    m.complete_store([h(1), h(2), h(3)], success=False)
    assert h(1) in m and h(2) not in m and h(3) not in m
    assert len(m.prepare_store([h(4), h(5), h(6)]).store_spec.block_ids) == 3


def test_complete_store_ignores_unknown_hashes() -> None:
    m = CPUOffloadingManager(4)
    m.complete_store([h(9)])
    m.complete_store([h(9)], success=False)
    assert len(m) == 0


# -------------------------------------------------------------------- recency


def test_new_blocks_are_inserted_most_recent_in_the_order_given() -> None:
    m = stored(3, [h(1), h(2), h(3)])
    out = m.prepare_store([h(4), h(5)])
    assert out.block_hashes_evicted == [h(1), h(2)]


def test_touch_makes_the_first_hash_the_most_recent() -> None:
    m = stored(4, [h(1), h(2), h(3), h(4)])
    m.touch([h(2), h(1)])
    # Order now (oldest first): 3, 4, 1, 2
    out = m.prepare_store([h(5), h(6), h(7)])
    assert out.block_hashes_evicted == [h(3), h(4), h(1)]


def test_touch_ignores_unknown_hashes() -> None:
    m = stored(2, [h(1), h(2)])
    m.touch([h(9), h(1)])
    assert m.prepare_store([h(3)]).block_hashes_evicted == [h(2)]


def test_loads_do_not_change_recency() -> None:
    m = stored(2, [h(1), h(2)])
    m.prepare_load([h(1)])
    m.complete_load([h(1)])
    assert m.prepare_store([h(3)]).block_hashes_evicted == [h(1)]


# --------------------------------------------------------------------- events


def test_events_are_off_by_default() -> None:
    m = stored(1, [h(1)])
    m.prepare_store([h(2)])
    assert m.take_events() == []


def test_events_report_stores_and_evictions_in_order() -> None:
    m = CPUOffloadingManager(2, block_size=32, enable_events=True)
    m.prepare_store([h(1), h(2)])
    assert m.take_events() == []  # a store in flight emits nothing yet
    m.complete_store([h(1), h(2)])
    m.prepare_store([h(3)])
    m.complete_store([h(3)])
    assert m.take_events() == [
        OffloadingEvent([h(1), h(2)], 32, "CPU", False),
        OffloadingEvent([h(1)], 32, "CPU", True),
        OffloadingEvent([h(3)], 32, "CPU", False),
    ]
    assert m.take_events() == []


def test_failed_store_emits_no_event() -> None:
    m = CPUOffloadingManager(2, enable_events=True)
    m.prepare_store([h(1)])
    m.complete_store([h(1)], success=False)
    assert m.take_events() == []


# ------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    "call",
    [
        lambda m: m.lookup([h(1), "abc"]),
        lambda m: m.prepare_load([h(1), 5]),
        lambda m: m.complete_load([h(1), None]),
        lambda m: m.prepare_store([h(8), 3.0]),
        lambda m: m.complete_store([h(1), 1]),
        lambda m: m.complete_store([h(1), 1], success=False),
        lambda m: m.touch([h(1), [1]]),
    ],
)
def test_non_bytes_hashes_raise_and_change_nothing(call) -> None:
    m = stored(4, [h(1), h(2)])
    m.prepare_load([h(1)])
    before = snapshot(m)
    with pytest.raises(InvalidArgumentError, match="bytes"):
        call(m)
    assert snapshot(m) == before


def test_any_iterable_of_hashes_is_accepted() -> None:
    m = CPUOffloadingManager(4)
    m.prepare_store(iter([h(1), h(2)]))
    m.complete_store(x for x in [h(1), h(2)])
    assert m.lookup(iter([h(1), h(2)])) == 2


def test_store_output_names_the_slots_of_evicted_blocks() -> None:
    m = stored(3, [h(1), h(2), h(3)])
    slots = {k: m.block_state(k).slot for k in (h(1), h(2))}
    out = m.prepare_store([h(4), h(5)])
    assert out.block_hashes_evicted == [h(1), h(2)]
    assert out.evicted_block_ids == [slots[h(1)], slots[h(2)]]
    assert sorted(out.store_spec.block_ids) == sorted(out.evicted_block_ids)
