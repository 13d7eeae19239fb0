"""The NVMe tier: KV blocks in files on a local drive, durable, verified and bounded.

Layout under ``root``::

    root/<readable-prefix>-<namespace digest>/   one directory per cache identity
        NAMESPACE                                the full namespace string (JSON)
        owners/<instance>.lock                   one per running tier, held with flock
        00/ .. ff/                               fan-out: <key hex>.kvb block files

Each block is one file (format: :mod:`backends.nvme_format`), so a block becomes
visible atomically by a rename, eviction is an unlink that returns the space at once,
recovery is a directory scan, and engines sharing a root never write into each other's
files. The blocking work of a job runs in ONE call on the tier's own thread pool (the
slot views are cut there too, so the loop does little per block); the bookkeeping lives
on the event-loop thread, in the shared :class:`~tiering.residency.ResidencyIndex`
(resident keys, pins, holds, eviction) and :class:`backends.nvme_space.SpaceGuard`
(cap, free-space floor, disk full).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import stat
import threading
import time
import uuid
from collections import Counter, deque
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

import aiofiles
import aiofiles.os

from backends.nvme_files import BlockFiles, LoadReport, ScanReport, StoreReport
from backends.nvme_format import (
    FORMAT_VERSION,
    HEADER_BYTES,
    MAX_KEY_BYTES,
    fanout_dirs,
    namespace_digest,
    namespace_dirname,
)
from backends.nvme_os import (
    FSYNC_POLICIES,
    OWNERS_DIR,
    REAL_OS,
    FsyncPolicy,
    OsCalls,
    OwnerLock,
    probe_o_direct,
)
from backends.nvme_sealing import PayloadSealer
from backends.nvme_space import DISK_FULL_REASON, SpaceGuard
from tiering.actor import TierActor
from tiering.encryption import BlockCipher, Keyring, keyring_from
from tiering.errors import ClosedError, InvalidArgumentError, TieringError
from tiering.policies import EvictionPolicy
from tiering.residency import ResidencyIndex
from tiering.secondary import JobMetadata, JobResult, OffloadKey, ReqContext
from tiering.statistics import FailureLog
from tiering.validation import positive_int

logger = logging.getLogger(__name__)

IDENTITY_FILE = "NAMESPACE"
DEFAULT_MIN_FREE_BYTES = 1 << 30
DEFAULT_MAX_INFLIGHT_BYTES = 256 << 20
DEFAULT_ENOSPC_RETRY_S = 5.0

_MISSING = "block file is missing"
_THREAD_START_TIMEOUT_S = 5.0
"""How long :meth:`NVMeFileTier.start` waits for all its I/O threads to be up at once."""


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
    relocated_blocks: int = 0
    """Segment layout: recently used blocks of an evicted segment written again."""
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


PRIVATE_DIR_MODE = 0o700
"""Mode of the directories the tier makes: its user's alone (KV bytes are user data)."""
PRIVATE_FILE_MODE = 0o600
"""Mode of the files the tier writes."""


def _check_private(option: str, path: str) -> None:
    """Refuse a directory another user owns or anyone but its owner may write to.

    Raises:
        InvalidArgumentError: naming ``option``, the path and what is wrong with it.
    """
    status = os.stat(path)
    if not stat.S_ISDIR(status.st_mode):
        raise InvalidArgumentError(f"{option}: {path!r} is not a directory")
    if status.st_uid != os.geteuid():
        raise InvalidArgumentError(
            f"{option}: {path!r} belongs to user {status.st_uid}, not to this process's "
            f"({os.geteuid()}): another user could read or replace the KV blocks in it"
        )
    if status.st_mode & 0o022:
        raise InvalidArgumentError(
            f"{option}: {path!r} has mode {stat.S_IMODE(status.st_mode):o}: others can write "
            "to it (plant or swap files); make it writable by its owner only (chmod go-w)"
        )


