"""Segment files, the blocking half of the NVMe tier (docs/nvme.md): :class:`SegmentFiles`
does a job's file work in one call on an I/O thread and decides nothing (the index places
each record). It builds the records in aligned buffers of its thread, then makes the
system calls, each through an :class:`~backends.nvme.os_calls.OsCalls` (fault injection)."""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from backends.nvme.os_calls import (
    ALIGNMENT,
    DISK_FULL_ERRNOS,
    O_DIRECT,
    REAL_OS,
    FsyncPolicy,
    OsCalls,
    describe_os_error,
    free_bytes,
    fsync_dir,
    write_all,
)
from backends.nvme.segment_format import (
    REMOVED_MARK,
    SEGMENTS_DIR,
    SegmentScan,
    check_segment_header,
    encode_segment_header,
    parse_segment_name,
)
from tiering.device.page_memory import HUGE_PAGE_BYTES, io_buffer
from tiering.errors import CorruptBlockError, InvalidArgumentError
from tiering.security.encryption import TAG_BYTES, BlockCipher, Seal
from tiering.tiers.block_record import (
    HEADER_BYTES,
    check_header,
    decode_header,
    encode_header,
    payload_checksum,
    record_binding,
    verify_payload,
)

if TYPE_CHECKING:
    from backends.nvme.segment_index import Placement

MAX_IOV = 1024  # the most buffers one pwritev/preadv takes (Linux IOV_MAX)
GIL_PAUSE_BYTES = 128 << 10  # the default bytes hashed between GIL pauses
MOVE_BYTES_PER_JOB = 64 << 20  # the most bytes of moved records one store job rewrites
SEAL_BATCH_BYTES = 8 << 20  # sealing buffers per I/O thread

ReadOutcome = tuple[bytes | None, str, bool]
"""What :meth:`SegmentFiles.read` says of one record: the key its header names (None
when it does not decode), why it failed ("" when it verified), and whether the record
was missing (its segment gone, or shorter)."""


def align_up(value: int, to: int = ALIGNMENT) -> int:
    """``value`` rounded up to a multiple of ``to``."""
    return -(-value // to) * to


def buffer_address(view: memoryview) -> int | None:
    """The address of a buffer's first byte, or None if it cannot be taken (read-only)."""
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(view))
    except (TypeError, ValueError):
        return None


def is_aligned(view: memoryview) -> bool:
    """True if ``view`` can take part in O_DIRECT I/O: aligned address and length."""
    if view.nbytes % ALIGNMENT:
        return False
    address = buffer_address(view)
    return address is not None and address % ALIGNMENT == 0


def thread_buffer(
    local: threading.local, name: str, nbytes: int, *, at_least: int = 0
) -> memoryview:
    """``nbytes`` of this thread's page-aligned, zeroed buffer ``name`` in ``local``, made
    ``max(nbytes, at_least)`` long when missing or too short."""
    view: memoryview | None = getattr(local, name, None)
    if view is None or view.nbytes < nbytes:
        size = max(nbytes, at_least)
        if size >= HUGE_PAGE_BYTES:
            view = io_buffer(size)
        else:  # a small buffer gains nothing from a huge page, and its first touch would
            # zero a whole one while the thread holds the GIL; never 0 bytes (EINVAL)
            view = memoryview(mmap.mmap(-1, max(size, ALIGNMENT)))
        setattr(local, name, view)
    return view[:nbytes]


def copy_bytes(target: memoryview, source: memoryview) -> None:
    """``target[:] = source``, without the GIL (``ctypes.memmove``) where both buffers
    are writable: I/O threads copy in parallel, and the loop's thread does not wait."""
    into, of = buffer_address(target), buffer_address(source)
    if into is None or of is None or target.nbytes != source.nbytes:
        target[:] = source
    else:
        ctypes.memmove(into, of, source.nbytes)


