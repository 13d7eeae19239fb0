"""Looking into an NVMe tier's root from outside the tier: inspect, verify, clear.

Synchronous and independent of any event loop; the ``tiering inspect``, ``verify`` and
``clear`` commands are thin shells around :func:`inspect_root`, :func:`verify_root` and
:func:`clear_root`.

What counts as what is the tier's own view, computed with the tier's own code:

* **blocks** are what a tier started now would index: the entries of a
  :class:`~backends.nvme_segment_index.SegmentIndex` rebuilt with ``restore`` from the
  checkpoint and a scan of every segment (as the tier's start-up does).
* **damaged** is what the tier's recovery drops or cannot use: record slots of a
  segment whose header does not verify (but not those :func:`verify_root` marked
  removed), a segment with neither a valid header
  nor a valid record, a rejected checkpoint, a ``NAMESPACE`` file that does not name
  the directory's namespace.
* **orphaned** is what nobody will read again: temporary files and lock files of writers
  that are gone, segments holding no block the index would serve, record slots
  :func:`verify_root` marked removed, leftover O_DIRECT probes, and files with names
  the tier never writes (which the tier leaves alone).

The record size of a namespace is not stored apart from its blocks: it is read from the
block headers (the most common payload length among those that verify). A namespace
none of whose blocks verifies has no known record size; its files are then reported
damaged as a whole.

Concurrency: every tier holds ``flock`` on ``owners/<id>.lock`` while it runs.
:func:`inspect_root` and :func:`verify_root` without ``remove`` only read and may run
next to a live tier; what they report about that namespace is then a snapshot taken
while it changes (a record being written can look torn), and each namespace report says
which owners were alive. :func:`verify_root` with ``remove`` and :func:`clear_root`
refuse (:class:`~tiering.errors.TieringError`, nothing changed) a namespace with a live
owner. Tiers do not exclude one another, so there is no lock to take: a tier that
starts after that check and before the work ends races with it, as two engines sharing
a root would not; stop the engines first.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from backends.block_record import HEADER_BYTES, BlockHeader, decode_header, namespace_digest
from backends.nvme_os import OWNERS_DIR, check_root, describe_os_error, owner_alive
from backends.nvme_recovery import IDENTITY_FILE, recover
from backends.nvme_sealing import PayloadSealer
from backends.nvme_segment_format import (
    CHECKPOINT_FILE,
    SEGMENTS_DIR,
    Checkpoint,
    parse_segment_name,
)
from backends.nvme_segment_index import SegmentIndex, key_digest
from backends.nvme_segments import SegmentFiles
from backends.nvme_space import MAX_RECORDS_PER_SEGMENT
from tiering.encryption import BlockCipher, Keyring, keyring_from
from tiering.errors import CorruptBlockError, InvalidArgumentError, TieringError

_NAMESPACE_DIR = re.compile(r"^(.+)-([0-9a-f]{32})$")
TEMP_SUFFIX = ".tmp"
_PROBE_PREFIX = ".odirect-probe."
_READ_BATCH_BYTES = 32 << 20
"""The most payload bytes one verification read holds in memory."""
_REMOVED_MARK = b"KVTIER removed by verify\n"
"""How the header page that ``verify --remove`` writes over a bad segment record begins.
It is no block header (the tier's scan skips the slot, as it skips a torn one), and
``inspect`` tells it from damage: the slot is counted removed, not damaged."""

LAYOUT_SEGMENTS = "segments"


# -- reports ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Finding:
    """One damaged or orphaned thing: ``path`` relative to the root, and why."""

    path: str
    reason: str


@dataclass(frozen=True, slots=True)
class NamespaceReport:
    """What one namespace directory holds.

    ``namespace`` is the identity its ``NAMESPACE`` file names (None when that file is
    missing or unreadable); ``digest`` the 32 hex digits in the directory's name (what
    ``--namespace`` accepts a prefix of). ``layouts`` lists the layouts present;
    ``block_bytes`` is the payload length of its blocks (None when no block verifies).
    ``payload_bytes`` is ``blocks * block_bytes``; ``disk_bytes`` the size of every file
    in the directory. ``live_owners`` are the tiers running on it now.
    """

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

    @property
    def label(self) -> str:
        """The namespace string, or the directory name when it is unknown."""
        return self.namespace if self.namespace is not None else self.directory


@dataclass(frozen=True, slots=True)
class RootReport:
    """What :func:`inspect_root` found: totals over the namespaces, the namespaces (by
    directory name), and the root's other entries (never touched by the tier or these
    tools). ``damaged`` and ``orphaned`` count findings."""

    root: str
    blocks: int
    payload_bytes: int
    disk_bytes: int
    damaged: int
    orphaned: int
    namespaces: tuple[NamespaceReport, ...]
    other_entries: tuple[str, ...]

    @classmethod
    def of(
        cls, root: str, namespaces: tuple[NamespaceReport, ...], others: tuple[str, ...]
    ) -> RootReport:
        """The report of ``namespaces``, with their totals."""
        return cls(
            root,
            sum(ns.blocks for ns in namespaces),
            sum(ns.payload_bytes for ns in namespaces),
            sum(ns.disk_bytes for ns in namespaces),
            sum(len(ns.damaged) for ns in namespaces),
            sum(len(ns.orphaned) for ns in namespaces),
            namespaces,
            others,
        )


@dataclass(frozen=True, slots=True)
class BadBlock:
    """A block that failed verification: ``path`` relative to the root, the record
    number for a segment, the key in hex when its header could be read, why it failed,
    and whether it was removed (or marked bad)."""

    path: str
    record: int | None
    key: str | None
    reason: str
    removed: bool


@dataclass(frozen=True, slots=True)
class NamespaceVerify:
    """One namespace's verification: blocks checked, the bad ones, live owners seen."""

    directory: str
    namespace: str | None
    checked: int
    bad: tuple[BadBlock, ...]
    live_owners: tuple[str, ...]
    checkpoint_rewritten: bool = False


