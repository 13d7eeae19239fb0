"""The engine's decisions, without I/O: where each block comes from and goes to.

:class:`TransferPlanner` owns the CPU tier's :class:`CPUOffloadingManager` and asks the
secondary tiers only synchronous ``lookup`` questions. It turns an engine call into a
plan (which slots to fill, which to pin, which tier to promote from) and applies the
outcome when the I/O is done. The async engine executes plans; every rule about pins,
slots and hand-offs lives here and is testable without an event loop.

Fill hand-off: a CPU slot being filled (by a store from the device, or by a promotion
from a secondary tier) is not ready. A load that needs such a block registers as a
waiter; when the fill succeeds, :meth:`finish_fill` marks the block ready and pins it
once per waiter in the same synchronous step, so no eviction can slip in between.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from tiering.abstract import BlockHash, as_block_hashes
from tiering.errors import BlockNotFoundError, InvalidArgumentError
from tiering.manager import CPUOffloadingManager

TierLookup = Callable[[BlockHash], "bool | None"]


@dataclass(frozen=True, slots=True)
class StorePlan:
    """Copy ``device_ids[i]`` into CPU slot ``slots[i]`` for block ``hashes[i]``.

    ``evicted`` left the CPU tier to make room; ``evicted_slots[i]`` held ``evicted[i]``
    and still holds its bytes until the new copy overwrites it.
    """

    hashes: list[BlockHash]
    slots: list[int]
    device_ids: list[int]
    evicted: list[BlockHash] = field(default_factory=list)
    evicted_slots: list[int] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class LoadPlan:
    """Copy CPU slot ``slots[i]`` to device block ``device_ids[i]`` for ``hashes[i]``.

    ``pinned``: ready blocks pinned by the plan. ``awaited``: blocks whose CPU fill must
    finish first (each occurrence becomes a pin on success). ``promotions[t]``: blocks
    to read from secondary tier ``t`` into their new CPU slot, as ``(hash, slot)``.
    """

    hashes: list[BlockHash]
    slots: list[int]
    device_ids: list[int]
    pinned: list[BlockHash]
    awaited: list[BlockHash]
    promotions: dict[int, list[tuple[BlockHash, int]]]
    evicted: list[BlockHash] = field(default_factory=list)
    evicted_slots: list[int] = field(default_factory=list)


def _check_lengths(hashes: Sequence[BlockHash], device_ids: Sequence[int]) -> list[int]:
    ids = list(device_ids)
    if len(ids) != len(hashes):
        raise InvalidArgumentError(f"{len(hashes)} block hashes but {len(ids)} device block ids")
    return ids


class TransferPlanner:
    """Plans stores, loads and cascades over one CPU tier and its secondary tiers."""

    def __init__(
        self,
        manager: CPUOffloadingManager,
        tier_lookups: Sequence[TierLookup],
        *,
        servable: Sequence[bool] | None = None,
    ) -> None:
        """``tier_lookups[t]`` answers for secondary tier ``t``, fastest tier first.

        ``servable[t]`` False marks a tier that loads must never come from (it holds no
        bytes); it still counts for cascades. By default every tier is servable.
        """
        self.manager = manager
        self._tier_lookups = list(tier_lookups)
        self._servable = list(servable) if servable is not None else [True] * len(tier_lookups)
        if len(self._servable) != len(self._tier_lookups):
            raise InvalidArgumentError("servable needs one flag per tier lookup")
        self._waiters: Counter[BlockHash] = Counter()

    # ------------------------------------------------------------------ queries

    def lookup(self, block_hashes: Iterable[BlockHash]) -> int:
        """Leading hashes that are ready in the CPU tier or stored in a secondary tier."""
        is_ready = self.manager.is_ready
        n = 0
        for h in as_block_hashes(block_hashes):
            # A block being filled into CPU still lives in the tier it comes from.
            if not is_ready(h) and self.holder(h) is None:
                break
            n += 1
        return n

    def holder(self, block_hash: BlockHash) -> int | None:
        """Index of the first servable secondary tier that stores the block, or None."""
        for i, look in enumerate(self._tier_lookups):
            if self._servable[i] and look(block_hash) is True:
                return i
        return None

    def waiters(self, block_hash: BlockHash) -> int:
        """Loads waiting for this block's CPU fill (a test and metrics aid)."""
        return self._waiters[block_hash]

    # ------------------------------------------------------------------- stores

    def plan_store(
        self, block_hashes: Iterable[BlockHash], device_ids: Sequence[int]
    ) -> StorePlan | None:
        """Reserve CPU slots for the blocks not yet in the CPU tier.

        Returns None (and changes nothing) when the CPU tier cannot make room.

        Raises:
            InvalidArgumentError: non-bytes hashes or a length mismatch; nothing changed.
        """
        hashes = as_block_hashes(block_hashes)
        ids = _check_lengths(hashes, device_ids)
        out = self.manager.prepare_store(hashes)
        if out is None:
            return None
        first_id = {}
        for h, d in zip(hashes, ids, strict=True):
            first_id.setdefault(h, d)
        return StorePlan(
            list(out.block_hashes_to_store),
            list(out.store_spec.block_ids),
            [first_id[h] for h in out.block_hashes_to_store],
            list(out.block_hashes_evicted),
            list(out.evicted_block_ids),
        )

    def finish_fill(self, ok: Iterable[BlockHash], failed: Iterable[BlockHash]) -> None:
        """Apply the end of CPU fills: ``ok`` become ready, ``failed`` are dropped.

        Waiters of an ``ok`` block each receive a pin now; waiters of a failed block
        are forgotten (their loads fail that key).
        """
        ok = list(ok)
        failed = list(failed)
        manager = self.manager
        manager.complete_store(ok, success=True)
        manager.complete_store(failed, success=False)
        for h in ok:
            n = self._waiters.pop(h, 0)
            if n:
                manager.prepare_load([h] * n)
        for h in failed:
            self._waiters.pop(h, None)

    # -------------------------------------------------------------------- loads

    def plan_load(
        self, block_hashes: Iterable[BlockHash], device_ids: Sequence[int]
    ) -> LoadPlan | None:
        """Pin, await or promote every block of a load.

        Returns None (and changes nothing) when the CPU tier has no room for the blocks
        that must be promoted from a secondary tier.

        Raises:
            InvalidArgumentError: non-bytes hashes or a length mismatch.
            BlockNotFoundError: a hash is held by no tier; nothing changed.
        """
        hashes = as_block_hashes(block_hashes)
        ids = _check_lengths(hashes, device_ids)
        manager = self.manager
        sources: dict[BlockHash, int] = {}
        for h in hashes:
            if h in manager or h in sources:
                continue
            tier = self.holder(h)
            if tier is None:
                raise BlockNotFoundError(f"cannot load block {h.hex()}: no tier holds it")
            sources[h] = tier
        ready = [h for h in hashes if manager.is_ready(h)]
        in_flight = [h for h in hashes if h in manager and not manager.is_ready(h)]
        out = manager.prepare_store(hashes) if sources else None
        if sources and out is None:
            return None
        manager.prepare_load(ready)
        promotions: dict[int, list[tuple[BlockHash, int]]] = {}
        if out is not None:
            for h, slot in zip(out.block_hashes_to_store, out.store_spec.block_ids, strict=True):
                promotions.setdefault(sources[h], []).append((h, slot))
        awaited = in_flight + [h for h in hashes if h in sources]
        self._waiters.update(awaited)
        return LoadPlan(
            hashes=list(hashes),
            slots=[manager.slot_of(h) for h in hashes],
            device_ids=ids,
            pinned=ready,
            awaited=awaited,
            promotions=promotions,
            evicted=list(out.block_hashes_evicted) if out else [],
            evicted_slots=list(out.evicted_block_ids) if out else [],
        )

    def cancel_wait(self, block_hash: BlockHash, count: int = 1) -> None:
        """Withdraw ``count`` waiters of a block still being filled (a load gave up)."""
        left = self._waiters[block_hash] - count
        if left > 0:
            self._waiters[block_hash] = left
        else:
            self._waiters.pop(block_hash, None)

    def release(self, block_hashes: Iterable[BlockHash]) -> None:
        """Drop the pins a finished load held (each occurrence is one pin)."""
        self.manager.complete_load(block_hashes)

    # ----------------------------------------------------------------- cascades

    def plan_cascade(
        self, block_hashes: Iterable[BlockHash], tier: int
    ) -> list[tuple[BlockHash, int]]:
        """Pin the ready CPU blocks that secondary tier ``tier`` lacks; ``(hash, slot)`` each.

        The caller releases the returned hashes with :meth:`release` once the tier's
        store finished (successfully or not).
        """
        look = self._tier_lookups[tier]
        is_ready = self.manager.is_ready
        chosen = [h for h in dict.fromkeys(block_hashes) if is_ready(h) and look(h) is not True]
        spec = self.manager.prepare_load(chosen)
        return list(zip(chosen, spec.block_ids, strict=True))
