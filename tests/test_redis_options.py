"""The Redis tier's url options (``backends.redis.options``): those the tier implements
work on all of its connections against a real redis-server; every other one redis-py
takes is refused at construction, by name, never showing the url."""

from __future__ import annotations

import inspect
import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests._nvme_helpers import load_job, random_pool, store_job
from tests._redis_helpers import BLOCK, keys, local_redis_server, opened, self_signed_tls, slot
from tiering.errors import InvalidArgumentError
from tiering.tiers.registry import make_tier

if os.environ.get("KV_TIERING_REQUIRE_REDIS") != "1":  # CI: a missing redis-py fails
    pytest.importorskip("redis", reason="pip install 'kv-tiering[redis]'")

from redis.connection import URL_QUERY_ARGUMENT_PARSERS, SSLConnection, UnixDomainSocketConnection

IMPLEMENTED = {
    "db",
    "username",
    "password",
    "client_name",
    "socket_keepalive",
    "ssl_check_hostname",
}


def redis_py_options() -> list[str]:
    """Every query option redis-py's url parser or its connections take."""
    names = set(URL_QUERY_ARGUMENT_PARSERS)
    for kind in (SSLConnection, UnixDomainSocketConnection):
        for cls in kind.__mro__:
            if "__init__" in vars(cls):
                names.update(inspect.signature(cls.__init__).parameters)
    return sorted(names - {"self", "args", "kwargs"} - IMPLEMENTED)


@pytest.fixture
def pool() -> Iterator[memoryview]:
    with random_pool(BLOCK, 8) as view:
        yield view


def tier_of(pool: memoryview, url: str, **options: Any) -> Any:
    return make_tier({"type": "redis", "url": url, "namespace": "x", **options}, pool, BLOCK)


@pytest.mark.parametrize("name", redis_py_options())
def test_a_query_option_the_tier_does_not_implement_is_refused_by_name(
    pool: memoryview, name: str
) -> None:
    url = f"rediss://user:Zq9Secret@127.0.0.1:6390/0?{name}=1"
    with pytest.raises(InvalidArgumentError, match=f"url: its query (sets|option) {name}[ ,]"):
        tier_of(pool, url)
    with pytest.raises(InvalidArgumentError) as raised:
        tier_of(pool, url)
    assert "Zq9Secret" not in str(raised.value) + repr(raised.value)


def test_a_tls_file_in_the_query_points_at_the_tier_s_option(pool: memoryview) -> None:
    with pytest.raises(InvalidArgumentError, match=r"sets ssl_ca_certs, .* from tls_ca_file"):
        tier_of(pool, "rediss://127.0.0.1:6390/0?ssl_ca_certs=/etc/hostname")


@pytest.mark.parametrize(
    ("query", "why"),
    [
        ("client_name=two%20words", "client_name must be printable ASCII"),
        ("ssl_check_hostname=false", "ssl_check_hostname needs a rediss:// url"),
        ("db=x", "db has an invalid value"),
    ],
)
def test_an_implemented_option_with_a_value_the_tier_cannot_use_is_refused(
    pool: memoryview, query: str, why: str
) -> None:
    with pytest.raises(InvalidArgumentError, match=why):
        tier_of(pool, f"redis://127.0.0.1:6390/0?{query}")


def test_keepalive_over_a_unix_socket_is_refused(pool: memoryview) -> None:
    with pytest.raises(InvalidArgumentError, match="socket_keepalive needs a redis://"):
        tier_of(pool, "unix:///tmp/redis.sock?socket_keepalive=true")


async def test_client_name_names_every_connection_of_the_tier(
    pool: memoryview, redis_server: Any
) -> None:
    url = redis_server.url + "?client_name=kv-tier-named"
    async with opened(pool, redis_server, url=url) as tier:
        assert (await store_job(tier, keys(4), [0, 1, 2, 3])).success
        assert (await load_job(tier, keys(4), [4, 5, 6, 7])).success
        clients = redis_server.command("CLIENT", "LIST")
        assert isinstance(clients, bytes)
        ours = [line for line in clients.splitlines() if b"cmd=client|list" not in line]
        # The connections blocks moved on: a load ends with its padding ECHO.
        assert any(b"cmd=echo" in line for line in ours)
        assert any(b"cmd=set" in line for line in ours)
        assert ours and all(b"name=kv-tier-named " in line for line in ours)
    assert [slot(pool, i) for i in range(4, 8)] == [slot(pool, i) for i in range(4)]


