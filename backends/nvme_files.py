"""The NVMe tier's blocking core: block files in one namespace directory.

:class:`BlockFiles` does every blocking file operation of the tier, synchronously and
without an event loop. The async shell (:mod:`backends.nvme`) calls one of its methods
once per job on the tier's own worker threads, so one job costs one executor hop. The
methods are safe to run concurrently on several threads: they share no mutable state
except a thread-local header page and a sequence counter.

Guarantees:

* A block file is visible under its final name only once it is completely written:
  it is written to a unique temporary name in the same directory, then renamed.
* Payloads move between the caller's memoryviews and the files with positional vectored
  I/O (``pwritev``/``preadv``) and no intermediate copy; with O_DIRECT when enabled and
  the slot's address is 4096-aligned, buffered otherwise.
* A read is reported as loaded only after the file length, header (magic, version,
  namespace, key, payload length, header checksum) and payload checksum all matched.
  A file that fails is removed from disk in the same call.
* Temporary files of a crashed writer are removed by :meth:`BlockFiles.scan`; those of a
  live writer (another engine on the same root) are left alone. Each writer holds an
  ``flock`` on ``owners/<instance>.lock`` for its lifetime, and its temporary names carry
  its instance id, so liveness is a non-blocking lock attempt.

Every system call goes through an :class:`OsCalls` object, so tests can inject faults
(see :mod:`tests._faults`).
"""

from __future__ import annotations

import errno
import itertools
import mmap
import os
import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from backends.nvme_format import (
    BLOCK_SUFFIX,
    HEADER_BYTES,
    TEMP_SUFFIX,
    block_relpath,
    check_header,
    decode_header,
    encode_header,
    fanout_dirs,
    payload_checksum,
    verify_payload,
)
from backends.nvme_os import (
    _O_CLOEXEC,
    _O_DIRECT,
    DISK_FULL_ERRNOS,
    FSYNC_POLICIES,
    OWNERS_DIR,
    REAL_OS,
    FsyncPolicy,
    OsCalls,
    describe_os_error,
    free_bytes,
    fsync_dir,
    is_aligned,
    owner_alive,
    write_all,
)
from tiering.errors import CorruptBlockError, InvalidArgumentError

if TYPE_CHECKING:
    from backends.nvme_sealing import PayloadSealer


@dataclass(slots=True)
class StoreReport:
    """What one ``BlockFiles.store`` call did.

    ``stored`` keys are complete and visible on disk (durable per the fsync policy);
    ``failed`` maps every other key to a reason. ``disk_full`` is true when the file
    system answered ENOSPC or EDQUOT. ``free_bytes`` is the space left afterwards.
    """

    stored: list[bytes] = field(default_factory=list)
    failed: dict[bytes, str] = field(default_factory=dict)
    disk_full: bool = False
    removed: int = 0
    free_bytes: int | None = None


@dataclass(slots=True)
class LoadReport:
    """What one ``BlockFiles.load`` call did.

    ``loaded`` keys were verified and are in their slots; ``failed`` maps every other
    key to a reason; ``corrupt`` lists the failed keys whose file existed but failed
    verification (they were removed from disk).
    """

    loaded: list[bytes] = field(default_factory=list)
    failed: dict[bytes, str] = field(default_factory=dict)
    corrupt: list[bytes] = field(default_factory=list)


@dataclass(slots=True)
class ScanReport:
    """What is on disk: valid blocks ``(key, mtime)`` oldest first, files removed by reason."""

    blocks: list[tuple[bytes, float]] = field(default_factory=list)
    removed: Counter[str] = field(default_factory=Counter)


