"""The reports of ``tiering inspect``, ``verify`` and ``clear`` (docs/nvme.md), made with
the tier's own code: read-only recovery, reads that verify as a load does,
``mark_removed`` and ``tier_file``. Each public function blocks, running its report on an
event loop of its own as the tier runs (docs/architecture.md#where-work-runs)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import os
import re
import threading
import uuid
from collections import Counter
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import aiofiles
import aiofiles.os

from backends.nvme.os_calls import OWNERS_DIR, check_root, describe_os_error, fs_call, owner_alive
from backends.nvme.recovery import Recovery, read_identity, recover, write_checkpoint
from backends.nvme.segment_format import (
    CHECKPOINT_FILE,
    IDENTITY_FILE,
    SEGMENTS_DIR,
    parse_segment_name,
    temporary_writer,
    tier_file,
)
from backends.nvme.segment_index import MAX_RECORDS_PER_SEGMENT, SegmentIndex, key_digest
from backends.nvme.segments import SegmentFiles
from tiering.errors import CorruptBlockError, InvalidArgumentError, TieringError
from tiering.security.encryption import BlockCipher, Keyring, keyring_from
from tiering.tiers.block_record import HEADER_BYTES, decode_header, namespace_digest

_NAMESPACE_DIR = re.compile(r"^(.+)-([0-9a-f]{32})$")
_FOREIGN = "not a file the tier writes (the tier leaves it alone)"
_VERIFY_BATCH_BYTES = 32 << 20  # payload bytes verify reads at a time
_T = TypeVar("_T")


@dataclass(frozen=True, slots=True)
class Finding:
    """One damaged or orphaned thing: ``path`` relative to the root, and why."""

    path: str
    reason: str


@dataclass(frozen=True, slots=True)
class NamespaceReport:
    """What one namespace directory holds (``namespace`` None: its ``NAMESPACE`` file
    is missing or unreadable; ``block_bytes`` None: no block verifies)."""

    directory: str
    namespace: str | None
    digest: str
    layouts: tuple[str, ...]
    block_bytes: int | None
    blocks: int
    payload_bytes: int
    disk_bytes: int
    files: int
    live_owners: tuple[str, ...]
    damaged: tuple[Finding, ...]
    orphaned: tuple[Finding, ...]


@dataclass(frozen=True, slots=True)
class RootReport:
    """What :func:`inspect_root` found: totals, namespaces, the root's other entries."""

    root: str
    blocks: int
    payload_bytes: int
    disk_bytes: int
    damaged: int
    orphaned: int
    namespaces: tuple[NamespaceReport, ...]
    other_entries: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class BadBlock:
    """A block that failed verification (``key`` in hex, None when unreadable)."""

    path: str
    record: int | None
    key: str | None
    reason: str
    removed: bool


@dataclass(frozen=True, slots=True)
class NamespaceVerify:
    """One namespace's verification."""

    directory: str
    namespace: str | None
    checked: int
    bad: tuple[BadBlock, ...]
    live_owners: tuple[str, ...]
    checkpoint_rewritten: bool = False


@dataclass(frozen=True, slots=True)
class VerifyReport:
    """What :func:`verify_root` checked and found, in total and per namespace."""

    root: str
    remove: bool
    checked: int
    bad: int
    removed: int
    namespaces: tuple[NamespaceVerify, ...]

    @property
    def bad_blocks(self) -> tuple[BadBlock, ...]:
        """Every bad block, namespace by namespace."""
        return tuple(b for ns in self.namespaces for b in ns.bad)


@dataclass(frozen=True, slots=True)
class ClearReport:
    """What :func:`clear_root` removed (``dry_run``: would remove), and the files ``left``."""

    root: str
    dry_run: bool
    namespaces: tuple[str, ...]
    files: int
    bytes: int
    left: tuple[str, ...]


