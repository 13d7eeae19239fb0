"""redis-py's client as the Redis tier uses it, on the tier's I/O threads: urls checked
without ever quoting them, clients that never retry (redis-py's retries made a call to a
dead node wait for several timeouts; a cluster's MOVED, ASK and TRYAGAIN are followed),
pipelines that fail one key at a time, and errors stripped of block bytes.
"""

from __future__ import annotations

import logging
import re
import urllib.parse
from collections.abc import Sequence
from typing import Any

from tiering.errors import InvalidArgumentError

try:
    from redis import Redis
    from redis.backoff import NoBackoff
    from redis.cluster import PipelineCommand, RedisCluster
    from redis.connection import URL_QUERY_ARGUMENT_PARSERS, Connection, parse_url
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
    from redis.retry import Retry
except ImportError as exc:  # pragma: no cover - exercised only without redis-py
    raise ImportError(
        "the redis tier needs redis-py (pip install 'kv-tiering[redis]'); "
        f"importing it failed: {type(exc).__name__}: {exc}"
    ) from exc

logger = logging.getLogger(__name__)

# What a call to the server may raise (the cluster client's own errors are no RedisErrors).
CLIENT_ERRORS = (RedisError, RedisClusterException, OSError)
ClientError = RedisError | RedisClusterException | OSError
UNREACHABLE = (
    RedisConnectionError,
    RedisTimeoutError,
    ClusterDownError,
    RedisClusterException,  # no node of the cluster answered, or a slot has no node
    OSError,  # the builtin ConnectionError and TimeoutError too
)
_NODE_DOWN = (RedisConnectionError, RedisTimeoutError, ClusterDownError)  # the node failed


def new_client(
    url: str, *, cluster: bool, timeout_s: float, max_connections: int, tls: dict[str, str]
) -> Redis | RedisCluster:
    """A client of ``url`` (checked by :func:`check_url`) whose every call times out
    after ``timeout_s``; with ``cluster`` a cluster client, which connects as it is made
    (raising the client's error if no node answers)."""
    options: dict[str, Any] = {
        "socket_timeout": timeout_s,
        "socket_connect_timeout": timeout_s,
        "max_connections": max_connections,
        "decode_responses": False,
        **tls,
    }
    if cluster:
        return RedisCluster.from_url(url, retry=Retry(NoBackoff(), 0), **options)
    return Redis.from_url(url, **options)


_TIER_SETS = {
    "socket_timeout": "timeout_s",
    "socket_connect_timeout": "timeout_s",
    "max_connections": "max_connections",
    "retry_on_timeout": "timeout_s",
    "retry_on_error": "timeout_s",
}
"""Query options of a url that the tier sets itself, and the tier option that does."""


def check_url(url: object, *, cluster: bool) -> None:
    """Check that redis-py will connect with ``url`` as the tier means it to; else
    raise InvalidArgumentError saying what is wrong (no redis://, rediss:// or unix://
    url redis-py parses, a path that is no database number, a query option the tier
    sets itself, a database other than 0 or unix:// for a cluster), never quoting it."""
    if isinstance(url, str) and url.startswith("unix://") and cluster:
        raise InvalidArgumentError("cluster needs a redis:// or rediss:// url, not unix://")
    problem = _url_problem(url, cluster=cluster)
    if problem is not None:  # raised here, outside any handler: no parser error chained
        raise InvalidArgumentError(f"url: {problem} (the url is not shown: it may hold a password)")


def _url_problem(url: object, *, cluster: bool) -> str | None:
    """What is wrong with ``url``, in words that quote no part of it; None if nothing."""
    if not isinstance(url, str) or not url.startswith(("redis://", "rediss://", "unix://")):
        return "must be a redis://, rediss:// or unix:// URL"
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:  # its message may quote a piece of the url
        return "its host cannot be parsed"
    try:
        port = None if parts.scheme == "unix" else parts.port
    except ValueError:  # its message quotes the port, which may be a piece of a password
        return (
            "its port is not a number from 1 to 65535 (a '/', '?' or '#' in the user "
            "name or password must be percent-encoded: %2F, %3F, %23)"
        )
    # A password always comes before an '@': with one after the host (or a fragment),
    # part of the credentials spilled into the path, query or fragment.
    if "#" in url or "@" in parts.path + parts.query:
        return (
            "it holds an unescaped '/', '?', '#' or '@' after the user name or password "
            "(percent-encode them: %2F, %3F, %23, %40)"
        )
    if port == 0:
        return "its port is not a number from 1 to 65535"
    if parts.scheme == "unix":
        if not parts.path:
            return "a unix:// url needs the path of the server's socket"
    else:
        database = urllib.parse.unquote(parts.path).strip("/")
        if database and not database.isdigit():
            return "its path must be the database number (/0, /1, ...) or nothing"
    for name, values in urllib.parse.parse_qs(parts.query).items():
        if name in _TIER_SETS:
            return f"its query sets {name}, which the tier sets from {_TIER_SETS[name]}"
        parse = URL_QUERY_ARGUMENT_PARSERS.get(name)  # a name redis-py knows: safe to show
        try:
            if parse is not None:
                parse(values[0])
        except (TypeError, ValueError):
            return f"its query option {name} has an invalid value"
    try:
        options = parse_url(url)  # the parser redis-py connects with
    except (TypeError, ValueError):
        return "redis-py cannot parse it"
    if cluster and options.get("db", 0) != 0:
        return "a Redis Cluster has database 0 only"
    connection_class = options.pop("connection_class", Connection)
    try:
        connection_class(**options)  # builds the connection redis-py would, unconnected
    except (TypeError, ValueError, RedisError):
        return "its query has an option redis-py does not take, or an invalid value"
    return None


