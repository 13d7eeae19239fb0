"""The block record: the header every stored block carries, and how a reader verifies it.

Both lower tiers store a block as one record, a header and the payload. The header
binds the payload to its namespace, tenant and key, and is laid out one of two ways:
compact (the Redis tier's, as long as its fields need) or padded to one
:data:`HEADER_BYTES` page (the NVMe tier's, so that the payload after it starts at an
aligned file offset for O_DIRECT). Layout, little endian::

    0    8s   magic  b"KVTBLK\\r\\n" (the CR LF catches text-mode mangling)
    8    u16  format version (FORMAT_VERSION)
    10   u8   kind: 1 = plain (the next field is a checksum), 2 = sealed with AES-GCM
              (:mod:`tiering.security.encryption`; the next field is the GCM tag)
    11   1x   reserved, zero
    12   u32  header length in bytes (compact, or HEADER_BYTES)
    16   u64  payload length in bytes
    24   16s  the payload's checksum (plain) or GCM tag (sealed)
    40   16s  namespace digest (first 16 bytes of sha256 of the namespace string)
    56   u16  tenant length (0: no tenant)
    58   u16  key length
    60   u32  sealed: the encryption key id (zero otherwise)
    64   12s  sealed: the GCM nonce (zeros otherwise)
    76   ...  the tenant, then the key, then zeros up to the trailer
    -8   u64  header checksum: xxh3_64 of every byte before it

A plain record's checksum is the xxh3_128 of its :func:`record_binding` (namespace
digest, tenant, key) then the payload; a sealed record's associated data is the binding
(no checksum of the plaintext: equal payloads would show). A payload moved under another
key, tenant or namespace fails to verify even under a forged header, and a reader of
one kind never serves a record of the other. Pure (no file, no socket); checksums and
the cipher run on the tiers' worker threads, never the event loop."""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable
from typing import NamedTuple

import xxhash

from tiering.errors import CorruptBlockError, InvalidArgumentError
from tiering.security.encryption import NONCE_BYTES, TAG_BYTES, BlockCipher, Buffer, Seal

MAGIC = b"KVTBLK\r\n"
FORMAT_VERSION = 5
"""A record of any other version reads as corrupt."""
HEADER_BYTES = 4096
"""The padded layout's length: one page."""
PLAIN = 1
SEALED = 2

_FIXED = struct.Struct(f"<8sHBxIQ16s16sHHI{NONCE_BYTES}s")
_TRAILER = struct.Struct("<Q")
_BOUND = struct.Struct("<HH")  # tenant and key lengths, ahead of them in the binding
MAX_KEY_BYTES = HEADER_BYTES - _FIXED.size - _TRAILER.size
"""The longest key a header can hold (and, padded, the most tenant and key bytes)."""
MAX_TENANT_BYTES = 0xFFFF
"""The longest tenant a compact header can hold."""


class BlockHeader(NamedTuple):
    """A decoded header whose own checksum verified."""

    key: bytes
    payload_bytes: int
    payload_checksum: bytes
    """The plain payload's checksum, or a sealed payload's GCM tag."""
    namespace_digest: bytes
    seal: Seal | None = None
    """How the payload is sealed; None for a plain record."""
    tenant: bytes = b""

    @property
    def binding(self) -> bytes:
        """:func:`record_binding` of this record."""
        return record_binding(self.namespace_digest, self.tenant, self.key)


def namespace_digest(namespace: str) -> bytes:
    """The 16-byte digest of a namespace string that every header of it carries."""
    return hashlib.sha256(namespace.encode("utf-8")).digest()[:16]


def record_binding(ns_digest: bytes, tenant: bytes, key: bytes) -> bytes:
    """What a record is bound to: its namespace digest, tenant (``b""`` for none) and
    key, lengths first, so no two (tenant, key) pairs give the same bytes. A sealed
    record's associated data; a plain record's checksum covers it."""
    return bytes(ns_digest) + _BOUND.pack(len(tenant), len(key)) + tenant + key


def check_key(key: object) -> bytes:
    """``key`` if it is bytes a header can hold; InvalidArgumentError if it is not bytes,
    is empty, or exceeds MAX_KEY_BYTES."""
    if not isinstance(key, bytes):
        raise InvalidArgumentError(f"block key must be bytes, got {type(key).__name__}")
    if not key or len(key) > MAX_KEY_BYTES:
        raise InvalidArgumentError(
            f"block key must be 1..{MAX_KEY_BYTES} bytes long, got {len(key)}"
        )
    return key


