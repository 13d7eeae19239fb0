"""What one job of the Redis tier sends, where its replies land and what it came to: its
plan, without I/O. A stream (:mod:`backends.redis.streams`) plans the job on its own
thread, sends its pipelines, hands each one's replies back to the job, then ends it.

A block is one Redis string: its compact header (:mod:`tiering.tiers.block_record`),
then its payload. A store writes each with one ``SET``, the payload straight from its
slot (or with a cipher sealed into the thread's buffer). A load reads each ``GET``
reply in two parts (:data:`backends.redis.resp.Landing`): the header into a small
buffer, then, once the header checks out (namespace, tenant, key, length, and the
record's kind: plain or sealed, as this tier reads), the payload: a plain one straight
into the slot, where its checksum is verified; a sealed one into a buffer of
:class:`LandingBuffers`, from which it is opened (AES-GCM) into the slot in one pass. A
header that does not check out sends its payload to scratch: a block of another key,
tenant or namespace never reaches the slot. A value that comes back whole (a redirected
read) is split and verified as it is copied (or opened) into the slot. A job's end
releases its views of the host pool, so nothing of the job outlives it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

from backends.redis.connection import Command, Expected
from backends.redis.control import ResponseError
from backends.redis.resp import Landed, Sink
from tiering.errors import CorruptBlockError
from tiering.security.encryption import BlockCipher
from tiering.tiers.block_record import (
    BlockHeader,
    check_header,
    compact_bytes,
    compact_header,
    decode_header,
    payload_checksum,
    record_binding,
    verify_payload,
)

# How a load or store of one key failed; the first words of its reason.
MISSING = "not in the redis tier"
CORRUPT = "corrupt block"
REFUSED = "redis refused"


class Pipeline(NamedTuple):
    """One pipelined round trip of a job: its ``commands`` (on the keys ``names``, one
    per command) and where their replies land (``sinks``, ``expected``: as
    :meth:`RespConnection.receive <backends.redis.connection.RespConnection.receive>`
    takes them). ``independent``: the commands may run in any order, each on a
    connection of its own (a link may spread them); else in order, on one."""

    names: Sequence[bytes]
    commands: Sequence[Command]
    sinks: Sequence[Sink | None] | None = None
    expected: Sequence[Expected] | None = None
    independent: bool = False


class Job(Protocol):
    """A job as a stream carries it: ``pipelines`` of them, each built by
    :meth:`pipeline` just before it is sent and answered by :meth:`answered` in the
    order sent, then :meth:`finish`, once."""

    pipelines: int

    def pipeline(self, index: int) -> Pipeline: ...

    def answered(self, index: int, replies: list[Any]) -> None:
        """The replies of pipeline ``index``, in its commands' order."""

    def finish(self) -> Any:
        """Called once all pipelines sent are answered, or the job failed: releases what
        the job holds; returns its outcome."""


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


