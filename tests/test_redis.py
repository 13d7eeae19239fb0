"""The Redis tier against a real redis-server (``backends.redis.tier``)."""

from __future__ import annotations

import asyncio
import os
import struct
import threading

import pytest
import torch
import xxhash

from tests._nvme_helpers import load_job, random_pool, store_job
from tests._redis_helpers import (
    BLOCK,
    client_of,
    dripping_replies,
    give_slot_of,
    holding_replies,
    keys,
    local_redis_cluster,
    local_redis_server,
    move_slot_of,
    name_of,
    opened,
    owner_of,
    put_record,
    record_of,
    self_signed_tls,
    settled,
    slot,
)
from tests._redis_servers import LocalRedisCluster
from tests._redis_servers import LocalRedisServer as RedisServer
from tests._scripts import last_json, run_script
from tiering import TieringEngine
from tiering.cli import main
from tiering.config import load_config
from tiering.errors import ConfigError, InvalidArgumentError
from tiering.tiers.block_record import namespace_digest
from tiering.tiers.registry import make_tier, tier_factory

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
        header, _ = record_of(redis_server, name)
        put_record(redis_server, name, header, os.urandom(BLOCK))  # same length, other bytes
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


async def test_while_the_breaker_is_open_a_lookup_answers_false_even_for_a_cached_key(
    pool: memoryview, redis_server: RedisServer
) -> None:
    names = keys(2)
    options = {"timeout_s": 0.5, "breaker_failures": 1}
    async with opened(pool, redis_server, **options) as tier:
        assert (await store_job(tier, names[:1], [0])).success
        assert tier.lookup(names[0]) is True  # from the cache, fresh for presence_ttl_s
        redis_server.kill()
        assert not (await store_job(tier, names[1:], [1])).success
        assert str(tier.breaker.state) == "open"
        assert tier.lookup(names[0]) is False
        assert tier.lookup_all(names) == [False, False]


@pytest.mark.parametrize("call", ["load", "store"])
async def test_a_server_that_drips_its_replies_fails_a_call_within_about_timeout_s(
    pool: memoryview, redis_server: RedisServer, call: str
) -> None:
    """A reply that comes a byte every 20 ms (every receive gets bytes well within
    ``timeout_s``) fails the job once the call's one deadline has passed: the breaker
    counts it, and the tier serves again once the replies flow."""
    names = keys(480)  # a store: 60 replies of 5 bytes on each of its 8 connections
    slots = [i % SLOTS for i in range(len(names))]
    bound_s = 3.0  # timeout_s 0.5, and generous for a busy machine
    options = {"timeout_s": 0.5, "breaker_failures": 1, "breaker_backoff_s": 0.05}
    async with (
        dripping_replies(redis_server, every_s=0.02) as proxy,
        opened(pool, redis_server, url=proxy.url, **options) as tier,
    ):
        assert (await store_job(tier, names[:4], slots[:4])).success
        with proxy.drip():
            async with asyncio.timeout(bound_s):
                if call == "load":
                    failed = await load_job(tier, names[:4], [28, 29, 30, 31])
                else:
                    failed = await store_job(tier, names, slots)
        assert not failed.success and "redis unreachable" in str(failed.error)
        assert "timeout_s" in str(failed.error)
        assert str(tier.breaker.state) == "open"
        assert tier.statistics().counters["unreachable_calls"] == 1
        await asyncio.sleep(0.1)  # past the back-off: the next call is the probe
        assert (await load_job(tier, names[:4], [28, 29, 30, 31])).success
        assert [slot(pool, 28 + i) for i in range(4)] == [slot(pool, i) for i in range(4)]
        assert str(tier.breaker.state) == "closed"