def payload_checksum(payload: Buffer, binding: bytes) -> bytes:
    """A plain record's checksum: the 16-byte xxh3_128 of ``binding`` then ``payload``
    (holds the GIL: call it off the loop)."""
    hasher = xxhash.xxh3_128(binding)
    hasher.update(payload)
    return hasher.digest()


_NO_NONCE = bytes(NONCE_BYTES)


def compact_bytes(tenant: bytes, key: bytes) -> int:
    """The length of a compact header for ``tenant`` and ``key``."""
    return _FIXED.size + len(tenant) + len(key) + _TRAILER.size


def encode_header(
    into: memoryview | bytearray,
    *,
    key: bytes,
    payload_bytes: int,
    ns_digest: bytes,
    tenant: bytes = b"",
    checksum: bytes | None = None,
    seal: Seal | None = None,
) -> None:
    """Write a header into the whole of ``into``, :func:`compact_bytes` long (compact)
    or :data:`HEADER_BYTES` (padded with zeros after the key): a plain record's with
    ``checksum`` (:func:`payload_checksum`), or a sealed one's with ``seal``. Raises
    InvalidArgumentError, leaving ``into`` unchanged, unless exactly one of them is
    given, for a field of the wrong type or length, or ``into`` of another length."""
    size, needed = len(into), compact_bytes(tenant, key)
    if size != needed and (size != HEADER_BYTES or needed > HEADER_BYTES):
        raise InvalidArgumentError(
            f"a header buffer must be {needed} bytes (compact) or {HEADER_BYTES} (padded), "
            f"and {needed} must fit; got {size}"
        )
    header = _header(size, key, payload_bytes, ns_digest, tenant, checksum, seal)
    memoryview(into).cast("B")[:] = header


def compact_header(
    *,
    key: bytes,
    payload_bytes: int,
    ns_digest: bytes,
    tenant: bytes = b"",
    checksum: bytes | None = None,
    seal: Seal | None = None,
) -> bytes:
    """A compact header: :func:`encode_header` with the same arguments, as bytes."""
    size = compact_bytes(tenant, key)
    return _header(size, key, payload_bytes, ns_digest, tenant, checksum, seal)


def _header(
    size: int,
    key: bytes,
    payload_bytes: int,
    ns_digest: bytes,
    tenant: bytes,
    checksum: bytes | None,
    seal: Seal | None,
) -> bytes:
    """A whole header of ``size`` bytes, checked (:func:`encode_header`)."""
    check_key(key)
    if (checksum is None) == (seal is None):
        raise InvalidArgumentError("a block header takes either a checksum or a seal")
    if seal is not None and (len(seal.nonce) != NONCE_BYTES or len(seal.tag) != TAG_BYTES):
        raise InvalidArgumentError("a seal's nonce must be 12 bytes and its tag 16")
    field = seal.tag if seal is not None else checksum
    if len(field) != 16 or len(ns_digest) != 16:  # type: ignore[arg-type]
        raise InvalidArgumentError("checksum and namespace digest must be 16 bytes each")
    if len(tenant) > MAX_TENANT_BYTES:
        raise InvalidArgumentError(f"tenant is {len(tenant)} bytes, at most {MAX_TENANT_BYTES}")
    if payload_bytes < 0:
        raise InvalidArgumentError(f"payload length must be >= 0, got {payload_bytes}")
    fixed = _FIXED.pack(
        MAGIC,
        FORMAT_VERSION,
        PLAIN if seal is None else SEALED,
        size,
        payload_bytes,
        field,
        ns_digest,
        len(tenant),
        len(key),
        0 if seal is None else seal.key_id,
        _NO_NONCE if seal is None else seal.nonce,
    )
    head = fixed + tenant + key + bytes(size - compact_bytes(tenant, key))  # padded: zeros
    return head + _TRAILER.pack(xxhash.xxh3_64_intdigest(head))


