"""Authenticated encryption of block payloads at rest: AES-GCM under a keyring, each
block under the current key and a fresh random 96-bit nonce, bound to its record by the
associated data; every key id held opens. Key material never appears in an error, a log
line or a ``repr``. Specs (``"2:<base64 key>,1:<base64 key>"`` or ``"env:VARIABLE"``),
key sizes and rotation: docs/security.md."""

from __future__ import annotations

import binascii
import logging
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from tiering.errors import CorruptBlockError, InvalidArgumentError

NONCE_BYTES = 12
TAG_BYTES = 16
KEY_SIZES = (16, 24, 32)
MAX_KEY_ID = 2**32 - 1
ENV_PREFIX = "env:"

_log = logging.getLogger(__name__)
_E = TypeVar("_E", bound=CorruptBlockError)
Buffer = memoryview | bytes | bytearray


class UnknownKeyError(CorruptBlockError):
    """A block was sealed under a key id the keyring does not hold; never served."""


class AuthenticationError(CorruptBlockError):
    """A sealed block failed authentication (wrong key, altered or moved bytes); never served."""


class Keyring:
    """Encryption keys by id (ints in ``[1, 2**32)`` to 16, 24 or 32 bytes); ``current``
    seals, every one opens. Raises InvalidArgumentError (naming ``source`` and ids, never
    key bytes) for no keys, a bad id or key length, or ``current`` not among the ids."""

    __slots__ = ("_keys", "current")

    def __init__(
        self, keys: Mapping[int, bytes], current: int, *, source: str = "encryption"
    ) -> None:
        if not isinstance(keys, Mapping) or not keys:
            raise InvalidArgumentError(f"{source}: keys must be a non-empty mapping of id to key")
        for key_id, key in keys.items():
            _check_key_id(key_id, source)
            if not isinstance(key, bytes | bytearray) or len(key) not in KEY_SIZES:
                got = f"{len(key)} bytes" if isinstance(key, bytes | bytearray) else "no bytes"
                raise InvalidArgumentError(
                    f"{source}: key {key_id} is {got}, not 16, 24 or 32 bytes"
                )
        _check_key_id(current, source)
        if current not in keys:
            raise InvalidArgumentError(
                f"{source}: the current key id {current} is not among the key ids {sorted(keys)}"
            )
        self._keys = {key_id: bytes(key) for key_id, key in keys.items()}
        self.current = current

    @classmethod
    def parse(cls, spec: str, *, option: str = "encryption") -> Keyring:
        """A keyring from a spec, its first entry current. Raises InvalidArgumentError
        naming ``option`` (and an ``env:`` variable), never quoting the spec, for a bad
        spec, an unset variable, a bad or repeated id, or a bad key."""
        if not isinstance(spec, str):
            raise InvalidArgumentError(
                f"{option} must be a keyring spec string, got {type(spec).__name__}"
            )
        source = option
        if spec.startswith(ENV_PREFIX):
            variable = spec[len(ENV_PREFIX) :]
            value = os.environ.get(variable)
            if not variable or value is None:
                raise InvalidArgumentError(
                    f"{option}: environment variable {variable!r} is not set"
                )
            spec, source = value, f"{option} (from ${variable})"
        keys: dict[int, bytes] = {}
        for position, entry in enumerate(spec.split(","), 1):
            key_id_text, sep, encoded = entry.strip().partition(":")
            if not sep or not key_id_text.strip().isdigit():
                raise InvalidArgumentError(
                    f"{source}: entry {position} is not '<key id>:<base64 key>'"
                )
            key_id = int(key_id_text)
            if key_id in keys:
                raise InvalidArgumentError(f"{source}: key id {key_id} appears twice")
            try:
                keys[key_id] = binascii.a2b_base64(encoded.strip(), strict_mode=True)
            except (binascii.Error, ValueError):
                raise InvalidArgumentError(
                    f"{source}: key {key_id} is not valid base64"
                ) from None  # the cause would quote the key
        return cls(keys, next(iter(keys)), source=source)  # split yields at least one entry

    @property
    def key_ids(self) -> tuple[int, ...]:
        """Every key id held, the current one first."""
        return (self.current, *(k for k in self._keys if k != self.current))

    def key(self, key_id: int) -> bytes | None:
        return self._keys.get(key_id)

    def __repr__(self) -> str:
        return f"Keyring(current={self.current}, key_ids={list(self.key_ids)})"


def _check_key_id(key_id: object, source: str) -> None:
    if isinstance(key_id, bool) or not isinstance(key_id, int) or not 1 <= key_id <= MAX_KEY_ID:
        raise InvalidArgumentError(f"{source}: key id must be an int in [1, 2**32), got {key_id!r}")


def keyring_from(value: object, *, option: str = "encryption") -> Keyring | None:
    """The keyring a tier option names (None, a :class:`Keyring` or a spec string);
    InvalidArgumentError as :meth:`Keyring.parse`, or for another type."""
    if value is None or isinstance(value, Keyring):
        return value
    if isinstance(value, str):
        return Keyring.parse(value, option=option)
    raise InvalidArgumentError(
        f"{option} must be a keyring spec string or a Keyring, got {type(value).__name__}"
    )