def _keepalive_to(port: int) -> list[bool]:
    """Whether each of this process's TCP connections to ``port`` has SO_KEEPALIVE."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                continue
            sock = socket.socket(fileno=os.dup(int(fd)))
        except OSError:
            continue
        with sock:
            if sock.family != socket.AF_INET or sock.type != socket.SOCK_STREAM:
                continue
            try:
                peer = sock.getpeername()
            except OSError:
                continue
            if peer[1] == port:
                found.append(bool(sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE)))
    return found


@pytest.mark.parametrize(("query", "keepalive"), [("", True), ("?socket_keepalive=false", False)])
async def test_tcp_keepalive_is_on_every_connection_unless_the_url_turns_it_off(
    pool: memoryview, redis_server: Any, query: str, keepalive: bool
) -> None:
    async with opened(pool, redis_server, url=redis_server.url + query) as tier:
        assert (await store_job(tier, keys(4), [0, 1, 2, 3])).success
        assert (await load_job(tier, keys(4), [4, 5, 6, 7])).success
        flags = _keepalive_to(redis_server.port)
        assert len(flags) >= 3  # redis-py's, and a stream's for loads and for stores
        assert all(flag is keepalive for flag in flags)


async def test_ssl_check_hostname_false_accepts_a_certificate_for_another_name(
    pool: memoryview, tmp_path: Path
) -> None:
    """The server's certificate is for 127.0.0.1; the url names it localhost."""
    cert, key, ca = self_signed_tls(tmp_path)
    server = local_redis_server(tmp_path, tls=(cert, key, ca))
    try:
        assert server.tls_url is not None
        url = server.tls_url.replace("127.0.0.1", "localhost")
        with pytest.raises(InvalidArgumentError, match=r"tls_ca_file: .*did not verify"):
            await tier_of(pool, url, tls_ca_file=str(ca)).start()
        unchecked = url + "?ssl_check_hostname=false"
        async with opened(pool, server, url=unchecked, tls_ca_file=str(ca)) as tier:
            assert (await store_job(tier, keys(2), [0, 1])).success
            assert (await load_job(tier, keys(2), [2, 3])).success
        assert [slot(pool, 2), slot(pool, 3)] == [slot(pool, 0), slot(pool, 1)]
    finally:
        server.stop()


@pytest.mark.parametrize(
    ("userinfo", "query"),
    [("kv-engine:user-pw-41d2@", ""), ("", "?username=kv-engine&password=user-pw-41d2")],
    ids=["userinfo", "query"],
)
async def test_an_acl_user_s_credentials_authenticate_every_connection(
    pool: memoryview, tmp_path: Path, userinfo: str, query: str
) -> None:
    server = local_redis_server(tmp_path)
    try:
        server.command("ACL", "SETUSER", "kv-engine", "on", ">user-pw-41d2", "~kvt:*", "+@all")
        server.command("ACL", "SETUSER", "default", "off")  # only the named user gets in
        url = server.url.replace("redis://", "redis://" + userinfo) + query
        async with opened(pool, server, url=url) as tier:
            assert (await store_job(tier, keys(2), [0, 1])).success
            assert (await load_job(tier, keys(2), [2, 3])).success
        assert [slot(pool, 2), slot(pool, 3)] == [slot(pool, 0), slot(pool, 1)]
    finally:
        server.stop()


async def test_a_tls_certificate_that_does_not_load_fails_the_start_naming_it(
    pool: memoryview,
) -> None:
    tier = tier_of(pool, "rediss://127.0.0.1:1/0", tls_cert_file="/etc/hostname")
    with pytest.raises(InvalidArgumentError, match="tls_cert_file"):
        await tier.start()
    assert tier.state.name == "CLOSED"