@dataclass(frozen=True, slots=True)
class VerifyReport:
    """What :func:`verify_root` checked and found: blocks checked, bad, and of those
    removed (``remove``: bad blocks were asked to be removed), per namespace."""

    root: str
    remove: bool
    checked: int
    bad: int
    removed: int
    namespaces: tuple[NamespaceVerify, ...]

    @classmethod
    def of(cls, root: str, remove: bool, namespaces: tuple[NamespaceVerify, ...]) -> VerifyReport:
        """The report of ``namespaces``, with their totals."""
        bad = [b for ns in namespaces for b in ns.bad]
        checked = sum(ns.checked for ns in namespaces)
        return cls(root, remove, checked, len(bad), sum(b.removed for b in bad), namespaces)

    @property
    def bad_blocks(self) -> tuple[BadBlock, ...]:
        """Every bad block, namespace by namespace."""
        return tuple(b for ns in self.namespaces for b in ns.bad)


@dataclass(frozen=True, slots=True)
class ClearReport:
    """What :func:`clear_root` removed (or, with ``dry_run``, would remove): the
    namespace directories, how many files and bytes, and the files it left because the
    tier never writes such names (their directories stay too)."""

    root: str
    dry_run: bool
    namespaces: tuple[str, ...]
    files: int
    bytes: int
    left: tuple[str, ...]


# -- the root and its namespace directories -----------------------------------------------


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


def _open_root(root: str | os.PathLike[str]) -> tuple[str, list[_Namespace], list[str]]:
    """The root's path, its namespace directories (name order) and its other entries.

    Raises:
        InvalidArgumentError: ``root`` fails the tier's own :func:`check_root` (it does
            not exist, is not a directory, belongs to another user or others may write
            to it), cannot be listed, or is neither empty nor holds a namespace
            directory.
    """
    path = os.fspath(root)
    try:
        check_root(path, option="ROOT")
        entries = sorted(os.scandir(path), key=lambda e: e.name)
    except OSError as exc:
        raise InvalidArgumentError(
            f"ROOT: {path!r} cannot be read: {describe_os_error(exc)}"
        ) from None
    namespaces: list[_Namespace] = []
    others: list[str] = []
    for entry in entries:
        match = _NAMESPACE_DIR.match(entry.name)
        if match and entry.is_dir(follow_symlinks=False) and _looks_like_namespace(entry.path):
            namespaces.append(_read_identity(path, entry.name, bytes.fromhex(match.group(2))))
        else:
            others.append(entry.name)
    if others and not namespaces:
        raise InvalidArgumentError(
            f"ROOT: {path!r} is not an NVMe root: it holds no namespace directory "
            "(<name>-<32 hex digits> with a NAMESPACE file, owners/ or segments/)"
        )
    return path, namespaces, others


