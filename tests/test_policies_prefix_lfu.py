"""PrefixLFUPolicy: frequency over age, counts kept in the ghost, leaves first, the evict
contract, scan resistance (``tiering.policies.prefix_lfu``)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from _policy_ops import any_key as _any
from _policy_ops import (
    hot_chain_and_one_offs,
    hot_hits_under_scan,
    operations,
    pairs,
    run_operations,
)
from _policy_ops import key as _key
from hypothesis import given, settings
from hypothesis import strategies as st

from tiering.errors import InvalidArgumentError
from tiering.manager import CPUOffloadingManager
from tiering.policies import PrefixLFUPolicy, make_policy
from tiering.policies.lru import LRUPolicy
from tiering.replay import CacheModel, simulate
from tiering.workloads import Request


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
     ("ghost_factor", 0), ("ghost_factor", 1.5), ("ghost_factor", True), ("ghost_window", 0),
     ("admission", "never"), ("sample", 0)],
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


def test_the_ghost_halves_its_counts_every_window_and_forgets_the_ones() -> None:
    policy = _policy(4, ghost_window=2)  # ages every 8 touched keys
    for _ in range(3):
        policy.touch([_key(1)])  # not cached: the ghost counts 3
    policy.touch([_key(2)])  # 1
    assert dict(policy.snapshot().ghost) == {_key(1): 3, _key(2): 1}
    policy.touch([_key(3), _key(4), _key(5), _key(6)])  # the 8th touched key: it ages
    assert dict(policy.snapshot().ghost) == {_key(1): 1}  # halved; the ones forgotten


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


# -- admission ------------------------------------------------------------------------


def test_second_sight_admits_only_a_block_requested_before() -> None:
    policy = _policy(admission="second-sight")
    policy.touch([_key(1)])
    assert not policy.admit(_key(1))  # this request is its first
    policy.touch([_key(1)])
    assert policy.admit(_key(1))
    assert _policy(admission="all").admit(_key(2))


def test_a_declined_block_is_not_stored_and_evicts_nothing() -> None:
    manager = CPUOffloadingManager(2, policy=PrefixLFUPolicy(admission="second-sight"))
    keys = [_key(1), _key(2)]
    manager.touch(keys)
    manager.touch(keys)  # both requested before
    out = manager.prepare_store(keys)
    assert out is not None and out.block_hashes_to_store == keys
    manager.complete_store(keys)
    manager.touch([_key(3)])
    out = manager.prepare_store([_key(3)])  # its first request: declined
    assert out is not None and out.block_hashes_to_store == [] and out.block_hashes_evicted == []
    assert manager.lookup(keys) == 2
    forced = manager.prepare_store([_key(3)], admission=False)  # a promotion must land
    assert forced is not None and forced.block_hashes_to_store == [_key(3)]


@pytest.mark.parametrize(
    ("workload", "second_sight_wins"), [(hot_chain_and_one_offs, True), (pairs, False)]
)
def test_the_duel_follows_the_admission_that_wins(
    workload: Callable[[int], list[Request]], second_sight_wins: bool
) -> None:
    requests = workload(60)
    dueling = PrefixLFUPolicy(sample=1)  # every key feeds the shadows
    model = CacheModel(64, dueling)
    for request in requests:
        model.request(request.keys())
    assert dueling.prefers_second_sight is second_sight_wins
    fixed = {
        rule: simulate(requests, cpu_blocks=64, policy=PrefixLFUPolicy(admission=rule)).hit_ratio
        for rule in ("all", "second-sight")
    }
    winner = "second-sight" if second_sight_wins else "all"
    assert fixed[winner] > fixed["all" if second_sight_wins else "second-sight"]
    assert model.hit_ratio >= 0.9 * fixed[winner]  # it got most of what the winner got


def test_the_duels_shadows_follow_the_policys_own_weights_and_ghost() -> None:
    policy = PrefixLFUPolicy(age_weight=1.5, ghost_window=3, ghost_factor=5, sample=2)
    policy.bind(64)
    shadows = [shadow.policy for shadow in policy._shadows or ()]
    assert [s.admission for s in shadows] == ["all", "second-sight"]
    for shadow in shadows:
        assert (shadow.age_weight, shadow.ghost_window, shadow.ghost_factor) == (1.5, 3, 5)
        assert shadow.capacity == 32
