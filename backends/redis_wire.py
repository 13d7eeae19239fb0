"""The Redis tier's pipelines on its own RESP connections (:mod:`backends.resp_connection`),
to one server (carried by streams, :mod:`backends.redis_stream`, or one round trip at
a time) or to every node of a cluster at once.

On a cluster, a pipeline's commands are grouped by the node that owns their key's
slot (redis-py's map of the slots) and every node's group is sent before any reply is
read: the nodes work at once, and one thread reads their replies in turn. A command a
node redirects (MOVED, ASK, TRYAGAIN) is sent again through redis-py's cluster client,
which follows it and updates its map; a node that fails makes the pipeline raise (the
connections it used closed, replies left unread on them) after the map is refreshed.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from backends.redis_client import (
    CLIENT_ERRORS,
    AskError,
    ClientError,
    ClusterDownError,
    RedisCluster,
    ResponseError,
    TryAgainError,
)
from backends.redis_stream import RespStream
from backends.resp import Reply, Sink, joined
from backends.resp_connection import Command, ConnectionPool, Endpoint, Expected, RespConnection

logger = logging.getLogger(__name__)

Replies = list[Reply | ResponseError | Any]


class WirePipelines:
    """Pipelined round trips of the tier's data commands (their keys in ``names``,
    one per command) to ``endpoint``, or with ``cluster`` (redis-py's client) to the
    node of each key; with ``streams``, that many :class:`RespStream` s to ``endpoint``
    (each keeping ``window`` pipelines on the wire at most)."""

    def __init__(
        self,
        endpoint: Endpoint,
        cluster: RedisCluster | None = None,
        *,
        streams: int = 0,
        window: int = 1,
    ) -> None:
        self._endpoint = endpoint
        self._cluster = cluster
        self._pool = ConnectionPool()
        self.streams = [
            RespStream(endpoint, window=window, name=f"RedisTier-stream-{i}")
            for i in range(streams if cluster is None else 0)
        ]
        """The streams to the server (none to a cluster): :meth:`stream` picks one."""

    def stream(self) -> RespStream:
        """The stream with the fewest jobs waiting."""
        return min(self.streams, key=RespStream.queued)

    def round_trip(
        self,
        names: Sequence[bytes],
        commands: Sequence[Command],
        sinks: Sequence[Sink | None] | None = None,
        expected: Sequence[Expected] | None = None,
    ) -> Replies:
        """Send ``commands`` and read every reply, in the commands' order (an error
        reply in its place; a redirected command's reply as redis-py gives it, with no
        sink). ``sinks`` and ``expected``: as :meth:`RespConnection.round_trip` takes
        them. Raises the client's error (connection failed or timed out, cluster down),
        retrying nothing."""
        cluster = self._cluster
        if cluster is None:
            return self._pool.run(self._endpoint, lambda c: c.round_trip(commands, sinks, expected))
        groups: dict[Endpoint, list[int]] = {}
        for i, name in enumerate(names):
            node = cluster.nodes_manager.get_node_from_slot(cluster.keyslot(name))
            groups.setdefault(self._endpoint.at(node.host, node.port), []).append(i)
        replies: Replies = [None] * len(commands)
        # Every node's group is sent before any reply is read, so the nodes work at
        # once; one thread reads them in turn (threads per node would only wait on each
        # other for the GIL). Nothing reads into the caller's memory once this returns.
        parts = [(endpoint, group, *_chosen(group, commands, sinks, expected))
                 for endpoint, group in groups.items()]  # fmt: skip
        taken: list[RespConnection] = []
        pads: list[int] = []
        failure: BaseException | None = None
        try:
            for endpoint, _, chosen, chosen_sinks, chosen_expected in parts:
                taken.append(self._pool.take(endpoint))
                pads.append(taken[-1].send(chosen, chosen_sinks, chosen_expected))
            for part, connection, pad in zip(parts, taken, pads, strict=True):
                _, group, _, chosen_sinks, chosen_expected = part
                got = connection.receive(len(group), chosen_sinks, chosen_expected, pad)
                self._place(replies, group, got)
        except CLIENT_ERRORS as exc:
            failure = exc
        for connection in taken:
            if failure is None:
                self._pool.give(connection)
            else:  # replies may be left unread on it
                connection.close()
        if failure is not None:
            self._refresh()
            raise failure
        for i, reply in enumerate(replies):
            if isinstance(reply, ClusterDownError):
                raise reply
            if isinstance(reply, (AskError, TryAgainError)):  # MovedError is an AskError
                try:
                    replies[i] = cluster.execute_command(*joined(commands[i]))
                except ResponseError as exc:
                    if isinstance(exc, ClusterDownError):
                        raise
                    replies[i] = exc
        return replies

    @staticmethod
    def _place(replies: Replies, group: list[int], got: Replies) -> None:
        for i, reply in zip(group, got, strict=True):
            replies[i] = reply

    def _refresh(self) -> None:
        """Reload the cluster's map of the slots after a node failed (best effort)."""
        try:
            assert self._cluster is not None
            self._cluster.nodes_manager.initialize()
        except CLIENT_ERRORS as exc:  # the next call tries again
            logger.debug("redis tier: refreshing the cluster's slots failed: %r", exc)

    def close(self) -> None:
        """Close the idle connections (those in use close as their hop ends) and the
        streams (once their jobs begun are done)."""
        self._pool.close()
        for stream in self.streams:
            stream.close()


def _chosen(
    group: list[int],
    commands: Sequence[Command],
    sinks: Sequence[Sink | None] | None,
    expected: Sequence[Expected] | None,
) -> tuple[list[Command], list[Sink | None] | None, list[Expected] | None]:
    """The commands, sinks and expected replies of ``group`` (indexes into them)."""
    return (
        [commands[i] for i in group],
        None if sinks is None else [sinks[i] for i in group],
        None if expected is None else [expected[i] for i in group],
    )


__all__ = ["ClientError", "WirePipelines"]
