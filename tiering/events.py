"""KV events for routers: a stable wire format for ``take_events()``, and publishers.

**Format** (version 1, ``docs/metrics.md`` has an example). One
:class:`~tiering.abstract.OffloadingEvent` is one line of UTF-8 JSON, ending with
``"\\n"``; a batch is its lines concatenated (JSON lines). Each line is an object whose
keys come in this order::

    {"v": 1, "medium": "CPU", "removed": false, "block_size": 16,
     "block_hashes": ["9f2c…", …], "node": "gpu-7", "tenant": "team-a"}

* ``v``: the format version, 1. Fields may be added within a version (readers ignore
  keys they do not know); a change of meaning or a removed field makes a new version.
* ``medium``: where the blocks are or were: ``"CPU"`` (the primary tier) or a
  secondary tier's type in upper case (``"MEMORY"``, ``"NVME"``, ``"REDIS"``).
* ``removed``: false, the blocks became stored in the medium; true, they left it
  (evicted, or dropped because their bytes did not verify).
* ``block_size``: tokens per block.
* ``block_hashes``: the blocks' hashes as lower-case hex strings, in the event's order.
* ``node``, ``tenant``: opaque strings the publisher was given, present only then.

Within one medium, events come in the order they happened: a reader that applies them
in order (add on stored, discard on removed) knows what the medium holds.

**Publishers.** :class:`CallbackPublisher` hands each encoded batch to a function (an
in-process router, or any transport the caller already runs: Kafka, NATS, HTTP).
:class:`ZmqPublisher` is a ZeroMQ PUB socket, when ``pyzmq`` is installed. PUB/SUB is
chosen because it is what routers already consume (vLLM publishes its KV cache events
over a ZeroMQ PUB socket as ``(topic, sequence, payload)`` frames, and KV-aware routers
subscribe to that), because one publisher serves any number of routers without a
broker, and because a PUB socket never blocks its sender: a slow or absent subscriber
makes it drop messages at its high-water mark instead of stalling the event loop.
Routers detect a drop by a gap in the sequence numbers and resynchronize (for
instance by treating the node's blocks as unknown). :func:`run_publisher` drains an
engine's ``take_events()`` into a publisher periodically.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Iterable, Sequence
from types import TracebackType
from typing import Any, Protocol, Self

from tiering.abstract import OffloadingEvent
from tiering.errors import InvalidArgumentError

logger = logging.getLogger(__name__)

EVENT_FORMAT_VERSION = 1
"""The ``v`` field of every event line this module writes."""
DEFAULT_TOPIC = b"kv-events"
_FIELDS = ("v", "medium", "removed", "block_size", "block_hashes")


def encode_events(
    events: Iterable[OffloadingEvent], *, node: str | None = None, tenant: str | None = None
) -> bytes:
    """``events`` as JSON lines (the module's format); ``b""`` for no events.

    Raises:
        InvalidArgumentError: ``node`` or ``tenant`` is given but not a string, or an
            event's fields have the wrong types (hashes not bytes, block size not an
            int, medium not a string, removed not a bool).
    """
    for label, value in (("node", node), ("tenant", tenant)):
        if value is not None and not isinstance(value, str):
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
        }
        if node is not None:
            record["node"] = node
        if tenant is not None:
            record["tenant"] = tenant
        lines.append(json.dumps(record, separators=(",", ":"), ensure_ascii=False))
        lines.append("\n")
    return "".join(lines).encode()


def decode_events(data: bytes) -> list[dict[str, Any]]:
    """Parse what :func:`encode_events` wrote: one dict per event, in order, with keys
    ``v``, ``medium``, ``removed``, ``block_size``, ``block_hashes`` (as ``bytes``),
    ``node`` and ``tenant`` (None when absent). Unknown keys are ignored; blank lines
    are skipped.

    Raises:
        InvalidArgumentError: not UTF-8 JSON lines of this format, a field missing or of
            the wrong type, or a version other than :data:`EVENT_FORMAT_VERSION` (the
            message names the line).
    """
    if not isinstance(data, bytes | bytearray | memoryview):
        raise InvalidArgumentError(f"data must be bytes, got {type(data).__name__}")
    try:
        text = bytes(data).decode()
    except UnicodeDecodeError as exc:
        raise InvalidArgumentError(f"events are not UTF-8: {exc}") from None
    decoded = []
    for number, line in enumerate(text.split("\n"), start=1):
        if line.strip():
            decoded.append(_decode_line(line, number))
    return decoded


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
    if not isinstance(hashes, list) or not all(isinstance(h, str) for h in hashes):
        raise bad("block_hashes must be a list of hex strings")
    try:
        block_hashes = [bytes.fromhex(h) for h in hashes]
    except ValueError:
        raise bad("block_hashes must be a list of hex strings") from None
    labels = {}
    for label in ("node", "tenant"):
        value = record.get(label)
        if value is not None and not isinstance(value, str):
            raise bad(f"{label} must be a string")
        labels[label] = value
    return {
        "v": version,
        "medium": medium,
        "removed": removed,
        "block_size": size,
        "block_hashes": block_hashes,
        **labels,
    }


# --------------------------------------------------------------------------- publishers


class EventPublisher(Protocol):
    """Something that sends batches of events to routers."""

    def publish(self, events: Sequence[OffloadingEvent]) -> int:
        """Send one batch; returns the number of events sent (0 for an empty batch)."""
        ...

    def close(self) -> None:
        """Release the publisher's resources; idempotent."""
        ...


