"""The Redis tier's I/O shell: streams, each a thread and a link (its connections to
one server or to every node of a cluster), that carry several jobs' pipelines at once.
A pipeline's connections, requests and replies (on every node) are all in by one
deadline, ``timeout_s`` from its send, or the link raises RedisTimeoutError.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, TypeVar

from backends.redis.connection import Endpoint, RespConnection, any_stale
from backends.redis.control import (
    CLIENT_ERRORS,
    AskError,
    ClusterDownError,
    LazyClient,
    RedisCluster,
    RedisConnectionError,
    TryAgainError,
    detached,
    redirected,
    refresh_slots,
)
from backends.redis.jobs import Job, Pipeline
from backends.redis.resp import encode_command, joined
from tiering.tiers.io_threads import init_io_worker

_T = TypeVar("_T")

# Connections a link to one server spreads an independent pipeline (a store's SETs) over,
# a command on each in turn: a server spends less CPU per byte on large SETs that arrive
# one per connection than queued on one (docs/redis.md).
_SPREAD = 8

_Where = tuple[Endpoint, int]  # a link's connection: the node, and which of its lanes
_Sent = list[tuple[RespConnection, Sequence[int]]]  # each connection, and its commands' indexes


class Link:
    """A stream's connections (made as first needed) to one server, or with ``clients``
    (redis-py's cluster client) to the nodes of a cluster, each reached as ``endpoint``
    says. Raises as :class:`RespConnection` does.

    On one server, an ordered pipeline goes on one connection, an independent one a
    command on each of up to ``_SPREAD`` more in turn. On a cluster, commands are grouped
    by the node owning their key's slot (redis-py's map), every group sent before any
    reply is read; a redirected command (MOVED, ASK, TRYAGAIN) is sent again through
    redis-py's client, which follows it; a failure (a connection failed or timed out,
    the cluster is down) refreshes the map, then raises the client's error."""

    def __init__(self, endpoint: Endpoint, clients: LazyClient | None = None) -> None:
        self._endpoint, self._clients = endpoint, clients
        self._connections: dict[_Where, RespConnection] = {}
        self._next = 0  # the spread connection an independent pipeline's next command takes

    def send(self, pipeline: Pipeline, *, idle: bool) -> _Sent:
        """Send ``pipeline``. ``idle`` (nothing on the wire): if the server closed a
        connection meanwhile (restarted, timed it out), every one is made anew."""
        requests = [encode_command(command) for command in pipeline.commands]
        if idle and self._connections and any_stale(self._connections.values()):
            self.close()
        deadline = time.monotonic() + self._endpoint.timeout_s
        groups = []
        try:
            for where, indexes in self._groups(pipeline):
                connection = self._connections.get(where)
                if connection is None:
                    connection = self._connections[where] = RespConnection(where[0], deadline)
                sinks = _chosen(indexes, pipeline.sinks)
                expected = _chosen(indexes, pipeline.expected)
                connection.send([requests[i] for i in indexes], sinks, expected, deadline=deadline)
                groups.append((connection, indexes))
        except CLIENT_ERRORS:
            self._refresh()
            raise
        return groups

    def receive(self, pipeline: Pipeline, sent: _Sent) -> list[Any]:
        """The replies of ``pipeline`` (``send`` returned ``sent``), in its order."""
        replies: list[Any] = [None] * len(pipeline.commands)
        try:
            for connection, indexes in sent:
                for i, reply in zip(indexes, connection.receive(), strict=True):
                    replies[i] = reply
        except CLIENT_ERRORS:
            self._refresh()
            raise
        if self._clients is not None:
            for i, reply in enumerate(replies):
                if isinstance(reply, ClusterDownError):
                    raise reply
                if isinstance(reply, (AskError, TryAgainError)):  # MovedError is an AskError
                    replies[i] = redirected(self._cluster(), joined(pipeline.commands[i]))
        return replies

    def close(self) -> None:
        for connection in self._connections.values():
            connection.close()
        self._connections.clear()

    def _groups(self, pipeline: Pipeline) -> Iterable[tuple[_Where, Sequence[int]]]:
        if self._clients is not None:
            cluster = self._cluster()
            indexes: dict[_Where, list[int]] = {}
            for i, name in enumerate(pipeline.names):
                node = cluster.nodes_manager.get_node_from_slot(cluster.keyslot(name))
                where = self._endpoint._replace(host=node.host, port=node.port, path=None)
                indexes.setdefault((where, 0), []).append(i)
            return indexes.items()
        if not pipeline.independent:
            return [((self._endpoint, 0), range(len(pipeline.commands)))]
        groups = []
        for i in range(len(pipeline.commands)):
            self._next = self._next % _SPREAD + 1
            groups.append(((self._endpoint, self._next), [i]))
        return groups

    def _cluster(self) -> RedisCluster:
        cluster = self._clients.get() if self._clients is not None else None
        assert isinstance(cluster, RedisCluster)
        return cluster

    def _refresh(self) -> None:
        if self._clients is not None:
            with contextlib.suppress(*CLIENT_ERRORS):  # no client: the next call makes one
                refresh_slots(self._cluster())


def _chosen(indexes: Sequence[int], items: Sequence[_T] | None) -> Sequence[_T] | None:
    """The ``items`` at ``indexes`` (None for None; all, as they are, for all)."""
    if items is None or len(indexes) == len(items):
        return items
    return [items[i] for i in indexes]


