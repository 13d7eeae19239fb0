"""Several jobs' pipelines on one connection (``backends.redis_stream``), against a
real server."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any

import pytest

if os.environ.get("KV_TIERING_REQUIRE_REDIS") != "1":  # CI: a missing redis-py fails
    pytest.importorskip("redis", reason="pip install 'kv-tiering[redis]'")

from backends.redis_client import RedisConnectionError
from backends.redis_stream import Pipeline, RespStream
from backends.resp_connection import endpoint_of


class Work:
    """A job of plain commands, a pipeline per list; it records the replies."""

    def __init__(self, *pipelines: list[tuple[Any, ...]]) -> None:
        self._pipelines = pipelines
        self.replies: list[list[Any]] = []
        self.begun = self.finished = False

    def pipelines(self) -> Iterator[Pipeline]:
        self.begun = True
        for commands in self._pipelines:
            yield Pipeline([b"k"] * len(commands), commands, None, None, self.replies.append)

    def finish(self) -> str:
        self.finished = True
        return "finished"


def run(stream: RespStream, work: Work) -> tuple[Future[None], Future[Any]]:
    """Give ``work`` to ``stream``; the second future gets what is delivered."""
    delivered: Future[Any] = Future()
    return stream.submit(work, delivered.set_result), delivered


@pytest.fixture
def stream(redis_server: Any) -> Iterator[RespStream]:
    endpoint = endpoint_of(redis_server.url, timeout_s=5.0, tls={})
    assert endpoint is not None
    stream = RespStream(endpoint, window=3, name="test-stream")
    yield stream
    stream.close()


def test_jobs_on_one_stream_get_their_own_replies_over_one_connection(
    stream: RespStream, redis_server: Any
) -> None:
    works = [
        Work(
            [("SET", f"k{i}", f"v{i}"), ("INCR", f"n{i}")],
            [("GET", f"k{i}")],
            [("INCRBY", f"n{i}", 10)],
        )
        for i in range(6)
    ]
    ends = [run(stream, work) for work in works]
    for call, delivered in ends:
        assert delivered.result(timeout=10) == "finished"
        call.result(timeout=10)
    for i, work in enumerate(works):
        assert work.replies == [[b"OK", 1], [f"v{i}".encode()], [11]]
        assert work.finished
    clients = redis_server.command("CLIENT", "LIST")
    assert isinstance(clients, bytes)
    ours = [line for line in clients.splitlines() if b"cmd=client|list" not in line]
    assert len(ours) == 1  # every job went over the stream's one connection


def test_a_lost_connection_fails_its_jobs_and_the_next_job_reconnects(
    stream: RespStream,
) -> None:
    """A job whose pipeline makes the server drop the connection (after answering the
    kill, before the PING) fails with a connection error; a job given after it runs
    on a new connection."""
    killed = Work([("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "no"), ("PING",)])
    _, delivered = run(stream, killed)
    assert isinstance(delivered.result(timeout=10), RedisConnectionError)
    assert killed.finished  # its end ran: what it held is released
    after = Work([("SET", "after", "1")], [("GET", "after")])
    _, delivered = run(stream, after)
    assert delivered.result(timeout=10) == "finished"
    assert after.replies == [[b"OK"], [b"1"]]


def test_a_job_withdrawn_before_it_began_is_never_begun(
    stream: RespStream, redis_server: Any
) -> None:
    blocking = Work([("BLPOP", "never-pushed", 1)])
    run(stream, blocking)
    deadline = time.monotonic() + 10
    while b"cmd=blpop" not in redis_server.command("CLIENT", "LIST"):  # on the wire now
        assert time.monotonic() < deadline
        time.sleep(0.01)
    withdrawn = Work([("SET", "withdrawn", "1")])
    call, delivered = run(stream, withdrawn)
    assert call.cancel()  # the stream is reading the BLPOP's reply: not begun yet
    later = Work([("GET", "withdrawn")])
    _, done = run(stream, later)
    assert done.result(timeout=10) == "finished"
    assert later.replies == [[None]]  # the withdrawn SET was never sent
    assert not withdrawn.begun and not delivered.done()


def test_closing_ends_the_begun_jobs_and_fails_the_queued(
    stream: RespStream, redis_server: Any
) -> None:
    blocking = Work([("BLPOP", "never-pushed", 1)])
    _, first = run(stream, blocking)
    deadline = time.monotonic() + 10
    while b"cmd=blpop" not in redis_server.command("CLIENT", "LIST"):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    queued = Work([("SET", "queued", "1")])
    _, second = run(stream, queued)
    stream.close()
    assert first.result(timeout=10) == "finished"  # begun: carried to its end
    assert blocking.replies == [[None]]
    assert isinstance(second.result(timeout=10), RedisConnectionError)
    assert not queued.begun
    with pytest.raises(RuntimeError):
        run(stream, Work([("PING",)]))