def check_root(
    path: str, *, option: str = "root", create: bool = False, mode: int = PRIVATE_DIR_MODE
) -> None:
    """Check ``path`` as an NVMe root: the one check the tier's start and the
    ``tiering inspect`` / ``verify`` / ``clear`` commands share.

    The root must be a directory of this process's user that nobody else may write to
    (see docs/security.md). With ``create``, a missing root is made (with ``mode``, its
    missing parents too); without it, a missing root is refused.

    Raises:
        InvalidArgumentError: naming ``option`` and the path: it does not exist (and not
            ``create``), is not a directory (a file, or under one), cannot be created
            for lack of permission, belongs to another user, or others may write to it.
        OSError: any other failure of the file system (I/O, no space).
    """
    if create:
        try:
            os.makedirs(path, mode=mode, exist_ok=True)
        except FileExistsError:  # something that is not a directory is in the way
            raise InvalidArgumentError(f"{option}: {path!r} is not a directory") from None
        except (NotADirectoryError, PermissionError) as exc:
            raise InvalidArgumentError(
                f"{option}: {path!r} cannot be created: {exc.strerror}"
            ) from None
    try:
        _check_private(option, path)
    except FileNotFoundError:
        raise InvalidArgumentError(f"{option}: {path!r} does not exist") from None


def _check_mode(option: str, mode: object, *, required: int, allowed: int) -> None:
    """Refuse a mode that denies the owner what the tier needs or lets others write.

    Raises:
        InvalidArgumentError: naming ``option`` and the mode in octal.
    """
    if isinstance(mode, bool) or not isinstance(mode, int):
        raise InvalidArgumentError(f"{option} must be an int such as 0o{required:o}, got {mode!r}")
    if mode & required != required or mode & ~allowed:
        shown = f"0o{mode:o}" if mode >= 0 else repr(mode)
        raise InvalidArgumentError(
            f"{option} must include 0o{required:o} and stay within 0o{allowed:o} (nobody "
            f"but the owner may write), got {shown}"
        )