def _looks_like_namespace(path: str) -> bool:
    return any(
        os.path.lexists(os.path.join(path, part))
        for part in (IDENTITY_FILE, OWNERS_DIR, SEGMENTS_DIR)
    )


def _read_identity(root: str, name: str, digest: bytes) -> _Namespace:
    ns = _Namespace(root, name, digest)
    try:
        with open(os.path.join(root, name, IDENTITY_FILE), encoding="utf-8") as file:
            found = json.load(file).get("namespace")
    except FileNotFoundError:
        ns.identity_problem = "no NAMESPACE file (a tier start was cut short, or it was removed)"
        return ns
    except (OSError, ValueError, AttributeError) as exc:
        ns.identity_problem = f"NAMESPACE file unreadable: {exc}"
        return ns
    if not isinstance(found, str) or namespace_digest(found) != digest:
        ns.identity_problem = (
            f"NAMESPACE file names {found!r}, not the directory's namespace; a tier refuses it"
        )
        return ns
    ns.namespace = found
    return ns


def _select(namespaces: list[_Namespace], wanted: str | None) -> list[_Namespace]:
    """The namespaces ``wanted`` names: the namespace string, the directory name, or a
    prefix (at least 4 hex digits) of the digest; all of them for None.

    Raises:
        InvalidArgumentError: nothing or more than one namespace matches.
    """
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
    known = ", ".join(f"{ns.namespace or ns.name} ({ns.digest.hex()[:12]})" for ns in namespaces)
    if by_digest:
        raise InvalidArgumentError(
            f"argument --namespace: {wanted!r} matches {len(by_digest)} namespaces; "
            "give more digits"
        )
    raise InvalidArgumentError(
        f"argument --namespace: no namespace {wanted!r} in the root; it holds: {known or 'none'}"
    )


def _live_owners(ns: _Namespace) -> tuple[str, ...]:
    owners = os.path.join(ns.path, OWNERS_DIR)
    try:
        names = sorted(entry.name for entry in os.scandir(owners))
    except OSError:
        return ()
    return tuple(
        name.removesuffix(".lock")
        for name in names
        if name.endswith(".lock") and owner_alive(ns.path, name.removesuffix(".lock"))
    )


def _refuse_if_live(namespaces: Sequence[_Namespace], action: str) -> None:
    for ns in namespaces:
        live = _live_owners(ns)
        if live:
            raise TieringError(
                f"refusing to {action}: namespace {ns.namespace or ns.name!r} is in use by "
                f"{len(live)} running tier(s) (owners/{live[0]}.lock is held); "
                "stop them first. Nothing was changed"
            )


@contextlib.contextmanager
def _os_errors(root: str) -> Iterator[None]:
    """An OSError while reading the root becomes a TieringError naming it."""
    try:
        yield
    except OSError as exc:
        where = f" ({exc.filename})" if exc.filename else ""
        raise TieringError(f"cannot read {root!r}{where}: {describe_os_error(exc)}") from None


def _walk_files(path: str) -> Iterator[tuple[str, int]]:
    """``(path, size)`` of every non-directory below ``path`` (links not followed)."""
    for directory, dirs, files in os.walk(path):
        for name in files + [d for d in dirs if os.path.islink(os.path.join(directory, d))]:
            full = os.path.join(directory, name)
            with contextlib.suppress(OSError):
                yield full, os.lstat(full).st_size


def _listdir(path: str) -> list[os.DirEntry[str]]:
    try:
        return sorted(os.scandir(path), key=lambda e: e.name)
    except (FileNotFoundError, NotADirectoryError):
        return []


def _most_common(sizes: Counter[int]) -> int | None:
    return sizes.most_common(1)[0][0] if sizes else None


def _read_header(path: str, offset: int = 0) -> BlockHeader | None:
    try:
        with open(path, "rb", buffering=0) as file:
            page = os.pread(file.fileno(), HEADER_BYTES, offset)
        return decode_header(page)
    except (OSError, CorruptBlockError):
        return None


# -- the segment layout ------------------------------------------------------------------


@dataclass(slots=True)
class _SegmentsState:
    files: SegmentFiles | None = None
    block_bytes: int | None = None
    checkpoint: Checkpoint | None = None
    index: SegmentIndex | None = None
    damaged: list[Finding] = field(default_factory=list)
    orphaned: list[Finding] = field(default_factory=list)
    sealed: bool = False  # some segment's first record is encrypted

    @property
    def blocks(self) -> int:
        return 0 if self.index is None else len(self.index)


