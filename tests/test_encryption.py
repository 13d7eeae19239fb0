"""Tests of tiering.security.encryption: keyrings, sealing and opening payloads (issue 14)."""

from __future__ import annotations

import base64
import logging
import os

import pytest
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from tiering.errors import CorruptBlockError, InvalidArgumentError
from tiering.security.encryption import (
    TAG_BYTES,
    AuthenticationError,
    BlockCipher,
    Keyring,
    Seal,
    UnknownKeyError,
    keyring_from,
)

KEY_1 = os.urandom(32)
KEY_2 = os.urandom(16)
SPEC = f"2:{base64.b64encode(KEY_2).decode()}, 1:{base64.b64encode(KEY_1).decode()}"
AAD = b"n" * 16 + b"block-key"  # what a record binds: its namespace digest and key


def sealed(cipher: BlockCipher, payload: bytes, aad: bytes = AAD) -> tuple[Seal, bytearray]:
    out = bytearray(len(payload) + TAG_BYTES)
    return cipher.seal_into(memoryview(payload), memoryview(out), aad), out


def test_a_spec_names_keys_by_id_and_the_first_one_seals() -> None:
    keyring = Keyring.parse(SPEC)
    assert keyring.current == 2
    assert keyring.key_ids == (2, 1)
    assert keyring.key(1) == KEY_1 and keyring.key(2) == KEY_2


def test_a_spec_can_come_from_an_environment_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KV_TEST_KEYS", SPEC)
    assert Keyring.parse("env:KV_TEST_KEYS").key_ids == (2, 1)
    monkeypatch.delenv("KV_TEST_KEYS")
    with pytest.raises(InvalidArgumentError, match="'KV_TEST_KEYS' is not set"):
        keyring_from("env:KV_TEST_KEYS", option="tiers[0].encryption")


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("", "entry 1 is not '<key id>:<base64 key>'"),
        ("1=abc", "entry 1 is not"),
        (f"x:{base64.b64encode(KEY_1).decode()}", "entry 1 is not"),
        ("1:not base64!", "key 1 is not valid base64"),
        (f"1:{base64.b64encode(b'short').decode()}", "key 1 is 5 bytes, not 16, 24 or 32"),
        (f"0:{base64.b64encode(KEY_1).decode()}", "key id must be an int in"),
        (f"{SPEC},2:{base64.b64encode(KEY_1).decode()}", "key id 2 appears twice"),
    ],
)
def test_a_bad_spec_is_refused_naming_the_option_never_the_key(spec: str, message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message) as refused:
        keyring_from(spec, option="encryption")
    text = str(refused.value) + repr(refused.value) + repr(refused.value.__cause__)
    assert "encryption" in str(refused.value)
    assert base64.b64encode(KEY_1).decode() not in text and "not base64!" not in text


def test_a_keyring_object_checks_lengths_and_the_current_id() -> None:
    with pytest.raises(
        InvalidArgumentError, match="encryption: key 3 is 10 bytes, not 16, 24 or 32"
    ):
        Keyring({3: b"x" * 10}, 3)
    with pytest.raises(InvalidArgumentError, match="encryption: the current key id 5 is not among"):
        Keyring({1: KEY_1}, 5)
    with pytest.raises(InvalidArgumentError, match="must be a keyring spec string or a Keyring"):
        keyring_from(KEY_1)


def test_no_repr_shows_key_material() -> None:
    keyring = Keyring.parse(SPEC)
    for text in (repr(keyring), repr(BlockCipher(keyring))):
        assert "key_ids=[2, 1]" in text
        for key in (KEY_1, KEY_2):
            assert base64.b64encode(key).decode() not in text and repr(key) not in text


@pytest.mark.parametrize("size", [16, 8192, 2 << 20])
def test_a_sealed_payload_opens_byte_exact_and_hides_the_plaintext(size: int) -> None:
    cipher = BlockCipher(Keyring.parse(SPEC))
    payload = os.urandom(size)
    seal, out = sealed(cipher, payload)
    assert seal.key_id == 2 and len(seal.nonce) == 12 and seal.tag == out[-TAG_BYTES:]
    assert payload[:16] not in out
    back = bytearray(size)
    cipher.open_into(seal, memoryview(out)[:size], AAD, memoryview(back))
    assert back == payload


def test_a_seal_is_standard_aes_gcm() -> None:
    keyring = Keyring.parse(SPEC)
    payload = os.urandom(5000)
    seal, out = sealed(BlockCipher(keyring), payload)
    reference = AESGCM(keyring.key(2)).encrypt(seal.nonce, payload, AAD)  # type: ignore[arg-type]
    assert bytes(out) == reference


def test_two_seals_of_one_payload_differ() -> None:
    cipher = BlockCipher(Keyring.parse(SPEC))
    payload = bytes(4096)
    (first, a), (second, b) = sealed(cipher, payload), sealed(cipher, payload)
    assert first.nonce != second.nonce and a != b


