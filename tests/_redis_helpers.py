"""A real redis-server for the Redis tests (see ``backends.redis_server``)."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from backends.redis_server import SERVER, LocalRedisCluster, LocalRedisServer
from tiering.registry import make_tier


def _require_redis() -> None:
    """Skip the test, saying how to install what is missing, without redis-server or
    redis-py (fail with ``KV_TIERING_REQUIRE_REDIS=1``, as in CI)."""
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


def local_redis_server(
    directory: Path, *args: str, tls: tuple[Path, Path, Path] | None = None
) -> LocalRedisServer:
    """A started :class:`~backends.redis_server.LocalRedisServer` (or a skip, as
    :func:`_require_redis` says)."""
    _require_redis()
    server = LocalRedisServer(directory, *args, tls=tls)
    server.start()
    return server


def local_redis_cluster(directory: Path) -> LocalRedisCluster:
    """A started three-node :class:`~backends.redis_server.LocalRedisCluster` (or a
    skip, as :func:`_require_redis` says)."""
    _require_redis()
    cluster = LocalRedisCluster(directory)
    try:
        cluster.start()
    except BaseException:
        cluster.stop()
        raise
    return cluster


def self_signed_tls(directory: Path) -> tuple[Path, Path, Path]:
    """A throwaway CA and a server certificate for 127.0.0.1 signed by it, made with the
    ``openssl`` command (without it the test skips, or fails as the servers do):
    ``(certificate, key, CA certificate)``."""
    openssl = shutil.which("openssl")
    if openssl is None:
        required = os.environ.get("KV_TIERING_REQUIRE_REDIS") == "1"
        (pytest.fail if required else pytest.skip)("openssl is not installed")
    ca_key, ca_crt = directory / "ca.key", directory / "ca.crt"
    key, csr, crt = directory / "server.key", directory / "server.csr", directory / "server.crt"
    extensions = directory / "san.ext"
    extensions.write_text("subjectAltName=IP:127.0.0.1\n")
    for argv in (
        ["req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", ca_key, "-out", ca_crt,
         "-days", "1", "-subj", "/CN=kv-tiering test CA"],
        ["req", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", csr,
         "-subj", "/CN=127.0.0.1"],
        ["x509", "-req", "-in", csr, "-CA", ca_crt, "-CAkey", ca_key, "-CAcreateserial",
         "-out", crt, "-days", "1", "-extfile", extensions],
    ):  # fmt: skip
        subprocess.run([openssl, *map(str, argv)], check=True, capture_output=True, timeout=60)
    return crt, key, ca_crt


BLOCK = 16 << 10
"""The block size of the Redis tier tests."""


@asynccontextmanager
async def opened(
    pool: memoryview, server: LocalRedisServer | LocalRedisCluster, **options: Any
) -> AsyncIterator[Any]:
    """A started Redis tier of namespace ``model-a`` on ``server`` over ``pool``, closed
    on leaving."""
    spec = {"type": "redis", "url": server.url, "namespace": "model-a", **options}
    tier = make_tier(spec, pool, BLOCK)
    await tier.start()
    try:
        yield tier
    finally:
        await tier.aclose()


def keys(n: int, prefix: str = "k") -> list[bytes]:
    """``n`` distinct 32-byte block keys."""
    return [f"{prefix}{i}".encode().ljust(32, b".") for i in range(n)]


def slot(pool: memoryview, i: int) -> bytes:
    """The bytes of slot ``i`` of ``pool``."""
    return bytes(pool[i * BLOCK : (i + 1) * BLOCK])


async def settled(answer: Callable[[], object], bound_s: float = 10.0) -> object:
    """Ask until the answer is not None ("ask again"), as a scheduler does each step."""
    deadline = asyncio.get_running_loop().time() + bound_s
    while (value := answer()) is None:
        assert asyncio.get_running_loop().time() < deadline, "the lookup never settled"
        await asyncio.sleep(0.005)
    return value
