"""KV events for routers: the wire format of ``take_events()`` (one JSON line per
:class:`~tiering.core.scheduler_api.OffloadingEvent`; fields, versioning and ordering:
docs/metrics.md), publishers, and :func:`run_publisher` to drain an engine into one."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

from tiering.core.scheduler_api import OffloadingEvent
from tiering.errors import InvalidArgumentError
from tiering.validation import positive_int, seconds

logger = logging.getLogger(__name__)

EVENT_FORMAT_VERSION = 1  # the ``v`` field of every event line this module writes
DEFAULT_TOPIC = b"kv-events"
_FIELDS = ("v", "medium", "removed", "block_size", "block_hashes")


def encode_events(
    events: Iterable[OffloadingEvent], *, node: str | None = None, tenant: str | None = None
) -> bytes:
    """``events`` as JSON lines (``b""`` for none). Raises InvalidArgumentError for a label
    not a string or None, or an event's fields of the wrong types."""
    labels = {k: v for k, v in (("node", node), ("tenant", tenant)) if v is not None}
    for label, value in labels.items():
        if not isinstance(value, str):
            raise InvalidArgumentError(f"{label} must be a string or None, got {value!r}")
    lines = []
    for event in events:
        if not (
            isinstance(event.medium, str)
            and isinstance(event.removed, bool)
            and isinstance(event.block_size, int)
            and not isinstance(event.block_size, bool)
            and all(isinstance(h, bytes) for h in event.block_hashes)
        ):
            raise InvalidArgumentError(f"not an event of bytes hashes: {event!r:.200}")
        record: dict[str, Any] = {
            "v": EVENT_FORMAT_VERSION,
            "medium": event.medium,
            "removed": event.removed,
            "block_size": event.block_size,
            "block_hashes": [h.hex() for h in event.block_hashes],
            **labels,
        }
        lines.append(json.dumps(record, separators=(",", ":"), ensure_ascii=False) + "\n")
    return "".join(lines).encode()


