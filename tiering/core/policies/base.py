"""The eviction-policy interface the block managers use: a policy only orders keys (it
knows nothing of slots, readers or readiness) and never evicts a key the manager's
predicate rejects."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence

from tiering.core.scheduler_api import BlockHash
from tiering.errors import InvalidArgumentError
from tiering.validation import positive_int


class EvictionPolicy(ABC):
    """Decides which resident keys leave first.

    Protocol (guaranteed by the owning manager): ``bind(capacity)`` comes first, once;
    ``insert(key)`` names a key not resident; ``touch(keys)`` ignores keys not resident;
    ``remove(key)`` forgets a resident key without history (a failed store);
    ``evict(n, can_evict)`` is called only when at least ``n`` resident keys satisfy
    ``can_evict`` and returns exactly ``n`` distinct such keys, no longer resident;
    ``admit(key)`` is asked before a store gives a key a slot."""

    name: str = ""

    def __init__(self) -> None:
        self.capacity = 0

    def bind(self, capacity: int) -> None:
        """Size the policy for ``capacity`` blocks. Raises InvalidArgumentError for a bad
        capacity or one other than already bound (an instance serves one tier)."""
        positive_int("capacity", capacity)
        if self.capacity and self.capacity != capacity:
            raise InvalidArgumentError(
                f"{type(self).__name__} is already bound to a tier of {self.capacity} blocks"
            )
        self.capacity = capacity

    @abstractmethod
    def insert(self, key: BlockHash) -> None:
        """A new key became resident (most recently used)."""

    @abstractmethod
    def touch(self, keys: Sequence[BlockHash]) -> None:
        """The keys were accessed; ``keys[0]`` counts as the most recent access."""

    @abstractmethod
    def remove(self, key: BlockHash) -> None:
        """A resident key left without being evicted."""

    @abstractmethod
    def evict(self, n: int, can_evict: Callable[[BlockHash], bool]) -> list[BlockHash]:
        """Pick and drop ``n`` distinct resident keys accepted by ``can_evict`` (fewer,
        without looping forever, if fewer are evictable)."""

    def admit(self, key: BlockHash) -> bool:
        """Whether a store may give ``key`` a slot (the default: always)."""
        return True

    @property
    def admits_everything(self) -> bool:
        """True unless the policy overrides :meth:`admit`."""
        return type(self).admit is EvictionPolicy.admit

    @abstractmethod
    def __len__(self) -> int:
        """Number of resident keys."""

    def __contains__(self, key: object) -> bool:
        raise NotImplementedError
