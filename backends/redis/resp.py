"""RESP2, the Redis wire protocol, without I/O: commands encoded as lists of buffers,
and a reader that is fed bytes and hands out whole replies, each bulk string landing
where a *sink* says (a block's payload in its host-pool slot, which the I/O layer can
``recv_into`` with no copy at all: :meth:`RespReader.direct`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final

Buffer = bytes | bytearray | memoryview

# Where a bulk string lands: one writable view exactly as long as it, or a view for its
# first bytes and a function called once they are in, giving the view for the rest.
Landing = memoryview | tuple[memoryview, Callable[[], memoryview]]
# sink(before, length): where a bulk string of length bytes lands, given the elements
# before it in the array that holds it (empty at the top level); None: a new bytes.
Sink = Callable[[list[Any], int], Landing | None]

_CRLF: Final = b"\r\n"
_COMPACT_AT: Final = 1 << 16  # consumed bytes the buffer keeps before dropping them


class ProtocolError(ValueError):
    """The bytes are no RESP2, or a sink gave a view of the wrong length."""


@dataclass(frozen=True, slots=True)
class ErrorReply:
    """An error reply (``-ERR ...``): its message, as the server wrote it."""

    message: str


@dataclass(frozen=True, slots=True)
class Landed:
    """A bulk string of ``length`` bytes that went to the views its sink gave."""

    length: int


NOT_YET: Final = object()  # what RespReader.gets returns while a reply is incomplete
Reply = bytes | int | ErrorReply | Landed | None | list[Any]
# A command's argument: bytes, text (sent in UTF-8), an int (its decimal digits), or a
# tuple of buffers sent as one argument, in order.
Argument = Buffer | str | int | tuple[Buffer, ...]


def encode_command(args: Sequence[Argument]) -> list[Buffer]:
    """The request of ``args``, as buffers to send in order: each memoryview (an
    argument, or a part of one) as it is (no copy), the rest in as few ``bytes`` as
    they allow."""
    out: list[Buffer] = []
    head = bytearray(b"*%d\r\n" % len(args))
    for arg in args:
        if isinstance(arg, int):
            arg = b"%d" % arg
        elif isinstance(arg, str):
            arg = arg.encode()
        if isinstance(arg, memoryview):
            arg = (arg,)
        if isinstance(arg, tuple):
            head += b"$%d\r\n" % sum(memoryview(part).nbytes for part in arg)
            for part in arg:
                if isinstance(part, memoryview):
                    if head:
                        out.append(bytes(head))
                    out.append(part)
                    head = bytearray()
                else:
                    head += part
            head += _CRLF
        else:
            head += b"$%d\r\n" % len(arg)
            head += arg
            head += _CRLF
    out.append(bytes(head))
    return out


def joined(command: Sequence[Argument]) -> tuple[Buffer | str | int, ...]:
    """``command`` with each tuple argument joined into one ``bytes`` (for redis-py)."""
    return tuple(b"".join(arg) if isinstance(arg, tuple) else arg for arg in command)


class RespReader:
    """Turns RESP2 bytes into replies (bulk and simple strings ``bytes``, or
    :class:`Landed` where the sink took them; integers; :class:`ErrorReply`; nil
    ``None``; arrays lists). Raises ProtocolError for bytes that are no RESP2."""

    def __init__(self) -> None:
        self._buffer = bytearray()
        self._pos = 0
        # Arrays being read: [their elements so far, how many they have in all].
        self._stack: list[tuple[list[Any], int]] = []
        # The bulk string landing in a sink's view now: the view, the bytes it still
        # lacks, and the function giving the view for the rest (None: no rest).
        self._target: memoryview | None = None
        self._due = 0
        self._rest: Callable[[], memoryview] | None = None
        self._length = self._head = 0  # the whole bulk string's, its first view's
        self._declined = -1  # where a bulk string starts whose sink said None
        self.sink: Sink | None = None  # where the current reply's bulk strings land

    def feed(self, data: Buffer) -> None:
        self._buffer += data

    def direct(self) -> memoryview | None:
        """The part of a sink's view the next bytes belong to once everything fed is
        consumed (``recv_into`` it, then :meth:`filled`); None: :meth:`feed` them."""
        if self._target is None or self._due == 0 or self._pos < len(self._buffer):
            return None
        return self._target[self._target.nbytes - self._due :]

    def filled(self, count: int) -> None:
        """Record that ``count`` bytes were written into the start of :meth:`direct`."""
        if self._target is None or not 0 <= count <= self._due:
            raise ProtocolError(f"filled {count} bytes, but {self._due} are due")
        self._due -= count
        self._advance()

    def gets(self) -> Reply | object:
        """The next whole reply, or :data:`NOT_YET` if its bytes are not all in."""
        while True:
            element: Any = self._land() if self._target is not None else self._element()
            if element is NOT_YET:
                return NOT_YET
            if element is _OPENED:  # an array, or a string landing in a sink's views
                continue
            while self._stack:
                items, total = self._stack[-1]
                items.append(element)
                if len(items) < total:
                    break
                self._stack.pop()
                element = items
            else:
                self._compact()
                return element

    def _element(self) -> Any:
        """One whole element (consumed), _OPENED for an array or a sink's bulk string
        begun, or NOT_YET (nothing consumed)."""
        buffer, start = self._buffer, self._pos
        end = buffer.find(_CRLF, start)
        if end < 0:
            return NOT_YET
        kind, line = buffer[start], bytes(buffer[start + 1 : end])
        after = end + 2
        if kind == 0x24:  # $ bulk string
            length = _number(line)
            if length < 0:
                self._pos = after
                return None
            sink, before = self.sink, self._stack[-1][0] if self._stack else []
            landing = None
            if sink is not None and self._declined != start:  # asked once per string
                landing = sink(before, length)
                self._declined = start
            if landing is not None:
                view, rest = landing if isinstance(landing, tuple) else (landing, None)
                view = _checked(view, length, whole=rest is None)
                self._pos, self._target, self._due = after, view, view.nbytes
                self._rest, self._length, self._head = rest, length, view.nbytes
                self._advance()
                return _OPENED
            if len(buffer) < after + length + 2:
                return NOT_YET  # the sink is not asked again for it
            if buffer[after + length : after + length + 2] != _CRLF:
                raise ProtocolError("a bulk string does not end with CR LF")
            self._pos, self._declined = after + length + 2, -1
            return bytes(buffer[after : after + length])
        self._pos = after
        if kind == 0x2B:  # + simple string
            return line
        if kind == 0x3A:  # : integer
            return _number(line)
        if kind == 0x2D:  # - error
            return ErrorReply(line.decode("utf-8", "replace"))
        if kind == 0x2A:  # * array
            count = _number(line)
            if count < 0:
                return None
            if count == 0:
                return []
            self._stack.append(([], count))
            return _OPENED
        raise ProtocolError(f"unknown reply type {bytes([kind])!r}")

    def _land(self) -> Landed | object:
        """Move fed bytes into the sink's view; Landed once its CR LF is in."""
        buffer = self._buffer
        while self._due:
            target = self._target
            assert target is not None
            take = min(self._due, len(buffer) - self._pos)
            if not take:
                self._compact()
                return NOT_YET
            offset = target.nbytes - self._due
            target[offset : offset + take] = memoryview(buffer)[self._pos : self._pos + take]
            self._pos += take
            self._due -= take
            self._advance()
        if len(buffer) - self._pos < 2:
            return NOT_YET
        if buffer[self._pos : self._pos + 2] != _CRLF:
            raise ProtocolError("a bulk string does not end with CR LF")
        self._pos += 2
        self._target, self._declined = None, -1
        return Landed(self._length)

    def _advance(self) -> None:
        """Once a head view is full, go on to the view for the rest."""
        if self._due == 0 and self._rest is not None:
            rest, self._rest = self._rest, None
            self._target = _checked(rest(), self._length - self._head, whole=True)
            self._due = self._target.nbytes

    def _compact(self) -> None:
        self._declined = -1  # positions move: no bulk string is half read here
        if self._pos == len(self._buffer):
            self._buffer.clear()
            self._pos = 0
        elif self._pos >= _COMPACT_AT:
            del self._buffer[: self._pos]
            self._pos = 0


_OPENED: Final = object()  # an array or a sink's bulk string begun: read on


def _checked(view: object, length: int, *, whole: bool) -> memoryview:
    """A sink's view as bytes: writable, contiguous, ``length`` bytes (``whole``) or less."""
    if not isinstance(view, memoryview) or view.readonly or not view.c_contiguous:
        raise ProtocolError("a sink gave no writable, contiguous memoryview")
    if view.nbytes > length or (whole and view.nbytes != length):
        raise ProtocolError(f"a sink gave {view.nbytes} bytes for a bulk string of {length}")
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def _number(line: bytes) -> int:
    try:
        return int(line)
    except ValueError:
        raise ProtocolError(f"{line[:20]!r} is no number") from None
