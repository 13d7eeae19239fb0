"""One RESP connection of the Redis tier (TCP, unix or TLS), with no copy on our side:
requests go out in ``sendmsg`` calls that gather the slots' views, and each payload is
received straight into its slot (an expected reply in one ``recvmsg_into`` with the next
reply's framing and head, any other through :mod:`backends.redis.resp`'s reader).
"""

from __future__ import annotations

import contextlib
import math
import select
import socket
import ssl
import struct
import time
from collections import deque
from collections.abc import Iterable, Sequence
from typing import NamedTuple

from backends.redis import resp
from backends.redis.control import (
    AuthenticationError,
    BaseParser,
    RedisConnectionError,
    RedisTimeoutError,
    ResponseError,
)
from backends.redis.resp import Buffer, Reply, Sink

Command = Sequence[resp.Argument]
Sinks = Sequence[Sink | None] | None
Replies = list[Reply | ResponseError]

_CHUNK = 32 << 10  # bytes one plain recv asks for (replies' framing, small values)
_AHEAD = 512  # ... and while a reply may land in a sink
_PAD_FRAMING = 32  # bytes the padding reply holds beyond its padding, at most
_IOV_MAX = 512  # buffers per sendmsg, below the kernel's IOV_MAX
_SLACK_S = 0.005  # how far off the deadline a socket's timeout may end before it is set again
# What a socket call raises when its timeout ends it with nothing moved (EAGAIN; TLS).
_TIMED_OUT = (BlockingIOError, TimeoutError)


class Expected(NamedTuple):
    """The bulk string a reply is expected to be: its ``length``, and how many of its
    first bytes (``head``) land in the sink's first view before the rest."""

    length: int
    head: int


Expecteds = Sequence[Expected] | None


class Endpoint(NamedTuple):
    """Where and how to connect (from the url), and the time every call has."""

    host: str
    port: int
    path: str | None
    username: str | None
    password: str | None
    db: int
    client_name: str | None
    tls: ssl.SSLContext | None
    keepalive: bool
    timeout_s: float

    def __repr__(self) -> str:  # the password stays out of every repr
        where = self.path if self.path is not None else f"{self.host}:{self.port}"
        return f"<Endpoint {where} tls={self.tls is not None}>"