class PayloadSealer:
    """Seals one namespace's payloads of ``block_bytes`` with ``cipher`` (encryption at
    rest) into page-aligned buffers of each I/O thread; the slot keeps its plaintext."""

    def __init__(self, cipher: BlockCipher, block_bytes: int, ns_digest: bytes) -> None:
        self.cipher = cipher
        self.block_bytes = block_bytes
        self.ns_digest = ns_digest
        # Payloads at page-aligned offsets, not a page further apart for their tags: a
        # 2 MiB payload then fills exactly one huge page of the buffer.
        self.stride = align_up(block_bytes)
        self.batch = max(1, SEAL_BATCH_BYTES // self.stride)  # the most buffers lent at once
        self._local = threading.local()

    def buffers(self, count: int) -> list[memoryview]:
        """``count`` (at most :attr:`batch`) page-aligned buffers of ``block_bytes +
        TAG_BYTES``, this thread's until its next call. Seal into them in order: a tag
        (kept by its :class:`Seal`) spills into the next buffer, which overwrites it."""
        if not 0 < count <= self.batch:
            raise ValueError(f"count must be in 1..{self.batch}, got {count}")
        arena = thread_buffer(self._local, "arena", self.batch * self.stride + TAG_BYTES)
        size = self.block_bytes + TAG_BYTES
        return [arena[i * self.stride : i * self.stride + size] for i in range(count)]

    def seal(self, key: bytes, payload: memoryview, buffer: memoryview) -> Seal:
        """Seal ``payload``, ``key``'s block, into ``buffer``: its first ``block_bytes`` go
        to disk, the seal into the header."""
        seal = self.cipher.seal_into(payload, buffer, record_binding(self.ns_digest, b"", key))
        os.sched_yield()  # the cipher ran without the GIL, not without a core
        return seal


@dataclass(frozen=True, slots=True)
class RecordRun:
    """Records to write at consecutive slots of one segment from record ``first``;
    ``create``: this run creates the segment (with its header)."""

    segment: str
    first: int
    records: Sequence[tuple[bytes, memoryview]]
    create: bool = False


@dataclass(slots=True)
class WriteReport:
    """What a write did: ``written`` keys are on disk (durable per the fsync policy),
    ``failed`` maps every other key to a reason."""

    written: list[bytes] = field(default_factory=list)
    failed: dict[bytes, str] = field(default_factory=dict)
    disk_full: bool = False
    created: list[str] = field(default_factory=list)
    free_bytes: int | None = None


@dataclass(slots=True)
class StoreHop:
    """One store job for :meth:`SegmentFiles.store`: its ``records`` ``(key, CPU slot)`` go
    to the first of ``placed``, the ``moves`` ``(segment, record, digest)`` to the rest;
    the keys of the records ``gone`` are read and the segments ``delete`` deleted.
    ``moved``, ``gone_keys``: the keys read (None: unverified), None until the hop read."""

    records: list[tuple[bytes, int]]
    placed: Sequence[Placement]
    moves: Sequence[tuple[str, int, int]]
    gone: Sequence[tuple[str, int]]
    delete: Sequence[str]
    moved: list[bytes | None] | None = None
    gone_keys: list[bytes | None] | None = None


class SegmentFiles:
    """Blocking reads and writes of segment files in one namespace directory, whose
    ``segments/`` must exist; safe from several threads at once for distinct records.
    ``o_direct``: O_DIRECT may be used (probed) for aligned runs; ``staging_bytes``
    (0: off): direct I/O moves through a staging buffer per thread, sealed records excepted."""

    def __init__(
        self,
        directory: str,
        *,
        block_bytes: int,
        ns_digest: bytes,
        fsync: FsyncPolicy = "batch",
        o_direct: bool = False,
        gil_pause_bytes: int = GIL_PAUSE_BYTES,
        staging_bytes: int = 0,
        cipher: BlockCipher | None = None,
        file_mode: int = 0o600,
        os_calls: OsCalls = REAL_OS,
    ) -> None:
        self.gil_pause_bytes = gil_pause_bytes
        self.directory = directory
        self.segments_dir = os.path.join(directory, SEGMENTS_DIR)
        self.block_bytes = block_bytes
        self.record_bytes = HEADER_BYTES + align_up(block_bytes)  # from a record to the next
        self.ns_digest = ns_digest
        self.fsync = fsync
        self.o_direct = o_direct and bool(O_DIRECT)
        self.os = os_calls
        self.sealer = None if cipher is None else PayloadSealer(cipher, block_bytes, ns_digest)
        self.file_mode = file_mode
        self._local = threading.local()
        self._moves = threading.local()  # per thread: buffers for moved records
        self._padding = memoryview(mmap.mmap(-1, ALIGNMENT))[: align_up(block_bytes) - block_bytes]
        self._staged_records = max(1, staging_bytes // self.record_bytes) if staging_bytes else 0

    @property
    def staged(self) -> int:
        """Records one staged call moves; 0 when I/O is not staged (off, or no O_DIRECT)."""
        return self._staged_records if self.o_direct else 0

    def path_of(self, segment: str) -> str:
        return os.path.join(self.segments_dir, segment)

    def offset_of(self, record: int) -> int:
        return HEADER_BYTES + record * self.record_bytes

    def records_in(self, size: int) -> int:
        """Whole record slots in a segment file of ``size`` bytes."""
        return max(0, (size - HEADER_BYTES) // self.record_bytes)

    def _pages(self, count: int) -> memoryview:
        # Aligned header pages, reused per thread: O_DIRECT needs aligned buffers.
        return thread_buffer(self._local, "pages", count * HEADER_BYTES, at_least=16 * HEADER_BYTES)

    def _staging(self) -> memoryview:
        # This thread's staging buffer: records laid out as on disk, on huge pages.
        return thread_buffer(self._local, "staging", self._staged_records * self.record_bytes)

    def store(self, hop: StoreHop, slot: Callable[[int], memoryview], writer: str) -> WriteReport:
        """One store job's blocking half: read the moves and the keys gone into ``hop``,
        delete ``hop.delete``, then :meth:`write` the job's blocks (``slot(block id)``)
        and the moves that verified. Raises as :meth:`write`."""
        size, count = self.block_bytes, len(hop.moves)
        buffers: list[memoryview] = []
        if count:
            view = thread_buffer(self._moves, "moves", count * size, at_least=MOVE_BYTES_PER_JOB)
            buffers = [view[i * size : (i + 1) * size] for i in range(count)]
        moving = [(s, r, b, None) for (s, r, _), b in zip(hop.moves, buffers, strict=True)]
        moved = [key if not why else None for key, why, _ in self.read(moving)]
        hop.moved, hop.gone_keys = moved, self.read_keys(hop.gone)
        self.delete(hop.delete)
        records = [(key, slot(block_id)) for key, block_id in hop.records]
        where = [(p.segment, p.record, p.create) for p in hop.placed[: len(records)]]
        for key, buffer, p in zip(moved, buffers, hop.placed[len(records) :], strict=True):
            if key is not None:
                records.append((key, buffer))
                where.append((p.segment, p.record, p.create))
        return self.write(list(iter_runs(where, records)), writer=writer)

    def load(
        self, reads: Sequence[tuple[bytes, str, int, int]], slot: Callable[[int], memoryview]
    ) -> list[ReadOutcome]:
        """One load job's blocking half: :meth:`read` of each ``(key, segment, record, block
        id)`` into ``slot(block id)``."""
        return self.read([(segment, record, slot(b), key) for key, segment, record, b in reads])

    def drop_move_buffers(self) -> None:
        """Let every thread's buffers for moved records go (the next move makes its own)."""
        self._moves = threading.local()

    def write(self, runs: Sequence[RecordRun], *, writer: str) -> WriteReport:
        """Write each run's records into its segment. An I/O error fails the rest of its
        run (after ENOSPC/EDQUOT, every later run) and never raises; unless ``fsync`` is
        ``"none"`` a key is written once its segment is synced. InvalidArgumentError
        (nothing written) for a payload that is not ``block_bytes`` long."""
        for run in runs:
            for _key, payload in run.records:
                if payload.nbytes != self.block_bytes:
                    raise InvalidArgumentError(
                        f"payload is {payload.nbytes} bytes, the tier stores {self.block_bytes}"
                    )
        report = WriteReport()
        for position, run in enumerate(runs):
            if report.disk_full:
                for later in runs[position:]:
                    for key, _ in later.records:
                        report.failed.setdefault(key, "disk full (ENOSPC)")
                break
            try:
                self._write_run(run, writer, report)
            except OSError as exc:
                reason = f"write failed: {describe_os_error(exc)}"
                report.failed.update((key, reason) for key, _ in run.records)
                report.disk_full = exc.errno in DISK_FULL_ERRNOS
                continue
            report.written.extend(key for key, _ in run.records)
        if report.created and self.fsync != "none" and report.written:
            try:
                fsync_dir(self.os, self.segments_dir)
            except OSError as exc:
                reason = f"fsync failed: {describe_os_error(exc)}"
                report.failed.update(dict.fromkeys(report.written, reason))
                report.written = []
        report.free_bytes = self.free_bytes()
        return report

    def _write_run(self, run: RecordRun, writer: str, report: WriteReport) -> None:
        records = run.records
        direct = self.o_direct and (
            self.sealer is not None or self.staged > 0 or all(is_aligned(p) for _, p in records)
        )
        # Within MAX_IOV buffers (a header, a payload, maybe padding each), and the
        # sealing buffers or the staging buffer.
        per_call = MAX_IOV // (3 if self._padding.nbytes else 2)
        per_call = min(per_call, self.sealer.batch) if self.sealer else self.staged or per_call
        calls = [records[i : i + per_call] for i in range(0, len(records), per_call)] or [records]
        # The segment header and the first call's records are built before the file is
        # opened: a job goes down from the records to the system calls.
        header = None
        if run.create:
            header = thread_buffer(self._local, "segment header", HEADER_BYTES)
            encode_segment_header(
                header, payload_bytes=self.block_bytes, ns_digest=self.ns_digest, writer=writer
            )
        buffers = self._record_buffers(calls[0])
        # O_CREAT for every run: jobs writing one segment run on several threads, and the
        # run that writes its header may come last. Names are unique to this writer.
        flags = os.O_WRONLY | os.O_CREAT | (O_DIRECT if direct else 0)
        fd = self.os.open(self.path_of(run.segment), flags, self.file_mode)
        try:
            if header is not None:
                report.created.append(run.segment)
                write_all(self.os, fd, [header], 0)
            offset = self.offset_of(run.first)
            if len(calls) > 1:
                # Allocated first, in one call: on ext4 a direct write that must allocate
                # takes the file for itself and waits for all I/O in flight on it, which
                # would stall every other job writing the segment (docs/security.md).
                self.os.allocate(fd, offset, len(records) * self.record_bytes)
            for i, chunk in enumerate(calls):
                write_all(self.os, fd, buffers if i == 0 else self._record_buffers(chunk), offset)
                offset += len(chunk) * self.record_bytes
                if self.fsync == "always":
                    self.os.fdatasync(fd)
            if self.fsync != "none":
                self.os.fdatasync(fd)
        finally:
            self.os.close(fd)

    def _record_buffers(self, records: Sequence[tuple[bytes, memoryview]]) -> list[memoryview]:
        """What one ``pwritev`` writes for consecutive ``records``: each one's header page,
        payload (sealed, when encrypting) and padding; staged, one buffer laid out as on
        disk (the checksum taken of the copy)."""
        staged, size = self.sealer is None and self.staged > 0, self.block_bytes
        ns = self.ns_digest
        step = self.record_bytes if staged else HEADER_BYTES
        pages = self._staging() if staged else self._pages(len(records))
        sealed = [] if self.sealer is None else self.sealer.buffers(len(records))
        buffers: list[memoryview] = []
        for i, (key, payload) in enumerate(records):
            page, start = pages[i * step : i * step + HEADER_BYTES], i * step + HEADER_BYTES
            seal, data = None, payload
            if staged:
                data = pages[start : start + size]
                copy_bytes(data, payload)
                if self._padding.nbytes:  # reads through this buffer leave other bytes there
                    pages[start + size : (i + 1) * step] = self._padding
            elif self.sealer is not None:
                seal, data = self.sealer.seal(key, payload, sealed[i]), sealed[i][:size]
            checksum = None if seal else self._checksum(data, record_binding(ns, b"", key))
            encode_header(
                page, key=key, payload_bytes=size, ns_digest=ns, checksum=checksum, seal=seal
            )
            buffers += [page, data, self._padding] if self._padding.nbytes else [page, data]
        return [pages[: len(records) * step]] if staged else buffers

    def _checksum(self, payload: memoryview | bytes | bytearray, binding: bytes) -> bytes:
        """:func:`payload_checksum`, with a moment without the GIL after each
        ``gil_pause_bytes`` hashed (0: never), so that the loop's thread does not wait."""
        checksum = payload_checksum(payload, binding)
        if self.gil_pause_bytes:
            done = getattr(self._local, "hashed", 0) + payload.nbytes
            if done >= self.gil_pause_bytes:
                time.sleep(0)
                done = 0
            self._local.hashed = done
        return checksum

    def read(self, reads: Sequence[tuple[str, int, memoryview, bytes | None]]) -> list[ReadOutcome]:
        """Read each ``(segment, record, slot, expected key or None for any)`` into its
        slot and verify it as a load does: one :data:`ReadOutcome` per read, in order (a
        failed read's slot must not be used). Raises only InvalidArgumentError, nothing
        read, for a slot that is not ``block_bytes`` long."""
        outcomes: list[ReadOutcome] = [(None, "not read", False)] * len(reads)
        by_segment: dict[str, list[tuple[int, int, memoryview, bytes | None]]] = {}
        for i, (segment, record, slot, key) in enumerate(reads):
            if slot.nbytes != self.block_bytes:
                raise InvalidArgumentError(
                    f"slot is {slot.nbytes} bytes, the tier stores {self.block_bytes}"
                )
            by_segment.setdefault(segment, []).append((i, record, slot, key))
        for segment, items in by_segment.items():
            self._read_segment(segment, items, outcomes)
        return outcomes

    def _read_segment(
        self,
        segment: str,
        items: list[tuple[int, int, memoryview, bytes | None]],
        outcomes: list[ReadOutcome],
    ) -> None:
        # Sealed records land in the sealer's aligned buffers, never staged (as on write),
        # and open from there into their slots.
        staged = self.staged if self.sealer is None else 0
        direct = self.o_direct and (
            self.sealer is not None or staged > 0 or all(is_aligned(i[2]) for i in items)
        )
        try:
            fd = self.os.open(self.path_of(segment), os.O_RDONLY | (O_DIRECT if direct else 0))
        except OSError as exc:
            missing = isinstance(exc, FileNotFoundError)
            why = "segment file is missing" if missing else f"read failed: {describe_os_error(exc)}"
            for i, _, _, _ in items:
                outcomes[i] = (None, why, missing)
            return
        items.sort(key=lambda item: item[1])
        try:
            most = staged if direct and staged else MAX_IOV // 3
            if self.sealer is not None:
                most = min(most, self.sealer.batch)
            for run in _runs([(segment, item[1]) for item in items], most):
                self._read_run(fd, items[run], outcomes, staged=direct and staged > 0)
        finally:
            self.os.close(fd)

    def _read_run(
        self,
        fd: int,
        run: list[tuple[int, int, memoryview, bytes | None]],
        outcomes: list[ReadOutcome],
        *,
        staged: bool,
    ) -> None:
        """Read consecutive records in one ``preadv`` (into their slots; ``staged`` into
        the staging buffer, each payload copied into its slot once its header checks;
        sealed into the sealer's buffers, each opened into its slot), and verify each."""
        step, size = self.record_bytes, self.block_bytes
        sealed = [] if self.sealer is None else self.sealer.buffers(len(run))
        if staged:
            pages, page_step = self._staging(), step
            buffers = [pages[: len(run) * step]]
        else:
            pages, page_step = self._pages(len(run)), HEADER_BYTES
            # Where a read's padding between records goes (never the zeros writes use).
            sink = thread_buffer(self._local, "sink", self._padding.nbytes)
            padding = [sink] if sink.nbytes else []
            buffers = []
            for j, (_, _, slot, _) in enumerate(run):
                landing = sealed[j][:size] if sealed else slot
                buffers += [pages[j * HEADER_BYTES : (j + 1) * HEADER_BYTES], landing, *padding]
        try:
            got = self.os.preadv(fd, buffers, self.offset_of(run[0][1]))
        except OSError as exc:
            for i, _, _, _ in run:
                outcomes[i] = (None, f"read failed: {describe_os_error(exc)}", False)
            return
        cipher = None if self.sealer is None else self.sealer.cipher
        for j, (i, _, slot, key) in enumerate(run):
            available = got - j * step
            header = None
            try:
                if available <= 0:
                    outcomes[i] = (None, "record is missing (segment is shorter)", True)
                    continue
                if available < HEADER_BYTES + self.block_bytes:
                    raise CorruptBlockError(f"short read: {available} bytes")
                start = j * page_step
                header = decode_header(pages[start : start + HEADER_BYTES])
                check_header(
                    header, key=key, payload_bytes=self.block_bytes, ns_digest=self.ns_digest
                )
                if staged:
                    payload = start + HEADER_BYTES
                    copy_bytes(slot, pages[payload : payload + slot.nbytes])
                if cipher is None:
                    verify_payload(header, slot, None, self._checksum)
                else:
                    verify_payload(header, sealed[j][:size], cipher, into=slot)
                    os.sched_yield()  # as PayloadSealer.seal does
            except CorruptBlockError as exc:
                outcomes[i] = (header and header.key, f"corrupt block: {exc}", False)
            else:
                outcomes[i] = (header.key, "", False)

    def scan(self, segment: str, start: int = 0) -> SegmentScan:
        """Read the record headers (not payloads) of ``segment`` from record ``start`` on;
        a slot whose header does not verify is counted, not listed. OSError if unreadable."""
        fd = self.os.open(self.path_of(segment), os.O_RDONLY)
        try:
            page = self._pages(1)
            header_ok = True
            try:
                if self.os.preadv(fd, [page], 0) != HEADER_BYTES:
                    raise CorruptBlockError("segment header is short")
                check_segment_header(page, payload_bytes=self.block_bytes, ns_digest=self.ns_digest)
            except CorruptBlockError:
                header_ok = False
            end = self.records_in(self.os.fstat(fd).st_size)
            records: list[tuple[bytes, int]] = []
            invalid = removed = 0
            for record in range(start, end):
                key = self._key_at(fd, page, record)
                if key is not None:
                    records.append((key, record))
                elif page[: len(REMOVED_MARK)] == REMOVED_MARK:
                    removed += 1
                else:
                    invalid += 1
            return SegmentScan(records, end, invalid, header_ok, removed)
        finally:
            self.os.close(fd)

    def _key_at(self, fd: int, page: memoryview, record: int) -> bytes | None:
        """The key of ``record``, its header page read into ``page``; None unless it verifies."""
        if self.os.preadv(fd, [page], self.offset_of(record)) != HEADER_BYTES:
            return None
        try:
            header = decode_header(page)
            check_header(header, key=None, payload_bytes=self.block_bytes, ns_digest=self.ns_digest)
        except CorruptBlockError:
            return None
        return header.key

    def read_keys(self, records: Sequence[tuple[str, int]]) -> list[bytes | None]:
        """The key in the header of each ``(segment, record)``, or None where the header
        cannot be read or does not verify (payloads are not read). Never raises."""
        keys: list[bytes | None] = [None] * len(records)
        page = self._pages(1)
        for fd, _, items in self._open_each(records, os.O_RDONLY):
            for i, record in items:
                with contextlib.suppress(OSError):
                    keys[i] = self._key_at(fd, page, record)
        return keys

    def mark_removed(self, records: Sequence[tuple[str, int]]) -> set[tuple[str, int]]:
        """Overwrite the header page of each ``(segment, record)`` with
        :data:`REMOVED_MARK`, synced (a scan skips the slot and counts it removed); those
        marked (a segment that fails is left out). Never raises."""
        marked: set[tuple[str, int]] = set()
        mark = memoryview(REMOVED_MARK.ljust(HEADER_BYTES, b"\0"))
        for fd, segment, items in self._open_each(records, os.O_WRONLY):
            with contextlib.suppress(OSError):
                size = self.os.fstat(fd).st_size
                done = {(segment, r) for _, r in items if self.offset_of(r) + HEADER_BYTES <= size}
                for _, record in sorted(done):
                    write_all(self.os, fd, [mark], self.offset_of(record))
                self.os.fdatasync(fd)
                marked |= done
        return marked

    def _open_each(
        self, records: Sequence[tuple[str, int]], flags: int
    ) -> Iterator[tuple[int, str, list[tuple[int, int]]]]:
        # ``(fd, segment, [(position in records, record)])`` of each segment that opens;
        # the fd closes when the next is asked for.
        by_segment: dict[str, list[tuple[int, int]]] = {}
        for i, (segment, record) in enumerate(records):
            by_segment.setdefault(segment, []).append((i, record))
        for segment, items in by_segment.items():
            try:
                fd = self.os.open(self.path_of(segment), flags)
            except OSError:
                continue
            try:
                yield fd, segment, items
            finally:
                self.os.close(fd)

    def list_segments(self) -> list[tuple[str, int]]:
        """``(name, bytes)`` of every segment file, in name order."""
        try:
            entries = list(os.scandir(self.segments_dir))
        except FileNotFoundError:
            return []
        found = []
        for entry in entries:
            if parse_segment_name(entry.name) is not None:
                with contextlib.suppress(FileNotFoundError):  # deleted since the listing
                    found.append((entry.name, entry.stat().st_size))
        return sorted(found)

    def delete(self, segments: Sequence[str]) -> int:
        """Unlink segment files; returns how many existed. Never raises."""
        removed = 0
        for segment in segments:
            with contextlib.suppress(OSError):
                self.os.unlink(self.path_of(segment))
                removed += 1
        return removed

    def free_bytes(self) -> int | None:
        """Free bytes on the file system, or None if ``statvfs`` failed."""
        try:
            return free_bytes(self.os.statvfs(self.directory))
        except OSError:
            return None


def _runs(places: Sequence[tuple[str, int]], most: int = 1 << 62) -> Iterator[slice]:
    # Slices of ``places`` at consecutive records of one segment, at most ``most`` long.
    start = 0
    for i in range(1, len(places) + 1):
        segment, record = places[i - 1]
        if i == len(places) or i - start == most or places[i] != (segment, record + 1):
            yield slice(start, i)
            start = i


def iter_runs(
    placed: Sequence[tuple[str, int, bool]], records: Sequence[tuple[bytes, memoryview]]
) -> Iterator[RecordRun]:
    """Group records placed at ``(segment, record number, creates segment)`` into runs of
    consecutive record numbers of one segment, in order."""
    for run in _runs([(segment, record) for segment, record, _ in placed]):
        segment, first, create = placed[run.start]
        yield RecordRun(segment, first, records[run], create)