class CallbackPublisher:
    """Hands each non-empty batch, encoded (:func:`encode_events`), to ``callback``.

    ``callback(payload)`` runs on the caller's thread, synchronously; if it raises, the
    exception propagates to :meth:`publish` (:func:`run_publisher` logs it and goes on).
    """

    def __init__(
        self,
        callback: Callable[[bytes], object],
        *,
        node: str | None = None,
        tenant: str | None = None,
    ) -> None:
        """Raises: InvalidArgumentError if ``callback`` is not callable or a label is
        not a string."""
        if not callable(callback):
            raise InvalidArgumentError(f"callback must be callable, got {callback!r}")
        encode_events((), node=node, tenant=tenant)  # checks the labels
        self._callback = callback
        self.node = node
        self.tenant = tenant

    def publish(self, events: Sequence[OffloadingEvent]) -> int:
        """Encode ``events`` and call the callback once; nothing for no events."""
        if not events:
            return 0
        self._callback(encode_events(events, node=self.node, tenant=self.tenant))
        return len(events)

    def close(self) -> None:
        """Nothing to release."""


class ZmqPublisher:
    """A ZeroMQ PUB socket bound to ``endpoint``; each batch is one message of three
    frames: ``topic``, the batch's sequence number (8 bytes, big-endian, from 0), and
    the payload (:func:`encode_events`).

    ``endpoint`` may use a wildcard port (``"tcp://127.0.0.1:*"``); :attr:`endpoint`
    then holds the bound one. Sends never block: beyond ``send_hwm`` queued messages
    per subscriber, ZeroMQ drops them (``dropped`` counts sends it refused outright).
    Use from one thread (ZeroMQ sockets are not thread-safe); sending is a queue
    handoff to ZeroMQ's I/O thread, so it is fit for the event loop.

    Raises:
        InvalidArgumentError: a label is not a string, ``topic`` is not bytes, or
            ``send_hwm`` is not a positive int.
        ImportError: ``pyzmq`` is not installed.
        zmq.ZMQError: ``endpoint`` cannot be bound.
    """

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
        if not isinstance(send_hwm, int) or isinstance(send_hwm, bool) or send_hwm <= 0:
            raise InvalidArgumentError(f"send_hwm must be a positive int, got {send_hwm!r}")
        self._zmq = zmq
        self.topic = topic
        self.node = node
        self.tenant = tenant
        self.sequence = 0
        """The sequence number of the next batch."""
        self.dropped = 0
        """Batches ZeroMQ refused to queue (counted, never raised)."""
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
        """Send ``events`` as the next batch; nothing for no events. Returns the number
        of events handed to ZeroMQ (0 if it refused the message).

        Raises:
            InvalidArgumentError: the publisher is closed.
        """
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
        """Close the socket without waiting for unsent messages; idempotent."""
        self._socket.close(linger=0)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class _EventSource(Protocol):
    def take_events(self) -> Iterable[OffloadingEvent]: ...


async def run_publisher(
    source: _EventSource, publisher: EventPublisher, *, interval: float = 0.05
) -> None:
    """Every ``interval`` seconds, publish what ``source.take_events()`` returns, until
    cancelled; on cancellation, one last drain is published before it re-raises.

    Run it as a task on the engine's loop; it must be the only caller of
    ``take_events`` (each event is returned once). A publisher that raises is logged
    (once per kind of error) and the events of that batch are lost; the task goes on.

    Raises:
        InvalidArgumentError: ``interval`` is not a positive number.
    """
    if not isinstance(interval, int | float) or not interval > 0:
        raise InvalidArgumentError(f"interval must be a positive number, got {interval!r}")
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


def zmq_available() -> bool:
    """True if ``pyzmq`` can be imported (so :class:`ZmqPublisher` works)."""
    try:
        import zmq  # noqa: F401
    except ImportError:
        return False
    return True


__all__ = [
    "DEFAULT_TOPIC",
    "EVENT_FORMAT_VERSION",
    "CallbackPublisher",
    "EventPublisher",
    "ZmqPublisher",
    "decode_events",
    "encode_events",
    "run_publisher",
    "zmq_available",
]