@dataclass(frozen=True, slots=True)
class Seal:
    """What a reader needs besides the ciphertext: the key id, the nonce and the tag."""

    key_id: int
    nonce: bytes
    tag: bytes


class BlockCipher:
    """Seals and opens block payloads with AES-GCM under a :class:`Keyring`; thread-safe
    (tiers call it on their worker threads, never on the loop). Raises
    InvalidArgumentError without the ``cryptography`` package."""

    __slots__ = ("_aead", "_algorithms", "_lock", "_reported", "keyring")

    def __init__(self, keyring: Keyring) -> None:
        try:
            from cryptography.hazmat.primitives.ciphers import algorithms
            from cryptography.hazmat.primitives.ciphers.aead import AESGCM
        except ImportError as exc:  # pragma: no cover - exercised only without the extra
            raise InvalidArgumentError(
                "encryption needs the 'cryptography' package: pip install 'kv-tiering[encryption]'"
            ) from exc
        self.keyring = keyring
        # A one-shot AESGCM seals; an AES algorithm makes the cipher contexts that open.
        keys = keyring._keys.items()
        self._aead: dict[int, Any] = {key_id: AESGCM(key) for key_id, key in keys}
        self._algorithms: dict[int, Any] = {key_id: algorithms.AES(key) for key_id, key in keys}
        self._reported: set[tuple[type[CorruptBlockError], int]] = set()
        self._lock = threading.Lock()

    def seal_into(self, payload: memoryview, out: memoryview, aad: bytes) -> Seal:
        """Encrypt ``payload`` under the current key into ``out[:len(payload)]``, the tag
        after it (and in the returned :class:`Seal`). Raises InvalidArgumentError if
        ``out`` is shorter than ``len(payload) + TAG_BYTES``."""
        n = len(payload)
        if len(out) < n + TAG_BYTES:
            raise InvalidArgumentError(f"seal buffer is {len(out)} bytes, needs {n + TAG_BYTES}")
        nonce = os.urandom(NONCE_BYTES)
        key_id = self.keyring.current
        self._aead[key_id].encrypt_into(nonce, payload, aad, out[: n + TAG_BYTES])
        return Seal(key_id, nonce, bytes(out[n : n + TAG_BYTES]))

    def open_into(self, seal: Seal, ciphertext: Buffer, aad: bytes, out: memoryview) -> None:
        """Decrypt and verify ``ciphertext`` (its tag is ``seal.tag``) into ``out``, a
        writable buffer as long as it and apart from it (``cryptography`` refuses to
        decrypt in place); after a failure ``out`` holds nothing decrypted. Raises
        UnknownKeyError (no key ``seal.key_id``) or AuthenticationError, and
        InvalidArgumentError if ``out`` is not as long as ``ciphertext`` or overlaps it."""
        from cryptography.exceptions import InvalidTag
        from cryptography.hazmat.primitives.ciphers import Cipher, modes

        algorithm = self._algorithms.get(seal.key_id)
        if algorithm is None:
            held = list(self.keyring.key_ids)
            why = f"which the keyring lacks (it holds {held})"
            message = f"block sealed under key id {seal.key_id}, {why}"
            raise self._reported_error(UnknownKeyError, seal.key_id, message)
        n = len(ciphertext)
        if len(out) != n:
            raise InvalidArgumentError(f"open buffer is {len(out)} bytes, the ciphertext {n}")
        if np.may_share_memory(np.frombuffer(ciphertext, np.uint8), np.frombuffer(out, np.uint8)):
            raise InvalidArgumentError("the open buffer overlaps the ciphertext")
        decryptor = Cipher(algorithm, modes.GCM(seal.nonce, seal.tag)).decryptor()
        decryptor.authenticate_additional_data(aad)
        decryptor.update_into(ciphertext, out)
        # No exception is kept in a local: it would hold this frame (and ``out``, a view
        # of the caller's buffer) in a reference cycle until the next collection.
        try:
            decryptor.finalize()
            return
        except InvalidTag:
            pass
        out[:] = bytes(n)  # it decrypted unauthenticated bytes: none of them stays
        why = "a wrong key under that id, or bytes altered or moved"
        message = f"block failed authentication under key id {seal.key_id}: {why}"
        raise self._reported_error(AuthenticationError, seal.key_id, message)

    def _reported_error(self, error: type[_E], key_id: int, message: str) -> _E:
        """``error(message)``, logged the first time this kind of failure meets ``key_id``."""
        with self._lock:
            first = (error, key_id) not in self._reported
            self._reported.add((error, key_id))
        if first:
            _log.error("%s (reported once per key id; such blocks are misses)", message)
        return error(message)

    def __repr__(self) -> str:
        return f"BlockCipher({self.keyring!r})"
