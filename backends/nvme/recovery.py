"""Opening an NVMe namespace directory, recovering its index from the checkpoint and a
scan of what was written after it, and writing the checkpoint (docs/nvme.md).

Where the work runs (docs/architecture.md#where-work-runs): the file-system operations
around the data path (the namespace directory and its identity file, the listing of
leftovers, the checkpoint read whole, its rename and the directory sync) are awaited
through aiofiles, one executor hop each; what is a batch of system calls (the scan of
every segment's record headers and the index built from it, the checkpoint's body
written and synced) is ONE blocking call, run by the caller's ``run_blocking``: the
tier's I/O threads, or a thread of the loop's executor (:func:`asyncio.to_thread`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import stat
import struct
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import aiofiles
import aiofiles.os

from backends.nvme.os_calls import (
    OWNERS_DIR,
    UNUSABLE_ROOT_ERRNOS,
    check_private,
    check_root,
    describe_os_error,
    fs_call,
    fsync_dir,
    owner_alive,
    private_opener,
    to_the_end,
    write_all,
)
from backends.nvme.segment_format import (
    CHECKPOINT_FILE,
    IDENTITY_FILE,
    SEGMENTS_DIR,
    Checkpoint,
    encode_checkpoint,
    parse_checkpoint,
    parse_segment_name,
    temporary_writer,
)
from backends.nvme.segment_index import SegmentIndex, key_digest
from backends.nvme.segments import SegmentFiles, SegmentScan
from tiering.errors import CorruptBlockError, InvalidArgumentError
from tiering.tiers.block_record import FORMAT_VERSION

_T = TypeVar("_T")


class BlockingRunner(Protocol):
    """Runs a blocking ``fn(*args)`` off the loop, awaited: ``TierActor.run_blocking``
    (the tier's I/O threads) or :func:`asyncio.to_thread`."""

    def __call__(self, fn: Callable[..., _T], /, *args: Any) -> Awaitable[_T]: ...


async def open_directory(
    root: str, directory: str, namespace: str, *, dir_mode: int, file_mode: int, writer: str
) -> None:
    """Check ``root``, make the namespace's ``directory`` and its subdirectories,
    private, and write or check its identity file, through aiofiles. InvalidArgumentError:
    the root fails :func:`check_root` or is not writable (making those entries fails with
    an error of :data:`UNUSABLE_ROOT_ERRNOS`), a directory is a link or a file, or it
    holds another namespace; OSError: the file system refused another operation.
    """
    await fs_call(check_root, root, create=True, mode=dir_mode)
    try:
        await _make_namespace(
            directory, namespace, dir_mode=dir_mode, file_mode=file_mode, writer=writer
        )
    except OSError as exc:
        if exc.errno not in UNUSABLE_ROOT_ERRNOS:
            raise
        raise InvalidArgumentError(
            f"root: {root!r} is not writable: {exc.strerror} (making the tier's namespace "
            "directory in it)"
        ) from None


async def _make_namespace(
    directory: str, namespace: str, *, dir_mode: int, file_mode: int, writer: str
) -> None:
    with contextlib.suppress(FileExistsError):
        await aiofiles.os.mkdir(directory, dir_mode)
    if await aiofiles.os.path.islink(directory):
        raise InvalidArgumentError(
            f"root: {directory!r} is a symbolic link; the tier never follows one out of its root"
        )
    await fs_call(check_private, "root", directory)
    for sub in (OWNERS_DIR, SEGMENTS_DIR):
        path = os.path.join(directory, sub)
        try:
            await aiofiles.os.mkdir(path, dir_mode)
        except FileExistsError:
            found = await aiofiles.os.stat(path, follow_symlinks=False)
            if not stat.S_ISDIR(found.st_mode):
                raise InvalidArgumentError(
                    f"root: {path!r} is not a directory of the tier (a link or a file)"
                ) from None
    path = os.path.join(directory, IDENTITY_FILE)
    try:
        async with aiofiles.open(path, encoding="utf-8") as existing:
            text = await existing.read()
    except FileNotFoundError:
        identity = {"namespace": namespace, "format_version": FORMAT_VERSION}
        temp = f"{path}.{writer}.tmp"
        async with aiofiles.open(temp, "xb", opener=private_opener(file_mode)) as new:
            await new.write(json.dumps(identity, sort_keys=True).encode())
        await aiofiles.os.replace(temp, path)
        return
    found_namespace = read_identity(text)
    if found_namespace != namespace:
        raise InvalidArgumentError(
            f"{directory!r} holds namespace {found_namespace!r}, not {namespace!r}; "
            "refusing to use it"
        )


def read_identity(text: str) -> str | None:
    """The namespace an identity file's ``text`` names, or None if it names none."""
    try:
        found = json.loads(text).get("namespace")
    except (ValueError, AttributeError):
        return None
    return found if isinstance(found, str) else None


@dataclass(slots=True)
class Recovery:
    """What :func:`recover` found, and the index it built from it."""

    index: SegmentIndex
    recovered: int  # blocks the index holds
    excess: list[str]  # segments over the cap (none of a live writer), to delete
    # What was dropped, by cause: "corrupt segment", "invalid record", "temporary".
    removed: Counter[str] = field(default_factory=Counter)
    checkpoint: Checkpoint | None = None
    checkpoint_note: str | None = None  # why the checkpoint was not used, if it was not
    # The scan of each segment read (beyond the checkpoint; read-only: from record 0).
    scans: dict[str, SegmentScan] = field(default_factory=dict)
    # Segments of dead writers in which neither the header nor a record verifies.
    corrupt: list[str] = field(default_factory=list)
    unreadable: dict[str, str] = field(default_factory=dict)  # segment -> why


async def recover(
    files: SegmentFiles,
    new_index: Callable[[int], SegmentIndex],
    *,
    writer: str,
    read_only: bool = False,
    run_blocking: BlockingRunner = asyncio.to_thread,
) -> Recovery:
    """Read the checkpoint, scan what it does not cover, and build an index with
    ``new_index(records on disk)``, deleting dead writers' checkpoint temporaries and
    segments in which nothing verifies; ``read_only`` (inspect, verify): nothing is
    deleted, and every segment is scanned from record 0. The temporaries and the
    checkpoint file go through aiofiles; the scan and the index are one call of
    ``run_blocking``. Raises OSError when the namespace directory cannot be listed."""
    directory = files.directory
    removed: Counter[str] = Counter()
    for name in await aiofiles.os.listdir(directory):  # dead writers' checkpoint temporaries
        owner = temporary_writer(name, CHECKPOINT_FILE)
        if owner is None or owner == writer or await fs_call(owner_alive, directory, owner):
            continue
        with contextlib.suppress(OSError):
            if not read_only:
                await aiofiles.os.unlink(os.path.join(directory, name))
            removed["temporary"] += 1
    data, note = await _read_checkpoint_file(files)
    return await run_blocking(_rebuild, files, new_index, data, note, removed, read_only)


def _rebuild(
    files: SegmentFiles,
    new_index: Callable[[int], SegmentIndex],
    data: bytes | None,
    note: str | None,
    removed: Counter[str],
    read_only: bool,
) -> Recovery:
    """Blocking, one call: parse the checkpoint's bytes (``data``; None: ``note`` says
    why none), list and scan the segments, delete dead writers' corrupt ones (unless
    ``read_only``), build the index."""
    directory = files.directory
    checkpoint, note = _decode_checkpoint(files, data, note)
    covered = dict(checkpoint.segments) if checkpoint is not None and not read_only else {}
    alive: dict[str, bool] = {}
    on_disk: list[tuple[str, int, float]] = []
    scans: dict[str, SegmentScan] = {}
    corrupt: list[str] = []
    unreadable: dict[str, str] = {}
    protected: set[str] = set()
    for name, size in files.list_segments():
        owner = parse_segment_name(name)[0]  # type: ignore[index]
        if owner not in alive:
            alive[owner] = owner_alive(directory, owner)
        records = files.records_in(size)
        start = min(covered.get(name, 0), records)
        try:
            scan = files.scan(name, start) if start < records or name not in covered else None
            mtime = os.stat(files.path_of(name)).st_mtime
        except OSError as exc:
            unreadable[name] = describe_os_error(exc)
            continue
        if scan is not None and not scan.header_ok and not scan.records and not start:
            if not alive[owner] and (read_only or files.delete([name])):
                corrupt.append(name)
                removed["corrupt segment"] += 1
            continue
        if scan is not None:
            scans[name] = scan
            removed["invalid record"] += scan.invalid + scan.removed
            records = max(records, scan.end)  # a live writer's segment grew meanwhile
        if alive[owner]:
            protected.add(name)
        on_disk.append((name, records, mtime))
    order = {name: i for i, (name, _) in enumerate(checkpoint.segments if checkpoint else [])}
    on_disk.sort(key=lambda item: (order.get(item[0], len(order)), item[2], item[0]))
    listed = [(name, records) for name, records, _ in on_disk]
    index = new_index(sum(records for _, records in listed))
    recovered = index.restore(checkpoint, listed, scans, protected)
    excess = [name for name in index.excess_segments(listed) if name not in protected]
    return Recovery(index, recovered, excess, removed, checkpoint, note, scans, corrupt, unreadable)


def verify_index(
    files: SegmentFiles,
    index: SegmentIndex,
    *,
    on_batch: Callable[[int], None],
    batch_bytes: int = 32 << 20,
) -> tuple[int, dict[tuple[str, int], tuple[bytes | None, str, bool]]]:
    """Read and verify every record ``index`` holds as a load does, ``batch_bytes`` of
    payload at a time, calling ``on_batch(records read)`` after each. Returns the
    records checked and the failures: ``(segment, record)`` -> ``(its header's key or
    None, why, whether the record itself is bad)`` (not a missing or stale one)."""
    snapshot = index.snapshot()
    entries = list(zip(snapshot.locations(), snapshot.digests.tolist(), strict=True))
    size = files.block_bytes
    per_batch = max(1, batch_bytes // size)
    buffer = memoryview(bytearray(per_batch * size))
    failures: dict[tuple[str, int], tuple[bytes | None, str, bool]] = {}
    for start in range(0, len(entries), per_batch):
        batch = entries[start : start + per_batch]
        reads = [
            (*where, buffer[i * size : (i + 1) * size], None) for i, (where, _) in enumerate(batch)
        ]
        for (where, digest), (key, why, missing) in zip(batch, files.read(reads), strict=True):
            if why:
                failures[where] = (key, why, not missing)
            elif key_digest(key) != digest:  # type: ignore[arg-type]
                failures[where] = (key, "stale index entry: the record holds another block", False)
        on_batch(len(batch))
    return len(entries), failures


async def write_checkpoint(
    files: SegmentFiles,
    checkpoint: Checkpoint | Callable[[], Checkpoint],
    *,
    temp_suffix: str,
    run_blocking: BlockingRunner = asyncio.to_thread,
) -> int:
    """Write ``checkpoint`` atomically as ``files``' ``index.ckpt`` and return its size:
    in ONE call of ``run_blocking``, its body encoded and written to a temporary of
    ``temp_suffix`` and synced (``checkpoint`` may be a function making it there: a
    snapshot taken off the loop); then, through aiofiles, the temporary renamed over
    ``index.ckpt`` and the directory synced. Every system call goes through ``files.os``.
    OSError: the old checkpoint stays and the temporary is removed. Once begun it runs
    to its end: cancelled meanwhile, it raises CancelledError after (a rename left
    running could publish a temporary that the next checkpoint is rewriting)."""
    return await to_the_end(_write_checkpoint(files, checkpoint, temp_suffix, run_blocking))


async def _write_checkpoint(
    files: SegmentFiles,
    checkpoint: Checkpoint | Callable[[], Checkpoint],
    temp_suffix: str,
    run_blocking: BlockingRunner,
) -> int:
    temp, size = await run_blocking(_write_temporary, files, checkpoint, temp_suffix)
    try:
        await fs_call(files.os.replace, temp, os.path.join(files.directory, CHECKPOINT_FILE))
        await fs_call(fsync_dir, files.os, files.directory)
    except BaseException:
        with contextlib.suppress(OSError):
            await fs_call(files.os.unlink, temp)
        raise
    return size


def _write_temporary(
    files: SegmentFiles, checkpoint: Checkpoint | Callable[[], Checkpoint], temp_suffix: str
) -> tuple[str, int]:
    """Blocking: the checkpoint's temporary written and synced; its path and size.
    OSError: the temporary is removed."""
    if not isinstance(checkpoint, Checkpoint):
        checkpoint = checkpoint()
    parts = encode_checkpoint(checkpoint, block_bytes=files.block_bytes, ns_digest=files.ns_digest)
    temp = os.path.join(files.directory, f"{CHECKPOINT_FILE}.{temp_suffix}.tmp")
    fd = files.os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, files.file_mode)
    try:
        try:
            write_all(files.os, fd, [memoryview(p) for p in parts], 0)
            files.os.fdatasync(fd)
        finally:
            files.os.close(fd)
    except BaseException:
        with contextlib.suppress(OSError):
            files.os.unlink(temp)
        raise
    return temp, sum(len(p) for p in parts)


async def _read_checkpoint_file(files: SegmentFiles) -> tuple[bytes | None, str | None]:
    """``(the checkpoint file's bytes, None)``, or ``(None, why not)``."""
    path = os.path.join(files.directory, CHECKPOINT_FILE)
    try:
        async with aiofiles.open(path, "rb") as file:
            return await file.read(), None
    except FileNotFoundError:
        return None, "no checkpoint"
    except OSError as exc:
        return None, f"checkpoint unreadable: {describe_os_error(exc)}"


def _decode_checkpoint(
    files: SegmentFiles, data: bytes | None, note: str | None
) -> tuple[Checkpoint | None, str | None]:
    if data is None:
        return None, note
    try:
        return parse_checkpoint(
            data, block_bytes=files.block_bytes, ns_digest=files.ns_digest
        ), None
    except (CorruptBlockError, ValueError, struct.error) as exc:
        return None, f"checkpoint rejected: {exc}"
