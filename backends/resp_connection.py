"""The Redis tier's data path: RESP over plain sockets (TCP, unix or TLS), payloads
sent from and received into the host pool's memory with no copy on our side.

redis-py copies every reply through its buffers and builds a ``bytes`` per payload
while it holds the GIL; here a pipeline's requests go out in ``sendmsg`` calls that
gather the slots' views, and each payload is read with ``recv_into`` straight into its
slot (:mod:`backends.resp` parses the rest). Blocking sockets on the tier's I/O
threads release the GIL for every byte they move. The url's credentials (``AUTH``),
database (``SELECT``) and TLS files are honoured; a url asking for anything else
gets no :class:`Endpoint` here, and the tier uses redis-py for it.
"""

from __future__ import annotations

import contextlib
import select
import socket
import ssl
import struct
import threading
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from backends.redis_client import AuthenticationError, RedisConnectionError, ResponseError
from backends.resp import (
    NOT_YET,
    Argument,
    ErrorReply,
    ProtocolError,
    Reply,
    RespReader,
    Sink,
    encode_command,
)

try:
    from redis._parsers.base import BaseParser
    from redis.connection import SSLConnection, UnixDomainSocketConnection, parse_url
except ImportError as exc:  # pragma: no cover - redis_client above raised already
    raise ImportError(f"the redis tier needs redis-py: {exc}") from exc

Buffer = bytes | bytearray | memoryview
Command = Sequence[Argument]

_CHUNK = 32 << 10  # bytes one plain recv asks for (replies' framing, small values)
_AHEAD = 512  # ... and while a reply may land in a sink
_IOV_MAX = 512  # buffers per sendmsg, below the kernel's IOV_MAX
_PLAIN_KEYS = {"host", "port", "username", "password", "db", "path", "connection_class"}


class Endpoint(NamedTuple):
    """Where and how to connect: a TCP ``host``/``port`` or a unix ``path``, the
    url's credentials and database, a TLS context (None: plain), and the timeout of
    every connect, send and receive."""

    host: str
    port: int
    path: str | None
    username: str | None
    password: str | None
    db: int
    tls: ssl.SSLContext | None
    timeout_s: float

    def at(self, host: str, port: int) -> Endpoint:
        """The same credentials and TLS at another node (of a cluster)."""
        return self._replace(host=host, port=port, path=None)

    def __repr__(self) -> str:  # the password stays out of every repr
        where = self.path if self.path is not None else f"{self.host}:{self.port}"
        return f"<Endpoint {where} tls={self.tls is not None}>"


def endpoint_of(url: str, *, timeout_s: float, tls: dict[str, str]) -> Endpoint | None:
    """The endpoint of ``url`` (checked already by ``check_url``) with redis-py's TLS
    argument names in ``tls`` (``ssl_ca_certs``, ``ssl_certfile``, ``ssl_keyfile``);
    None if the url's query asks for an option this path does not implement."""
    options = parse_url(url)
    if set(options) - _PLAIN_KEYS:
        return None
    kind = options.get("connection_class")
    context = None
    if kind is SSLConnection:
        # As redis-py's defaults: the certificate verified, its host name checked.
        context = ssl.create_default_context(cafile=tls.get("ssl_ca_certs"))
        if "ssl_certfile" in tls:
            context.load_cert_chain(tls["ssl_certfile"], tls.get("ssl_keyfile"))
    return Endpoint(
        host=options.get("host", "localhost"),
        port=int(options.get("port", 6379)),
        path=options.get("path") if kind is UnixDomainSocketConnection else None,
        username=options.get("username"),
        password=options.get("password"),
        db=int(options.get("db", 0)),
        tls=context,
        timeout_s=timeout_s,
    )


def response_error(reply: ErrorReply) -> ResponseError:
    """The redis-py error an error reply stands for (MOVED, ASK, WRONGTYPE, ...)."""
    error = BaseParser.parse_error(reply.message)
    return error if isinstance(error, ResponseError) else ResponseError(reply.message)


