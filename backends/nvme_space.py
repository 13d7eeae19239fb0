"""The NVMe tier's space guard: byte cap, free-space floor, cached free space, disk full.

:class:`SpaceGuard` is sans-I/O: the tier measures free space (``statvfs``, off the
loop) and feeds the figure in; the guard says whether that figure is fresh enough to
plan a store by, how many blocks the floor still allows, and whether stores are
refused because the file system answered ENOSPC. It never touches a file.

Rules:

* **Cap.** At most ``capacity_bytes // file_bytes`` block files are held.
* **Floor.** A store may not bring free space below ``min_free_bytes``; blocks already
  promised to running stores count as written. Whichever of cap and floor binds first
  wins; a floor already crossed asks for eviction beyond the store's own need.
* **Freshness.** A figure older than ``max_age_s``, or one too close to the floor to
  plan by, is measured again before a store plans; every store hop measures as it
  ends, so a busy tier rarely needs an extra hop.
* **Disk full.** ENOSPC (or EDQUOT) makes the tier read-only for stores. Stores are
  then refused without I/O, except one probing store every ``retry_s`` seconds or as
  soon as the tier freed space itself; a store that lands ends the read-only state.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

from tiering.errors import InvalidArgumentError
from tiering.validation import seconds

DEFAULT_MAX_AGE_S = 1.0
"""Free space measured longer ago than this is measured again before a store plans."""

DISK_FULL_REASON = (
    "nvme tier is read-only: the file system was full (ENOSPC); stores resume once space returns"
)


class SpaceGuard:
    """Cap, floor, cached free space and the read-only (disk full) state of one tier.

    Raises (constructor):
        InvalidArgumentError: a size is not an int in range, or ``capacity_bytes`` holds
            not even one block file, or ``retry_s``/``max_age_s`` is not a number >= 0.
    """

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
        _check_int("file_bytes", file_bytes, minimum=1)
        if not isinstance(capacity_bytes, int) or isinstance(capacity_bytes, bool):
            raise InvalidArgumentError(f"capacity_bytes must be an int, got {capacity_bytes!r}")
        if capacity_bytes < file_bytes:
            raise InvalidArgumentError(
                f"capacity_bytes={capacity_bytes!r} is below one block file ({file_bytes} "
                "bytes: header page + block); the tier could never store"
            )
        _check_int("min_free_bytes", min_free_bytes, minimum=0)
        seconds("enospc_retry_s", retry_s, allow_zero=True)
        seconds("max_age_s", max_age_s, allow_zero=True)
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
        """Refuse a floor the file system can never satisfy.

        Raises:
            InvalidArgumentError: ``min_free_bytes`` is at or above ``total_bytes``.
        """
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
        block files (reserved ones included): unknown, old, near the floor, or the tier
        is read-only (space may have returned)."""
        if self._full_since is not None or self.free_bytes is None:
            return True
        if self._clock() - self._measured_at >= self.max_age_s:
            return True
        return self.free_bytes - pending_blocks * self.file_bytes < self.min_free_bytes

    def limit(self, held_blocks: int, reserved_blocks: int) -> tuple[int, str]:
        """The most block files (held plus reserved) allowed now, and why it binds.

        ``held_blocks`` are on disk already (their space is gone from ``free_bytes``);
        ``reserved_blocks`` are promised to running stores and not yet written.
        """
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
        """The tier removed block files: a refused store may probe again at once."""
        self._freed = True

    def refusing(self) -> bool:
        """True if a store must be refused without I/O now.

        When read-only, one store is let through to probe every ``retry_s`` seconds, or
        at once after :meth:`freed`; letting one through starts a new retry period.
        """
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


def _check_int(name: str, value: object, *, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise InvalidArgumentError(f"{name} must be an int >= {minimum}, got {value!r}")


__all__ = ["DEFAULT_MAX_AGE_S", "DISK_FULL_REASON", "SpaceGuard"]
