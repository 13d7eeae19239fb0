"""ARCPolicy: the ARC rules, the evict contract, bounded ghosts, scan resistance."""

from __future__ import annotations

import pytest
from _policy_ops import any_key as _any
from _policy_ops import arc_lists, hot_hits_under_scan, operations, run_operations
from _policy_ops import key as _key
from hypothesis import given, settings
from hypothesis import strategies as st

from tiering.core.policies import ARCPolicy, make_policy
from tiering.core.policies.lru import LRUPolicy
from tiering.errors import BlockNotFoundError, InvalidArgumentError


def _arc(capacity: int, inserted: range = range(0)) -> ARCPolicy:
    policy = ARCPolicy()
    policy.bind(capacity)
    for i in inserted:
        policy.insert(_key(i))
    return policy


def test_make_policy_builds_arc_by_name() -> None:
    policy = make_policy("arc", 8)
    assert isinstance(policy, ARCPolicy)
    assert policy.capacity == 8


def test_inserted_key_is_resident_in_t1() -> None:
    policy = _arc(4, range(2))
    state = arc_lists(policy)
    assert state.t1 == (_key(0), _key(1))
    assert state.t2 == ()
    assert len(policy) == 2
    assert _key(0) in policy


def test_touched_t1_key_moves_to_t2() -> None:
    policy = _arc(4, range(3))
    policy.touch([_key(1)])
    state = arc_lists(policy)
    assert state.t1 == (_key(0), _key(2))
    assert state.t2 == (_key(1),)


def test_touched_t2_key_becomes_most_recent_of_t2() -> None:
    policy = _arc(4, range(3))
    policy.touch([_key(0)])
    policy.touch([_key(1)])
    policy.touch([_key(0)])
    assert arc_lists(policy).t2 == (_key(1), _key(0))


def test_touch_makes_first_key_the_most_recent() -> None:
    policy = _arc(4, range(3))
    policy.touch([_key(2), _key(0), _key(1)])
    assert arc_lists(policy).t2 == (_key(1), _key(0), _key(2))


def test_touch_ignores_keys_not_resident() -> None:
    policy = _arc(3, range(3))
    policy.evict(1, _any)  # key 0 becomes a B1 ghost
    policy.touch([_key(0), _key(99)])
    state = arc_lists(policy)
    assert state.t2 == ()
    assert state.b1 == (_key(0),)


def test_evict_takes_lru_of_t1_while_t1_exceeds_target() -> None:
    policy = _arc(4, range(4))
    policy.touch([_key(0)])  # T1 = 1,2,3; T2 = 0; p = 0
    assert policy.evict(2, _any) == [_key(1), _key(2)]
    assert arc_lists(policy).t2 == (_key(0),)


def test_evict_takes_lru_of_t2_when_t1_is_within_target() -> None:
    policy = _arc(2, range(2))
    policy.evict(1, _any)  # key 0 -> B1
    policy.remove(_key(1))
    policy.insert(_key(0))  # B1 hit: p = 1, key 0 in T2
    policy.insert(_key(5))  # T1 = 5 (|T1| == p)
    assert arc_lists(policy).target_t1 == 1.0
    assert policy.evict(1, _any) == [_key(0)]
    assert arc_lists(policy).b2 == (_key(0),)


def test_evicted_t1_key_becomes_most_recent_b1_ghost() -> None:
    policy = _arc(4, range(4))
    policy.evict(2, _any)
    state = arc_lists(policy)
    assert state.b1 == (_key(0), _key(1))
    assert _key(0) not in policy
    assert len(policy) == 2


def test_reinserted_b1_ghost_lands_in_t2_and_raises_target() -> None:
    policy = _arc(4, range(4))
    policy.evict(1, _any)
    policy.insert(_key(0))
    state = arc_lists(policy)
    assert state.t2 == (_key(0),)
    assert state.b1 == ()
    assert state.target_t1 == 1.0


