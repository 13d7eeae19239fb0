"""The secondary-tier interface: tiers below the CPU tier (vLLM's tiering semantics). A
secondary tier moves whole blocks between CPU slots and its own storage; it sees the host
pool only as ``primary_kv_view``, a flat byte view in which slot ``i`` is
``view[i * block_bytes:(i + 1) * block_bytes]``, and never touches the GPU."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tiering.core.scheduler_api import BlockHash
from tiering.errors import InvalidArgumentError
from tiering.validation import as_index_list, check_index_range, hash_list, positive_int

OffloadKey = BlockHash
ReqContext = Any
"""Per-request context a framework may pass through; tiers may ignore it."""


@dataclass(frozen=True, slots=True)
class JobMetadata:
    """One transfer job: ``keys[i]`` moves from (store) or into (load) CPU slot ``block_ids[i]``."""

    job_id: int
    keys: Sequence[OffloadKey]
    block_ids: Sequence[int]

    def __post_init__(self) -> None:
        if len(self.keys) != len(self.block_ids):
            raise InvalidArgumentError(
                f"job {self.job_id}: {len(self.keys)} keys but {len(self.block_ids)} block_ids"
            )


@dataclass(frozen=True, slots=True)
class JobResult:
    """How a job ended (docs/job-lifecycle.md#what-a-jobresult-means): ``success`` exactly
    when every key was transferred; else ``failed_keys`` names the keys that were not
    (every other key was), or is empty when the job failed as a whole, and ``error`` is a
    short reason."""

    job_id: int
    success: bool
    failed_keys: tuple[OffloadKey, ...] = field(default=())
    error: str | None = None


def checked_job(
    job_id: int, keys: object, slots: object, num_slots: int | None = None
) -> JobMetadata:
    """A job of tuples from arguments a caller passed in: ``keys`` bytes, ``slots`` ints
    (CPU slots of the host pool, given its ``num_slots``), as many of each; else
    InvalidArgumentError naming the argument."""
    key_list = hash_list("keys", keys)
    slot_list = as_index_list("slots", slots)
    if len(key_list) != len(slot_list):
        raise InvalidArgumentError(f"{len(key_list)} keys but {len(slot_list)} slots")
    if num_slots is not None:
        check_index_range("slots (CPU slots of the host pool)", slot_list, num_slots, unique=False)
    return JobMetadata(job_id, tuple(key_list), tuple(slot_list))


class SecondaryTierManager(ABC):
    """A tier below the CPU tier: ``submit_store``/``submit_load`` return at once and
    never do I/O on the caller's stack; each submitted job later yields exactly one
    :class:`JobResult` from ``get_finished()``; ``lookup`` is synchronous and cheap.
    ``holds_data`` is False for a tier that only records which keys it was given: the
    engine cascades to it but never loads from it."""

    holds_data: bool = True

    def __init__(self, primary_kv_view: memoryview, block_bytes: int) -> None:
        if not isinstance(primary_kv_view, memoryview):
            raise InvalidArgumentError("primary_kv_view must be a memoryview of the host pool")
        block_bytes = positive_int("block_bytes", block_bytes)
        view = primary_kv_view.cast("B") if primary_kv_view.format != "B" else primary_kv_view
        if view.nbytes % block_bytes:
            raise InvalidArgumentError(
                f"host pool of {view.nbytes} bytes is not a whole number of "
                f"{block_bytes}-byte blocks"
            )
        self.primary_kv_view = view
        self.block_bytes = block_bytes
        self.num_primary_slots = view.nbytes // block_bytes
        self._removed: deque[OffloadKey] | None = None

    @abstractmethod
    def lookup(self, key: OffloadKey, req_context: ReqContext = None) -> bool | None:
        """True if the block is stored here, False if not, None if in transfer (ask again)."""

    def lookup_all(self, keys: Sequence[OffloadKey]) -> list[bool | None]:
        """:meth:`lookup` of each key, in order (a tier with an index answers at once)."""
        return [self.lookup(key) for key in keys]

    @abstractmethod
    def submit_store(self, job_metadata: JobMetadata) -> None:
        """Queue a job that copies the job's CPU slots into this tier."""

    @abstractmethod
    def submit_load(self, job_metadata: JobMetadata) -> None:
        """Queue a job that copies blocks of this tier into the job's CPU slots."""

    @abstractmethod
    def get_finished(self) -> Iterable[JobResult]:
        """Results of the jobs that finished since the last call; never blocks."""

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext = None) -> None:  # noqa: B027
        """Mark blocks as recently used, ``keys[0]`` most recently."""

    def hold(self, keys: Collection[OffloadKey]) -> None:  # noqa: B027
        """Keep ``keys`` from being evicted until a matching :meth:`release` (an
        extension: the engine holds a key it loads from here until the load ends). Holds
        count, keys not stored here too. The default does nothing."""

    def release(self, keys: Collection[OffloadKey]) -> None:  # noqa: B027
        """Undo one :meth:`hold` of each key; releasing a key not held is an error of
        the caller and may raise :class:`~tiering.errors.InvalidArgumentError`."""

    def report_removals(self) -> None:
        """From now on, keep the keys this tier stops holding for :meth:`take_removed`
        (off until called, so that keys nobody reads never pile up); idempotent."""
        if self._removed is None:
            self._removed = deque()

    def take_removed(self) -> list[OffloadKey]:
        """The keys this tier stopped holding since the last call, oldest first: evicted,
        or dropped unverified (not by :meth:`clear`). Empty unless :meth:`report_removals`
        was called. One caller at a time, from any thread; each key comes once."""
        removed = self._removed or deque()
        return [removed.popleft() for _ in range(len(removed))]

    def _note_removed(self, keys: Iterable[OffloadKey]) -> None:
        """For subclasses: ``keys`` left the tier (kept only while removals are reported)."""
        if self._removed is not None:
            self._removed.extend(keys)

    @staticmethod
    @abstractmethod
    def get_tier_type() -> str:
        """The name this tier type is registered under, e.g. ``"nvme"``."""

    @abstractmethod
    def get_num_blocks(self) -> int:
        """Number of blocks stored in this tier now."""

    def clear(self) -> None:  # noqa: B027
        """Drop every block (used by tests and operators)."""

    def shutdown(self) -> None:  # noqa: B027
        """Stop at once and release resources; idempotent and synchronous."""

    def slot(self, block_id: int) -> memoryview:
        """The writable bytes of CPU slot ``block_id``."""
        if not 0 <= block_id < self.num_primary_slots:
            raise InvalidArgumentError(
                f"CPU slot {block_id} is outside the host pool (0..{self.num_primary_slots - 1})"
            )
        start = block_id * self.block_bytes
        return self.primary_kv_view[start : start + self.block_bytes]


def tier_capacity_blocks(tier: SecondaryTierManager) -> int | None:
    """The blocks ``tier`` holds at most, as its ``statistics()`` says (in blocks or in
    bytes); None when it says neither, or has no ``statistics``."""
    statistics = getattr(tier, "statistics", None)
    if not callable(statistics):
        return None
    stats = statistics()
    return stats.capacity_blocks or stats.capacity_bytes // tier.block_bytes or None