async def test_a_full_server_s_refusal_fails_the_job_without_quoting_its_bytes(
    pool: memoryview, redis_server: RedisServer
) -> None:
    redis_server.command("CONFIG", "SET", "maxmemory", "1")  # full; the policy: noeviction
    async with opened(pool, redis_server) as tier:
        refused = await store_job(tier, keys(2), [0, 1])
        assert not refused.success and "maxmemory" in str(refused.error)
        assert "SET" not in str(refused.error)  # redis-py quotes the command: block bytes
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
        "--job-blocks", "2", "--repeat", "3", "--lmcache", "off",
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


def test_bench_redis_runs_lmcache_s_resp_adapter_beside_the_tier(
    redis_server: RedisServer,
) -> None:
    pytest.importorskip("lmcache", reason="the LMCache side is optional")
    done = run_script(
        "examples/bench_redis.py", redis_server.url, "--size-mib", "2", "--block-sizes", "64K",
        "--job-blocks", "2", "--repeat", "3", "--no-encryption", "--lmcache", "on",
    )  # fmt: skip
    (run,) = last_json(done)["runs"]
    for figure in ("lmcache_store_GBps", "lmcache_load_GBps", "lmcache_warm_load_GBps"):
        assert run[figure] > 0
    for what in ("store", "load", "warm_load"):
        assert run[f"{what}_vs_lmcache"] > 0
    assert redis_server.command("DBSIZE") == 0


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


@pytest.mark.parametrize("where", ["server", "cluster"])
async def test_a_value_of_another_type_fails_only_its_key_and_is_deleted(
    pool: memoryview, request: pytest.FixtureRequest, where: str
) -> None:
    server = request.getfixturevalue("redis_server" if where == "server" else "empty_cluster")
    names = keys(4)
    expected = [slot(pool, i) for i in range(4)]
    async with opened(pool, server, cluster=where == "cluster") as tier:
        assert (await store_job(tier, names, range(4))).success
        with client_of(server) as other:  # another client puts a list in a block's place
            other.delete(name_of(names[2]))
            other.rpush(name_of(names[2]), b"garbage")
            result = await load_job(tier, names, range(10, 14))
            assert result.failed_keys == (names[2],) and "WRONGTYPE" in str(result.error)
            assert [slot(pool, i) for i in (10, 11, 13)] == [expected[i] for i in (0, 1, 3)]
            assert tier.statistics().counters["corrupt_blocks"] == 1
            assert other.exists(name_of(names[2])) == 0  # deleted, never served
        assert tier.lookup(names[2]) is False


async def test_a_store_over_a_value_of_another_type_replaces_it(
    pool: memoryview, redis_server: RedisServer
) -> None:
    names = keys(3)
    redis_server.command("RPUSH", name_of(names[1]), "garbage")  # a list, not a string
    async with opened(pool, redis_server) as tier:
        assert (await store_job(tier, names, range(3))).success
        assert tier.statistics().counters["stored_blocks"] == 3
        assert (await load_job(tier, names, range(10, 13))).success
    assert [slot(pool, i) for i in range(10, 13)] == [slot(pool, i) for i in range(3)]


async def test_after_a_refused_load_a_store_through_the_engine_sends_the_block_again(
    redis_server: RedisServer,
) -> None:
    kv = torch.randn(16, 4, 64).half()  # 16 device blocks of 512 bytes
    tiers = [{"type": "redis", "url": redis_server.url}]
    async with TieringEngine(kv, 4, secondary_tiers=tiers, cache_identity="heal") as engine:
        tier = engine.tiers[0]
        first, second = [b"a%d" % i for i in range(4)], [b"b%d" % i for i in range(4)]
        for hashes, blocks in ((first, [0, 1, 2, 3]), (second, [4, 5, 6, 7])):
            job = engine.store(hashes, blocks)
            assert (await job).success and await job.cascaded  # first: only in redis now
        name = name_of(first[1], engine.namespace)
        redis_server.command("DEL", name)
        redis_server.command("RPUSH", name, "garbage")  # no block: WRONGTYPE
        loaded = await engine.load(first, [8, 9, 10, 11])
        assert loaded.failed_keys == (first[1],)
        stored = tier.statistics().counters["stored_blocks"]
        job = engine.store(first[1:2], [1])
        assert (await job).success and await job.cascaded
        assert tier.statistics().counters["stored_blocks"] == stored + 1  # sent, not skipped
        assert redis_server.command("TYPE", name) == b"string"
    async with TieringEngine(kv, 4, secondary_tiers=tiers, cache_identity="heal") as other:
        assert await settled(lambda: other.lookup(first) or None) == 4
        assert (await other.load(first, [12, 13, 14, 15])).success
    assert torch.equal(kv[0:4], kv[12:16])


