"""The block record shared by the NVMe and Redis tiers (``tiering.tiers.block_record``), on
its own: round trips in both layouts, plain and sealed, and every tampering refused."""

from __future__ import annotations

import os
import struct

import pytest

from tiering.errors import CorruptBlockError, InvalidArgumentError
from tiering.security.encryption import BlockCipher, Keyring, Seal
from tiering.tiers.block_record import (
    HEADER_BYTES,
    MAX_KEY_BYTES,
    BlockHeader,
    check_header,
    check_key,
    compact_bytes,
    compact_header,
    decode_header,
    encode_header,
    namespace_digest,
    payload_checksum,
    record_binding,
    verify_payload,
)

NS = namespace_digest("model-a")
KEY = b"block-hash-0001".ljust(32, b".")
TENANT = b"tenant-a"
PAYLOAD = os.urandom(4096)


def _cipher() -> BlockCipher | None:
    try:
        return BlockCipher(Keyring({1: os.urandom(32)}, current=1))
    except ImportError:  # pragma: no cover - without the encryption extra
        return None


def plain_record(padded: bool, tenant: bytes = TENANT) -> tuple[bytes, bytes]:
    """A plain record's header (compact or padded) and payload."""
    checksum = payload_checksum(PAYLOAD, record_binding(NS, tenant, KEY))
    fields = dict(key=KEY, tenant=tenant, payload_bytes=len(PAYLOAD), ns_digest=NS)
    if not padded:
        return compact_header(**fields, checksum=checksum), PAYLOAD
    page = bytearray(HEADER_BYTES)
    encode_header(page, **fields, checksum=checksum)
    return bytes(page), PAYLOAD


def sealed_record(cipher: BlockCipher, padded: bool) -> tuple[bytes, bytes]:
    """A sealed record's header (compact or padded) and ciphertext."""
    out = bytearray(len(PAYLOAD) + 16)
    seal = cipher.seal_into(memoryview(PAYLOAD), memoryview(out), record_binding(NS, TENANT, KEY))
    fields = dict(key=KEY, tenant=TENANT, payload_bytes=len(PAYLOAD), ns_digest=NS, seal=seal)
    if padded:
        page = bytearray(HEADER_BYTES)
        encode_header(page, **fields)
        return bytes(page), bytes(out[: len(PAYLOAD)])
    return compact_header(**fields), bytes(out[: len(PAYLOAD)])


def read(header: bytes, payload: bytes, cipher: BlockCipher | None = None, **expected) -> bytes:
    """Verify a record as a reader of ``expected`` (key, tenant, namespace, length) and
    return the payload it lands."""
    record = decode_header(header)
    want = dict(key=KEY, tenant=TENANT, payload_bytes=len(PAYLOAD), ns_digest=NS) | expected
    check_header(record, **want)
    into = memoryview(bytearray(len(payload)))
    verify_payload(record, payload, cipher, into=into)
    return bytes(into)


@pytest.mark.parametrize("padded", [False, True], ids=["compact", "padded"])
def test_a_plain_record_round_trips(padded: bool) -> None:
    header, payload = plain_record(padded)
    assert len(header) == (HEADER_BYTES if padded else compact_bytes(TENANT, KEY))
    record = decode_header(header)
    assert (record.key, record.tenant, record.namespace_digest) == (KEY, TENANT, NS)
    assert record.seal is None and record.payload_bytes == len(PAYLOAD)
    assert read(header, payload) == PAYLOAD


@pytest.mark.parametrize("padded", [False, True], ids=["compact", "padded"])
def test_a_sealed_record_round_trips_and_holds_no_plaintext_checksum(padded: bool) -> None:
    cipher = _cipher()
    if cipher is None:
        pytest.skip("pip install 'kv-tiering[encryption]'")
    header, sealed = sealed_record(cipher, padded)
    assert sealed != PAYLOAD
    assert payload_checksum(PAYLOAD, record_binding(NS, TENANT, KEY)) not in header
    record = decode_header(header)
    assert record.seal is not None and record.seal.key_id == 1
    assert read(header, sealed, cipher) == PAYLOAD


