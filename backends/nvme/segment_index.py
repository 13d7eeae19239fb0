"""The NVMe tier's index (:class:`SegmentIndex`) and space accounting (:class:`SpaceGuard`),
sans-I/O on the loop thread (docs/nvme.md)."""

from __future__ import annotations

import logging
import time
from array import array
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
import xxhash

from backends.nvme.segment_format import Checkpoint, SegmentScan, parse_segment_name, segment_name
from tiering.errors import InvalidArgumentError
from tiering.tiers.block_record import HEADER_BYTES

logger = logging.getLogger(__name__)

_EMPTY = 0


def key_digest(key: bytes) -> int:
    """The index's 64-bit name for ``key`` (never 0, which marks an empty slot)."""
    return xxhash.xxh3_64_intdigest(key) or 1


class KeyTable:
    """A fixed-size map from 64-bit digests to (location, tick) in flat arrays (linear
    probing, backward-shift deletion), at most 70 % full at ``capacity`` entries."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        size = 8
        while size * 0.7 < capacity:
            size *= 2
        self._mask = size - 1
        self._digests = array("Q", bytes(8 * size))
        self._locs = array("Q", bytes(8 * size))
        self._ticks = array("I", bytes(4 * size))
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def _find(self, digest: int) -> int:
        """The slot holding ``digest``, or the empty slot where it would go."""
        digests, mask = self._digests, self._mask
        slot = digest & mask
        while True:
            found = digests[slot]
            if found in (digest, _EMPTY):
                return slot
            slot = (slot + 1) & mask

    def get(self, digest: int) -> int | None:
        """The location of ``digest``; None: absent."""
        slot = self._find(digest)
        return self._locs[slot] if self._digests[slot] else None

    def present(self, digests: Sequence[int]) -> np.ndarray:
        """Whether each of ``digests`` is present (booleans, in order), probed as arrays."""
        table = np.frombuffer(self._digests, dtype=np.uint64)
        wanted = np.fromiter(digests, dtype=np.uint64, count=len(digests))
        found = np.zeros(len(wanted), dtype=bool)
        mask = np.uint64(self._mask)
        slots = wanted & mask
        probing = np.arange(len(wanted))
        while probing.size:
            seen = table[slots[probing]]
            hit = seen == wanted[probing]
            found[probing[hit]] = True
            probing = probing[~hit & (seen != _EMPTY)]
            slots[probing] = (slots[probing] + np.uint64(1)) & mask
        return found

    def tick_of(self, digest: int) -> int | None:
        slot = self._find(digest)
        return self._ticks[slot] if self._digests[slot] else None

    def touch(self, digest: int, tick: int) -> bool:
        """Set the last-use tick of a present digest; False if absent."""
        slot = self._find(digest)
        if not self._digests[slot]:
            return False
        self._ticks[slot] = tick
        return True

    def put(self, digest: int, loc: int, tick: int) -> int | None:
        """Map ``digest`` to ``loc``; returns the location it replaced, if any
        (InvalidArgumentError when a new entry would exceed ``capacity``)."""
        slot = self._find(digest)
        old = self._locs[slot] if self._digests[slot] else None
        if old is None:
            if self._len >= self.capacity:
                raise InvalidArgumentError(f"the key table is full ({self.capacity} entries)")
            self._digests[slot] = digest
            self._len += 1
        self._locs[slot] = loc
        self._ticks[slot] = tick
        return old

    def delete(self, digest: int) -> int | None:
        """Remove ``digest``; returns its location (None: absent)."""
        digests, locs, ticks, mask = self._digests, self._locs, self._ticks, self._mask
        hole = self._find(digest)
        if not digests[hole]:
            return None
        old = locs[hole]
        # Backward shift: move later entries of the probe run into the hole when their
        # home slot is not between the hole and them (cyclically).
        slot = (hole + 1) & mask
        while digests[slot]:
            home = digests[slot] & mask
            if (slot - home) & mask >= (slot - hole) & mask:
                digests[hole], locs[hole], ticks[hole] = digests[slot], locs[slot], ticks[slot]
                hole = slot
            slot = (slot + 1) & mask
        digests[hole] = locs[hole] = ticks[hole] = _EMPTY
        self._len -= 1
        return old

    def entries(self, chunk: int = 1 << 16) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Copies of the present ``(digests, locations, ticks)``, in slot order; safe from
        another thread while the owner goes on (an entry moved meanwhile may be copied
        torn or twice: reads verify)."""
        digests = np.frombuffer(self._digests, dtype=np.uint64)
        locs = np.frombuffer(self._locs, dtype=np.uint64)
        ticks = np.frombuffer(self._ticks, dtype=np.uint32)
        parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        for start in range(0, len(digests), chunk):
            window = slice(start, start + chunk)
            present = digests[window] != _EMPTY
            parts.append((digests[window][present], locs[window][present], ticks[window][present]))
            time.sleep(0)
        return tuple(np.concatenate([part[i] for part in parts]) for i in range(3))  # type: ignore[return-value]