@dataclass(slots=True)
class _Namespace:
    root: str
    name: str
    digest: bytes
    namespace: str | None = None
    identity_problem: str | None = None

    @property
    def path(self) -> str:
        return os.path.join(self.root, self.name)

    def rel(self, *parts: str) -> str:
        return os.path.join(self.name, *parts)

    async def live_owners(self) -> tuple[str, ...]:
        names = await _listdir(os.path.join(self.path, OWNERS_DIR))
        owners = [name.removesuffix(".lock") for name in names if name.endswith(".lock")]
        return tuple([owner for owner in owners if await fs_call(owner_alive, self.path, owner)])


def _run(main: Coroutine[Any, Any, _T]) -> _T:
    """``main`` run on an event loop of its own (on a thread of its own if one runs here)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(main)
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="nvme-inspect") as pool:
        return pool.submit(asyncio.run, main).result()


async def _open_root(
    root: str | os.PathLike[str], wanted: str | None, refuse_if_live: str | None = None
) -> tuple[str, list[_Namespace], list[str]]:
    """The root's path, the namespace directories ``wanted`` names (:func:`_select`)
    and the root's other entries. InvalidArgumentError: ``root`` fails :func:`check_root`,
    cannot be listed, or is neither empty nor holds a namespace; with ``refuse_if_live``
    (an action), TieringError when a running tier holds one."""
    path = os.fspath(root)
    try:
        await fs_call(check_root, path, option="ROOT")
        names = sorted(await aiofiles.os.listdir(path))
    except OSError as exc:
        raise InvalidArgumentError(
            f"ROOT: {path!r} cannot be read: {describe_os_error(exc)}"
        ) from None
    namespaces: list[_Namespace] = []
    others: list[str] = []
    for name in names:
        match = _NAMESPACE_DIR.match(name)
        if match and await fs_call(_is_namespace_dir, os.path.join(path, name)):
            namespaces.append(await _read_identity(path, name, bytes.fromhex(match.group(2))))
        else:
            others.append(name)
    if others and not namespaces:
        raise InvalidArgumentError(
            f"ROOT: {path!r} is not an NVMe root: it holds no namespace directory "
            "(<name>-<32 hex digits> with a NAMESPACE file, owners/ or segments/)"
        )
    selected = _select(namespaces, wanted)
    for ns in selected if refuse_if_live else ():
        live = await ns.live_owners()
        if live:
            raise TieringError(
                f"refusing to {refuse_if_live}: namespace {ns.namespace or ns.name!r} is in "
                f"use by {len(live)} running tier(s) (owners/{live[0]}.lock is held); "
                "stop them first. Nothing was changed"
            )
    return path, selected, others


def _is_namespace_dir(path: str) -> bool:
    """Whether ``path`` is a directory, not a link, holding an entry of the tier's."""
    if not os.path.isdir(path) or os.path.islink(path):
        return False
    return any(
        os.path.lexists(os.path.join(path, p)) for p in (IDENTITY_FILE, OWNERS_DIR, SEGMENTS_DIR)
    )


async def _read_identity(root: str, name: str, digest: bytes) -> _Namespace:
    ns = _Namespace(root, name, digest)
    try:
        found = await read_identity(ns.path)
    except FileNotFoundError:
        ns.identity_problem = "no NAMESPACE file (a tier start was cut short, or it was removed)"
    except (OSError, ValueError) as exc:
        ns.identity_problem = f"NAMESPACE file unreadable: {exc}"
    else:
        if found is not None and namespace_digest(found) == digest:
            ns.namespace = found
        else:
            ns.identity_problem = (
                f"NAMESPACE file names {found!r}, not the directory's namespace; a tier refuses it"
            )
    return ns


def _select(namespaces: list[_Namespace], wanted: str | None) -> list[_Namespace]:
    """The namespaces ``wanted`` names (its string, directory name, or a digest prefix of
    4+ hex digits; None: all); InvalidArgumentError when none or several match."""
    if wanted is None:
        return namespaces
    exact = [ns for ns in namespaces if wanted in (ns.namespace, ns.name)]
    if exact:
        return exact
    low = wanted.lower()
    by_digest = []
    if len(low) >= 4 and re.fullmatch(r"[0-9a-f]+", low):
        by_digest = [ns for ns in namespaces if ns.digest.hex().startswith(low)]
    if len(by_digest) == 1:
        return by_digest
    if by_digest:
        raise InvalidArgumentError(
            f"argument --namespace: {wanted!r} matches {len(by_digest)} namespaces; "
            "give more digits"
        )
    known = ", ".join(f"{ns.namespace or ns.name} ({ns.digest.hex()[:12]})" for ns in namespaces)
    raise InvalidArgumentError(
        f"argument --namespace: no namespace {wanted!r} in the root; it holds: {known or 'none'}"
    )


