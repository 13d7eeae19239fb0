"""AdaptivePolicy: ARC's and LRU's orders over one resident set, second sight from two
generations of request counts, four sampled shadows and the one it follows, the evict
contract (``tiering.core.policies.adaptive``)."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
from _policy_ops import any_key as _any
from _policy_ops import (
    arc_lists,
    hot_chain_and_one_offs,
    hot_hits_under_scan,
    operations,
    pairs,
    run_operations,
)
from _policy_ops import key as _key
from hypothesis import given, settings
from hypothesis import strategies as st

from tiering.core.cpu_tier import CPUOffloadingManager
from tiering.core.policies import AdaptivePolicy, ARCPolicy, make_policy
from tiering.core.policies.adaptive import EXPERTS
from tiering.core.policies.lru import LRUPolicy
from tiering.errors import BlockNotFoundError, InvalidArgumentError
from tiering.lab.replay import CacheModel, simulate
from tiering.lab.workloads import Request


def _policy(capacity: int = 10, leader: str | None = None, **options: float) -> AdaptivePolicy:
    """A bound policy; with ``leader``, one that keeps following that shadow."""
    policy = AdaptivePolicy(**options)
    policy.bind(capacity)
    if leader is not None:
        _pin(policy, leader)
    return policy


def _pin(policy: AdaptivePolicy, leader: str) -> None:
    index = EXPERTS.index(leader)
    policy._leader = index
    policy._lru_order = index >= 2
    policy._second_sight = index % 2 == 1
    policy._follow = lambda sampled: None  # type: ignore[method-assign]


def _request_count(policy: AdaptivePolicy, key: bytes) -> int:
    """How many requests named ``key`` lately: the current generation's count, which
    includes half the previous one's."""
    count = policy._counts.get(key)
    return count if count is not None else policy._counts_before.get(key, 0) >> 1


def test_make_policy_builds_it_by_name() -> None:
    policy = make_policy("adaptive", 8)
    assert isinstance(policy, AdaptivePolicy) and policy.capacity == 8
    assert EXPERTS[policy._leader] == "arc"  # until a shadow is ahead of ARC's


@pytest.mark.parametrize(
    ("option", "value"),
    [("window", 0), ("window", 1.5), ("window", True), ("shadow_blocks", 0),
     ("horizon", -1), ("horizon", "8"), ("arc_bias", -0.1), ("arc_bias", float("nan")),
     ("arc_bias", "0")],
)  # fmt: skip
def test_a_bad_option_is_named(option: str, value: object) -> None:
    with pytest.raises(InvalidArgumentError, match=option):
        AdaptivePolicy(**{option: value})  # type: ignore[arg-type]


def _invariants(policy: AdaptivePolicy, resident: set[bytes]) -> None:  # type: ignore[override]
    state = arc_lists(policy)
    assert set(state.t1) | set(state.t2) == resident and len(policy) == len(resident)
    assert not (set(state.b1) | set(state.b2)) & resident, "a key is resident and a ghost"
    assert len(state.t1) + len(state.b1) <= policy.capacity
    assert len(state.b1) + len(state.b2) <= policy.capacity
    assert 0 <= state.target_t1 <= policy.capacity
    assert set(policy._last) == resident  # LRU's order covers exactly the resident keys
    for order in (state.t1, state.t2):  # each list is ordered by last use
        uses = [policy._last[k] for k in order]
        assert uses == sorted(uses)
    assert EXPERTS[policy._leader] in EXPERTS


@pytest.mark.parametrize("leader", [None, *EXPERTS])
@settings(max_examples=150, deadline=None)
@given(capacity=st.integers(1, 12), ops=st.lists(operations(16, max_evict=6), max_size=80))
def test_random_operations_keep_the_evict_contract_and_its_invariants(
    leader: str | None, capacity: int, ops: list[tuple]
) -> None:
    policy = _policy(capacity, leader, shadow_blocks=1)
    run_operations(policy, capacity, ops, 16, _invariants)  # type: ignore[arg-type]


def _random_requests(seed: int, count: int = 400) -> list[Request]:
    """Chains over a few shared prefixes, some requests repeated, some new."""
    rng = random.Random(seed)
    requests = []
    for t in range(count):
        root = rng.randrange(6) * 1000
        depth = rng.randrange(1, 12)
        tail = rng.randrange(40) * 20 + 100 + t * 100_000 * (rng.random() < 0.3)
        requests.append(Request(float(t), (root, root + 1, *range(tail, tail + depth)), 0, 0))
    return requests


@pytest.mark.parametrize(("leader", "reference"), [("arc", ARCPolicy), ("lru", LRUPolicy)])
def test_following_one_order_and_admitting_everything_is_that_policy(
    leader: str, reference: Callable[[], ARCPolicy | LRUPolicy]
) -> None:
    for seed in range(3):
        requests = _random_requests(seed)
        ours = CacheModel(37, _policy(37, leader))
        theirs = CacheModel(37, reference())
        for request in requests:
            keys = request.keys()
            assert ours.request(keys) == theirs.request(keys)
        assert set(ours.manager.ready_hashes()) == set(theirs.manager.ready_hashes())


