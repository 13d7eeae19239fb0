"""The Redis tier's pipelines on its own RESP connections (:mod:`backends.resp_connection`),
to one server (carried by streams, :mod:`backends.redis_stream`, or one round trip at
a time) or to every node of a cluster at once.

On a cluster, a pipeline's commands are grouped by the node that owns their key's
slot (redis-py's map of the slots) and every node's group is sent at the same time,
each on its own thread: the pipeline takes as long as its slowest node, not the sum.
A command a node redirects (MOVED, ASK, TRYAGAIN) is sent again through redis-py's
cluster client, which follows it and updates its map; a node that fails makes the
pipeline raise once every other node's group is over (none of them still reads into
or sends from the caller's memory), after the map is refreshed.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from backends.redis_client import (
    CLIENT_ERRORS,
    AskError,
    ClientError,
    ClusterDownError,
    RedisCluster,
    RedisConnectionError,
    ResponseError,
    TryAgainError,
)
from backends.redis_stream import RespStream
from backends.resp import Reply, Sink, joined
from backends.resp_connection import Command, ConnectionPool, Endpoint, Expected
from tiering.workers import init_io_worker

logger = logging.getLogger(__name__)

Replies = list[Reply | ResponseError | Any]


class WirePipelines:
    """Pipelined round trips of the tier's data commands (their keys in ``names``,
    one per command) to ``endpoint``, or with ``cluster`` (redis-py's client) to the
    node of each key; ``fan_out`` threads send to a cluster's other nodes."""

    def __init__(
        self,
        endpoint: Endpoint,
        cluster: RedisCluster | None = None,
        *,
        fan_out: int = 1,
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
        self._fan_out = (
            ThreadPoolExecutor(
                max_workers=fan_out,
                thread_name_prefix="RedisTier-node",
                initializer=init_io_worker,  # scheduled as the tier's own I/O threads
            )
            if cluster is not None
            else None
        )

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
        parts = list(groups.items())
        assert self._fan_out is not None
        others: list[tuple[list[int], Future[Replies]]] = []
        failure: BaseException | None = None
        for endpoint, group in parts[1:]:
            try:
                call = self._fan_out.submit(
                    self._group_trip, endpoint, group, commands, sinks, expected
                )
            except RuntimeError:  # shut down: the tier is closing
                failure = RedisConnectionError("the redis tier is closed")
                parts = []  # nothing more is sent; what was is waited for below
                break
            others.append((group, call))
        try:
            if parts:
                endpoint, group = parts[0]
                got = self._group_trip(endpoint, group, commands, sinks, expected)
                self._place(replies, group, got)
        except CLIENT_ERRORS as exc:
            failure = exc
        for group, future in others:  # every group waited for: they use the caller's memory
            try:
                self._place(replies, group, future.result())
            except CLIENT_ERRORS as exc:
                failure = failure or exc
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

    def _group_trip(
        self,
        endpoint: Endpoint,
        group: list[int],
        commands: Sequence[Command],
        sinks: Sequence[Sink | None] | None,
        expected: Sequence[Expected] | None,
    ) -> Replies:
        chosen = [commands[i] for i in group]
        chosen_sinks = None if sinks is None else [sinks[i] for i in group]
        chosen_expected = None if expected is None else [expected[i] for i in group]
        return self._pool.run(
            endpoint, lambda c: c.round_trip(chosen, chosen_sinks, chosen_expected)
        )

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
        if self._fan_out is not None:
            self._fan_out.shutdown(wait=False)


__all__ = ["ClientError", "WirePipelines"]
