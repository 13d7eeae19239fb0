"""The NVMe tier's own formats, without I/O (docs/nvme.md, "On disk"): the names of what it
writes, the segment header, the index checkpoint, what a scan of a segment found. Each
record is a padded :mod:`tiering.tiers.block_record`.

A segment header page (little endian): magic ``KVTSEG\\r\\n``, u16 format version, u16
header length, u32 zero, u64 payload bytes per record, 16 bytes namespace digest, the
writer id (ASCII, NUL-padded to 64 bytes), zeros, and an xxh3_64 of bytes 0..4087 at
offset 4088. The checkpoint (``index.ckpt``): a head (magic, version, head length,
record payload bytes, namespace digest, segments, entries, body length, body checksum),
then a body: the segment list as text, then the entries as flat little-endian arrays.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass

import numpy as np
import xxhash

from backends.nvme.os_calls import OWNERS_DIR, PROBE_PREFIX
from tiering.errors import CorruptBlockError, InvalidArgumentError
from tiering.tiers.block_record import HEADER_BYTES, namespace_digest

SEGMENTS_DIR = "segments"
SEGMENT_SUFFIX = ".seg"
CHECKPOINT_FILE = "index.ckpt"
IDENTITY_FILE = "NAMESPACE"  # the namespace directory's identity: the namespace (JSON)
TEMP_SUFFIX = ".tmp"
REMOVED_MARK = b"KVTIER removed by verify\n"
"""How a record slot's header page begins once ``tiering verify --remove`` removed its
record: a scan skips the slot and counts it removed, not damaged."""
SEGMENT_FORMAT_VERSION = 1
_SEGMENT_ID = (b"KVTSEG\r\n", SEGMENT_FORMAT_VERSION, HEADER_BYTES)  # magic, version, length
_SEGMENT_FIXED = struct.Struct("<8sHH4xQ16s64s")
_TRAILER = struct.Struct("<Q")
_TRAILER_OFFSET = HEADER_BYTES - _TRAILER.size
_SEGMENT_NAME = re.compile(r"^([0-9a-f]{1,64})-([0-9a-f]{8})\.seg$")
_READABLE = re.compile(r"[^A-Za-z0-9._-]+")
_CHECKPOINT_HEAD = struct.Struct("<8sHH4xQ16sQQQ16s")
_CHECKPOINT_ID = (b"KVTCKPT\n", 1, _CHECKPOINT_HEAD.size)  # magic, version, head length
_COLUMNS = (("digests", "<u8"), ("segment_of", "<u4"), ("record_of", "<u4"), ("ticks", "<u4"))


def namespace_dirname(namespace: str) -> str:
    """A safe directory name for ``namespace`` (else InvalidArgumentError): a readable
    prefix of at most 40 ``[A-Za-z0-9._-]``, then the 32 hex digits of its digest."""
    if not isinstance(namespace, str) or not namespace:
        raise InvalidArgumentError(f"namespace must be a non-empty string, got {namespace!r}")
    readable = _READABLE.sub("_", namespace).strip("._-")[:40] or "ns"
    return f"{readable}-{namespace_digest(namespace).hex()}"


def segment_name(writer: str, seq: int) -> str:
    """The file name of writer ``writer``'s segment number ``seq`` (InvalidArgumentError
    unless ``writer`` is 1..64 lowercase hex digits and ``seq`` in 0..2**32-1)."""
    if not re.fullmatch(r"[0-9a-f]{1,64}", writer) or not 0 <= seq < 1 << 32:
        raise InvalidArgumentError(f"bad segment writer {writer!r} or sequence number {seq!r}")
    return f"{writer}-{seq:08x}{SEGMENT_SUFFIX}"


def parse_segment_name(name: str) -> tuple[str, int] | None:
    """``(writer, seq)`` of a segment file name, or None for any other name."""
    match = _SEGMENT_NAME.match(name)
    return None if match is None else (match.group(1), int(match.group(2), 16))


def temporary_name(final: str, writer: str) -> str:
    """The name of writer ``writer``'s temporary file of ``final``."""
    return f"{final}.{writer}{TEMP_SUFFIX}"


