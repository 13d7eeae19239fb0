"""S3FIFOPolicy: Algorithm 1's rules, the evict contract, termination, scan resistance."""

from __future__ import annotations

import pytest
from _policy_ops import any_key as _any
from _policy_ops import hot_hits_under_scan, operations, run_operations, s3fifo_queues
from _policy_ops import key as _key
from hypothesis import given, settings
from hypothesis import strategies as st

from tiering.core.policies import S3FIFOPolicy, make_policy
from tiering.core.policies.lru import LRUPolicy
from tiering.errors import BlockNotFoundError, InvalidArgumentError


def _s3fifo(capacity: int, inserted: range = range(0)) -> S3FIFOPolicy:
    policy = S3FIFOPolicy()
    policy.bind(capacity)
    for i in inserted:
        policy.insert(_key(i))
    return policy


def _with_main(capacity: int, ids: range) -> S3FIFOPolicy:
    """A policy whose main queue holds ``ids`` in order (admitted through the ghost queue)."""
    policy = _s3fifo(capacity, ids)
    policy.evict(len(ids), _any)
    for i in ids:
        policy.insert(_key(i))
    assert s3fifo_queues(policy).main == tuple(_key(i) for i in ids)
    return policy


def test_make_policy_builds_s3fifo_by_name() -> None:
    policy = make_policy("s3fifo", 10)
    assert isinstance(policy, S3FIFOPolicy)
    assert policy.capacity == 10
    assert policy._ghost_capacity == 9


@pytest.mark.parametrize("ratio", [0, 1, -0.1, 1.5, True, "0.1", float("nan")])
def test_small_ratio_outside_open_unit_interval_is_rejected(ratio: object) -> None:
    with pytest.raises(InvalidArgumentError, match="small_ratio"):
        S3FIFOPolicy(small_ratio=ratio)  # type: ignore[arg-type]


def test_new_key_enters_small_queue_with_zero_count() -> None:
    policy = _s3fifo(10, range(2))
    state = s3fifo_queues(policy)
    assert state.small == (_key(0), _key(1))
    assert state.main == ()
    assert state.freq == {_key(0): 0, _key(1): 0}
    assert len(policy) == 2
    assert _key(1) in policy


def test_touch_counts_accesses_up_to_three() -> None:
    policy = _s3fifo(10, range(2))
    for _ in range(5):
        policy.touch([_key(0)])
    policy.touch([_key(1), _key(1)])
    assert s3fifo_queues(policy).freq == {_key(0): 3, _key(1): 2}


def test_touch_ignores_keys_not_resident() -> None:
    policy = _s3fifo(10, range(2))
    policy.evict(1, _any)  # key 0 -> ghost
    policy.touch([_key(0), _key(99)])
    state = s3fifo_queues(policy)
    assert state.freq == {_key(1): 0}
    assert state.ghost == (_key(0),)


def test_key_accessed_twice_in_small_is_promoted_to_main_instead_of_evicted() -> None:
    policy = _s3fifo(10, range(3))
    policy.touch([_key(0)])
    policy.touch([_key(0)])
    assert policy.evict(1, _any) == [_key(1)]
    state = s3fifo_queues(policy)
    assert state.main == (_key(0),)
    assert state.small == (_key(2),)
    assert state.freq[_key(0)] == 0  # bits cleared on the move
    assert state.ghost == (_key(1),)


def test_key_accessed_once_in_small_is_evicted_to_ghost() -> None:
    policy = _s3fifo(10, range(3))
    policy.touch([_key(0)])
    assert policy.evict(1, _any) == [_key(0)]
    state = s3fifo_queues(policy)
    assert state.ghost == (_key(0),)
    assert state.main == ()
    assert _key(0) not in policy


def test_inserted_key_found_in_ghost_queue_goes_to_main() -> None:
    policy = _s3fifo(10, range(3))
    policy.evict(1, _any)
    policy.insert(_key(0))
    state = s3fifo_queues(policy)
    assert state.main == (_key(0),)
    assert state.small == (_key(1), _key(2))
    assert state.ghost == ()
    assert state.freq[_key(0)] == 0