class BlockFiles:
    """Blocking reads and writes of block files in one namespace directory.

    The directory, its fan-out subdirectories and ``owners/`` must exist. ``o_direct``
    says whether O_DIRECT may be used (the caller probed the file system); even then a
    block whose slot is not 4096-aligned moves with buffered I/O.
    """

    def __init__(
        self,
        directory: str,
        *,
        block_bytes: int,
        ns_digest: bytes,
        instance_id: str,
        fsync: FsyncPolicy = "batch",
        o_direct: bool = False,
        sealer: PayloadSealer | None = None,
        file_mode: int = 0o600,
        os_calls: OsCalls = REAL_OS,
    ) -> None:
        if fsync not in FSYNC_POLICIES:
            raise InvalidArgumentError(f"fsync must be one of {FSYNC_POLICIES}, got {fsync!r}")
        self.directory = directory
        self.block_bytes = block_bytes
        self.file_bytes = HEADER_BYTES + block_bytes
        self.sealer = sealer
        self.file_mode = file_mode
        self.ns_digest = ns_digest
        self.instance_id = instance_id
        self.fsync = fsync
        self.o_direct = o_direct and bool(_O_DIRECT)
        self.os = os_calls
        self._seq = itertools.count()
        self._local = threading.local()

    # -- paths ---------------------------------------------------------------------

    def path_of(self, key: bytes) -> str:
        """The final path of ``key``'s block file."""
        return os.path.join(self.directory, block_relpath(key))

    def _temp_path(self, final: str) -> str:
        stem = final[: -len(BLOCK_SUFFIX)]
        return f"{stem}.{self.instance_id}-{next(self._seq)}{TEMP_SUFFIX}"

    def _header_page(self) -> memoryview:
        # One aligned page per worker thread: O_DIRECT needs an aligned header buffer.
        page = getattr(self._local, "page", None)
        if page is None:
            page = memoryview(mmap.mmap(-1, HEADER_BYTES))
            self._local.page = page
        return page

    def _direct_flag(self, payload: memoryview) -> int:
        return _O_DIRECT if self.o_direct and is_aligned(payload) else 0

    # -- store ---------------------------------------------------------------------

    def store(
        self, writes: Sequence[tuple[bytes, memoryview]], remove: Sequence[bytes] = ()
    ) -> StoreReport:
        """Remove the files of ``remove``, then write each ``(key, payload)`` as a block.

        Never raises for an I/O error: each key either lands in ``stored`` or gets a
        reason in ``failed``. On ENOSPC/EDQUOT the rest of the job is not attempted.
        With ``fsync="batch"`` the job ends with one ``syncfs`` (per-file and directory
        fsyncs where ``syncfs`` is missing); if that flush fails, every key fails and its
        file is removed.
        """
        report = StoreReport()
        report.removed = self.remove(remove)
        written: list[tuple[bytes, str]] = []
        for index, (key, payload) in enumerate(writes):
            if report.disk_full:
                for rest, _ in writes[index:]:
                    report.failed[rest] = "disk full (ENOSPC)"
                break
            final = self.path_of(key)
            try:
                self._write_block(key, payload, final)
            except OSError as exc:
                report.failed[key] = f"write failed: {describe_os_error(exc)}"
                if exc.errno in DISK_FULL_ERRNOS:
                    report.disk_full = True
                continue
            written.append((key, final))
        if written and self.fsync == "batch":
            try:
                self._sync_batch([final for _, final in written])
            except OSError as exc:
                reason = f"fsync failed: {describe_os_error(exc)}"
                for key, final in written:
                    report.failed[key] = reason
                    self._unlink_quietly(final)
                written = []
                if exc.errno in DISK_FULL_ERRNOS:
                    report.disk_full = True
        report.stored = [key for key, _ in written]
        report.free_bytes = self.free_bytes()
        return report

    def _write_block(self, key: bytes, payload: memoryview, final: str) -> None:
        if payload.nbytes != self.block_bytes:
            raise InvalidArgumentError(
                f"payload is {payload.nbytes} bytes, the tier stores {self.block_bytes}"
            )
        header = self._header_page()
        if self.sealer is None:
            seal, data, checksum = None, payload, payload_checksum(payload)
        else:
            buffer = self.sealer.buffers(1)[0]
            seal = self.sealer.seal(key, payload, buffer)
            data, checksum = buffer[: self.block_bytes], seal.tag
        encode_header(
            header,
            key=key,
            payload_bytes=payload.nbytes,
            checksum=checksum,
            ns_digest=self.ns_digest,
            seal=seal,
        )
        temp = self._temp_path(final)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_CLOEXEC | self._direct_flag(data)
        fd = self.os.open(temp, flags, self.file_mode)
        try:
            try:
                write_all(self.os, fd, [header, data], 0)
                if self.fsync == "always":
                    self.os.fdatasync(fd)
            finally:
                self.os.close(fd)  # a failed close (EIO) is a failed write too
            self.os.replace(temp, final)
        except BaseException:
            self._unlink_quietly(temp)
            raise
        if self.fsync == "always":
            try:
                fsync_dir(self.os, os.path.dirname(final))
            except BaseException:
                # The key is reported failed, so its file must not stay behind unindexed.
                self._unlink_quietly(final)
                raise

    def _sync_batch(self, finals: Sequence[str]) -> None:
        fd = self.os.open(self.directory, os.O_RDONLY | _O_CLOEXEC)
        try:
            self.os.syncfs(fd)
            return
        except OSError as exc:
            if exc.errno != errno.ENOSYS:
                raise
        finally:
            self.os.close(fd)
        for final in finals:
            fd = self.os.open(final, os.O_RDONLY | _O_CLOEXEC)
            try:
                self.os.fdatasync(fd)
            finally:
                self.os.close(fd)
        for directory in {os.path.dirname(final) for final in finals}:
            fsync_dir(self.os, directory)

    # -- load ----------------------------------------------------------------------

    def load(self, reads: Sequence[tuple[bytes, memoryview]]) -> LoadReport:
        """Read each ``(key, slot)`` block into ``slot`` and verify it.

        Never raises for an I/O error or bad data: each key lands in ``loaded`` only if
        its length, header and payload checksum matched; otherwise it gets a reason in
        ``failed`` and its file is removed (unless it was missing already). A failed
        key's slot may hold partial bytes and must not be used.
        """
        report = LoadReport()
        for key, slot in reads:
            path = self.path_of(key)
            try:
                self._read_block(key, slot, path)
            except FileNotFoundError:
                report.failed[key] = "block file is missing"
            except CorruptBlockError as exc:
                report.failed[key] = f"corrupt block: {exc}"
                report.corrupt.append(key)
            except OSError as exc:
                report.failed[key] = f"read failed: {describe_os_error(exc)}"
                self._unlink_quietly(path)
            else:
                report.loaded.append(key)
        return report

    def _read_block(self, key: bytes, slot: memoryview, path: str) -> None:
        if slot.nbytes != self.block_bytes:
            raise InvalidArgumentError(
                f"slot is {slot.nbytes} bytes, the tier stores {self.block_bytes}"
            )
        fd = self.os.open(path, os.O_RDONLY | _O_CLOEXEC | self._direct_flag(slot))
        try:
            stat = self.os.fstat(fd)
            try:
                if stat.st_size != self.file_bytes:
                    raise CorruptBlockError(
                        f"file is {stat.st_size} bytes, expected {self.file_bytes}"
                    )
                header = self._header_page()
                got = self.os.preadv(fd, [header, slot], 0)
                if got != self.file_bytes:
                    raise CorruptBlockError(f"short read: {got} of {self.file_bytes} bytes")
                decoded = decode_header(header)
                check_header(
                    decoded, key=key, payload_bytes=self.block_bytes, ns_digest=self.ns_digest
                )
                verify_payload(decoded, slot, self.sealer)
            except CorruptBlockError:
                self._unlink_if_same(path, stat)
                raise
        finally:
            self.os.close(fd)

    # -- removal, space, recovery -----------------------------------------------------

    def remove(self, keys: Sequence[bytes]) -> int:
        """Unlink the block files of ``keys``; returns how many existed. Never raises."""
        removed = 0
        for key in keys:
            removed += self._unlink_quietly(self.path_of(key))
        return removed

    def free_bytes(self) -> int | None:
        """Free bytes on the file system, or None if ``statvfs`` failed."""
        try:
            return free_bytes(self.os.statvfs(self.directory))
        except OSError:
            return None

    def scan(self) -> ScanReport:
        """List the valid blocks on disk and remove what must not stay.

        Removed: block files that are torn (wrong length), unreadable, of another
        namespace or format, or misplaced (name does not match the key inside); temporary
        files of writers that are no longer running; lock files of dead writers. Files
        with other names are left alone. Payload checksums are not read here; every load
        verifies them.
        """
        report = ScanReport()
        found: list[tuple[float, bytes]] = []
        alive: dict[str, bool] = {}
        for sub in fanout_dirs():
            subdir = os.path.join(self.directory, sub)
            try:
                entries = [entry.name for entry in os.scandir(subdir)]
            except FileNotFoundError:
                continue
            for name in entries:
                path = os.path.join(subdir, name)
                if name.endswith(BLOCK_SUFFIX):
                    found_block = self._check_block_file(path, report)
                    if found_block is not None:
                        found.append(found_block)
                elif name.endswith(TEMP_SUFFIX):
                    owner = name[: -len(TEMP_SUFFIX)].rpartition(".")[2].partition("-")[0]
                    if owner not in alive:
                        alive[owner] = owner_alive(self.directory, owner)
                    if not alive[owner] and self._unlink_quietly(path):
                        report.removed["temporary"] += 1
        self._remove_dead_owner_locks(report)
        found.sort()
        report.blocks = [(key, mtime) for mtime, key in found]
        return report

    def _check_block_file(self, path: str, report: ScanReport) -> tuple[float, bytes] | None:
        header = self._header_page()
        try:
            fd = self.os.open(path, os.O_RDONLY | _O_CLOEXEC)
        except OSError:
            return None
        try:
            stat = self.os.fstat(fd)
            torn = stat.st_size != self.file_bytes
            if torn or self.os.preadv(fd, [header], 0) != HEADER_BYTES:
                reason = "torn"
            else:
                reason = self._header_problem(header, path)
                if reason is None:
                    return stat.st_mtime, decode_header(header).key
        except OSError:
            reason = "unreadable"
        finally:
            self.os.close(fd)
        if self._unlink_quietly(path):
            report.removed[reason] += 1
        return None

    def _header_problem(self, header: memoryview, path: str) -> str | None:
        try:
            decoded = decode_header(header)
        except CorruptBlockError:
            return "corrupt"
        if decoded.namespace_digest != self.ns_digest:
            return "foreign"
        if decoded.payload_bytes != self.block_bytes:
            return "corrupt"
        if self.path_of(decoded.key) != path:
            return "misplaced"
        return None

    def _remove_dead_owner_locks(self, report: ScanReport) -> None:
        owners = os.path.join(self.directory, OWNERS_DIR)
        try:
            names = [entry.name for entry in os.scandir(owners)]
        except FileNotFoundError:
            return
        for name in names:
            if not name.endswith(".lock"):
                continue
            instance = name[: -len(".lock")]
            if instance == self.instance_id or owner_alive(self.directory, instance):
                continue
            if self._unlink_quietly(os.path.join(owners, name)):
                report.removed["owner lock"] += 1

    def _unlink_quietly(self, path: str) -> int:
        try:
            self.os.unlink(path)
        except OSError:
            return 0
        return 1

    def _unlink_if_same(self, path: str, stat: os.stat_result) -> None:
        # Another engine on a shared root may have renamed a fresh block over the bad
        # one since we opened it; only remove the file we actually read.
        try:
            current = self.os.stat(path)
        except OSError:
            return
        if (current.st_dev, current.st_ino) == (stat.st_dev, stat.st_ino):
            self._unlink_quietly(path)
