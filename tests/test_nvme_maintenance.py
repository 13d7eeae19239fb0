"""Tests of backends.nvme.maintenance on real roots written by the real tier."""

from __future__ import annotations

import base64
import os
import shutil
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

from backends.nvme.maintenance import clear_root, inspect_root, verify_root
from backends.nvme.segment_format import CHECKPOINT_FILE, SEGMENTS_DIR, namespace_dirname
from backends.nvme.tier import NVMeTier
from tests._nvme_helpers import load_job, random_pool, store_job
from tiering.errors import InvalidArgumentError, TieringError
from tiering.tiers.block_record import HEADER_BYTES

BLOCK = 16 << 10
RECORD = HEADER_BYTES + BLOCK
SLOTS = 16
SEGMENTS_NS = "model=tiny;layout=segments"
OTHER_NS = "model=tiny;other"


@pytest.fixture
def pool() -> Iterator[memoryview]:
    with random_pool(BLOCK, SLOTS) as view:
        yield view


def make_tier(name: str, pool: memoryview, root: Path, **kwargs: Any) -> NVMeTier:
    """A tier of namespace SEGMENTS_NS (``name`` "segments") or OTHER_NS ("other")."""
    options: dict[str, Any] = {"root": root, "capacity_bytes": 64 * RECORD, "min_free_bytes": 0}
    options.update(kwargs)
    options.setdefault("namespace", SEGMENTS_NS if name == "segments" else OTHER_NS)
    options.setdefault("segment_bytes", HEADER_BYTES + 8 * RECORD)
    return NVMeTier(pool, BLOCK, **options)


def keys(n: int, tag: str) -> list[bytes]:
    return [f"{tag}-{i}-".encode() + os.urandom(8) for i in range(n)]


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as file:
        file.seek(offset)
        byte = file.read(1)
        file.seek(offset)
        file.write(bytes([byte[0] ^ 1]))


def payload_offset(root: Path, record: int, namespace: str = SEGMENTS_NS) -> tuple[Path, int]:
    """Where a byte of the payload of the first segment's ``record`` lies."""
    directory = root / namespace_dirname(namespace) / SEGMENTS_DIR
    [first, *_] = sorted(directory.iterdir())
    return first, HEADER_BYTES + record * RECORD + HEADER_BYTES + 100


async def fill(name: str, pool: memoryview, root: Path, names: list[bytes]) -> None:
    async with make_tier(name, pool, root) as tier:
        assert (await store_job(tier, names, range(len(names)))).success


async def test_inspect_counts_the_blocks_and_bytes_the_tier_stored(
    pool: memoryview, tmp_path: Path
) -> None:
    await fill("segments", pool, tmp_path, keys(10, "a"))
    report = inspect_root(tmp_path)
    [ns] = report.namespaces
    assert ns.namespace == SEGMENTS_NS
    assert ns.layouts == ("segments",) and ns.block_bytes == BLOCK
    assert ns.blocks == 10 and ns.payload_bytes == 10 * BLOCK
    disk = sum(p.stat().st_size for p in (tmp_path / ns.directory).rglob("*") if p.is_file())
    assert ns.disk_bytes == disk > 10 * BLOCK
    assert ns.damaged == () and ns.orphaned == () and ns.live_owners == ()
    assert asdict(report)["blocks"] == 10


async def test_two_namespaces_in_one_root_are_reported_apart(
    pool: memoryview, tmp_path: Path
) -> None:
    await fill("segments", pool, tmp_path, keys(12, "s"))
    await fill("other", pool, tmp_path, keys(5, "f"))
    report = inspect_root(tmp_path)
    assert {ns.namespace: ns.blocks for ns in report.namespaces} == {
        SEGMENTS_NS: 12,
        OTHER_NS: 5,
    }
    assert report.blocks == 17 and report.other_entries == ()
    only = inspect_root(tmp_path, namespace=namespace_dirname(OTHER_NS).rpartition("-")[2][:6])
    assert [ns.namespace for ns in only.namespaces] == [OTHER_NS]