async def test_after_a_failed_load_call_a_store_through_the_engine_sends_the_blocks_again(
    redis_server: RedisServer,
) -> None:
    kv = torch.randn(16, 4, 64).half()
    tiers = [{"type": "redis", "url": redis_server.url, "timeout_s": 0.5, "breaker_failures": 1,
              "breaker_backoff_s": 0.05}]  # fmt: skip
    async with TieringEngine(kv, 4, secondary_tiers=tiers, cache_identity="lost") as engine:
        tier = engine.tiers[0]
        first, second = [b"a%d" % i for i in range(4)], [b"b%d" % i for i in range(4)]
        for hashes, blocks in ((first, [0, 1, 2, 3]), (second, [4, 5, 6, 7])):
            job = engine.store(hashes, blocks)
            assert (await job).success and await job.cascaded
        redis_server.kill()
        assert not (await engine.load(first, [8, 9, 10, 11])).success
        redis_server.start()  # back, and empty: it held the blocks in memory only
        await asyncio.sleep(0.1)  # past the back-off
        stored = tier.statistics().counters["stored_blocks"]
        job = engine.store(first, [0, 1, 2, 3])
        assert (await job).success and await job.cascaded
        assert tier.statistics().counters["stored_blocks"] == stored + 4
        assert redis_server.command("DBSIZE") == 4


async def test_a_presence_check_that_read_the_server_before_a_store_does_not_undo_it(
    pool: memoryview, redis_server: RedisServer
) -> None:
    """A check's "absent", read before a store landed but back after it, is dropped: the
    tier knows the block is there (an engine would otherwise not load it)."""
    [key] = keys(1)
    async with (
        holding_replies(redis_server, b"EXISTS") as proxy,
        opened(pool, redis_server, url=proxy.url) as tier,
    ):
        assert tier.lookup(key) is None  # unknown: a check goes out
        await proxy.seen.wait()  # the server has answered "absent"; the answer is held
        assert (await store_job(tier, [key], [0])).success
        assert tier.lookup(key) is True
        proxy.released.set()
        await settled(lambda: tier.statistics().counters["lookup_round_trips"] or None)
        assert tier.lookup(key) is True


async def test_a_value_copied_to_another_tenant_s_key_is_a_miss(
    pool: memoryview, redis_server: RedisServer
) -> None:
    [key] = keys(1)
    async with (
        opened(pool, redis_server, tenant="A") as a,
        opened(pool, redis_server, tenant="B") as b,
    ):
        assert (await store_job(a, [key], [0])).success
        value = redis_server.command("GET", name_of(key, tenant="A"))
        assert isinstance(value, bytes)
        redis_server.command("SET", name_of(key, tenant="B"), value)
        pool[10 * BLOCK : 11 * BLOCK] = bytes(BLOCK)
        result = await load_job(b, [key], [10])
        assert result.failed_keys == (key,) and "another tenant" in str(result.error)
        assert slot(pool, 10) == bytes(BLOCK)  # never served
        assert redis_server.command("EXISTS", name_of(key, tenant="B")) == 0
        assert (await load_job(a, [key], [11])).success  # A's own value is untouched
    assert slot(pool, 11) == slot(pool, 0)


