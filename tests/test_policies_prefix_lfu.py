"""PrefixLFUPolicy: frequency over age, counts kept in the ghost, leaves first, the evict
contract, scan resistance (``tiering.policies.prefix_lfu``)."""

from __future__ import annotations

import pytest
from _policy_ops import any_key as _any
from _policy_ops import hot_hits_under_scan, operations, run_operations
from _policy_ops import key as _key
from hypothesis import given, settings
from hypothesis import strategies as st

from tiering.errors import InvalidArgumentError
from tiering.policies import PrefixLFUPolicy, make_policy
from tiering.policies.lru import LRUPolicy


def _policy(capacity: int = 10, **options: object) -> PrefixLFUPolicy:
    policy = PrefixLFUPolicy(**options)  # type: ignore[arg-type]
    policy.bind(capacity)
    return policy


def _request(policy: PrefixLFUPolicy, ids: list[int]) -> None:
    """One request as the manager drives it: touch its chain, insert what is missing."""
    keys = [_key(i) for i in ids]
    policy.touch(keys)
    for k in keys:
        if k not in policy:
            policy.insert(k)


def test_make_policy_builds_it_by_name() -> None:
    policy = make_policy("prefix-lfu", 8)
    assert isinstance(policy, PrefixLFUPolicy) and policy.capacity == 8


@pytest.mark.parametrize(
    ("option", "value"),
    [("age_weight", -1), ("age_weight", float("inf")), ("age_weight", "1"),
     ("ghost_factor", 0), ("ghost_factor", 1.5), ("ghost_factor", True)],
)  # fmt: skip
def test_a_bad_option_is_named(option: str, value: object) -> None:
    with pytest.raises(InvalidArgumentError, match=option):
        PrefixLFUPolicy(**{option: value})  # type: ignore[arg-type]


def _invariants(policy: PrefixLFUPolicy, resident: set[bytes]) -> None:  # type: ignore[override]
    state = policy.snapshot()
    assert set(state.counts) == resident and len(policy) == len(resident)
    assert all(count >= 1 for count in state.counts.values())
    ghost = {k for k, _ in state.ghost}
    assert not ghost & resident, "a key is both cached and a ghost"
    assert len(state.ghost) <= policy.ghost_factor * policy.capacity
    for k in resident:  # inner exactly while a cached child waits on it
        assert (state.queue_of[k] < 0) == (state.children.get(k, 0) > 0)


@settings(max_examples=200, deadline=None)
@given(capacity=st.integers(1, 12), ops=st.lists(operations(16, max_evict=6), max_size=80))
def test_random_operations_keep_the_evict_contract_and_its_invariants(
    capacity: int, ops: list[tuple]
) -> None:
    run_operations(_policy(capacity), capacity, ops, 16, _invariants)  # type: ignore[arg-type]


def test_the_least_requested_block_goes_first() -> None:
    policy = _policy()
    _request(policy, [1])
    _request(policy, [2])
    for _ in range(3):
        _request(policy, [1])  # 1: four requests, 2: one, and 2 is no older
    assert policy.evict(1, _any) == [_key(2)]


def test_among_equal_counts_the_older_goes_first() -> None:
    policy = _policy(age_weight=1.0)
    _request(policy, [1])
    _request(policy, [2])
    assert policy.evict(1, _any) == [_key(1)]


def test_a_count_survives_eviction_in_the_ghost() -> None:
    policy = _policy()
    for _ in range(5):
        _request(policy, [1])
    assert policy.evict(1, _any) == [_key(1)]
    _request(policy, [2])
    _request(policy, [1])  # back, with its five earlier requests remembered
    _request(policy, [3])
    assert policy.evict(2, _any) == [_key(2), _key(3)]
    fresh = _policy(1, ghost_factor=1)
    for _ in range(5):
        _request(fresh, [1])
    fresh.evict(1, _any)
    _request(fresh, [7])
    _request(fresh, [8])  # the ghost holds one key: 1's count is gone
    fresh.evict(2, _any)
    _request(fresh, [1])
    _request(fresh, [9])
    assert fresh.evict(1, _any) == [_key(1)]  # 1 and 9 both at count 1; 1 is older


def test_leaves_go_before_their_parents() -> None:
    policy = _policy(age_weight=1.0)
    _request(policy, [1, 2, 3])  # a chain: 1 <- 2 <- 3, all touched alike
    _request(policy, [9])
    _request(policy, [9])  # 9 is newer and more requested than the chain
    assert policy.evict(3, _any) == [_key(3), _key(2), _key(1)]


def test_a_pinned_leaf_lets_its_parent_wait_and_an_inner_block_goes_last() -> None:
    policy = _policy()
    _request(policy, [1, 2])
    pinned = {_key(2)}
    assert policy.evict(1, lambda k: k not in pinned) == [_key(1)]  # only an inner one left
    assert len(policy) == 1 and _key(2) in policy


def test_a_removed_block_leaves_no_history() -> None:
    policy = _policy(age_weight=1.0)
    for _ in range(4):
        _request(policy, [1])
    policy.remove(_key(1))  # a failed store: it never was
    _request(policy, [1])  # a first request again, not a fifth
    _request(policy, [2])
    assert policy.evict(1, _any) == [_key(1)]  # count 1 and older; with history it stays


def test_it_keeps_a_hot_set_through_scans_better_than_lru() -> None:
    assert hot_hits_under_scan(PrefixLFUPolicy(), 40) > hot_hits_under_scan(LRUPolicy(), 40)
