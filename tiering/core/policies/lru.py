"""Least-recently-used eviction."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from itertools import islice

from tiering.core.policies.base import EvictionPolicy
from tiering.core.scheduler_api import BlockHash


class LRUPolicy(EvictionPolicy):
    """Evicts the least recently inserted-or-touched key that may be evicted."""

    name = "lru"

    def __init__(self) -> None:
        super().__init__()
        # Oldest first: the head is the next victim.
        self._order: OrderedDict[BlockHash, None] = OrderedDict()

    def insert(self, key: BlockHash) -> None:
        self._order[key] = None

    def touch(self, keys: Sequence[BlockHash]) -> None:
        order = self._order
        move = order.move_to_end
        # Walk backwards so keys[0] ends up the most recent of all.
        for key in reversed(keys):
            if key in order:
                move(key)

    def remove(self, key: BlockHash) -> None:
        del self._order[key]

    def evict(self, n: int, can_evict: Callable[[BlockHash], bool]) -> list[BlockHash]:
        order = self._order
        victims = list(islice(filter(can_evict, order), max(n, 0)))
        for key in victims:
            del order[key]
        return victims

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order