async def test_verify_finds_a_flipped_payload_byte_and_remove_keeps_a_restart_from_serving_it(
    pool: memoryview, tmp_path: Path
) -> None:
    names = keys(6, "v")
    await fill("segments", pool, tmp_path, names)
    path, offset = payload_offset(tmp_path, 2)
    flip_byte(path, offset)

    report = verify_root(tmp_path, remove=False)
    assert report.checked == 6
    [bad] = report.bad_blocks
    assert "payload checksum mismatch" in bad.reason and not bad.removed
    assert bad.key == names[2].hex()
    assert verify_root(tmp_path, remove=False).bad_blocks == report.bad_blocks  # nothing changed

    removed = verify_root(tmp_path, remove=True)
    assert [b.removed for b in removed.bad_blocks] == [True]
    assert verify_root(tmp_path, remove=False).bad_blocks == ()
    async with make_tier("segments", pool, tmp_path) as tier:
        assert tier.lookup(names[2]) is False
        assert tier.get_num_blocks() == 5
        others = names[:2] + names[3:]
        assert (await load_job(tier, others, range(5))).success


async def test_a_record_verify_removed_is_counted_removed_not_damaged_by_inspect(
    pool: memoryview, tmp_path: Path
) -> None:
    names = keys(6, "r")
    await fill("segments", pool, tmp_path, names)
    segment, _ = payload_offset(tmp_path, 2)
    flip_byte(segment, HEADER_BYTES + 2 * RECORD + 10)  # in record 2's header: damaged
    assert inspect_root(tmp_path).damaged == 1

    assert [b.removed for b in verify_root(tmp_path, remove=True).bad_blocks] == [True]
    report = inspect_root(tmp_path)
    assert report.damaged == 0 and report.blocks == 5
    [ns] = report.namespaces
    assert [f.reason for f in ns.orphaned] == [
        "1 of 6 record slots removed by `tiering verify --remove` (their space returns with "
        "the segment)"
    ]


KEYRING = "1:" + base64.b64encode(bytes(range(32))).decode()


async def test_verify_checks_encrypted_blocks_under_their_keyring_and_never_removes_blindly(
    pool: memoryview, tmp_path: Path
) -> None:
    names = keys(4, "e")
    async with make_tier("segments", pool, tmp_path, encryption=KEYRING) as tier:
        assert (await store_job(tier, names, range(4))).success
    assert verify_root(tmp_path, remove=False, encryption=KEYRING).bad_blocks == ()
    blind = verify_root(tmp_path, remove=False)  # no keyring: cannot be checked
    assert len(blind.bad_blocks) == 4 and all("encrypted" in b.reason for b in blind.bad_blocks)
    with pytest.raises(TieringError, match="holds encrypted blocks"):
        verify_root(tmp_path, remove=True)
    path, offset = payload_offset(tmp_path, 1)
    flip_byte(path, offset)
    [bad] = verify_root(tmp_path, remove=True, encryption=KEYRING).bad_blocks
    assert bad.key == names[1].hex() and "authentication" in bad.reason and bad.removed
    async with make_tier("segments", pool, tmp_path, encryption=KEYRING) as tier:
        assert tier.get_num_blocks() == 3 and tier.lookup(names[0])


async def test_a_bad_record_named_by_the_checkpoint_leaves_it(
    pool: memoryview, tmp_path: Path
) -> None:
    names = keys(6, "c")
    await fill("segments", pool, tmp_path, names)
    checkpoint = tmp_path / namespace_dirname(SEGMENTS_NS) / CHECKPOINT_FILE
    before = checkpoint.read_bytes()
    path, offset = payload_offset(tmp_path, 4)
    flip_byte(path, offset)
    report = verify_root(tmp_path, remove=True)
    assert [ns.checkpoint_rewritten for ns in report.namespaces] == [True]
    assert checkpoint.read_bytes() != before
    async with make_tier("segments", pool, tmp_path) as tier:
        assert tier.metrics.recovered_blocks == 5 and tier.lookup(names[4]) is False