@contextlib.contextmanager
def _os_errors(root: str) -> Iterator[None]:
    """An OSError while reading the root becomes a TieringError naming it."""
    try:
        yield
    except OSError as exc:
        where = f" ({exc.filename})" if exc.filename else ""
        raise TieringError(f"cannot read {root!r}{where}: {describe_os_error(exc)}") from None


def _files_under(path: str) -> list[tuple[str, int]]:
    """``(path, size)`` of every non-directory below ``path`` (links not followed)."""
    found = []
    for directory, dirs, files in os.walk(path):
        for name in files + [d for d in dirs if os.path.islink(os.path.join(directory, d))]:
            full = os.path.join(directory, name)
            with contextlib.suppress(OSError):
                found.append((full, os.lstat(full).st_size))
    return found


async def _listdir(path: str) -> list[str]:
    """The names in ``path``, sorted; none if it is missing or not a directory."""
    try:
        return sorted(await aiofiles.os.listdir(path))
    except (FileNotFoundError, NotADirectoryError):
        return []


_LEFTOVER = {
    "checkpoint temporary": "temporary checkpoint of a writer that is gone",
    "identity temporary": "temporary NAMESPACE file left by a tier start",
    "probe": "O_DIRECT probe file left by a tier start",
    "lock": "lock file of a writer that is gone",
}


@dataclass(slots=True)
class _Segments:
    """A namespace's segments: read-only recovery (None: record size unknown), findings;
    ``sealed``: some segment's first record is encrypted."""

    present: bool
    files: SegmentFiles | None = None
    found: Recovery | None = None
    sealed: bool = False
    damaged: list[Finding] = field(default_factory=list)
    orphaned: list[Finding] = field(default_factory=list)

    @property
    def blocks(self) -> int:
        return 0 if self.found is None else len(self.found.index)


