"""The Redis tier against a real redis-server (``backends.redis``)."""

from __future__ import annotations

import asyncio
import os
import threading

import pytest
import torch

from backends.redis_server import LocalRedisCluster
from backends.redis_server import LocalRedisServer as RedisServer
from tests._nvme_helpers import load_job, random_pool, store_job
from tests._redis_helpers import (
    BLOCK,
    keys,
    local_redis_cluster,
    local_redis_server,
    opened,
    self_signed_tls,
    settled,
    slot,
)
from tests._scripts import last_json, run_script
from tiering import TieringEngine
from tiering.errors import InvalidArgumentError
from tiering.registry import make_tier

if os.environ.get("KV_TIERING_REQUIRE_REDIS") != "1":  # CI: a missing redis-py fails
    pytest.importorskip("redis", reason="pip install 'kv-tiering[redis]'")

SLOTS = 32


@pytest.fixture
def pool():
    with random_pool(BLOCK, SLOTS) as view:
        yield view


@pytest.fixture(scope="module")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory):
    """A three-node local Redis Cluster for this module's tests, emptied after each."""
    cluster = local_redis_cluster(tmp_path_factory.mktemp("cluster"))
    yield cluster
    cluster.stop()


@pytest.fixture
def empty_cluster(redis_cluster: LocalRedisCluster):
    yield redis_cluster
    for node in redis_cluster.nodes:
        node.command("FLUSHALL")


async def test_store_then_load_is_byte_exact(pool: memoryview, redis_server: RedisServer) -> None:
    names = keys(4)
    expected = [slot(pool, i) for i in range(4)]
    async with opened(pool, redis_server) as tier:
        assert (await store_job(tier, names, range(4))).success
        assert (await load_job(tier, names, range(10, 14))).success
    assert [slot(pool, i) for i in range(10, 14)] == expected


async def test_a_lookup_never_waits_and_settles_after_one_batched_check(
    pool: memoryview, redis_server: RedisServer
) -> None:
    names = keys(1000)
    async with opened(pool, redis_server) as writer:
        assert (await store_job(writer, names[:2], [0, 1])).success
    redis_server.command("CONFIG", "RESETSTAT")
    async with opened(pool, redis_server) as reader:  # a fresh cache: it knows nothing
        assert all(reader.lookup(k) is None for k in names)  # queued, no waiting
        answers = [await settled(lambda k=k: reader.lookup(k)) for k in names]
        assert answers == [True, True] + [False] * 998
        assert reader.statistics().counters["lookup_round_trips"] == 1
    assert redis_server.command("INFO", "commandstats")["cmdstat_exists"]["calls"] == 1000


async def test_statistics_report_the_server_s_memory_and_keys(
    pool: memoryview, redis_server: RedisServer
) -> None:
    redis_server.command("CONFIG", "SET", "maxmemory", str(256 << 20))
    async with opened(pool, redis_server, usage_every_s=0.01) as tier:
        assert (await store_job(tier, keys(4), range(4))).success
        await settled(lambda: tier.statistics().counters["server_keys"] == 4 or None)
        stats = tier.statistics()
        assert stats.capacity_bytes == 256 << 20
        assert stats.used_bytes > 4 * BLOCK  # the server's own figure, blocks included


async def test_it_counts_the_blocks_it_knows_are_there_within_its_cache_bound(
    pool: memoryview, redis_server: RedisServer
) -> None:
    names = keys(4)
    async with opened(pool, redis_server, presence_entries=3) as tier:
        assert (await store_job(tier, names[:2], [0, 1])).success
        assert tier.get_num_blocks() == 2
        assert not (await load_job(tier, [b"missing".ljust(32, b".")], [9])).success
        assert tier.get_num_blocks() == 2  # an absent answer is not a block
        assert (await store_job(tier, names[2:], [2, 3])).success
        assert tier.get_num_blocks() == 2  # 3 answers kept: the oldest two went
        assert tier.statistics().used_blocks == 2