class RespConnection:
    """One connection to one server, authenticated and on the url's database. Raises
    OSError (a timeout too), RedisConnectionError for a closed connection or bytes
    that are no RESP, and AuthenticationError if ``AUTH`` is refused; after any of
    them the connection is of no further use."""

    def __init__(self, endpoint: Endpoint) -> None:
        self.endpoint = endpoint
        if endpoint.path is not None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(endpoint.timeout_s)
            try:
                sock.connect(endpoint.path)
            except OSError:
                sock.close()
                raise
        else:
            sock = socket.create_connection((endpoint.host, endpoint.port), endpoint.timeout_s)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if endpoint.tls is not None:
            try:
                sock = endpoint.tls.wrap_socket(sock, server_hostname=endpoint.host)
            except OSError:
                sock.close()
                raise
        self._sock: socket.socket = sock
        self._gather = endpoint.tls is None  # an SSL socket has no sendmsg
        self._wait_all = 0
        if endpoint.tls is None:
            # A blocking socket whose kernel timeouts bound each call: a payload then
            # arrives in one recv_into (MSG_WAITALL) and a pipeline goes out in one
            # sendmsg, each a single release of the GIL instead of one per segment.
            limit = struct.pack("ll", int(endpoint.timeout_s), int(endpoint.timeout_s % 1 * 1e6))
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, limit)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, limit)
            sock.settimeout(None)
            self._wait_all = socket.MSG_WAITALL
        self._reader = RespReader()
        self._chunk = memoryview(bytearray(_CHUNK))
        try:
            self._hello()
        except BaseException:
            self.close()
            raise

    def _hello(self) -> None:
        endpoint, commands = self.endpoint, []
        if endpoint.password is not None:
            user = () if endpoint.username is None else (endpoint.username.encode(),)
            commands.append((b"AUTH", *user, endpoint.password.encode()))
        if endpoint.db:
            commands.append((b"SELECT", endpoint.db))
        if not commands:
            return
        for reply in self.round_trip(commands):
            if isinstance(reply, ResponseError):
                raise AuthenticationError(str(reply))

    def round_trip(
        self, commands: Sequence[Command], sinks: Sequence[Sink | None] | None = None
    ) -> list[Reply | ResponseError]:
        """Send ``commands`` pipelined and read their replies, in order; an error reply
        comes back as redis-py's error in its place. ``sinks[i]`` (if given) picks
        where the bulk strings of reply ``i`` land (:data:`backends.resp.Sink`)."""
        buffers: list[Buffer] = []
        for command in commands:
            encode_command(command, buffers)
        self._send(buffers)
        replies: list[Reply | ResponseError] = []
        reader = self._reader
        for i in range(len(commands)):
            reader.sink = sinks[i] if sinks is not None else None
            reply = self._read_reply()
            replies.append(response_error(reply) if isinstance(reply, ErrorReply) else reply)
        reader.sink = None
        return replies

    def _send(self, buffers: list[Buffer]) -> None:
        sock = self._sock
        if not self._gather:
            for buffer in buffers:
                sock.sendall(buffer)
            return
        pending = [memoryview(b).cast("B") if not isinstance(b, bytes) else b for b in buffers]
        first = 0
        while first < len(pending):
            sent = sock.sendmsg(pending[first : first + _IOV_MAX])
            while first < len(pending) and sent >= len(pending[first]):
                sent -= len(pending[first])
                first += 1
            if sent:
                pending[first] = memoryview(pending[first])[sent:]

    def _read_reply(self) -> Reply:
        reader, sock = self._reader, self._sock
        try:
            while (reply := reader.gets()) is NOT_YET:
                into = reader.direct()
                if into is not None:
                    count = sock.recv_into(into, 0, self._wait_all)
                    if count:
                        reader.filled(count)
                else:
                    # Ahead of a sink's bulk string, a little: its framing and header,
                    # and no payload that would be copied twice on its way to the slot.
                    chunk = self._chunk if reader.sink is None else self._chunk[:_AHEAD]
                    count = sock.recv_into(chunk)
                    if count:
                        reader.feed(chunk[:count])
                if not count:
                    raise RedisConnectionError("the redis server closed the connection")
        except ProtocolError as exc:
            raise RedisConnectionError(f"the redis server sent no RESP: {exc}") from None
        return reply  # type: ignore[return-value]

    def stale(self) -> bool:
        """Whether an idle connection has something to read: the server closed it
        (restarted, timed it out) or sent what nobody asked for; either way it is
        closed rather than used."""
        try:
            readable, _, _ = select.select([self._sock], [], [], 0)
        except (OSError, ValueError):  # closed under us
            return True
        return bool(readable)

    def close(self) -> None:
        with contextlib.suppress(OSError):  # best effort: the connection is dropped anyway
            self._sock.close()


class ConnectionPool:
    """Idle connections per endpoint, reused by the I/O threads (each hop holds its
    own while it runs: at most one per running hop and node). :meth:`close` closes the
    idle ones, and a connection given back after it is closed as well."""

    def __init__(self) -> None:
        self._idle: dict[Endpoint, list[RespConnection]] = {}
        self._lock = threading.Lock()
        self._closed = False

    def run(self, endpoint: Endpoint, work: Callable[[RespConnection], Any]) -> Any:
        """``work(connection)`` on an idle connection to ``endpoint`` (or a new one);
        the connection goes back to the pool if ``work`` returns, and is closed if it
        raises (its stream may be half read)."""
        connection = self._take(endpoint) or RespConnection(endpoint)
        try:
            result = work(connection)
        except BaseException:
            connection.close()
            raise
        with self._lock:
            if not self._closed:
                self._idle.setdefault(endpoint, []).append(connection)
                return result
        connection.close()
        return result

    def _take(self, endpoint: Endpoint) -> RespConnection | None:
        """An idle connection to ``endpoint`` that is still good, if one is left."""
        while True:
            with self._lock:
                if self._closed:
                    raise RedisConnectionError("the redis tier is closed")
                idle = self._idle.get(endpoint)
                connection = idle.pop() if idle else None
            if connection is None or not connection.stale():
                return connection
            connection.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, {}
        for connections in idle.values():
            for connection in connections:
                connection.close()


__all__ = [
    "Command",
    "ConnectionPool",
    "Endpoint",
    "RespConnection",
    "endpoint_of",
    "response_error",
]