@pytest.mark.parametrize("version", [1, 3, 5])
async def test_a_block_in_an_older_format_is_a_miss(
    pool: memoryview, redis_server: RedisServer, version: int
) -> None:
    """A block of the tier's older formats, each a hash of a header and a payload
    (version 1, its header without the tenant; version 3, the last before the shared
    block record; version 5, the shared record as a hash) is read as corrupt: deleted,
    never served, even though it is sound in its own format."""
    [key] = keys(1)
    payload = slot(pool, 0)
    if version == 5:
        async with opened(pool, redis_server) as tier:
            assert (await store_job(tier, [key], [0])).success
        header, _ = record_of(redis_server, name_of(key))
        redis_server.command("DEL", name_of(key))
    else:
        old_layout = struct.Struct("<8sHxxQ16s16sH" + ("H" if version == 3 else ""))
        lengths = (0, len(key)) if version == 3 else (len(key),)
        checksum = xxhash.xxh3_128_digest(payload)
        ns = namespace_digest("model-a")
        body = old_layout.pack(b"KVTRDS\r\n", version, BLOCK, checksum, ns, *lengths) + key
        header = body + xxhash.xxh3_64_intdigest(body).to_bytes(8, "little")
    redis_server.command("HSET", name_of(key), "h", header, "p", payload)
    async with opened(pool, redis_server) as tier:
        result = await load_job(tier, [key], [10])
        assert result.failed_keys == (key,)
        assert "holds no block" in str(result.error)
        assert redis_server.command("EXISTS", name_of(key)) == 0


BAD_URLS = [
    "redis://127.0.0.1:notaport/0",
    "redis://127.0.0.1:99999/0",
    "redis://127.0.0.1:6390/0?socket_timeout=abc",
    "redis://127.0.0.1:6390/0?health_check_interval=abc",
    "redis://127.0.0.1:6390/0?no_such_option=1",
    "redis://127.0.0.1:6390/0?protocol=4",
    "redis://127.0.0.1:6390/not-a-db",
    "redis://user:Zq9Secret/pw@127.0.0.1:6390/0",
    "redis://user:Zq9Secret#pw@127.0.0.1:6390/0",
    "redis://user:Zq9Secret?pw@127.0.0.1:6390/0",
    "redis://user:12345/Zq9Secret@127.0.0.1:6390/0",  # parses, as host "user", port 12345
    "redis://user:12345?Zq9Secret@127.0.0.1:6390/0",
]


@pytest.mark.parametrize("url", BAD_URLS)
def test_a_malformed_url_is_a_clear_error_that_never_shows_it(
    pool: memoryview, url: str, caplog: pytest.LogCaptureFixture
) -> None:
    spec = {"type": "redis", "url": url, "namespace": "x"}
    with pytest.raises(InvalidArgumentError, match="url: ") as raised:
        make_tier(spec, pool, BLOCK)
    chain: list[BaseException] = []  # no parser's error chained: it may quote the url
    error: BaseException | None = raised.value
    while error is not None:
        chain.append(error)
        error = error.__cause__ or error.__context__
    assert all(isinstance(error, InvalidArgumentError) for error in chain)
    shown = "".join(str(error) + repr(error) for error in chain) + caplog.text
    assert "Zq9Secret" not in shown and "12345" not in shown and "6390" not in shown


@pytest.mark.parametrize("url", BAD_URLS[:3] + BAD_URLS[-4:])
def test_a_config_with_a_malformed_url_is_refused_when_loaded_without_showing_it(
    tmp_path, url: str
) -> None:
    """The url is checked by the tier's options, so loading the config catches it."""
    path = tmp_path / "kv-tiering.toml"
    path.write_text(f"[engine]\ncpu_blocks = 8\n\n[[tiers]]\ntype = 'redis'\nurl = '{url}'\n")
    with pytest.raises(ConfigError, match=r"tiers\[0\]\.url: ") as raised:
        load_config(path)
    shown = str(raised.value) + repr(raised.value)
    assert "Zq9Secret" not in shown and "12345" not in shown and "6390" not in shown