async def test_a_lookup_from_another_thread_is_checked_on_the_loop(
    pool: memoryview, redis_server: RedisServer
) -> None:
    names = keys(1)
    async with opened(pool, redis_server) as writer:
        assert (await store_job(writer, names, [0])).success
    async with opened(pool, redis_server) as reader:
        answers: list[object] = []
        caller = threading.Thread(target=lambda: answers.append(reader.lookup(names[0])))
        caller.start()
        caller.join()
        assert answers == [None]  # it never waits, whatever thread asks
        await settled(lambda: reader.statistics().counters["lookup_round_trips"] or None)
        assert reader.lookup(names[0]) is True


async def test_another_engine_on_the_server_sees_the_blocks(
    pool: memoryview, redis_server: RedisServer
) -> None:
    names = keys(3)
    expected = [slot(pool, i) for i in range(3)]
    async with opened(pool, redis_server) as first, opened(pool, redis_server) as second:
        assert (await store_job(first, names, range(3))).success
        assert [await settled(lambda k=k: second.lookup(k)) for k in names] == [True] * 3
        assert (await load_job(second, names, range(20, 23))).success
    assert [slot(pool, i) for i in range(20, 23)] == expected


@pytest.mark.parametrize("other", [{"namespace": "model-b"}, {"tenant": "team-2"}])
async def test_namespaces_and_tenants_never_see_each_others_blocks(
    pool: memoryview, redis_server: RedisServer, other: dict
) -> None:
    names = keys(2)
    async with opened(pool, redis_server) as mine, opened(pool, redis_server, **other) as theirs:
        assert (await store_job(mine, names, [0, 1])).success
        assert [await settled(lambda k=k: theirs.lookup(k)) for k in names] == [False, False]
        result = await load_job(theirs, names, [5, 6])
        assert not result.success and set(result.failed_keys) == set(names)


async def test_a_corrupted_value_is_a_failed_key_never_served(
    pool: memoryview, redis_server: RedisServer
) -> None:
    names = keys(2)
    async with opened(pool, redis_server) as tier:
        assert (await store_job(tier, names, [0, 1])).success
        [name] = [n for n in redis_server.command("KEYS", "*") if n.endswith(names[1])]
        redis_server.command("HSET", name, "p", os.urandom(BLOCK))  # same length, other bytes
        pool[8 * BLOCK : 9 * BLOCK] = bytes(BLOCK)
        result = await load_job(tier, names, [7, 8])
        assert result.failed_keys == (names[1],) and "checksum" in str(result.error)
        assert slot(pool, 7) == slot(pool, 0)
        assert tier.statistics().counters["corrupt_blocks"] == 1
        assert redis_server.command("EXISTS", name) == 0  # deleted, not served again
        assert tier.lookup(names[1]) is False


async def test_an_engine_lookup_checks_a_whole_request_in_one_round_trip(
    redis_server: RedisServer,
) -> None:
    kv = torch.randn(16, 4, 64).half()
    tiers = [{"type": "redis", "url": redis_server.url}]
    hashes = [b"h%d" % i for i in range(12)]
    async with TieringEngine(kv, 4, secondary_tiers=tiers, cache_identity="ask") as writer:
        for start in range(0, 12, 4):
            job = writer.store(hashes[start : start + 4], range(4))
            assert (await job).success and await job.cascaded
    async with TieringEngine(kv, 4, secondary_tiers=tiers, cache_identity="ask") as reader:
        assert reader.lookup(hashes) == 0  # it knows nothing yet: ask again
        found = await settled(lambda: reader.lookup(hashes) or None)
        assert found == 12
        assert reader.tiers[0].statistics().counters["lookup_round_trips"] == 1


