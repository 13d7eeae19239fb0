"""Encryption at rest in the Redis tier (``backends.redis.tier`` with ``encryption``), against a
real redis-server: sealed values, key rotation, and every way a value may fail to open
being a miss, never bytes (issue 14)."""

from __future__ import annotations

import asyncio
import base64
import logging
import os
import urllib.request
from typing import Any

import pytest
import torch

from tests._nvme_helpers import load_job, random_pool, store_job
from tests._redis_helpers import (
    BLOCK,
    keys,
    name_of,
    opened,
    put_record,
    record_of,
    settled,
    slot,
)
from tests._redis_servers import LocalRedisServer as RedisServer
from tiering import TieringEngine
from tiering.errors import InvalidArgumentError
from tiering.observe.events import encode_events
from tiering.observe.metrics import serve_engine_metrics
from tiering.security.encryption import Seal
from tiering.tiers.block_record import (
    compact_header,
    decode_header,
    namespace_digest,
    payload_checksum,
    record_binding,
)
from tiering.tiers.registry import make_tier

if os.environ.get("KV_TIERING_REQUIRE_REDIS") != "1":  # CI: a missing redis-py fails
    pytest.importorskip("redis", reason="pip install 'kv-tiering[redis]'")
pytest.importorskip("cryptography", reason="pip install 'kv-tiering[encryption]'")

SLOTS = 32
TAG = 16
NAMESPACE = "model-a"

OLD_KEY, NEW_KEY, OTHER_KEY = (os.urandom(32) for _ in range(3))


def b64(key: bytes) -> str:
    return base64.b64encode(key).decode()


def spec(*entries: tuple[int, bytes]) -> str:
    """A keyring spec, the first entry current."""
    return ",".join(f"{key_id}:{b64(key)}" for key_id, key in entries)


@pytest.fixture
def pool():
    with random_pool(BLOCK, SLOTS) as view:
        yield view


def raw(server: RedisServer, key: bytes, part: str) -> bytes:
    """The stored header (``part`` "h") or payload ("p") of ``key``'s block."""
    header, payload = record_of(server, name_of(key))
    return header if part == "h" else payload


def header_fields(header: bytes) -> tuple[bool, int, bytes]:
    """Whether a raw header is a sealed record's, and its key id and nonce."""
    seal = decode_header(header).seal
    return (True, seal.key_id, seal.nonce) if seal is not None else (False, 0, b"")


def forged(
    header: bytes, *, key: bytes = b"", tenant: bytes | None = None, namespace: str = "", tag=b""
) -> bytes:
    """A sealed record's ``header`` made again, its own checksum sound, with the given
    fields changed (the key id and nonce kept)."""
    record = decode_header(header)
    assert record.seal is not None
    return compact_header(
        key=key or record.key,
        tenant=record.tenant if tenant is None else tenant,
        payload_bytes=record.payload_bytes,
        ns_digest=namespace_digest(namespace) if namespace else record.namespace_digest,
        seal=Seal(record.seal.key_id, record.seal.nonce, tag or record.seal.tag),
    )


def encryption_errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "tiering.security.encryption" and r.levelno == logging.ERROR
    ]


