"""The NVMe tier's on-disk format: namespace directory names and block record headers.

Every stored block is one record, self-describing and verifiable on its own::

    offset 0     header page (HEADER_BYTES = 4096 bytes, see below)
    offset 4096  payload: exactly ``payload_bytes`` bytes, the block as it sat in its CPU slot

The header fills a whole page so that the payload starts at an aligned file offset and
can move with O_DIRECT straight from and into the host pool. Header layout (little
endian)::

    0    8s   magic  b"KVTBLK\\r\\n" (the CR LF catches text-mode mangling)
    8    u16  format version (FORMAT_VERSION)
    10   u16  header length in bytes (HEADER_BYTES)
    12   u8   checksum kind: 1 = xxh3_128 of the payload; 2 = the payload is AES-GCM
              ciphertext (:mod:`tiering.encryption`) and the next field is its tag
    13   3x   reserved, zero
    16   u64  payload length in bytes
    24   16s  payload checksum (xxh3_128, big-endian digest), or the GCM tag
    40   16s  namespace digest (first 16 bytes of sha256 of the namespace string)
    56   u16  key length
    58   6x   reserved, zero
    64   ...  the key (the full block hash), then zeros
    4072 u32  kind 2: the encryption key id (zero otherwise)
    4076 12s  kind 2: the GCM nonce (zeros otherwise)
    4088 u64  header checksum: xxh3_64 of bytes 0..4087

A sealed block (kind 2) carries no checksum of its plaintext, which would tell equal
payloads apart; the tag verifies it, with the namespace digest and the key as associated
data. A reader of the other kind never serves a block: a plain reader refuses kind 2,
and an encrypting tier refuses kind 1.

This module is pure: it computes names, digests and header bytes and never touches a
file. Checksums are computed on the tier's worker threads, never on the loop; the
xxhash binding holds the GIL while it hashes (docs/nvme.md, "Measurements behind the
code", says how much that costs and why it stays).
"""

from __future__ import annotations

import hashlib
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import xxhash

from tiering.encryption import NONCE_BYTES, TAG_BYTES, Seal
from tiering.errors import CorruptBlockError, InvalidArgumentError

MAGIC = b"KVTBLK\r\n"
FORMAT_VERSION = 1
HEADER_BYTES = 4096
CHECKSUM_XXH3_128 = 1
SEALED_AES_GCM = 2

_FIXED = struct.Struct("<8sHHB3xQ16s16sH6x")
_KEY_OFFSET = _FIXED.size
_TRAILER = struct.Struct("<Q")
_TRAILER_OFFSET = HEADER_BYTES - _TRAILER.size
_SEAL = struct.Struct(f"<I{NONCE_BYTES}s")
_SEAL_OFFSET = _TRAILER_OFFSET - _SEAL.size
MAX_KEY_BYTES = _SEAL_OFFSET - _KEY_OFFSET
"""The longest key a header can hold."""

_READABLE = re.compile(r"[^A-Za-z0-9._-]+")


@dataclass(frozen=True, slots=True)
class BlockHeader:
    """A decoded, self-consistent block header (its own checksum already verified)."""

    key: bytes
    payload_bytes: int
    payload_checksum: bytes
    """The xxh3_128 of the payload, or for a sealed block its GCM tag."""
    namespace_digest: bytes
    seal: Seal | None = None
    """How the payload was sealed; None for a plain block."""


def _byte_view(buffer: memoryview | bytes | bytearray) -> memoryview:
    view = memoryview(buffer)
    return view if view.format == "B" else view.cast("B")


def namespace_digest(namespace: str) -> bytes:
    """The 16-byte digest of a namespace string that every header of it carries."""
    return hashlib.sha256(namespace.encode("utf-8")).digest()[:16]


def namespace_dirname(namespace: str) -> str:
    """A safe directory name for ``namespace``: a readable prefix plus a digest.

    The prefix keeps only ``[A-Za-z0-9._-]`` (at most 40 characters) so an operator can
    tell directories apart; the 32 hex digits of the digest make names distinct.

    Raises:
        InvalidArgumentError: ``namespace`` is not a non-empty string.
    """
    if not isinstance(namespace, str) or not namespace:
        raise InvalidArgumentError(f"namespace must be a non-empty string, got {namespace!r}")
    readable = _READABLE.sub("_", namespace).strip("._-")[:40] or "ns"
    return f"{readable}-{namespace_digest(namespace).hex()}"


def check_key(key: object) -> bytes:
    """Return ``key`` if it is bytes a header can hold.

    Raises:
        InvalidArgumentError: ``key`` is not bytes, is empty, or exceeds MAX_KEY_BYTES.
    """
    if not isinstance(key, bytes):
        raise InvalidArgumentError(f"block key must be bytes, got {type(key).__name__}")
    if not key or len(key) > MAX_KEY_BYTES:
        raise InvalidArgumentError(
            f"block key must be 1..{MAX_KEY_BYTES} bytes long, got {len(key)}"
        )
    return key


def payload_checksum(payload: memoryview | bytes | bytearray) -> bytes:
    """The 16-byte xxh3_128 digest of a payload (holds the GIL: call it off the loop)."""
    return xxhash.xxh3_128_digest(payload)


