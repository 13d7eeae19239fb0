"""Encryption at rest in the NVMe tier (backends.nvme.segments.PayloadSealer): sealed
blocks round-trip byte-exact, no plaintext reaches the disk, and a wrong or missing key,
a tampered byte, a moved block or a block of the other kind is a miss, never bytes."""

from __future__ import annotations

import base64
import logging
import os
import stat
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import xxhash

from backends.nvme.segments import PayloadSealer
from backends.nvme.tier import NVMeTier
from tests._engine_helpers import flip_byte
from tests._nvme_helpers import load_job as load
from tests._nvme_helpers import random_pool
from tests._nvme_helpers import store_job as store
from tiering.errors import InvalidArgumentError
from tiering.security.encryption import TAG_BYTES, BlockCipher, Keyring
from tiering.tiers.block_record import HEADER_BYTES, SEALED, decode_header, record_binding

BLOCK = 16 << 10
SLOTS = 8
KEY_A = os.urandom(32)
KEY_B = os.urandom(32)
OLD = f"1:{base64.b64encode(KEY_A).decode()}"
ROTATED = f"2:{base64.b64encode(KEY_B).decode()},{OLD}"
LAYOUTS = [NVMeTier]


@pytest.fixture
def pool() -> Iterator[memoryview]:
    with random_pool(BLOCK, SLOTS) as view:
        yield view


def make(layout: type[NVMeTier], pool: memoryview, root: Path, **kwargs: Any) -> Any:
    options: dict[str, Any] = {
        "root": root,
        "namespace": "model=tiny;sealed",
        "capacity_bytes": 64 * (HEADER_BYTES + BLOCK),
        "min_free_bytes": 0,
    }
    options.update(kwargs)
    return layout(pool, BLOCK, **options)


def block_files(tier: NVMeTier) -> list[Path]:
    """Every file holding block payloads: the segment files."""
    return sorted(p for p in Path(tier.directory).rglob("*") if p.suffix == ".seg")


def headers(tier: NVMeTier) -> dict[bytes, tuple[Path, int]]:
    """Each stored key's file and the offset of its header page."""
    found: dict[bytes, tuple[Path, int]] = {}
    for path in block_files(tier):
        data = path.read_bytes()
        for offset in range(HEADER_BYTES, len(data) - HEADER_BYTES + 1, HEADER_BYTES):
            try:
                header = decode_header(data[offset : offset + HEADER_BYTES])
            except Exception:
                continue
            found[header.key] = (path, offset)
    return found


