"""A real redis-server for the Redis tests (see ``tests._redis_servers``)."""

from __future__ import annotations

import asyncio
import os
import shutil
import struct
import subprocess
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import pytest

from tests._redis_servers import SERVER, LocalRedisCluster, LocalRedisServer
from tiering.tiers.block_record import namespace_digest
from tiering.tiers.registry import make_tier


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
    """A started :class:`~tests._redis_servers.LocalRedisServer` (or a skip, as
    :func:`_require_redis` says)."""
    _require_redis()
    server = LocalRedisServer(directory, *args, tls=tls)
    server.start()
    return server


def local_redis_cluster(directory: Path) -> LocalRedisCluster:
    """A started three-node :class:`~tests._redis_servers.LocalRedisCluster` (or a
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


class ReplyProxy:
    """A TCP proxy in front of a server (``port`` and ``url`` name it once
    :func:`serving`): each request goes on as it comes, and the server's replies too,
    except on a connection that sent one of ``markers`` in a request, whose replies go
    through :meth:`relay`."""

    def __init__(self, upstream: LocalRedisServer, *markers: bytes) -> None:
        self.upstream, self.markers = upstream, markers
        self.port, self.url = 0, ""
        self._writers: list[asyncio.StreamWriter] = []
        self._handlers: set[asyncio.Task[Any]] = set()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream.port)
        self._writers += (writer, up_writer)
        marked = False

        async def requests() -> None:
            nonlocal marked
            while data := await reader.read(1 << 16):
                marked = marked or any(marker in data for marker in self.markers)
                up_writer.write(data)
                await up_writer.drain()
            up_writer.close()

        async def replies() -> None:
            while data := await up_reader.read(1 << 16):
                if marked:
                    await self.relay(data, writer)
                else:
                    writer.write(data)
                    await writer.drain()
            writer.close()

        await asyncio.gather(requests(), replies(), return_exceptions=True)

    async def relay(self, data: bytes, writer: asyncio.StreamWriter) -> None:
        """Pass on ``data``, a reply (or part of one) on a marked connection."""
        writer.write(data)
        await writer.drain()

    def stop(self) -> None:
        """Let everything held go (on leaving :func:`serving`)."""

    async def close(self) -> None:
        """Close every connection made, both ways, and wait for their handlers."""
        for writer in self._writers:
            writer.close()
        await asyncio.gather(*self._handlers, return_exceptions=True)


class HeldReplies(ReplyProxy):
    """A :class:`ReplyProxy` that holds back the server's replies on each connection that
    sent ``marker`` in a request, until ``released`` is set; ``seen`` is set once such a
    reply is held (the server has run the command)."""

    def __init__(self, upstream: LocalRedisServer, marker: bytes) -> None:
        super().__init__(upstream, marker)
        self.seen, self.released = asyncio.Event(), asyncio.Event()

    async def relay(self, data: bytes, writer: asyncio.StreamWriter) -> None:
        if not self.released.is_set():
            self.seen.set()
            await self.released.wait()
        await super().relay(data, writer)

    def stop(self) -> None:
        self.released.set()


class DrippedReplies(ReplyProxy):
    """A :class:`ReplyProxy` that passes the server's replies on each connection that sent
    one of ``markers`` in a request a byte at a time, one every ``every_s``, inside
    :meth:`drip` (then the rest at once): a slow peer whose every byte comes well
    within a socket's timeout."""

    def __init__(self, upstream: LocalRedisServer, *markers: bytes, every_s: float) -> None:
        super().__init__(upstream, *markers)
        self.every_s = every_s
        self.dripping = False

    @contextmanager
    def drip(self) -> Iterator[None]:
        """Drip while inside; on leaving (an error too) the rest goes at once, so a call
        still waiting on a reply ends and the tier can close."""
        self.dripping = True
        try:
            yield
        finally:
            self.dripping = False

    async def relay(self, data: bytes, writer: asyncio.StreamWriter) -> None:
        view = memoryview(data)
        while view and self.dripping and not writer.is_closing():
            writer.write(view[:1])
            await writer.drain()
            view = view[1:]
            await asyncio.sleep(self.every_s)
        if view and not writer.is_closing():
            await super().relay(bytes(view), writer)

    def stop(self) -> None:
        self.dripping = False


@asynccontextmanager
async def serving(proxy: ReplyProxy) -> AsyncIterator[None]:
    """Serve ``proxy`` on a free loopback port (its ``url``) while inside; on leaving,
    let go what it holds and close its connections."""
    server = await asyncio.start_server(proxy.handle, "127.0.0.1", 0)
    proxy.port = server.sockets[0].getsockname()[1]
    proxy.url = f"redis://127.0.0.1:{proxy.port}/0"
    try:
        yield
    finally:
        proxy.stop()
        server.close()
        await proxy.close()
        await server.wait_closed()


