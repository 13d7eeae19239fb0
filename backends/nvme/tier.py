"""The NVMe tier, registered as ``"nvme"`` (docs/nvme.md): the actor shell. Its index
decides on the loop thread; each job's blocking half is ONE :class:`SegmentFiles` call on
the tier's I/O threads; the file-system operations around them go through aiofiles."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import threading
import uuid
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import xxhash

from backends.nvme.options import NVMeOptions
from backends.nvme.os_calls import REAL_OS, OwnerLock, fs_call, probe_o_direct, to_the_end
from backends.nvme.recovery import Recovery, open_directory, recover, write_checkpoint
from backends.nvme.segment_format import namespace_dirname
from backends.nvme.segment_index import (
    DISK_FULL_REASON,
    Placement,
    SegmentIndex,
    SpaceGuard,
    key_digest,
    records_per_segment,
)
from backends.nvme.segments import (
    MOVE_BYTES_PER_JOB,
    ReadOutcome,
    SegmentFiles,
    StoreHop,
    WriteReport,
    align_up,
)
from tiering.errors import ClosedError, InvalidArgumentError, TieringError
from tiering.observe.statistics import DISK_FULL, NO_ROOM, FailureLog
from tiering.security.encryption import BlockCipher, keyring_from
from tiering.tiers.actor import TierActor
from tiering.tiers.block_record import HEADER_BYTES, MAX_KEY_BYTES, namespace_digest
from tiering.tiers.tier_api import JobMetadata, JobResult, OffloadKey, ReqContext
from tiering.validation import check_offload_key, hash_list, positive_int

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class NVMeMetrics:
    """Counters of one NVMe tier since it was created (blocks unless named bytes)."""

    stored_blocks: int = 0
    loaded_blocks: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    evicted_blocks: int = 0
    corrupt_blocks: int = 0  # loads whose record failed verification
    missing_blocks: int = 0  # loads whose segment had vanished (another engine removed it)
    read_errors: int = 0
    write_errors: int = 0  # ENOSPC included
    refused_blocks: int = 0  # stores refused without I/O: no room, or read-only
    disk_full_events: int = 0  # times ENOSPC turned the tier read-only
    recovered_blocks: int = 0
    relocated_blocks: int = 0  # recently used blocks of an evicted segment written again
    removed_on_recovery: Counter[str] = field(default_factory=Counter)


class InflightBytes:
    """A loop-thread byte budget for jobs' I/O: waiting loads are admitted before stores,
    and a job larger than the whole budget runs alone rather than never."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self._waiting: dict[bool, deque[tuple[int, asyncio.Future[None]]]]
        self._waiting = {True: deque(), False: deque()}  # by is_load

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


