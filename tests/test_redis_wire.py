"""The Redis tier's own wire: the RESP reader and encoder (``backends.redis.resp``) against
hiredis, and its connections (``backends.redis.connection``) against a real server."""

from __future__ import annotations

import os
import time
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests._nvme_helpers import load_job, random_pool, store_job
from tests._redis_helpers import BLOCK, keys, local_redis_server, name_of, opened, slot

if os.environ.get("KV_TIERING_REQUIRE_REDIS") != "1":  # CI: a missing redis-py fails
    pytest.importorskip("redis", reason="pip install 'kv-tiering[redis]'")

import hiredis

from backends.redis.resp import (
    NOT_YET,
    ErrorReply,
    Landed,
    ProtocolError,
    RespReader,
    encode_command,
    joined,
)

# -- the reader, fed replies split anywhere --------------------------------------------

_leaves = st.one_of(
    st.binary(max_size=300),
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.text(
        alphabet=st.characters(blacklist_characters="\r\n", blacklist_categories=("Cs",)),
        max_size=40,
    ).map(ErrorReply),
    st.none(),
)
replies = st.recursive(_leaves, lambda inner: st.lists(inner, max_size=5), max_leaves=20)


def encode_reply(reply: Any) -> bytes:
    if isinstance(reply, bytes):
        return b"$%d\r\n%s\r\n" % (len(reply), reply)
    if isinstance(reply, int):
        return b":%d\r\n" % reply
    if isinstance(reply, ErrorReply):
        return b"-%s\r\n" % reply.message.encode()
    if reply is None:
        return b"$-1\r\n"
    return b"*%d\r\n" % len(reply) + b"".join(encode_reply(r) for r in reply)


def as_hiredis(reply: Any) -> Any:
    """What hiredis's Reader gives for ``reply`` (errors as its ReplyError)."""
    if isinstance(reply, ErrorReply):
        return ("error", reply.message)
    if isinstance(reply, list):
        return [as_hiredis(r) for r in reply]
    return reply


def from_hiredis(reply: Any) -> Any:
    if isinstance(reply, hiredis.ReplyError):
        return ("error", str(reply))
    if isinstance(reply, list):
        return [from_hiredis(r) for r in reply]
    return reply


def read_all(reader: RespReader, data: bytes, cuts: list[int]) -> list[Any]:
    got: list[Any] = []
    for start, end in zip([0, *cuts], [*cuts, len(data)], strict=True):
        reader.feed(data[start:end])
        while (reply := reader.gets()) is not NOT_YET:
            got.append(reply)
    return got


@settings(max_examples=200, deadline=None)
@given(st.lists(replies, min_size=1, max_size=6), st.data())
def test_the_reader_parses_what_hiredis_parses_however_the_bytes_are_split(
    sent: list[Any], data: st.DataObject
) -> None:
    wire = b"".join(encode_reply(r) for r in sent)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(wire)), max_size=8)))
    got = read_all(RespReader(), wire, cuts)
    reference = hiredis.Reader()
    reference.feed(wire)
    expected = []
    while (reply := reference.gets()) is not False:
        expected.append(from_hiredis(reply))
    assert [as_hiredis(r) for r in got] == expected == [as_hiredis(r) for r in sent]


@settings(max_examples=200, deadline=None)
@given(
    st.binary(max_size=200),
    st.binary(min_size=1, max_size=5000),
    st.integers(0, 5000),
    st.data(),
)
def test_a_sink_lands_a_bulk_string_in_two_views_through_fed_and_direct_bytes(
    head: bytes, payload: bytes, head_bytes: int, data: st.DataObject
) -> None:
    """The second element of an array lands in a head view and, once that is full, the
    view the sink's function gives; the bytes come partly fed, partly written straight
    into :meth:`RespReader.direct` (as ``recv_into`` does)."""
    head_bytes = min(head_bytes, len(payload))
    first, rest = bytearray(head_bytes), bytearray(len(payload) - head_bytes)
    asked: list[tuple[list[Any], int]] = []

    def sink(before: list[Any], length: int) -> Any:
        asked.append((list(before), length))
        if before != [head]:
            return None
        return memoryview(first), lambda: memoryview(rest)

    reader = RespReader()
    reader.sink = sink
    wire = encode_reply([head, payload]) + encode_reply(b"after")
    got: list[Any] = []
    position = 0
    while position < len(wire):
        into = reader.direct()
        step = data.draw(st.integers(1, 700))
        count = min(step, len(wire) - position)
        if into is not None and data.draw(st.booleans()):
            count = min(count, into.nbytes)
            into[:count] = wire[position : position + count]
            reader.filled(count)
        else:
            reader.feed(wire[position : position + count])
        position += count
        while (reply := reader.gets()) is not NOT_YET:
            got.append(reply)
            reader.sink = None  # the next reply is read whole
    assert got == [[head, Landed(len(payload))], b"after"]
    assert bytes(first + rest) == payload
    assert asked == [([], len(head)), ([head], len(payload))]


def test_a_sink_can_decline_and_a_view_of_the_wrong_length_is_refused() -> None:
    reader = RespReader()
    reader.sink = lambda before, length: None
    reader.feed(encode_reply([b"x", b"payload"]))
    assert reader.gets() == [b"x", b"payload"]
    reader.sink = lambda before, length: memoryview(bytearray(length + 1))
    reader.feed(encode_reply(b"abc"))
    with pytest.raises(ProtocolError, match="4 bytes for a bulk string of 3"):
        reader.gets()
    readonly = RespReader()
    readonly.sink = lambda before, length: memoryview(bytes(length))
    readonly.feed(encode_reply(b"abc"))
    with pytest.raises(ProtocolError, match="writable"):
        readonly.gets()