def test_b1_hit_raises_target_by_ghost_ratio() -> None:
    policy = _arc(4, range(4))
    policy.touch([_key(0), _key(1), _key(2), _key(3)])  # all in T2
    policy.evict(2, _any)  # keys 3, 2 (LRU of T2) -> B2
    policy.insert(_key(10))
    policy.evict(1, _any)  # |T1| = 1 > p = 0: key 10 -> B1
    policy.insert(_key(10))  # |B2| / |B1| = 2
    assert arc_lists(policy).target_t1 == 2.0


def test_reinserted_b2_ghost_lands_in_t2_and_lowers_target() -> None:
    policy = _arc(4, range(4))
    policy.evict(1, _any)  # 0 -> B1
    policy.insert(_key(0))  # p = 1
    policy.touch([_key(1)])  # T1 = 2, 3; T2 = 0, 1
    policy.remove(_key(2))
    policy.remove(_key(3))
    assert policy.evict(1, _any) == [_key(0)]  # T1 empty: LRU of T2
    policy.insert(_key(0))
    state = arc_lists(policy)
    assert state.t2 == (_key(1), _key(0))
    assert state.b2 == ()
    assert state.target_t1 == 0.0


def test_b2_hit_never_lowers_target_below_zero() -> None:
    policy = _arc(2, range(2))
    policy.touch([_key(0)])  # T1 = 1; T2 = 0
    assert policy.evict(1, lambda k: k != _key(1)) == [_key(0)]  # T1 pinned: from T2
    policy.insert(_key(0))
    state = arc_lists(policy)
    assert state.t2 == (_key(0),)
    assert state.target_t1 == 0.0


def test_target_stays_within_zero_and_capacity() -> None:
    policy = _arc(2)
    for round_ in range(5):
        a, b = _key(2 * round_), _key(2 * round_ + 1)
        policy.insert(a)
        policy.insert(b)
        policy.evict(2, _any)
        policy.insert(a)  # B1 hit
        policy.evict(1, _any)
        assert 0.0 <= arc_lists(policy).target_t1 <= 2.0
        for key in list(arc_lists(policy).t2):
            policy.remove(key)
        for key in list(arc_lists(policy).t1):
            policy.remove(key)
    assert arc_lists(policy).target_t1 == 2.0


def test_evict_falls_back_to_t2_when_t1_has_nothing_evictable() -> None:
    policy = _arc(4, range(4))
    policy.touch([_key(3)])  # T1 = 0, 1, 2; T2 = 3
    pinned = {_key(0), _key(1), _key(2)}
    assert policy.evict(1, lambda k: k not in pinned) == [_key(3)]
    assert arc_lists(policy).t1 == (_key(0), _key(1), _key(2))


def test_pinned_t2_keys_are_never_returned() -> None:
    policy = _arc(4, range(4))
    policy.touch([_key(3), _key(2), _key(1), _key(0)])  # T2 = 0, 1, 2, 3
    pinned = {_key(0), _key(2)}
    assert policy.evict(2, lambda k: k not in pinned) == [_key(1), _key(3)]
    assert arc_lists(policy).t2 == (_key(0), _key(2))


def test_pinned_keys_are_never_returned_and_keep_their_place() -> None:
    policy = _arc(6, range(6))
    pinned = {_key(0), _key(2), _key(4)}
    victims = policy.evict(3, lambda k: k not in pinned)
    assert victims == [_key(1), _key(3), _key(5)]
    assert arc_lists(policy).t1 == (_key(0), _key(2), _key(4))


def test_evict_returns_exactly_n_distinct_keys() -> None:
    policy = _arc(8, range(8))
    policy.touch([_key(1), _key(5)])
    victims = policy.evict(5, _any)
    assert len(victims) == 5
    assert len(set(victims)) == 5
    assert len(policy) == 3
    assert not any(v in policy for v in victims)


def test_evict_calls_can_evict_at_most_once_perkey() -> None:
    policy = _arc(6, range(6))
    policy.touch([_key(0), _key(1)])
    calls: list[bytes] = []

    def only_odd(key: bytes) -> bool:
        calls.append(key)
        return int(key.split(b"-")[1]) % 2 == 1

    victims = policy.evict(3, only_odd)
    assert sorted(victims) == [_key(1), _key(3), _key(5)]
    assert len(calls) == len(set(calls))