async def test_without_remove_a_restart_still_indexes_the_bad_block_and_a_load_fails(
    pool: memoryview, tmp_path: Path
) -> None:
    # What --remove is for: verification alone changes nothing the tier sees.
    names = keys(4, "n")
    await fill("segments", pool, tmp_path, names)
    path, offset = payload_offset(tmp_path, 1)
    flip_byte(path, offset)
    assert len(verify_root(tmp_path, remove=False).bad_blocks) == 1
    async with make_tier("segments", pool, tmp_path) as tier:
        assert tier.lookup(names[1]) is True
        assert not (await load_job(tier, [names[1]], [0])).success


async def test_a_leftover_temporary_file_is_orphaned_and_an_unknown_one_too(
    pool: memoryview, tmp_path: Path
) -> None:
    names = keys(3, "o")
    await fill("segments", pool, tmp_path, names)
    directory = tmp_path / namespace_dirname(SEGMENTS_NS)
    dead_writer = "ab" * 16
    temp = directory / f"{CHECKPOINT_FILE}.{dead_writer}.tmp"
    temp.write_bytes(b"half a block")
    (directory / "notes.txt").write_text("mine")
    [ns] = inspect_root(tmp_path).namespaces
    reasons = {f.path: f.reason for f in ns.orphaned}
    assert "writer that is gone" in reasons[str(temp.relative_to(tmp_path))]
    assert "not a file the tier writes" in reasons[f"{ns.directory}/notes.txt"]
    assert ns.blocks == 3 and ns.damaged == ()


async def test_a_segment_whose_records_all_live_elsewhere_is_orphaned(
    pool: memoryview, tmp_path: Path
) -> None:
    names = keys(4, "d")
    await fill("segments", pool, tmp_path, names)
    directory = tmp_path / namespace_dirname(SEGMENTS_NS) / SEGMENTS_DIR
    [original] = sorted(directory.iterdir())
    # Another writer's later copy of every record: its records win, as at a tier start.
    shutil.copyfile(original, directory / f"{'cd' * 16}-00000000.seg")
    [ns] = inspect_root(tmp_path).namespaces
    assert ns.blocks == 4
    assert [(f.path, "no block" in f.reason) for f in ns.orphaned] == [
        (str(original.relative_to(tmp_path)), True)
    ]
    async with make_tier("segments", pool, tmp_path) as tier:
        assert tier.get_num_blocks() == 4


async def test_clear_of_one_namespace_leaves_the_other_and_files_it_does_not_know(
    pool: memoryview, tmp_path: Path
) -> None:
    await fill("segments", pool, tmp_path, keys(9, "s"))
    await fill("other", pool, tmp_path, keys(3, "f"))
    outside = tmp_path / "keep.txt"
    outside.write_text("not a namespace")
    stranger = tmp_path / namespace_dirname(SEGMENTS_NS) / "segments" / "mine.bin"
    stranger.write_bytes(b"x")

    preview = clear_root(tmp_path, namespace=SEGMENTS_NS, dry_run=True)
    assert preview.files > 0 and inspect_root(tmp_path).blocks == 12  # nothing gone yet

    done = clear_root(tmp_path, namespace=SEGMENTS_NS)
    assert done.files == preview.files and done.bytes == preview.bytes
    assert done.left == (str(stranger.relative_to(tmp_path)),)
    assert stranger.exists() and outside.exists()
    remaining = inspect_root(tmp_path)
    # The cleared directory stays only for the file the tier never wrote.
    assert {(ns.namespace, ns.blocks) for ns in remaining.namespaces} == {
        (OTHER_NS, 3),
        (None, 0),
    }
    async with make_tier("segments", pool, tmp_path) as tier:
        assert tier.get_num_blocks() == 0