def _segments_state(ns: _Namespace) -> _SegmentsState | None:
    """The segment layout in ``ns`` as the tier's start-up sees it (the checkpoint, a
    scan of every segment, the index ``restore`` builds from them); None when absent."""
    seg_dir = os.path.join(ns.path, SEGMENTS_DIR)
    if not os.path.isdir(seg_dir):
        return None
    state = _SegmentsState()
    sizes: Counter[int] = Counter()
    names: list[str] = []
    for entry in _listdir(seg_dir):
        rel = ns.rel(SEGMENTS_DIR, entry.name)
        if parse_segment_name(entry.name) is None or not entry.is_file(follow_symlinks=False):
            state.orphaned.append(
                Finding(rel, "not a file the tier writes (the tier leaves it alone)")
            )
            continue
        names.append(entry.name)
        # Record 0 sits right after the segment header whatever the record size.
        header = _read_header(entry.path, HEADER_BYTES)
        if header is not None and header.namespace_digest == ns.digest:
            sizes[header.payload_bytes] += 1
            state.sealed = state.sealed or header.seal is not None
    state.block_bytes = _most_common(sizes)
    if state.block_bytes is None:
        state.damaged.extend(
            Finding(
                ns.rel(SEGMENTS_DIR, name),
                "no segment's first record verifies: record size unknown",
            )
            for name in names
        )
        return state
    files = SegmentFiles(
        ns.path,
        block_bytes=state.block_bytes,
        ns_digest=ns.digest,
        fsync="batch",
        gil_pause_bytes=0,
    )
    state.files = files
    # The tier's own recovery, read-only; an index as large as what is on disk keeps
    # every block the tier would index, whatever its cap.
    found = recover(
        files,
        lambda records: SegmentIndex(
            max(1, records), records_per_segment=MAX_RECORDS_PER_SEGMENT, writer="0"
        ),
        writer=uuid.uuid4().hex,
        read_only=True,
    )
    state.checkpoint, state.index = found.checkpoint, found.index
    note = found.checkpoint_note
    if found.checkpoint is None and note != "no checkpoint":
        state.damaged.append(
            Finding(ns.rel(CHECKPOINT_FILE), f"{note} (the tier scans every segment instead)")
        )
    for name, size in files.list_segments():
        rel = ns.rel(SEGMENTS_DIR, name)
        records = files.records_in(size)
        scan = found.scans.get(name)
        if name in found.unreadable:
            state.damaged.append(Finding(rel, f"unreadable: {found.unreadable[name]}"))
        elif name in found.corrupt:
            state.damaged.append(
                Finding(rel, "neither its header nor any record verifies (removed at tier start)")
            )
        if scan is None:
            continue
        removed = _removed_slots(files, name, records) if scan.invalid else 0
        if scan.invalid > removed:
            state.damaged.append(
                Finding(rel, f"{scan.invalid - removed} of {records} record slots do not "
                        "verify (torn or damaged; their space returns with the segment)")
            )  # fmt: skip
        if removed:
            state.orphaned.append(
                Finding(rel, f"{removed} of {records} record slots removed by `tiering verify "
                        "--remove` (their space returns with the segment)")
            )  # fmt: skip
        if size > HEADER_BYTES and (size - HEADER_BYTES) % files.record_bytes:
            state.damaged.append(Finding(rel, "ends in a partial record (a torn write)"))
    live = Counter(name for name, _ in _live_entries(found.index))
    for name, _records in found.listed:
        if not live[name]:
            state.orphaned.append(
                Finding(
                    ns.rel(SEGMENTS_DIR, name),
                    "holds no block the index would serve (evicted first by the tier)",
                )
            )
    return state