def test_the_lru_order_takes_the_least_recently_used_of_both_lists() -> None:
    policy = _policy(8, "lru")
    for i in range(4):
        policy.insert(_key(i))
    policy.touch([_key(0)])  # 0 is in T2 now, the most recent of all
    policy.touch([_key(2), _key(1)])  # 1, 2 in T2 too; 2 more recent than 1
    state = arc_lists(policy)
    assert state.t1 == (_key(3),) and state.t2 == (_key(0), _key(1), _key(2))
    # ARC would take T1's 3 first; LRU takes 3 (older than every touch), then 0, then 1.
    assert policy.evict(3, _any) == [_key(3), _key(0), _key(1)]
    after = arc_lists(policy)
    assert after.b1 == (_key(3),) and after.b2 == (_key(0), _key(1))  # ARC's ghosts kept


def test_the_lru_order_skips_keys_it_may_not_evict() -> None:
    policy = _policy(8, "lru")
    for i in range(4):
        policy.insert(_key(i))
    policy.touch([_key(1)])
    pinned = {_key(0), _key(2)}
    assert policy.evict(2, lambda k: k not in pinned) == [_key(3), _key(1)]
    assert policy.evict(5, lambda k: k not in pinned) == []  # nothing else may go


def test_second_sight_admits_only_a_block_an_earlier_request_named() -> None:
    policy = _policy(8, "arc+second-sight")
    policy.touch([_key(1)])
    assert not policy.admit(_key(1))  # this request is its first
    policy.touch([_key(1)])
    assert policy.admit(_key(1)) and _request_count(policy, _key(1)) == 2
    assert _policy(8, "arc").admit(_key(2))  # admitting everything


def test_counts_halve_into_the_next_generation_and_then_are_gone() -> None:
    policy = _policy(2, window=2)  # a new generation every 4 touched keys
    for _ in range(3):
        policy.touch([_key(1)])
    policy.touch([_key(2)])  # the 4th key: a new generation
    assert _request_count(policy, _key(1)) == 1 and _request_count(policy, _key(2)) == 0
    policy.touch([_key(1)])  # 1 carried over (3 halved) plus this request
    assert _request_count(policy, _key(1)) == 2
    policy.touch([_key(3), _key(3), _key(3)])  # two generations later 2's count is gone
    policy.touch([_key(4)] * 4)
    assert _request_count(policy, _key(2)) == 0


def test_a_declined_block_is_not_stored_and_evicts_nothing() -> None:
    policy = AdaptivePolicy()
    manager = CPUOffloadingManager(2, policy=policy)
    _pin(policy, "lru+second-sight")
    keys = [_key(1), _key(2)]
    manager.touch(keys)
    manager.touch(keys)
    out = manager.prepare_store(keys)
    assert out is not None and out.block_hashes_to_store == keys
    manager.complete_store(keys)
    manager.touch([_key(3)])
    out = manager.prepare_store([_key(3)])
    assert out is not None and out.block_hashes_to_store == [] and out.block_hashes_evicted == []
    assert manager.lookup(keys) == 2


def test_remove_forgets_a_key_without_a_ghost() -> None:
    policy = _policy(4)
    policy.insert(_key(1))
    policy.remove(_key(1))
    assert _key(1) not in policy and _key(1) not in policy._last
    assert arc_lists(policy).b1 == ()
    with pytest.raises(BlockNotFoundError):
        policy.remove(_key(1))


def test_shadows_sample_about_shadow_blocks_of_a_large_cache() -> None:
    assert _policy(10_000)._sample == 39  # 256 blocks by default
    policy = _policy(10_000, shadow_blocks=500)
    assert policy._sample == 20
    assert all(s.capacity == 500 for s in policy._shadows)
    assert _policy(100, shadow_blocks=500)._sample == 1  # small: every key


@pytest.mark.parametrize(
    ("workload", "second_sight_leads"),
    [(hot_chain_and_one_offs, True), (pairs, False)],
)
def test_it_follows_the_shadow_that_is_ahead(
    workload: Callable[[int], list[Request]], second_sight_leads: bool
) -> None:
    requests = workload(60)
    policy = AdaptivePolicy()
    model = CacheModel(64, policy)
    for request in requests:
        model.request(request.keys())
    scores = {name: shadow.score for name, shadow in zip(EXPERTS, policy._shadows, strict=True)}
    assert EXPERTS[policy._leader] == max(scores, key=scores.__getitem__)
    assert EXPERTS[policy._leader].endswith("second-sight") is second_sight_leads
    best = max(
        simulate(requests, cpu_blocks=64, policy=_policy(64, leader)).hit_ratio
        for leader in EXPERTS
    )
    assert model.hit_ratio >= 0.9 * best  # it got most of what the best of the four got


def test_it_keeps_a_hot_set_through_scans_better_than_lru() -> None:
    assert hot_hits_under_scan(AdaptivePolicy(), 40) > hot_hits_under_scan(LRUPolicy(), 40)