async def _segments(ns: _Namespace, cipher: BlockCipher | None = None) -> _Segments:
    """The segments of ``ns``, recovered by the tier's code (reads open under ``cipher``).
    The record size is the most common payload length of the segments' first records
    that verify; without one, every segment is damaged."""
    seg_dir = os.path.join(ns.path, SEGMENTS_DIR)
    state = _Segments(present=await aiofiles.os.path.isdir(seg_dir))
    damaged, orphaned = state.damaged, state.orphaned
    names: list[str] = []
    sizes: Counter[int] = Counter()

    def first_records() -> None:  # blocking, a header read per segment
        try:
            entries = sorted(os.scandir(seg_dir), key=lambda e: e.name) if state.present else []
        except (FileNotFoundError, NotADirectoryError):  # removed since (a live root)
            entries = []
        for entry in entries:
            if parse_segment_name(entry.name) is None or not entry.is_file(follow_symlinks=False):
                orphaned.append(Finding(ns.rel(SEGMENTS_DIR, entry.name), _FOREIGN))
                continue
            names.append(entry.name)
            with contextlib.suppress(OSError, CorruptBlockError), open(entry.path, "rb") as file:
                # Record 0 sits right after the segment header whatever the record size.
                header = decode_header(os.pread(file.fileno(), HEADER_BYTES, HEADER_BYTES))
                if header.namespace_digest == ns.digest:
                    sizes[header.payload_bytes] += 1
                    state.sealed = state.sealed or header.seal is not None

    await asyncio.to_thread(first_records)
    if not sizes:
        why = "no segment's first record verifies: record size unknown"
        damaged.extend(Finding(ns.rel(SEGMENTS_DIR, name), why) for name in names)
        return state
    size = sizes.most_common(1)[0][0]
    files = SegmentFiles(
        ns.path, block_bytes=size, ns_digest=ns.digest, gil_pause_bytes=0, cipher=cipher
    )
    state.files = files

    def new_index(records: int) -> SegmentIndex:
        # As large as what is on disk: every block the tier would index, whatever its cap.
        return SegmentIndex(
            max(1, records), records_per_segment=MAX_RECORDS_PER_SEGMENT, writer="0"
        )

    found = state.found = await recover(files, new_index, writer=uuid.uuid4().hex, read_only=True)
    if found.checkpoint is None and found.checkpoint_note != "no checkpoint":
        why = f"{found.checkpoint_note} (the tier scans every segment instead)"
        damaged.append(Finding(ns.rel(CHECKPOINT_FILE), why))
    for name, size in found.listed:
        rel, records = ns.rel(SEGMENTS_DIR, name), files.records_in(size)
        scan = found.scans.get(name)
        if scan is None:  # unreadable, or corrupt
            if name in found.unreadable:
                damaged.append(Finding(rel, f"unreadable: {found.unreadable[name]}"))
            elif name in found.corrupt:
                why = "neither its header nor any record verifies (removed at tier start)"
                damaged.append(Finding(rel, why))
            continue
        if scan.invalid:
            why = f"{scan.invalid} of {records} record slots do not verify (torn or damaged"
            damaged.append(Finding(rel, f"{why}; their space returns with the segment)"))
        if scan.removed:
            why = f"{scan.removed} of {records} record slots removed by `tiering verify --remove`"
            orphaned.append(Finding(rel, f"{why} (their space returns with the segment)"))
        if size > HEADER_BYTES and (size - HEADER_BYTES) % files.record_bytes:
            damaged.append(Finding(rel, "ends in a partial record (a torn write)"))
    live = {name for name, _ in found.index.snapshot().locations()}
    why = "holds no block the index would serve (evicted first by the tier)"
    idle = [name for name in found.index.segments if name not in live]
    orphaned += [Finding(ns.rel(SEGMENTS_DIR, name), why) for name in idle]
    return state


async def _namespace_orphans(ns: _Namespace) -> list[Finding]:
    """Leftovers at the top of the namespace directory and in ``owners/``."""
    found: list[Finding] = []
    for top in ("", OWNERS_DIR):
        for name in await _listdir(os.path.join(ns.path, top)):
            parts = (top, name) if top else (name,)
            if parts in ((OWNERS_DIR,), (SEGMENTS_DIR,)):
                continue
            kind = tier_file(parts)
            if kind in ("lock", "checkpoint temporary"):
                owner = temporary_writer(name, CHECKPOINT_FILE) or name.removesuffix(".lock")
                if await fs_call(owner_alive, ns.path, owner):
                    continue
            if kind is None:
                found.append(Finding(ns.rel(*parts), _FOREIGN))
            elif kind in _LEFTOVER:
                found.append(Finding(ns.rel(*parts), _LEFTOVER[kind]))
    return found


async def _report(ns: _Namespace, segments: _Segments) -> NamespaceReport:
    damaged = [Finding(ns.rel(IDENTITY_FILE), ns.identity_problem)] if ns.identity_problem else []
    block_bytes = None if segments.files is None else segments.files.block_bytes
    sizes = [size for _, size in await asyncio.to_thread(_files_under, ns.path)]
    return NamespaceReport(
        directory=ns.name,
        namespace=ns.namespace,
        digest=ns.digest.hex(),
        layouts=("segments",) if segments.present else (),
        block_bytes=block_bytes,
        blocks=segments.blocks,
        payload_bytes=segments.blocks * (block_bytes or 0),
        disk_bytes=sum(sizes),
        files=len(sizes),
        live_owners=await ns.live_owners(),
        damaged=tuple(damaged + segments.damaged),
        orphaned=tuple(await _namespace_orphans(ns) + segments.orphaned),
    )


