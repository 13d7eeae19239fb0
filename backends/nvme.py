"""The NVMe tier: KV blocks in files on a local drive, durable, verified and bounded.

Layout under ``root``::

    root/<readable-prefix>-<namespace digest>/   one directory per cache identity
        NAMESPACE                                the full namespace string (JSON)
        owners/<instance>.lock                   one per running tier, held with flock
        00/ .. ff/                               fan-out: <key hex>.kvb block files

Each block is one file (format: :mod:`backends.nvme_format`), so a block becomes
visible atomically by a rename, eviction is an unlink that returns the space at once,
recovery is a directory scan, and engines sharing a root never write into each other's
files. The blocking work of a job runs in ONE call of
:class:`backends.nvme_files.BlockFiles` on the tier's own thread pool; every bookkeeping
structure (index, eviction policy, pins, reservations) lives on the event-loop thread.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
import uuid
from collections import Counter, deque
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from typing import Any

import aiofiles
import aiofiles.os

from backends.nvme_files import (
    FSYNC_POLICIES,
    OWNERS_DIR,
    REAL_OS,
    BlockFiles,
    FsyncPolicy,
    LoadReport,
    OsCalls,
    OwnerLock,
    ScanReport,
    StoreReport,
    probe_o_direct,
)
from backends.nvme_format import (
    FORMAT_VERSION,
    HEADER_BYTES,
    MAX_KEY_BYTES,
    fanout_dirs,
    namespace_digest,
    namespace_dirname,
)
from tiering.actor import TierActor
from tiering.errors import ClosedError, InvalidArgumentError, TieringError
from tiering.policies import EvictionPolicy, make_policy
from tiering.secondary import JobMetadata, JobResult, OffloadKey, ReqContext

logger = logging.getLogger(__name__)

IDENTITY_FILE = "NAMESPACE"
DEFAULT_MIN_FREE_BYTES = 1 << 30
DEFAULT_MAX_INFLIGHT_BYTES = 256 << 20
DEFAULT_ENOSPC_RETRY_S = 5.0
FREE_SPACE_MAX_AGE_S = 1.0
"""Free space measured longer ago than this is measured again before a store plans."""


@dataclass(slots=True)
class NVMeMetrics:
    """Counters of one NVMe tier since it was created (blocks unless named bytes)."""

    stored_blocks: int = 0
    loaded_blocks: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    evicted_blocks: int = 0
    corrupt_blocks: int = 0
    """Loads whose file failed verification (length, header, key or checksum)."""
    missing_blocks: int = 0
    """Loads whose file had vanished (removed by another engine sharing the root)."""
    read_errors: int = 0
    write_errors: int = 0
    """Blocks whose write failed (ENOSPC included)."""
    refused_blocks: int = 0
    """Stores refused without I/O: no room (cap or floor) or the tier is read-only."""
    disk_full_events: int = 0
    """Times the tier turned read-only because the file system answered ENOSPC."""
    recovered_blocks: int = 0
    removed_on_recovery: Counter[str] = field(default_factory=Counter)


class _InflightBytes:
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


class NVMeTier(TierActor):
    """A secondary tier that keeps blocks in files under ``root``.

    Args:
        primary_kv_view: the host pool (writable, ideally page-aligned: slots whose
            address and size are 4096-aligned move with O_DIRECT).
        block_bytes: bytes per block.
        root: the directory holding namespaces; created if missing.
        namespace: the cache identity (model, dtype, block geometry, format version, as
            the engine derives it). Blocks of one namespace are never served to another.
        capacity_bytes: most bytes of block files (header page included) kept here.
        min_free_bytes: free space on the file system below which stores evict (or are
            refused); whichever of this and ``capacity_bytes`` binds first wins.
        fsync: ``"none"`` (rename only; survives a process crash, not a power loss),
            ``"batch"`` (default: when a store job reports success its blocks are on
            stable storage: one ``syncfs`` per job), ``"always"`` (each block: fdatasync,
            rename, fsync of its directory, before the next).
        policy: eviction policy name (as the CPU tier's) or an EvictionPolicy instance.
        o_direct: True to require O_DIRECT, False to never use it, None (default) to
            probe once at start and fall back to buffered I/O with one log line.
        max_inflight_bytes: bound on payload bytes of jobs in their I/O at once.
        enospc_retry_s: after ENOSPC, stores are refused without I/O for this long
            (unless the tier freed space meanwhile), then one job probes again.
        os_calls: the system-call layer (tests pass a :class:`backends.faults.
            FaultInjector`).
        clock: monotonic seconds (tests pass a fake).
        **actor_kwargs: ``inbox_size``, ``max_inflight``, ``io_threads`` of TierActor.

    Guarantees:

    * A store's keys become visible (``lookup`` True) only after their files are
      complete and renamed into place (and durable per ``fsync``). Keys already held
      are skipped; a key twice in a job is stored from its first slot.
    * A load reports a key loaded only after its length, header (magic, version,
      namespace, key, payload length) and payload checksum matched. A key that fails
      is in ``failed_keys``, leaves the index (later lookups miss), its file is removed
      and ``metrics.corrupt_blocks`` (or ``read_errors``/``missing_blocks``) counts it.
      The others of the job still land.
    * Room is made by evicting keys by ``policy``; keys being loaded or written are
      never evicted. Stores that still do not fit fail (``failed_keys``).
    * ENOSPC (or EDQUOT) makes the tier read-only for stores; loads keep working. It
      turns writable again by itself when a later store succeeds (see
      ``enospc_retry_s``).
    * An I/O error fails the keys it hit, in that job only.
    * :meth:`start` recovers the index from disk (a restart keeps the cache warm) and
      removes torn, foreign and dead writers' temporary files.

    Raises (constructor): InvalidArgumentError for any bad argument;
    UnknownPolicyError for an unknown policy name.
    """

    def __init__(
        self,
        primary_kv_view: memoryview,
        block_bytes: int,
        *,
        root: str | os.PathLike[str],
        namespace: str,
        capacity_bytes: int,
        min_free_bytes: int = DEFAULT_MIN_FREE_BYTES,
        fsync: FsyncPolicy = "batch",
        policy: str | EvictionPolicy = "lru",
        o_direct: bool | None = None,
        max_inflight_bytes: int = DEFAULT_MAX_INFLIGHT_BYTES,
        enospc_retry_s: float = DEFAULT_ENOSPC_RETRY_S,
        os_calls: OsCalls = REAL_OS,
        clock: Callable[[], float] = time.monotonic,
        **actor_kwargs: Any,
    ) -> None:
        if not isinstance(root, str | os.PathLike):
            raise InvalidArgumentError(f"root must be a path, got {root!r}")
        dirname = namespace_dirname(namespace)
        file_bytes = HEADER_BYTES + block_bytes if isinstance(block_bytes, int) else 0
        _check_int("capacity_bytes", capacity_bytes, minimum=max(file_bytes, 1))
        _check_int("min_free_bytes", min_free_bytes, minimum=0)
        _check_int("max_inflight_bytes", max_inflight_bytes, minimum=1)
        if fsync not in FSYNC_POLICIES:
            raise InvalidArgumentError(f"fsync must be one of {FSYNC_POLICIES}, got {fsync!r}")
        if o_direct not in (None, True, False):
            raise InvalidArgumentError(f"o_direct must be True, False or None, got {o_direct!r}")
        if not isinstance(enospc_retry_s, int | float) or not enospc_retry_s >= 0:
            raise InvalidArgumentError(
                f"enospc_retry_s must be a non-negative number, got {enospc_retry_s!r}"
            )
        super().__init__(primary_kv_view, block_bytes, **actor_kwargs)
        self.root = os.fspath(root)
        self.namespace = namespace
        self.directory = os.path.join(self.root, dirname)
        self.file_bytes = HEADER_BYTES + self.block_bytes
        self.capacity_bytes = capacity_bytes
        self.capacity_blocks = capacity_bytes // self.file_bytes
        self.min_free_bytes = min_free_bytes
        self.fsync = fsync
        self.o_direct_requested = o_direct
        self.o_direct: bool | None = None
        """Whether O_DIRECT is in use; known after :meth:`start`."""
        self.enospc_retry_s = float(enospc_retry_s)
        self.metrics = NVMeMetrics()
        self._policy = make_policy(policy, self.capacity_blocks)
        self._os = os_calls
        self._clock = clock
        self._ns_digest = namespace_digest(namespace)
        self._instance_id = uuid.uuid4().hex
        self._files = BlockFiles(
            self.directory,
            block_bytes=self.block_bytes,
            ns_digest=self._ns_digest,
            instance_id=self._instance_id,
            fsync=fsync,
            o_direct=False,
            os_calls=os_calls,
        )
        self._budget = _InflightBytes(max_inflight_bytes)
        self._owner: OwnerLock | None = None
        self._opened = False
        self._start_lock = asyncio.Lock()

        self._resident: set[OffloadKey] = set()  # complete on disk, loadable
        self._readers: Counter[OffloadKey] = Counter()  # keys in a running load
        self._busy: dict[OffloadKey, asyncio.Event] = {}  # keys a running hop writes/removes
        self._trash: dict[OffloadKey, None] = {}  # dropped by clear(), files not yet removed
        self._reserved_blocks = 0  # admitted to running stores, not yet resident
        self._generation = 0  # bumped by clear(): older hops' keys are not committed
        self._free_bytes: int | None = None  # last statvfs
        self._free_bytes_at = float("-inf")  # when, by self._clock
        self._disk_full_since: float | None = None
        self._last_probe = 0.0
        self._freed_since_probe = False

    # -- life cycle -------------------------------------------------------------------

    async def start(self) -> None:
        """Open the namespace directory, recover the index from disk, then serve.

        Raises:
            ClosedError: the tier is closing or closed.
            InvalidArgumentError: the namespace directory holds another namespace, or
                ``o_direct=True`` and the file system refuses O_DIRECT.
            TieringError: the root cannot be created, written or scanned (the message
                carries the OS error).
        """
        if self.closed:
            raise ClosedError(f"{self._name()} is closed and cannot be restarted")
        async with self._start_lock:
            if self._opened:
                await super().start()
                return
            try:
                await self._prepare_directories()
                probe, scan, free = await self.run_blocking(self._open_on_disk)
            except OSError as exc:
                self._release_owner()
                raise TieringError(f"nvme tier cannot use {self.directory!r}: {exc}") from exc
            except BaseException:
                self._release_owner()
                raise
            excess = self._adopt(probe, scan, free)
            self._opened = True
            if excess:
                # Before serving: a store of one of these keys must not have its new
                # file removed by this clean-up.
                await self.run_blocking(self._files.remove, excess)
            await super().start()

    async def aclose(self, timeout: float = 5.0) -> None:  # noqa: ASYNC109 - base API
        """Close as :meth:`TierActor.aclose`, then remove the files of cleared blocks.

        Idempotent. A hard :meth:`~TierActor.shutdown` leaves those files on disk; the
        next start recovers them as blocks. Either way the owner lock is released as
        the tier closes, on the loop thread.
        """
        await super().aclose(timeout)
        trash, self._trash = list(self._trash), {}
        await self._remove_files(trash)

    def _on_closed(self) -> None:
        # Here rather than in shutdown(): called from another thread, shutdown() only
        # schedules the stop, and the lock must outlive the writes still running.
        self._release_owner()

    async def _prepare_directories(self) -> None:
        await aiofiles.os.makedirs(os.path.join(self.directory, OWNERS_DIR), exist_ok=True)
        for sub in fanout_dirs():
            await aiofiles.os.makedirs(os.path.join(self.directory, sub), exist_ok=True)
        identity = {"namespace": self.namespace, "format_version": FORMAT_VERSION}
        path = os.path.join(self.directory, IDENTITY_FILE)
        try:
            async with aiofiles.open(path, encoding="utf-8") as existing:
                text = await existing.read()
        except FileNotFoundError:
            temp = f"{path}.{self._instance_id}.tmp"
            async with aiofiles.open(temp, "w", encoding="utf-8") as new:
                await new.write(json.dumps(identity, sort_keys=True))
            await aiofiles.os.replace(temp, path)
            return
        try:
            found = json.loads(text).get("namespace")
        except (ValueError, AttributeError):
            found = None
        if found != self.namespace:
            raise InvalidArgumentError(
                f"{self.directory!r} holds namespace {found!r}, not {self.namespace!r}; "
                "refusing to use it"
            )

    def _open_on_disk(self) -> tuple[str | None, ScanReport, int | None]:
        """Worker thread: take the owner lock, probe O_DIRECT, scan, measure free space."""
        self._owner = OwnerLock(self.directory, self._instance_id)
        probe = None
        if self.o_direct_requested is not False:
            probe = probe_o_direct(self.directory, self._os)
        else:
            probe = "disabled by configuration (o_direct=False)"
        scan = self._files.scan()
        return probe, scan, self._files.free_bytes()

    def _adopt(self, probe: str | None, scan: ScanReport, free: int | None) -> list[OffloadKey]:
        """Take the start-up findings; returns the oldest blocks beyond the cap (to remove)."""
        if probe is not None and self.o_direct_requested is True:
            self._release_owner()
            raise InvalidArgumentError(
                f"o_direct=True but the file system at {self.directory!r} refuses it: {probe}"
            )
        self.o_direct = probe is None
        self._files.o_direct = self.o_direct
        if probe is not None and self.o_direct_requested is None:
            logger.warning(
                "nvme tier: O_DIRECT not usable at %s (%s); using buffered I/O",
                self.directory,
                probe,
            )
        keys = [key for key, _mtime in scan.blocks]  # oldest first
        split = max(0, len(keys) - self.capacity_blocks)
        excess, kept = keys[:split], keys[split:]
        for key in kept:  # in age order, so the policy ranks them by age
            self._resident.add(key)
            self._policy.insert(key)
        self.metrics.recovered_blocks = len(kept)
        self.metrics.evicted_blocks += len(excess)
        self.metrics.removed_on_recovery.update(scan.removed)
        self._set_free_bytes(free)
        if scan.blocks or scan.removed:
            logger.info(
                "nvme tier: recovered %d blocks in %s (%d over the cap evicted); removed %s",
                len(kept),
                self.directory,
                len(excess),
                dict(scan.removed) or "nothing",
            )
        return excess

    async def _remove_files(self, keys: Iterable[OffloadKey]) -> None:
        for key in keys:
            try:
                await aiofiles.os.remove(self._files.path_of(key))
            except FileNotFoundError:
                pass
            except OSError as exc:
                logger.warning("nvme tier: could not remove a block file: %s", exc)

    def _release_owner(self) -> None:
        owner, self._owner = self._owner, None
        if owner is not None:
            owner.release()

    # -- queries ----------------------------------------------------------------------

    @staticmethod
    def get_tier_type() -> str:
        return "nvme"

    def lookup(self, key: OffloadKey, req_context: ReqContext = None) -> bool | None:
        """True if stored and verified-complete on disk, None while a store of it is
        queued or running, else False.

        Raises:
            InvalidArgumentError: ``key`` is not bytes.
        """
        if not isinstance(key, bytes):
            raise InvalidArgumentError(f"keys must be bytes, got {type(key).__name__}")
        if key in self._resident:
            return True
        return None if self.storing(key) else False

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext = None) -> None:
        """Mark stored keys recently used, ``keys[0]`` the most recent; others ignored."""
        self._policy.touch([key for key in keys if key in self._resident])

    def get_num_blocks(self) -> int:
        """Blocks stored and loadable now (stores in progress not counted)."""
        return len(self._resident)

    @property
    def used_bytes(self) -> int:
        """Bytes of the block files this tier holds (header pages included)."""
        return len(self._resident) * self.file_bytes

    @property
    def read_only(self) -> bool:
        """True while stores are refused because the file system was full."""
        return self._disk_full_since is not None

    def clear(self) -> None:
        """Drop every block: lookups miss at once, stores running now do not land.

        The files are removed by the next store job or by :meth:`aclose`.
        """
        self._generation += 1
        for key in self._resident:
            self._policy.remove(key)
            self._trash[key] = None
        self._resident.clear()
        self._freed_since_probe = True

    # -- hooks ------------------------------------------------------------------------

    async def _do_store(self, job: JobMetadata) -> JobResult:
        failed: dict[OffloadKey, str] = {}
        wanted: dict[OffloadKey, int] = {}
        for key, block_id in zip(job.keys, job.block_ids, strict=True):
            if len(key) > MAX_KEY_BYTES or not key:
                failed[key] = f"key length {len(key)} is outside 1..{MAX_KEY_BYTES}"
            elif key not in self._resident and key not in wanted:
                wanted[key] = block_id
        wanted = await self._wait_until_free(wanted)
        if not wanted:
            return _result(job.job_id, failed, len(job.keys))
        if self._refusing_stores():
            reason = (
                "nvme tier is read-only: the file system was full (ENOSPC); "
                "stores resume once space returns"
            )
            self.metrics.refused_blocks += len(wanted)
            return _result(job.job_id, failed | dict.fromkeys(wanted, reason), len(job.keys))

        done = asyncio.Event()
        claimed = list(wanted)
        for key in claimed:
            self._busy[key] = done
        generation = self._generation
        budget = len(wanted) * self.block_bytes
        admitted_count = 0
        try:
            await self._budget.acquire(budget, is_load=False)
            try:
                if self._free_bytes_stale(len(wanted)):
                    await self._refresh_free_bytes()
                admitted_count, victims, limit = self._plan_room(len(wanted), set(job.keys))
                admitted = list(wanted.items())[:admitted_count]
                for key, _ in admitted:
                    self._trash.pop(key, None)  # the rename below replaces the old file
                removals = victims + list(self._trash)
                self._trash.clear()
                for key in removals:
                    self._busy[key] = done
                claimed += removals
                for key in list(wanted)[admitted_count:]:
                    failed[key] = limit
                self.metrics.refused_blocks += len(wanted) - admitted_count
                self._reserved_blocks += admitted_count
                writes = [(key, self.slot(block_id)) for key, block_id in admitted]
                report = await self.run_blocking(self._files.store, writes, removals)
            finally:
                self._budget.release(budget)
            self._commit_store(report, generation, failed)
        finally:
            self._reserved_blocks -= admitted_count
            for key in claimed:
                if self._busy.get(key) is done:
                    del self._busy[key]
            done.set()
        return _result(job.job_id, failed, len(job.keys))

    async def _do_load(self, job: JobMetadata) -> JobResult:
        failed: dict[OffloadKey, str] = {}
        reads: list[tuple[OffloadKey, memoryview]] = []
        for key, block_id in zip(job.keys, job.block_ids, strict=True):
            if key in self._resident:
                reads.append((key, self.slot(block_id)))
            else:
                failed[key] = "not in the nvme tier"
        if not reads:
            return _result(job.job_id, failed, len(job.keys))
        pinned = [key for key, _ in reads]
        self._readers.update(pinned)
        generation = self._generation
        budget = len(reads) * self.block_bytes
        try:
            await self._budget.acquire(budget, is_load=True)
            try:
                report = await self.run_blocking(self._files.load, reads)
            finally:
                self._budget.release(budget)
        finally:
            self._readers.subtract(pinned)
            for key in set(pinned):
                if self._readers.get(key, 0) <= 0:
                    del self._readers[key]
        self._commit_load(report, generation, failed)
        return _result(job.job_id, failed, len(job.keys))

    # -- bookkeeping (loop thread, no awaits) ------------------------------------------

    async def _wait_until_free(self, wanted: dict[OffloadKey, int]) -> dict[OffloadKey, int]:
        """Wait until no running hop writes or removes a wanted key; drop those stored."""
        while True:
            events = {self._busy[key] for key in wanted if key in self._busy}
            if not events:
                return wanted
            for event in events:
                await event.wait()
            wanted = {k: b for k, b in wanted.items() if k not in self._resident}

    def _refusing_stores(self) -> bool:
        if self._disk_full_since is None:
            return False
        if self._freed_since_probe or self._clock() - self._last_probe >= self.enospc_retry_s:
            self._last_probe = self._clock()
            self._freed_since_probe = False
            return False
        return True

    def _free_bytes_stale(self, count: int) -> bool:
        """True if the cached free space is too old or too close to the floor to plan by.

        Every store hop measures free space as it ends, so a busy tier plans with a
        fresh figure and no extra hop; an idle one, one near its floor, or one that hit
        ENOSPC asks again first (space may have gone or returned meanwhile).
        """
        if self.read_only or self._free_bytes is None:
            return True
        if self._clock() - self._free_bytes_at >= FREE_SPACE_MAX_AGE_S:
            return True
        pending = (self._reserved_blocks + count) * self.file_bytes
        return self._free_bytes - pending < self.min_free_bytes

    async def _refresh_free_bytes(self) -> None:
        self._set_free_bytes(await self.run_blocking(self._files.free_bytes))

    def _set_free_bytes(self, free: int | None) -> None:
        self._free_bytes = free
        self._free_bytes_at = self._clock()

    def _plan_room(
        self, count: int, protected: set[OffloadKey]
    ) -> tuple[int, list[OffloadKey], str]:
        """How many of ``count`` new blocks fit, after evicting which keys.

        Both limits count blocks already admitted to running stores. Victims leave the
        index now; their files are removed by the caller's hop before it writes.
        """
        room = self.capacity_blocks - len(self._resident) - self._reserved_blocks
        limit = f"nvme tier full: capacity {self.capacity_bytes} bytes reached"
        if self._free_bytes is not None:
            above_floor = self._free_bytes - self._reserved_blocks * self.file_bytes
            floor_room = (above_floor - self.min_free_bytes) // self.file_bytes
            if floor_room < room:
                room = floor_room
                limit = f"nvme tier full: free space would fall below {self.min_free_bytes} bytes"
        # room < 0 means the floor is already crossed: evict past ``count`` to restore it.
        shortfall = count - room
        victims: list[OffloadKey] = []
        if shortfall > 0:
            unavailable = {
                key for key in (*self._readers, *self._busy, *protected) if key in self._resident
            }
            evictable = len(self._resident) - len(unavailable)
            n = min(shortfall, evictable)
            if n > 0:
                victims = self._policy.evict(n, lambda key: key not in unavailable)
                self._resident.difference_update(victims)
                self.metrics.evicted_blocks += len(victims)
                self._freed_since_probe = True
        admitted = max(0, min(count, room + len(victims)))
        if admitted < count:
            limit += "; every other block is being read or written"
        return admitted, victims, limit

    def _commit_store(
        self, report: StoreReport, generation: int, failed: dict[OffloadKey, str]
    ) -> None:
        for key in report.stored:
            if generation != self._generation:
                self._trash[key] = None  # cleared while it was being written
            elif key not in self._resident:
                self._resident.add(key)
                self._policy.insert(key)
        failed.update(report.failed)
        self.metrics.stored_blocks += len(report.stored)
        self.metrics.bytes_written += len(report.stored) * self.file_bytes
        self.metrics.write_errors += len(report.failed)
        if report.free_bytes is not None:
            self._set_free_bytes(report.free_bytes)
        now = self._clock()
        if report.disk_full:
            if self._disk_full_since is None:
                self.metrics.disk_full_events += 1
                logger.warning(
                    "nvme tier: file system full (ENOSPC) at %s; stores refused, loads go "
                    "on; retrying every %gs or after space is freed",
                    self.directory,
                    self.enospc_retry_s,
                )
                self._disk_full_since = now
            self._last_probe = now
            self._freed_since_probe = False
        elif report.stored and self._disk_full_since is not None:
            logger.warning("nvme tier: space returned at %s; stores resumed", self.directory)
            self._disk_full_since = None

    def _commit_load(
        self, report: LoadReport, generation: int, failed: dict[OffloadKey, str]
    ) -> None:
        self.metrics.loaded_blocks += len(report.loaded)
        self.metrics.bytes_read += len(report.loaded) * self.file_bytes
        if report.loaded:
            self._policy.touch([key for key in report.loaded if key in self._resident])
        corrupt = set(report.corrupt)
        for key, reason in report.failed.items():
            failed[key] = reason
            if key in corrupt:
                self.metrics.corrupt_blocks += 1
                logger.warning("nvme tier: dropped block %s: %s", key.hex()[:16], reason)
            elif reason == "block file is missing":
                self.metrics.missing_blocks += 1
            else:
                self.metrics.read_errors += 1
            if generation == self._generation and key in self._resident:
                self._resident.discard(key)
                self._policy.remove(key)
                self._freed_since_probe = True


def _check_int(name: str, value: object, *, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise InvalidArgumentError(f"{name} must be an int >= {minimum}, got {value!r}")


def _result(job_id: int, failed: dict[OffloadKey, str], total: int) -> JobResult:
    if not failed:
        return JobResult(job_id, True)
    reasons = Counter(failed.values())
    summary = "; ".join(f"{reason} ({n})" for reason, n in reasons.most_common(3))
    return JobResult(
        job_id, False, tuple(failed), f"{len(failed)} of {total} blocks failed: {summary}"
    )


__all__ = ["NVMeMetrics", "NVMeTier"]
