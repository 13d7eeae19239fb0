"""One Redis tier job's plan, without I/O (a stream, :mod:`backends.redis.streams`,
carries it): what it sends, where the replies land and what it came to.

A store writes each block with one ``SET``, the payload straight from its slot (or
sealed into the thread's buffer). A load reads each ``GET`` reply in two parts: the
header into a small buffer, then, once the header checks out (namespace, tenant, key,
length, plain or sealed as this tier reads), the payload: plain straight into the slot,
checksum verified there; sealed into a landing buffer, opened into the slot in one pass.
A payload under a header that does not check out lands in scratch, never in the slot. A
value that comes back whole (a redirected read) is verified as it is copied (or opened)
into the slot. A job's end releases its views of the host pool.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

from backends.redis.connection import Command, Expected
from backends.redis.control import ResponseError
from backends.redis.resp import Landed, Sink
from tiering.errors import CorruptBlockError
from tiering.security.encryption import TAG_BYTES, BlockCipher
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
    """One pipelined round trip: its ``commands`` (on the keys ``names``), where their
    replies land (as :class:`~backends.redis.connection.RespConnection` takes them), and
    whether they may run in any order, each on a connection of its own (``independent``)."""

    names: Sequence[bytes]
    commands: Sequence[Command]
    sinks: Sequence[Sink | None] | None = None
    expected: Sequence[Expected] | None = None
    independent: bool = False


class Job(Protocol):
    """A job as a stream carries it: ``pipelines`` of them, each built by :meth:`pipeline`
    just before it is sent, its replies given to :meth:`answered` in order; then
    :meth:`finish`, once, also after a failure: it releases what the job holds and
    returns its outcome."""

    pipelines: int

    def pipeline(self, index: int) -> Pipeline: ...

    def answered(self, index: int, replies: list[Any]) -> None: ...

    def finish(self) -> Any: ...


@dataclass(slots=True)
class JobShape:
    """What every job of one tier is made with: the host ``pool`` (slots checked at
    admission), the keys' ``prefix``, the headers' ``record`` keywords, the ``cipher``
    (None: plain), the ``SET`` options (``expiry``), and ``delete(names)`` for values
    that are no blocks."""

    pool: memoryview
    block_bytes: int
    prefix: bytes
    record: dict[str, Any]
    cipher: BlockCipher | None
    per_pipeline: int
    expiry: tuple[Any, ...]
    delete: Callable[[list[bytes]], None]
    # Where sealed payloads land before they are opened into their slots (a cipher
    # cannot decrypt a buffer into itself): a load borrows one, given back at its end.
    landings: queue.SimpleQueue[memoryview] = field(init=False, default_factory=queue.SimpleQueue)
    _sealing: threading.local = field(init=False, default_factory=threading.local)

    def slot(self, block_id: int) -> memoryview:
        start = block_id * self.block_bytes
        return self.pool[start : start + self.block_bytes]

    def pipelines(self, keys: Sequence[bytes]) -> int:
        return -(-len(keys) // self.per_pipeline)

    def seal_buffers(self) -> list[memoryview]:
        """The calling thread's buffers for one pipeline's sealed payloads."""
        views: list[memoryview] | None = getattr(self._sealing, "views", None)
        if views is None:
            stride = self.block_bytes + TAG_BYTES
            arena = memoryview(bytearray(self.per_pipeline * stride))
            views = [arena[i : i + stride] for i in range(0, len(arena), stride)]
            self._sealing.views = views
        return views


class _Job:
    def __init__(self, shape: JobShape, keys: Sequence[bytes], block_ids: Sequence[int]) -> None:
        self._shape, self._keys, self._block_ids = shape, keys, block_ids
        self.pipelines = shape.pipelines(keys)
        self.failed: dict[bytes, str] = {}
        self._held: list[list[Any]] = []  # each pipeline's views of the host pool (or landings)

    def _batch(self, index: int) -> zip[tuple[bytes, int]]:
        first = index * self._shape.per_pipeline
        last = first + self._shape.per_pipeline
        return zip(self._keys[first:last], self._block_ids[first:last], strict=True)

    def finish(self) -> dict[bytes, str]:
        # The client's own frames, kept in reference cycles after an error, may still
        # name these views: released, they no longer pin the host pool.
        for held in self._held:
            for view in held:
                view.release()
        self._held.clear()
        return self.failed


class StoreJob(_Job):
    """A store; :meth:`finish` returns the keys the server refused, with why."""

    def pipeline(self, index: int) -> Pipeline:
        shape, record, cipher = self._shape, self._shape.record, self._shape.cipher
        sealed = shape.seal_buffers() if cipher is not None else []
        names: list[bytes] = []
        commands: list[Command] = []
        views: list[memoryview] = []
        self._held.append(views)
        for i, (key, block_id) in enumerate(self._batch(index)):
            value = shape.slot(block_id)
            views.append(value)
            binding = record_binding(record["ns_digest"], record["tenant"], key)
            if cipher is None:
                seal, checksum = None, payload_checksum(value, binding)
            else:
                # The buffer is free again once the pipeline before is sent: a stream
                # builds a job's next pipeline after that.
                seal, checksum = cipher.seal_into(value, sealed[i], binding), None
                value = sealed[i][: value.nbytes]
            header = compact_header(key=key, checksum=checksum, seal=seal, **record)
            names.append(shape.prefix + key)
            commands.append(("SET", names[-1], (header, value), *shape.expiry))
        # Each SET stands alone (a key given twice in a job keeps either of its values,
        # each a whole, verifiable record): the link may spread them.
        return Pipeline(names, commands, independent=True)

    def answered(self, index: int, replies: list[Any]) -> None:
        for (key, _), reply in zip(self._batch(index), replies, strict=True):
            if isinstance(reply, ResponseError):
                self.failed[key] = f"{REFUSED} the store: {reply}"


class LoadJob(_Job):
    """A load; :meth:`finish` deletes the values that are no blocks of this tier from
    the server and returns why each failed key failed."""

    def pipeline(self, index: int) -> Pipeline:
        shape = self._shape
        landings = [_Landing(key, shape.slot(slot), shape) for key, slot in self._batch(index)]
        self._held.append(landings)
        names = [shape.prefix + landing.key for landing in landings]
        commands = [("GET", name) for name in names]
        sinks, expected = [x.sink for x in landings], [x.expected for x in landings]
        return Pipeline(names, commands, sinks, expected)

    def answered(self, index: int, replies: list[Any]) -> None:
        for landing, value in zip(self._held[index], replies, strict=True):
            if why := landing.verify(value):
                self.failed[landing.key] = why

    def finish(self) -> dict[bytes, str]:
        failed, prefix = super().finish(), self._shape.prefix
        corrupt = [prefix + key for key, why in failed.items() if why.startswith(CORRUPT)]
        if corrupt:
            self._shape.delete(corrupt)
        return failed


class _Landing:
    """One key's load into ``slot`` (a view released by :meth:`release`)."""

    __slots__ = (
        "_aside", "_header", "_landed", "_record", "_shape", "_slot", "_why", "expected", "key",
    )  # fmt: skip

    def __init__(self, key: bytes, slot: memoryview, shape: JobShape) -> None:
        self.key, self._slot, self._shape = key, slot, shape
        self._header = bytearray(compact_bytes(shape.record["tenant"], key))
        # The GET reply of a record of this key: its length, its header's.
        self.expected = Expected(len(self._header) + slot.nbytes, len(self._header))
        self._record: BlockHeader | None = None
        self._why = ""  # the header's fault, found before the payload came
        self._aside: memoryview | None = None  # where a payload not for the slot went
        self._landed: memoryview | None = None  # a sealed payload, to open into the slot

    def sink(self, before: list[Any], length: int) -> tuple[memoryview, Any] | None:
        """The header, then :meth:`_payload_view`; None (read whole, to fail in
        :meth:`verify`) unless the reply is as long as a record of this key."""
        if before or length != self.expected.length:
            return None
        return memoryview(self._header), self._payload_view

    def _payload_view(self) -> memoryview:
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
                try:
                    self._landed = self._shape.landings.get_nowait()
                except queue.Empty:
                    self._landed = memoryview(bytearray(self._slot.nbytes))
                return self._landed
        self._aside = memoryview(bytearray(self._slot.nbytes))
        return self._aside

    def verify(self, value: Any) -> str:
        """Why the server's answer did not put the block, verified, in its slot ("" if it did)."""
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
        self._slot.release()
        landed, self._landed = self._landed, None
        if landed is not None:
            self._shape.landings.put(landed)