def inspect_root(root: str | os.PathLike[str], *, namespace: str | None = None) -> RootReport:
    """What ``root`` (or one ``namespace``, as :func:`_select` matches it) holds, from
    every record header, no payload; changes nothing on disk. InvalidArgumentError as
    :func:`_open_root`; TieringError for an OS error while reading."""

    async def inspect() -> RootReport:
        path, selected, others = await _open_root(root, namespace)
        with _os_errors(path):
            reports = tuple([await _report(ns, await _segments(ns)) for ns in selected])
        sizes = (
            sum(getattr(r, n) for r in reports) for n in ("blocks", "payload_bytes", "disk_bytes")
        )
        findings = (sum(len(getattr(r, n)) for r in reports) for n in ("damaged", "orphaned"))
        return RootReport(path, *sizes, *findings, reports, tuple(others))

    return _run(inspect())


def verify_root(
    root: str | os.PathLike[str],
    *,
    remove: bool,
    namespace: str | None = None,
    encryption: Keyring | str | None = None,
    on_progress: Callable[[int, int], None] | None = None,
) -> VerifyReport:
    """Check every block the rebuilt index of ``root`` (or one ``namespace``) holds as a
    load does, encrypted ones under ``encryption`` (without it they are bad). With
    ``remove``, a bad record is marked removed and leaves the checkpoint; one that could
    not be is reported not removed. ``on_progress(checked, total)`` from ``(0, total)``.
    InvalidArgumentError as :func:`inspect_root`; TieringError for an OS error, or with
    ``remove`` (nothing changed) a live owner or encrypted blocks and no keyring."""
    keyring = keyring_from(encryption, option="encryption")
    cipher = None if keyring is None else BlockCipher(keyring)

    async def verify() -> VerifyReport:
        action = "remove bad blocks" if remove else None
        path, selected, _ = await _open_root(root, namespace, action)
        with _os_errors(path):
            states = [(ns, await _segments(ns, cipher)) for ns in selected]
            for ns, state in states:
                if remove and keyring is None and state.sealed:
                    raise TieringError(
                        f"{ns.path}: holds encrypted blocks; without their keyring "
                        "(--encryption) none can be checked, so none is removed"
                    )
            total = sum(state.blocks for _, state in states)
            done = 0

            def advance(blocks: int) -> None:
                nonlocal done
                done += blocks
                if on_progress is not None:
                    on_progress(done, total)

            advance(0)
            results = tuple([await _verify(ns, state, remove, advance) for ns, state in states])
        bad = [b for ns in results for b in ns.bad]
        checked = sum(ns.checked for ns in results)
        return VerifyReport(path, remove, checked, len(bad), sum(b.removed for b in bad), results)

    return _run(verify())


