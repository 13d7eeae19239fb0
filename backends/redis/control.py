"""redis-py, for the Redis tier's control calls only (the start's checks, lookups'
``EXISTS``, usage, deletes, a cluster's slot map and redirections; never blocks): the
client made when first needed, pipelines that fail one key at a time, and errors
stripped of block bytes.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable, Sequence
from typing import Any

try:
    from redis import Redis
    from redis._parsers.base import BaseParser
    from redis.cluster import PipelineCommand, RedisCluster
    from redis.exceptions import (
        AskError,
        AuthenticationError,
        ClusterDownError,
        RedisClusterException,
        RedisError,
        ResponseError,
        TryAgainError,
    )
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import TimeoutError as RedisTimeoutError
except ImportError as exc:  # pragma: no cover - exercised only without redis-py
    raise ImportError(
        "the redis tier needs redis-py (pip install 'kv-tiering[redis]'); "
        f"importing it failed: {type(exc).__name__}: {exc}"
    ) from exc

logger = logging.getLogger(__name__)

# What a call to the server may raise (the cluster client's own errors are no RedisErrors).
CLIENT_ERRORS = (RedisError, RedisClusterException, OSError)
ClientError = RedisError | RedisClusterException | OSError
_NODE_DOWN = (RedisConnectionError, RedisTimeoutError, ClusterDownError)  # the node failed
# A node failed, no node of the cluster answered (or a slot has no node), or the socket
# failed (OSError: the builtin ConnectionError and TimeoutError too).
UNREACHABLE = (*_NODE_DOWN, RedisClusterException, OSError)


class LazyClient:
    """The tier's client, made once by ``make()`` at the first :meth:`get` (a cluster
    client connects as it is made: one whose nodes are down at start is made later)."""

    def __init__(self, make: Callable[[], Redis | RedisCluster]) -> None:
        self._make = make
        self._client: Redis | RedisCluster | None = None
        self._closed = False
        self._lock = threading.Lock()

    def get(self) -> Redis | RedisCluster:
        """The client, made now if needed. Raises RedisConnectionError once closed, the
        client's error if it cannot be made (no cluster node answers)."""
        with self._lock:
            if self._closed:
                raise RedisConnectionError("the redis tier is closed")
            if self._client is None:
                self._client = self._make()
            return self._client

    def delete(self, names: list[bytes]) -> None:
        """Delete ``names`` from the server, as far as it goes: a failure is logged (the
        next load of each fails again)."""
        try:
            self.get().delete(*names)
        except CLIENT_ERRORS as exc:
            logger.debug("redis tier: deleting corrupt blocks failed: %r", detached(exc))

    def close(self) -> None:
        """Drop the client (its pool's idle connections closed); none is made after."""
        with self._lock:
            self._closed = True
            client, self._client = self._client, None
        if client is not None:
            client.close()


def round_trip(client: Redis | RedisCluster, commands: Sequence[tuple[Any, ...]]) -> list[Any]:
    """Send ``commands`` pipelined (one round trip, or one per node of a cluster) and
    read every reply, once. An error reply to one command (WRONGTYPE, OOM) comes back in
    its place; a cluster's MOVED, ASK or TRYAGAIN is followed by sending that command
    again on its own. Raises the client's error when a connection fails or times out or
    the cluster is down, retrying nothing (a cluster client refreshes its slot map)."""
    pipe = client.pipeline(transaction=False)
    if not isinstance(client, RedisCluster):
        for command in commands:
            pipe.execute_command(*command)
        replies = pipe.execute(raise_on_error=False)
    else:
        # Not the pipeline's execute, which after a node timed out sends each of that
        # node's commands again on its own, each waiting for its timeout.
        stack = [PipelineCommand(command, {}, i) for i, command in enumerate(commands)]
        replies = pipe.send_cluster_commands(stack, raise_on_error=False, allow_redirections=False)
        down = next((reply for reply in replies if isinstance(reply, _NODE_DOWN)), None)
        if down is not None:
            _forget_frames(replies)
            refresh_slots(client)
            raise detached(down)  # a copy: the original sits in the replies
        for i, reply in enumerate(replies):
            if isinstance(reply, (AskError, TryAgainError)):
                replies[i] = redirected(client, commands[i])
    _forget_frames(replies)
    return replies


def redirected(cluster: RedisCluster, command: Sequence[Any]) -> Any:
    """The reply (or error reply) to ``command``, which a node redirected (MOVED, ASK,
    TRYAGAIN), sent again through ``cluster``, which follows the redirection and updates
    its map. Raises ClusterDownError and the client's other errors."""
    try:
        return cluster.execute_command(*command)
    except ResponseError as exc:
        if isinstance(exc, ClusterDownError):
            raise
        return exc


def refresh_slots(cluster: RedisCluster) -> None:
    """Reload ``cluster``'s slot map after a node failed (best effort)."""
    try:
        cluster.nodes_manager.initialize()
    except CLIENT_ERRORS as exc:
        logger.debug("redis tier: refreshing the cluster's slots failed: %r", exc)


def _forget_frames(replies: list[Any]) -> None:
    """Clear the tracebacks of error replies: their frames name the commands, and with
    them views of the host pool, which must not outlive the call."""
    for reply in replies:
        if isinstance(reply, BaseException):
            reply.__traceback__ = None


def detached(exc: ClientError) -> ClientError:
    """A copy of ``exc`` with no traceback, no chained errors and no quoted command
    (frames and a pipeline's quoted command hold block bytes that must not outlive
    the job)."""
    args = list(exc.args)
    if args and isinstance(args[0], str):
        args[0] = _QUOTED_COMMAND.sub("", args[0])
    try:
        return type(exc)(*args)
    except TypeError:  # a class whose constructor wants other arguments
        return RedisError(str(args[0]) if args else type(exc).__name__)


_QUOTED_COMMAND = re.compile(r"^Command # \d+ \(.*\) of pipeline caused error: ", re.DOTALL)


__all__ = [
    "CLIENT_ERRORS", "UNREACHABLE", "AskError", "AuthenticationError", "BaseParser",
    "ClientError", "ClusterDownError", "LazyClient", "Redis", "RedisCluster",
    "RedisConnectionError", "RedisTimeoutError", "ResponseError", "TryAgainError", "detached",
    "redirected", "refresh_slots", "round_trip",
]  # fmt: skip