def _write_private(path: str, data: bytes, mode: int = PRIVATE_FILE_MODE) -> None:
    """Write a new file of ``mode`` (by default readable by this user only), never
    through a link."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_NOFOLLOW, mode)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


def refuse_derived_options(cls: type[NVMeTierBase], options: Mapping[str, object]) -> None:
    """Refuse a layout's caller passing an argument the layout computes itself.

    Raises:
        InvalidArgumentError: naming the option and its value.
    """
    for name in cls.DERIVED_OPTIONS & options.keys():
        raise InvalidArgumentError(
            f"{name} is computed by the {cls.__name__} from block_bytes, not an option; "
            f"got {options[name]!r}"
        )


class NVMeTierBase(TierActor):
    """What the NVMe tier's layouts share: the namespace directory and its identity file,
    the owner lock, the O_DIRECT probe, the space guard, the I/O byte budget, metrics,
    and the start-up sequence. A layout subclass supplies the files and the index
    through the hooks below (``_subdirs``, ``_scan_disk``, ``_adopt_scan``,
    ``_remove_excess``, ``_free_bytes``, ``_use_o_direct``).

    Raises (constructor): InvalidArgumentError for any bad argument.
    """

    DERIVED_OPTIONS: ClassVar[frozenset[str]] = frozenset({"file_bytes"})
    """Arguments of this base that each layout computes from the block size; a
    layout's caller may not pass them (configs leave them out)."""

    def __init__(
        self,
        primary_kv_view: memoryview,
        block_bytes: int,
        *,
        root: str | os.PathLike[str],
        namespace: str,
        capacity_bytes: int,
        file_bytes: int,
        min_free_bytes: int = DEFAULT_MIN_FREE_BYTES,
        fsync: FsyncPolicy = "batch",
        o_direct: bool | None = None,
        max_inflight_bytes: int = DEFAULT_MAX_INFLIGHT_BYTES,
        enospc_retry_s: float = DEFAULT_ENOSPC_RETRY_S,
        encryption: Keyring | str | None = None,
        file_mode: int = PRIVATE_FILE_MODE,
        dir_mode: int = PRIVATE_DIR_MODE,
        os_calls: OsCalls = REAL_OS,
        clock: Callable[[], float] = time.monotonic,
        **actor_kwargs: Any,
    ) -> None:
        if not isinstance(root, str | os.PathLike):
            raise InvalidArgumentError(f"root must be a path, got {root!r}")
        _check_mode("file_mode", file_mode, required=0o600, allowed=0o644)
        _check_mode("dir_mode", dir_mode, required=0o700, allowed=0o755)
        keyring = keyring_from(encryption, option="encryption")
        dirname = namespace_dirname(namespace)
        positive_int("max_inflight_bytes", max_inflight_bytes)
        if fsync not in FSYNC_POLICIES:
            raise InvalidArgumentError(f"fsync must be one of {FSYNC_POLICIES}, got {fsync!r}")
        if o_direct not in (None, True, False):
            raise InvalidArgumentError(f"o_direct must be True, False or None, got {o_direct!r}")
        if not callable(clock):
            raise InvalidArgumentError(f"clock must be callable, got {clock!r}")
        self._space = SpaceGuard(
            file_bytes=file_bytes,
            capacity_bytes=capacity_bytes,
            min_free_bytes=min_free_bytes,
            retry_s=enospc_retry_s,
            clock=clock,
        )
        super().__init__(primary_kv_view, block_bytes, **actor_kwargs)
        self.root = os.fspath(root)
        self.namespace = namespace
        self.directory = os.path.join(self.root, dirname)
        self.file_bytes = file_bytes
        """Bytes one block takes on disk (its header page included)."""
        self.capacity_bytes = capacity_bytes
        self.capacity_blocks = self._space.capacity_blocks
        self.min_free_bytes = min_free_bytes
        self.fsync = fsync
        self.o_direct_requested = o_direct
        self.o_direct: bool | None = None
        """Whether O_DIRECT is in use; known after :meth:`start`."""
        self.enospc_retry_s = float(enospc_retry_s)
        self.metrics = NVMeMetrics()
        """Counters since creation; ``statistics().counters`` shows the same figures."""
        self._failure_log = FailureLog(logger, "nvme tier")
        self._os = os_calls
        self._clock = clock
        self._ns_digest = namespace_digest(namespace)
        self.file_mode = file_mode
        self.dir_mode = dir_mode
        self._sealer = (
            None
            if keyring is None
            else PayloadSealer(
                BlockCipher(keyring), block_bytes=self.block_bytes, ns_digest=self._ns_digest
            )
        )
        self._instance_id = uuid.uuid4().hex
        self._budget = _InflightBytes(max_inflight_bytes)
        self._owner: OwnerLock | None = None
        self._opened = False
        self._start_lock = asyncio.Lock()

    # -- layout hooks -------------------------------------------------------------------

    def _subdirs(self) -> list[str]:
        """Subdirectories of the namespace directory the layout needs (besides owners/)."""
        raise NotImplementedError

    def _scan_disk(self) -> Any:
        """Worker thread, at start: what the layout finds on disk."""
        raise NotImplementedError

    def _adopt_scan(self, scan: Any) -> list[Any]:
        """Loop thread, at start: index what ``_scan_disk`` found; returns what is over
        the cap, for ``_remove_excess``."""
        raise NotImplementedError

    def _remove_excess(self, excess: list[Any]) -> None:
        """Worker thread, at start: remove what ``_adopt_scan`` returned."""
        raise NotImplementedError

    def _free_bytes(self) -> int | None:
        """Worker thread: free bytes on the file system, or None if unknown."""
        raise NotImplementedError

    def _use_o_direct(self, enabled: bool) -> None:
        """The probe's verdict, before any job."""
        raise NotImplementedError

    # -- life cycle -------------------------------------------------------------------

    async def start(self) -> None:
        """Open the namespace directory, recover the index from disk, then serve.

        Raises:
            ClosedError: the tier is closing or closed.
            InvalidArgumentError: the root fails :func:`check_root` (not a directory,
                not creatable, another user's, writable by others), the namespace
                directory holds another namespace, or ``o_direct=True`` and the file
                system refuses O_DIRECT.
            TieringError: the root cannot be written or scanned (the message carries
                the OS error).
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
                raise TieringError(
                    f"nvme tier: root={self.root!r} cannot be used (it must be a writable "
                    f"directory or creatable as one): {exc}"
                ) from exc
            except BaseException:
                self._release_owner()
                raise
            excess = self._adopt(probe, scan, free)
            self._opened = True
            if excess:
                # Before serving: a store of one of these keys must not have its new
                # file removed by this clean-up.
                await self.run_blocking(self._remove_excess, excess)
            await self._start_io_threads()
            await super().start()

    def _make_private_directories(self) -> None:
        """Worker thread: check the root and make the namespace's directories, private.

        Raises:
            InvalidArgumentError: the root, or the namespace directory in it, is not a
                directory of this user that only it can write to, or the namespace
                directory is a link (it could lead out of the root).
        """
        check_root(self.root, create=True, mode=self.dir_mode)
        with contextlib.suppress(FileExistsError):
            os.mkdir(self.directory, self.dir_mode)
        if os.path.islink(self.directory):
            raise InvalidArgumentError(
                f"root: {self.directory!r} is a symbolic link; the tier never follows one "
                "out of its root"
            )
        _check_private("root", self.directory)
        for sub in (OWNERS_DIR, *self._subdirs()):
            path = os.path.join(self.directory, sub)
            try:
                os.mkdir(path, self.dir_mode)
            except FileExistsError:
                if os.path.islink(path) or not os.path.isdir(path):
                    raise InvalidArgumentError(
                        f"root: {path!r} is not a directory of the tier (a link or a file)"
                    ) from None

    def _on_closed(self) -> None:
        # Here rather than in shutdown(): called from another thread, shutdown() only
        # schedules the stop, and the lock must outlive the writes still running.
        self._release_owner()

    async def _start_io_threads(self) -> None:
        # A pool starts its threads lazily, one per call while none is idle: in the
        # first jobs the loop would wait for each thread's start handshake and compete
        # with its initializer for the GIL. Calls that wait for each other make the pool
        # start every thread now, before any job is served.
        meeting = threading.Barrier(self.io_threads)
        await asyncio.gather(*(self.run_blocking(_meet, meeting) for _ in range(self.io_threads)))

    async def _prepare_directories(self) -> None:
        await self.run_blocking(self._make_private_directories)
        identity = {"namespace": self.namespace, "format_version": FORMAT_VERSION}
        path = os.path.join(self.directory, IDENTITY_FILE)
        try:
            async with aiofiles.open(path, encoding="utf-8") as existing:
                text = await existing.read()
        except FileNotFoundError:
            temp = f"{path}.{self._instance_id}.tmp"
            text = json.dumps(identity, sort_keys=True)
            await self.run_blocking(_write_private, temp, text.encode(), self.file_mode)
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

    def _open_on_disk(self) -> tuple[str | None, Any, int | None]:
        """Worker thread: check the floor against the file system's size, take the owner
        lock, probe O_DIRECT, scan, measure free space."""
        statvfs = self._os.statvfs(self.directory)
        self._space.check_file_system(statvfs.f_blocks * statvfs.f_frsize, self.root)
        self._owner = OwnerLock(self.directory, self._instance_id)
        probe = None
        if self.o_direct_requested is not False:
            probe = probe_o_direct(self.directory, self._os)
        else:
            probe = "disabled by configuration (o_direct=False)"
        scan = self._scan_disk()
        return probe, scan, self._free_bytes()

    def _adopt(self, probe: str | None, scan: Any, free: int | None) -> list[Any]:
        """Take the start-up findings; returns what is beyond the cap (to remove)."""
        if probe is not None and self.o_direct_requested is True:
            self._release_owner()
            raise InvalidArgumentError(
                f"o_direct=True but the file system at {self.directory!r} refuses it: {probe}"
            )
        self.o_direct = probe is None
        self._use_o_direct(self.o_direct)
        if probe is not None and self.o_direct_requested is None:
            logger.warning(
                "nvme tier: O_DIRECT not usable at %s (%s); using buffered I/O",
                self.directory,
                probe,
            )
        self._space.measured(free)
        return self._adopt_scan(scan)

    def _release_owner(self) -> None:
        owner, self._owner = self._owner, None
        if owner is not None:
            owner.release()

    # -- space ------------------------------------------------------------------------

    @property
    def read_only(self) -> bool:
        """True while stores are refused because the file system was full."""
        return self._space.read_only

    async def _refresh_free_bytes(self) -> None:
        self._space.measured(await self.run_blocking(self._free_bytes))

    def _store_space_ended(
        self, free_bytes: int | None, *, disk_full: bool, stored_any: bool
    ) -> None:
        """Record a store hop's effect on space: free bytes, disk full or space back."""
        if free_bytes is not None:
            self._space.measured(free_bytes)
        change = self._space.store_ended(disk_full=disk_full, stored_any=stored_any)
        if change == "full":
            self.metrics.disk_full_events += 1
            logger.warning(
                "nvme tier: file system full (ENOSPC) at %s; stores refused, loads go "
                "on; retrying every %gs or after space is freed",
                self.directory,
                self.enospc_retry_s,
            )
        elif change == "resumed":
            logger.warning("nvme tier: space returned at %s; stores resumed", self.directory)

    async def _store_admission(
        self, job: JobMetadata
    ) -> tuple[dict[OffloadKey, str], dict[OffloadKey, int]]:
        """A store job's keys split into ``(failed, wanted)``: keys a header cannot hold
        fail, keys held already (or repeated in the job) are skipped, keys that a running
        hop writes are waited for, and while the disk is full every wanted key fails.
        ``wanted`` maps each key to store to its slot."""
        failed: dict[OffloadKey, str] = {}
        wanted: dict[OffloadKey, int] = {}
        for key, block_id in zip(job.keys, job.block_ids, strict=True):
            if len(key) > MAX_KEY_BYTES or not key:
                failed[key] = f"key length {len(key)} is outside 1..{MAX_KEY_BYTES}"
            elif key not in wanted and not self._holds_key(key):
                wanted[key] = block_id
        if failed:
            self._failure_log.record("bad key length", len(failed), next(iter(failed.values())))
        wanted = await self._wait_for_writes(wanted)
        if wanted and self._space.refusing():
            self.metrics.refused_blocks += len(wanted)
            self._failure_log.record("disk full", len(wanted), DISK_FULL_REASON)
            failed.update(dict.fromkeys(wanted, DISK_FULL_REASON))
            wanted = {}
        return failed, wanted

    def _holds_key(self, key: OffloadKey) -> bool:
        """True if the tier holds ``key`` already."""
        raise NotImplementedError

    async def _wait_for_writes(self, wanted: dict[OffloadKey, int]) -> dict[OffloadKey, int]:
        """Wait until no running hop writes a wanted key; returns those still not held."""
        raise NotImplementedError

    @staticmethod
    def get_tier_type() -> str:
        return "nvme"

    def _pinned_blocks(self) -> int:
        """Blocks that reads or writes in flight (or holds) keep from eviction now."""
        raise NotImplementedError

    def _usage(self) -> dict[str, Any]:
        counters = asdict(self.metrics)
        removed = counters.pop("removed_on_recovery")
        counters["removed_on_recovery"] = sum(removed.values())
        return {
            "used_blocks": self.get_num_blocks(),
            "capacity_blocks": self.capacity_blocks,
            "used_bytes": self.used_bytes,
            "capacity_bytes": self.capacity_bytes,
            "pinned_blocks": self._pinned_blocks(),
            "counters": counters,
            "failures": dict(self._failure_log.counts),
        }