async def test_sealed_blocks_round_trip_byte_exact_and_hold_no_plaintext(
    pool: memoryview, redis_server: RedisServer
) -> None:
    names = keys(5)
    pool[: 2 * BLOCK] = b"plaintext-marker" * (2 * BLOCK // 16)  # easy to spot if stored
    expected = [slot(pool, i) for i in range(5)]
    options = {"encryption": spec((1, OLD_KEY)), "pipeline_bytes": 2 * BLOCK + 1}
    async with opened(pool, redis_server, **options) as tier:
        assert (await store_job(tier, names, range(5))).success  # 3 pipelines: buffers reused
        assert (await load_job(tier, names, range(10, 15))).success
        assert tier.statistics().counters["pipelines"] == 6
    assert [slot(pool, i) for i in range(10, 15)] == expected
    for i, name in enumerate(names):
        stored, header = raw(redis_server, name, "p"), raw(redis_server, name, "h")
        assert len(stored) == BLOCK  # the ciphertext, as long as the payload (the tag: "h")
        assert b"plaintext-marker" not in stored
        assert expected[i][:64] not in stored and expected[i][BLOCK // 2 :][:64] not in stored
        binding = record_binding(namespace_digest(NAMESPACE), b"", name)
        assert payload_checksum(expected[i], binding) not in header  # no plaintext checksum
        assert header_fields(header)[:2] == (True, 1)
    nonces = {header_fields(raw(redis_server, name, "h"))[2] for name in names}
    assert len(nonces) == 5  # a fresh nonce for every block
    # The same plaintext (blocks 0 and 1) seals to different bytes.
    assert raw(redis_server, names[0], "p") != raw(redis_server, names[1], "p")


async def test_the_keyring_can_come_from_an_environment_variable(
    pool: memoryview, redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVT_TEST_KEYS", spec((7, NEW_KEY)))
    async with opened(pool, redis_server, encryption="env:KVT_TEST_KEYS") as tier:
        assert tier.keyring is not None and tier.keyring.key_ids == (7,)
        assert (await store_job(tier, keys(1), [0])).success
        assert (await load_job(tier, keys(1), [1])).success
    assert slot(pool, 1) == slot(pool, 0)
    assert header_fields(raw(redis_server, keys(1)[0], "h"))[1] == 7


async def test_a_wrong_key_under_the_same_id_is_a_miss_logged_once(
    pool: memoryview, redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, logger="tiering.security.encryption")
    names = keys(3)
    async with opened(pool, redis_server, encryption=spec((1, OLD_KEY))) as writer:
        assert (await store_job(writer, names, range(3))).success
    async with opened(pool, redis_server, encryption=spec((1, OTHER_KEY))) as reader:
        first = await load_job(reader, names[:2], [10, 11])
        second = await load_job(reader, names[2:], [12])
        assert set(first.failed_keys) == set(names[:2]) and second.failed_keys == (names[2],)
        assert "authentication" in str(first.error) and "key id 1" in str(first.error)
        assert reader.statistics().counters["corrupt_blocks"] == 3
        assert reader.statistics().counters["loaded_blocks"] == 0
        assert reader.lookup(names[0]) is False
    [logged] = encryption_errors(caplog)  # once for the key id, not once per block
    assert "key id 1" in logged
    assert all(redis_server.command("EXISTS", name_of(n)) == 0 for n in names)  # deleted


async def test_a_key_id_the_keyring_lacks_is_a_miss(
    pool: memoryview, redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, logger="tiering.security.encryption")
    names = keys(2)
    async with opened(pool, redis_server, encryption=spec((3, NEW_KEY))) as writer:
        assert (await store_job(writer, names, [0, 1])).success
    async with opened(pool, redis_server, encryption=spec((1, NEW_KEY))) as reader:
        result = await load_job(reader, names, [10, 11])
        assert not result.success and set(result.failed_keys) == set(names)
        assert "key id 3" in str(result.error) and "lacks" in str(result.error)
    [logged] = encryption_errors(caplog)
    assert "key id 3" in logged


async def test_a_rotated_keyring_reads_old_blocks_and_writes_new_ones_under_the_new_key(
    pool: memoryview, redis_server: RedisServer
) -> None:
    old, new = keys(2, "old"), keys(2, "new")
    async with opened(pool, redis_server, encryption=spec((1, OLD_KEY))) as before:
        assert (await store_job(before, old, [0, 1])).success
    rotated = spec((2, NEW_KEY), (1, OLD_KEY))
    async with opened(pool, redis_server, encryption=rotated) as after:
        assert (await load_job(after, old, [10, 11])).success
        assert (await store_job(after, new, [2, 3])).success
        assert (await load_job(after, new, [12, 13])).success
    assert [slot(pool, i) for i in range(10, 14)] == [slot(pool, i) for i in range(4)]
    assert [header_fields(raw(redis_server, k, "h"))[1] for k in old + new] == [1, 1, 2, 2]
    # The old key alone no longer opens the new blocks; the new key alone not the old.
    async with opened(pool, redis_server, encryption=spec((1, OLD_KEY))) as stale:
        result = await load_job(stale, new, [20, 21])
        assert set(result.failed_keys) == set(new) and "key id 2" in str(result.error)
    async with opened(pool, redis_server, encryption=spec((2, NEW_KEY))) as retired:
        result = await load_job(retired, old, [20, 21])
        assert set(result.failed_keys) == set(old) and "key id 1" in str(result.error)


@pytest.mark.parametrize("where", [0, BLOCK // 2, BLOCK - 1, BLOCK, BLOCK + TAG - 1])
async def test_a_flipped_byte_of_ciphertext_or_tag_is_a_miss(
    pool: memoryview, redis_server: RedisServer, where: int
) -> None:
    """A byte of the ciphertext, or of the tag (``where`` past the payload) in a header
    made again around it, its own checksum sound."""
    names = keys(2)
    async with opened(pool, redis_server, encryption=spec((1, OLD_KEY))) as tier:
        assert (await store_job(tier, names, [0, 1])).success
        stored = bytearray(raw(redis_server, names[1], "p"))
        header = raw(redis_server, names[1], "h")
        if where < BLOCK:
            stored[where] ^= 0x01
        else:
            tag = bytearray(decode_header(header).payload_checksum)
            tag[where - BLOCK] ^= 0x01
            header = forged(header, tag=bytes(tag))
        put_record(redis_server, name_of(names[1]), header, bytes(stored))
        result = await load_job(tier, names, [10, 11])
        assert result.failed_keys == (names[1],) and "authentication" in str(result.error)
        assert slot(pool, 10) == slot(pool, 0)  # the other key landed
        assert redis_server.command("EXISTS", name_of(names[1])) == 0


@pytest.mark.parametrize("forge", [False, True], ids=["as-is", "header-forged"])
async def test_a_value_copied_to_another_block_s_key_is_a_miss(
    pool: memoryview, redis_server: RedisServer, forge: bool
) -> None:
    """Copied as is, the header names the other key; with a header forged for the new
    key (same key id and nonce), the associated data no longer matches."""
    source, target = keys(2)
    async with opened(pool, redis_server, encryption=spec((1, OLD_KEY))) as tier:
        assert (await store_job(tier, [source, target], [0, 1])).success
        header, sealed = raw(redis_server, source, "h"), raw(redis_server, source, "p")
        if forge:
            header = forged(header, key=target)
        put_record(redis_server, name_of(target), header, sealed)
        result = await load_job(tier, [source, target], [10, 11])
        assert result.failed_keys == (target,)
        assert ("authentication" if forge else "another key") in str(result.error)
        assert slot(pool, 10) == slot(pool, 0)


async def test_a_value_copied_into_another_namespace_is_a_miss(
    pool: memoryview, redis_server: RedisServer
) -> None:
    [key] = keys(1)
    options = {"encryption": spec((1, OLD_KEY))}
    async with opened(pool, redis_server, **options) as mine:
        assert (await store_job(mine, [key], [0])).success
    header, sealed = raw(redis_server, key, "h"), raw(redis_server, key, "p")
    other = forged(header, namespace="model-b")
    put_record(redis_server, name_of(key, "model-b"), other, sealed)
    async with opened(pool, redis_server, namespace="model-b", **options) as theirs:
        result = await load_job(theirs, [key], [10])
        assert result.failed_keys == (key,) and "authentication" in str(result.error)


@pytest.mark.parametrize("forge", [False, True], ids=["as-is", "header-forged"])
async def test_a_value_copied_to_another_tenant_s_key_is_a_miss(
    redis_server: RedisServer, forge: bool
) -> None:
    """Two engines whose tiers differ only in ``tenant``, one keyring: copied as is, the
    header names the other tenant; with a header forged for the new tenant, the
    associated data no longer matches."""
    kv = torch.randn(16, 4, 64).half()

    def tiers(tenant: str) -> list[dict[str, Any]]:
        keyring = spec((1, OLD_KEY))
        return [{"type": "redis", "url": redis_server.url, "tenant": tenant, "encryption": keyring}]

    [block] = hashes = [b"h0"]
    async with (
        TieringEngine(kv, 4, secondary_tiers=tiers("A"), cache_identity="m") as mine,
        TieringEngine(kv, 4, secondary_tiers=tiers("B"), cache_identity="m") as theirs,
    ):
        job = mine.store(hashes, [0])
        assert (await job).success and await job.cascaded
        namespace = mine.namespace
        source, target = name_of(block, namespace, "A"), name_of(block, namespace, "B")
        header, sealed = record_of(redis_server, source)
        if forge:
            header = forged(header, tenant=b"B")
        put_record(redis_server, target, header, sealed)
        assert await settled(lambda: theirs.lookup(hashes) or None) == 1  # present to B
        result = await theirs.load(hashes, [8])
        assert result.failed_keys == (block,)
        assert ("authentication" if forge else "another tenant") in str(result.error)
        assert redis_server.command("EXISTS", target) == 0  # deleted, never served


async def test_plain_and_encrypting_tiers_never_serve_each_other_s_blocks(
    pool: memoryview, redis_server: RedisServer
) -> None:
    plain_names, sealed_names = keys(2, "plain"), keys(2, "sealed")
    sealing = {"encryption": spec((1, OLD_KEY))}
    async with opened(pool, redis_server) as plain, opened(pool, redis_server, **sealing) as enc:
        assert (await store_job(plain, plain_names, [0, 1])).success
        assert (await store_job(enc, sealed_names, [2, 3])).success
        pool[10 * BLOCK : 14 * BLOCK] = bytes(4 * BLOCK)
        # A plain tier never serves ciphertext: the slot is not even written.
        result = await load_job(plain, sealed_names, [10, 11])
        assert set(result.failed_keys) == set(sealed_names)
        assert "is encrypted" in str(result.error)
        assert slot(pool, 10) == slot(pool, 11) == bytes(BLOCK)
        # A tier that encrypts never serves a block that did not authenticate.
        result = await load_job(enc, plain_names, [12, 13])
        assert set(result.failed_keys) == set(plain_names)
        assert "not encrypted" in str(result.error)
        assert enc.statistics().counters["loaded_blocks"] == 0
        assert plain.statistics().counters["loaded_blocks"] == 0


@pytest.mark.parametrize(
    "value",
    [
        f"1:{b64(OLD_KEY)[:-4]}!!!!",  # not base64
        f"1:{b64(OLD_KEY[:20])}",  # 20 bytes: no AES key size
        f"0:{b64(OLD_KEY)}",  # id 0
        f"1:{b64(OLD_KEY)},1:{b64(NEW_KEY)}",  # an id twice
        b64(OLD_KEY),  # no id
        "env:KVT_NO_SUCH_VARIABLE_1f3c",
        "",
        42,
    ],
)
def test_a_bad_encryption_option_is_a_clear_error_without_key_bytes(
    pool: memoryview, value: object
) -> None:
    options = {"type": "redis", "url": "redis://127.0.0.1:1/0", "namespace": "x"}
    with pytest.raises(InvalidArgumentError, match="encryption") as raised:
        make_tier({**options, "encryption": value}, pool, BLOCK)
    shown = str(raised.value) + repr(raised.value)
    for key in (OLD_KEY, NEW_KEY):
        assert b64(key)[:12] not in shown and key.hex()[:24] not in shown


async def test_key_material_never_shows_anywhere(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Keys given to an encrypting tier (through the engine too) never show in its
    ``repr``, statistics, errors, logs, metrics or events, even when blocks fail to
    open under them."""
    caplog.set_level(logging.DEBUG)
    seen: list[str] = []
    kv = torch.randn(16, 4, 64).half()
    names = [b"h%d" % i for i in range(4)]

    def tiers(keyring: str) -> list[dict[str, Any]]:
        return [{"type": "redis", "url": redis_server.url, "encryption": keyring}]

    writer_keys = spec((2, NEW_KEY), (1, OLD_KEY))
    async with TieringEngine(kv, 4, secondary_tiers=tiers(writer_keys), enable_events=True) as e:
        job = e.store(names, [0, 1, 2, 3])
        assert (await job).success and await job.cascaded
        seen += [repr(e), repr(e.tiers[0]), repr(e.statistics()), repr(e.tiers[0].statistics())]
        seen.append(encode_events(e.take_events()).decode())
    wrong_keys = spec((2, OTHER_KEY))  # the right id, the wrong key: nothing opens
    async with TieringEngine(kv, 4, secondary_tiers=tiers(wrong_keys), enable_events=True) as e:
        assert await settled(lambda: e.lookup(names) or None) == 4  # present, not openable
        failed = await e.load(names, [8, 9, 10, 11])
        assert not failed.success
        with serve_engine_metrics(e, 0) as metrics:
            url = f"http://127.0.0.1:{metrics.port}/metrics"
            text = await asyncio.to_thread(lambda: urllib.request.urlopen(url).read())
        seen += [
            repr(failed),
            text.decode(),
            repr(e),
            repr(e.tiers[0]),
            repr(e.tiers[0].statistics()),
            repr(e.statistics()),
            encode_events(e.take_events()).decode(),
            repr(e.get_finished()),
        ]
    pool = memoryview(bytearray(8 * BLOCK))
    async with opened(pool, redis_server, namespace="n", encryption=writer_keys) as tier:
        assert (await store_job(tier, names, range(4))).success
    async with opened(pool, redis_server, namespace="n", encryption=wrong_keys) as tier:
        failed = await load_job(tier, names, range(4, 8))
        assert not failed.success and "authentication" in str(failed.error)
        seen += [str(failed), repr(failed), repr(tier), repr(tier.statistics())]
        seen += [repr(tier.keyring), repr(tier._cipher)]
    with pytest.raises(InvalidArgumentError) as bad:  # a key of a bad length
        make_tier(
            {"type": "redis", "url": redis_server.url, "encryption": f"1:{b64(OLD_KEY[:31])}"},
            pool,
            BLOCK,
        )
    seen += [str(bad.value), repr(bad.value), caplog.text]
    assert any("authentication" in place for place in seen)  # the failures were reported
    for key in (OLD_KEY, NEW_KEY, OTHER_KEY):
        shapes = (b64(key), b64(key)[:16], key.hex(), repr(key)[2:-1], str(list(key[:8]))[1:-1])
        leaks = [place for place in seen for shape in shapes if shape in place]
        assert not leaks, leaks
    raw_keys = (OLD_KEY, NEW_KEY, OTHER_KEY)
    assert not [p for p in seen if any(k.decode("latin-1") in p for k in raw_keys)]