def round_trip(client: Redis | RedisCluster, commands: Sequence[tuple[Any, ...]]) -> list[Any]:
    """Send ``commands`` pipelined (one round trip, or one per node of a cluster) and
    read every reply, once. An error reply to one command (WRONGTYPE, OOM) comes back in
    its place; a cluster's MOVED, ASK or TRYAGAIN is followed by sending that command
    again on its own. Raises the client's error when a connection fails or times out or
    the cluster is down, retrying nothing (a cluster client refreshes its slot map)."""
    if not isinstance(client, RedisCluster):
        pipe = client.pipeline(transaction=False)
        for command in commands:
            pipe.execute_command(*command)
        replies = pipe.execute(raise_on_error=False)
    else:
        # Not the pipeline's own execute: after a node timed out it sends each of that
        # node's commands again on its own, each waiting for its timeout. Without
        # redirections each node is written and read once, its errors left in place;
        # the redirected commands are sent again below.
        stack = [PipelineCommand(command, {}, i) for i, command in enumerate(commands)]
        pipe = client.pipeline(transaction=False)
        replies = pipe.send_cluster_commands(stack, raise_on_error=False, allow_redirections=False)
        down = next((reply for reply in replies if isinstance(reply, _NODE_DOWN)), None)
        if down is not None:
            _forget_frames(replies)
            try:
                client.nodes_manager.initialize()
            except CLIENT_ERRORS as exc:  # the next call tries again
                logger.debug("redis tier: refreshing the cluster's slots failed: %r", exc)
            raise detached(down)  # a copy: the original sits in the replies
        for i, reply in enumerate(replies):
            if isinstance(reply, (AskError, TryAgainError)):  # MovedError is an AskError
                try:
                    replies[i] = client.execute_command(*commands[i])
                except ResponseError as exc:
                    if isinstance(exc, ClusterDownError):
                        raise
                    replies[i] = exc
    _forget_frames(replies)
    return replies


def _forget_frames(replies: list[Any]) -> None:
    """Clear the tracebacks of error replies: their frames, down in the client, name the
    commands and with them views of the host pool, which must not outlive the call."""
    for reply in replies:
        if isinstance(reply, BaseException):
            reply.__traceback__ = None


def first_error(replies: Sequence[Any]) -> ResponseError | None:
    return next((reply for reply in replies if isinstance(reply, ResponseError)), None)


def holds_another_type(error: ResponseError) -> bool:
    """The key holds no hash (another client wrote it): for this tier, a corrupt block."""
    return str(error).startswith("WRONGTYPE")


def detached(exc: ClientError) -> ClientError:
    """A copy of ``exc`` with no traceback, no chained errors and no quoted command:
    a traceback's frames hold the hop's views and replies (block bytes that must not
    outlive the job), and a pipeline's error quotes the failed command (block bytes)."""
    args = list(exc.args)
    if args and isinstance(args[0], str):
        args[0] = _QUOTED_COMMAND.sub("", args[0])
    try:
        return type(exc)(*args)
    except TypeError:  # a class whose constructor wants other arguments
        return RedisError(str(args[0]) if args else type(exc).__name__)


_QUOTED_COMMAND = re.compile(r"^Command # \d+ \(.*\) of pipeline caused error: ", re.DOTALL)


__all__ = [
    "CLIENT_ERRORS",
    "UNREACHABLE",
    "AskError",
    "AuthenticationError",
    "ClientError",
    "ClusterDownError",
    "Redis",
    "RedisCluster",
    "RedisConnectionError",
    "RedisTimeoutError",
    "ResponseError",
    "TryAgainError",
    "check_url",
    "detached",
    "first_error",
    "holds_another_type",
    "new_client",
    "round_trip",
]
