"""How one block loaded from the Redis tier lands in its host-pool slot, and whether it
verifies.

A block is one Redis string: its compact header (:mod:`tiering.tiers.block_record`), then
its payload. On the tier's own connections the reply to ``GET`` is read in two parts
(:data:`backends.redis.resp.Landing`): the header into a small buffer, then, once the
header checks out (namespace, tenant, key, length, and the record's kind: plain or
sealed, as this tier reads), the payload: a plain one straight into the slot, where its
checksum is verified; a sealed one into a buffer of :class:`LandingBuffers`, from which
it is opened (AES-GCM) into the slot in one pass. A header that does not check out sends
its payload to a scratch buffer instead: a block of another key, tenant or namespace
never reaches the slot. A value that comes back whole (redis-py's path, a redirected
read) is split and verified as it is copied (or opened) into the slot.
"""

from __future__ import annotations

import threading
from typing import Any

from backends.redis.connection import Expected
from backends.redis.control import ResponseError, holds_another_type
from backends.redis.resp import Landed
from tiering.errors import CorruptBlockError
from tiering.security.encryption import BlockCipher
from tiering.tiers.block_record import (
    BlockHeader,
    check_header,
    compact_bytes,
    decode_header,
    verify_payload,
)

# How a load or store of one key failed; the first words of its reason.
MISSING = "not in the redis tier"
CORRUPT = "corrupt block"
REFUSED = "redis refused"


class LandingBuffers:
    """Buffers of ``nbytes`` where sealed payloads land before they are opened into their
    slots (a cipher cannot decrypt a buffer into itself), reused from one load to the
    next. Thread-safe; it keeps as many as were ever in use at once."""

    __slots__ = ("_free", "_lock", "nbytes")

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self._free: list[memoryview] = []
        self._lock = threading.Lock()

    def take(self) -> memoryview:
        """A buffer of :attr:`nbytes`, this caller's until :meth:`give`."""
        with self._lock:
            if self._free:
                return self._free.pop()
        return memoryview(bytearray(self.nbytes))

    def give(self, buffer: memoryview) -> None:
        """Take back a buffer :meth:`take` lent."""
        with self._lock:
            self._free.append(buffer)


class BlockLanding:
    """One key's load into ``slot`` (a view this object releases), checked against
    ``expected`` (``check_header``'s keywords, the key aside) and opened with
    ``cipher`` (None: a plain record) from a buffer of ``buffers``, lent until
    :meth:`release`."""

    __slots__ = (
        "_aside", "_buffers", "_cipher", "_expected", "_header", "_landed", "_record", "_slot",
        "_why", "key",
    )  # fmt: skip

    def __init__(
        self,
        key: bytes,
        slot: memoryview,
        expected: dict[str, Any],
        cipher: BlockCipher | None,
        buffers: LandingBuffers,
    ) -> None:
        self.key = key
        self._slot = slot
        self._expected = expected
        self._cipher = cipher
        self._buffers = buffers
        self._header = bytearray(compact_bytes(expected["tenant"], key))
        self._record: BlockHeader | None = None
        self._why = ""  # the header's fault, found before the payload came
        self._aside: memoryview | None = None  # where a payload not for the slot went
        self._landed: memoryview | None = None  # a sealed payload, to open into the slot

    @property
    def expected(self) -> Expected:
        """The ``GET`` reply of a record of this key: its length, its header's."""
        return Expected(len(self._header) + self._slot.nbytes, len(self._header))

    def sink(self, before: list[Any], length: int) -> tuple[memoryview, Any] | None:
        """The ``GET`` reply's landing: the header, then :meth:`_payload_view`; None
        (read whole, to fail in :meth:`verify`) unless it is as long as a record of
        this key."""
        if before or length != len(self._header) + self._slot.nbytes:
            return None
        return memoryview(self._header), self._payload_view

    def _payload_view(self) -> memoryview:
        """Where the payload lands: if the header checks out and is of this tier's kind,
        the slot (plain) or a landing buffer (sealed), else scratch."""
        try:
            record = self._record = decode_header(self._header)
            check_header(record, key=self.key, **self._expected)
        except CorruptBlockError as exc:
            self._why = f"{CORRUPT}: {exc}"
        else:
            if self._cipher is None and record.seal is None:
                return self._slot
            if self._cipher is not None and record.seal is not None:
                self._landed = self._buffers.take()
                return self._landed
        self._aside = memoryview(bytearray(self._slot.nbytes))
        return self._aside

    def verify(self, value: Any) -> str:
        """Verify what the server answered (a :class:`~backends.redis.resp.Landed` reply,
        a whole value, None, or an error reply): "" if the block is in its slot,
        else why not."""
        if isinstance(value, ResponseError):
            if not holds_another_type(value):
                return f"{REFUSED} the load: {value}"
            return f"{CORRUPT}: the key holds no block ({value})"
        if value is None:
            return MISSING
        try:
            if isinstance(value, Landed):
                if self._why:
                    return self._why
                assert self._record is not None
                if self._landed is not None:
                    verify_payload(self._record, self._landed, self._cipher, into=self._slot)
                else:  # plain in its slot, or a record of the other kind (refused)
                    target = self._slot if self._aside is None else self._aside
                    verify_payload(self._record, target, self._cipher)
                return ""
            split = len(self._header)
            record = decode_header(value[:split])
            check_header(record, key=self.key, **self._expected)
            payload = memoryview(value)[split:]
            verify_payload(record, payload, self._cipher, into=self._slot)
        except CorruptBlockError as exc:
            return f"{CORRUPT}: {exc}"
        return ""

    def release(self) -> None:
        """Let go of the slot (the host pool may be released after) and of the landing
        buffer."""
        self._slot.release()
        landed, self._landed = self._landed, None
        if landed is not None:
            self._buffers.give(landed)
