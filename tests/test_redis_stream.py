"""Several jobs' pipelines on one link (``backends.redis.streams``), against a real
server and a real cluster."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from concurrent.futures import Future
from functools import partial
from pathlib import Path
from typing import Any

import pytest

if os.environ.get("KV_TIERING_REQUIRE_REDIS") != "1":  # CI: a missing redis-py fails
    pytest.importorskip("redis", reason="pip install 'kv-tiering[redis]'")

from backends.redis.connection import Endpoint
from backends.redis.control import LazyClient, RedisConnectionError
from backends.redis.jobs import Pipeline
from backends.redis.options import RedisOptions
from backends.redis.streams import Link, RespStream, Streams
from tests._redis_helpers import local_redis_cluster


class Work:
    """A job of plain commands, a pipeline per list; it records the replies."""

    def __init__(self, *pipelines: list[tuple[Any, ...]], independent: bool = False) -> None:
        self._pipelines, self._independent = pipelines, independent
        self.pipelines = len(pipelines)
        self.replies: list[list[Any]] = []
        self.begun = self.finished = False

    def plan(self) -> Work:
        self.begun = True
        return self

    def pipeline(self, index: int) -> Pipeline:
        commands = self._pipelines[index]
        names = [command[1].encode() if len(command) > 1 else b"" for command in commands]
        return Pipeline(names, commands, independent=self._independent)

    def answered(self, index: int, replies: list[Any]) -> None:
        assert index == len(self.replies)  # in the order sent
        self.replies.append(replies)

    def finish(self) -> str:
        self.finished = True
        return "finished"


def run(stream: RespStream | Streams, work: Work) -> tuple[Future[None], Future[Any]]:
    """Give ``work`` to ``stream``; the second future gets what is delivered."""
    delivered: Future[Any] = Future()
    return stream.submit(work.plan, delivered.set_result), delivered


def endpoint_of(url: str) -> Endpoint:
    return RedisOptions(url=url, namespace="x", timeout_s=5.0).endpoint()


@pytest.fixture
def stream(redis_server: Any) -> Iterator[RespStream]:
    stream = RespStream(Link(endpoint_of(redis_server.url)), window=3, name="test-stream")
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


def test_an_independent_pipeline_is_spread_over_connections_and_answered_in_order(
    stream: RespStream, redis_server: Any
) -> None:
    spread = Work([("INCRBY", f"n{i}", i) for i in range(12)], independent=True)
    _, delivered = run(stream, spread)
    assert delivered.result(timeout=10) == "finished"
    assert spread.replies == [list(range(12))]
    clients = redis_server.command("CLIENT", "LIST")
    assert isinstance(clients, bytes)
    ours = [line for line in clients.splitlines() if b"cmd=client|list" not in line]
    # The 8 the commands went over: the stream's connection for pipelines that run in
    # order is made when one first needs it.
    assert len(ours) == 8


def test_a_connection_the_server_closed_while_idle_is_never_used(
    stream: RespStream, redis_server: Any
) -> None:
    """Any one of an idle link's connections closed by the server (here one of the
    spread ones) makes the next job start on a new link: it does not fail."""
    first = Work([("INCRBY", f"n{i}", 1) for i in range(12)], independent=True)
    _, delivered = run(stream, first)
    assert delivered.result(timeout=10) == "finished"
    clients = redis_server.command("CLIENT", "LIST")
    assert isinstance(clients, bytes)
    spread = [line for line in clients.splitlines() if b"cmd=incrby" in line]
    assert len(spread) == 8
    victim = spread[-1].split()[0].removeprefix(b"id=")
    assert redis_server.command("CLIENT", "KILL", "ID", victim) == 1
    time.sleep(0.1)  # the close reaches our end of the connection
    second = Work([("INCRBY", f"n{i}", 10) for i in range(12)], independent=True)
    _, delivered = run(stream, second)
    assert delivered.result(timeout=10) == "finished"
    assert second.replies == [[11] * 12]


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


def test_a_job_goes_to_the_stream_with_the_fewest_jobs_not_ended(redis_server: Any) -> None:
    """Two jobs given while the first is on the wire go over two connections: the
    second went to the other stream, though neither had a job waiting to begin."""
    streams = Streams(partial(Link, endpoint_of(redis_server.url)), count=2, window=2)
    try:
        _, held = run(streams, Work([("BLPOP", "held", 30)]))  # on the wire until pushed
        deadline = time.monotonic() + 10
        while b"cmd=blpop" not in redis_server.command("CLIENT", "LIST"):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        other = Work([("SET", "other", "1")])
        _, delivered = run(streams, other)
        assert delivered.result(timeout=10) == "finished"  # not behind the BLPOP
        assert not held.done() and other.replies == [[b"OK"]]
        redis_server.command("RPUSH", "held", "x")
        assert held.result(timeout=10) == "finished"
    finally:
        streams.close()


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


def test_on_a_cluster_each_node_gets_its_share_and_the_replies_keep_the_pipelines_order(
    tmp_path: Path,
) -> None:
    cluster = local_redis_cluster(tmp_path)
    options = RedisOptions(url=cluster.url, namespace="x", cluster=True, max_connections=4)
    client = LazyClient(partial(options.client, cluster=True))
    link = Link(endpoint_of(cluster.url), client)
    stream = RespStream(link, window=2, name="test-cluster")
    try:
        names = [f"key-{i}" for i in range(24)]
        work = Work(
            [("SET", name, f"value-{i}") for i, name in enumerate(names)],
            [("GET", name) for name in names],
        )
        call, delivered = run(stream, work)
        assert delivered.result(timeout=10) == "finished"
        call.result(timeout=10)
        assert work.replies == [[b"OK"] * 24, [f"value-{i}".encode() for i in range(24)]]
        held = [node.command("DBSIZE") for node in cluster.nodes]
        assert all(isinstance(count, int) and count > 0 for count in held) and sum(held) == 24
    finally:
        stream.close()
        client.close()
        cluster.stop()
