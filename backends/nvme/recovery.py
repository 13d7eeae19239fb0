"""Opening an NVMe namespace directory, recovering its index from the checkpoint and a
scan of what came after it, and writing the checkpoint (docs/nvme.md). A batch of system
calls is ONE call of the caller's ``run_blocking``; the operations around it go through
aiofiles (docs/architecture.md#where-work-runs)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import stat
import struct
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

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
    SegmentScan,
    encode_checkpoint,
    parse_checkpoint,
    parse_segment_name,
    temporary_name,
    temporary_writer,
)
from backends.nvme.segment_index import SegmentIndex
from backends.nvme.segments import SegmentFiles
from tiering.errors import CorruptBlockError, InvalidArgumentError
from tiering.tiers.block_record import FORMAT_VERSION

# Runs ``fn(*args)`` off the loop: ``TierActor.run_blocking`` or :func:`asyncio.to_thread`.
BlockingRunner = Callable[..., Awaitable[Any]]


async def open_directory(
    root: str, directory: str, namespace: str, *, dir_mode: int, file_mode: int, writer: str
) -> None:
    """Check ``root``, make the namespace's private ``directory`` and its subdirectories,
    and write or check its identity file. InvalidArgumentError: the root fails
    :func:`check_root` or is not writable, a directory is a link or a file, or it holds
    another namespace; OSError: the file system refused another operation."""
    await fs_call(check_root, root, create=True, mode=dir_mode)
    try:
        with contextlib.suppress(FileExistsError):
            await aiofiles.os.mkdir(directory, dir_mode)
        if await aiofiles.os.path.islink(directory):
            raise InvalidArgumentError(
                f"root: {directory!r} is a symbolic link; the tier never follows one out of "
                "its root"
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
        try:
            found_namespace = await read_identity(directory)
        except FileNotFoundError:
            identity = {"namespace": namespace, "format_version": FORMAT_VERSION}
            path = os.path.join(directory, IDENTITY_FILE)
            temp = temporary_name(path, writer)
            async with aiofiles.open(temp, "xb", opener=private_opener(file_mode)) as new:
                await new.write(json.dumps(identity, sort_keys=True).encode())
            await aiofiles.os.replace(temp, path)
            return
        if found_namespace != namespace:
            raise InvalidArgumentError(
                f"{directory!r} holds namespace {found_namespace!r}, not {namespace!r}; "
                "refusing to use it"
            )
    except OSError as exc:
        if exc.errno not in UNUSABLE_ROOT_ERRNOS:
            raise
        raise InvalidArgumentError(
            f"root: {root!r} is not writable: {exc.strerror} (making the tier's namespace "
            "directory in it)"
        ) from None


async def read_identity(directory: str) -> str | None:
    """The namespace the identity file of ``directory`` names, or None if it names none;
    raises what reading it raises (FileNotFoundError: there is none)."""
    async with aiofiles.open(os.path.join(directory, IDENTITY_FILE), encoding="utf-8") as file:
        text = await file.read()
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
    listed: list[tuple[str, int]] = field(default_factory=list)  # segments (name, bytes)
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
    segments in which nothing verifies; ``read_only``: nothing is deleted, every segment
    is scanned from record 0. OSError when the namespace directory cannot be listed."""
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
    data, note = None, "no checkpoint"
    try:
        async with aiofiles.open(os.path.join(directory, CHECKPOINT_FILE), "rb") as file:
            data, note = await file.read(), None
    except FileNotFoundError:
        pass
    except OSError as exc:
        note = f"checkpoint unreadable: {describe_os_error(exc)}"
    return await run_blocking(_rebuild, files, new_index, data, note, removed, read_only)


def _rebuild(
    files: SegmentFiles,
    new_index: Callable[[int], SegmentIndex],
    data: bytes | None,
    note: str | None,
    removed: Counter[str],
    read_only: bool,
) -> Recovery:
    checkpoint = None
    if data is not None:
        try:
            checkpoint = parse_checkpoint(
                data, block_bytes=files.block_bytes, ns_digest=files.ns_digest
            )
        except (CorruptBlockError, ValueError, struct.error) as exc:
            note = f"checkpoint rejected: {exc}"
    covered = dict(checkpoint.segments) if checkpoint is not None and not read_only else {}
    listed = files.list_segments()
    scans: dict[str, SegmentScan] = {}
    alive = functools.cache(functools.partial(owner_alive, files.directory))
    corrupt: list[str] = []
    unreadable: dict[str, str] = {}
    on_disk: list[tuple[str, int, float]] = []
    protected: set[str] = set()
    for name, size in listed:
        owner = parse_segment_name(name)[0]  # type: ignore[index]
        records = files.records_in(size)
        start = min(covered.get(name, 0), records)
        try:
            scan = files.scan(name, start) if start < records or name not in covered else None
            mtime = os.stat(files.path_of(name)).st_mtime
        except OSError as exc:
            unreadable[name] = describe_os_error(exc)
            continue
        if scan is not None and not scan.header_ok and not scan.records and not start:
            if not alive(owner) and (read_only or files.delete([name])):
                corrupt.append(name)
                removed["corrupt segment"] += 1
            continue
        if scan is not None:
            scans[name] = scan
            removed["invalid record"] += scan.invalid + scan.removed
            records = max(records, scan.end)  # a live writer's segment grew meanwhile
        if alive(owner):
            protected.add(name)
        on_disk.append((name, records, mtime))
    order = {name: i for i, (name, _) in enumerate(checkpoint.segments if checkpoint else [])}
    on_disk.sort(key=lambda item: (order.get(item[0], len(order)), item[2], item[0]))
    ordered = [(name, records) for name, records, _ in on_disk]
    index = new_index(sum(records for _, records in ordered))
    recovered = index.restore(checkpoint, ordered, scans, protected)
    excess = [name for name in index.excess_segments(ordered) if name not in protected]
    return Recovery(
        index, recovered, excess, removed, checkpoint, note, listed, scans, corrupt, unreadable
    )


async def write_checkpoint(
    files: SegmentFiles,
    checkpoint: Checkpoint | Callable[[], Checkpoint],
    *,
    temp_suffix: str,
    run_blocking: BlockingRunner = asyncio.to_thread,
) -> int:
    """Write ``checkpoint`` (or what a function makes, off the loop) atomically as
    ``files``' ``index.ckpt`` through ``files.os``, its temporary named by ``temp_suffix``;
    returns its size. OSError: the old checkpoint stays, the temporary is removed. Once
    begun it runs to its end (a rename left running could publish a temporary that the
    next checkpoint is rewriting): cancelled meanwhile, it raises CancelledError after."""

    async def write() -> int:
        temp, size = await run_blocking(_write_temporary, files, checkpoint, temp_suffix)
        try:
            await fs_call(files.os.replace, temp, os.path.join(files.directory, CHECKPOINT_FILE))
            await fs_call(fsync_dir, files.os, files.directory)
        except BaseException:
            with contextlib.suppress(OSError):
                await fs_call(files.os.unlink, temp)
            raise
        return size

    return await to_the_end(write())


def _write_temporary(
    files: SegmentFiles, checkpoint: Checkpoint | Callable[[], Checkpoint], temp_suffix: str
) -> tuple[str, int]:
    if not isinstance(checkpoint, Checkpoint):
        checkpoint = checkpoint()
    parts = encode_checkpoint(checkpoint, block_bytes=files.block_bytes, ns_digest=files.ns_digest)
    temp = os.path.join(files.directory, temporary_name(CHECKPOINT_FILE, temp_suffix))
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