def test_main_head_with_count_is_decremented_and_reinserted_at_tail() -> None:
    policy = _with_main(10, range(3))
    policy.touch([_key(0)])
    policy.touch([_key(1), _key(1)])
    assert policy.evict(1, _any) == [_key(2)]
    state = s3fifo_queues(policy)
    assert state.main == (_key(0), _key(1))
    assert state.freq == {_key(0): 0, _key(1): 1}


def test_key_evicted_from_main_leaves_no_ghost() -> None:
    policy = _with_main(10, range(3))
    assert policy.evict(2, _any) == [_key(0), _key(1)]
    assert s3fifo_queues(policy).ghost == ()


def test_evict_takes_from_small_while_it_holds_its_share_then_from_main() -> None:
    policy = _with_main(20, range(3))  # small share: |S| >= 2
    policy.insert(_key(10))
    policy.insert(_key(11))
    assert policy.evict(1, _any) == [_key(10)]  # |S| = 2
    assert policy.evict(1, _any) == [_key(0)]  # |S| = 1 < 2
    assert s3fifo_queues(policy).small == (_key(11),)


def test_one_evict_call_turns_to_main_once_small_falls_below_its_share() -> None:
    policy = _with_main(20, range(2))  # small share: |S| >= 2
    for i in (10, 11, 12):
        policy.insert(_key(i))
    assert policy.evict(3, _any) == [_key(10), _key(11), _key(0)]
    assert s3fifo_queues(policy).small == (_key(12),)


def test_evict_takes_from_main_when_small_has_nothing_evictable() -> None:
    policy = _with_main(10, range(2))
    policy.insert(_key(10))
    policy.insert(_key(11))
    pinned = {_key(10), _key(11)}
    assert policy.evict(1, lambda k: k not in pinned) == [_key(0)]
    assert s3fifo_queues(policy).small == (_key(10), _key(11))


def test_evict_takes_from_small_below_its_share_when_main_has_nothing_evictable() -> None:
    policy = _with_main(20, range(2))
    policy.insert(_key(10))  # |S| = 1 < 2
    pinned = {_key(0), _key(1)}
    assert policy.evict(1, lambda k: k not in pinned) == [_key(10)]
    assert s3fifo_queues(policy).main == (_key(0), _key(1))


def test_key_promoted_during_evict_can_still_be_evicted_from_main() -> None:
    policy = _with_main(20, range(1))  # small share: |S| >= 2
    policy.insert(_key(10))
    policy.touch([_key(10), _key(10)])
    # M (only key 0, pinned) is found empty first; then S promotes key 10 into M.
    assert policy.evict(1, lambda k: k != _key(0)) == [_key(10)]
    assert s3fifo_queues(policy).main == (_key(0),)


def test_ghost_queue_is_bounded_dropping_oldest() -> None:
    policy = _s3fifo(10)  # ghost holds 9
    for i in range(12):
        policy.insert(_key(i))
        policy.evict(1, _any)
    assert s3fifo_queues(policy).ghost == tuple(_key(i) for i in range(3, 12))


def test_pinned_keys_are_never_returned_and_keep_their_counters() -> None:
    policy = _s3fifo(10, range(4))
    policy.touch([_key(0)])
    policy.touch([_key(2), _key(2)])
    pinned = {_key(0), _key(2)}
    victims = policy.evict(2, lambda k: k not in pinned)
    assert victims == [_key(1), _key(3)]
    state = s3fifo_queues(policy)
    assert state.freq == {_key(0): 1, _key(2): 2}
    assert set(state.small) == pinned
    assert state.main == ()


def test_evict_terminates_when_all_but_one_key_is_pinned() -> None:
    capacity = 100
    policy = _with_main(capacity, range(50))
    for i in range(50, 100):
        policy.insert(_key(i))
    for _ in range(3):
        policy.touch([_key(i) for i in range(100)])
    free = _key(49)  # the tail of the main queue, counter at 3
    calls = 0

    def only_free(key: bytes) -> bool:
        nonlocal calls
        calls += 1
        return key == free

    assert policy.evict(1, only_free) == [free]
    assert len(policy) == 99
    # A pass over S, then at most four rounds of M (three decrements of `free`).
    assert calls <= 50 + 4 * 50 + 1
    state = s3fifo_queues(policy)
    assert all(state.freq[k] == 3 for k in state.freq)


