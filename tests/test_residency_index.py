"""ResidencyIndex: pins, holds, protected eviction, exact counts, capacity (model-checked)."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
)

from tiering.core.policies import policy_names
from tiering.errors import InvalidArgumentError, UnknownPolicyError
from tiering.tiers.residency_index import ResidencyIndex

KEYS = [b"k%02d" % i for i in range(12)]
key_st = st.sampled_from(KEYS)
keys_st = st.lists(key_st, max_size=4)


class ResidencyMachine(RuleBasedStateMachine):
    """Drives one index against a plain model: resident set, pin and hold counts,
    reserved units."""

    @initialize(capacity=st.integers(1, 6), policy=st.sampled_from(policy_names()))
    def build(self, capacity: int, policy: str) -> None:
        self.index = ResidencyIndex(capacity, policy)
        self.capacity = capacity
        self.resident: set[bytes] = set()
        self.pins: Counter[bytes] = Counter()  # all pins, holds included
        self.holds: Counter[bytes] = Counter()
        self.reserved = 0

    # -- operations -------------------------------------------------------------------

    @rule(key=key_st)
    def insert_from_reservation(self, key: bytes) -> None:
        if self.reserved == 0:
            with pytest.raises(InvalidArgumentError):
                self.index.insert(key, reserved=True)
            return
        assert self.index.insert(key, reserved=True) == (key not in self.resident)
        self.reserved -= 1
        self.resident.add(key)

    @rule(key=key_st)
    def insert_directly(self, key: bytes) -> None:
        full = len(self.resident) + self.reserved >= self.capacity
        if key not in self.resident and full:
            with pytest.raises(InvalidArgumentError, match="full"):
                self.index.insert(key)
            return
        assert self.index.insert(key) == (key not in self.resident)
        self.resident.add(key)

    @rule(keys=keys_st)
    def pin(self, keys: list[bytes]) -> None:
        self.index.pin(keys)
        self.pins.update(keys)

    @rule(keys=keys_st)
    def unpin(self, keys: list[bytes]) -> None:
        if Counter(keys) - self.pins:
            with pytest.raises(InvalidArgumentError, match="unpin of block"):
                self.index.unpin(keys)
            return
        if Counter(keys) - (self.pins - self.holds):
            return  # would take a hold's pin: a caller error the index cannot tell
        self.index.unpin(keys)
        self.pins.subtract(keys)
        self.pins = +self.pins

    @rule(keys=keys_st)
    def hold(self, keys: list[bytes]) -> None:
        self.index.hold(keys)
        self.holds.update(keys)
        self.pins.update(keys)

    @rule(keys=keys_st)
    def release(self, keys: list[bytes]) -> None:
        if Counter(keys) - self.holds:
            with pytest.raises(InvalidArgumentError, match="release of block"):
                self.index.release(keys)
            return
        self.index.release(keys)
        self.holds.subtract(keys)
        self.holds = +self.holds
        self.pins.subtract(keys)
        self.pins = +self.pins

    @rule(count=st.integers(0, 5), protected=keys_st)
    def reserve(self, count: int, protected: list[bytes]) -> None:
        evictable = {k for k in self.resident if not self.pins[k] and k not in protected}
        assert self.index.evictable(protected) == len(evictable)
        room = self.capacity - len(self.resident) - self.reserved
        room_result = self.index.reserve(count, protected=protected)
        victims = room_result.victims
        assert len(victims) == len(set(victims))
        assert set(victims) <= evictable, "evicted a pinned, held or protected key"
        # Exactly as many victims as needed (or as there are).
        assert len(victims) == max(0, min(count - room, len(evictable)))
        assert room_result.granted == max(0, min(count, room + len(victims)))
        self.resident -= set(victims)
        self.reserved += room_result.granted

    @rule(data=st.data())
    def unreserve(self, data: st.DataObject) -> None:
        count = data.draw(st.integers(0, self.reserved + 1))
        if count > self.reserved:
            with pytest.raises(InvalidArgumentError, match="unreserve"):
                self.index.unreserve(count)
            return
        self.index.unreserve(count)
        self.reserved -= count

    @rule(keys=keys_st)
    def touch(self, keys: list[bytes]) -> None:
        self.index.touch(keys)

    @rule(keep=st.booleans())
    def clear(self, keep: bool) -> None:
        dropped = self.index.clear(keep_room_for_pinned=keep)
        assert sorted(dropped) == sorted(self.resident)
        if keep:
            self.reserved += sum(1 for k in self.resident if self.pins[k])
        self.resident.clear()

    # -- invariants -------------------------------------------------------------------

    @invariant()
    def counts_are_exact(self) -> None:
        index = self.index
        assert len(index) == len(self.resident)
        assert len(index._policy) == len(self.resident), "policy and index disagree"
        assert index.reserved == self.reserved
        assert index.pinned_resident == sum(1 for k in self.resident if self.pins[k])
        assert index.evictable() == sum(1 for k in self.resident if not self.pins[k])
        for key in KEYS:
            assert (key in index) == (key in self.resident)
            assert index.is_pinned(key) == (self.pins[key] > 0)
            assert index.holds(key) == self.holds[key]

    @invariant()
    def capacity_is_respected(self) -> None:
        assert len(self.index) + self.index.reserved <= self.capacity


ResidencyMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=40)
TestResidencyMachine = ResidencyMachine.TestCase


def test_release_more_than_held_names_the_key_in_hex_and_changes_nothing() -> None:
    index = ResidencyIndex(4)
    index.insert(b"\xab\xcd")
    index.hold([b"\xab\xcd"])
    with pytest.raises(InvalidArgumentError, match="abcd"):
        index.release([b"\xab\xcd", b"\xab\xcd"])
    assert index.holds(b"\xab\xcd") == 1 and index.pinned_resident == 1


@pytest.mark.parametrize("keys", [None, b"abc", "abc", 5, [b"a", 1]])
def test_hold_of_something_that_is_not_bytes_keys_is_refused(keys: object) -> None:
    index = ResidencyIndex(4)
    with pytest.raises(InvalidArgumentError, match="keys"):
        index.hold(keys)  # type: ignore[arg-type]
    assert not index.is_pinned(b"a")


def test_a_hold_taken_before_the_key_is_stored_protects_it_once_stored() -> None:
    index = ResidencyIndex(2)
    index.hold([b"a"])
    index.insert(b"a")
    index.insert(b"b")
    room = index.reserve(2)
    assert room.victims == [b"b"] and room.granted == 1 and b"a" in index
    index.release([b"a"])
    index.unreserve(1)
    assert index.reserve(2).victims == [b"a"]


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda i: i.reserve(-1), "count"),
        (lambda i: i.reserve(1.5), "count"),
        (lambda i: i.unreserve(1), "unreserve"),
        (lambda i: i.unpin([b"x"]), "unpin of block 78"),
    ],
)
def test_bad_calls_raise_and_change_nothing(call: object, match: str) -> None:
    index = ResidencyIndex(2)
    index.insert(b"x")
    with pytest.raises(InvalidArgumentError, match=match):
        call(index)  # type: ignore[operator]
    assert len(index) == 1 and index.reserved == 0 and not index.is_pinned(b"x")


def test_constructor_validates_capacity_and_policy() -> None:
    with pytest.raises(InvalidArgumentError, match="capacity"):
        ResidencyIndex(0)
    with pytest.raises(UnknownPolicyError):
        ResidencyIndex(4, "nope")