def test_the_options_take_an_instance_and_keywords_win(pool: memoryview) -> None:
    RedisTier = tier_factory("redis")
    options = RedisTier.Options.check({"url": "redis://127.0.0.1:1/0", "namespace": "a"})
    tier = RedisTier(pool, BLOCK, options, tenant="t", timeout_s=2)
    assert tier.options.namespace == "a" and tier.options.tenant == "t"
    assert tier.options.timeout_s == 2.0 and options.timeout_s == 5.0
    with pytest.raises(InvalidArgumentError, match=r"breaker_max_backoff_s = 0\.5 is below"):
        RedisTier(pool, BLOCK, options, breaker_max_backoff_s=0.5)


async def test_a_malformed_url_fails_the_engine_s_start_without_showing_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    kv = torch.randn(16, 4, 64).half()
    tiers = [{"type": "redis", "url": "redis://user:Zq9Secret/pw@127.0.0.1:6390/0"}]
    with pytest.raises(InvalidArgumentError, match="url: ") as raised:
        async with TieringEngine(kv, 4, secondary_tiers=tiers):
            pass
    assert "Zq9Secret" not in str(raised.value) + repr(raised.value) + caplog.text


def test_replay_with_a_malformed_redis_url_exits_2_with_one_line_not_showing_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    url = "redis://user:Zq9Secret/pw@127.0.0.1:6390/0"
    assert main(["replay", "--limit", "5", "--redis", url]) == 2
    out, err = capsys.readouterr()
    assert len(err.strip().splitlines()) == 1 and "url: " in err
    assert "Zq9Secret" not in out + err


async def test_a_paused_cluster_node_fails_each_call_within_timeout_s_then_the_breaker_opens(
    pool: memoryview, tmp_path
) -> None:
    """A node that stops answering (SIGSTOP: its connections stay open) costs a call
    about ``timeout_s``, not the client's retries (12-23 s each at 0.5 s before)."""
    cluster = local_redis_cluster(tmp_path)  # its own: a pause must not reach other tests
    names = keys(24)
    expected = [slot(pool, i) for i in range(24)]
    timeout_s, bound_s = 0.5, 5.0  # the bound: generous for a busy machine
    options = {"cluster": True, "timeout_s": timeout_s, "breaker_failures": 2,
               "breaker_backoff_s": 0.2}  # fmt: skip
    try:
        async with opened(pool, cluster, **options) as tier:
            assert (await store_job(tier, names, range(24))).success
            paused = cluster.nodes[1]
            on_paused = [k for k in names if owner_of(cluster, name_of(k)) is paused]
            elsewhere = [k for k in names if k not in on_paused]
            assert on_paused and elsewhere
            job = [on_paused[0], elsewhere[0], on_paused[-1]]
            clock = asyncio.get_running_loop().time
            # The store sends each key's own bytes: one the paused node has in its socket
            # buffer when the call times out lands once it resumes, as with any client.
            own = [names.index(k) for k in job]
            paused.pause()
            try:
                for call in (load_job(tier, job, [24, 25, 26]), store_job(tier, job, own)):
                    started = clock()
                    failed = await call
                    assert clock() - started < bound_s
                    assert set(failed.failed_keys) == set(job)
                    assert "redis unreachable" in str(failed.error)
                assert str(tier.breaker.state) == "open"
                refused = await load_job(tier, elsewhere[:1], [27])  # fails with no call
                assert "circuit open" in str(refused.error)
            finally:
                paused.resume()
            await asyncio.sleep(0.3)  # past the back-off: the next call is the probe
            assert (await load_job(tier, on_paused[:4], range(28, 28 + len(on_paused[:4])))).success
            assert str(tier.breaker.state) == "closed"
            held = [names.index(k) for k in on_paused[:4]]
            assert [slot(pool, 28 + i) for i in range(len(held))] == [expected[i] for i in held]
    finally:
        cluster.stop()


