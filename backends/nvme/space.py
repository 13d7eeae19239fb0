"""The NVMe tier's space (docs/nvme.md: "Capacity" and "Faults"): the sans-I/O
:class:`SpaceGuard` (cap, free-space floor, cached free space, disk full; the tier
measures free space off the loop and feeds it in), :class:`InflightBytes` (the payload
bytes of jobs in their I/O at once) and :func:`records_per_segment`.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from typing import Literal

from tiering.errors import InvalidArgumentError
from tiering.tiers.block_record import HEADER_BYTES

DEFAULT_MAX_AGE_S = 1.0  # free space measured longer ago is measured again
DISK_FULL_REASON = (
    "nvme tier is read-only: the file system was full (ENOSPC); stores resume once space returns"
)
# Segment sizing (docs/nvme.md, "Segments per cap"):
DEFAULT_SEGMENT_BYTES = 256 << 20  # without ``segment_bytes``, unless the cap is small
MAX_RECORDS_PER_SEGMENT = 4096  # bounds the work of evicting one segment
DERIVED_SEGMENTS_PER_CAP = 8  # without ``segment_bytes``, the cap holds at least this many
MIN_SEGMENTS_PER_CAP = 2  # the segment being written is never evicted
MOVE_BYTES_PER_JOB = 64 << 20  # the most bytes of moved records one store job rewrites


class SpaceGuard:
    """Cap, floor, cached free space and the read-only (disk full) state of one tier;
    blocks promised to running stores count as written. InvalidArgumentError when
    ``capacity_bytes`` holds not even one block file."""

    def __init__(
        self,
        *,
        file_bytes: int,
        capacity_bytes: int,
        min_free_bytes: int,
        retry_s: float,
        clock: Callable[[], float],
        max_age_s: float = DEFAULT_MAX_AGE_S,
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
        self.max_age_s = float(max_age_s)
        self._clock = clock
        self.free_bytes: int | None = None
        """The last measured free space (None: unknown, the floor is not applied)."""
        self._measured_at = float("-inf")
        self._full_since: float | None = None
        self._last_probe = 0.0
        self._freed = False

    # -- start-up ---------------------------------------------------------------------

    def check_file_system(self, total_bytes: int, where: str) -> None:
        """InvalidArgumentError when ``min_free_bytes`` is at or above ``total_bytes``, a
        floor the file system can never satisfy."""
        if total_bytes > 0 and self.min_free_bytes >= total_bytes:
            raise InvalidArgumentError(
                f"min_free_bytes={self.min_free_bytes} is at or above the size of the file "
                f"system at {where!r} ({total_bytes} bytes); the tier could never store"
            )

    # -- free space -------------------------------------------------------------------

    def measured(self, free_bytes: int | None) -> None:
        """Take a new free-space figure (None when ``statvfs`` failed)."""
        self.free_bytes = free_bytes
        self._measured_at = self._clock()

    def stale(self, pending_blocks: int) -> bool:
        """True if free space must be measured before planning ``pending_blocks`` more
        records: unknown, old, near the floor, or read-only (space may have returned)."""
        if self._full_since is not None or self.free_bytes is None:
            return True
        if self._clock() - self._measured_at >= self.max_age_s:
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

    # -- disk full --------------------------------------------------------------------

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

    def store_ended(
        self, *, disk_full: bool, stored_any: bool
    ) -> Literal["full", "resumed"] | None:
        """Take a store hop's outcome; returns ``"full"`` when the tier just turned
        read-only, ``"resumed"`` when it just turned writable, else None."""
        now = self._clock()
        if disk_full:
            self._last_probe = now
            self._freed = False
            if self._full_since is None:
                self._full_since = now
                return "full"
            return None
        if stored_any and self._full_since is not None:
            self._full_since = None
            return "resumed"
        return None


class InflightBytes:
    """A loop-thread byte budget for jobs' I/O; waiting loads are admitted before stores.

    A job larger than the whole budget runs alone rather than never.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self._waiting: dict[bool, deque[tuple[int, asyncio.Future[None]]]] = {
            True: deque(),
            False: deque(),
        }

    def _fits(self, nbytes: int) -> bool:
        return self.used == 0 or self.used + nbytes <= self.limit

    async def acquire(self, nbytes: int, *, is_load: bool) -> None:
        ahead = self._waiting[True] if is_load else (*self._waiting[True], *self._waiting[False])
        if not ahead and self._fits(nbytes):
            self.used += nbytes
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (nbytes, future)
        self._waiting[is_load].append(entry)
        try:
            await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                self.release(nbytes)  # granted, but the caller is gone
            else:
                self._waiting[is_load].remove(entry)
                self._grant()
            raise

    def release(self, nbytes: int) -> None:
        self.used -= nbytes
        self._grant()

    def _grant(self) -> None:
        for is_load in (True, False):
            queue = self._waiting[is_load]
            while queue and self._fits(queue[0][0]):
                nbytes, future = queue.popleft()
                if future.done():
                    continue
                self.used += nbytes
                future.set_result(None)
            if queue:
                return  # a blocked load holds back stores


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
