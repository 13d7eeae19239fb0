"""ARC or LRU, admitting everything or by second sight: as the best of four sampled
shadow caches (``"adaptive"``; why, and its hit ratios against LRU and ARC: docs/sweep.md).

* Two eviction orders over one resident set: ARC's lists, kept as :class:`ARCPolicy`
  keeps them, and each key's last use; LRU's victim is the older of ``T1``'s and
  ``T2``'s heads (each list is ordered by last use).
* Two admissions: everything, or *second sight*: a block only if an earlier request asked
  for it too, counted in two generations of request counts (a new one every ``window`` x
  capacity touched keys; a count carried over is halved).
* Four SHARDS-style shadows: 1 key in ``S`` = capacity // ``shadow_blocks`` (by CRC-32, at
  least 1) replayed through ARC and LRU caches of capacity / ``S`` blocks, each with either
  admission. A shadow scores the leading run of a request's sampled keys it holds (a
  prefix hit), decayed over ``horizon`` shadow capacities of sampled keys; the cache
  evicts and admits as the highest score, ARC's counted ``1 + arc_bias`` times."""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Sequence

from tiering.core.policies.arc import ARCPolicy
from tiering.core.policies.base import EvictionPolicy
from tiering.core.policies.lru import LRUPolicy
from tiering.core.scheduler_api import BlockHash
from tiering.validation import positive_int, real

EXPERTS = ("arc", "arc+second-sight", "lru", "lru+second-sight")
"""The four policies the shadows run, by name: eviction order, then admission."""