def encode_header(
    into: memoryview | bytearray,
    *,
    key: bytes,
    payload_bytes: int,
    checksum: bytes,
    ns_digest: bytes,
    seal: Seal | None = None,
) -> None:
    """Write a complete header page for one block into ``into`` (HEADER_BYTES long);
    with ``seal``, of a sealed block (``checksum`` is then ignored: the seal's tag goes
    in its place).

    Raises:
        InvalidArgumentError: ``into`` has the wrong length, or ``key``, ``checksum`` or
            ``ns_digest`` has the wrong type or length; ``into`` is then unchanged.
    """
    check_key(key)
    if len(into) != HEADER_BYTES:
        raise InvalidArgumentError(f"a header buffer must be {HEADER_BYTES} bytes")
    if seal is not None:
        checksum = seal.tag
        if len(seal.nonce) != NONCE_BYTES or len(seal.tag) != TAG_BYTES:
            raise InvalidArgumentError("a seal's nonce must be 12 bytes and its tag 16")
    if len(checksum) != 16 or len(ns_digest) != 16:
        raise InvalidArgumentError("checksum and namespace digest must be 16 bytes each")
    if payload_bytes < 0:
        raise InvalidArgumentError(f"payload length must be >= 0, got {payload_bytes}")
    view = _byte_view(into)
    _FIXED.pack_into(
        view,
        0,
        MAGIC,
        FORMAT_VERSION,
        HEADER_BYTES,
        CHECKSUM_XXH3_128 if seal is None else SEALED_AES_GCM,
        payload_bytes,
        checksum,
        ns_digest,
        len(key),
    )
    end = _KEY_OFFSET + len(key)
    view[_KEY_OFFSET:end] = key
    view[end:_SEAL_OFFSET] = bytes(_SEAL_OFFSET - end)
    if seal is None:
        view[_SEAL_OFFSET:_TRAILER_OFFSET] = bytes(_SEAL.size)
    else:
        _SEAL.pack_into(view, _SEAL_OFFSET, seal.key_id, seal.nonce)
    _TRAILER.pack_into(view, _TRAILER_OFFSET, xxhash.xxh3_64_intdigest(view[:_TRAILER_OFFSET]))


def decode_header(page: memoryview | bytes | bytearray) -> BlockHeader:
    """Parse and self-check a header page.

    Raises:
        CorruptBlockError: the page is short, or its magic, version, length, checksum
            kind, key length or header checksum is wrong. The message names which.
    """
    view = _byte_view(page)
    if len(view) < HEADER_BYTES:
        raise CorruptBlockError(f"header is {len(view)} bytes, expected {HEADER_BYTES}")
    (stored_sum,) = _TRAILER.unpack_from(view, _TRAILER_OFFSET)
    if xxhash.xxh3_64_intdigest(view[:_TRAILER_OFFSET]) != stored_sum:
        if bytes(view[: len(MAGIC)]) != MAGIC:
            raise CorruptBlockError("not a block file (bad magic)")
        raise CorruptBlockError("header checksum mismatch")
    magic, version, header_len, kind, payload_bytes, checksum, ns_digest, key_len = (
        _FIXED.unpack_from(view, 0)
    )
    if magic != MAGIC:
        raise CorruptBlockError("not a block file (bad magic)")
    if version != FORMAT_VERSION:
        raise CorruptBlockError(f"unsupported format version {version}")
    if header_len != HEADER_BYTES or kind not in (CHECKSUM_XXH3_128, SEALED_AES_GCM):
        raise CorruptBlockError(f"unsupported header (length {header_len}, checksum {kind})")
    if not 0 < key_len <= MAX_KEY_BYTES:
        raise CorruptBlockError(f"bad key length {key_len}")
    key = bytes(view[_KEY_OFFSET : _KEY_OFFSET + key_len])
    seal = None
    if kind == SEALED_AES_GCM:
        key_id, nonce = _SEAL.unpack_from(view, _SEAL_OFFSET)
        seal = Seal(key_id, nonce, checksum)
    return BlockHeader(key, payload_bytes, checksum, ns_digest, seal)


def check_header(
    header: BlockHeader, *, key: bytes | None, payload_bytes: int, ns_digest: bytes
) -> None:
    """Check a decoded header against what the reader expects.

    ``key`` may be None (recovery, where the header names the key).

    Raises:
        CorruptBlockError: another namespace, another key, or another payload length.
    """
    if header.namespace_digest != ns_digest:
        raise CorruptBlockError("block belongs to another namespace")
    if key is not None and header.key != key:
        raise CorruptBlockError("block holds another key")
    if header.payload_bytes != payload_bytes:
        raise CorruptBlockError(f"payload length {header.payload_bytes}, expected {payload_bytes}")


class PayloadOpener(Protocol):
    """What :func:`verify_payload` needs of a sealer (:class:`~backends.nvme_sealing.
    PayloadSealer`): opening a sealed payload where it lies."""

    def open(self, header: BlockHeader, slot: memoryview) -> None: ...


def verify_payload(
    header: BlockHeader,
    payload: memoryview,
    sealer: PayloadOpener | None,
    checksum: Callable[[memoryview], bytes] = payload_checksum,
) -> None:
    """Check a payload read under ``header`` (already checked against the expected key,
    namespace and length) as every reader does: with ``sealer``, open it where it lies
    (:meth:`~backends.nvme_sealing.PayloadSealer.open`); without, refuse a sealed block
    and compare ``checksum(payload)`` with the header's.

    Raises:
        CorruptBlockError: the payload does not verify (``payload`` then holds garbage
            when a ``sealer`` was given).
    """
    if sealer is not None:
        sealer.open(header, payload)
        return
    if header.seal is not None:
        raise CorruptBlockError(
            f"block is encrypted (key id {header.seal.key_id}) and this tier has no keyring"
        )
    if checksum(payload) != header.payload_checksum:
        raise CorruptBlockError("payload checksum mismatch")