def test_rotation_opens_what_the_old_key_sealed() -> None:
    old = BlockCipher(Keyring({1: KEY_1}, 1))
    payload = os.urandom(4096)
    seal, out = sealed(old, payload)
    rotated = BlockCipher(Keyring.parse(SPEC))
    back = bytearray(len(payload))
    rotated.open_into(seal, memoryview(out)[: len(payload)], AAD, memoryview(back))
    assert back == payload
    assert sealed(rotated, payload)[0].key_id == 2


@pytest.mark.parametrize("change", ["ciphertext", "tag", "associated data", "wrong key"])
def test_anything_altered_fails_authentication(change: str) -> None:
    size = 4096
    cipher = BlockCipher(Keyring.parse(SPEC))
    payload = os.urandom(size)
    seal, out = sealed(cipher, payload)
    aad, reader = AAD, cipher
    if change == "ciphertext":
        out[100] ^= 1
    elif change == "tag":
        seal = Seal(seal.key_id, seal.nonce, bytes([seal.tag[0] ^ 1]) + seal.tag[1:])
    elif change == "associated data":
        aad = b"n" * 16 + b"another-key"
    else:
        reader = BlockCipher(Keyring({2: os.urandom(32)}, 2))
    with pytest.raises(AuthenticationError, match="failed authentication under key id 2"):
        reader.open_into(seal, memoryview(out)[:size], aad, memoryview(bytearray(size)))


def test_an_unknown_key_id_is_a_corrupt_block_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    writer = BlockCipher(Keyring({7: KEY_1}, 7))
    reader = BlockCipher(Keyring.parse(SPEC))
    payload = os.urandom(4096)
    caplog.set_level(logging.ERROR, logger="tiering.security.encryption")
    for _ in range(3):
        seal, out = sealed(writer, payload)
        with pytest.raises(UnknownKeyError) as failed:
            reader.open_into(seal, memoryview(out)[:4096], AAD, memoryview(bytearray(4096)))
        assert isinstance(failed.value, CorruptBlockError)
    assert "key id 7, which the keyring lacks (it holds [2, 1])" in str(failed.value)
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "key id 7" in errors[0].getMessage()


def test_sealing_into_a_short_buffer_is_refused() -> None:
    cipher = BlockCipher(Keyring.parse(SPEC))
    with pytest.raises(InvalidArgumentError, match="seal buffer is 4096 bytes, needs 4112"):
        cipher.seal_into(memoryview(bytes(4096)), memoryview(bytearray(4096)), AAD)


@pytest.mark.parametrize("size", [1, 16, 17, 4096, 2 << 20])
def test_a_payload_opens_and_a_changed_byte_fails(size: int) -> None:
    cipher = BlockCipher(Keyring.parse(SPEC))
    payload = os.urandom(size)
    seal, out = sealed(cipher, payload)
    into = bytearray(os.urandom(size))

    def opened(reader: BlockCipher, ciphertext: bytearray) -> bytearray:
        source = bytes(ciphertext)
        try:
            reader.open_into(seal, memoryview(ciphertext), AAD, memoryview(into))
        finally:
            assert ciphertext == source  # the source is left as it was
        return into

    assert opened(cipher, bytearray(out[:size])) == payload  # the ciphertext alone
    changed = bytearray(out[:size])
    changed[0] ^= 1
    with pytest.raises(AuthenticationError):
        opened(cipher, changed)
    assert into == bytes(size)  # zeroed: none of the unauthenticated plaintext stays
    with pytest.raises(UnknownKeyError):
        opened(BlockCipher(Keyring({9: KEY_1}, 9)), bytearray(out[:size]))


@pytest.mark.parametrize("shift", [0, 1, -1, 4095])
def test_opening_into_a_buffer_that_overlaps_the_ciphertext_is_refused(shift: int) -> None:
    """No release of ``cryptography`` is asked to decrypt in place (51 refuses it): an
    overlap is refused before any byte is written."""
    cipher = BlockCipher(Keyring.parse(SPEC))
    seal, out = sealed(cipher, os.urandom(4096))
    arena = bytearray(3 * 4096)
    arena[4096 : 2 * 4096] = out[:4096]
    before = bytes(arena)
    view = memoryview(arena)
    with pytest.raises(InvalidArgumentError, match="overlaps the ciphertext"):
        cipher.open_into(seal, view[4096 : 2 * 4096], AAD, view[4096 + shift : 2 * 4096 + shift])
    assert arena == before


def test_opening_into_a_buffer_of_another_length_is_refused() -> None:
    cipher = BlockCipher(Keyring.parse(SPEC))
    seal, out = sealed(cipher, bytes(4096))
    with pytest.raises(
        InvalidArgumentError, match="open buffer is 4095 bytes, the ciphertext 4096"
    ):
        cipher.open_into(seal, memoryview(out)[:4096], AAD, memoryview(bytearray(4095)))