def test_evict_with_too_few_evictable_keys_returns_those_it_found() -> None:
    policy = _arc(4, range(4))
    pinned = {_key(0), _key(1), _key(2)}
    assert policy.evict(2, lambda k: k not in pinned) == [_key(3)]
    assert len(policy) == 3


def test_evict_zero_changes_nothing() -> None:
    policy = _arc(4, range(4))
    assert policy.evict(0, _any) == []
    assert len(policy) == 4


def test_removed_key_leaves_no_ghost() -> None:
    policy = _arc(4, range(4))
    policy.touch([_key(2)])
    policy.remove(_key(0))
    policy.remove(_key(2))
    state = arc_lists(policy)
    assert state.b1 == state.b2 == ()
    assert len(policy) == 2
    policy.insert(_key(0))
    assert arc_lists(policy).t1[-1] == _key(0)
    assert arc_lists(policy).target_t1 == 0.0


def test_remove_of_key_not_resident_raises_and_changes_nothing() -> None:
    policy = _arc(4, range(2))
    before = arc_lists(policy)
    with pytest.raises(BlockNotFoundError, match="not resident"):
        policy.remove(_key(7))
    assert arc_lists(policy) == before


def test_insert_of_resident_key_raises_and_changes_nothing() -> None:
    policy = _arc(4, range(2))
    policy.touch([_key(1)])
    before = arc_lists(policy)
    for key in (_key(0), _key(1)):
        with pytest.raises(InvalidArgumentError, match="already resident"):
            policy.insert(key)
    assert arc_lists(policy) == before


def test_ghost_lists_stay_within_capacity_dropping_oldest() -> None:
    policy = _arc(3)
    for i in range(10):
        if len(policy) == 3:
            policy.evict(1, _any)
        policy.insert(_key(i))
    state = arc_lists(policy)
    # |T1| + |B1| <= 3 with T1 = 7, 8, 9: every ghost of B1 is dropped, oldest first.
    assert state.t1 == (_key(7), _key(8), _key(9))
    assert state.b1 == ()
    policy.evict(2, _any)
    assert arc_lists(policy).b1 == (_key(7), _key(8))


def test_b2_is_trimmed_when_ghosts_exceed_capacity() -> None:
    policy = _arc(2)
    for i in range(6):
        if len(policy) == 2:
            policy.evict(1, _any)
        policy.insert(_key(i))
        policy.touch([_key(i)])  # straight to T2
    state = arc_lists(policy)
    assert state.t2 == (_key(4), _key(5))
    assert state.b2 == (_key(2), _key(3))  # oldest ghosts 0, 1 dropped


# -- properties over random operation sequences ------------------------------------

# A universe not much larger than the cache, so ghosts are hit and pins land on residents.
_UNIVERSE = 12

_OPS = operations(_UNIVERSE, max_evict=7)


def _check_arc_invariants(policy: ARCPolicy, resident: set[bytes]) -> None:
    state = arc_lists(policy)
    t1, t2, b1, b2 = set(state.t1), set(state.t2), set(state.b1), set(state.b2)
    capacity = policy.capacity
    assert len(policy) == len(resident)
    assert t1 | t2 == resident
    assert not t1 & t2
    assert not (t1 | t2) & (b1 | b2), "a key is both resident and a ghost"
    assert not b1 & b2
    assert len(state.b1) + len(state.b2) <= capacity
    assert len(state.t1) + len(state.b1) <= capacity
    assert 0.0 <= state.target_t1 <= capacity


@settings(max_examples=150, deadline=None)
@given(capacity=st.integers(1, 8), ops=st.lists(_OPS, max_size=60))
def test_random_operations_keep_the_evict_contract_and_arc_invariants(
    capacity: int, ops: list[tuple]
) -> None:
    run_operations(_arc(capacity), capacity, ops, _UNIVERSE, _check_arc_invariants)


# -- scan resistance -----------------------------------------------------------------


def test_arc_keeps_more_hot_keys_than_lru_through_a_scan() -> None:
    lru_hits = hot_hits_under_scan(LRUPolicy(), 40)
    arc_hits = hot_hits_under_scan(ARCPolicy(), 40)
    assert arc_hits > lru_hits