def temporary_writer(name: str, final: str) -> str | None:
    """The writer whose temporary file of ``final`` ``name`` is, or None if it is none."""
    if name.startswith(f"{final}.") and name.endswith(TEMP_SUFFIX):
        return name[len(final) + 1 : -len(TEMP_SUFFIX)]
    return None


def tier_file(parts: tuple[str, ...]) -> str | None:
    """What the tier writes at ``parts``, a path below a namespace directory split at
    its separators: ``"identity"``, ``"checkpoint"``, ``"identity temporary"``,
    ``"checkpoint temporary"``, ``"probe"``, ``"segment"``, ``"lock"``, ``"lock
    temporary"``; None for a name the tier never writes."""
    if len(parts) == 1:
        (name,) = parts
        for final, kind in ((IDENTITY_FILE, "identity"), (CHECKPOINT_FILE, "checkpoint")):
            if name == final:
                return kind
            if temporary_writer(name, final) is not None:
                return f"{kind} temporary"
        return "probe" if name.startswith(PROBE_PREFIX) else None
    if len(parts) == 2 and parts[0] == SEGMENTS_DIR and parse_segment_name(parts[1]):
        return "segment"
    if len(parts) == 2 and parts[0] == OWNERS_DIR:
        if parts[1].endswith(".lock"):
            return "lock"
        if parts[1].startswith(".") and parts[1].endswith(".new"):
            return "lock temporary"
    return None


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """An index snapshot: ``segments`` ``(name, records covered)`` (later records must be
    scanned), and one entry per indexed block in the parallel arrays ``digests`` (u64),
    ``segment_of`` (u32, into ``segments``), ``record_of`` and ``ticks`` (u32)."""

    segments: list[tuple[str, int]]
    digests: np.ndarray
    segment_of: np.ndarray
    record_of: np.ndarray
    ticks: np.ndarray

    def locations(self) -> list[tuple[str, int]]:
        """``(segment, record)`` of each entry, in entry order."""
        names = [name for name, _ in self.segments]
        of = zip(self.segment_of.tolist(), self.record_of.tolist(), strict=True)
        return [(names[segment], record) for segment, record in of]

    def without(self, locations: set[tuple[str, int]]) -> Checkpoint:
        """This checkpoint less the entries at ``locations``."""
        keep = np.array([where not in locations for where in self.locations()], dtype=bool)
        columns = (self.digests, self.segment_of, self.record_of, self.ticks)
        return Checkpoint(self.segments, *(column[keep] for column in columns))


def encode_segment_header(
    into: memoryview, *, payload_bytes: int, ns_digest: bytes, writer: str
) -> None:
    """Write a segment header page into ``into`` (HEADER_BYTES long)."""
    view = into if into.format == "B" else into.cast("B")
    view[:] = bytes(HEADER_BYTES)
    fields = (*_SEGMENT_ID, payload_bytes, ns_digest, writer.encode("ascii"))
    _SEGMENT_FIXED.pack_into(view, 0, *fields)
    _TRAILER.pack_into(view, _TRAILER_OFFSET, xxhash.xxh3_64_intdigest(view[:_TRAILER_OFFSET]))


def check_segment_header(page: memoryview | bytes, *, payload_bytes: int, ns_digest: bytes) -> None:
    """Raise CorruptBlockError unless ``page`` is a valid segment header of this
    namespace and record size (the message says which check failed)."""
    view = memoryview(page).cast("B") if not isinstance(page, bytes) else memoryview(page)
    if len(view) < HEADER_BYTES:
        raise CorruptBlockError("segment header is short")
    (stored,) = _TRAILER.unpack_from(view, _TRAILER_OFFSET)
    if xxhash.xxh3_64_intdigest(view[:_TRAILER_OFFSET]) != stored:
        raise CorruptBlockError("segment header checksum mismatch")
    magic, version, length, payload, digest, _writer = _SEGMENT_FIXED.unpack_from(view, 0)
    if (magic, version, length) != _SEGMENT_ID:
        raise CorruptBlockError("not a segment of this format")
    if digest != ns_digest:
        raise CorruptBlockError("segment belongs to another namespace")
    if payload != payload_bytes:
        raise CorruptBlockError(f"segment records hold {payload} bytes, expected {payload_bytes}")