def _loc(segment: int, record: int) -> int:
    return segment << 32 | record


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a new record goes; ``create``: its write creates the segment file."""

    segment: str
    record: int
    create: bool


@dataclass(slots=True)
class _Segment:
    name: str
    digests: array = field(default_factory=lambda: array("Q"))  # record -> digest, 0 = none
    live: int = 0
    pins: int = 0  # reads in flight and writes not yet committed
    # Records placed and not yet committed or abandoned: a checkpoint covers the
    # segment only up to the first of them, so a restart scans from there.
    pending: set[int] = field(default_factory=set)
    protected: bool = False  # another live writer's segment: never evicted by this one


@dataclass(frozen=True, slots=True)
class Eviction:
    """A segment the index gave up, its file the caller's to delete: the blocks at records
    ``dropped`` left the index, and so did the ``reinsert`` ones (digest, old record),
    used recently or compacted: to write again if wanted."""

    segment: str
    dropped: list[int]
    reinsert: list[tuple[int, int]]


@dataclass(frozen=True, slots=True)
class RoomPlan:
    """How one store job makes room: ``fit`` of its records fit; ``moves`` are evicted
    records to write again, ``gone`` those that leave the tier; ``placed`` one placement
    per record that fits, then one per move."""

    fit: int
    evictions: list[Eviction]
    moves: list[tuple[str, int, int]]
    gone: list[tuple[str, int]]
    placed: list[Placement]


class SegmentIndex:
    """Which blocks the NVMe tier holds (by 64-bit key digest; every read verifies the full
    key), where, and what to evict. Capacity counts records on disk, live or dead. A
    pinned segment, one holding a held key and the one being written are never evicted;
    a newer record of a digest makes the older one dead. Its callers validate its
    arguments (options, the replay's layout)."""

    def __init__(
        self,
        capacity_records: int,
        *,
        records_per_segment: int,
        writer: str,
        hot_fraction: float = 0.25,
        compact_below: float = 0.25,
    ) -> None:
        self.capacity_records = capacity_records
        self.records_per_segment = records_per_segment
        self.writer = writer
        self.hot_fraction = float(hot_fraction)
        self.compact_below = float(compact_below)
        self._table = KeyTable(capacity_records)
        self._segments: dict[int, _Segment] = {}  # slot number -> segment, oldest first
        self._slot_of: dict[str, int] = {}
        self._next_slot = 0
        self._next_seq = 0
        self._active: int | None = None
        self._holds: Counter[int] = Counter()
        self._clock = 0
        self.used_records = 0  # record slots of every segment, live or dead

    def __len__(self) -> int:
        return len(self._table)

    def __contains__(self, digest: object) -> bool:
        return isinstance(digest, int) and self._table.get(digest) is not None

    def present(self, digests: Sequence[int]) -> np.ndarray:
        """Whether each of ``digests`` is present (booleans, in order)."""
        return self._table.present(digests)

    def locate(self, digest: int) -> tuple[str, int] | None:
        """``(segment name, record number)`` of a present digest, else None."""
        loc = self._table.get(digest)
        if loc is None:
            return None
        return self._segments[loc >> 32].name, loc & 0xFFFFFFFF

    @property
    def segments(self) -> list[str]:
        """The segments' names, oldest first."""
        return [segment.name for segment in self._segments.values()]

    @property
    def pinned_records(self) -> int:
        """Pins of every segment (reads, uncommitted writes) plus records of held keys."""
        pins = sum(segment.pins for segment in self._segments.values())
        return pins + sum(1 for digest in self._holds if digest in self)

    def touch(self, digests: Sequence[int]) -> None:
        """Mark present digests used now, the first the most recent (others: ignored)."""
        for digest in reversed(digests):
            self._clock += 1
            self._table.touch(digest, self._clock & 0xFFFFFFFF)

    def hold(self, digests: Iterable[int]) -> None:
        """Keep these digests' segments from eviction until released (holds count)."""
        self._holds.update(digests)

    def release(
        self, digests: Iterable[int], *, named: Callable[[int], str] = "digest {:#x}".format
    ) -> None:
        """Undo one :meth:`hold` of each digest (InvalidArgumentError, nothing released,
        naming ``named(digest)``, for one released more often than held)."""
        wanted = Counter(digests)
        for digest, n in wanted.items():
            if self._holds[digest] < n:
                raise InvalidArgumentError(f"{named(digest)} is released more often than held")
        self._holds.subtract(wanted)
        for digest in wanted:
            if self._holds[digest] <= 0:
                del self._holds[digest]

    def pin(self, segment: str) -> None:
        """One more read or write in flight in ``segment``: not evicted until unpinned."""
        self._segments[self._slot_of[segment]].pins += 1

    def unpin(self, segment: str) -> None:
        """Undo one :meth:`pin`; a segment that is gone already is ignored."""
        slot = self._slot_of.get(segment)
        if slot is not None:
            self._segments[slot].pins -= 1

    def room(self, limit: int | None = None) -> int:
        """Records that can be placed now without evicting (under ``limit`` records)."""
        bound = self.capacity_records if limit is None else min(limit, self.capacity_records)
        return bound - self.used_records

    def place(self, count: int) -> list[Placement]:
        """Reserve ``count`` record slots at the log's head and pin their segments; each
        is then committed or abandoned. InvalidArgumentError when they do not fit."""
        if count > self.room():
            raise InvalidArgumentError(f"{count} records do not fit ({self.room()} free)")
        placed: list[Placement] = []
        while len(placed) < count:
            active = self._segments.get(self._active) if self._active is not None else None
            if active is None or len(active.digests) >= self.records_per_segment:
                self._active = self._add_segment(segment_name(self.writer, self._next_seq))
                self._next_seq += 1
                active = self._segments[self._active]
            record = len(active.digests)
            take = min(count - len(placed), self.records_per_segment - record)
            active.digests.extend([0] * take)
            active.pins += take
            active.pending.update(range(record, record + take))
            placed.extend(
                Placement(active.name, record + i, create=record + i == 0) for i in range(take)
            )
        self.used_records += count
        return placed

    def _add_segment(self, name: str) -> int:
        slot = self._next_slot
        self._next_slot += 1
        self._segments[slot] = _Segment(name)
        self._slot_of[name] = slot
        return slot

    def commit(self, digest: int, placement: Placement) -> None:
        """The record at ``placement`` holds ``digest`` now (an older record of it becomes
        dead); its segment is unpinned."""
        slot = self._slot_of[placement.segment]
        self._segments[slot].pins -= 1
        self._segments[slot].pending.discard(placement.record)
        self._clock += 1
        self._put(slot, placement.record, digest, self._clock & 0xFFFFFFFF)

    def _put(self, slot: int, record: int, digest: int, tick: int) -> None:
        segment = self._segments[slot]
        old = self._table.put(digest, _loc(slot, record), tick)
        segment.digests[record] = digest
        segment.live += 1
        if old is not None:
            self._dead(old)

    def abandon(self, placement: Placement) -> None:
        """The write to ``placement`` failed: the slot stays taken (dead space)."""
        segment = self._segments[self._slot_of[placement.segment]]
        segment.pins -= 1
        segment.pending.discard(placement.record)

    def remove(self, digest: int) -> bool:
        """Forget ``digest`` (its record failed verification); True if it was present."""
        old = self._table.delete(digest)
        if old is None:
            return False
        self._dead(old)
        return True

    def _dead(self, loc: int) -> None:
        segment = self._segments[loc >> 32]
        segment.live -= 1
        segment.digests[loc & 0xFFFFFFFF] = 0

    def make_room(self, count: int, *, limit: int | None = None) -> tuple[int, list[Eviction]]:
        """Evict the oldest evictable segments until ``count`` records fit under ``limit``
        (default: the capacity); returns ``(records that fit now, evictions)``."""
        evictions: list[Eviction] = []
        while self.room(limit) < count:
            victim = self._next_victim()
            if victim is None:
                break
            evictions.append(self._evict(*victim))
        return min(count, max(0, self.room(limit))), evictions

    def plan_room(self, count: int, *, limit: int | None = None, most_moves: int) -> RoomPlan:
        """Make room for a store job of ``count`` records (:meth:`make_room`, with room
        for the victims' recently used blocks too), move the newest of those the room
        and ``most_moves`` allow, and place the job's records, then the moves."""
        fit, evictions = self.make_room(count, limit=limit)
        if any(e.reinsert for e in evictions):
            hot = sum(len(e.reinsert) for e in evictions)
            evictions += self.make_room(fit + hot, limit=limit)[1]
        most = min(max(0, self.room(limit) - fit), most_moves)
        hot_records = [(e.segment, record, d) for e in evictions for d, record in e.reinsert]
        moves = hot_records[-most:] if most else []
        moving = {(segment, record) for segment, record, _ in moves}
        gone = [(e.segment, record) for e in evictions for record in e.dropped]
        gone += [(seg, rec) for seg, rec, _ in hot_records if (seg, rec) not in moving]
        return RoomPlan(fit, evictions, moves, gone, self.place(fit + len(moves)))

    def _next_victim(self) -> tuple[int, bool] | None:
        # ``(slot, compact)``: the first evictable segment under ``compact_below`` live
        # (all its live blocks move), else the oldest evictable one.
        holds = self._holds
        oldest: int | None = None
        for slot, segment in self._segments.items():
            if slot == self._active or segment.pins or segment.protected:
                continue
            if holds and any(d in holds for d in segment.digests if d):
                continue
            records = len(segment.digests)
            if records and segment.live < self.compact_below * records:
                return slot, True
            if oldest is None:
                oldest = slot
        return None if oldest is None else (oldest, False)

    def _evict(self, slot: int, compact: bool = False) -> Eviction:
        segment = self._segments.pop(slot)
        del self._slot_of[segment.name]
        window = int(self.hot_fraction * self.capacity_records)
        table = self._table
        dropped: list[int] = []
        reinsert: list[tuple[int, int]] = []
        for record, digest in enumerate(segment.digests):
            if not digest or table.get(digest) != _loc(slot, record):
                continue
            tick = table.tick_of(digest)
            table.delete(digest)
            recent = window and tick is not None and (self._clock - tick) & 0xFFFFFFFF <= window
            if compact or recent:
                reinsert.append((digest, record))
            else:
                dropped.append(record)
        self.used_records -= len(segment.digests)
        return Eviction(segment.name, dropped, reinsert)

    def clear(self) -> list[str]:
        """Forget every block and segment; returns the segment names (their files are the
        caller's to delete). Placements made before must not be committed afterwards."""
        names = self.segments
        self._table = KeyTable(self.capacity_records)
        self._segments.clear()
        self._slot_of.clear()
        self._active = None
        self.used_records = 0
        return names

    def checkpoint_segments(self) -> list[tuple[int, str, int]]:
        """``(slot, name, records covered)`` of every segment, oldest first, for
        :meth:`snapshot` (the cheap half, on the owner's thread). A segment is covered up
        to its first record not yet committed or abandoned (a restart scans from there)."""
        return [
            (slot, seg.name, min(seg.pending, default=len(seg.digests)))
            for slot, seg in self._segments.items()
        ]

    def snapshot(self, segments: list[tuple[int, str, int]] | None = None) -> Checkpoint:
        """The index as a checkpoint. With ``segments`` from :meth:`checkpoint_segments`,
        it may run on another thread while the owner goes on (entries of segments created
        since are left out)."""
        if segments is None:
            segments = self.checkpoint_segments()
        digests, locs, ticks = self._table.entries()
        slots = (locs >> np.uint64(32)).astype(np.int64)
        position = np.full(max(self._next_slot, 1) + 1, len(segments), dtype=np.int64)
        for i, (slot, _, _) in enumerate(segments):
            if slot < len(position):
                position[slot] = i
        where = position[np.minimum(slots, len(position) - 1)]
        known = where < len(segments)
        return Checkpoint(
            [(name, records) for _, name, records in segments],
            digests[known],
            where[known].astype(np.uint32),
            (locs[known] & np.uint64(0xFFFFFFFF)).astype(np.uint32),
            ticks[known],
        )

    def restore(
        self,
        checkpoint: Checkpoint | None,
        on_disk: Sequence[tuple[str, int]],
        scans: dict[str, SegmentScan],
        protected: Collection[str] = (),
    ) -> int:
        """Rebuild an empty index (else InvalidArgumentError) from a checkpoint and segment
        scans; returns the blocks indexed. ``on_disk``: the segments present, oldest first,
        with their records; the checkpoint counts up to the records it covered, ``scans``
        for the rest. Later records of a digest win; segments beyond capacity are left
        out; ``protected`` ones (another live writer's) are never evicted."""
        if self._segments:
            raise InvalidArgumentError("restore needs an empty index")
        covered = dict(checkpoint.segments) if checkpoint is not None else {}
        by_name: dict[str, list[tuple[int, int, int]]] = {}
        if checkpoint is not None:
            columns = (checkpoint.digests.tolist(), checkpoint.ticks.tolist())
            for (name, record), digest, tick in zip(checkpoint.locations(), *columns, strict=True):
                by_name.setdefault(name, []).append((record, digest, tick))
        for name, _records in on_disk:
            parsed = parse_segment_name(name)
            if parsed is not None and parsed[0] == self.writer:
                self._next_seq = max(self._next_seq, parsed[1] + 1)
        kept: set[str] = set()
        total = 0
        for name, records in reversed(on_disk):  # the newest segments are kept
            if total + records > self.capacity_records:
                break
            total += records
            kept.add(name)
        for name, records in on_disk:
            if name not in kept:
                continue
            slot = self._add_segment(name)
            segment = self._segments[slot]
            segment.protected = name in protected
            segment.digests.extend([0] * records)
            self.used_records += records
            upto = min(covered.get(name, 0), records)
            entries = [(r, d, t) for r, d, t in by_name.get(name, ()) if r < upto]
            scan = scans.get(name)
            if scan is not None:
                entries.extend((r, key_digest(k), 0) for k, r in scan.records if r >= upto)
            for record, digest, tick in sorted(entries):
                self._put(slot, record, digest, tick)
                self._clock = max(self._clock, tick)  # ticks restart near the newest
        return len(self._table)

    def excess_segments(self, on_disk: Sequence[tuple[str, int]]) -> list[str]:
        """The segments of ``on_disk`` :meth:`restore` left out."""
        return [name for name, _ in on_disk if name not in self._slot_of]


DISK_FULL_REASON = (
    "nvme tier is read-only: the file system was full (ENOSPC); stores resume once space returns"
)
# Segment sizing (docs/nvme.md, "Segments per cap"):
DEFAULT_SEGMENT_BYTES = 256 << 20  # without ``segment_bytes``, unless the cap is small
MAX_RECORDS_PER_SEGMENT = 4096  # bounds the work of evicting one segment
DERIVED_SEGMENTS_PER_CAP = 8  # without ``segment_bytes``, the cap holds at least this many
MIN_SEGMENTS_PER_CAP = 2  # the segment being written is never evicted


class SpaceGuard:
    """Cap, floor, cached free space and the read-only (disk full) state of one tier (its
    directory ``where``); blocks promised to running stores count as written; the tier
    feeds in free space. InvalidArgumentError when ``capacity_bytes`` holds no block file."""

    MAX_AGE_S = 1.0  # free space measured longer ago is measured again

    def __init__(
        self,
        *,
        file_bytes: int,
        capacity_bytes: int,
        min_free_bytes: int,
        retry_s: float,
        clock: Callable[[], float],
        where: str,
    ) -> None:
        if capacity_bytes < file_bytes:
            raise InvalidArgumentError(
                f"capacity_bytes={capacity_bytes!r} is below one block file ({file_bytes} "
                "bytes: header page + block); the tier could never store"
            )
        self.file_bytes = file_bytes
        self.capacity_bytes = capacity_bytes
        self.capacity_blocks = capacity_bytes // file_bytes
        self.min_free_bytes = min_free_bytes
        self.retry_s = float(retry_s)
        self._clock = clock
        self.where = where  # the directory, for the log
        self.free_bytes: int | None = None  # last measured (None: unknown, no floor applied)
        self._measured_at = float("-inf")
        self._full_since: float | None = None
        self._last_probe = 0.0
        self._freed = False

    def check_file_system(self, total_bytes: int, where: str) -> None:
        """InvalidArgumentError when ``min_free_bytes`` is at or above ``total_bytes``, a
        floor the file system can never satisfy."""
        if total_bytes > 0 and self.min_free_bytes >= total_bytes:
            raise InvalidArgumentError(
                f"min_free_bytes={self.min_free_bytes} is at or above the size of the file "
                f"system at {where!r} ({total_bytes} bytes); the tier could never store"
            )

    def measured(self, free_bytes: int | None) -> None:
        """Take a new free-space figure (None when ``statvfs`` failed)."""
        self.free_bytes = free_bytes
        self._measured_at = self._clock()

    def stale(self, pending_blocks: int) -> bool:
        """True if free space must be measured before planning ``pending_blocks`` more
        records: unknown, old, near the floor, or read-only (space may have returned)."""
        if self._full_since is not None or self.free_bytes is None:
            return True
        if self._clock() - self._measured_at >= self.MAX_AGE_S:
            return True
        return self.free_bytes - pending_blocks * self.file_bytes < self.min_free_bytes

    def limit(self, held_blocks: int, reserved_blocks: int) -> tuple[int, str]:
        """The most records (``held_blocks`` on disk plus ``reserved_blocks`` promised to
        running stores) allowed now, and why it binds."""
        bound = self.capacity_blocks
        reason = f"nvme tier full: capacity {self.capacity_bytes} bytes reached"
        if self.free_bytes is not None:
            above_floor = self.free_bytes - reserved_blocks * self.file_bytes
            floor_room = (above_floor - self.min_free_bytes) // self.file_bytes
            floor_bound = held_blocks + reserved_blocks + floor_room
            if floor_bound < bound:
                bound = floor_bound
                reason = f"nvme tier full: free space would fall below {self.min_free_bytes} bytes"
        return bound, reason

    @property
    def read_only(self) -> bool:
        """True while stores are refused because the file system was full."""
        return self._full_since is not None

    def freed(self) -> None:
        """The tier freed space: a refused store may probe again at once."""
        self._freed = True

    def refusing(self) -> bool:
        """True if a store must be refused without I/O now: while read-only, all but one
        probing store every ``retry_s`` seconds (or at once after :meth:`freed`)."""
        if self._full_since is None:
            return False
        now = self._clock()
        if self._freed or now - self._last_probe >= self.retry_s:
            self._last_probe = now
            self._freed = False
            return False
        return True

    def store_ended(self, free_bytes: int | None, disk_full: bool, stored_any: bool) -> bool:
        """Take a store hop's outcome (the free space it measured, unless None); True
        when the tier just turned read-only. Each change is logged."""
        if free_bytes is not None:
            self.measured(free_bytes)
        now = self._clock()
        if disk_full:
            self._last_probe = now
            self._freed = False
            if self._full_since is None:
                self._full_since = now
                logger.warning(
                    "nvme tier: file system full (ENOSPC) at %s; stores refused, loads go "
                    "on; retrying every %gs or after space is freed",
                    self.where,
                    self.retry_s,
                )
                return True
        elif stored_any and self._full_since is not None:
            self._full_since = None
            logger.warning("nvme tier: space returned at %s; stores resumed", self.where)
        return False


def records_per_segment(capacity_bytes: int, segment_bytes: int | None, record_bytes: int) -> int:
    """Records a segment takes: from ``segment_bytes``, or (None) from the cap;
    InvalidArgumentError (both options named) when the cap holds fewer than two."""
    capacity_records = capacity_bytes // record_bytes
    size = DEFAULT_SEGMENT_BYTES if segment_bytes is None else segment_bytes
    records = max(1, min(MAX_RECORDS_PER_SEGMENT, (size - HEADER_BYTES) // record_bytes))
    if segment_bytes is None:
        records = min(records, max(1, capacity_records // DERIVED_SEGMENTS_PER_CAP))
        if 0 < capacity_records < MIN_SEGMENTS_PER_CAP:
            raise InvalidArgumentError(
                f"capacity_bytes={capacity_bytes} holds {capacity_records} record of "
                f"{record_bytes} bytes; a segment tier needs room for at least "
                f"{MIN_SEGMENTS_PER_CAP} (the segment being written is never evicted)"
            )
    elif 0 < capacity_records < MIN_SEGMENTS_PER_CAP * records:
        raise InvalidArgumentError(
            f"capacity_bytes={capacity_bytes} holds {capacity_records} records of "
            f"{record_bytes} bytes, fewer than {MIN_SEGMENTS_PER_CAP} segments of "
            f"segment_bytes={segment_bytes} ({records} records each): the segment being "
            "written is never evicted, so the tier would fill once and then refuse every "
            "store; raise capacity_bytes, lower segment_bytes, or leave segment_bytes out "
            "(it then follows from the cap)"
        )
    return records