async def test_a_cluster_node_that_drips_its_replies_fails_a_load_within_about_timeout_s(
    pool: memoryview, tmp_path
) -> None:
    """A node whose replies come a byte every 20 ms (it announces a proxy's port as its
    own, so every client reaches it through the proxy) fails a load of keys on it and
    elsewhere once the call's one deadline has passed; the tier serves again once the
    replies flow."""
    cluster = local_redis_cluster(tmp_path)  # its own: one node is announced elsewhere
    names = keys(24)
    bound_s = 3.0  # timeout_s 0.5, and generous for a busy machine
    options = {"cluster": True, "timeout_s": 0.5, "breaker_failures": 1,
               "breaker_backoff_s": 0.05}  # fmt: skip
    try:
        slow = cluster.nodes[1]
        async with dripping_replies(slow, every_s=0.02) as proxy:
            slow.command("CONFIG", "SET", "cluster-announce-port", str(proxy.port))
            for _ in range(200):  # gossip tells the first node (the url's) within seconds
                ranges = cluster.nodes[0].command("CLUSTER", "SLOTS")
                assert isinstance(ranges, list)
                slow_slots = [(first, last) for first, last, (_, port, *_), *_ in ranges
                              if port == proxy.port]  # fmt: skip
                if slow_slots:
                    break
                await asyncio.sleep(0.05)
            else:
                raise AssertionError("the node's new port never showed")
            async with opened(pool, cluster, **options) as tier:
                assert (await store_job(tier, names, range(24))).success
                on_slow = [
                    k for k in names
                    if any(first <= _slot_of(cluster, k) <= last for first, last in slow_slots)
                ]  # fmt: skip
                elsewhere = [k for k in names if k not in on_slow]
                job = [on_slow[0], elsewhere[0], on_slow[-1]]
                with proxy.drip():
                    async with asyncio.timeout(bound_s):
                        failed = await load_job(tier, job, [24, 25, 26])
                assert set(failed.failed_keys) == set(job)
                assert "redis unreachable" in str(failed.error)
                assert "timeout_s" in str(failed.error)
                assert str(tier.breaker.state) == "open"
                await asyncio.sleep(0.1)  # past the back-off: the next call is the probe
                assert (await load_job(tier, job, [24, 25, 26])).success
                held = [names.index(k) for k in job]
                assert [slot(pool, 24 + i) for i in range(3)] == [slot(pool, i) for i in held]
                assert str(tier.breaker.state) == "closed"
    finally:
        cluster.stop()


def _slot_of(cluster: LocalRedisCluster, key: bytes) -> int:
    """The hash slot of the Redis key a block ``key`` is stored under."""
    slot = cluster.nodes[0].command("CLUSTER", "KEYSLOT", name_of(key))
    assert isinstance(slot, int)
    return slot


@pytest.mark.parametrize("stage", ["moved", "ask"])
async def test_a_cluster_tier_follows_a_slot_migrating_to_another_node(
    pool: memoryview, empty_cluster: LocalRedisCluster, stage: str
) -> None:
    """Halfway through a migration the old node answers ASK, after it MOVED: the tier
    (whose map of the slots is from before) loads and stores through either."""
    names = keys(6)
    expected = [slot(pool, i) for i in range(6)]
    async with opened(pool, empty_cluster, cluster=True) as tier:
        assert (await store_job(tier, names, range(6))).success  # the map is made
        moved = name_of(names[0])
        source = owner_of(empty_cluster, moved)
        target = next(node for node in empty_cluster.nodes if node is not source)
        try:
            move_slot_of(empty_cluster, moved, target, finish=stage == "moved")
            assert (await load_job(tier, names, range(10, 16))).success
            assert [slot(pool, i) for i in range(10, 16)] == expected
            assert (await store_job(tier, names[:1], [0])).success
            hash_slot = target.command("CLUSTER", "KEYSLOT", moved)
            on_target = target.command("CLUSTER", "GETKEYSINSLOT", str(hash_slot), "10")
            assert isinstance(on_target, list) and moved in on_target  # where the slot went
        finally:
            give_slot_of(empty_cluster, moved, target)  # the migration ends, in any case