class NVMeTier(TierActor):
    """A secondary tier keeping blocks as records of segment files under ``root``
    (options: :class:`NVMeOptions`; promises: docs/nvme.md). A store's keys become
    visible once written (and synced per ``fsync``); keys held are skipped, a key twice
    in a job is stored from its first slot. A record is served only if it verifies; a key
    that fails is in ``failed_keys`` while the job's other keys land. Space returns by
    whole segments; after ENOSPC stores fail (loads go on) until one succeeds. A key that
    is not bytes raises InvalidArgumentError and changes nothing."""

    Options = NVMeOptions

    def __init__(
        self,
        primary_kv_view: memoryview,
        block_bytes: int,
        options: NVMeOptions | None = None,
        /,
        **values: Any,
    ) -> None:
        """Takes an :class:`NVMeOptions`, keywords, or both (keywords win); InvalidArgumentError
        for a bad view, size or option (named), or a cap under two segments."""
        o = NVMeOptions.check({**dict(options or {}), **values}, owner="NVMeTier")
        record_bytes = HEADER_BYTES + align_up(positive_int("block_bytes", block_bytes))
        self.records_per_segment = records_per_segment(
            o.capacity_bytes, o.segment_bytes, record_bytes
        )
        keyring = keyring_from(o.encryption, option="encryption")
        directory = os.path.join(os.fspath(o.root), namespace_dirname(o.namespace))
        self._space = SpaceGuard(
            file_bytes=record_bytes,
            capacity_bytes=o.capacity_bytes,
            min_free_bytes=o.min_free_bytes,
            retry_s=o.enospc_retry_s,
            clock=o.clock,
            where=directory,
        )
        super().__init__(primary_kv_view, block_bytes, **o.actor_options())
        self.options = o
        self.root = os.fspath(o.root)
        self.namespace = o.namespace
        self.directory = directory
        self.file_bytes = record_bytes  # one block on disk, its header page included
        self.capacity_bytes = o.capacity_bytes
        self.capacity_blocks = self._space.capacity_blocks
        if o.drive_writes_per_day is not None:  # the tier's capacity, so many times a day
            daily = o.drive_writes_per_day * o.capacity_bytes / 86400
            self.write_budget = daily if o.write_budget is None else min(o.write_budget, daily)
        # Read by the vLLM adapter's tests and the replay model (tiering.lab.replay.tier_layout).
        self.gil_pause_bytes, self.staging_bytes = o.gil_pause_bytes, o.staging_bytes
        self.hot_fraction = o.hot_fraction
        self.moves_per_job = max(1, MOVE_BYTES_PER_JOB // self.block_bytes)
        self.o_direct: bool | None = None  # whether O_DIRECT is in use, once started
        self.metrics = NVMeMetrics()  # what statistics().counters shows
        self._failure_log = FailureLog(logger, "nvme tier")
        self._os = o.os_calls or REAL_OS
        self._instance_id = uuid.uuid4().hex
        self._budget = InflightBytes(o.max_inflight_bytes)
        self._owner: OwnerLock | None = None
        self._opened = False
        self._start_lock = asyncio.Lock()
        self._segments = SegmentFiles(
            self.directory,
            block_bytes=self.block_bytes,
            ns_digest=namespace_digest(o.namespace),
            fsync=o.fsync,
            gil_pause_bytes=o.gil_pause_bytes,
            staging_bytes=o.staging_bytes,
            cipher=None if keyring is None else BlockCipher(keyring),
            file_mode=o.file_mode,
            os_calls=self._os,
        )
        self._index = self._new_index()
        # Digests a running hop writes -> its end: a store of one waits, not writes twice.
        self._writing: dict[int, asyncio.Event] = {}
        self._writing_records = 0
        self._trash: list[str] = []  # segments given up, files not yet deleted
        # Records in the trash whose keys removals still owe (their hop never ran).
        self._owed: list[tuple[str, int]] = []
        self._generation = 0  # bumped by clear(): older hops' records are not committed
        self._since_checkpoint = 0
        # Set while no checkpoint is being written: one at a time, they share a temp file.
        self._checkpoint_idle = asyncio.Event()
        self._checkpoint_idle.set()

    def _new_index(self) -> SegmentIndex:
        return SegmentIndex(
            self.capacity_blocks,
            records_per_segment=self.records_per_segment,
            writer=self._instance_id,
            hot_fraction=self.hot_fraction,
        )

    @staticmethod
    def get_tier_type() -> str:
        return "nvme"

    async def start(self) -> None:
        """Open the namespace directory, recover the index, then serve. ClosedError once
        closed; InvalidArgumentError when the root fails :func:`check_root`, is not
        writable, holds another namespace, or refuses ``o_direct=True``; TieringError for
        any other OS error (with it)."""
        if self.closed:
            raise ClosedError(f"{self._name()} is closed and cannot be restarted")
        async with self._start_lock:
            if self._opened:
                await super().start()
                return
            try:
                # Cancelled, it still ends (as one hop did): no file is left half made.
                probe, found, free = await to_the_end(self._open_on_disk())
                excess = self._adopt(probe, found, free)
            except BaseException as exc:
                self._release_owner()
                if not isinstance(exc, OSError):
                    raise
                raise TieringError(
                    f"nvme tier: root={self.root!r} cannot be used (it must be a writable "
                    f"directory or creatable as one): {exc}"
                ) from exc
            self._opened = True
            if excess:  # before serving: no store may race this clean-up
                await self.run_blocking(self._segments.delete, excess)
            # A pool starts its threads lazily (the first jobs would wait for each start):
            # calls that wait for each other make it start every thread now.
            meeting = threading.Barrier(self.io_threads)
            await asyncio.gather(
                *(self.run_blocking(_meet, meeting) for _ in range(self.io_threads))
            )
            await super().start()

    async def aclose(self, timeout: float = 5.0) -> None:  # noqa: ASYNC109 - base API
        """Close as :meth:`TierActor.aclose`, then delete the segments given up and write
        the index checkpoint."""
        first = not self.closed
        await super().aclose(timeout)
        if not first or not self._opened:
            return
        trash, self._trash = self._trash, []
        owed, self._owed = self._owed, []
        # The pool is shut down by now: the loop's executor runs the blocking calls.
        if trash or owed:  # a hop that only reads the keys owed and deletes the trash
            hop = StoreHop([], [], [], owed, trash)
            await asyncio.to_thread(self._segments.store, hop, self.slot, self._instance_id)
            self._note_given_up(hop.gone_keys or [])
        # A job's checkpoint can outlive the close deadline (it runs to its end).
        await self._checkpoint_idle.wait()
        try:
            await self._write_checkpoint(asyncio.to_thread)
        except OSError as exc:
            logger.warning("nvme tier: could not write the index checkpoint: %s", exc)

    def _on_closed(self) -> None:
        # Not in shutdown(), which from another thread only schedules the stop: the
        # lock must outlive the writes still running.
        self._release_owner()

    async def _open_on_disk(self) -> tuple[str | None, Recovery, int | None]:
        # The directory opened, the floor checked, the owner lock taken, O_DIRECT probed
        # (a hop), the index recovered (a hop), free space measured.
        await open_directory(
            self.root,
            self.directory,
            self.namespace,
            dir_mode=self.options.dir_mode,
            file_mode=self.options.file_mode,
            writer=self._instance_id,
        )
        statvfs = await fs_call(self._os.statvfs, self.directory)
        self._space.check_file_system(statvfs.f_blocks * statvfs.f_frsize, self.root)
        self._owner = await fs_call(OwnerLock, self.directory, self._instance_id)
        if self.options.o_direct is not False:
            probe = await self.run_blocking(probe_o_direct, self.directory, self._os)
        else:
            probe = "disabled by configuration (o_direct=False)"
        found = await recover(
            self._segments,
            lambda _: self._new_index(),
            writer=self._instance_id,
            run_blocking=self.run_blocking,
        )
        return probe, found, await fs_call(self._segments.free_bytes)

    def _adopt(self, probe: str | None, found: Recovery, free: int | None) -> list[str]:
        # The start-up findings taken; returns the segments over the cap (to delete).
        if probe is not None and self.options.o_direct is True:
            raise InvalidArgumentError(
                f"o_direct=True but the file system at {self.directory!r} refuses it: {probe}"
            )
        self.o_direct = probe is None
        self._segments.o_direct = self.o_direct
        if probe is not None and self.options.o_direct is None:
            why = "nvme tier: O_DIRECT not usable at %s (%s); using buffered I/O"
            logger.warning(why, self.directory, probe)
        self._space.measured(free)
        self._index = found.index
        self.metrics.recovered_blocks = found.recovered
        self.metrics.removed_on_recovery.update(found.removed)
        if found.recovered or found.excess or found.removed:
            logger.info(
                "nvme tier: recovered %d blocks in %s (%s; %d segments over the cap "
                "removed); removed %s",
                found.recovered,
                self.directory,
                found.checkpoint_note or "from the checkpoint and the segments after it",
                len(found.excess),
                dict(found.removed) or "nothing",
            )
        return found.excess

    def _release_owner(self) -> None:
        owner, self._owner = self._owner, None
        if owner is not None:
            owner.release()

    @property
    def read_only(self) -> bool:
        """True while stores are refused because the file system was full (ENOSPC)."""
        return self._space.read_only

    def lookup(self, key: OffloadKey, req_context: ReqContext = None) -> bool | None:
        """True if stored, None while a store of it is queued or running, else False."""
        check_offload_key(key)
        if key_digest(key) in self._index:
            return True
        return None if self.storing(key) else False

    def lookup_all(self, keys: Sequence[OffloadKey]) -> list[bool | None]:
        """:meth:`lookup` of each of ``keys`` in one probe of the index."""
        keys = hash_list("keys", keys)
        digest = xxhash.xxh3_64_intdigest  # key_digest, inlined: the batch is the point
        present = self._index.present([digest(key) or 1 for key in keys])
        if present.all():
            return [True] * len(keys)
        return [
            True if held else (None if self.storing(key) else False)
            for held, key in zip(present.tolist(), keys, strict=True)
        ]

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext = None) -> None:
        """Mark stored keys recently used, ``keys[0]`` the most recent; others are ignored."""
        self._index.touch([key_digest(key) for key in hash_list("keys", keys)])

    def hold(self, keys: Collection[OffloadKey]) -> None:
        """Keep ``keys``' segments from eviction until released (holds count)."""
        self._index.hold([key_digest(key) for key in hash_list("keys", keys)])

    def release(self, keys: Collection[OffloadKey]) -> None:
        """Undo one :meth:`hold` of each key; InvalidArgumentError for a key released more
        often than held (named in hex)."""
        keys = hash_list("keys", keys)
        digests = [key_digest(key) for key in keys]
        key_of = dict(zip(digests, keys, strict=True))
        self._index.release(digests, named=lambda digest: f"key {key_of[digest].hex()}")

    def get_num_blocks(self) -> int:
        return len(self._index)

    @property
    def used_bytes(self) -> int:
        """Bytes of the segments' record slots (dead records included)."""
        return self._index.used_records * self.file_bytes

    def clear(self) -> None:
        """Drop every block: lookups miss at once, stores running now do not land; the
        files go with the next store job or :meth:`aclose`."""
        self._generation += 1
        self._trash.extend(self._index.clear())
        self._space.freed()

    def _usage(self) -> dict[str, Any]:
        removed = self.metrics.removed_on_recovery.total()
        counters = {**asdict(self.metrics), "removed_on_recovery": removed}
        return {
            "used_blocks": self.get_num_blocks(),
            "capacity_blocks": self.capacity_blocks,
            "used_bytes": self.used_bytes,
            "capacity_bytes": self.capacity_bytes,
            "pinned_blocks": self._index.pinned_records,
            "counters": counters,
            "failures": dict(self._failure_log.counts),
        }

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
                hop = await self._plan_store(wanted, failed)
                placed = list(hop.placed)
                try:
                    report = await self.run_blocking(
                        self._segments.store, hop, self.slot, self._instance_id
                    )
                except BaseException:  # cancelled (by a close's deadline), or a bug
                    self._hop_lost(hop)
                    raise
            finally:
                self._budget.release(budget)
            self._commit_store(report, hop, digests, generation, failed)
            self._note_given_up(hop.gone_keys or [])
            placed = []
            due = self._since_checkpoint >= self.options.checkpoint_every
            if due and generation == self._generation:
                await self._checkpoint()
        finally:
            if placed and generation == self._generation:  # cancelled before the commit
                for placement in placed:
                    self._index.abandon(placement)
            self._writing_records -= len(placed)
            for digest in digests.values():
                if self._writing.get(digest) is done:
                    del self._writing[digest]
            done.set()
        return _result(job.job_id, failed, len(job.keys))

    async def _store_admission(
        self, job: JobMetadata
    ) -> tuple[dict[OffloadKey, str], dict[OffloadKey, int]]:
        # ``(failed, wanted: key -> slot)``: keys a header cannot hold fail, keys held (or
        # repeated) are skipped, keys a running hop writes are waited for, and while the
        # disk is full every wanted key fails.
        failed: dict[OffloadKey, str] = {}
        wanted: dict[OffloadKey, int] = {}
        for key, block_id in zip(job.keys, job.block_ids, strict=True):
            if len(key) > MAX_KEY_BYTES or not key:
                failed[key] = f"key length {len(key)} is outside 1..{MAX_KEY_BYTES}"
            elif key not in wanted and key_digest(key) not in self._index:
                wanted[key] = block_id
        if failed:
            self._failure_log.record("bad key length", len(failed), next(iter(failed.values())))
        while self._writing and wanted:  # a store of a key a running hop writes waits
            events = {e for key in wanted if (e := self._writing.get(key_digest(key))) is not None}
            if not events:
                break
            for event in events:
                await event.wait()
            wanted = {k: b for k, b in wanted.items() if key_digest(k) not in self._index}
        if wanted and self._space.refusing():
            self.metrics.refused_blocks += len(wanted)
            self._failure_log.record(DISK_FULL, len(wanted), DISK_FULL_REASON)
            failed.update(dict.fromkeys(wanted, DISK_FULL_REASON))
            wanted = {}
        return failed, wanted

    async def _plan_store(
        self, wanted: dict[OffloadKey, int], failed: dict[OffloadKey, str]
    ) -> StoreHop:
        # Room made for ``wanted`` (space measured first when stale); what does not fit
        # fails (in ``failed``).
        pending = self._index.used_records - self._writing_records
        if self._space.stale(self._writing_records + len(wanted)):
            self._space.measured(await self.run_blocking(self._segments.free_bytes))
        limit, reason = self._space.limit(pending, self._writing_records)
        plan = self._index.plan_room(len(wanted), limit=limit, most_moves=self.moves_per_job)
        gone = plan.gone
        if plan.evictions:
            self.metrics.evicted_blocks += len(gone)
            self._space.freed()
        if self._removed is None:
            gone = []  # nobody asks which keys they held
        else:
            gone, self._owed = gone + self._owed, []  # their segments go too
        if plan.fit < len(wanted):
            refused = list(wanted)[plan.fit :]
            reason += "; every other segment is in use (read, written or held)"
            failed.update(dict.fromkeys(refused, reason))
            self.metrics.refused_blocks += len(refused)
            self._failure_log.record(NO_ROOM, len(refused), reason)
        self._writing_records += len(plan.placed)
        delete, self._trash = [e.segment for e in plan.evictions] + self._trash, []
        admitted = list(wanted.items())[: plan.fit]
        return StoreHop(admitted, plan.placed, plan.moves, gone, delete)

    async def _do_load(self, job: JobMetadata) -> JobResult:
        failed: dict[OffloadKey, str] = {}
        reads: list[tuple[OffloadKey, str, int, int]] = []
        for key, block_id in zip(job.keys, job.block_ids, strict=True):
            where = self._index.locate(key_digest(key))
            if where is None:
                failed[key] = "not in the nvme tier"
            else:
                reads.append((key, *where, block_id))
                self._index.pin(where[0])  # not evicted while read
        if failed:
            self._failure_log.record("not in the tier", len(failed))
        if not reads:
            return _result(job.job_id, failed, len(job.keys))
        generation = self._generation
        budget = len(reads) * self.block_bytes
        try:
            await self._budget.acquire(budget, is_load=True)
            try:
                report = await self.run_blocking(self._segments.load, reads, self.slot)
            finally:
                self._budget.release(budget)
        finally:
            for _, segment, _, _ in reads:
                self._index.unpin(segment)
        self._commit_load(report, reads, generation, failed)
        return _result(job.job_id, failed, len(job.keys))

    async def _write_checkpoint(self, run_blocking: Callable[..., Awaitable[Any]]) -> None:
        # OSError if it failed (the old checkpoint stays).
        self._checkpoint_idle.clear()
        try:
            # The entries are copied on the thread, off the loop, while the loop goes on.
            snapshot = functools.partial(self._index.snapshot, self._index.checkpoint_segments())
            await write_checkpoint(
                self._segments, snapshot, temp_suffix=self._instance_id, run_blocking=run_blocking
            )
        finally:
            self._checkpoint_idle.set()

    async def _checkpoint(self) -> None:
        if not self._checkpoint_idle.is_set():  # the next job due after this one writes
            return
        self._since_checkpoint = 0
        self._segments.drop_move_buffers()
        try:
            await self._write_checkpoint(self.run_blocking)
        except OSError as exc:
            self._failure_log.record("checkpoint failed", 1, str(exc))

    def _hop_lost(self, hop: StoreHop) -> None:
        # A store job ended without its commit (a close's deadline): if its hop never
        # ran, its deletions and the reads of the keys they remove are owed to a later hop
        # (or the close); if it ran, the keys it read that the index lacks are removals.
        if hop.gone_keys is None:
            self._trash.extend(hop.delete)
            if self._removed is not None:
                self._owed += [*hop.gone, *((segment, record) for segment, record, _ in hop.moves)]
            return
        moved = hop.moved or []
        self.metrics.evicted_blocks += sum(key is not None for key in moved)
        self._note_given_up([*moved, *hop.gone_keys])

    def _note_given_up(self, keys: Sequence[bytes | None]) -> None:
        # Removals: keys read from records given up that the index no longer holds.
        self._note_removed(k for k in keys if k is not None and key_digest(k) not in self._index)

    def _commit_store(
        self,
        report: WriteReport,
        hop: StoreHop,
        digests: dict[OffloadKey, int],
        generation: int,
        failed: dict[OffloadKey, str],
    ) -> None:
        # The records written indexed (the job's, then the moved ones', unless stored
        # again meanwhile); none if the tier was cleared meanwhile.
        self._writing_records -= len(hop.placed)
        written = set(report.written)
        ours, theirs = hop.placed[: len(hop.records)], hop.placed[len(hop.records) :]
        if generation != self._generation:  # cleared while being written
            self._trash.extend({p.segment for p in ours})
        else:
            for (key, _), placement in zip(hop.records, ours, strict=True):
                if key in written:
                    self._index.commit(digests[key], placement)
                else:
                    self._index.abandon(placement)
            for key, placement in zip(hop.moved or (), theirs, strict=True):
                digest = None if key is None else key_digest(key)
                if key in written and digest not in self._index:
                    self._index.commit(digest, placement)  # type: ignore[arg-type]
                    self.metrics.relocated_blocks += 1
                else:
                    self._index.abandon(placement)
                    self.metrics.evicted_blocks += 1
                    if key is not None and digest not in self._index:
                        self._note_removed((key,))
        self._since_checkpoint += len(written)
        if report.failed:
            failed.update(report.failed)
            cause = DISK_FULL if report.disk_full else "write error"
            self._failure_log.record(cause, len(report.failed), next(iter(report.failed.values())))
        self.metrics.stored_blocks += len(written)
        self.metrics.bytes_written += len(written) * self.file_bytes
        self.metrics.write_errors += len(report.failed)
        if self._space.store_ended(report.free_bytes, report.disk_full, bool(report.written)):
            self.metrics.disk_full_events += 1

    def _commit_load(
        self,
        outcomes: Sequence[ReadOutcome],
        reads: Sequence[tuple[OffloadKey, str, int, int]],
        generation: int,
        failed: dict[OffloadKey, str],
    ) -> None:
        loaded = [read[0] for read, (_, why, _) in zip(reads, outcomes, strict=True) if not why]
        self.metrics.loaded_blocks += len(loaded)
        self.metrics.bytes_read += len(loaded) * self.file_bytes
        if loaded:
            self._index.touch([key_digest(key) for key in loaded])
        bad = {read[0]: (read, out) for read, out in zip(reads, outcomes, strict=True) if out[1]}
        for key, ((_, segment, record, _), (_, reason, missing)) in bad.items():
            failed[key] = reason
            if missing:
                counter, cause = "missing_blocks", "block missing"
            elif reason.startswith("corrupt"):
                counter, cause = "corrupt_blocks", "corrupt block"
            else:
                counter, cause = "read_errors", "read error"
            setattr(self.metrics, counter, getattr(self.metrics, counter) + 1)
            self._failure_log.record(cause, 1, reason)
            digest = key_digest(key)
            if generation == self._generation and self._index.locate(digest) == (segment, record):
                self._index.remove(digest)
                self._note_removed((key,))


def _meet(meeting: threading.Barrier) -> None:
    # A broken or timed-out meeting only means some thread starts later, in a job.
    with contextlib.suppress(threading.BrokenBarrierError):
        meeting.wait(5.0)  # seconds start() waits for its I/O threads to meet


def _result(job_id: int, failed: dict[OffloadKey, str], total: int) -> JobResult:
    if not failed:
        return JobResult(job_id, True)
    reasons = Counter(failed.values())
    summary = "; ".join(f"{reason} ({n})" for reason, n in reasons.most_common(3))
    return JobResult(
        job_id, False, tuple(failed), f"{len(failed)} of {total} blocks failed: {summary}"
    )


__all__ = ["InflightBytes", "NVMeMetrics", "NVMeOptions", "NVMeTier"]