async def test_a_dead_server_opens_the_breaker_and_a_restart_closes_it(
    pool: memoryview, redis_server: RedisServer
) -> None:
    names = keys(2)
    options = {"timeout_s": 0.5, "breaker_failures": 1, "breaker_backoff_s": 0.05}
    async with opened(pool, redis_server, **options) as tier:
        assert (await store_job(tier, names[:1], [0])).success
        redis_server.kill()
        failed = await store_job(tier, names[1:], [1])
        assert not failed.success and "unreachable" in str(failed.error)
        assert str(tier.breaker.state) == "open"
        refused = await load_job(tier, names[:1], [2])  # fails at once: no call is made
        assert not refused.success
        assert tier.lookup(names[1]) is False
        redis_server.start()  # same port: the server is back (empty, no persistence)
        await asyncio.sleep(0.1)  # past the back-off: the next call is the probe
        assert (await store_job(tier, names[1:], [1])).success
        assert str(tier.breaker.state) == "closed"


async def test_a_full_server_s_refusal_fails_the_job_without_quoting_its_bytes(
    pool: memoryview, redis_server: RedisServer
) -> None:
    redis_server.command("CONFIG", "SET", "maxmemory", "1")  # full; the policy: noeviction
    async with opened(pool, redis_server) as tier:
        refused = await store_job(tier, keys(2), [0, 1])
        assert not refused.success and "maxmemory" in str(refused.error)
        assert "HSET" not in str(refused.error)  # the client quotes the command: block bytes
        assert str(tier.breaker.state) == "closed"  # a refusal is no outage
        redis_server.command("CONFIG", "SET", "maxmemory", "0")
        assert (await store_job(tier, keys(2), [0, 1])).success


async def test_a_large_job_goes_in_pipelines_of_at_most_pipeline_bytes(
    pool: memoryview, redis_server: RedisServer
) -> None:
    names = keys(5)
    expected = [slot(pool, i) for i in range(5)]
    async with opened(pool, redis_server, pipeline_bytes=2 * BLOCK + 1) as tier:
        assert (await store_job(tier, names, range(5))).success
        assert tier.statistics().counters["pipelines"] == 3  # 2 + 2 + 1 blocks
        assert (await load_job(tier, names, range(10, 15))).success
        assert tier.statistics().counters["pipelines"] == 6
    assert [slot(pool, i) for i in range(10, 15)] == expected


async def test_a_cluster_holds_blocks_on_every_node_and_serves_them_to_another_engine(
    pool: memoryview, empty_cluster: LocalRedisCluster
) -> None:
    names = keys(24)
    expected = [slot(pool, i) for i in range(24)]
    options = {"cluster": True, "usage_every_s": 0.01}
    async with opened(pool, empty_cluster, **options) as first:
        assert (await store_job(first, names, range(24))).success
        async with opened(pool, empty_cluster, **options) as second:
            assert [await settled(lambda k=k: second.lookup(k)) for k in names] == [True] * 24
            for start in (0, 8, 16):
                assert (await load_job(second, names[start : start + 8], range(24, 32))).success
                assert [slot(pool, i) for i in range(24, 32)] == expected[start : start + 8]
            await settled(lambda: second.statistics().counters["server_keys"] == 24 or None)
    held = [node.command("DBSIZE") for node in empty_cluster.nodes]
    assert all(isinstance(count, int) and count > 0 for count in held) and sum(held) == 24


async def test_the_cluster_option_must_match_the_server(
    pool: memoryview, redis_server: RedisServer, redis_cluster: LocalRedisCluster
) -> None:
    for server, cluster in ((redis_cluster, False), (redis_server, True)):
        spec = {"type": "redis", "url": server.url, "namespace": "x", "cluster": cluster}
        tier = make_tier(spec, pool, BLOCK)
        with pytest.raises(InvalidArgumentError, match=f"cluster={cluster}"):
            await tier.start()
        assert tier.state.name == "CLOSED"