class AdaptivePolicy(ARCPolicy):
    """Evicts and admits as the leading shadow (see the module docstring); the options
    are named there. Raises InvalidArgumentError for a window, shadow size or horizon
    that is not a positive int, or a bias that is not a finite number >= 0.
    ``insert``/``touch``/``remove`` are O(1) a key plus the sampled shadows' work
    (O(1) a sampled key); ``evict`` is O(n + pinned keys passed)."""

    name = "adaptive"

    def __init__(
        self,
        window: int = 8,
        shadow_blocks: int = 256,
        horizon: int = 64,
        arc_bias: float = 0.02,
    ) -> None:
        super().__init__()
        self.window = positive_int("window", window)
        self.shadow_blocks = positive_int("shadow_blocks", shadow_blocks)
        self.horizon = positive_int("horizon", horizon)
        self.arc_bias = real("arc_bias", arc_bias, "a number >= 0", lambda b: 0 <= b < math.inf)
        self._seq = 0  # one per key use: LRU's order
        self._last: dict[BlockHash, int] = {}  # resident key -> its last use
        self._counts: dict[BlockHash, int] = {}  # requests naming a key, this generation
        self._counts_before: dict[BlockHash, int] = {}  # the generation before
        self._touched = 0  # keys touched this generation
        self._sample = 1
        self._shadows: list[Shadow] = []
        self._leader = 0  # index into EXPERTS
        self._lru_order = False
        self._second_sight = False

    def bind(self, capacity: int) -> None:
        super().bind(capacity)
        if self._shadows:
            return
        self._sample = max(1, capacity // self.shadow_blocks)
        size = max(1, capacity // self._sample)
        self._shadows = [Shadow(expert, size, self.horizon) for expert in EXPERTS]

    def admit(self, key: BlockHash) -> bool:
        return not self._second_sight or self._counts.get(key, 0) >= 2

    def insert(self, key: BlockHash) -> None:
        super().insert(key)
        self._seq += 1
        self._last[key] = self._seq

    def touch(self, keys: Sequence[BlockHash]) -> None:
        t1, t2, last, counts = self._t1, self._t2, self._last, self._counts
        to_mru, get, get_before = t2.move_to_end, counts.get, self._counts_before.get
        seq = self._seq
        # Walk backwards so keys[0] ends up the most recent of all.
        for key in reversed(keys):
            count = get(key)
            counts[key] = count + 1 if count is not None else (get_before(key, 0) >> 1) + 1
            if key in t2:
                to_mru(key)
            elif key in t1:
                del t1[key]
                t2[key] = None
            else:
                continue
            seq += 1
            last[key] = seq
        self._seq = seq
        self._touched += len(keys)
        if self._touched >= self.window * self.capacity:
            self._touched = 0
            self._counts_before = counts
            self._counts = {}
        sample = self._sample
        sampled = keys if sample == 1 else [k for k in keys if zlib.crc32(k) % sample == 0]
        if sampled:
            self._follow(sampled)

    def _follow(self, sampled: Sequence[BlockHash]) -> None:
        """Replay the sampled keys in every shadow, then follow the highest score."""
        unique = list(dict.fromkeys(sampled)) if len(sampled) > 1 else list(sampled)
        counts = self._counts
        shadows = self._shadows
        for shadow in shadows:
            shadow.request(sampled, unique, counts)
        best, best_score = 0, shadows[0].score * (1.0 + self.arc_bias)  # ARC's
        for i in range(1, len(shadows)):
            if shadows[i].score > best_score:
                best, best_score = i, shadows[i].score
        self._leader = best
        self._lru_order = best >= 2
        self._second_sight = best % 2 == 1

    def remove(self, key: BlockHash) -> None:
        super().remove(key)
        del self._last[key]

    def evict(self, n: int, can_evict: Callable[[BlockHash], bool]) -> list[BlockHash]:
        """As :meth:`ARCPolicy.evict`, in the leader's order; the victims' ghosts go to
        ``B1``/``B2`` either way."""
        if n <= 0:
            return []
        order = self._lru_victims if self._lru_order else self._victims
        victims = order(n, can_evict)
        self._retire(victims)
        last = self._last
        for key in victims:
            del last[key]
        return victims

    def _lru_victims(self, n: int, can_evict: Callable[[BlockHash], bool]) -> list[BlockHash]:
        """The ``n`` least recently used evictable keys: a merge of ``T1`` and ``T2``."""
        victims: list[BlockHash] = []
        last = self._last
        scan1, scan2 = filter(can_evict, self._t1), filter(can_evict, self._t2)
        head1, head2 = next(scan1, None), next(scan2, None)
        while len(victims) < n:
            if head1 is not None and (head2 is None or last[head1] < last[head2]):
                victims.append(head1)
                head1 = next(scan1, None)
            elif head2 is not None:
                victims.append(head2)
                head2 = next(scan2, None)
            else:
                break
        return victims


class Shadow:
    """A cache of sampled keys under one of :data:`EXPERTS` (eviction order and admission),
    scoring its decayed prefix hits; ``held`` mirrors the policy's resident keys (one set
    lookup). The lower tiers' adaptive admission runs two of them too."""

    __slots__ = ("capacity", "decay", "held", "policy", "score", "second_sight")

    def __init__(self, expert: str, capacity: int, horizon: int) -> None:
        self.policy: EvictionPolicy = ARCPolicy() if expert.startswith("arc") else LRUPolicy()
        self.policy.bind(capacity)
        self.capacity = capacity
        self.second_sight = expert.endswith("second-sight")
        self.held: set[BlockHash] = set()
        self.score = 0.0
        self.decay = 1.0 - 1.0 / (horizon * capacity)

    def request(
        self, keys: Sequence[BlockHash], unique: list[BlockHash], counts: dict[BlockHash, int]
    ) -> None:
        """One request's sampled keys (``unique``: without repeats), taken as the manager
        takes a request: touch, score the leading keys held, store the admitted rest
        (second sight: ``counts`` >= 2) if room can be made without evicting its own."""
        policy, held = self.policy, self.held
        policy.touch(keys)
        hits = 0
        for key in keys:
            if key not in held:
                break
            hits += 1
        self.score = self.score * self.decay ** len(keys) + hits
        if self.second_sight:
            new = [k for k in unique if k not in held and counts.get(k, 0) >= 2]
        else:
            new = [k for k in unique if k not in held]
        if not new:
            return
        shortfall = len(held) + len(new) - self.capacity
        if shortfall > 0:
            protected = held.intersection(keys)
            if len(held) - len(protected) < shortfall:
                return
            held.difference_update(policy.evict(shortfall, lambda k: k not in protected))
        insert = policy.insert
        for key in new:
            insert(key)
        held.update(new)
