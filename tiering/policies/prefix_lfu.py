"""Frequency over age for prefix-chained KV blocks, leaves first (``"prefix-lfu"``).

A prefix-chained block is only useful while its parent is cached, shared system prompts'
first blocks are read by many sessions, and most blocks are read once. So:

* **Frequency over age.** Every :meth:`touch` naming a block adds one to its count,
  cached or not; a block not cached keeps its count in a *ghost*, whose counts halve
  every ``ghost_window`` x capacity touched keys (computed on read) and which holds at
  most ``ghost_factor`` x capacity keys, oldest dropped first. The victim is the
  evictable block with the lowest ``count / age ** age_weight`` (age: requests since
  its last touch, plus one).
* **O(classes), not O(n).** Blocks wait in one least-recently-touched queue per count
  class (1, 2-3, 4-7, ...); eviction compares only each queue's first evictable block.
* **Leaves first.** A block whose child is cached (learned from the key order
  :meth:`touch` gets) waits outside the queues, so the cache stays prefix-closed; when
  its last cached child leaves it rejoins its queue at the front. An inner block goes
  only if every evictable block is inner.

Hit ratios against LRU: ``docs/replay.md``.
"""

from __future__ import annotations

import zlib
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from tiering.abstract import BlockHash
from tiering.errors import InvalidArgumentError
from tiering.policies.base import EvictionPolicy
from tiering.validation import positive_int

CLASSES = 16
"""Count classes: class ``c`` holds counts in ``[2**(c-1), 2**c)``; the last, the rest."""
ADMISSIONS = ("duel", "all", "second-sight")
"""The admission rules a :class:`PrefixLFUPolicy` may follow (see its ``admission``)."""


@dataclass(frozen=True, slots=True)
class PrefixLFUState:
    """A copy of a :class:`PrefixLFUPolicy`'s counts, queues (``-1``: an inner block),
    ghost counts (oldest first) and cached children, for tests and debugging."""

    counts: Mapping[BlockHash, int]
    queue_of: Mapping[BlockHash, int]
    ghost: tuple[tuple[BlockHash, int], ...]
    children: Mapping[BlockHash, int]