def overwrite(path: Path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as file:
        file.seek(offset)
        file.write(data)


def slot(pool: memoryview, i: int) -> bytes:
    return bytes(pool[i * BLOCK : (i + 1) * BLOCK])


@pytest.mark.parametrize("layout", LAYOUTS)
async def test_sealed_blocks_round_trip_and_no_plaintext_reaches_the_disk(
    layout: type[NVMeTier], pool: memoryview, tmp_path: Path
) -> None:
    async with make(layout, pool, tmp_path, encryption=OLD) as tier:
        keys = [b"a", b"b", b"c"]
        assert (await store(tier, keys, [0, 1, 2])).success
        on_disk = b"".join(p.read_bytes() for p in block_files(tier))
        for i in range(3):
            assert slot(pool, i)[:64] not in on_disk
            assert slot(pool, i)[-64:] not in on_disk
        for key, (path, offset) in headers(tier).items():
            raw = path.read_bytes()[offset : offset + HEADER_BYTES]
            header = decode_header(raw)
            assert raw[10] == SEALED and header.seal is not None
            assert header.seal.key_id == 1
            payload = slot(pool, keys.index(key))
            assert header.payload_checksum != xxhash.xxh3_128_digest(payload)  # no plaintext sum
        expected = [slot(pool, i) for i in range(3)]
        assert (await load(tier, keys, [5, 6, 7])).success
        assert [slot(pool, i) for i in (5, 6, 7)] == expected


@pytest.mark.parametrize("layout", LAYOUTS)
async def test_a_restart_with_the_same_keyring_keeps_every_block(
    layout: type[NVMeTier], pool: memoryview, tmp_path: Path
) -> None:
    async with make(layout, pool, tmp_path, encryption=OLD) as tier:
        assert (await store(tier, [b"a", b"b"], [0, 1])).success
    expected = [slot(pool, 0), slot(pool, 1)]
    async with make(layout, pool, tmp_path, encryption=OLD) as tier:
        assert (await load(tier, [b"a", b"b"], [4, 5])).success
    assert [slot(pool, 4), slot(pool, 5)] == expected


@pytest.mark.parametrize("layout", LAYOUTS)
async def test_rotation_reads_the_old_key_and_writes_the_new_one(
    layout: type[NVMeTier], pool: memoryview, tmp_path: Path
) -> None:
    async with make(layout, pool, tmp_path, encryption=OLD) as tier:
        assert (await store(tier, [b"old"], [0])).success
    old_bytes = slot(pool, 0)
    async with make(layout, pool, tmp_path, encryption=ROTATED) as tier:
        assert (await store(tier, [b"new"], [1])).success
        assert (await load(tier, [b"old"], [4])).success
        assert slot(pool, 4) == old_bytes
        ids = {}
        for key, (path, offset) in headers(tier).items():
            seal = decode_header(path.read_bytes()[offset : offset + HEADER_BYTES]).seal
            ids[key] = seal.key_id if seal is not None else None
        assert ids == {b"old": 1, b"new": 2}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(
    ("reader", "logged"),
    [
        (f"1:{base64.b64encode(os.urandom(32)).decode()}", "failed authentication under key id 1"),
        (f"2:{base64.b64encode(KEY_B).decode()}", "key id 1, which the keyring lacks"),
    ],
    ids=["wrong-key", "missing-key-id"],
)
async def test_a_wrong_or_missing_key_is_a_miss_with_one_error(
    layout: type[NVMeTier],
    reader: str,
    logged: str,
    pool: memoryview,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with make(layout, pool, tmp_path, encryption=OLD) as tier:
        assert (await store(tier, [b"a", b"b", b"c"], [0, 1, 2])).success
    pool[5 * BLOCK : 6 * BLOCK] = bytes(BLOCK)
    caplog.set_level(logging.ERROR)
    async with make(layout, pool, tmp_path, encryption=reader) as tier:
        for key, target in ((b"a", 5), (b"b", 6), (b"c", 7)):
            result = await load(tier, [key], [target])
            assert not result.success and result.failed_keys == (key,)
            assert not tier.lookup(key)  # a miss from now on
    errors = [r.getMessage() for r in caplog.records if "tiering.security.encryption" in r.name]
    assert len(errors) == 1 and logged in errors[0]
    for key in (KEY_A, KEY_B):
        assert base64.b64encode(key).decode() not in caplog.text


@pytest.mark.parametrize("layout", LAYOUTS)
async def test_a_flipped_ciphertext_byte_is_a_miss(
    layout: type[NVMeTier], pool: memoryview, tmp_path: Path
) -> None:
    async with make(layout, pool, tmp_path, encryption=OLD) as tier:
        assert (await store(tier, [b"a", b"b"], [0, 1])).success
        path, offset = headers(tier)[b"a"]
        flip_byte(path, offset + HEADER_BYTES + 1000)
        result = await load(tier, [b"a", b"b"], [4, 5])
        assert result.failed_keys == (b"a",)
        assert slot(pool, 5) == slot(pool, 1)  # the other block of the job still lands


async def test_a_block_moved_under_another_key_fails_authentication(
    pool: memoryview, tmp_path: Path
) -> None:
    # Whoever can write the files can forge a self-consistent header (its checksum is
    # no secret): only the associated data tells the block it was sealed for another key.
    async with make(NVMeTier, pool, tmp_path, encryption=OLD) as tier:
        assert (await store(tier, [b"victim", b"other1"], [0, 1])).success
        (source, at), (target, there) = headers(tier)[b"other1"], headers(tier)[b"victim"]
        data = bytearray(source.read_bytes()[at : at + HEADER_BYTES + BLOCK])
        data[76:82] = b"victim"  # the key, after an empty tenant (tiering/tiers/block_record.py)
        struct.pack_into("<H", data, 58, 6)
        struct.pack_into("<Q", data, HEADER_BYTES - 8, xxhash.xxh3_64_intdigest(data[:4088]))
        assert decode_header(bytes(data[:HEADER_BYTES])).key == b"victim"
        overwrite(target, there, bytes(data))
        result = await load(tier, [b"victim"], [4])
        assert not result.success


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(("writer", "reader"), [(OLD, None), (None, OLD)], ids=["sealed", "plain"])
async def test_a_block_of_the_other_kind_is_a_miss(
    layout: type[NVMeTier],
    writer: str | None,
    reader: str | None,
    pool: memoryview,
    tmp_path: Path,
) -> None:
    async with make(layout, pool, tmp_path, encryption=writer) as tier:
        assert (await store(tier, [b"a"], [0])).success
    async with make(layout, pool, tmp_path, encryption=reader) as tier:
        result = await load(tier, [b"a"], [4])
        assert not result.success and not tier.lookup(b"a")


@pytest.mark.parametrize("layout", LAYOUTS)
async def test_file_and_dir_modes_are_configurable_within_owner_only_writes(
    layout: type[NVMeTier], pool: memoryview, tmp_path: Path
) -> None:
    old_umask = os.umask(0o022)
    try:
        async with make(layout, pool, tmp_path / "r", file_mode=0o640, dir_mode=0o750) as tier:
            assert (await store(tier, [b"a"], [0])).success
            made = [Path(tier.directory), *block_files(tier)]
    finally:
        os.umask(old_umask)
    assert stat.S_IMODE(made[0].stat().st_mode) == 0o750
    assert {stat.S_IMODE(p.stat().st_mode) for p in made[1:]} == {0o640}


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("file_mode", 0o666, "^file_mode = 438: must include 0o600 and stay within 0o644"),
        ("file_mode", 0o400, "^file_mode = 256: .*got 0o400"),
        ("dir_mode", 0o770, "^dir_mode = 504: must include 0o700 and stay within 0o755"),
        ("dir_mode", "0700", "^dir_mode = '0700': Input should be a valid integer"),
        ("encryption", "1:%%%", "encryption: key 1 is not valid base64"),
        ("encryption", b"raw", r"^encryption: Input should be a valid string.*\(its value is not"),
    ],
)
def test_a_bad_privacy_option_is_refused_naming_it(
    option: str, value: object, message: str, pool: memoryview, tmp_path: Path
) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        make(NVMeTier, pool, tmp_path, **{option: value})


def test_payloads_sealed_in_order_into_a_batch_each_open() -> None:
    """The buffers of a batch overlap by a tag; sealed one after another, every payload
    still goes to disk whole and opens with its own seal."""
    sealer = PayloadSealer(
        BlockCipher(Keyring({1: KEY_A}, 1)), block_bytes=BLOCK, ns_digest=b"n" * 16
    )
    payloads = [os.urandom(BLOCK) for _ in range(sealer.batch)]
    buffers = sealer.buffers(sealer.batch)
    keys = [i.to_bytes(32, "big") for i in range(sealer.batch)]
    seals = [
        sealer.seal(key, memoryview(payload), buffer)
        for key, payload, buffer in zip(keys, payloads, buffers, strict=True)
    ]
    for key, payload, buffer, seal in zip(keys, payloads, buffers, seals, strict=True):
        on_disk, opened = bytes(buffer[:BLOCK]), bytearray(BLOCK)
        assert on_disk != payload
        binding = record_binding(b"n" * 16, b"", key)
        sealer.cipher.open_into(seal, on_disk, binding, memoryview(opened))
        assert opened == payload
    assert len(seals[0].tag) == TAG_BYTES