class RespConnection:
    """One connection to one server, authenticated, named and on the url's database
    (as redis-py's), made by ``deadline`` (a :func:`time.monotonic` time; None:
    ``timeout_s`` from now). Each call ends by its own deadline. Raises
    RedisTimeoutError once a deadline has passed, OSError for a connection that fails,
    RedisConnectionError for a closed connection or bytes that are no RESP,
    AuthenticationError if its set-up is refused; after any, the connection is useless."""

    def __init__(self, endpoint: Endpoint, deadline: float | None = None) -> None:
        self.endpoint = endpoint
        self._deadline = time.monotonic() + endpoint.timeout_s if deadline is None else deadline
        self._tls = endpoint.tls is not None
        # Plain: kernel timeouts bound each call (_arm), so a payload arrives in one
        # recv_into (MSG_WAITALL) and a pipeline leaves in one sendmsg, one GIL release.
        self._wait_all = 0 if self._tls else socket.MSG_WAITALL
        self._armed = [math.inf, math.inf]  # SO_RCVTIMEO, SO_SNDTIMEO as last set (s)
        self._reader = resp.RespReader()
        self._chunk = memoryview(bytearray(_CHUNK))
        self._ahead = memoryview(bytearray(_CHUNK))  # a reply's framing and head, read ahead
        self._crlf = memoryview(bytearray(2))
        # Pipelines sent, replies unread: sizes, sinks, expected replies, padding, deadlines.
        self._sent: deque[tuple[int, Sinks, Expecteds, int, float]] = deque()
        sock = None
        try:
            if endpoint.path is not None:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.settimeout(self._left())
                sock.connect(endpoint.path)
            else:
                sock = socket.create_connection((endpoint.host, endpoint.port), self._left())
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, endpoint.keepalive)
            if endpoint.tls is not None:
                sock.settimeout(self._left())  # the handshake's, as a whole
                sock = endpoint.tls.wrap_socket(sock, server_hostname=endpoint.host)
            else:
                sock.settimeout(None)
            self._sock: socket.socket = sock
            self._hello()
        except BaseException:
            if sock is not None:
                with contextlib.suppress(OSError):  # best effort: the error raised matters
                    sock.close()
            raise

    def _left(self) -> float:
        """Seconds left until the current call's deadline, or RedisTimeoutError."""
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise RedisTimeoutError(
                f"the redis server did not answer within timeout_s ({self.endpoint.timeout_s} s)"
            )
        return left

    def _arm(self, receiving: bool) -> None:
        """Bound the next blocking receive (or send) by the current call's deadline. A
        call the timeout ends early raises _TIMED_OUT or moves fewer bytes: the caller
        arms again, until the deadline raises."""
        left = self._left()
        if self._tls:
            self._sock.settimeout(left)  # Python's timeout: bounds one call as a whole
            return
        # The kernel restarts its timeout at each socket call: set it again only when
        # the wait would end more than _SLACK_S off the deadline.
        which = 0 if receiving else 1
        if abs(left - self._armed[which]) > _SLACK_S:
            seconds, micros = int(left), int(left % 1 * 1e6)
            limit = struct.pack("ll", seconds, max(micros, 1) if seconds == 0 else micros)
            option = socket.SO_RCVTIMEO if receiving else socket.SO_SNDTIMEO
            self._sock.setsockopt(socket.SOL_SOCKET, option, limit)
            self._armed[which] = left

    def _hello(self) -> None:
        endpoint, commands = self.endpoint, []
        if endpoint.password is not None:
            user = () if endpoint.username is None else (endpoint.username,)
            commands.append((b"AUTH", *user, endpoint.password))
        if endpoint.client_name is not None:
            commands.append((b"CLIENT", b"SETNAME", endpoint.client_name))
        if endpoint.db:
            commands.append((b"SELECT", endpoint.db))
        if not commands:
            return
        requests = [resp.encode_command(command) for command in commands]
        self.send(requests, None, None, deadline=self._deadline)
        for reply in self.receive():  # in by the connect's deadline
            if isinstance(reply, ResponseError):
                raise AuthenticationError(str(reply))

    def send(
        self,
        requests: Sequence[list[Buffer]],
        sinks: Sinks,
        expected: Expecteds,
        *,
        deadline: float,
    ) -> None:
        """Send the encoded ``requests`` (a command's buffers each) by ``deadline``; their
        replies, read by :meth:`receive` in order, land as ``sinks[i]`` picks;
        ``expected[i]`` is the bulk string reply ``i`` should be (one receive if plain)."""
        self._deadline = deadline
        buffers = [buffer for request in requests for buffer in request]
        pad = 0
        if expected and sinks is not None and not self._tls:
            # A padding reply after the last: whatever the replies are, at least a
            # reply's framing and head follow each, so a MSG_WAITALL receive never hangs.
            pad = max(len(b"$%d\r\n" % e.length) + e.head for e in expected)
            if pad + _PAD_FRAMING <= self._ahead.nbytes:
                buffers.append(b"*2\r\n$4\r\nECHO\r\n$%d\r\n%s\r\n" % (pad, b"." * pad))
            else:
                pad = 0
        self._send(buffers)
        self._sent.append((len(requests), sinks, expected, pad, deadline))

    def receive(self) -> Replies:
        """The replies of the oldest pipeline not received yet, all in by its deadline,
        an error reply as redis-py's error in its place."""
        count, sinks, expected, pad, self._deadline = self._sent.popleft()
        if pad:
            assert sinks is not None and expected is not None
            return self._read_expected(sinks, expected, pad)
        return self._read_replies(sinks, 0, count)

    def _read_replies(self, sinks: Sinks, first: int, stop: int) -> Replies:
        replies: Replies = []
        reader = self._reader
        for i in range(first, stop):
            reader.sink = sinks[i] if sinks is not None else None
            reply = self._read_reply()
            if isinstance(reply, resp.ErrorReply):  # MOVED, ASK, WRONGTYPE, ... as redis-py's
                error = BaseParser.parse_error(reply.message)
                reply = error if isinstance(error, ResponseError) else ResponseError(reply.message)
            replies.append(reply)
        reader.sink = None
        return replies

    def _read_expected(
        self, sinks: Sequence[Sink | None], expected: Sequence[Expected], pad: int
    ) -> Replies:
        """The replies of a pipeline sent with its padding ``ECHO``: while as ``expected``,
        each in one ``recvmsg_into`` (its rest into the sink's view, its CR LF, the next
        one's framing and head); from the first that is not, through the reader."""
        ahead, crlf = self._ahead, self._crlf
        framings = [b"$%d\r\n" % e.length for e in expected]
        trailer = b"$%d\r\n%s\r\n" % (pad, b"." * pad)
        size = len(framings[0]) + expected[0].head
        self._fill([ahead[:size]])
        replies: Replies = []
        for i, (framing, (length, head)) in enumerate(zip(framings, expected, strict=True)):
            sink = sinks[i]
            landing = sink([], length) if ahead[: len(framing)] == framing and sink else None
            if not isinstance(landing, tuple) or landing[0].nbytes != head:
                # Not as expected (a nil, an error, another length): the reader takes
                # over with what was read ahead; the sink is asked again, by it.
                self._reader.feed(ahead[:size])
                replies += self._read_replies(sinks, i, len(expected))
                if self._read_reply() != b"." * pad:
                    raise RedisConnectionError("the redis server sent no reply to ECHO")
                return replies
            view, rest = landing
            view[:] = ahead[len(framing) : size]
            target = rest()
            if target.nbytes != length - head:
                raise RedisConnectionError("a sink gave a view of the wrong length")
            size = len(framings[i + 1]) + expected[i + 1].head if i + 1 < len(expected) else 0
            self._fill([target, crlf, ahead[: size or len(trailer)]])
            if crlf != b"\r\n":
                raise RedisConnectionError("the redis server sent no RESP: no CR LF")
            replies.append(resp.Landed(length))
        if ahead[: len(trailer)] != trailer:
            raise RedisConnectionError("the redis server sent no reply to ECHO")
        return replies

    def _fill(self, views: list[memoryview]) -> None:
        """Receive exactly as many bytes as ``views`` hold, into them in order."""
        sock, wait_all = self._sock, self._wait_all
        while views:
            self._arm(receiving=True)
            try:
                count = sock.recvmsg_into(views, 0, wait_all)[0]
            except _TIMED_OUT:
                continue  # arm again (see _arm)
            if not count:
                raise RedisConnectionError("the redis server closed the connection")
            while views and count >= views[0].nbytes:
                count -= views.pop(0).nbytes
            if count:
                views[0] = views[0][count:]

    def _send(self, buffers: list[Buffer]) -> None:
        sock = self._sock
        pending = [memoryview(b).cast("B") if not isinstance(b, bytes) else b for b in buffers]
        first = 0
        while first < len(pending):
            self._arm(receiving=False)
            try:
                if self._tls:  # an SSL socket has no sendmsg
                    sent = sock.send(pending[first])
                else:
                    sent = sock.sendmsg(pending[first : first + _IOV_MAX])
            except _TIMED_OUT:
                continue  # the socket's timeout: arm it again, or the deadline has passed
            while first < len(pending) and sent >= len(pending[first]):
                sent -= len(pending[first])
                first += 1
            if sent:
                pending[first] = memoryview(pending[first])[sent:]

    def _read_reply(self) -> Reply:
        reader, sock = self._reader, self._sock
        try:
            while (reply := reader.gets()) is resp.NOT_YET:
                into = reader.direct()
                self._arm(receiving=True)
                try:
                    if into is not None:
                        count = sock.recv_into(into, 0, self._wait_all)
                        if count:
                            reader.filled(count)
                    else:
                        # Ahead of a sink's bulk string, only its framing and header: no
                        # payload copied twice on its way to the slot.
                        chunk = self._chunk if reader.sink is None else self._chunk[:_AHEAD]
                        count = sock.recv_into(chunk)
                        if count:
                            reader.feed(chunk[:count])
                except _TIMED_OUT:
                    continue  # the socket's timeout: arm it again, or the deadline has passed
                if not count:
                    raise RedisConnectionError("the redis server closed the connection")
        except resp.ProtocolError as exc:
            raise RedisConnectionError(f"the redis server sent no RESP: {exc}") from None
        return reply  # type: ignore[return-value]

    def close(self) -> None:
        with contextlib.suppress(OSError):  # best effort: the connection is dropped anyway
            self._sock.close()


def any_stale(connections: Iterable[RespConnection]) -> bool:
    """Whether any of the idle ``connections`` has something to read (one ``select``
    for them all): the server closed it or sent what nobody asked for."""
    try:
        readable, _, _ = select.select([c._sock for c in connections], [], [], 0)
    except (OSError, ValueError):  # one was closed under us
        return True
    return bool(readable)