class PrefixLFUPolicy(EvictionPolicy):
    """Evicts the cached leaf block with the lowest count / age**age_weight.

    ``age_weight``: 0 is pure frequency, 1 count per request since the last touch.
    ``ghost_window``, ``ghost_factor``: see the module docstring. ``admission``: which
    blocks a store may add: ``"all"``; ``"second-sight"``, only a block requested before
    (ghost count at least two); or ``"duel"``, whichever of the two is ahead in two
    shadow caches of ``capacity / sample`` blocks (at least 4) fed one key in ``sample``.
    Raises InvalidArgumentError for a negative or non-finite weight, a ghost window,
    ghost factor or sample that is not a positive int, or an unknown admission.
    """

    name = "prefix-lfu"

    def __init__(
        self,
        age_weight: float = 0.25,
        ghost_window: int = 8,
        ghost_factor: int = 32,
        admission: str = "duel",
        sample: int = 64,
    ) -> None:
        super().__init__()
        if admission not in ADMISSIONS:
            raise InvalidArgumentError(
                f"admission must be one of {', '.join(ADMISSIONS)}, got {admission!r}"
            )
        self.admission = admission
        self.sample = positive_int("sample", sample)
        self._second_sight = admission == "second-sight"  # the duel moves it
        self._shadows: tuple[_Shadow, _Shadow] | None = None  # made when bound
        if (
            isinstance(age_weight, bool)
            or not isinstance(age_weight, int | float)
            or not 0 <= age_weight < float("inf")
        ):
            raise InvalidArgumentError(f"age_weight must be a number >= 0, got {age_weight!r}")
        self.ghost_window = positive_int("ghost_window", ghost_window)
        self._touched = 0  # keys touched since the ghost last aged
        self.age_weight = float(age_weight)
        self.ghost_factor = positive_int("ghost_factor", ghost_factor)
        self._tick = 0  # one per touch: ages are counted in requests
        self._count: dict[BlockHash, int] = {}  # cached: its request count
        self._last: dict[BlockHash, int] = {}  # cached: the tick of its last touch
        self._class: dict[BlockHash, int] = {}  # cached: its queue, -1 while inner
        self._queues: list[OrderedDict[BlockHash, None]] = [OrderedDict() for _ in range(CLASSES)]
        # not cached: (count, epoch it was last set in); it halves each epoch since,
        # computed when read, so aging costs nothing however large the ghost
        self._ghost: OrderedDict[BlockHash, tuple[int, int]] = OrderedDict()
        self._epoch = 0
        self._parent: dict[BlockHash, BlockHash] = {}  # cached or ghost keys only
        self._children: dict[BlockHash, int] = {}  # key -> its cached children

    def bind(self, capacity: int) -> None:
        super().bind(capacity)
        if self.admission == "duel" and self._shadows is None:
            size = max(4, capacity // self.sample)
            self._shadows = (
                _Shadow(size, self._shadow_policy("all")),
                _Shadow(size, self._shadow_policy("second-sight")),
            )

    def _shadow_policy(self, admission: str) -> PrefixLFUPolicy:
        """A policy for one shadow of the duel: this one's weights and ghost, the given
        fixed admission (so the duel compares the admissions, nothing else)."""
        return PrefixLFUPolicy(
            age_weight=self.age_weight,
            ghost_window=self.ghost_window,
            ghost_factor=self.ghost_factor,
            admission=admission,
        )

    def admit(self, key: BlockHash) -> bool:
        # Second sight: requested before this request.
        return not self._second_sight or self._ghost_count(key) >= 2

    @property
    def prefers_second_sight(self) -> bool:
        """Whether admission is second-sight now: always with ``"second-sight"``, never
        with ``"all"``, and with ``"duel"`` while that shadow has more (decayed) hits."""
        return self._second_sight

    def insert(self, key: BlockHash) -> None:
        count = max(1, self._take_ghost(key))
        self._count[key] = count
        self._last[key] = self._tick
        parent = self._parent.get(key)
        if parent is not None:
            self._add_child(parent)
        if key in self._children:
            self._class[key] = -1
        else:
            self._enqueue(key)

    def touch(self, keys: Sequence[BlockHash]) -> None:
        self._tick += 1
        tick, count, last, ghost = self._tick, self._count, self._last, self._ghost
        klass, queues = self._class, self._queues
        previous: BlockHash | None = None
        for key in keys:
            if previous is not None and previous != key and self._parent.get(key) != previous:
                self._set_parent(key, previous)
            previous = key
            c = count.get(key)
            if c is None:
                ghost[key] = (self._take_ghost(key) + 1, self._epoch)
                continue
            count[key] = c = c + 1
            last[key] = tick
            queue = klass[key]
            if queue < 0:
                continue  # an inner block: its children go first
            if queue == min(c.bit_length(), CLASSES) - 1:
                queues[queue].move_to_end(key)
            else:
                self._dequeue(key)
                self._enqueue(key)
        self._touched += len(keys)
        if self._touched >= self.ghost_window * max(1, self.capacity):
            self._touched = 0
            self._epoch += 1  # every ghost count halves
        self._trim_ghost()
        if self._shadows is not None:
            sampled = [k for k in keys if zlib.crc32(k) % self.sample == 0]
            if sampled:
                everything, second = self._shadows
                everything.request(sampled)
                second.request(sampled)
                self._second_sight = second.hits > everything.hits

    def remove(self, key: BlockHash) -> None:
        self._forget(key)
        if key not in self._ghost:
            self._parent.pop(key, None)

    def evict(self, n: int, can_evict: Callable[[BlockHash], bool]) -> list[BlockHash]:
        victims: list[BlockHash] = []
        for _ in range(max(0, n)):
            victim = self._best_leaf(can_evict)
            if victim is None:
                victim = next(k for k, c in self._class.items() if c < 0 and can_evict(k))
            self._ghost[victim] = (self._count[victim], self._epoch)
            self._forget(victim)
            victims.append(victim)
        self._trim_ghost()
        return victims

    def snapshot(self) -> PrefixLFUState:
        """The policy's state now (copies)."""
        return PrefixLFUState(
            dict(self._count),
            dict(self._class),
            tuple((k, n) for k in self._ghost if (n := self._ghost_count(k))),
            {k: n for k, n in self._children.items() if k in self._count},
        )

    def __len__(self) -> int:
        return len(self._count)

    def __contains__(self, key: object) -> bool:
        return key in self._count

    def _best_leaf(self, can_evict: Callable[[BlockHash], bool]) -> BlockHash | None:
        """The lowest-scoring of the queues' first evictable leaves, or None."""
        best: BlockHash | None = None
        best_score = 0.0
        now, weight, count, last = self._tick + 1, self.age_weight, self._count, self._last
        for queue in self._queues:
            if not queue:
                continue
            for key in queue:
                if can_evict(key):
                    score = count[key] / (now - last[key]) ** weight
                    if best is None or score < best_score:
                        best, best_score = key, score
                    break
        return best

    def _enqueue(self, key: BlockHash, *, front: bool = False) -> None:
        c = min(self._count[key].bit_length(), CLASSES) - 1
        self._class[key] = c
        queue = self._queues[c]
        queue[key] = None
        if front:
            queue.move_to_end(key, last=False)

    def _dequeue(self, key: BlockHash) -> None:
        del self._queues[self._class[key]][key]
        self._class[key] = -1

    def _forget(self, key: BlockHash) -> None:
        """``key`` stops being cached (its ghost entry, if any, is the caller's)."""
        c = self._class.pop(key)
        if c >= 0:
            del self._queues[c][key]
        del self._count[key], self._last[key]
        parent = self._parent.get(key)
        if parent is not None:
            self._drop_child(parent)

    def _set_parent(self, key: BlockHash, parent: BlockHash) -> None:
        old = self._parent.get(key)
        cached = key in self._count
        if cached and old is not None:
            self._drop_child(old)
        self._parent[key] = parent
        if cached:
            self._add_child(parent)

    def _add_child(self, parent: BlockHash) -> None:
        children = self._children.get(parent, 0)
        self._children[parent] = children + 1
        if children == 0 and self._class.get(parent, -1) >= 0:
            self._dequeue(parent)  # an inner block now: its children go first

    def _drop_child(self, parent: BlockHash) -> None:
        children = self._children[parent] - 1
        if children:
            self._children[parent] = children
            return
        del self._children[parent]
        if parent in self._count:
            # A leaf again, and its class's next candidate: once a chain's tail has gone,
            # the rest of the chain follows unless it is requested again.
            self._enqueue(parent, front=True)

    def _ghost_count(self, key: BlockHash) -> int:
        """``key``'s ghost count, halved once per epoch since it was set (0 if absent)."""
        entry = self._ghost.get(key)
        return 0 if entry is None else entry[0] >> (self._epoch - entry[1])

    def _take_ghost(self, key: BlockHash) -> int:
        """Remove ``key`` from the ghost; its count now (0 if it was not there)."""
        count = self._ghost_count(key)
        self._ghost.pop(key, None)
        return count

    def _trim_ghost(self) -> None:
        ghost, limit = self._ghost, self.ghost_factor * max(1, self.capacity)
        while len(ghost) > limit:
            key, _ = ghost.popitem(last=False)
            self._parent.pop(key, None)


class _Shadow:
    """A miniature cache of sampled keys under one admission rule, counting its
    (decayed) hits: half of the duel."""

    __slots__ = ("capacity", "decay", "hits", "policy")

    def __init__(self, capacity: int, policy: PrefixLFUPolicy) -> None:
        self.capacity = capacity
        self.policy = policy
        self.policy.bind(capacity)
        self.hits = 0.0
        self.decay = 1.0 - 1.0 / (8 * capacity)  # remembers about 8 capacities of keys

    def request(self, keys: Sequence[BlockHash]) -> None:
        """One request's sampled keys, stored as a manager stores them (room for all the
        admitted new keys at once, its own cached keys protected)."""
        policy = self.policy
        policy.touch(keys)
        hits = sum(1 for key in keys if key in policy)
        self.hits = self.hits * self.decay ** len(keys) + hits
        new = [k for k in dict.fromkeys(keys) if k not in policy and policy.admit(k)]
        shortfall = len(policy) + len(new) - self.capacity
        if shortfall > 0:
            protected = set(keys)
            if len(policy) - sum(1 for k in protected if k in policy) < shortfall:
                return  # no room, as a manager's prepare_store would find
            policy.evict(shortfall, lambda k: k not in protected)
        for key in new:
            policy.insert(key)
