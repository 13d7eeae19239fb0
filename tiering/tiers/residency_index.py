"""The memory tier's residency index (sans-I/O; the tier owns the bytes and tells it what
happened). A key is *resident* once its bytes are complete in the tier; a *pin* is one
counted reason a key may not be evicted now (a load, a caller's :meth:`~ResidencyIndex.hold`),
taken before or after the key is resident."""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Iterable
from dataclasses import dataclass

from tiering.core.policies import EvictionPolicy, make_policy
from tiering.core.scheduler_api import BlockHash
from tiering.errors import InvalidArgumentError
from tiering.validation import hash_list, positive_int


@dataclass(frozen=True, slots=True)
class Room:
    """What :meth:`ResidencyIndex.reserve` granted: ``granted`` units reserved, and the
    ``victims`` evicted for them, in order, whose bytes are the caller's to remove."""

    granted: int
    victims: list[BlockHash]


def _hex(key: BlockHash) -> str:
    return key.hex() if isinstance(key, bytes) else repr(key)


class ResidencyIndex:
    """Resident keys, pins and eviction for a tier of ``capacity`` blocks. A pinned or
    protected key is never evicted; ``len(index) + index.reserved <= index.capacity``;
    a call that raises changes nothing. Raises InvalidArgumentError for a bad
    ``capacity``, UnknownPolicyError for a bad ``policy``."""

    def __init__(self, capacity: int, policy: str | EvictionPolicy = "lru") -> None:
        self.capacity = positive_int("capacity", capacity)
        self._policy = make_policy(policy, capacity)
        self._resident: set[BlockHash] = set()
        self._pins: dict[BlockHash, int] = {}
        self._holds: Counter[BlockHash] = Counter()
        self.pinned_resident = 0
        """Resident keys with at least one pin or hold."""
        self.reserved = 0
        """Units of room promised to stores in progress (or taken by no resident key)."""

    def __len__(self) -> int:
        return len(self._resident)

    def __contains__(self, key: object) -> bool:
        return key in self._resident

    def is_pinned(self, key: BlockHash) -> bool:
        """True if ``key`` has a pin or a hold (resident or not)."""
        return key in self._pins

    def holds(self, key: BlockHash) -> int:
        """How many holds ``key`` has."""
        return self._holds.get(key, 0)

    def evictable(self, protected: Collection[BlockHash] = ()) -> int:
        """How many resident keys eviction could take now, sparing ``protected``."""
        spared = sum(1 for key in set(protected) if key in self._resident and key not in self._pins)
        return len(self._resident) - self.pinned_resident - spared

    def insert(self, key: BlockHash, *, reserved: bool = False) -> bool:
        """Make ``key`` resident (most recently used); False if it already was. With
        ``reserved`` one reserved unit is consumed either way. Raises
        InvalidArgumentError if ``reserved`` but nothing is, or the index is full."""
        if reserved:
            if self.reserved <= 0:
                raise InvalidArgumentError(f"insert of {_hex(key)} from a reservation, but none")
            self.reserved -= 1
        elif key not in self._resident and len(self._resident) + self.reserved >= self.capacity:
            raise InvalidArgumentError(
                f"insert of {_hex(key)}: the index is full ({self.capacity} blocks)"
            )
        if key in self._resident:
            return False
        self._resident.add(key)
        self._policy.insert(key)
        if key in self._pins:
            self.pinned_resident += 1
        return True

    def touch(self, keys: Collection[BlockHash]) -> None:
        """Mark keys recently used, the first most recent; keys not resident are ignored."""
        self._policy.touch([key for key in keys if key in self._resident])

    def clear(self, *, keep_room_for_pinned: bool = False) -> list[BlockHash]:
        """Drop and return every resident key; pins and holds stay, and with
        ``keep_room_for_pinned`` so does each pinned key's unit, as reserved."""
        dropped = list(self._resident)
        for key in dropped:
            self._policy.remove(key)
        self._resident.clear()
        if keep_room_for_pinned:
            self.reserved += self.pinned_resident
        self.pinned_resident = 0
        return dropped

    def reserve(self, count: int, *, protected: Collection[BlockHash] = ()) -> Room:
        """Reserve up to ``count`` units, evicting unpinned, unprotected keys if needed.
        InvalidArgumentError for a negative ``count``."""
        if not isinstance(count, int) or count < 0:
            raise InvalidArgumentError(f"count must be an int >= 0, got {count!r}")
        room = self.capacity - len(self._resident) - self.reserved
        victims: list[BlockHash] = []
        shortfall = count - room
        if shortfall > 0:
            spared = frozenset(protected)
            n = min(shortfall, self.evictable(spared))
            if n > 0:
                pins = self._pins
                victims = self._policy.evict(n, lambda k: k not in pins and k not in spared)
                self._resident.difference_update(victims)
        granted = max(0, min(count, room + len(victims)))
        self.reserved += granted
        return Room(granted, victims)

    def unreserve(self, count: int) -> None:
        """Give back ``count`` reserved units; InvalidArgumentError if out of range."""
        if not isinstance(count, int) or not 0 <= count <= self.reserved:
            raise InvalidArgumentError(
                f"unreserve count must be an int in 0..{self.reserved}, got {count!r}"
            )
        self.reserved -= count

    def pin(self, keys: Iterable[BlockHash]) -> None:
        """Add one pin per occurrence of each key (resident or not)."""
        pins = self._pins
        resident = self._resident
        for key in keys:
            count = pins.get(key, 0)
            if not count and key in resident:
                self.pinned_resident += 1
            pins[key] = count + 1

    def unpin(self, keys: Iterable[BlockHash]) -> None:
        """Remove one pin per occurrence of each key; InvalidArgumentError if a key would
        lose more pins than it has."""
        wanted = Counter(keys)
        pins = self._pins
        for key, n in wanted.items():
            if pins.get(key, 0) < n:
                raise InvalidArgumentError(
                    f"unpin of block {_hex(key)}: it has {pins.get(key, 0)} pins, {n} asked to go"
                )
        resident = self._resident
        for key, n in wanted.items():
            pins[key] -= n
            if not pins[key]:
                del pins[key]
                if key in resident:
                    self.pinned_resident -= 1

    def hold(self, keys: Collection[BlockHash]) -> None:
        """Hold each key once more (a pin the caller owns; see :meth:`release`).
        InvalidArgumentError if ``keys`` is not a collection of bytes."""
        listed = hash_list("keys", keys)
        self._holds.update(listed)
        self.pin(listed)

    def release(self, keys: Collection[BlockHash]) -> list[BlockHash]:
        """Undo one :meth:`hold` per occurrence of each key; returns the keys as a list.
        InvalidArgumentError for keys not bytes or not held that often."""
        listed = hash_list("keys", keys)
        wanted = Counter(listed)
        for key, n in wanted.items():
            if self._holds.get(key, 0) < n:
                raise InvalidArgumentError(
                    f"release of block {_hex(key)}: held {self._holds.get(key, 0)} times, "
                    f"released {n} times"
                )
        self._holds -= wanted  # keeps positive counts only
        self.unpin(listed)
        return listed