@pytest.mark.parametrize(
    ("wire", "says"),
    [(b"?what\r\n", "unknown reply type"), (b"$3\r\nabcXY", "CR LF"), (b"*x\r\n", "no number")],
)
def test_bytes_that_are_no_resp_are_a_protocol_error(wire: bytes, says: str) -> None:
    reader = RespReader()
    reader.feed(wire)
    with pytest.raises(ProtocolError, match=says):
        reader.gets()


# -- the encoder ------------------------------------------------------------------------

_arguments = st.one_of(
    st.binary(max_size=50),
    st.binary(max_size=50).map(lambda b: memoryview(bytearray(b))),
    st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=20),
    st.integers(-(10**12), 10**12),
    st.lists(
        st.one_of(st.binary(max_size=30), st.binary(max_size=30).map(memoryview)), max_size=4
    ).map(tuple),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(_arguments, min_size=1, max_size=8))
def test_a_command_encodes_as_hiredis_packs_it_joined(args: list[Any]) -> None:
    out = encode_command(args)
    flat = [bytes(a) if isinstance(a, memoryview) else a for a in joined(args)]
    assert b"".join(bytes(part) for part in out) == hiredis.pack_command(tuple(flat))


def test_memoryviews_go_out_as_they_are() -> None:
    payload = memoryview(bytearray(b"p" * 64))
    out = encode_command(("SET", b"k", (b"header", payload), "EX", 5))
    assert any(part is payload for part in out)


# -- connections against a real server -------------------------------------------------


@pytest.fixture
def pool():
    with random_pool(BLOCK, 16) as view:
        yield view


async def test_a_unix_socket_url_with_a_database_round_trips(pool: memoryview, tmp_path) -> None:
    path = tmp_path / "redis.sock"
    server = local_redis_server(tmp_path, "--unixsocket", str(path), "--unixsocketperm", "700")
    try:
        async with opened(pool, server, url=f"unix://{path}?db=3") as tier:
            assert (await store_job(tier, keys(2), [0, 1])).success
            assert (await load_job(tier, keys(2), [2, 3])).success
        assert [slot(pool, 2), slot(pool, 3)] == [slot(pool, 0), slot(pool, 1)]
        import redis

        with redis.Redis.from_url(server.url.replace("/0", "/3")) as on_three:
            assert on_three.exists(name_of(keys(1)[0])) == 1  # on database 3, not 0
        assert server.command("DBSIZE") == 0
    finally:
        server.stop()


# -- replies read as expected, and what is not as expected ------------------------------

_HEAD, _REST = 8, 4000  # an expected value: a head, then the rest


def _expected_replies(server: Any, kinds: list[str], *, expected: bool) -> tuple[list, list]:
    """GET one key per kind (``ok``: a value of the expected length; ``missing``;
    ``hash``: no string; ``short``/``long``: a string of another length) on one
    connection, each value's head and rest landing in views of their own; returns the
    replies and what landed, as ``bytes``."""
    from backends.redis.connection import Expected, RespConnection
    from backends.redis.options import RedisOptions

    values = {"ok": _HEAD + _REST, "short": _HEAD + 1, "long": _HEAD + _REST + 1}
    for i, kind in enumerate(kinds):
        server.command("DEL", f"k{i}")
        if kind in values:
            server.command("SET", f"k{i}", bytes([i]) * values[kind])
        elif kind == "hash":
            server.command("HSET", f"k{i}", "f", "v")
    heads = [bytearray(_HEAD) for _ in kinds]
    rests = [bytearray(_REST) for _ in kinds]

    def sink(i: int) -> Any:
        def land(before: list[Any], length: int) -> Any:
            if length != _HEAD + _REST:
                return None
            return memoryview(heads[i]), lambda: memoryview(rests[i])

        return land

    connection = RespConnection(RedisOptions(url=server.url, namespace="x").endpoint())
    deadline = time.monotonic() + 5
    try:
        gets = [encode_command(("GET", f"k{i}")) for i in range(len(kinds))]
        sinks = [sink(i) for i in range(len(kinds))]
        expectations = [Expected(_HEAD + _REST, _HEAD)] * len(kinds) if expected else None
        connection.send(gets, sinks, expectations, deadline=deadline)
        connection.send([encode_command(("PING",))], None, None, deadline=deadline)
        replies = connection.receive()
        # The connection reads on exactly where its replies end.
        assert connection.receive() == [b"PONG"]
    finally:
        connection.close()
    return [repr(r) for r in replies], [bytes(h + r) for h, r in zip(heads, rests, strict=True)]


@pytest.mark.parametrize(
    "kinds",
    [
        ["ok", "ok", "ok"],
        ["ok", "ok", "missing"],
        ["missing", "ok", "ok"],
        ["ok", "hash", "ok"],
        ["ok", "short", "ok", "ok"],
        ["ok", "ok", "long"],
        ["short", "missing", "hash"],
        ["ok"],
        ["missing"],
    ],
)
def test_replies_read_as_expected_are_what_the_reader_reads(
    redis_server: Any, kinds: list[str]
) -> None:
    """A pipeline read as expected (one receive per value) gives the replies and the
    landed bytes the reader gives, whatever turns out not to be as expected, and never
    waits for bytes that do not come."""
    fast = _expected_replies(redis_server, kinds, expected=True)
    assert fast == _expected_replies(redis_server, kinds, expected=False)
    replies, landed = fast
    for i, kind in enumerate(kinds):
        if kind == "ok":
            assert replies[i] == repr(Landed(_HEAD + _REST))
            assert landed[i] == bytes([i]) * (_HEAD + _REST)
        else:
            assert landed[i] == bytes(_HEAD + _REST)  # nothing landed