async def test_blocks_evicted_from_cpu_come_back_from_redis_through_the_engine(
    redis_server: RedisServer,
) -> None:
    kv = torch.randn(16, 4, 64).half()  # 16 device blocks of 512 bytes
    tiers = [{"type": "redis", "url": redis_server.url}]
    async with TieringEngine(kv, 4, secondary_tiers=tiers, cache_identity="redis-test") as engine:
        first, second = [b"a%d" % i for i in range(4)], [b"b%d" % i for i in range(4)]
        for hashes, blocks in ((first, [0, 1, 2, 3]), (second, [4, 5, 6, 7])):
            job = engine.store(hashes, blocks)
            assert (await job).success and await job.cascaded  # write-through: in redis
        assert engine.lookup(first) == 4  # evicted from the CPU tier, held by redis
        assert (await engine.load(first, [8, 9, 10, 11])).success
    assert torch.equal(kv[0:4], kv[8:12])


async def test_with_redis_dead_the_engine_serves_from_cpu_and_nvme_and_recovers(
    redis_server: RedisServer, tmp_path
) -> None:
    kv = torch.randn(16, 4, 64).half()  # 16 device blocks of 512 bytes
    tiers = [
        {"type": "nvme", "root": str(tmp_path / "nvme"), "capacity_bytes": 1 << 20},
        {"type": "redis", "url": redis_server.url, "timeout_s": 0.5, "breaker_failures": 1,
         "breaker_backoff_s": 0.05},
    ]  # fmt: skip
    async with TieringEngine(kv, 4, secondary_tiers=tiers, cache_identity="dead") as engine:
        redis_tier = engine.tiers[1]
        first, second, third = ([b"%s%d" % (p, i) for i in range(4)] for p in (b"a", b"b", b"c"))
        job = engine.store(first, [0, 1, 2, 3])
        assert (await job).success and await job.cascaded
        redis_server.kill()
        job = engine.store(second, [4, 5, 6, 7])  # pushes the first out of the CPU tier
        assert (await job).success and not await job.cascaded  # NVMe has it, redis not
        assert str(redis_tier.breaker.state) == "open"
        assert engine.lookup(first) == 4  # from NVMe
        assert (await engine.load(first, [8, 9, 10, 11])).success
        assert torch.equal(kv[0:4], kv[8:12])
        redis_server.start()  # back, empty
        await asyncio.sleep(0.1)  # past the back-off
        job = engine.store(third, [12, 13, 14, 15])
        assert (await job).success and await job.cascaded
        assert str(redis_tier.breaker.state) == "closed"


async def test_blocks_expire_after_ttl_s(pool: memoryview, redis_server: RedisServer) -> None:
    async with opened(pool, redis_server, ttl_s=30) as tier:
        assert (await store_job(tier, keys(1), [0])).success
        [name] = redis_server.command("KEYS", "*")
        assert 0 < redis_server.command("TTL", name) <= 30


@pytest.mark.parametrize("credentials", ["", ":wrong-pw-7f3a@"])
async def test_refused_credentials_fail_the_start_without_showing_them(
    pool: memoryview, tmp_path, credentials: str, caplog: pytest.LogCaptureFixture
) -> None:
    server = local_redis_server(tmp_path, "--requirepass", "right-pw-9c1e")
    try:
        url = server.url.replace("redis://", f"redis://{credentials}")
        tier = make_tier({"type": "redis", "url": url, "namespace": "x"}, pool, BLOCK)
        with pytest.raises(InvalidArgumentError, match="refused its credentials") as raised:
            await tier.start()
        assert "pw-" not in str(raised.value) and "pw-" not in repr(tier)
        assert tier.state.name == "CLOSED"  # nothing left running
        right = server.url.replace("redis://", "redis://:right-pw-9c1e@")
        async with opened(pool, server, url=right) as authed:
            assert (await store_job(authed, keys(1), [0])).success
            assert (await load_job(authed, keys(1), [1])).success
            assert "pw-" not in repr(authed) + repr(authed.statistics())
        assert slot(pool, 1) == slot(pool, 0)
        assert "pw-" not in caplog.text
    finally:
        server.stop()