def decode_header(header: Buffer) -> BlockHeader:
    """Parse and self-check a header, compact or padded (``header`` is all of it).
    Raises CorruptBlockError naming what is wrong: it is short, or its magic, version,
    length, kind, tenant or key length or its own checksum."""
    # bytes (a Redis reply) are read as they are: a memoryview would cost more than it saves
    view = header if isinstance(header, bytes) else memoryview(header).cast("B")
    if len(view) < _FIXED.size + _TRAILER.size:
        raise CorruptBlockError(f"header is {len(view)} bytes")
    (magic, version, kind, size, payload_bytes, field, ns, tenant_len, key_len, key_id, nonce) = (
        _FIXED.unpack_from(view, 0)
    )
    if magic != MAGIC:
        raise CorruptBlockError("not a block record (bad magic)")
    if version != FORMAT_VERSION:
        raise CorruptBlockError(f"unsupported format version {version}")
    if size != len(view):
        raise CorruptBlockError(f"header length {size}, but it is {len(view)} bytes")
    (stored,) = _TRAILER.unpack_from(view, size - _TRAILER.size)
    if xxhash.xxh3_64_intdigest(view[: size - _TRAILER.size]) != stored:
        raise CorruptBlockError("header checksum mismatch")
    if kind not in (PLAIN, SEALED):
        raise CorruptBlockError(f"unknown record kind {kind}")
    end = _FIXED.size + tenant_len + key_len
    if key_len == 0 or end > size - _TRAILER.size:
        raise CorruptBlockError(f"bad tenant or key length ({tenant_len}, {key_len})")
    tenant = bytes(view[_FIXED.size : _FIXED.size + tenant_len])
    key = bytes(view[_FIXED.size + tenant_len : end])
    seal = Seal(key_id, nonce, field) if kind == SEALED else None
    return BlockHeader(key, payload_bytes, field, ns, seal, tenant)


def check_header(
    header: BlockHeader,
    *,
    key: bytes | None,
    payload_bytes: int,
    ns_digest: bytes,
    tenant: bytes = b"",
) -> None:
    """Check a decoded header against what the reader expects (``key`` None: a scan,
    where the header names the key); CorruptBlockError for another namespace, tenant,
    key or payload length."""
    if header.namespace_digest != ns_digest:
        raise CorruptBlockError("block belongs to another namespace")
    if header.tenant != tenant:
        raise CorruptBlockError("block belongs to another tenant")
    if key is not None and header.key != key:
        raise CorruptBlockError("block holds another key")
    if header.payload_bytes != payload_bytes:
        raise CorruptBlockError(f"payload length {header.payload_bytes}, expected {payload_bytes}")


def verify_payload(
    header: BlockHeader,
    payload: memoryview | bytes,
    cipher: BlockCipher | None = None,
    checksum: Callable[[Buffer, bytes], bytes] = payload_checksum,
    *,
    into: memoryview | None = None,
) -> None:
    """Verify the payload read under ``header`` (already checked by
    :func:`check_header`), off the loop. Without ``cipher``: refuse a sealed record,
    compare ``checksum(payload, binding)`` with the header's, then copy the payload to
    ``into`` if given. With ``cipher``: refuse a plain record and open the ciphertext
    into ``into`` (one pass; ``into`` is required, and apart from ``payload``).
    CorruptBlockError for a length not the header's, a record of the other kind, or one
    that does not verify (the cipher's UnknownKeyError or AuthenticationError, logged
    once per key id); ``into`` then holds none of it. InvalidArgumentError for a sealed
    record without ``into``, or with one that overlaps ``payload``."""
    if len(payload) != header.payload_bytes:
        raise CorruptBlockError(f"payload is {len(payload)} bytes, expected {header.payload_bytes}")
    if cipher is None:
        if header.seal is not None:
            raise CorruptBlockError(
                f"block is encrypted (key id {header.seal.key_id}), and this tier has no "
                "encryption keyring"
            )
        if checksum(payload, header.binding) != header.payload_checksum:
            raise CorruptBlockError("payload checksum mismatch")
        if into is not None:
            into[:] = payload
        return
    if header.seal is None:
        raise CorruptBlockError("block is not encrypted, and this tier reads only encrypted ones")
    if into is None:
        raise InvalidArgumentError("a sealed payload opens into a buffer of its own: pass into")
    cipher.open_into(header.seal, payload, header.binding, into)
