"""Test helpers shared by the policy test modules (not a test module itself)."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from hypothesis import strategies as st

from tiering.core.policies import ARCPolicy, S3FIFOPolicy
from tiering.core.policies.base import EvictionPolicy
from tiering.lab.workloads import Request


class ARCLists(NamedTuple):
    """An ARC policy's lists, each least recent first: resident keys seen once (``t1``)
    or again or readmitted from a ghost (``t2``), the ghosts evicted from each (``b1``,
    ``b2``), and the target ``p`` for ``|t1|``."""

    t1: tuple[bytes, ...]
    t2: tuple[bytes, ...]
    b1: tuple[bytes, ...]
    b2: tuple[bytes, ...]
    target_t1: float


def arc_lists(policy: ARCPolicy) -> ARCLists:
    """A copy of ``policy``'s lists, read from its state: the rules of the paper these
    tests check are the policy's inside, not a caller's view."""
    return ARCLists(
        tuple(policy._t1), tuple(policy._t2), tuple(policy._b1), tuple(policy._b2), policy._p
    )


class S3FIFOQueues(NamedTuple):
    """An S3-FIFO policy's queues ``S``, ``M`` and ``G``, each oldest (next out) first,
    and every resident key's counter (0..3)."""

    small: tuple[bytes, ...]
    main: tuple[bytes, ...]
    ghost: tuple[bytes, ...]
    freq: dict[bytes, int]


def s3fifo_queues(policy: S3FIFOPolicy) -> S3FIFOQueues:
    """A copy of ``policy``'s queues, read from its state (as :func:`arc_lists`)."""
    return S3FIFOQueues(
        tuple(policy._small), tuple(policy._main), tuple(policy._ghost), dict(policy._freq)
    )


def key(i: int) -> bytes:
    return b"blk-%d" % i


def any_key(_key: bytes) -> bool:
    return True


def operations(universe: int, max_evict: int) -> st.SearchStrategy[tuple]:
    """Random insert/touch/remove/evict steps over keys ``key(0..universe-1)``.

    An evict step carries a seed for ``n`` and a set of pinned key ids.
    """
    ids = st.integers(0, universe - 1)
    return st.one_of(
        st.tuples(st.just("insert"), ids),
        st.tuples(st.just("touch"), st.lists(ids, max_size=4)),
        st.tuples(st.just("remove"), ids),
        st.tuples(st.just("evict"), st.integers(0, max_evict), st.frozensets(ids)),
    )


def run_operations(
    policy: EvictionPolicy,
    capacity: int,
    ops: list[tuple],
    universe: int,
    check: Callable[[EvictionPolicy, set[bytes]], None],
) -> None:
    """Apply ``ops`` as a manager would, asserting the evict contract after each step.

    The contract: exactly ``n`` distinct victims, all resident and accepted by
    ``can_evict``; residency matches a plain model; then ``check`` (the policy's own
    invariants) runs against the model's resident set.
    """
    resident: set[bytes] = set()
    for op in ops:
        if op[0] == "insert":
            k = key(op[1])
            if k in resident or len(resident) >= capacity:
                continue
            policy.insert(k)
            resident.add(k)
        elif op[0] == "touch":
            policy.touch([key(i) for i in op[1]])
        elif op[0] == "remove":
            k = key(op[1])
            if k not in resident:
                continue
            policy.remove(k)
            resident.discard(k)
        else:
            _, n_seed, pinned_ids = op
            pinned = {key(i) for i in pinned_ids}
            evictable = resident - pinned
            n = n_seed % (len(evictable) + 1)
            victims = policy.evict(n, lambda k, pinned=pinned: k not in pinned)
            assert len(victims) == n
            assert len(set(victims)) == n
            assert set(victims) <= evictable
            resident -= set(victims)
        for i in range(universe):
            assert (key(i) in policy) == (key(i) in resident)
        check(policy, resident)


def hot_hits_under_scan(policy: EvictionPolicy, capacity: int) -> int:
    """Hits on a small hot set re-read between bursts of one-time scan keys."""
    policy.bind(capacity)
    hot = [b"hot-%d" % i for i in range(capacity // 4)]

    def access(k: bytes) -> bool:
        if k in policy:
            policy.touch([k])
            return True
        if len(policy) >= capacity:
            policy.evict(1, any_key)
        policy.insert(k)
        return False

    for _ in range(2):
        for k in hot:
            access(k)
    hits = 0
    scan_ids = iter(range(10**9))
    for _ in range(10):
        # A burst as long as the cache: LRU loses every hot key to it.
        for _ in range(capacity):
            access(b"scan-%d" % next(scan_ids))
        hits += sum(access(k) for k in hot)
    return hits


def hot_chain_and_one_offs(requests: int) -> list[Request]:
    """Every request: the same 32-block chain, then 48 blocks nobody asks for again."""
    fresh = iter(range(1000, 10**6))
    return [
        Request(float(t), (*range(32), *(next(fresh) for _ in range(48))), 80 * 512, 0)
        for t in range(requests)
    ]


def pairs(requests: int) -> list[Request]:
    """Every block is asked for twice, by two requests in a row, and never again."""
    return [
        Request(float(t), tuple(range(40 * (t // 2), 40 * (t // 2) + 40)), 40 * 512, 0)
        for t in range(requests)
    ]