async def test_an_acl_user_with_a_password_round_trips(pool: memoryview, tmp_path) -> None:
    server = local_redis_server(tmp_path)
    try:
        server.command("ACL", "SETUSER", "kv-engine", "on", ">user-pw-41d2", "~kvt:*", "+@all")
        server.command("ACL", "SETUSER", "default", "off")  # only the named user gets in
        url = server.url.replace("redis://", "redis://kv-engine:user-pw-41d2@")
        async with opened(pool, server, url=url) as tier:
            assert (await store_job(tier, keys(2), [0, 1])).success
            assert (await load_job(tier, keys(2), [2, 3])).success
        assert [slot(pool, 2), slot(pool, 3)] == [slot(pool, 0), slot(pool, 1)]
    finally:
        server.stop()


async def test_tls_with_the_server_s_ca_round_trips_and_without_it_is_a_clear_error(
    pool: memoryview, tmp_path
) -> None:
    cert, key, ca = self_signed_tls(tmp_path)
    server = local_redis_server(tmp_path, tls=(cert, key, ca))
    try:
        assert server.tls_url is not None
        spec = {"type": "redis", "url": server.tls_url, "namespace": "x"}
        untrusted = make_tier(spec, pool, BLOCK)
        with pytest.raises(InvalidArgumentError, match="tls_ca_file"):
            await untrusted.start()  # a self-signed CA the system does not trust
        async with opened(pool, server, url=server.tls_url, tls_ca_file=str(ca)) as tier:
            assert (await store_job(tier, keys(2), [0, 1])).success
            assert (await load_job(tier, keys(2), [2, 3])).success
        assert [slot(pool, 2), slot(pool, 3)] == [slot(pool, 0), slot(pool, 1)]
    finally:
        server.stop()


def test_bench_redis_runs_against_a_given_server_and_ends_with_json(
    redis_server: RedisServer,
) -> None:
    done = run_script(
        "examples/bench_redis.py", redis_server.url, "--size-mib", "2", "--block-sizes", "64K",
        "--job-blocks", "2", "--repeat", "3",
    )  # fmt: skip
    (run,) = last_json(done)["runs"]
    assert run["block_bytes"] == 64 << 10
    for figure in ("store_GBps", "load_GBps", "baseline_store_GBps", "baseline_load_GBps"):
        assert run[figure] > 0
    for figure in ("encrypted_store_GBps", "encrypted_load_GBps"):  # measured alongside
        assert run[figure] > 0
    for what in ("store", "load"):
        ratio = run[f"encrypted_{what}_ratio"]
        assert ratio > 0 and run[f"encryption_{what}_cost_pct"] == round(100 * (1 - ratio), 1)
    assert run["loop_lag_p99_ms"] >= 0
    assert redis_server.command("DBSIZE") == 0  # it cleans up after itself


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"url": "http://user:secret@host"}, "url"),
        ({"timeout_s": 0}, "timeout_s"),
        ({"tenant": "a:b"}, "tenant"),
        ({"breaker_failures": 0}, "breaker_failures"),
        ({"presence_entries": -1}, "presence_entries"),
        ({"pipeline_bytes": 0}, "pipeline_bytes"),
        ({"cluster": "yes"}, "cluster"),
        ({"url": "unix:///tmp/redis.sock", "cluster": True}, "cluster"),
        ({"tls_ca_file": "/etc/hostname"}, "tls_ca_file"),  # a file, but the url is not TLS
        ({"url": "rediss://127.0.0.1:1/0", "tls_cert_file": "/no/such.pem"}, "tls_cert_file"),
    ],
)
def test_a_bad_option_is_a_clear_error(pool: memoryview, options: dict, named: str) -> None:
    spec = {"type": "redis", "url": "redis://127.0.0.1:1/0", "namespace": "x", **options}
    with pytest.raises(InvalidArgumentError, match=named) as raised:
        make_tier(spec, pool, BLOCK)
    assert "secret" not in str(raised.value)  # a password in the url is never shown
