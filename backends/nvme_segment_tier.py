"""The NVMe tier, registered as ``"nvme"``: KV blocks packed into segment files.

From the outside the same tier as the file-per-block :class:`backends.nvme.NVMeFileTier`
(``"nvme-files"``): namespaces, cap and free-space floor, disk full, verification
before serving, shared roots, fault injection. Inside, blocks are records appended to
large segment files (:mod:`backends.nvme_segments`), indexed by :class:`~backends.
nvme_segment_index.SegmentIndex` (about 50-65 bytes of memory per block), evicted a
whole segment at a time, oldest first, with the recently used blocks of the victim
written again (FIFO with reinsertion), and recovered from a checkpoint of the index plus
a scan of what was written after it. A store job is one vectored write per segment it
touches, not a create and a rename per block. Why it is the default, with figures:
``docs/nvme.md``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
from collections import Counter
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

from backends.nvme import NVMeTierBase, _result, refuse_derived_options
from backends.nvme_format import HEADER_BYTES
from backends.nvme_os import REAL_OS, FsyncPolicy, OsCalls, owner_alive
from backends.nvme_segment_index import Eviction, Placement, SegmentIndex, key_digest
from backends.nvme_segments import (
    CHECKPOINT_FILE,
    GIL_PAUSE_BYTES,
    SEGMENTS_DIR,
    ReadReport,
    SegmentFiles,
    SegmentScan,
    WriteReport,
    align_up,
    iter_runs,
    parse_segment_name,
)
from tiering.errors import InvalidArgumentError
from tiering.host_pool import io_buffer
from tiering.secondary import JobMetadata, JobResult, OffloadKey, ReqContext
from tiering.validation import hash_list, positive_int

logger = logging.getLogger(__name__)

DEFAULT_SEGMENT_BYTES = 256 << 20
"""The segment size when ``segment_bytes`` is not given, unless the cap is small (below)."""
MAX_RECORDS_PER_SEGMENT = 4096
"""Bounds the work of evicting one segment (one index deletion per record)."""
DERIVED_SEGMENTS_PER_CAP = 8
"""Without ``segment_bytes``, segments shrink so that the cap holds at least this many:
an eviction then gives up an eighth of the cache, not half of it."""
MIN_SEGMENTS_PER_CAP = 2
"""The fewest segments a cap must hold: the segment being written is never evicted, so
a cap of one segment fills once and then refuses every store."""
DEFAULT_HOT_FRACTION = 0.25
"""Blocks used within the last quarter of the capacity's worth of uses are moved, not
dropped, when their segment is evicted."""
MOVE_BYTES_PER_JOB = 64 << 20
"""The most bytes of moved records one store job reads and writes again."""
DEFAULT_CHECKPOINT_EVERY = 16384
"""Records written between checkpoints: what a restart scans beyond the checkpoint."""


@dataclass(slots=True)
class _DiskState:
    """What the start-up hop found, and the index it built from it (worker thread)."""

    index: SegmentIndex
    recovered: int
    excess: list[str]
    removed: Counter[str] = field(default_factory=Counter)
    checkpoint_note: str | None = None


class NVMeSegmentTier(NVMeTierBase):
    """A secondary tier keeping blocks as records of segment files under ``root``.

    Args: as :class:`backends.nvme.NVMeFileTier` (without ``policy``: eviction is by
    segment, oldest first), plus

        segment_bytes: the size a segment grows to before the next one starts (at most
            4096 records). Default: 256 MiB, or less for a cap under 2 GiB, so that
            the cap holds 8 segments (one record each at the least). Given, the cap
            must hold at least two segments.
        checkpoint_every: records written between index checkpoints (also written at a
            graceful close). A restart reads the checkpoint and scans only the records
            written after it.
        hot_fraction: blocks of an evicted segment used within the last this fraction
            of the capacity's worth of uses are written again rather than dropped (0:
            plain FIFO).
        gil_pause_bytes: bytes an I/O thread hashes before it lets go of the GIL for a
            moment, so that the event loop's thread is not kept waiting for it (0:
            never; for a tier on a loop of its own, whose lag delays only completions).
        staging_bytes: 0 (default) moves direct I/O straight between the disk and the
            slots; otherwise through a staging buffer of this many bytes per I/O thread
            (at least one record), on huge pages: for a ``primary_kv_view`` in memory of
            scattered 4 KiB pages, such as a shared memory file (vLLM's CPU tier), whose
            direct transfers would each go to the disk as many small requests
            (:class:`~backends.nvme_segments.SegmentFiles`). Costs one copy of each
            payload, off the loop and without the GIL.

    Guarantees (besides those of the file layout):

    * A store's keys become visible only after their records are written (and synced
      per ``fsync``: ``"batch"`` syncs each segment a job wrote once, ``"always"`` after
      every run of records).
    * A record is served only if its header (namespace, key, length, checksum) and
      payload checksum verify; a stale or damaged checkpoint can cost hits, never
      serve wrong bytes.
    * Space comes back by deleting whole segments; a segment being read or written,
      one holding a held key, and another live writer's segments are never deleted.

    Raises (constructor): InvalidArgumentError for any bad argument.
    """

    def __init__(
        self,
        primary_kv_view: memoryview,
        block_bytes: int,
        *,
        root: str | os.PathLike[str],
        namespace: str,
        capacity_bytes: int,
        segment_bytes: int | None = None,
        checkpoint_every: int = DEFAULT_CHECKPOINT_EVERY,
        hot_fraction: float = DEFAULT_HOT_FRACTION,
        fsync: FsyncPolicy = "batch",
        gil_pause_bytes: int = GIL_PAUSE_BYTES,
        staging_bytes: int = 0,
        os_calls: OsCalls = REAL_OS,
        **options: Any,
    ) -> None:
        refuse_derived_options(type(self), options)
        record_bytes = HEADER_BYTES + align_up(positive_int("block_bytes", block_bytes))
        records_per_segment = _records_per_segment(capacity_bytes, segment_bytes, record_bytes)
        self.gil_pause_bytes = positive_int("gil_pause_bytes", gil_pause_bytes, allow_zero=True)
        self.staging_bytes = positive_int("staging_bytes", staging_bytes, allow_zero=True)
        self.checkpoint_every = positive_int("checkpoint_every", checkpoint_every)
        if not isinstance(hot_fraction, int | float) or not 0 <= hot_fraction <= 1:
            raise InvalidArgumentError(f"hot_fraction must be in [0, 1], got {hot_fraction!r}")
        self.hot_fraction = float(hot_fraction)
        super().__init__(
            primary_kv_view,
            block_bytes,
            root=root,
            namespace=namespace,
            capacity_bytes=capacity_bytes,
            file_bytes=record_bytes,
            fsync=fsync,
            os_calls=os_calls,
            **options,
        )
        self.records_per_segment = records_per_segment
        self._segments = SegmentFiles(
            self.directory,
            block_bytes=self.block_bytes,
            ns_digest=self._ns_digest,
            fsync=fsync,
            gil_pause_bytes=gil_pause_bytes,
            staging_bytes=staging_bytes,
            sealer=self._sealer,
            file_mode=self.file_mode,
            os_calls=os_calls,
        )
        self._index = self._new_index()
        # Digests a running hop writes, with the event set when it ends: a store of
        # such a key waits for it rather than writing it twice.
        self._writing: dict[int, asyncio.Event] = {}
        self._writing_records = 0
        self._trash: list[str] = []  # segments given up, files not yet deleted
        self._generation = 0  # bumped by clear(): older hops' records are not committed
        self._since_checkpoint = 0
        self._local = threading.local()  # per I/O thread: buffers for moved records

    def _new_index(self) -> SegmentIndex:
        return SegmentIndex(
            self.capacity_blocks,
            records_per_segment=self.records_per_segment,
            writer=self._instance_id,
            hot_fraction=self.hot_fraction,
        )

    # -- life cycle -------------------------------------------------------------------

    async def aclose(self, timeout: float = 5.0) -> None:  # noqa: ASYNC109 - base API
        """Close as :meth:`TierActor.aclose`, then write the index checkpoint and delete
        the segments given up. Idempotent. After a hard :meth:`~TierActor.shutdown`
        the next start scans what was written after the last checkpoint."""
        first = not self.closed
        await super().aclose(timeout)
        if not first or not self._opened:
            return
        trash, self._trash = self._trash, []
        segments = self._index.checkpoint_segments()
        try:
            await asyncio.to_thread(self._close_on_disk, segments, trash)
        except OSError as exc:
            logger.warning("nvme tier: could not write the index checkpoint: %s", exc)

    def _close_on_disk(self, segments: list[tuple[int, str, int]], trash: list[str]) -> None:
        self._segments.delete(trash)
        self._checkpoint_hop(segments)

    def _subdirs(self) -> list[str]:
        return [SEGMENTS_DIR]

    def _free_bytes(self) -> int | None:
        return self._segments.free_bytes()

    def _use_o_direct(self, enabled: bool) -> None:
        self._segments.o_direct = enabled

    def _remove_excess(self, excess: list[str]) -> None:
        self._segments.delete(excess)

    def _scan_disk(self) -> _DiskState:
        """Worker thread: read the checkpoint, scan what it does not cover, build the
        index (the loop is not blocked while a large index is rebuilt)."""
        files = self._segments
        removed: Counter[str] = Counter()
        self._remove_dead_temporaries(removed)
        checkpoint, note = files.read_checkpoint()
        covered = dict(checkpoint.segments) if checkpoint is not None else {}
        present = files.list_segments()
        alive: dict[str, bool] = {}
        on_disk: list[tuple[str, int, float]] = []
        scans: dict[str, SegmentScan] = {}
        protected: set[str] = set()
        for name, size in present:
            writer = parse_segment_name(name)[0]  # type: ignore[index]
            if writer not in alive:
                alive[writer] = owner_alive(self.directory, writer)
            records = files.records_in(size)
            start = min(covered.get(name, 0), records)
            try:
                scan = files.scan(name, start) if start < records or name not in covered else None
            except OSError:
                continue
            if scan is not None and not scan.header_ok and not scan.records and not start:
                if not alive[writer] and files.delete([name]):
                    removed["corrupt segment"] += 1
                continue
            if scan is not None:
                scans[name] = scan
                removed["invalid record"] += scan.invalid
            if alive[writer]:
                protected.add(name)
            with contextlib.suppress(OSError):
                on_disk.append((name, records, os.stat(files.path_of(name)).st_mtime))
        order = {name: i for i, (name, _) in enumerate(checkpoint.segments if checkpoint else [])}
        on_disk.sort(key=lambda item: (order.get(item[0], len(order)), item[2], item[0]))
        listed = [(name, records) for name, records, _ in on_disk]
        index = self._new_index()
        recovered = index.restore(checkpoint, listed, scans, protected)
        excess = [name for name in index.excess_segments(listed) if name not in protected]
        return _DiskState(index, recovered, excess, removed, note)

    def _remove_dead_temporaries(self, removed: Counter[str]) -> None:
        prefix = CHECKPOINT_FILE + "."
        for entry in os.scandir(self.directory):
            if not (entry.name.startswith(prefix) and entry.name.endswith(".tmp")):
                continue
            writer = entry.name[len(prefix) : -len(".tmp")]
            if writer != self._instance_id and not owner_alive(self.directory, writer):
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)
                    removed["temporary"] += 1

    def _adopt_scan(self, scan: _DiskState) -> list[str]:
        self._index = scan.index
        self.metrics.recovered_blocks = scan.recovered
        self.metrics.removed_on_recovery.update(scan.removed)
        if scan.recovered or scan.excess or scan.removed:
            logger.info(
                "nvme tier: recovered %d blocks in %s (%s; %d segments over the cap "
                "removed); removed %s",
                scan.recovered,
                self.directory,
                scan.checkpoint_note or "from the checkpoint and the segments after it",
                len(scan.excess),
                dict(scan.removed) or "nothing",
            )
        return scan.excess

    # -- queries ----------------------------------------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext = None) -> bool | None:
        """True if stored, None while a store of it is queued or running, else False.

        Raises:
            InvalidArgumentError: ``key`` is not bytes.
        """
        if not isinstance(key, bytes):
            raise InvalidArgumentError(f"keys must be bytes, got {type(key).__name__}")
        digest = key_digest(key)
        if digest in self._index:
            return True
        return None if self.storing(key) else False

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext = None) -> None:
        """Mark stored keys recently used; others are ignored."""
        self._index.touch(key_digest(key) for key in hash_list("keys", keys))

    def hold(self, keys: Collection[OffloadKey]) -> None:
        """Keep ``keys``' segments from eviction until released (holds count).

        Raises:
            InvalidArgumentError: ``keys`` is not a collection of bytes; nothing held.
        """
        self._index.hold([key_digest(key) for key in hash_list("keys", keys)])

    def release(self, keys: Collection[OffloadKey]) -> None:
        """Undo one :meth:`hold` of each key.

        Raises:
            InvalidArgumentError: a key is not bytes or released more often than held;
                nothing released.
        """
        self._index.release([key_digest(key) for key in hash_list("keys", keys)])

    def get_num_blocks(self) -> int:
        """Blocks stored and loadable now."""
        return len(self._index)

    @property
    def used_bytes(self) -> int:
        """Bytes of the segments' record slots (dead records included)."""
        return self._index.used_records * self.file_bytes

    def clear(self) -> None:
        """Drop every block: lookups miss at once, stores running now do not land.

        The segment files are deleted by the next store job or by :meth:`aclose`.
        """
        self._generation += 1
        self._trash.extend(self._index.clear())
        self._space.freed()

    def _pinned_blocks(self) -> int:
        return self._index.pinned_records

    # -- hooks ------------------------------------------------------------------------

    async def _do_store(self, job: JobMetadata) -> JobResult:
        failed, wanted = await self._store_admission(job)
        if not wanted:
            return _result(job.job_id, failed, len(job.keys))
        done = asyncio.Event()
        digests = {key: key_digest(key) for key in wanted}
        for digest in digests.values():
            self._writing[digest] = done
        budget = len(wanted) * self.block_bytes
        placed: list[Placement] = []
        generation = self._generation
        try:
            await self._budget.acquire(budget, is_load=False)
            try:
                pending = self._index.used_records - self._writing_records
                if self._space.stale(self._writing_records + len(wanted)):
                    await self._refresh_free_bytes()
                limit, reason = self._space.limit(pending, self._writing_records)
                fit, evictions = self._index.make_room(len(wanted), limit=limit)
                hot = sum(len(e.reinsert) for e in evictions)
                if hot:  # room for the evicted segments' recently used blocks too
                    evictions += self._index.make_room(fit + hot, limit=limit)[1]
                bound = min(limit, self.capacity_blocks)
                moves = self._moves(evictions, bound - self._index.used_records - fit)
                gone: list[tuple[str, int]] = []
                if evictions:
                    gone = self._dropped_records(evictions, moves)
                    self.metrics.evicted_blocks += len(gone)
                    self._space.freed()
                    if self._removed is None:
                        gone = []  # nobody asks which keys they held
                admitted = list(wanted.items())[:fit]
                if fit < len(wanted):
                    refused = list(wanted)[fit:]
                    reason += "; every other segment is in use (read, written or held)"
                    failed.update(dict.fromkeys(refused, reason))
                    self.metrics.refused_blocks += len(refused)
                    self._failure_log.record("no room", len(refused), reason)
                placed = self._index.place(fit + len(moves))
                self._writing_records += len(placed)
                delete = [e.segment for e in evictions] + self._trash
                self._trash = []
                try:
                    report, moved, gone_keys = await self.run_blocking(
                        self._store_hop, admitted, placed, moves, gone, delete
                    )
                except BaseException:  # the hop never ran: its deletions are still owed
                    self._trash.extend(delete)
                    raise
            finally:
                self._budget.release(budget)
            self._commit_store(report, admitted, placed[:fit], digests, generation, failed)
            self._commit_moves(report, moved, placed[fit:], generation)
            self._note_removed(
                key for key in gone_keys if key is not None and key_digest(key) not in self._index
            )
            placed = []
            if self._since_checkpoint >= self.checkpoint_every and generation == self._generation:
                await self._checkpoint()
        finally:
            if placed and generation == self._generation:  # cancelled before the commit
                for placement in placed:
                    self._index.abandon(placement)
            self._writing_records -= len(placed) if placed else 0
            for digest in digests.values():
                if self._writing.get(digest) is done:
                    del self._writing[digest]
            done.set()
        return _result(job.job_id, failed, len(job.keys))

    async def _do_load(self, job: JobMetadata) -> JobResult:
        failed: dict[OffloadKey, str] = {}
        reads: list[tuple[OffloadKey, str, int, int]] = []
        for key, block_id in zip(job.keys, job.block_ids, strict=True):
            where = self._index.locate(key_digest(key))
            if where is None:
                failed[key] = "not in the nvme tier"
            else:
                reads.append((key, where[0], where[1], block_id))
        if failed:
            self._failure_log.record("not in the tier", len(failed))
        if not reads:
            return _result(job.job_id, failed, len(job.keys))
        for _, segment, _, _ in reads:
            self._index.pin(segment)
        generation = self._generation
        budget = len(reads) * self.block_bytes
        try:
            await self._budget.acquire(budget, is_load=True)
            try:
                report = await self.run_blocking(self._load_hop, reads)
            finally:
                self._budget.release(budget)
        finally:
            for _, segment, _, _ in reads:
                self._index.unpin(segment)
        self._commit_load(report, reads, generation, failed)
        return _result(job.job_id, failed, len(job.keys))

    # -- worker thread: one hop per job ------------------------------------------------

    def _store_hop(
        self,
        admitted: Sequence[tuple[OffloadKey, int]],
        placed: Sequence[Placement],
        moves: Sequence[tuple[str, int]],
        gone: Sequence[tuple[str, int]],
        delete: Sequence[str],
    ) -> tuple[WriteReport, list[bytes | None], list[bytes | None]]:
        """Read the recently used records of evicted segments and the keys of the
        ``gone`` records, delete those segments, then write the job's blocks and the
        moved records: ``placed`` holds the job's placements, then one per move. Returns
        the write's report, each move's key (None where its record did not verify: it is
        not written) and each gone record's key (None where its header did not)."""
        buffers = self._move_buffers(len(moves))
        moved = self._segments.read_records(
            [
                (segment, record, buffer)
                for (segment, record), buffer in zip(moves, buffers, strict=True)
            ]
        )
        gone_keys = self._segments.read_keys(gone)
        self._segments.delete(delete)
        slot = self.slot
        records = [(key, slot(block_id)) for key, block_id in admitted]
        where = [(p.segment, p.record, p.create) for p in placed[: len(admitted)]]
        for key, buffer, placement in zip(moved, buffers, placed[len(admitted) :], strict=True):
            if key is not None:
                records.append((key, buffer))
                where.append((placement.segment, placement.record, placement.create))
        runs = list(iter_runs(where, records))
        return self._segments.write(runs, writer=self._instance_id), moved, gone_keys

    def _move_buffers(self, count: int) -> list[memoryview]:
        # Aligned (O_DIRECT) buffers for moved records, one set per I/O thread.
        if not count:
            return []
        size = count * self.block_bytes
        view: memoryview | None = getattr(self._local, "moves", None)
        if view is None or view.nbytes < size:
            view = io_buffer(max(size, MOVE_BYTES_PER_JOB))
            self._local.moves = view
        return [view[i * self.block_bytes : (i + 1) * self.block_bytes] for i in range(count)]

    def _load_hop(self, reads: Sequence[tuple[OffloadKey, str, int, int]]) -> ReadReport:
        slot = self.slot
        return self._segments.read(
            [(key, segment, record, slot(block_id)) for key, segment, record, block_id in reads]
        )

    def _checkpoint_hop(self, segments: list[tuple[int, str, int]]) -> None:
        # The entries are copied here, off the loop, while the loop goes on.
        checkpoint = self._index.snapshot(segments)
        self._segments.write_checkpoint(checkpoint, temp_suffix=self._instance_id)

    # -- bookkeeping (loop thread) -------------------------------------------------------

    def _holds_key(self, key: OffloadKey) -> bool:
        return key_digest(key) in self._index

    async def _wait_for_writes(self, wanted: dict[OffloadKey, int]) -> dict[OffloadKey, int]:
        """Wait until no running hop writes a wanted key; drop those stored meanwhile."""
        while self._writing:
            events = {
                event for key in wanted if (event := self._writing.get(key_digest(key))) is not None
            }
            if not events:
                break
            for event in events:
                await event.wait()
            wanted = {k: b for k, b in wanted.items() if key_digest(k) not in self._index}
        return wanted

    def _commit_store(
        self,
        report: WriteReport,
        admitted: Sequence[tuple[OffloadKey, int]],
        placed: Sequence[Placement],
        digests: dict[OffloadKey, int],
        generation: int,
        failed: dict[OffloadKey, str],
    ) -> None:
        self._writing_records -= len(placed)
        written = set(report.written)
        if generation != self._generation:  # cleared while being written
            self._trash.extend({p.segment for p in placed})
        else:
            for (key, _), placement in zip(admitted, placed, strict=True):
                if key in written:
                    self._index.commit(digests[key], placement)
                else:
                    self._index.abandon(placement)
        self._since_checkpoint += len(written)
        if report.failed:
            failed.update(report.failed)
            cause = "disk full" if report.disk_full else "write error"
            self._failure_log.record(cause, len(report.failed), next(iter(report.failed.values())))
        self.metrics.stored_blocks += len(written)
        self.metrics.bytes_written += len(written) * self.file_bytes
        self.metrics.write_errors += len(report.failed)
        self._store_space_ended(
            report.free_bytes, disk_full=report.disk_full, stored_any=bool(written)
        )

    def _moves(self, evictions: Sequence[Eviction], room: int) -> list[tuple[str, int]]:
        """The recently used records of ``evictions`` to write again: as many as ``room``
        records and the per-job byte bound allow (the newest records when not all fit)."""
        hot = [(e.segment, record) for e in evictions for _, record in e.reinsert]
        most = min(max(0, room), max(1, MOVE_BYTES_PER_JOB // self.block_bytes))
        return hot[-most:] if most else []

    @staticmethod
    def _dropped_records(
        evictions: Sequence[Eviction], moves: Sequence[tuple[str, int]]
    ) -> list[tuple[str, int]]:
        """The records of ``evictions`` whose blocks leave the tier: those dropped, and
        the recently used ones that are not moved."""
        moving = set(moves)
        return [(e.segment, record) for e in evictions for record in e.dropped] + [
            (e.segment, record)
            for e in evictions
            for _, record in e.reinsert
            if (e.segment, record) not in moving
        ]

    def _commit_moves(
        self,
        report: WriteReport,
        moved: Sequence[bytes | None],
        placed: Sequence[Placement],
        generation: int,
    ) -> None:
        """Index the moved records that were written, unless the key was stored again
        meanwhile (the newer record wins) or the tier was cleared."""
        self._writing_records -= len(placed)
        written = set(report.written)
        for key, placement in zip(moved, placed, strict=True):
            if generation != self._generation:
                continue
            digest = None if key is None else key_digest(key)
            if key in written and digest not in self._index:
                self._index.commit(digest, placement)  # type: ignore[arg-type]
                self.metrics.relocated_blocks += 1
            else:
                self._index.abandon(placement)
                self.metrics.evicted_blocks += 1
                if key is not None and digest not in self._index:
                    self._note_removed((key,))

    def _commit_load(
        self,
        report: ReadReport,
        reads: Sequence[tuple[OffloadKey, str, int, int]],
        generation: int,
        failed: dict[OffloadKey, str],
    ) -> None:
        self.metrics.loaded_blocks += len(report.loaded)
        self.metrics.bytes_read += len(report.loaded) * self.file_bytes
        if report.loaded:
            self._index.touch(key_digest(key) for key in report.loaded)
        if not report.failed:
            return
        corrupt, missing = set(report.corrupt), set(report.missing)
        where = {key: (segment, record) for key, segment, record, _ in reads}
        for key, reason in report.failed.items():
            failed[key] = reason
            if key in corrupt:
                self.metrics.corrupt_blocks += 1
                self._failure_log.record("corrupt block", 1, reason)
            elif key in missing:
                self.metrics.missing_blocks += 1
                self._failure_log.record("block missing", 1, reason)
            else:
                self.metrics.read_errors += 1
                self._failure_log.record("read error", 1, reason)
            digest = key_digest(key)
            if generation == self._generation and self._index.locate(digest) == where[key]:
                self._index.remove(digest)
                self._note_removed((key,))

    async def _checkpoint(self) -> None:
        self._since_checkpoint = 0
        self._local = threading.local()  # per I/O thread: buffers for moved records
        try:
            await self.run_blocking(self._checkpoint_hop, self._index.checkpoint_segments())
        except OSError as exc:
            self._failure_log.record("checkpoint failed", 1, str(exc))


def _records_per_segment(capacity_bytes: object, segment_bytes: object, record_bytes: int) -> int:
    """Records a segment takes: from ``segment_bytes``, or (None) from the cap.

    Raises:
        InvalidArgumentError: ``segment_bytes`` is not a positive int or None, or the cap
            holds fewer than two segments (both options named); a bad ``capacity_bytes``
            is left to the space guard, which names it.
    """
    if segment_bytes is not None:
        positive_int("segment_bytes", segment_bytes)
    if not isinstance(capacity_bytes, int) or isinstance(capacity_bytes, bool):
        capacity_bytes = 0  # the space guard refuses it, naming it
    capacity_records = capacity_bytes // record_bytes
    largest = min(MAX_RECORDS_PER_SEGMENT, (DEFAULT_SEGMENT_BYTES - HEADER_BYTES) // record_bytes)
    if segment_bytes is None:
        records = max(1, min(largest, capacity_records // DERIVED_SEGMENTS_PER_CAP))
        if 0 < capacity_records < MIN_SEGMENTS_PER_CAP:
            raise InvalidArgumentError(
                f"capacity_bytes={capacity_bytes} holds {capacity_records} record of "
                f"{record_bytes} bytes; a segment tier needs room for at least "
                f"{MIN_SEGMENTS_PER_CAP} (the segment being written is never evicted)"
            )
        return records
    records = max(1, min(MAX_RECORDS_PER_SEGMENT, (segment_bytes - HEADER_BYTES) // record_bytes))
    if 0 < capacity_records < MIN_SEGMENTS_PER_CAP * records:
        raise InvalidArgumentError(
            f"capacity_bytes={capacity_bytes} holds {capacity_records} records of "
            f"{record_bytes} bytes, fewer than {MIN_SEGMENTS_PER_CAP} segments of "
            f"segment_bytes={segment_bytes} ({records} records each): the segment being "
            "written is never evicted, so the tier would fill once and then refuse every "
            "store; raise capacity_bytes, lower segment_bytes, or leave segment_bytes out "
            "(it then follows from the cap)"
        )
    return records


__all__ = ["NVMeSegmentTier"]