def encode_checkpoint(checkpoint: Checkpoint, *, block_bytes: int, ns_digest: bytes) -> list[bytes]:
    """The bytes of ``checkpoint``'s file, in parts: its head, then its body
    (InvalidArgumentError when the entry arrays differ in length)."""
    names = "\n".join(f"{name} {covered}" for name, covered in checkpoint.segments).encode()
    arrays = [np.ascontiguousarray(getattr(checkpoint, n), dtype=t) for n, t in _COLUMNS]
    count = len(arrays[0])
    if any(len(array) != count for array in arrays):
        raise InvalidArgumentError("checkpoint arrays differ in length")
    body = [struct.pack("<Q", len(names)), names, *(memoryview(a).cast("B") for a in arrays)]
    digest = xxhash.xxh3_128()
    for part in body:
        digest.update(part)
    sizes = (len(checkpoint.segments), count, sum(len(part) for part in body))
    head = _CHECKPOINT_HEAD.pack(*_CHECKPOINT_ID, block_bytes, ns_digest, *sizes, digest.digest())
    return [head, *(bytes(part) for part in body)]


def parse_checkpoint(data: bytes, *, block_bytes: int, ns_digest: bytes) -> Checkpoint:
    """The checkpoint a file holds; CorruptBlockError when it fails a check, ValueError
    or struct.error when its segment table does not parse."""
    if len(data) < _CHECKPOINT_HEAD.size:
        raise CorruptBlockError("checkpoint is short")
    magic, version, head_len, payload, ns, n_segments, count, body_len, checksum = (
        _CHECKPOINT_HEAD.unpack_from(data, 0)
    )
    if (magic, version, head_len) != _CHECKPOINT_ID:
        raise CorruptBlockError("not a checkpoint of this format")
    if ns != ns_digest or payload != block_bytes:
        raise CorruptBlockError("checkpoint of another namespace or block size")
    body = memoryview(data)[head_len:]
    if len(body) != body_len:
        raise CorruptBlockError(f"checkpoint body is {len(body)} bytes, expected {body_len}")
    if xxhash.xxh3_128_digest(body) != checksum:
        raise CorruptBlockError("checkpoint checksum mismatch")
    (names_len,) = struct.unpack_from("<Q", body, 0)
    names = bytes(body[8 : 8 + names_len]).decode("ascii").split("\n") if names_len else []
    segments = []
    for line in names:
        name, _, covered = line.partition(" ")
        if parse_segment_name(name) is None:
            raise CorruptBlockError(f"bad segment name {name!r}")
        segments.append((name, int(covered)))
    if len(segments) != n_segments:
        raise CorruptBlockError("segment table length mismatch")
    at = 8 + names_len
    arrays = []
    for _, dtype in _COLUMNS:
        arrays.append(np.frombuffer(body, dtype=dtype, count=count, offset=at).copy())
        at += arrays[-1].nbytes
    if at != body_len:
        raise CorruptBlockError("checkpoint arrays do not fill the body")
    if count and int(arrays[1].max()) >= max(n_segments, 1):
        raise CorruptBlockError("checkpoint entry names a segment it does not list")
    return Checkpoint(segments, *arrays)


@dataclass(frozen=True, slots=True)
class SegmentScan:
    """A segment's valid records ``(key, record)`` from some record on, in file order;
    ``end`` after the last whole slot; ``invalid`` slots hold no valid record, and
    ``removed`` ones the mark of ``SegmentFiles.mark_removed``."""

    records: list[tuple[bytes, int]]
    end: int
    invalid: int
    header_ok: bool = True
    removed: int = 0
