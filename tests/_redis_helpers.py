"""A real redis-server for the Redis tests (see ``backends.redis_server``)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from backends.redis_server import SERVER, LocalRedisServer


def local_redis_server(directory: Path, *args: str) -> LocalRedisServer:
    """A started :class:`~backends.redis_server.LocalRedisServer`; without redis-server or
    redis-py the test skips, saying how to install them (fails with
    ``KV_TIERING_REQUIRE_REDIS=1``, as in CI)."""
    required = os.environ.get("KV_TIERING_REQUIRE_REDIS") == "1"
    missing = []
    if SERVER is None:
        missing.append("redis-server (apt-get install redis-server)")
    try:
        import redis  # noqa: F401
    except ImportError:
        missing.append("redis-py (pip install 'kv-tiering[redis]')")
    if missing:
        (pytest.fail if required else pytest.skip)(f"not installed: {', '.join(missing)}")
    server = LocalRedisServer(directory, *args)
    server.start()
    return server
