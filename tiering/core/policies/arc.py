"""Adaptive Replacement Cache eviction (Megiddo & Modha, FAST'03)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence

from tiering.core.policies.base import EvictionPolicy
from tiering.core.scheduler_api import BlockHash
from tiering.errors import BlockNotFoundError, InvalidArgumentError

_ABSENT = object()


class ARCPolicy(EvictionPolicy):
    """ARC (Megiddo & Modha) with capacity ``c`` and adaptive ``T1`` target ``p``.

    One deviation from the paper: the manager evicts before it inserts, so REPLACE
    cannot know whether the incoming key is a ``B2`` ghost and ties (``|T1| == p``) go
    to ``T2``. When the preferred list has no evictable key, the other one gives. After
    every call ``|T1| + |B1| <= c`` and ``|B1| + |B2| <= c`` (oldest ghosts dropped), and
    no key is both resident and a ghost. ``remove`` leaves no ghost and keeps ``p``.
    ``insert``/``touch``/``remove`` are O(1) a key, ``evict`` O(n + pinned keys passed)."""

    name = "arc"

    def __init__(self) -> None:
        super().__init__()
        # Each list is ordered least recent first: the head is the next victim.
        self._t1: OrderedDict[BlockHash, None] = OrderedDict()
        self._t2: OrderedDict[BlockHash, None] = OrderedDict()
        self._b1: OrderedDict[BlockHash, None] = OrderedDict()
        self._b2: OrderedDict[BlockHash, None] = OrderedDict()
        self._p = 0.0

    def insert(self, key: BlockHash) -> None:
        """Admit ``key`` (to ``T2`` if it is a ghost, adapting ``p``; else to ``T1``).
        Raises InvalidArgumentError if it is already resident."""
        t1, t2 = self._t1, self._t2
        if key in t2 or key in t1:
            raise InvalidArgumentError(f"key {key!r} is already resident in the ARC policy")
        b1, b2 = self._b1, self._b2
        if key in b1:
            # Sizes before the hit leaves B1: the paper's delta_1.
            self._p = min(self._p + max(len(b2) / len(b1), 1.0), float(self.capacity))
            del b1[key]
        elif key in b2:
            self._p = max(self._p - max(len(b1) / len(b2), 1.0), 0.0)
            del b2[key]
        else:
            t1[key] = None
            # |T1| + |B1| <= c held before (or B1 is empty), so one ghost is enough.
            if b1 and len(t1) + len(b1) > self.capacity:
                b1.popitem(last=False)
            return
        t2[key] = None  # a ghost hit

    def touch(self, keys: Sequence[BlockHash]) -> None:
        t1, t2 = self._t1, self._t2
        to_mru = t2.move_to_end
        # Walk backwards so keys[0] ends up the most recent of all.
        for key in reversed(keys):
            if key in t2:
                to_mru(key)
            elif key in t1:
                del t1[key]
                t2[key] = None

    def remove(self, key: BlockHash) -> None:
        """Forget resident ``key`` without a ghost entry (BlockNotFoundError if absent)."""
        if self._t1.pop(key, _ABSENT) is _ABSENT and self._t2.pop(key, _ABSENT) is _ABSENT:
            raise BlockNotFoundError(f"key {key!r} is not resident in the ARC policy")

    def evict(self, n: int, can_evict: Callable[[BlockHash], bool]) -> list[BlockHash]:
        """As :meth:`EvictionPolicy.evict`; ``can_evict`` is called at most once a key."""
        if n <= 0:
            return []
        victims = self._victims(n, can_evict)
        self._retire(victims)
        return victims

    def _victims(self, n: int, can_evict: Callable[[BlockHash], bool]) -> list[BlockHash]:
        """The ``n`` evictable keys ARC's order picks, nothing changed yet (so the
        iterators stay valid); an iterator is dropped once its list has none left."""
        victims: list[BlockHash] = []
        # What |T1| will be once the victims chosen so far are gone.
        size1 = len(self._t1)
        scan1: Iterator[BlockHash] | None = filter(can_evict, self._t1)
        scan2: Iterator[BlockHash] | None = filter(can_evict, self._t2)
        p = self._p
        while len(victims) < n:
            if scan1 is not None and (size1 > p or scan2 is None):
                if (key := next(scan1, None)) is None:
                    scan1 = None
                else:
                    victims.append(key)
                    size1 -= 1
            elif scan2 is not None:
                if (key := next(scan2, None)) is None:
                    scan2 = None
                else:
                    victims.append(key)
            else:
                break
        return victims

    def _retire(self, victims: list[BlockHash]) -> None:
        """Move ``victims`` to their ghost lists, then trim the ghosts to the capacity."""
        t1, t2, b1, b2 = self._t1, self._t2, self._b1, self._b2
        for key in victims:
            if t1.pop(key, _ABSENT) is _ABSENT:
                del t2[key]
                b2[key] = None
            else:
                b1[key] = None
        capacity = self.capacity
        excess = len(t1) + len(b1) - capacity
        while excess > 0 and b1:
            b1.popitem(last=False)
            excess -= 1
        # Once |T1| + |B1| <= c holds, B1 alone is within c, so B2 is never empty here;
        # `b2 or b1` only guards a manager that overfills the tier.
        excess = len(b1) + len(b2) - capacity
        while excess > 0 and (b2 or b1):
            (b2 or b1).popitem(last=False)
            excess -= 1

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)

    def __contains__(self, key: object) -> bool:
        # T2 first: it holds the keys that keep getting hit.
        return key in self._t2 or key in self._t1