@asynccontextmanager
async def holding_replies(upstream: LocalRedisServer, marker: bytes) -> AsyncIterator[HeldReplies]:
    """A :class:`HeldReplies` proxy in front of ``upstream``, serving while inside."""
    proxy = HeldReplies(upstream, marker)
    async with serving(proxy):
        yield proxy


DATA_COMMANDS = (b"$3\r\nGET\r\n", b"$3\r\nSET\r\n")
"""Markers of the requests the Redis tier moves blocks with (``GET``, ``SET``): its
checks and usage (``PING``, ``INFO``, ``EXISTS``, ...) hold none."""


@asynccontextmanager
async def dripping_replies(
    upstream: LocalRedisServer, every_s: float
) -> AsyncIterator[DrippedReplies]:
    """A :class:`DrippedReplies` proxy in front of ``upstream`` that drips the replies to
    the tier's data path (:data:`DATA_COMMANDS`), serving while inside."""
    proxy = DrippedReplies(upstream, *DATA_COMMANDS, every_s=every_s)
    async with serving(proxy):
        yield proxy


def name_of(key: bytes, namespace: str = "model-a", tenant: str = "") -> bytes:
    """The Redis key a block of ``namespace`` and ``tenant`` is stored under."""
    digest = namespace_digest(namespace).hex().encode()
    return b"kvt:2:" + digest + b":" + tenant.encode() + b":" + key


def record_of(server: LocalRedisServer, name: bytes) -> tuple[bytes, bytes]:
    """The header and payload of the block stored under the Redis key ``name`` (one
    string: the header, whose length is its u32 at offset 12, then the payload)."""
    value = server.command("GET", name)
    assert isinstance(value, bytes)
    (length,) = struct.unpack_from("<I", value, 12)
    return value[:length], value[length:]


def put_record(server: LocalRedisServer, name: bytes, header: bytes, payload: bytes) -> None:
    """Store ``header`` and ``payload`` under the Redis key ``name``, as the tier does."""
    server.command("SET", name, header + payload)


def damage_payload(client: Any, name: bytes) -> None:
    """Flip the last byte of the block stored under ``name`` (a byte of its payload)
    through ``client`` (redis-py's), the value's length unchanged: the block no longer
    verifies."""
    value = client.get(name)
    client.setrange(name, len(value) - 1, bytes([value[-1] ^ 0xFF]))


def client_of(server: LocalRedisServer | LocalRedisCluster) -> Any:
    """A plain redis-py client of ``server`` (a cluster client for a cluster), as
    another program on the server would use; close it after use."""
    import redis

    if isinstance(server, LocalRedisCluster):
        return redis.RedisCluster.from_url(server.url)
    return redis.Redis.from_url(server.url)


def owner_of(cluster: LocalRedisCluster, name: bytes) -> LocalRedisServer:
    """The node of ``cluster`` that serves the slot of the Redis key ``name``."""
    slot = cluster.nodes[0].command("CLUSTER", "KEYSLOT", name)
    ranges = cluster.nodes[0].command("CLUSTER", "SLOTS")
    assert isinstance(slot, int) and isinstance(ranges, list)
    for first, last, (_, port, *_), *_ in ranges:
        if first <= slot <= last:
            return next(node for node in cluster.nodes if node.port == port)
    raise AssertionError("no node serves the slot")


def move_slot_of(
    cluster: LocalRedisCluster, name: bytes, to: LocalRedisServer, *, finish: bool
) -> None:
    """Migrate the slot of ``name``, its keys and all, from its node to ``to``, as
    ``redis-cli --cluster reshard`` does. With ``finish`` False it stops halfway: the
    keys are on ``to`` but the slot still migrating, so the old node answers ASK (end
    it with :func:`give_slot_of`); with it, the slot is ``to``'s and the old node
    answers MOVED."""
    source = owner_of(cluster, name)
    slot = str(source.command("CLUSTER", "KEYSLOT", name))
    to.command("CLUSTER", "SETSLOT", slot, "IMPORTING", _id_of(source))
    source.command("CLUSTER", "SETSLOT", slot, "MIGRATING", _id_of(to))
    held = source.command("CLUSTER", "GETKEYSINSLOT", slot, "1000")
    assert isinstance(held, list)
    if held:
        source.command("MIGRATE", "127.0.0.1", str(to.port), "", "0", "5000", "KEYS", *held)
    if finish:
        give_slot_of(cluster, name, to)


def give_slot_of(cluster: LocalRedisCluster, name: bytes, to: LocalRedisServer) -> None:
    """Make the slot of ``name`` ``to``'s on every node (the end of a migration)."""
    slot = str(to.command("CLUSTER", "KEYSLOT", name))
    for node in [to, *(n for n in cluster.nodes if n is not to)]:
        node.command("CLUSTER", "SETSLOT", slot, "NODE", _id_of(to))


def _id_of(node: LocalRedisServer) -> bytes:
    node_id = node.command("CLUSTER", "MYID")
    assert isinstance(node_id, bytes)
    return node_id


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