async def _verify(
    ns: _Namespace, state: _Segments, remove: bool, advance: Callable[[int], None]
) -> NamespaceVerify:
    """Verify ``ns``'s blocks, a batch at a time, calling ``advance(records read)`` after
    each; with ``remove``, mark the bad ones and drop them from the checkpoint. Cancelled,
    the reads stop after the batch in flight."""
    files, found = state.files, state.found
    if files is None or found is None or not len(found.index):
        return NamespaceVerify(ns.name, ns.namespace, 0, (), await ns.live_owners())
    # (segment, record) -> (its header's key or None, why, whether the record itself is
    # bad, not missing or stale)
    failures: dict[tuple[str, int], tuple[bytes | None, str, bool]] = {}
    stop = threading.Event()

    def read_all() -> int:  # blocking: every record the index holds; how many
        snapshot = found.index.snapshot()
        entries = list(zip(snapshot.locations(), snapshot.digests.tolist(), strict=True))
        size = files.block_bytes
        per_batch = max(1, _VERIFY_BATCH_BYTES // size)
        buffer = memoryview(bytearray(per_batch * size))
        for start in range(0, len(entries), per_batch):
            batch = entries[start : start + per_batch]
            reads = [
                (*where, buffer[i * size : (i + 1) * size], None)
                for i, (where, _) in enumerate(batch)
            ]
            for (where, digest), (key, why, missing) in zip(batch, files.read(reads), strict=True):
                if why:
                    failures[where] = (key, why, not missing)
                elif key_digest(key) != digest:  # type: ignore[arg-type]
                    stale = "stale index entry: the record holds another block"
                    failures[where] = (key, stale, False)
            if stop.is_set():  # the caller was cancelled (Ctrl-C): its result is not awaited
                break
            advance(len(batch))
        return len(entries)

    try:
        checked = await asyncio.to_thread(read_all)
    except asyncio.CancelledError:
        stop.set()
        raise
    marked: set[tuple[str, int]] = set()
    dropped: set[tuple[str, int]] = set()
    listed = set() if found.checkpoint is None else set(found.checkpoint.locations())
    if remove and failures:
        bad_records = [where for where, (_, _, bad) in failures.items() if bad]
        marked = await asyncio.to_thread(files.mark_removed, bad_records)
        if listed & failures.keys():
            with contextlib.suppress(OSError):  # the old checkpoint then stays
                # The temporary carries an id no tier holds a lock for: if this process
                # dies before the rename, a tier start removes it as a dead writer's.
                await write_checkpoint(
                    files,
                    functools.partial(found.checkpoint.without, set(failures)),  # type: ignore[union-attr]
                    temp_suffix=uuid.uuid4().hex,
                )
                dropped = listed & failures.keys()
    bad = tuple(
        BadBlock(
            ns.rel(SEGMENTS_DIR, where[0]),
            where[1],
            None if key is None else key.hex(),
            reason,
            remove and (where not in listed or where in dropped) and (where in marked or not mark),
        )
        for where, (key, reason, mark) in sorted(failures.items())
    )
    owners = await ns.live_owners()
    return NamespaceVerify(ns.name, ns.namespace, checked, bad, owners, bool(dropped))


def clear_root(
    root: str | os.PathLike[str], *, namespace: str | None, dry_run: bool = False
) -> ClearReport:
    """Remove the files the tier writes (:func:`tier_file`) in ``root``'s namespace
    directories (or one ``namespace``'s), then the directories left empty; other files
    stay, listed in ``left``. Links are removed, never followed. ``dry_run``: no change.
    InvalidArgumentError as :func:`inspect_root`; TieringError for a live owner (nothing
    changed) or a file that could not be removed (named; what went before is gone)."""

    async def clear() -> ClearReport:
        path, selected, _ = await _open_root(root, namespace, None if dry_run else "clear")
        files = nbytes = 0
        left: list[str] = []
        for ns in selected:
            with _os_errors(path):
                listing = sorted(await asyncio.to_thread(_files_under, ns.path))
            doomed: list[tuple[str, int]] = []
            for full, size in listing:
                if tier_file(tuple(_relative(full, ns.path).split(os.sep))):
                    doomed.append((full, size))
                else:
                    left.append(_relative(full, path))
            # The identity file goes last: until then the directory is still recognisably
            # a namespace, so an interrupted clear can be run again.
            doomed.sort(key=lambda item: os.path.basename(item[0]) == IDENTITY_FILE)
            files += len(doomed)
            nbytes += sum(size for _, size in doomed)
            if dry_run:
                continue
            for full, _ in doomed:
                try:
                    await aiofiles.os.unlink(full)
                except FileNotFoundError:
                    continue
                except OSError as exc:
                    raise TieringError(
                        f"could not remove {_relative(full, path)!r}: {describe_os_error(exc)}"
                    ) from None
            # Each directory before its parent (the walk runs on the thread).
            for directory, _, _ in await asyncio.to_thread(list, os.walk(ns.path, topdown=False)):
                with contextlib.suppress(OSError):
                    await aiofiles.os.rmdir(directory)  # only succeeds once empty
        return ClearReport(
            path, dry_run, tuple(ns.name for ns in selected), files, nbytes, tuple(left)
        )

    return _run(clear())


def _relative(path: str, base: str) -> str:
    """``path``, found by walking ``base``, relative to ``base`` (no system call)."""
    return path.removeprefix(os.path.join(base, ""))