@dataclass(frozen=True, slots=True)
class JobShape:
    """What every job of one tier is made with: the host ``pool`` of ``block_bytes``
    slots (jobs' slots are checked at admission), the key ``prefix``, the ``record``
    keywords its headers carry, the ``cipher`` (None: plain), blocks ``per_pipeline``,
    the ``SET`` options (``expiry``), the calling thread's sealing buffers
    (``seal_buffers()``), the buffers sealed loads land in, and ``delete(names)`` for
    values that are no blocks."""

    pool: memoryview
    block_bytes: int
    prefix: bytes
    record: dict[str, Any]
    cipher: BlockCipher | None
    per_pipeline: int
    expiry: tuple[Any, ...]
    seal_buffers: Callable[[], list[memoryview]]
    landing_buffers: LandingBuffers
    delete: Callable[[list[bytes]], None]

    def slot(self, block_id: int) -> memoryview:
        start = block_id * self.block_bytes
        return self.pool[start : start + self.block_bytes]

    def pipelines(self, keys: Sequence[bytes]) -> int:
        return -(-len(keys) // self.per_pipeline)


class StoreJob:
    """A store: every block written as one string. :meth:`finish` returns the keys the
    server refused, with why."""

    def __init__(self, shape: JobShape, keys: Sequence[bytes], block_ids: Sequence[int]) -> None:
        self._shape, self._keys, self._block_ids = shape, keys, block_ids
        self.pipelines = shape.pipelines(keys)
        self._views: list[memoryview] = []
        self._sealed = shape.seal_buffers() if shape.cipher is not None else []
        self.failed: dict[bytes, str] = {}

    def pipeline(self, index: int) -> Pipeline:
        shape, record, cipher = self._shape, self._shape.record, self._shape.cipher
        start = index * shape.per_pipeline
        batch = slice(start, start + shape.per_pipeline)
        names: list[bytes] = []
        commands: list[Command] = []
        pairs = zip(self._keys[batch], self._block_ids[batch], strict=True)
        for i, (key, block_id) in enumerate(pairs):
            value = shape.slot(block_id)
            self._views.append(value)
            binding = record_binding(record["ns_digest"], record["tenant"], key)
            if cipher is None:
                seal, checksum = None, payload_checksum(value, binding)
            else:
                # The buffer is free again once the pipeline before is sent: a stream
                # builds a job's next pipeline after that.
                seal, checksum = cipher.seal_into(value, self._sealed[i], binding), None
                value = self._sealed[i][: value.nbytes]
            header = compact_header(key=key, checksum=checksum, seal=seal, **record)
            names.append(shape.prefix + key)
            commands.append(("SET", names[-1], (header, value), *shape.expiry))
        # Each SET stands alone (a key given twice in a job keeps either of its values,
        # each a whole, verifiable record): the link may spread them.
        return Pipeline(names, commands, independent=True)

    def answered(self, index: int, replies: list[Any]) -> None:
        start = index * self._shape.per_pipeline
        batch = self._keys[start : start + self._shape.per_pipeline]
        for key, reply in zip(batch, replies, strict=True):
            if isinstance(reply, ResponseError):
                self.failed[key] = f"{REFUSED} the store: {reply}"

    def finish(self) -> dict[bytes, str]:
        # The client's own frames, kept in reference cycles after an error, may still
        # name these views: released, they no longer pin the host pool.
        for view in self._views:
            view.release()
        self._views.clear()
        return self.failed


class LoadJob:
    """A load: every block read straight into its slot and verified (:class:`_Landing`).
    :meth:`finish` deletes the corrupt values (and values of another type) from the
    server and returns why each failed key failed."""

    def __init__(self, shape: JobShape, keys: Sequence[bytes], block_ids: Sequence[int]) -> None:
        self._shape, self._keys, self._block_ids = shape, keys, block_ids
        self.pipelines = shape.pipelines(keys)
        self._landings: list[list[_Landing]] = []
        self.failed: dict[bytes, str] = {}

    def pipeline(self, index: int) -> Pipeline:
        shape = self._shape
        start = index * shape.per_pipeline
        batch = slice(start, start + shape.per_pipeline)
        landings = [
            _Landing(key, shape.slot(block_id), shape)
            for key, block_id in zip(self._keys[batch], self._block_ids[batch], strict=True)
        ]
        self._landings.append(landings)
        names = [shape.prefix + landing.key for landing in landings]
        commands = [("GET", name) for name in names]
        sinks, expected = [x.sink for x in landings], [x.expected for x in landings]
        return Pipeline(names, commands, sinks, expected)

    def answered(self, index: int, replies: list[Any]) -> None:
        for landing, value in zip(self._landings[index], replies, strict=True):
            why = landing.verify(value)
            if why:
                self.failed[landing.key] = why

    def finish(self) -> dict[bytes, str]:
        for landing in (landing for landings in self._landings for landing in landings):
            landing.release()
        self._landings.clear()
        prefix = self._shape.prefix
        corrupt = [prefix + key for key, why in self.failed.items() if why.startswith(CORRUPT)]
        if corrupt:
            self._shape.delete(corrupt)
        return self.failed


class _Landing:
    """One key's load into ``slot`` (a view this object releases), checked against the
    shape's record keywords and opened with its cipher from a landing buffer, lent until
    :meth:`release`."""

    __slots__ = ("_aside", "_header", "_landed", "_record", "_shape", "_slot", "_why", "key")

    def __init__(self, key: bytes, slot: memoryview, shape: JobShape) -> None:
        self.key, self._slot, self._shape = key, slot, shape
        self._header = bytearray(compact_bytes(shape.record["tenant"], key))
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
        cipher = self._shape.cipher
        try:
            record = self._record = decode_header(self._header)
            check_header(record, key=self.key, **self._shape.record)
        except CorruptBlockError as exc:
            self._why = f"{CORRUPT}: {exc}"
        else:
            if cipher is None and record.seal is None:
                return self._slot
            if cipher is not None and record.seal is not None:
                self._landed = self._shape.landing_buffers.take()
                return self._landed
        self._aside = memoryview(bytearray(self._slot.nbytes))
        return self._aside

    def verify(self, value: Any) -> str:
        """Verify what the server answered (a :class:`~backends.redis.resp.Landed` reply,
        a whole value, None, or an error reply): "" if the block is in its slot, else
        why not."""
        cipher = self._shape.cipher
        if isinstance(value, ResponseError):
            if not str(value).startswith("WRONGTYPE"):
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
                    verify_payload(self._record, self._landed, cipher, into=self._slot)
                else:  # plain in its slot, or a record of the other kind (refused)
                    target = self._slot if self._aside is None else self._aside
                    verify_payload(self._record, target, cipher)
                return ""
            split = len(self._header)
            record = decode_header(value[:split])
            check_header(record, key=self.key, **self._shape.record)
            verify_payload(record, memoryview(value)[split:], cipher, into=self._slot)
        except CorruptBlockError as exc:
            return f"{CORRUPT}: {exc}"
        return ""

    def release(self) -> None:
        """Let go of the slot (the host pool may be released after) and of the landing
        buffer."""
        self._slot.release()
        landed, self._landed = self._landed, None
        if landed is not None:
            self._shape.landing_buffers.give(landed)


__all__ = ["CORRUPT", "MISSING", "REFUSED", "Job", "JobShape", "LoadJob", "Pipeline", "StoreJob"]