def _removed_slots(files: SegmentFiles, segment: str, records: int) -> int:
    """How many of the first ``records`` slots of ``segment`` carry the removal mark.

    Raises:
        OSError: the segment cannot be opened or read.
    """
    fd = os.open(files.path_of(segment), os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        return sum(
            os.pread(fd, len(_REMOVED_MARK), files.offset_of(record)) == _REMOVED_MARK
            for record in range(records)
        )
    finally:
        os.close(fd)


def _live_entries(index: SegmentIndex) -> list[tuple[str, int]]:
    """``(segment, record)`` of every block ``index`` holds."""
    snap = index.snapshot()
    return [
        (snap.segments[s][0], r)
        for s, r in zip(snap.segment_of.tolist(), snap.record_of.tolist(), strict=True)
    ]


def _sealer(
    keyring: Keyring | None, block_bytes: int | None, ns_digest: bytes
) -> PayloadSealer | None:
    if keyring is None or block_bytes is None:
        return None
    return PayloadSealer(BlockCipher(keyring), block_bytes=block_bytes, ns_digest=ns_digest)


def _verify_segments(
    ns: _Namespace,
    state: _SegmentsState,
    remove: bool,
    keyring: Keyring | None,
    advance: Callable[[int], None],
) -> tuple[int, list[BadBlock], bool]:
    """Read every block the index holds with the tier's reader (``SegmentFiles.read``:
    header, key, namespace, length, payload checksum); with ``remove``, mark the bad
    records and drop them from the checkpoint. Returns (checked, bad, checkpoint
    rewritten)."""
    files, index = state.files, state.index
    if files is None or index is None or not len(index):
        return 0, [], False
    files.sealer = _sealer(keyring, files.block_bytes, ns.digest)
    snap = index.snapshot()
    entries = [
        (snap.segments[s][0], r, d)
        for s, r, d in zip(
            snap.segment_of.tolist(), snap.record_of.tolist(), snap.digests.tolist(), strict=True
        )
    ]
    keys = files.read_keys([(segment, record) for segment, record, _ in entries])
    # (segment, record) -> (key in its header or None, why it failed, whether the
    # record itself is bad and must be marked; a missing record or a stale entry is not)
    failures: dict[tuple[str, int], tuple[bytes | None, str, bool]] = {}
    size = files.block_bytes
    per_batch = max(1, _READ_BATCH_BYTES // size)
    buffer = memoryview(bytearray(per_batch * size))
    for batch in _unique_key_batches(entries, keys, per_batch):
        reads = [
            (name, segment, record, buffer[i * size : (i + 1) * size])
            for i, (name, _, segment, record, _) in enumerate(batch)
        ]
        report = files.read(reads)
        advance(len(batch))
        missing = set(report.missing)
        for name, key, segment, record, digest in batch:
            if name in report.failed:
                failures[(segment, record)] = (key, report.failed[name], name not in missing)
            elif key_digest(name) != digest:
                failures[(segment, record)] = (
                    key,
                    "stale index entry: the record holds another block",
                    False,
                )
    marked: set[tuple[str, int]] = set()
    dropped: set[tuple[str, int]] = set()
    in_checkpoint = _checkpoint_locations(state.checkpoint)
    if remove and failures:
        marked = _mark_bad_records(files, [where for where, f in failures.items() if f[2]])
        dropped = _drop_from_checkpoint(files, state.checkpoint, set(failures))
    bad = []
    for where, (key, reason, mark) in sorted(failures.items()):
        unlisted = where not in in_checkpoint or where in dropped
        removed = remove and unlisted and (where in marked or not mark)
        bad.append(
            BadBlock(
                ns.rel(SEGMENTS_DIR, where[0]),
                where[1],
                key.hex() if key is not None else None,
                reason,
                removed,
            )
        )
    return len(entries), bad, bool(dropped)


def _checkpoint_locations(checkpoint: Checkpoint | None) -> set[tuple[str, int]]:
    if checkpoint is None:
        return set()
    names = [name for name, _ in checkpoint.segments]
    return {
        (names[s], r)
        for s, r in zip(checkpoint.segment_of.tolist(), checkpoint.record_of.tolist(), strict=True)
    }


_NO_KEY = b"\x00unverified-"
"""Stands for the key of a record whose header does not verify: the tier's reader then
fails it on the header (magic, checksum, namespace, length) before it compares keys."""


def _unique_key_batches(
    entries: Sequence[tuple[str, int, int]], keys: Sequence[bytes | None], most: int
) -> Iterator[list[tuple[bytes, bytes | None, str, int, int]]]:
    """``(name to read it by, key in its header or None, segment, record, digest)`` in
    batches of at most ``most``, no name twice in one (the reader's report is keyed by
    key)."""
    batch: list[tuple[bytes, bytes | None, str, int, int]] = []
    seen: set[bytes] = set()
    for i, ((segment, record, digest), key) in enumerate(zip(entries, keys, strict=True)):
        name = key if key is not None else _NO_KEY + str(i).encode()
        if len(batch) == most or name in seen:
            yield batch
            batch, seen = [], set()
        batch.append((name, key, segment, record, digest))
        seen.add(name)
    if batch:
        yield batch


def _mark_bad_records(
    files: SegmentFiles, records: Sequence[tuple[str, int]]
) -> set[tuple[str, int]]:
    """Overwrite the header page of each bad record with the removal mark, synced, so
    that a scan at the next start skips it (as a torn record) and ``inspect`` counts it
    removed; returns those marked."""
    marked: set[tuple[str, int]] = set()
    mark = _REMOVED_MARK.ljust(HEADER_BYTES, b"\0")
    by_segment: dict[str, list[int]] = {}
    for segment, record in records:
        by_segment.setdefault(segment, []).append(record)
    for segment, numbers in by_segment.items():
        try:
            fd = os.open(files.path_of(segment), os.O_WRONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError:
            continue
        try:
            size = os.fstat(fd).st_size
            for record in numbers:
                if files.offset_of(record) + HEADER_BYTES <= size:
                    os.pwrite(fd, mark, files.offset_of(record))
                    marked.add((segment, record))
            os.fdatasync(fd)
        except OSError:
            marked.difference_update((segment, r) for r in numbers)
        finally:
            os.close(fd)
    return marked


def _drop_from_checkpoint(
    files: SegmentFiles, checkpoint: Checkpoint | None, bad: set[tuple[str, int]]
) -> set[tuple[str, int]]:
    """Write the checkpoint again without the entries of ``bad`` records (atomically, as
    the tier writes it); returns the locations whose entries it dropped (none if the
    write failed: the old checkpoint then stays)."""
    if checkpoint is None:
        return set()
    names = [name for name, _ in checkpoint.segments]
    where = list(
        zip(
            [names[s] for s in checkpoint.segment_of.tolist()],
            checkpoint.record_of.tolist(),
            strict=True,
        )
    )
    keep = np.array([loc not in bad for loc in where], dtype=bool)
    if keep.all():
        return set()
    filtered = Checkpoint(
        checkpoint.segments,
        checkpoint.digests[keep],
        checkpoint.segment_of[keep],
        checkpoint.record_of[keep],
        checkpoint.ticks[keep],
    )
    try:
        # The temporary name carries an id no tier holds a lock for: if this process
        # dies before the rename, the next tier start removes it as a dead writer's.
        files.write_checkpoint(filtered, temp_suffix=uuid.uuid4().hex)
    except OSError:
        return set()
    return {loc for loc, kept in zip(where, keep.tolist(), strict=True) if not kept}


# -- inspect ----------------------------------------------------------------------------


def _namespace_orphans(ns: _Namespace, layouts: Sequence[str]) -> list[Finding]:
    """Leftovers at the top of the namespace directory and in ``owners/``."""
    found: list[Finding] = []
    known = {IDENTITY_FILE, OWNERS_DIR, SEGMENTS_DIR, CHECKPOINT_FILE}
    for entry in _listdir(ns.path):
        name = entry.name
        if name in known:
            continue
        if name.startswith(f"{CHECKPOINT_FILE}.") and name.endswith(TEMP_SUFFIX):
            writer = name[len(CHECKPOINT_FILE) + 1 : -len(TEMP_SUFFIX)]
            if not owner_alive(ns.path, writer):
                found.append(Finding(ns.rel(name), "temporary checkpoint of a writer that is gone"))
        elif name.startswith(f"{IDENTITY_FILE}.") and name.endswith(TEMP_SUFFIX):
            found.append(Finding(ns.rel(name), "temporary NAMESPACE file left by a tier start"))
        elif name.startswith(_PROBE_PREFIX):
            found.append(Finding(ns.rel(name), "O_DIRECT probe file left by a tier start"))
        else:
            found.append(
                Finding(ns.rel(name), "not a file the tier writes (the tier leaves it alone)")
            )
    for entry in _listdir(os.path.join(ns.path, OWNERS_DIR)):
        if entry.name.endswith(".lock"):
            if not owner_alive(ns.path, entry.name.removesuffix(".lock")):
                found.append(
                    Finding(ns.rel(OWNERS_DIR, entry.name), "lock file of a writer that is gone")
                )
        elif not (entry.name.startswith(".") and entry.name.endswith(".new")):
            found.append(
                Finding(
                    ns.rel(OWNERS_DIR, entry.name),
                    "not a file the tier writes (the tier leaves it alone)",
                )
            )
    return found


@dataclass(slots=True)
class _State:
    ns: _Namespace
    segments: _SegmentsState | None


def _state(ns: _Namespace) -> _State:
    return _State(ns, _segments_state(ns))


def _report(state: _State) -> NamespaceReport:
    ns, segments = state.ns, state.segments
    layouts = (LAYOUT_SEGMENTS,) if segments is not None else ()
    damaged: list[Finding] = []
    if ns.identity_problem is not None:
        damaged.append(Finding(ns.rel(IDENTITY_FILE), ns.identity_problem))
    orphaned = _namespace_orphans(ns, layouts)
    blocks = payload = 0
    block_bytes = None
    if segments is not None:
        damaged += segments.damaged
        orphaned += segments.orphaned
        block_bytes = segments.block_bytes
        blocks += segments.blocks
        payload += segments.blocks * (segments.block_bytes or 0)
    sizes = [size for _, size in _walk_files(ns.path)]
    return NamespaceReport(
        directory=ns.name,
        namespace=ns.namespace,
        digest=ns.digest.hex(),
        layouts=layouts,
        block_bytes=block_bytes,
        blocks=blocks,
        payload_bytes=payload,
        disk_bytes=sum(sizes),
        files=len(sizes),
        live_owners=_live_owners(ns),
        damaged=tuple(damaged),
        orphaned=tuple(orphaned),
    )


def inspect_root(root: str | os.PathLike[str], *, namespace: str | None = None) -> RootReport:
    """What ``root`` holds, per namespace directory; changes nothing on disk.

    ``namespace`` limits the report to one namespace (its string, its directory name or
    a prefix of at least 4 hex digits of its digest). Block payloads are not read (see
    :func:`verify_root`); every block header and segment record header is.

    Raises:
        InvalidArgumentError: ``root`` fails the tier's own check of a root
            (:func:`~backends.nvme.check_root`: it does not exist, is not a directory,
            belongs to another user or others may write to it) or is not an NVMe root
            (neither empty nor holding a namespace directory); ``namespace`` matches
            none or several.
        TieringError: an OS error while reading (the message carries it).
    """
    path, namespaces, others = _open_root(root)
    selected = _select(namespaces, namespace)
    with _os_errors(path):
        return RootReport.of(path, tuple(_report(_state(ns)) for ns in selected), tuple(others))


# -- verify -----------------------------------------------------------------------------


def verify_root(
    root: str | os.PathLike[str],
    *,
    remove: bool,
    namespace: str | None = None,
    encryption: Keyring | str | None = None,
    on_progress: Callable[[int, int], None] | None = None,
) -> VerifyReport:
    """Read every block of ``root`` (or of one namespace) and check it as a load does:
    length, header (magic, version, checksum, namespace, key, payload length) and
    payload checksum, or for an encrypted block its authentication under
    ``encryption`` (a keyring or its spec, as the tier's option). Without a keyring an
    encrypted block is reported bad (it cannot be checked), and ``remove`` is refused
    for a namespace that holds encrypted blocks.

    The blocks are those the rebuilt index holds (a record no index entry names is never
    served, so it is not a block). With ``remove``: a bad record's header page is
    overwritten with a removal mark, so a start's scan skips it (and :func:`inspect_root`
    counts it removed, not damaged), and its entry leaves the index checkpoint
    (rewritten atomically). A later tier start then neither indexes nor serves them.

    ``on_progress(checked, total)``, if given, is called as blocks are checked (from
    ``(0, total)`` on, once the headers are read).

    Raises:
        InvalidArgumentError: as :func:`inspect_root`.
        TieringError: ``remove`` and a selected namespace has a live owner, or holds
            encrypted blocks and no keyring was given (nothing changed), or an OS error
            while reading (the message carries it). A block that could not be removed
            is reported as not removed.
    """
    keyring = keyring_from(encryption, option="encryption")
    path, namespaces, _ = _open_root(root)
    selected = _select(namespaces, namespace)
    if remove:
        _refuse_if_live(selected, "remove bad blocks")
    with _os_errors(path):
        states = [(ns, _state(ns)) for ns in selected]
        if remove and keyring is None:
            for ns, state in states:
                if state.segments is not None and state.segments.sealed:
                    raise TieringError(
                        f"{ns.path}: holds encrypted blocks; without their keyring "
                        "(--encryption) none can be checked, so none is removed"
                    )
        total = sum(
            state.segments.blocks if state.segments is not None else 0 for _, state in states
        )
        done = 0

        def advance(blocks: int) -> None:
            nonlocal done
            done += blocks
            if on_progress is not None:
                on_progress(done, total)

        advance(0)
        results = [_verify_namespace(ns, state, remove, keyring, advance) for ns, state in states]
    return VerifyReport.of(path, remove, tuple(results))


def _verify_namespace(
    ns: _Namespace,
    state: _State,
    remove: bool,
    keyring: Keyring | None,
    advance: Callable[[int], None],
) -> NamespaceVerify:
    checked = 0
    bad: list[BadBlock] = []
    rewritten = False
    if state.segments is not None:
        n, found, rewritten = _verify_segments(ns, state.segments, remove, keyring, advance)
        checked += n
        bad += found
    return NamespaceVerify(ns.name, ns.namespace, checked, tuple(bad), _live_owners(ns), rewritten)


# -- clear ------------------------------------------------------------------------------


def _tier_file(rel_parts: tuple[str, ...]) -> bool:
    """Whether the tier writes a file at this path relative to a namespace directory."""
    if len(rel_parts) == 1:
        name = rel_parts[0]
        return (
            name in (IDENTITY_FILE, CHECKPOINT_FILE)
            or (name.startswith(f"{CHECKPOINT_FILE}.") and name.endswith(TEMP_SUFFIX))
            or (name.startswith(f"{IDENTITY_FILE}.") and name.endswith(TEMP_SUFFIX))
            or name.startswith(_PROBE_PREFIX)
        )
    if len(rel_parts) != 2:
        return False
    top, name = rel_parts
    if top == SEGMENTS_DIR:
        return parse_segment_name(name) is not None
    if top == OWNERS_DIR:
        return name.endswith(".lock") or (name.startswith(".") and name.endswith(".new"))
    return False


def clear_root(
    root: str | os.PathLike[str], *, namespace: str | None, dry_run: bool = False
) -> ClearReport:
    """Remove every block of ``root``, or of one namespace, with its namespace directory.

    Removed: the files the tier writes (segments, the checkpoint, the
    ``NAMESPACE`` file, temporary, probe and lock files) and then the directories left
    empty. Files with other names are left, with their directories, and listed in
    ``left``. Nothing outside the namespace directories is touched; symbolic links are
    removed, never followed. With ``dry_run`` nothing changes and the report says what
    would go.

    Raises:
        InvalidArgumentError: as :func:`inspect_root`.
        TieringError: a selected namespace has a live owner (nothing changed), or a
            file could not be removed (the message names it; what went before is gone).
    """
    path, namespaces, _ = _open_root(root)
    selected = _select(namespaces, namespace)
    if not dry_run:
        _refuse_if_live(selected, "clear")
    files = nbytes = 0
    left: list[str] = []
    for ns in selected:
        with _os_errors(path):
            listing = sorted(_walk_files(ns.path))
        doomed: list[tuple[str, int]] = []
        for full, size in listing:
            parts = tuple(os.path.relpath(full, ns.path).split(os.sep))
            if _tier_file(parts):
                doomed.append((full, size))
            else:
                left.append(os.path.relpath(full, path))
        # The identity file goes last: until then the directory is still recognisably
        # a namespace, so an interrupted clear can be run again.
        doomed.sort(key=lambda item: os.path.basename(item[0]) == IDENTITY_FILE)
        files += len(doomed)
        nbytes += sum(size for _, size in doomed)
        if dry_run:
            continue
        for full, _ in doomed:
            try:
                os.unlink(full)
            except FileNotFoundError:
                continue
            except OSError as exc:
                raise TieringError(
                    f"could not remove {os.path.relpath(full, path)!r}: {describe_os_error(exc)}"
                ) from None
        for directory, _, _ in sorted(os.walk(ns.path, topdown=False), reverse=True):
            with contextlib.suppress(OSError):
                os.rmdir(directory)  # only succeeds once empty
    return ClearReport(path, dry_run, tuple(ns.name for ns in selected), files, nbytes, tuple(left))


__all__ = [
    "BadBlock",
    "ClearReport",
    "Finding",
    "NamespaceReport",
    "NamespaceVerify",
    "RootReport",
    "VerifyReport",
    "clear_root",
    "inspect_root",
    "verify_root",
]