class NVMeFileTier(NVMeTierBase):
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
        encryption: None (plain blocks), or a keyring (a :class:`~tiering.encryption.
            Keyring` or its spec, such as ``"env:KV_TIERING_KEYS"``): payloads are
            sealed with AES-GCM under its current key, and blocks under any of its key
            ids are read. A block that is not sealed, or does not open, is a miss.
        file_mode, dir_mode: modes of the files and directories the tier makes (0o600
            and 0o700; the process umask still applies). They may add read access for
            group and others, never write access.
        os_calls: the system-call layer (tests pass a :class:`tests._faults.
            FaultInjector`).
        clock: monotonic seconds (tests pass a fake).
        **actor_kwargs: ``inbox_size``, ``max_inflight``, ``io_threads`` of TierActor.

    Guarantees:

    * A store's keys become visible (``lookup`` True) only after their files are
      complete and renamed into place (and durable per ``fsync``). Keys already held
      are skipped; a key twice in a job is stored from its first slot.
    * A load reports a key loaded only after its length, header (magic, version,
      namespace, key, payload length) and payload checksum (with ``encryption``: its
      GCM tag) matched. A key that fails
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
        policy: str | EvictionPolicy = "lru",
        fsync: FsyncPolicy = "batch",
        os_calls: OsCalls = REAL_OS,
        **options: Any,
    ) -> None:
        refuse_derived_options(type(self), options)
        super().__init__(
            primary_kv_view,
            block_bytes,
            root=root,
            namespace=namespace,
            capacity_bytes=capacity_bytes,
            file_bytes=HEADER_BYTES + positive_int("block_bytes", block_bytes),
            fsync=fsync,
            os_calls=os_calls,
            **options,
        )
        self._index = ResidencyIndex(self.capacity_blocks, policy)
        self._files = BlockFiles(
            self.directory,
            block_bytes=self.block_bytes,
            ns_digest=self._ns_digest,
            instance_id=self._instance_id,
            fsync=fsync,
            o_direct=False,
            sealer=self._sealer,
            file_mode=self.file_mode,
            os_calls=os_calls,
        )
        # Keys a running hop writes or removes, with the event set when it ends: a store
        # of such a key waits for it (eviction protection is the index's pins).
        self._busy: dict[OffloadKey, asyncio.Event] = {}
        self._trash: dict[OffloadKey, None] = {}  # dropped by clear(), files not yet removed
        self._generation = 0  # bumped by clear(): older hops' keys are not committed

    @staticmethod
    def get_tier_type() -> str:
        return "nvme-files"

    # -- life cycle -------------------------------------------------------------------

    async def aclose(self, timeout: float = 5.0) -> None:  # noqa: ASYNC109 - base API
        """Close as :meth:`TierActor.aclose`, then remove the files of cleared blocks.

        Idempotent. A hard :meth:`~TierActor.shutdown` leaves those files on disk; the
        next start recovers them as blocks. Either way the owner lock is released as
        the tier closes, on the loop thread.
        """
        await super().aclose(timeout)
        trash, self._trash = list(self._trash), {}
        await self._remove_files(trash)

    def _subdirs(self) -> list[str]:
        return fanout_dirs()

    def _scan_disk(self) -> ScanReport:
        return self._files.scan()

    def _free_bytes(self) -> int | None:
        return self._files.free_bytes()

    def _use_o_direct(self, enabled: bool) -> None:
        self._files.o_direct = enabled

    def _remove_excess(self, excess: list[OffloadKey]) -> None:
        self._files.remove(excess)

    def _adopt_scan(self, scan: ScanReport) -> list[OffloadKey]:
        keys = [key for key, _mtime in scan.blocks]  # oldest first
        split = max(0, len(keys) - self.capacity_blocks)
        excess, kept = keys[:split], keys[split:]
        for key in kept:  # in age order, so the policy ranks them by age
            self._index.insert(key)
        self.metrics.recovered_blocks = len(kept)
        self.metrics.evicted_blocks += len(excess)
        self.metrics.removed_on_recovery.update(scan.removed)
        if scan.blocks or scan.removed:
            logger.info(
                "nvme tier: recovered %d blocks in %s (%d over the cap evicted); removed %s",
                len(kept),
                self.directory,
                len(excess),
                dict(scan.removed) or "nothing",
            )
        return excess

    async def _remove_files(self, keys: Sequence[OffloadKey]) -> None:
        # One hop for all of them (the tier's own pool is shut down by now).
        if keys:
            await asyncio.to_thread(self._files.remove, keys)

    # -- queries ----------------------------------------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext = None) -> bool | None:
        """True if stored and verified-complete on disk, None while a store of it is
        queued or running, else False.

        Raises:
            InvalidArgumentError: ``key`` is not bytes.
        """
        if not isinstance(key, bytes):
            raise InvalidArgumentError(f"keys must be bytes, got {type(key).__name__}")
        if key in self._index:
            return True
        return None if self.storing(key) else False

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext = None) -> None:
        """Mark stored keys recently used, ``keys[0]`` the most recent; others ignored."""
        self._index.touch(list(keys))

    def hold(self, keys: Collection[OffloadKey]) -> None:
        """Keep ``keys`` from eviction (by a store, the cap or the floor) until released.

        Holds count; a key not (yet) stored may be held and is protected once stored.

        Raises:
            InvalidArgumentError: ``keys`` is not a collection of bytes; nothing held.
        """
        self._index.hold(keys)

    def release(self, keys: Collection[OffloadKey]) -> None:
        """Undo one :meth:`hold` of each key.

        Raises:
            InvalidArgumentError: a key is not bytes, or is released more often than
                held (named in hex); nothing released.
        """
        self._index.release(keys)

    def get_num_blocks(self) -> int:
        """Blocks stored and loadable now (stores in progress not counted)."""
        return len(self._index)

    @property
    def used_bytes(self) -> int:
        """Bytes of the block files this tier holds (header pages included)."""
        return len(self._index) * self.file_bytes

    def clear(self) -> None:
        """Drop every block: lookups miss at once, stores running now do not land.

        The files are removed by the next store job or by :meth:`aclose`.
        """
        self._generation += 1
        for key in self._index.clear():
            self._trash[key] = None
        self._space.freed()

    def _pinned_blocks(self) -> int:
        return self._index.pinned_resident

    # -- hooks ------------------------------------------------------------------------

    async def _do_store(self, job: JobMetadata) -> JobResult:
        failed, wanted = await self._store_admission(job)
        if not wanted:
            return _result(job.job_id, failed, len(job.keys))
        index = self._index

        done = asyncio.Event()
        claimed = list(wanted)
        for key in claimed:
            self._busy[key] = done
        index.pin(claimed)
        generation = self._generation
        budget = len(wanted) * self.block_bytes
        granted = 0
        try:
            await self._budget.acquire(budget, is_load=False)
            try:
                if self._space.stale(index.reserved + len(wanted)):
                    await self._refresh_free_bytes()
                limit, reason = self._space.limit(len(index), index.reserved)
                room = index.reserve(len(wanted), protected=job.keys, limit=limit)
                granted = room.granted
                if room.victims:
                    self.metrics.evicted_blocks += len(room.victims)
                    self._note_removed(room.victims)
                    self._space.freed()
                admitted = list(wanted.items())
                del admitted[granted:]
                trash = self._trash
                if trash:
                    for key, _ in admitted:
                        trash.pop(key, None)  # the rename below replaces the old file
                removals = [*room.victims, *trash]
                trash.clear()
                for key in removals:
                    self._busy[key] = done
                index.pin(removals)
                claimed += removals
                if granted < len(wanted):
                    refused = list(wanted)[granted:]
                    reason += "; every other block is pinned (being read, written or held)"
                    failed.update(dict.fromkeys(refused, reason))
                    self.metrics.refused_blocks += len(refused)
                    self._failure_log.record("no room", len(refused), reason)
                report = await self.run_blocking(self._store_hop, admitted, removals)
            finally:
                self._budget.release(budget)
            granted = self._commit_store(report, generation, failed, granted)
        finally:
            index.unreserve(granted)
            index.unpin(claimed)
            for key in claimed:
                if self._busy.get(key) is done:
                    del self._busy[key]
            done.set()
        return _result(job.job_id, failed, len(job.keys))

    async def _do_load(self, job: JobMetadata) -> JobResult:
        failed: dict[OffloadKey, str] = {}
        index = self._index
        reads: list[tuple[OffloadKey, int]] = []
        for key, block_id in zip(job.keys, job.block_ids, strict=True):
            if key in index:
                reads.append((key, block_id))
            else:
                failed[key] = "not in the nvme tier"
        if failed:
            self._failure_log.record("not in the tier", len(failed))
        if not reads:
            return _result(job.job_id, failed, len(job.keys))
        pinned = [key for key, _ in reads]
        index.pin(pinned)
        generation = self._generation
        budget = len(reads) * self.block_bytes
        try:
            await self._budget.acquire(budget, is_load=True)
            try:
                report = await self.run_blocking(self._load_hop, reads)
            finally:
                self._budget.release(budget)
        finally:
            index.unpin(pinned)
        self._commit_load(report, generation, failed)
        return _result(job.job_id, failed, len(job.keys))

    # -- worker thread: one hop per job ------------------------------------------------

    def _store_hop(
        self, admitted: Sequence[tuple[OffloadKey, int]], removals: Sequence[OffloadKey]
    ) -> StoreReport:
        # The slot views are cut here rather than on the loop: per-block work.
        slot = self.slot
        return self._files.store([(key, slot(block_id)) for key, block_id in admitted], removals)

    def _load_hop(self, reads: Sequence[tuple[OffloadKey, int]]) -> LoadReport:
        slot = self.slot
        return self._files.load([(key, slot(block_id)) for key, block_id in reads])

    # -- bookkeeping (loop thread, no awaits) ------------------------------------------

    def _holds_key(self, key: OffloadKey) -> bool:
        return key in self._index

    async def _wait_for_writes(self, wanted: dict[OffloadKey, int]) -> dict[OffloadKey, int]:
        """Wait until no running hop writes or removes a wanted key; drop those stored."""
        while True:
            busy = self._busy
            if not busy:
                return wanted
            events = {busy[key] for key in busy.keys() & wanted.keys()}
            if not events:
                return wanted
            for event in events:
                await event.wait()
            wanted = {k: b for k, b in wanted.items() if k not in self._index}

    def _commit_store(
        self, report: StoreReport, generation: int, failed: dict[OffloadKey, str], granted: int
    ) -> int:
        """Record a store hop's outcome; returns the reserved units still to give back."""
        if generation != self._generation:
            self._trash.update(dict.fromkeys(report.stored))  # cleared while being written
        else:
            insert = self._index.insert
            for key in report.stored:
                insert(key, reserved=True)
            granted -= len(report.stored)
        if report.failed:
            failed.update(report.failed)
            cause = "disk full" if report.disk_full else "write error"
            self._failure_log.record(cause, len(report.failed), next(iter(report.failed.values())))
        self.metrics.stored_blocks += len(report.stored)
        self.metrics.bytes_written += len(report.stored) * self.file_bytes
        self.metrics.write_errors += len(report.failed)
        self._store_space_ended(
            report.free_bytes, disk_full=report.disk_full, stored_any=bool(report.stored)
        )
        return granted

    def _commit_load(
        self, report: LoadReport, generation: int, failed: dict[OffloadKey, str]
    ) -> None:
        index = self._index
        self.metrics.loaded_blocks += len(report.loaded)
        self.metrics.bytes_read += len(report.loaded) * self.file_bytes
        if report.loaded:
            index.touch(report.loaded)
        if not report.failed:
            return
        corrupt = set(report.corrupt)
        for key, reason in report.failed.items():
            failed[key] = reason
            if key in corrupt:
                self.metrics.corrupt_blocks += 1
                self._failure_log.record("corrupt block", 1, reason)
            elif reason == _MISSING:
                self.metrics.missing_blocks += 1
                self._failure_log.record("block file missing", 1, reason)
            else:
                self.metrics.read_errors += 1
                self._failure_log.record("read error", 1, reason)
            if generation == self._generation and index.remove(key):
                self._note_removed((key,))
                self._space.freed()


def _meet(meeting: threading.Barrier) -> None:
    # A broken or timed-out meeting only means some thread starts later, in a job.
    with contextlib.suppress(threading.BrokenBarrierError):
        meeting.wait(_THREAD_START_TIMEOUT_S)


def _result(job_id: int, failed: dict[OffloadKey, str], total: int) -> JobResult:
    if not failed:
        return JobResult(job_id, True)
    reasons = Counter(failed.values())
    summary = "; ".join(f"{reason} ({n})" for reason, n in reasons.most_common(3))
    return JobResult(
        job_id, False, tuple(failed), f"{len(failed)} of {total} blocks failed: {summary}"
    )


__all__ = ["NVMeFileTier", "NVMeMetrics", "NVMeTierBase", "check_root"]