async def test_clear_of_everything_leaves_an_empty_root(pool: memoryview, tmp_path: Path) -> None:
    await fill("segments", pool, tmp_path, keys(2, "s"))
    await fill("other", pool, tmp_path, keys(2, "f"))
    report = clear_root(tmp_path, namespace=None)
    assert len(report.namespaces) == 2 and report.left == ()
    assert os.listdir(tmp_path) == []
    assert inspect_root(tmp_path).namespaces == ()


async def test_a_live_tier_is_reported_and_removal_and_clear_refuse_it(
    pool: memoryview, tmp_path: Path
) -> None:
    async with make_tier("segments", pool, tmp_path) as tier:
        assert (await store_job(tier, keys(3, "l"), range(3))).success
        [ns] = inspect_root(tmp_path).namespaces
        assert len(ns.live_owners) == 1 and ns.blocks == 3
        assert verify_root(tmp_path, remove=False).checked == 3
        with pytest.raises(TieringError, match="in use by 1 running tier"):
            verify_root(tmp_path, remove=True)
        with pytest.raises(TieringError, match="in use"):
            clear_root(tmp_path, namespace=None)
        assert (tmp_path / ns.directory / "owners").exists()
    assert inspect_root(tmp_path).namespaces[0].live_owners == ()


def test_a_root_that_is_missing_a_file_or_not_a_root_is_refused_naming_root(
    tmp_path: Path,
) -> None:
    (tmp_path / "file").write_text("x")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "data.txt").write_text("precious")
    for path, why in (
        (tmp_path / "missing", "does not exist"),
        (tmp_path / "file", "is not a directory"),
        (tmp_path / "other", "is not an NVMe root"),
    ):
        with pytest.raises(InvalidArgumentError, match=f"ROOT: .* {why}"):
            inspect_root(path)
        with pytest.raises(InvalidArgumentError, match=f"ROOT: .* {why}"):
            verify_root(path, remove=True)
        with pytest.raises(InvalidArgumentError, match=f"ROOT: .* {why}"):
            clear_root(path, namespace=None)
    assert (tmp_path / "other" / "data.txt").read_text() == "precious"


async def test_a_root_others_can_write_to_is_refused_as_the_tier_refuses_it(
    pool: memoryview, tmp_path: Path
) -> None:
    await fill("segments", pool, tmp_path, keys(2, "w"))
    os.chmod(tmp_path, 0o777)
    try:
        for call in (
            lambda: inspect_root(tmp_path),
            lambda: verify_root(tmp_path, remove=True),
            lambda: clear_root(tmp_path, namespace=None, dry_run=True),
        ):
            with pytest.raises(InvalidArgumentError, match=r"^ROOT: .* has mode 777: others"):
                call()
    finally:
        os.chmod(tmp_path, 0o700)
    assert inspect_root(tmp_path).blocks == 2  # nothing was removed


async def test_an_unknown_or_ambiguous_namespace_is_refused(
    pool: memoryview, tmp_path: Path
) -> None:
    await fill("other", pool, tmp_path, keys(1, "f"))
    with pytest.raises(InvalidArgumentError, match="--namespace: no namespace 'nope'"):
        clear_root(tmp_path, namespace="nope")
    with pytest.raises(InvalidArgumentError, match="no namespace 'abc'"):  # too short a prefix
        inspect_root(tmp_path, namespace="abc")
    assert inspect_root(tmp_path).blocks == 1


def test_an_empty_directory_is_an_empty_root(tmp_path: Path) -> None:
    assert asdict(inspect_root(tmp_path))["namespaces"] == ()
    assert verify_root(tmp_path, remove=True).checked == 0
    assert clear_root(tmp_path, namespace=None).files == 0