def test_evict_with_nothing_evictable_returns_empty_and_terminates() -> None:
    policy = _with_main(10, range(3))
    policy.insert(_key(10))
    policy.touch([_key(0), _key(10)])
    before = s3fifo_queues(policy)
    assert policy.evict(2, lambda k: False) == []
    after = s3fifo_queues(policy)
    assert after.freq == before.freq
    assert set(after.main) == set(before.main)
    assert set(after.small) == set(before.small)


def test_evict_returns_exactly_n_distinct_keys() -> None:
    policy = _s3fifo(10, range(10))
    policy.touch([_key(i) for i in range(0, 10, 2)] * 2)  # evens get promoted
    victims = policy.evict(7, _any)
    assert len(victims) == 7
    assert len(set(victims)) == 7
    assert len(policy) == 3
    assert not any(v in policy for v in victims)


def test_evict_zero_changes_nothing() -> None:
    policy = _s3fifo(10, range(3))
    before = s3fifo_queues(policy)
    assert policy.evict(0, _any) == []
    assert s3fifo_queues(policy) == before


def test_removed_keys_leave_no_ghost() -> None:
    policy = _with_main(10, range(2))
    policy.insert(_key(10))
    policy.remove(_key(0))
    policy.remove(_key(10))
    state = s3fifo_queues(policy)
    assert state.ghost == ()
    assert state.main == (_key(1),)
    assert state.small == ()
    assert state.freq == {_key(1): 0}
    policy.insert(_key(0))
    assert s3fifo_queues(policy).small == (_key(0),)


def test_remove_of_key_not_resident_raises_and_changes_nothing() -> None:
    policy = _s3fifo(10, range(2))
    before = s3fifo_queues(policy)
    with pytest.raises(BlockNotFoundError, match="not resident"):
        policy.remove(_key(7))
    assert s3fifo_queues(policy) == before


def test_insert_of_resident_key_raises_and_changes_nothing() -> None:
    policy = _with_main(10, range(1))
    policy.insert(_key(1))
    before = s3fifo_queues(policy)
    for key in (_key(0), _key(1)):
        with pytest.raises(InvalidArgumentError, match="already resident"):
            policy.insert(key)
    assert s3fifo_queues(policy) == before


# -- properties over random operation sequences ------------------------------------

# A universe not much larger than the cache, so ghosts are hit and pins land on residents.
_UNIVERSE = 24

_OPS = operations(_UNIVERSE, max_evict=15)


def _check_s3fifo_invariants(policy: S3FIFOPolicy, resident: set[bytes]) -> None:
    state = s3fifo_queues(policy)
    small, main, ghost = set(state.small), set(state.main), set(state.ghost)
    assert len(policy) == len(resident)
    assert small | main == resident
    assert not small & main
    assert set(state.freq) == resident
    assert all(0 <= count <= 3 for count in state.freq.values())
    assert not resident & ghost, "a key is both resident and a ghost"
    assert len(state.ghost) <= policy._ghost_capacity


@settings(max_examples=150, deadline=None)
@given(capacity=st.integers(1, 16), ops=st.lists(_OPS, max_size=80))
def test_random_operations_keep_the_evict_contract_and_s3fifo_invariants(
    capacity: int, ops: list[tuple]
) -> None:
    run_operations(_s3fifo(capacity), capacity, ops, _UNIVERSE, _check_s3fifo_invariants)


# -- scan resistance -----------------------------------------------------------------


def test_s3fifo_keeps_more_hot_keys_than_lru_through_a_scan() -> None:
    lru_hits = hot_hits_under_scan(LRUPolicy(), 40)
    s3fifo_hits = hot_hits_under_scan(S3FIFOPolicy(), 40)
    assert s3fifo_hits > lru_hits
