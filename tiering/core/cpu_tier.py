"""The CPU tier's block bookkeeping, sans-I/O: which block hash sits in which slot. It
sits on a scheduler's hot path: O(1) amortised per hash."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from tiering.core.policies import DEFAULT_POLICY, EvictionPolicy, make_policy
from tiering.core.scheduler_api import (
    BlockHash,
    CPULoadStoreSpec,
    OffloadingEvent,
    OffloadingManager,
    PrepareStoreOutput,
)
from tiering.errors import BlockNotFoundError, NotLoadingError
from tiering.validation import as_block_hashes, positive_int

_MEDIUM = "CPU"


@dataclass(frozen=True, slots=True)
class BlockState:
    """A snapshot of one resident block."""

    slot: int
    ref_count: int
    ready: bool


class CPUOffloadingManager(OffloadingManager):
    """Slots, readers and eviction for a CPU tier of ``num_blocks`` block-sized slots
    (docs/architecture.md#the-block-manager-and-eviction-policies). Every method
    completes or raises before changing anything, InvalidArgumentError for a hash that is
    not bytes; the constructor raises it for bad sizes, UnknownPolicyError for an unknown
    ``policy``."""

    def __init__(
        self,
        num_blocks: int,
        *,
        block_size: int = 16,
        policy: str | EvictionPolicy = DEFAULT_POLICY,
        enable_events: bool = False,
    ) -> None:
        self.num_blocks = positive_int("num_blocks", num_blocks)
        self.block_size = positive_int("block_size", block_size)
        self.policy = make_policy(policy, num_blocks)
        self._admits_everything = self.policy.admits_everything
        self.enable_events = enable_events
        # Readers and readiness in arrays indexed by slot: no object per block to collect.
        self._slot_of: dict[BlockHash, int] = {}
        self._ref: list[int] = [0] * num_blocks
        self._ready = bytearray(num_blocks)
        # Popping from the end hands out low slot ids first, in ascending order.
        self._free_slots: list[int] = list(range(num_blocks - 1, -1, -1))
        # Ready blocks with no reader (what eviction may take): its membership test is the
        # policy's predicate, so eviction never calls back into this module.
        self._evictable: set[BlockHash] = set()
        self._events: list[OffloadingEvent] = []

    def lookup(self, block_hashes: Iterable[BlockHash]) -> int:
        """Length of the leading run of hashes that are stored and ready."""
        slot_of, ready = self._slot_of, self._ready
        n = 0
        for h in as_block_hashes(block_hashes):
            slot = slot_of.get(h)
            if slot is None or not ready[slot]:
                break
            n += 1
        return n

    def ready_hashes(self) -> list[BlockHash]:
        """Every ready block's hash, least recently inserted first."""
        ready = self._ready
        return [h for h, slot in self._slot_of.items() if ready[slot]]

    def is_ready(self, block_hash: BlockHash) -> bool:
        """True if the block is resident and its store completed."""
        slot = self._slot_of.get(block_hash)
        return slot is not None and self._ready[slot] == 1

    def slot_of(self, block_hash: BlockHash) -> int:
        """The slot of a resident block (ready or not); raises BlockNotFoundError if none."""
        slot = self._slot_of.get(block_hash)
        if slot is None:
            raise BlockNotFoundError(f"block {block_hash.hex()} is not in the CPU tier")
        return slot

    def resident_slot(self, block_hash: BlockHash) -> int | None:
        """The slot of a resident block (ready or not), or None if it is not resident."""
        return self._slot_of.get(block_hash)

    def block_state(self, block_hash: BlockHash) -> BlockState | None:
        """The block's slot, reader count and readiness, or None if not resident."""
        slot = self._slot_of.get(block_hash)
        if slot is None:
            return None
        return BlockState(slot, self._ref[slot], self._ready[slot] == 1)

    def __len__(self) -> int:
        return len(self._slot_of)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._slot_of

    @property
    def num_evictable(self) -> int:
        """Ready blocks with no reader: what eviction may take."""
        return len(self._evictable)

    @property
    def num_pinned(self) -> int:
        """Blocks with at least one reader."""
        return len(self._ref) - self._ref.count(0)  # a free slot has none

    def prepare_load(self, block_hashes: Iterable[BlockHash]) -> CPULoadStoreSpec:
        """Add a reader to each block (two for a hash named twice) and return their slots,
        in order. Raises BlockNotFoundError if a hash is not resident or not ready."""
        hashes = as_block_hashes(block_hashes)
        slot_of, ref, ready, evictable = self._slot_of, self._ref, self._ready, self._evictable
        slots: list[int] = []
        for i, h in enumerate(hashes):
            slot = slot_of.get(h)
            if slot is None or not ready[slot]:
                self._add_readers(hashes[:i], -1)
                state = "not stored" if slot is None else "still being stored"
                raise BlockNotFoundError(f"cannot load block {h!r} ({h.hex()}): {state}")
            if ref[slot] == 0:
                evictable.discard(h)
            ref[slot] += 1
            slots.append(slot)
        return CPULoadStoreSpec(slots)

    def complete_load(self, block_hashes: Iterable[BlockHash]) -> None:
        """Remove one reader from each block. Raises NotLoadingError if a hash has no
        reader left (or is not resident)."""
        hashes = as_block_hashes(block_hashes)
        slot_of, ref = self._slot_of, self._ref
        for i, h in enumerate(hashes):
            slot = slot_of.get(h)
            if slot is None or ref[slot] == 0:
                self._add_readers(hashes[:i], 1)
                raise NotLoadingError(
                    f"complete_load of block {h!r} ({h.hex()}), which has no reader"
                )
            ref[slot] -= 1
            if ref[slot] == 0:
                self._evictable.add(h)

    def _add_readers(self, hashes: Sequence[BlockHash], delta: int) -> None:
        """Undo a failed call's first steps: ``delta`` readers more on each resident hash."""
        ref, evictable = self._ref, self._evictable
        for h in hashes:
            slot = self._slot_of[h]
            if ref[slot] == 0:
                evictable.discard(h)
            ref[slot] += delta
            if ref[slot] == 0:
                evictable.add(h)

    def touch(self, block_hashes: Iterable[BlockHash]) -> None:
        """Mark resident blocks most recently used, the first most recent of all; hashes
        not resident are ignored."""
        self.policy.touch(as_block_hashes(block_hashes))

    def prepare_store(
        self, block_hashes: Iterable[BlockHash], *, admission: bool = True
    ) -> PrepareStoreOutput | None:
        """Give a slot to every hash not yet resident that the policy admits (asked only
        with ``admission``), evicting if needed but never a hash named in the call;
        ``None`` (and nothing changed) if not enough blocks can be evicted. New blocks are
        not ready until ``complete_store``."""
        hashes = as_block_hashes(block_hashes)
        slot_of, ready = self._slot_of, self._ready
        unique = hashes if len(hashes) == 1 else dict.fromkeys(hashes)
        to_store = [h for h in unique if h not in slot_of]
        if admission and not self._admits_everything:
            admit = self.policy.admit
            to_store = [h for h in to_store if admit(h)]
        shortfall = len(to_store) - len(self._free_slots)
        evicted: list[BlockHash] = []
        evicted_slots: list[int] = []
        if shortfall > 0:
            evictable = self._evictable
            protected = evictable.intersection(hashes)
            if len(evictable) - len(protected) < shortfall:
                return None
            evictable -= protected
            try:
                evicted = self.policy.evict(shortfall, evictable.__contains__)
            finally:
                evictable |= protected
            evictable.difference_update(evicted)
            evicted_slots = [slot_of.pop(h) for h in evicted]
            # Reversed so the first victim's slot is handed out first.
            self._free_slots.extend(reversed(evicted_slots))
            if self.enable_events:
                self._events.append(OffloadingEvent(evicted, self.block_size, _MEDIUM, True))

        free = self._free_slots
        insert = self.policy.insert
        slots: list[int] = []
        for h in to_store:
            slot = free.pop()
            slot_of[h] = slot
            ready[slot] = 0
            insert(h)
            slots.append(slot)
        return PrepareStoreOutput(to_store, CPULoadStoreSpec(slots), evicted, evicted_slots)

    def complete_store(self, block_hashes: Iterable[BlockHash], success: bool = True) -> None:
        """Finish stores prepared earlier: the named in-flight blocks become ready, or
        without ``success`` leave and free their slots; other hashes are left alone."""
        hashes = as_block_hashes(block_hashes)
        slot_of, ref, ready = self._slot_of, self._ref, self._ready
        stored: list[BlockHash] = []
        for h in hashes:
            slot = slot_of.get(h)
            if slot is None or ready[slot]:
                continue
            if success:
                ready[slot] = 1
                if ref[slot] == 0:
                    self._evictable.add(h)
                stored.append(h)
            else:
                del slot_of[h]
                self.policy.remove(h)
                self._free_slots.append(slot)
        if stored and self.enable_events:
            self._events.append(OffloadingEvent(stored, self.block_size, _MEDIUM, False))

    def take_events(self) -> list[OffloadingEvent]:
        """The events since the last call, oldest first; clears them."""
        events, self._events = self._events, []
        return events
