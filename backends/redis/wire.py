"""The Redis tier's streams on its own RESP connections (:mod:`backends.redis.connection`):
to one server, or to every node of a cluster at once.

Each stream (:class:`backends.redis.stream.RespStream`) holds one link: to one server a
connection, and a few more over which a store's ``SET``s go one per connection
(:class:`ServerLink`); to a cluster a connection per node, made as it is first needed
(:class:`ClusterLink`). On a cluster, a pipeline's commands are grouped by
the node that owns their key's slot (redis-py's map of the slots) and every node's
group is sent before any reply is read, so the nodes work at once; the stream then
reads them in turn. A command a node redirects (MOVED, ASK, TRYAGAIN) is sent again
through redis-py's cluster client, which follows it and updates its map; a node that
fails makes the link raise (the stream then drops it, replies left unread on it) after
the map is refreshed.

Each pipeline has one deadline, ``timeout_s`` from when it is sent: the connections made
for it, its requests and all of its replies (on every node) are in by then, or the link
raises RedisTimeoutError.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any, NamedTuple, TypeVar

from backends.redis.connection import Command, Endpoint, Expected, RespConnection, any_stale
from backends.redis.control import (
    CLIENT_ERRORS,
    AskError,
    ClientError,
    ClusterDownError,
    RedisCluster,
    ResponseError,
    TryAgainError,
)
from backends.redis.resp import Sink, joined
from backends.redis.stream import Pipeline, RespStream

logger = logging.getLogger(__name__)

Replies = list[Any]
_T = TypeVar("_T")


class WirePipelines:
    """``streams`` :class:`RespStream` s to ``endpoint``, or with ``cluster`` (redis-py's
    client, whose map of the slots they read) to its nodes, each keeping ``window``
    pipelines on the wire at most."""

    def __init__(
        self, endpoint: Endpoint, cluster: RedisCluster | None = None, *, streams: int, window: int
    ) -> None:
        def link() -> ServerLink | ClusterLink:
            return ServerLink(endpoint) if cluster is None else ClusterLink(endpoint, cluster)

        self.streams = [
            RespStream(link, window=window, name=f"RedisTier-stream-{i}") for i in range(streams)
        ]

    def stream(self) -> RespStream:
        """The stream with the fewest jobs given and not yet ended."""
        return min(self.streams, key=RespStream.load)

    def close(self) -> None:
        """Close the streams (once their jobs begun are done)."""
        for stream in self.streams:
            stream.close()


# Connections a stream spreads an independent pipeline (a store's SETs) over, a command
# on each in turn: a server spends less CPU per byte on SETs of large values that arrive
# one per connection than on SETs queued one after another on one (docs/redis.md).
_SPREAD = 8


class _Group(NamedTuple):
    """A share of a pipeline sent on one connection: the connection, the indexes of its
    commands in the pipeline, their sinks and expected replies, and what ``receive``
    needs (what ``send`` returned, and the pipeline's deadline)."""

    connection: RespConnection
    indexes: Sequence[int]
    sinks: Sequence[Sink | None] | None
    expected: Sequence[Expected] | None
    sent: int
    deadline: float


def _send_group(
    connection: RespConnection,
    pipeline: Pipeline,
    deadline: float,
    chosen: list[int] | None = None,
) -> _Group:
    """Send the commands of ``pipeline`` at the indexes ``chosen`` (None: all of them) on
    ``connection``, by ``deadline``, which their replies are to be in by too."""
    if chosen is None:
        indexes: Sequence[int] = range(len(pipeline.commands))
        commands, sinks, expected = pipeline.commands, pipeline.sinks, pipeline.expected
    else:
        indexes, commands = chosen, [pipeline.commands[i] for i in chosen]
        sinks, expected = _chosen(chosen, pipeline.sinks), _chosen(chosen, pipeline.expected)
    sent = connection.send(commands, sinks, expected, deadline=deadline)
    return _Group(connection, indexes, sinks, expected, sent, deadline)


def _receive_groups(pipeline: Pipeline, groups: list[_Group]) -> Replies:
    """The replies of ``pipeline`` sent as ``groups``, in its commands' order (a
    connection's replies come in the order its groups were sent)."""
    if len(groups) == 1 and len(groups[0].indexes) == len(pipeline.commands):
        return _receive_group(groups[0])  # the whole pipeline, in order
    replies: Replies = [None] * len(pipeline.commands)
    for group in groups:
        for i, reply in zip(group.indexes, _receive_group(group), strict=True):
            replies[i] = reply
    return replies


def _receive_group(group: _Group) -> Replies:
    """The replies of the commands sent as ``group``, in their order."""
    connection, count = group.connection, len(group.indexes)
    sent, deadline = group.sent, group.deadline
    return connection.receive(count, group.sinks, group.expected, sent, deadline=deadline)


def _deadline(endpoint: Endpoint) -> float:
    """The deadline of a pipeline sent now: ``timeout_s`` from now."""
    return time.monotonic() + endpoint.timeout_s


class ServerLink:
    """A stream's connections to one server (raises as :class:`RespConnection` does): one
    for pipelines whose commands run in order, and up to ``_SPREAD`` more, each made as
    first needed, over which an independent pipeline goes a command on each in turn."""

    def __init__(self, endpoint: Endpoint) -> None:
        self._endpoint = endpoint
        self._connection: RespConnection | None = None
        self._spread: list[RespConnection] = []
        self._next = 0

    def send(self, pipeline: Pipeline) -> list[_Group]:
        """Send ``pipeline``; returns what :meth:`receive` needs to read its replies."""
        deadline = _deadline(self._endpoint)
        if not pipeline.independent:
            if self._connection is None:
                self._connection = RespConnection(self._endpoint, deadline)
            return [_send_group(self._connection, pipeline, deadline)]
        return [
            _send_group(self._spread_one(deadline), pipeline, deadline, [i])
            for i in range(len(pipeline.commands))
        ]

    def receive(self, pipeline: Pipeline, groups: list[_Group]) -> Replies:
        """The replies of ``pipeline``, :meth:`send` having returned ``groups``."""
        return _receive_groups(pipeline, groups)

    def stale(self) -> bool:
        """Whether an idle connection is of no further use (:func:`any_stale`)."""
        return any_stale(self._connections())

    def close(self) -> None:
        for connection in self._connections():
            connection.close()

    def _connections(self) -> list[RespConnection]:
        made = [] if self._connection is None else [self._connection]
        return made + self._spread

    def _spread_one(self, deadline: float) -> RespConnection:
        """The next spread connection: a new one (made by ``deadline``) while fewer than
        ``_SPREAD`` are made."""
        if len(self._spread) < _SPREAD:
            self._spread.append(RespConnection(self._endpoint, deadline))
            return self._spread[-1]
        connection = self._spread[self._next]
        self._next = (self._next + 1) % _SPREAD
        return connection


class ClusterLink:
    """A stream's connections to the nodes of ``cluster`` (reached as ``endpoint`` says:
    credentials, TLS, timeouts). Raises the client's error (a connection failed or timed
    out, the cluster is down), retrying nothing; the map of the slots is refreshed first
    (through redis-py's client, as a redirected command is sent again: those calls
    are redis-py's, each socket operation bounded by ``timeout_s``)."""

    def __init__(self, endpoint: Endpoint, cluster: RedisCluster) -> None:
        self._endpoint, self._cluster = endpoint, cluster
        self._connections: dict[Endpoint, RespConnection] = {}

    def send(self, pipeline: Pipeline) -> list[_Group]:
        """Send every node's group of ``pipeline``; returns them for :meth:`receive`."""
        cluster = self._cluster
        indexes: dict[Endpoint, list[int]] = {}
        for i, name in enumerate(pipeline.names):
            node = cluster.nodes_manager.get_node_from_slot(cluster.keyslot(name))
            indexes.setdefault(self._endpoint.at(node.host, node.port), []).append(i)
        groups: list[_Group] = []
        deadline = _deadline(self._endpoint)
        try:
            for endpoint, chosen in indexes.items():
                connection = self._connections.get(endpoint)
                if connection is None:
                    connection = RespConnection(endpoint, deadline)
                    self._connections[endpoint] = connection
                groups.append(_send_group(connection, pipeline, deadline, chosen))
        except CLIENT_ERRORS:
            self._refresh()
            raise
        return groups

    def receive(self, pipeline: Pipeline, groups: list[_Group]) -> Replies:
        """The replies of ``pipeline``, in its commands' order (an error reply in its
        place; a redirected command's reply as redis-py gives it, with no sink)."""
        try:
            replies = _receive_groups(pipeline, groups)
        except CLIENT_ERRORS:
            self._refresh()
            raise
        for i, reply in enumerate(replies):
            if isinstance(reply, ClusterDownError):
                raise reply
            if isinstance(reply, (AskError, TryAgainError)):  # MovedError is an AskError
                replies[i] = self._redirected(pipeline.commands[i])
        return replies

    def _redirected(self, command: Command) -> Any:
        """``command`` sent again through redis-py, which follows the redirection."""
        try:
            return self._cluster.execute_command(*joined(command))
        except ResponseError as exc:
            if isinstance(exc, ClusterDownError):
                raise
            return exc

    def stale(self) -> bool:
        """Whether any idle connection of the link is of no further use."""
        return any_stale(self._connections.values())

    def close(self) -> None:
        for connection in self._connections.values():
            connection.close()
        self._connections.clear()

    def _refresh(self) -> None:
        """Reload the cluster's map of the slots after a node failed (best effort)."""
        try:
            self._cluster.nodes_manager.initialize()
        except CLIENT_ERRORS as exc:  # the next call tries again
            logger.debug("redis tier: refreshing the cluster's slots failed: %r", exc)


def _chosen(indexes: list[int], items: Sequence[_T] | None) -> list[_T] | None:
    """The ``items`` at ``indexes`` (None for None)."""
    return None if items is None else [items[i] for i in indexes]


__all__ = ["ClientError", "ClusterLink", "ServerLink", "WirePipelines"]