@dataclass(slots=True, eq=False)
class _Entry:
    plan: Callable[[], Job]
    deliver: Callable[[Any], None]
    call: Future[None] = field(default_factory=Future)
    job: Job | None = None  # planned once begun
    sent: int = 0  # pipelines sent


class RespStream:
    """One ``link`` and the thread (named ``name``) that carries the jobs given to
    :meth:`submit`, in order: it plans each (:mod:`backends.redis.jobs`) and sends its
    pipelines, then those of the jobs behind it, up to ``window`` on the wire while it
    lands and verifies earlier replies, read in the order sent. A link's failure fails
    every job with a pipeline sent on it (the jobs not begun go on)."""

    def __init__(self, link: Link, *, window: int, name: str) -> None:
        self._link, self._window, self._name = link, max(1, window), name
        self._queue: deque[_Entry] = deque()
        self._wake = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None
        # Each written by one thread only (the giver's, the stream's): no lock needed.
        self._given = self._ended = 0

    def submit(self, plan: Callable[[], Job], deliver: Callable[[Any], None]) -> Future[None]:
        """Queue the job ``plan()`` makes on the stream's thread once it begins;
        ``deliver(outcome)`` follows on that thread (what the job's ``finish()``
        returned, or the client's error, detached). The future returned ends when the
        stream is done with the job; cancelled before the job began, it withdraws it
        (nothing is delivered). RuntimeError once closed."""
        entry = _Entry(plan, deliver)
        with self._wake:
            if self._closed:
                raise RuntimeError("the stream is closed")
            self._queue.append(entry)
            self._given += 1
            self._wake.notify()
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name=self._name, daemon=True)
                self._thread.start()
        return entry.call

    def load(self) -> int:
        """Jobs given and not yet ended (read without the lock: to choose a stream)."""
        return self._given - self._ended

    def close(self) -> None:
        """Stop once the jobs begun are done; the jobs still queued fail as closed."""
        with self._wake:
            self._closed = True
            self._wake.notify()

    def _serve(self) -> None:
        init_io_worker()
        link = self._link
        active: deque[_Entry] = deque()  # begun, with pipelines left to send
        on_wire: deque[tuple[_Entry, int, Pipeline, _Sent]] = deque()  # replies unread
        current: _Entry | None = None  # whose pipeline is being built, sent or read
        while True:
            with self._wake:
                while not (self._queue or active or on_wire or self._closed):
                    self._wake.wait()
                if self._closed and not (active or on_wire):
                    break
                while self._queue and not self._closed:
                    entry = self._queue.popleft()
                    if entry.call.set_running_or_notify_cancel():
                        active.append(entry)
                    else:  # withdrawn
                        self._ended += 1
            try:
                while active and len(on_wire) < self._window:
                    current = entry = active[0]
                    if entry.job is None:
                        entry.job = entry.plan()
                    job = entry.job
                    if not job.pipelines:
                        active.popleft()
                        current = None
                        self._end(entry)
                        continue
                    index = entry.sent
                    pipeline = job.pipeline(index)
                    entry.sent += 1
                    if entry.sent == job.pipelines:
                        active.popleft()
                    on_wire.append((entry, index, pipeline, link.send(pipeline, idle=not on_wire)))
                current = None
                if on_wire:
                    current, index, pipeline, sent = on_wire.popleft()
                    assert current.job is not None
                    current.job.answered(index, link.receive(pipeline, sent))
                    entry, current = current, None
                    # Replies are read in the order sent: its last pipeline's are its last.
                    if index + 1 == entry.job.pipelines:
                        self._end(entry)
            except BaseException as exc:  # every job on this link fails with it
                link.close()
                error = detached(exc) if isinstance(exc, CLIENT_ERRORS) else exc
                failed = {entry for entry, _, _, _ in on_wire}
                failed.update(entry for entry in active if entry.sent)
                if current is not None:
                    failed.add(current)
                    current = None
                on_wire.clear()
                for entry in failed:
                    if entry in active:
                        active.remove(entry)
                    self._end(entry, error)
        link.close()
        with self._wake:
            left, self._queue = list(self._queue), deque()
        for entry in left:
            if entry.call.set_running_or_notify_cancel():
                self._end(entry, RedisConnectionError("the redis tier is closed"))

    def _end(self, entry: _Entry, error: BaseException | None = None) -> None:
        try:
            outcome = None if entry.job is None else entry.job.finish()
        except BaseException as exc:
            outcome = exc
        entry.job = None  # the job, and the views it holds, go now
        self._ended += 1
        entry.deliver(outcome if error is None else error)
        entry.call.set_result(None)


class Streams:
    """``count`` :class:`RespStream` s, each with its own ``link()`` and ``window``."""

    def __init__(self, link: Callable[[], Link], *, count: int, window: int) -> None:
        self._streams = [
            RespStream(link(), window=window, name=f"RedisTier-stream-{i}") for i in range(count)
        ]

    def submit(self, plan: Callable[[], Job], deliver: Callable[[Any], None]) -> Future[None]:
        """:meth:`RespStream.submit` on the stream with the fewest jobs not yet ended."""
        return min(self._streams, key=RespStream.load).submit(plan, deliver)

    def close(self) -> None:
        for stream in self._streams:
            stream.close()