def test_a_sealed_payload_opens_only_into_a_buffer_of_its_own() -> None:
    cipher = _cipher()
    if cipher is None:
        pytest.skip("pip install 'kv-tiering[encryption]'")
    header, sealed = sealed_record(cipher, padded=False)
    record, landed = decode_header(header), memoryview(bytearray(sealed))
    with pytest.raises(InvalidArgumentError, match="pass into"):
        verify_payload(record, landed, cipher)
    with pytest.raises(InvalidArgumentError, match="overlaps"):
        verify_payload(record, landed, cipher, into=landed)
    assert bytes(landed) == sealed  # refused before a byte changed


def test_a_sealed_payload_that_fails_leaves_nothing_of_it_in_into() -> None:
    cipher = _cipher()
    if cipher is None:
        pytest.skip("pip install 'kv-tiering[encryption]'")
    header, sealed = sealed_record(cipher, padded=False)
    changed = bytearray(sealed)
    changed[len(changed) // 2] ^= 1
    into = memoryview(bytearray(b"\xff" * len(sealed)))
    with pytest.raises(CorruptBlockError, match="authentication"):
        verify_payload(decode_header(header), bytes(changed), cipher, into=into)
    assert bytes(into) == bytes(len(sealed))  # zeroed: no unauthenticated plaintext


def test_a_record_without_a_tenant_is_one_with_an_empty_tenant() -> None:
    header, payload = plain_record(padded=True, tenant=b"")
    assert decode_header(header).tenant == b""
    assert read(header, payload, tenant=b"") == PAYLOAD


@pytest.mark.parametrize("padded", [False, True], ids=["compact", "padded"])
def test_every_byte_of_a_header_is_covered(padded: bool) -> None:
    """A flip of any byte, padding and trailer included, is refused: no field escapes
    the header's own checksum."""
    header, _ = plain_record(padded)
    for i in range(len(header)):
        damaged = bytearray(header)
        damaged[i] ^= 0x01
        with pytest.raises(CorruptBlockError):
            decode_header(bytes(damaged))


@pytest.mark.parametrize(
    ("expected", "message"),
    [
        ({"ns_digest": namespace_digest("model-b")}, "another namespace"),
        ({"tenant": b"tenant-b"}, "another tenant"),
        ({"tenant": b""}, "another tenant"),
        ({"key": b"another-key"}, "another key"),
        ({"payload_bytes": len(PAYLOAD) + 1}, "payload length"),
    ],
)
def test_a_record_of_another_namespace_tenant_key_or_length_is_refused(
    expected: dict, message: str
) -> None:
    header, payload = plain_record(padded=False)
    with pytest.raises(CorruptBlockError, match=message):
        read(header, payload, **expected)


@pytest.mark.parametrize("field", ["key", "tenant", "namespace", "payload"])
def test_a_payload_under_a_header_forged_for_another_record_fails_its_check(
    field: str,
) -> None:
    """A header made afresh (its own checksum sound) for another key, tenant or
    namespace, around a payload written for the first: the plain checksum and the seal
    each cover the binding, so neither verifies; nor does a changed payload."""
    cipher = _cipher()
    other = {"key": b"other-key", "tenant": b"tenant-b", "namespace": namespace_digest("b")}
    for sealed in [False, True] if cipher is not None else [False]:
        header, payload = sealed_record(cipher, False) if sealed else plain_record(False)
        record = decode_header(header)
        fields = dict(key=record.key, tenant=record.tenant, ns_digest=NS)
        if field == "payload":
            payload = bytes([payload[0] ^ 1]) + payload[1:]
        else:
            fields[{"namespace": "ns_digest"}.get(field, field)] = other[field]
        forged = compact_header(
            **fields,
            payload_bytes=record.payload_bytes,
            checksum=None if sealed else record.payload_checksum,
            seal=record.seal,
        )
        expect = {
            "key": fields["key"],
            "tenant": fields["tenant"],
            "ns_digest": fields["ns_digest"],
        }
        with pytest.raises(CorruptBlockError, match="authentication" if sealed else "checksum"):
            read(forged, payload, cipher if sealed else None, **expect)


def test_a_reader_of_one_kind_never_serves_the_other() -> None:
    cipher = _cipher()
    if cipher is None:
        pytest.skip("pip install 'kv-tiering[encryption]'")
    header, sealed = sealed_record(cipher, padded=False)
    into = memoryview(bytearray(len(sealed)))
    with pytest.raises(CorruptBlockError, match="is encrypted"):
        verify_payload(decode_header(header), sealed, None, into=into)
    assert bytes(into) == bytes(len(sealed))  # not even written
    header, payload = plain_record(padded=False)
    with pytest.raises(CorruptBlockError, match="not encrypted"):
        verify_payload(decode_header(header), payload, cipher, into=into)


def test_a_payload_of_another_length_is_refused() -> None:
    header, payload = plain_record(padded=False)
    with pytest.raises(CorruptBlockError, match="payload is"):
        verify_payload(decode_header(header), payload[:-1])


def test_other_formats_and_lengths_are_refused_with_what_is_wrong() -> None:
    header, _ = plain_record(padded=False)
    with pytest.raises(CorruptBlockError, match="bad magic"):
        decode_header(b"KVTRDS\r\n" + header[8:])
    version = bytearray(header)
    struct.pack_into("<H", version, 8, 4)
    with pytest.raises(CorruptBlockError, match="format version 4"):
        decode_header(bytes(version))
    with pytest.raises(CorruptBlockError, match="header length"):
        decode_header(header + bytes(8))
    with pytest.raises(CorruptBlockError, match="header is 10 bytes"):
        decode_header(header[:10])


def test_a_header_takes_a_checksum_or_a_seal_and_sound_fields() -> None:
    fields = dict(key=KEY, payload_bytes=16, ns_digest=NS)
    seal = Seal(1, bytes(12), bytes(16))
    for bad in (
        {},  # neither
        {"checksum": bytes(16), "seal": seal},  # both
        {"checksum": bytes(15)},
        {"seal": Seal(1, bytes(11), bytes(16))},
        {"checksum": bytes(16), "tenant": bytes(0x10000)},
        {"checksum": bytes(16), "payload_bytes": -1},
        {"checksum": bytes(16), "key": b""},
    ):
        with pytest.raises(InvalidArgumentError):
            compact_header(**(fields | bad))
    page = bytearray(HEADER_BYTES - 1)
    with pytest.raises(InvalidArgumentError, match="header buffer"):
        encode_header(page, **fields, checksum=bytes(16))
    assert page == bytearray(HEADER_BYTES - 1)  # unchanged
    with pytest.raises(InvalidArgumentError, match="header buffer"):  # does not fit a page
        too_long = {"tenant": b"t" * 200, "key": b"k" * MAX_KEY_BYTES}
        encode_header(bytearray(HEADER_BYTES), **fields | too_long, checksum=bytes(16))


def test_keys_are_checked() -> None:
    assert check_key(b"k" * MAX_KEY_BYTES) == b"k" * MAX_KEY_BYTES
    for bad in (b"", b"k" * (MAX_KEY_BYTES + 1), "text"):
        with pytest.raises(InvalidArgumentError, match="block key"):
            check_key(bad)


def test_the_binding_tells_tenant_and_key_apart() -> None:
    assert record_binding(NS, b"ab", b"c") != record_binding(NS, b"a", b"bc")
    assert BlockHeader(KEY, 1, bytes(16), NS, None, TENANT).binding == record_binding(
        NS, TENANT, KEY
    )
