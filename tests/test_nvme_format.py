"""Tests of backends.nvme_format: names, digests and the block header."""

from __future__ import annotations

import os
import re
import struct

import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from backends.nvme_format import (
    HEADER_BYTES,
    MAX_KEY_BYTES,
    check_header,
    check_key,
    decode_header,
    encode_header,
    namespace_digest,
    namespace_dirname,
    payload_checksum,
)
from tiering.errors import CorruptBlockError, InvalidArgumentError

NS = namespace_digest("model=m;dtype=bf16;block=16x2x128;v=1")


def _header(key: bytes = b"k" * 32, payload: bytes = b"p" * 100) -> bytearray:
    page = bytearray(HEADER_BYTES)
    encode_header(
        page,
        key=key,
        payload_bytes=len(payload),
        checksum=payload_checksum(payload),
        ns_digest=NS,
    )
    return page


def _resign(page: bytearray) -> None:
    """Recompute the header checksum so a deliberate field change reaches its own check."""
    struct.pack_into("<Q", page, HEADER_BYTES - 8, xxhash.xxh3_64_intdigest(page[:-8]))


def test_header_round_trips_every_field() -> None:
    payload = os.urandom(4096)
    key = os.urandom(32)
    decoded = decode_header(_header(key, payload))
    assert decoded.key == key
    assert decoded.payload_bytes == len(payload)
    assert decoded.payload_checksum == payload_checksum(payload)
    assert decoded.namespace_digest == NS


def test_header_holds_the_longest_key() -> None:
    key = b"\xff" * MAX_KEY_BYTES
    assert decode_header(_header(key)).key == key


@settings(max_examples=200, deadline=None)
@given(position=st.integers(0, HEADER_BYTES - 1), bit=st.integers(0, 7))
def test_any_flipped_header_bit_is_detected(position: int, bit: int) -> None:
    page = _header()
    page[position] ^= 1 << bit
    with pytest.raises(CorruptBlockError):
        decode_header(page)


def test_bad_magic_is_reported_as_not_a_block_file() -> None:
    with pytest.raises(CorruptBlockError, match="bad magic"):
        decode_header(bytes(HEADER_BYTES))


def test_other_format_version_is_refused_even_with_a_valid_checksum() -> None:
    page = _header()
    struct.pack_into("<H", page, 8, 2)
    _resign(page)
    with pytest.raises(CorruptBlockError, match="unsupported format version 2"):
        decode_header(page)


def test_bad_key_length_is_refused_even_with_a_valid_checksum() -> None:
    page = _header()
    struct.pack_into("<H", page, 56, MAX_KEY_BYTES + 1)
    _resign(page)
    with pytest.raises(CorruptBlockError, match="bad key length"):
        decode_header(page)


def test_short_header_is_refused() -> None:
    with pytest.raises(CorruptBlockError, match="expected 4096"):
        decode_header(_header()[:100])


def test_check_header_refuses_another_namespace() -> None:
    decoded = decode_header(_header())
    with pytest.raises(CorruptBlockError, match="another namespace"):
        check_header(decoded, key=None, payload_bytes=100, ns_digest=namespace_digest("x"))


def test_check_header_refuses_another_key() -> None:
    decoded = decode_header(_header(b"a" * 8))
    with pytest.raises(CorruptBlockError, match="another key"):
        check_header(decoded, key=b"b" * 8, payload_bytes=100, ns_digest=NS)


def test_check_header_refuses_another_payload_length() -> None:
    decoded = decode_header(_header())
    with pytest.raises(CorruptBlockError, match="payload length 100, expected 200"):
        check_header(decoded, key=None, payload_bytes=200, ns_digest=NS)


def test_check_header_accepts_a_matching_block() -> None:
    decoded = decode_header(_header(b"a" * 8))
    check_header(decoded, key=b"a" * 8, payload_bytes=100, ns_digest=NS)


@pytest.mark.parametrize(
    ("key", "message"),
    [
        ("text", "must be bytes"),
        (b"", f"1..{MAX_KEY_BYTES}"),
        (b"x" * (MAX_KEY_BYTES + 1), f"1..{MAX_KEY_BYTES}"),
    ],
)
def test_encode_rejects_a_bad_key_and_leaves_the_buffer_alone(key: object, message: str) -> None:
    page = bytearray(b"\x07" * HEADER_BYTES)
    with pytest.raises(InvalidArgumentError, match=message):
        encode_header(page, key=key, payload_bytes=1, checksum=bytes(16), ns_digest=NS)  # type: ignore[arg-type]
    assert page == bytearray(b"\x07" * HEADER_BYTES)


def test_encode_rejects_a_buffer_of_the_wrong_size() -> None:
    with pytest.raises(InvalidArgumentError, match="4096 bytes"):
        encode_header(bytearray(100), key=b"k", payload_bytes=1, checksum=bytes(16), ns_digest=NS)


def test_encode_rejects_digests_of_the_wrong_size() -> None:
    with pytest.raises(InvalidArgumentError, match="16 bytes"):
        encode_header(
            bytearray(HEADER_BYTES), key=b"k", payload_bytes=1, checksum=b"x", ns_digest=NS
        )


def test_check_key_accepts_bytes_within_limits() -> None:
    assert check_key(b"abc") == b"abc"


def test_namespace_dirname_is_safe_readable_and_deterministic() -> None:
    name = namespace_dirname("meta-llama/Llama-3 8B;dtype=bf16;../../etc")
    assert re.fullmatch(r"[A-Za-z0-9._-]+", name)
    assert name.startswith("meta-llama_Llama-3_8B_dtype")
    assert "/" not in name and ".." not in name.split("-")[0]
    assert name == namespace_dirname("meta-llama/Llama-3 8B;dtype=bf16;../../etc")


def test_namespaces_with_the_same_readable_prefix_get_different_dirs() -> None:
    assert namespace_dirname("model a") != namespace_dirname("model/a")


def test_namespace_dirname_of_punctuation_only_still_has_a_prefix() -> None:
    assert namespace_dirname("///").startswith("ns-")


@pytest.mark.parametrize("namespace", ["", None, b"bytes"])
def test_namespace_dirname_rejects_a_non_string_or_empty(namespace: object) -> None:
    with pytest.raises(InvalidArgumentError, match="non-empty string"):
        namespace_dirname(namespace)  # type: ignore[arg-type]


def test_payload_checksum_sees_one_flipped_bit() -> None:
    payload = bytearray(os.urandom(1 << 20))
    before = payload_checksum(memoryview(payload))
    payload[123456] ^= 0x10
    assert payload_checksum(memoryview(payload)) != before
    assert len(before) == 16