def decode_events(data: bytes) -> list[dict[str, Any]]:
    """Parse what :func:`encode_events` wrote: one dict per event, in order, with
    ``block_hashes`` as ``bytes`` and ``node``/``tenant`` None when absent; unknown keys
    and blank lines are skipped. Raises InvalidArgumentError, naming the line, for
    anything not in this format or of another version."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise InvalidArgumentError(f"data must be bytes, got {type(data).__name__}")
    try:
        text = bytes(data).decode()
    except UnicodeDecodeError as exc:
        raise InvalidArgumentError(f"events are not UTF-8: {exc}") from None
    lines = enumerate(text.split("\n"), start=1)
    return [_decode_line(line, number) for number, line in lines if line.strip()]


def _decode_line(line: str, number: int) -> dict[str, Any]:
    def bad(why: str) -> InvalidArgumentError:
        return InvalidArgumentError(f"event line {number}: {why}: {line[:120]!r}")

    try:
        record = json.loads(line)
    except ValueError:
        raise bad("not JSON") from None
    if not isinstance(record, dict):
        raise bad("not a JSON object")
    missing = [name for name in _FIELDS if name not in record]
    if missing:
        raise bad(f"missing {', '.join(missing)}")
    version = record["v"]
    if type(version) is not int or version != EVENT_FORMAT_VERSION:
        raise bad(f"format version {version!r}; this reader knows {EVENT_FORMAT_VERSION}")
    medium, removed, size = record["medium"], record["removed"], record["block_size"]
    if not isinstance(medium, str) or type(removed) is not bool or type(size) is not int:
        raise bad("medium must be a string, removed a bool and block_size an int")
    hashes = record["block_hashes"]
    try:
        if not isinstance(hashes, list):
            raise TypeError
        block_hashes = [bytes.fromhex(h) for h in hashes]
    except (TypeError, ValueError):
        raise bad("block_hashes must be a list of hex strings") from None
    labels = {label: record.get(label) for label in ("node", "tenant")}
    for label, value in labels.items():
        if value is not None and not isinstance(value, str):
            raise bad(f"{label} must be a string")
    return {**{name: record[name] for name in _FIELDS}, "block_hashes": block_hashes, **labels}


class EventPublisher(Protocol):
    """Sends batches of events to routers: ``publish`` returns how many; ``close`` is idempotent."""

    def publish(self, events: Sequence[OffloadingEvent]) -> int: ...

    def close(self) -> None: ...


class CallbackPublisher:
    """Hands each non-empty batch, encoded, to ``callback(payload)`` (what it raises
    propagates). Raises InvalidArgumentError for a ``callback`` not callable or a bad label."""

    def __init__(
        self,
        callback: Callable[[bytes], object],
        *,
        node: str | None = None,
        tenant: str | None = None,
    ) -> None:
        if not callable(callback):
            raise InvalidArgumentError(f"callback must be callable, got {callback!r}")
        encode_events((), node=node, tenant=tenant)  # checks the labels
        self._callback = callback
        self.node = node
        self.tenant = tenant

    def publish(self, events: Sequence[OffloadingEvent]) -> int:
        if not events:
            return 0
        self._callback(encode_events(events, node=self.node, tenant=self.tenant))
        return len(events)

    def close(self) -> None:
        pass  # nothing to release


class ZmqPublisher(AbstractContextManager["ZmqPublisher"]):
    """A ZeroMQ PUB socket bound to ``endpoint`` (a wildcard port resolved in
    :attr:`endpoint`); a batch is one message: ``topic``, the sequence number (8 bytes,
    big-endian, from 0), the payload. Sends never block: past ``send_hwm`` queued messages
    per subscriber ZeroMQ drops them (``dropped`` counts refusals). Use from one thread.
    Raises InvalidArgumentError for a bad label, ``topic`` or ``send_hwm``; ImportError
    without ``pyzmq``; ``zmq.ZMQError`` if ``endpoint`` cannot be bound."""

    def __init__(
        self,
        endpoint: str = "tcp://127.0.0.1:5557",
        *,
        topic: bytes = DEFAULT_TOPIC,
        node: str | None = None,
        tenant: str | None = None,
        send_hwm: int = 10_000,
    ) -> None:
        import zmq

        encode_events((), node=node, tenant=tenant)
        if not isinstance(topic, bytes):
            raise InvalidArgumentError(f"topic must be bytes, got {topic!r}")
        positive_int("send_hwm", send_hwm)
        self._zmq = zmq
        self.topic = topic
        self.node = node
        self.tenant = tenant
        self.sequence = 0  # of the next batch
        self.dropped = 0  # batches ZeroMQ refused to queue
        self._socket = zmq.Context.instance().socket(zmq.PUB)
        try:
            self._socket.setsockopt(zmq.SNDHWM, send_hwm)
            self._socket.setsockopt(zmq.LINGER, 0)
            self._socket.bind(endpoint)
            self.endpoint: str = self._socket.getsockopt(zmq.LAST_ENDPOINT).decode()
        except BaseException:
            self._socket.close(linger=0)
            raise

    def publish(self, events: Sequence[OffloadingEvent]) -> int:
        """Send ``events`` as the next batch (0 for none or a refused message). Raises
        InvalidArgumentError once closed."""
        if self._socket.closed:
            raise InvalidArgumentError("the ZeroMQ publisher is closed")
        if not events:
            return 0
        payload = encode_events(events, node=self.node, tenant=self.tenant)
        frames = (self.topic, self.sequence.to_bytes(8, "big"), payload)
        self.sequence += 1
        try:
            self._socket.send_multipart(frames, flags=self._zmq.NOBLOCK, copy=False)
        except self._zmq.Again:
            self.dropped += 1
            return 0
        return len(events)

    def close(self) -> None:
        self._socket.close(linger=0)  # unsent messages are dropped

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class _EventSource(Protocol):
    def take_events(self) -> Iterable[OffloadingEvent]: ...


async def run_publisher(
    source: _EventSource, publisher: EventPublisher, *, interval: float = 0.05
) -> None:
    """Every ``interval`` seconds, and once more when cancelled, publish what
    ``source.take_events()`` returns; run it on the engine's loop as its only caller. A
    publisher's error is logged once per kind and loses that batch. Raises
    InvalidArgumentError for a bad ``interval``."""
    seconds("interval", interval, allow_zero=False)
    logged: set[type[BaseException]] = set()

    def drain() -> None:
        events = list(source.take_events())
        try:
            publisher.publish(events)
        except Exception as exc:
            if type(exc) not in logged:
                logged.add(type(exc))
                logger.warning("events: the publisher failed (logged once): %r", exc)

    try:
        while True:
            await asyncio.sleep(interval)
            drain()
    finally:
        drain()
