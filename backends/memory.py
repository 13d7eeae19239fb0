"""An in-memory secondary tier that really holds the bytes: the data-integrity reference.

Its storage is one preallocated numpy arena of ``max_blocks`` rows: a row copy is one
memcpy with the GIL released (a memoryview slice assignment holds it), so jobs' copies
overlap on the io threads. The bookkeeping (rows; residency, pins, holds and eviction in
a :class:`~tiering.tiers.residency_index.ResidencyIndex`) lives on the loop thread.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Sequence
from typing import Any

import numpy as np

from tiering.core.policies import EvictionPolicy
from tiering.observe.statistics import NO_ROOM, FailureLog
from tiering.options import ActorOptions, PositiveInt
from tiering.tiers.actor import TierActor
from tiering.tiers.residency_index import ResidencyIndex
from tiering.tiers.tier_api import JobMetadata, JobResult, OffloadKey, ReqContext
from tiering.validation import check_offload_key

logger = logging.getLogger(__name__)

_NOT_HELD = "not in the memory tier"
_FULL = "memory tier full"


class MemoryOptions(ActorOptions):
    """The memory tier's options: room for ``max_blocks`` blocks, evicted by ``policy``
    (a policy name or instance)."""

    max_blocks: PositiveInt = 1024
    policy: str | EvictionPolicy = "lru"


class MemoryTier(TierActor):
    """Blocks kept in process memory, at most ``max_blocks`` of them, evicted by ``policy``.

    * A key is visible (``lookup`` True, loadable) only once its bytes are copied; keys
      held are skipped, and a key twice in one store job is stored from its first slot.
    * Room is made by evicting keys neither pinned (being loaded, or held through
      :meth:`hold`) nor in the storing job; a store that cannot fit its new keys stores
      the leading ones and fails the rest (``failed_keys``).
    * A load writes every held key into its slot and fails the others (``failed_keys``);
      a key being loaded is pinned until its copy ends.
    * A job's copying is ONE :meth:`run_blocking` call; failures are counted by cause
      in ``statistics().failures`` and logged once per cause.
    """

    Options = MemoryOptions

    def __init__(
        self,
        primary_kv_view: memoryview,
        block_bytes: int,
        options: MemoryOptions | None = None,
        /,
        **values: Any,
    ) -> None:
        """Takes a :class:`MemoryOptions`, keywords, or both (keywords win). Raises
        InvalidArgumentError for a bad view, size or option, UnknownPolicyError for an
        unknown ``policy``."""
        checked = MemoryOptions.check({**dict(options or {}), **values}, owner="MemoryTier")
        super().__init__(primary_kv_view, block_bytes, **checked.actor_options())
        max_blocks = self.max_blocks = checked.max_blocks
        self._index = ResidencyIndex(max_blocks, checked.policy)
        self._arena = np.empty((max_blocks, block_bytes), dtype=np.uint8)
        self._pool = np.frombuffer(self.primary_kv_view, dtype=np.uint8).reshape(-1, block_bytes)
        self._row_of: dict[OffloadKey, int] = {}  # resident keys only
        # Popped from the end, so rows fill from 0 upwards.
        self._free_rows: list[int] = list(range(max_blocks - 1, -1, -1))
        # Rows of keys dropped by clear() while pinned: freed once the key is unpinned.
        self._orphaned: dict[OffloadKey, list[int]] = {}
        self._failure_log = FailureLog(logger, "memory tier")
        self._counters = {"stored_blocks": 0, "loaded_blocks": 0, "evicted_blocks": 0}

    def lookup(self, key: OffloadKey, req_context: ReqContext = None) -> bool | None:
        """True if held, None while a store of it is queued or running, else False.
        Raises InvalidArgumentError if ``key`` is not bytes."""
        check_offload_key(key)
        if key in self._row_of:
            return True
        return None if self.storing(key) else False

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext = None) -> None:
        """Mark held keys recently used, ``keys[0]`` the most recent; others are ignored."""
        self._index.touch(list(keys))

    def hold(self, keys: Collection[OffloadKey]) -> None:
        """Keep ``keys`` from eviction until released; holds count, absent keys allowed.
        Raises InvalidArgumentError (nothing held) if a key is not bytes."""
        self._index.hold(keys)

    def release(self, keys: Collection[OffloadKey]) -> None:
        """Undo one :meth:`hold` of each key. Raises InvalidArgumentError (nothing
        released) for a key not bytes or released more often than held (named in hex)."""
        self._free_orphans(self._index.release(keys))

    @staticmethod
    def get_tier_type() -> str:
        return "memory"

    def get_num_blocks(self) -> int:
        """Keys held and loadable now (stores in progress not counted)."""
        return len(self._row_of)

    def clear(self) -> None:
        """Drop every held key. Rows being read stay untouched until their loads end;
        stores already running still land their keys when they finish."""
        index = self._index
        for key in index.clear(keep_room_for_pinned=True):
            row = self._row_of.pop(key)
            if index.is_pinned(key):
                self._orphaned.setdefault(key, []).append(row)
            else:
                self._free_rows.append(row)

    def _usage(self) -> dict[str, Any]:
        used = len(self._row_of)
        return {
            "used_blocks": used,
            "capacity_blocks": self.max_blocks,
            "used_bytes": used * self.block_bytes,
            "capacity_bytes": self.max_blocks * self.block_bytes,
            "pinned_blocks": self._index.pinned_resident,
            "counters": dict(self._counters),
            "failures": dict(self._failure_log.counts),
        }

    async def _do_store(self, job: JobMetadata) -> JobResult:
        wanted: dict[OffloadKey, int] = {}
        for key, block_id in zip(job.keys, job.block_ids, strict=True):
            if key not in self._row_of and key not in wanted:
                wanted[key] = block_id
        if not wanted:
            return JobResult(job.job_id, True)
        index = self._index
        room = index.reserve(len(wanted), protected=job.keys)
        rows = [self._free_rows.pop() for _ in range(room.granted - len(room.victims))]
        rows += [self._row_of.pop(victim) for victim in room.victims]
        self._counters["evicted_blocks"] += len(room.victims)
        self._note_removed(room.victims)
        placed = list(wanted.items())[: room.granted]
        refused = tuple(list(wanted)[room.granted :])
        copies = [(row, block_id) for (_, block_id), row in zip(placed, rows, strict=True)]
        try:
            if copies:
                await self.run_blocking(self._copy, self._arena, self._pool, copies)
        except BaseException:
            # The rows never became visible. (A job is only cancelled when the tier
            # closes, so no later store can reuse a row a straggling copy still writes.)
            self._free_rows.extend(rows)
            index.unreserve(len(rows))
            raise
        for (key, _), row in zip(placed, rows, strict=True):
            if index.insert(key, reserved=True):
                self._row_of[key] = row
            else:  # another job stored it meanwhile
                self._free_rows.append(row)
        self._counters["stored_blocks"] += len(placed)
        if refused:
            self._failure_log.record(
                NO_ROOM, len(refused), f"{_FULL}: no unpinned block left to evict"
            )
            why = (
                f"{_FULL}: no room for {len(refused)} of {len(wanted)} new blocks "
                "(the rest are pinned or belong to this job)"
            )
            return JobResult(job.job_id, False, refused, why)
        return JobResult(job.job_id, True)

    async def _do_load(self, job: JobMetadata) -> JobResult:
        copies: list[tuple[int, int]] = []
        missing: list[OffloadKey] = []
        pinned: list[OffloadKey] = []
        for key, block_id in zip(job.keys, job.block_ids, strict=True):
            row = self._row_of.get(key)
            if row is None:
                missing.append(key)
            else:
                copies.append((block_id, row))
                pinned.append(key)
        self._index.pin(pinned)
        try:
            if copies:
                await self.run_blocking(self._copy, self._pool, self._arena, copies)
        finally:
            self._index.unpin(pinned)
            self._free_orphans(pinned)
        self._counters["loaded_blocks"] += len(copies)
        if missing:
            self._failure_log.record(_NOT_HELD, len(missing))
            why = f"{len(missing)} of {len(job.keys)} blocks are {_NOT_HELD}"
            return JobResult(job.job_id, False, tuple(missing), why)
        return JobResult(job.job_id, True)

    def _free_orphans(self, keys: Collection[OffloadKey]) -> None:
        if not self._orphaned:
            return
        for key in keys:
            rows = self._orphaned.get(key)
            if rows is not None and not self._index.is_pinned(key):
                del self._orphaned[key]
                self._free_rows.extend(rows)
                self._index.unreserve(len(rows))

    def _copy(self, into: np.ndarray, source: np.ndarray, rows: Sequence[tuple[int, int]]) -> None:
        for into_row, source_row in rows:
            into[into_row] = source[source_row]
