"""The Redis tier's pipelines on its own RESP connections (:mod:`backends.resp_connection`),
to one server or to every node of a cluster at once.

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
from backends.resp import Reply, Sink, joined
from backends.resp_connection import Command, ConnectionPool, Endpoint
from tiering.workers import init_io_worker

logger = logging.getLogger(__name__)

Replies = list[Reply | ResponseError | Any]


class WirePipelines:
    """Pipelined round trips of the tier's data commands (their keys in ``names``,
    one per command) to ``endpoint``, or with ``cluster`` (redis-py's client) to the
    node of each key; ``fan_out`` threads send to a cluster's other nodes."""

    def __init__(
        self, endpoint: Endpoint, cluster: RedisCluster | None = None, *, fan_out: int = 1
    ) -> None:
        self._endpoint = endpoint
        self._cluster = cluster
        self._pool = ConnectionPool()
        self._fan_out = (
            ThreadPoolExecutor(
                max_workers=fan_out,
                thread_name_prefix="RedisTier-node",
                initializer=init_io_worker,  # scheduled as the tier's own I/O threads
            )
            if cluster is not None
            else None
        )

    def round_trip(
        self,
        names: Sequence[bytes],
        commands: Sequence[Command],
        sinks: Sequence[Sink | None] | None = None,
    ) -> Replies:
        """Send ``commands`` and read every reply, in the commands' order (an error
        reply in its place; a redirected command's reply as redis-py gives it, with no
        sink). Raises the client's error (connection failed or timed out, cluster down),
        retrying nothing."""
        cluster = self._cluster
        if cluster is None:
            return self._pool.run(self._endpoint, lambda c: c.round_trip(commands, sinks))
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
                call = self._fan_out.submit(self._group_trip, endpoint, group, commands, sinks)
            except RuntimeError:  # shut down: the tier is closing
                failure = RedisConnectionError("the redis tier is closed")
                parts = []  # nothing more is sent; what was is waited for below
                break
            others.append((group, call))
        try:
            if parts:
                endpoint, group = parts[0]
                self._place(replies, group, self._group_trip(endpoint, group, commands, sinks))
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
    ) -> Replies:
        chosen = [commands[i] for i in group]
        chosen_sinks = None if sinks is None else [sinks[i] for i in group]
        return self._pool.run(endpoint, lambda c: c.round_trip(chosen, chosen_sinks))

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
        """Close the idle connections (those in use close as their hop ends)."""
        self._pool.close()
        if self._fan_out is not None:
            self._fan_out.shutdown(wait=False)


__all__ = ["ClientError", "WirePipelines"]
