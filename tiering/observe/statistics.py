"""The one statistics shape of kv-tiering (the immutable snapshot engine, tiers and copier
each answer ``statistics()`` with), and failure counting that logs once per cause."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TypeVar

from tiering.lifecycle import Lifecycle

_T = TypeVar("_T")

# The failure causes that say a block found no room (a capacity, not a fault): a tier
# full with every block it could evict in use, and a full file system.
NO_ROOM = "no room"
DISK_FULL = "disk full"
CAPACITY_CAUSES = frozenset({NO_ROOM, DISK_FULL})


@dataclass(frozen=True, slots=True)
class Statistics:
    """A snapshot of one engine, tier or copier: state, jobs and bytes in flight, what
    it holds and may hold (0: no bound), pinned blocks, monotonic ``counters`` (named
    by each kind of object) and ``failures`` by cause."""

    state: Lifecycle
    jobs_in_flight: int = 0
    bytes_in_flight: int = 0
    used_blocks: int = 0
    capacity_blocks: int = 0
    used_bytes: int = 0
    capacity_bytes: int = 0
    pinned_blocks: int = 0
    counters: Mapping[str, int] = field(default_factory=dict)
    failures: Mapping[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # Freeze the mappings too, so a snapshot never changes under its holder.
        object.__setattr__(self, "counters", MappingProxyType(dict(self.counters)))
        object.__setattr__(self, "failures", MappingProxyType(dict(self.failures)))

    def __repr__(self) -> str:
        capacity = format_bytes(self.capacity_bytes) if self.capacity_bytes else "-"
        parts = [
            str(self.state),
            f"{self.jobs_in_flight} jobs ({format_bytes(self.bytes_in_flight)}) in flight",
            f"{self.used_blocks}/{self.capacity_blocks or '-'} blocks",
            f"{format_bytes(self.used_bytes)}/{capacity}",
            f"{self.pinned_blocks} pinned",
        ]
        shown = {k: v for k, v in self.counters.items() if v}
        if shown:
            parts.append(" ".join(f"{k}={v}" for k, v in shown.items()))
        if self.failures:
            parts.append("failures: " + ", ".join(f"{k} ({v})" for k, v in self.failures.items()))
        return f"Statistics({'; '.join(parts)})"


def format_bytes(nbytes: int) -> str:
    """``nbytes`` in binary units for people: ``512 B``, ``16.0 KiB``, ``1.5 GiB``."""
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift:
            return f"{nbytes / (1 << shift):.1f} {unit}"
    return f"{nbytes} B"


def uncount(counts: Counter[_T], items: Iterable[_T]) -> None:
    """Take one count off ``counts`` for each of ``items``, dropping those left at zero."""
    for item in items:
        counts[item] -= 1
        if counts[item] <= 0:
            del counts[item]


class FailureLog:
    """Counts failures by cause (a short, stable category such as "disk full", never one
    carrying keys) and logs the first of each at WARNING, pointing at ``counts_at``."""

    def __init__(
        self, logger: logging.Logger, owner: str, *, counts_at: str = "statistics().failures"
    ) -> None:
        self._logger = logger
        self._owner = owner
        self._counts_at = counts_at
        self._counts: Counter[str] = Counter()

    def record(self, cause: str, count: int = 1, detail: str = "") -> None:
        """Count ``count`` failures of ``cause`` (logged if the first of its kind)."""
        if count <= 0:
            return
        first = cause not in self._counts
        self._counts[cause] += count
        if first:
            self._logger.warning(
                "%s: %s%s (logged once; see %s for counts)",
                self._owner,
                cause,
                f": {detail}" if detail else "",
                self._counts_at,
            )

    @property
    def counts(self) -> Mapping[str, int]:
        """Failures so far by cause (read-only)."""
        return MappingProxyType(self._counts)
