"""Tests of backends.nvme.segments: segment files and the index checkpoint (no loop)."""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from backends.nvme.os_calls import ALIGNMENT, REAL_OS, OsCalls, probe_o_direct
from backends.nvme.recovery import write_checkpoint
from backends.nvme.segment_format import (
    CHECKPOINT_FILE,
    SEGMENTS_DIR,
    Checkpoint,
    namespace_dirname,
    parse_segment_name,
    segment_name,
)
from backends.nvme.segments import (
    MAX_IOV,
    RecordRun,
    SegmentFiles,
    is_aligned,
    iter_runs,
    thread_buffer,
)
from tests._faults import FaultInjector
from tests._nvme_helpers import checkpoint_read, random_pool
from tiering.errors import InvalidArgumentError
from tiering.tiers.block_record import (
    HEADER_BYTES,
    MAX_KEY_BYTES,
    decode_header,
    encode_header,
    namespace_digest,
    payload_checksum,
)

BLOCK = 16 << 10
SLOTS = 8
NS = namespace_digest("ns-a")
WRITER = "ab12"


@pytest.fixture
def pool() -> Iterator[memoryview]:
    with random_pool(BLOCK, SLOTS) as view:
        yield view


def read(seg: SegmentFiles, reads: list[tuple[bytes, str, int, memoryview]]) -> SimpleNamespace:
    """``seg.read`` of ``(key, segment, record, slot)`` reads, summed up: the keys loaded,
    the failed ones with their reasons, and of those the corrupt and the missing."""
    outcomes = seg.read([(segment, record, out, k) for k, segment, record, out in reads])
    report = SimpleNamespace(loaded=[], failed={}, corrupt=[], missing=[])
    for (k, *_), (_, why, missing) in zip(reads, outcomes, strict=True):
        if not why:
            report.loaded.append(k)
            continue
        report.failed[k] = why
        if missing:
            report.missing.append(k)
        elif why.startswith("corrupt"):
            report.corrupt.append(k)
    return report


def slot(pool: memoryview, i: int) -> memoryview:
    return pool[i * BLOCK : (i + 1) * BLOCK]


def key(i: int) -> bytes:
    return i.to_bytes(4, "big") * 8


def files(tmp_path: Path, os_calls: OsCalls = REAL_OS, **options: object) -> SegmentFiles:
    (tmp_path / SEGMENTS_DIR).mkdir(parents=True, exist_ok=True)
    return SegmentFiles(
        str(tmp_path), block_bytes=BLOCK, ns_digest=NS, os_calls=os_calls, **options
    )  # type: ignore[arg-type]


def write(seg: SegmentFiles, pool: memoryview, placed: list[tuple[int, str, int, bool]]):
    """Write key(i) from slot i at each (i, segment, record, creates)."""
    records = [(key(i), slot(pool, i)) for i, *_ in placed]
    runs = list(iter_runs([(s, r, c) for _, s, r, c in placed], records))
    return seg.write(runs, writer=WRITER)


def test_records_round_trip_byte_exact_across_segments(tmp_path: Path, pool: memoryview) -> None:
    seg = files(tmp_path)
    a, b = segment_name(WRITER, 0), segment_name(WRITER, 1)
    report = write(seg, pool, [(0, a, 0, True), (1, a, 1, False), (2, b, 0, True)])
    assert report.written == [key(0), key(1), key(2)] and not report.failed
    assert report.created == [a, b]
    target = mmap.mmap(-1, 3 * BLOCK)
    out = memoryview(target)
    reads = [
        (key(i), s, r, out[i * BLOCK : (i + 1) * BLOCK])
        for i, s, r in [(0, a, 0), (1, a, 1), (2, b, 0)]
    ]
    loaded = read(seg, reads)
    assert loaded.loaded == [key(0), key(1), key(2)] and not loaded.failed
    for i in range(3):
        assert bytes(out[i * BLOCK : (i + 1) * BLOCK]) == bytes(slot(pool, i))
    assert os.path.getsize(seg.path_of(a)) == HEADER_BYTES + 2 * seg.record_bytes


def test_one_run_is_one_write_call(tmp_path: Path, pool: memoryview) -> None:
    faults = FaultInjector()
    seg = files(tmp_path, faults)
    name = segment_name(WRITER, 0)
    write(seg, pool, [(i, name, i, i == 0) for i in range(SLOTS)])
    assert faults.calls["pwritev"] == 2  # the segment header, then all eight records
    assert faults.calls["allocate"] == 0  # one call needs no allocation first


def test_consecutive_records_are_read_in_one_call(tmp_path: Path, pool: memoryview) -> None:
    faults = FaultInjector()
    seg = files(tmp_path, faults)
    name = segment_name(WRITER, 0)
    write(seg, pool, [(i, name, i, i == 0) for i in range(6)])
    out = memoryview(mmap.mmap(-1, 6 * BLOCK))
    faults.calls.clear()
    # Records 5, 0, 1, 2 and 4 (asked out of order): runs 0-2 and 4-5, two reads.
    wanted = [5, 0, 1, 2, 4]
    report = read(seg, [(key(r), name, r, out[r * BLOCK : (r + 1) * BLOCK]) for r in wanted])
    assert sorted(report.loaded) == sorted(key(r) for r in wanted) and not report.failed
    assert faults.calls["preadv"] == 2
    for r in wanted:
        assert bytes(out[r * BLOCK : (r + 1) * BLOCK]) == bytes(slot(pool, r))


def test_a_run_longer_than_iov_max_is_split(tmp_path: Path, pool: memoryview) -> None:
    faults = FaultInjector()
    seg = files(tmp_path, faults)
    name = segment_name(WRITER, 0)
    count = MAX_IOV // 2 + 3
    records = [(key(i), slot(pool, i % SLOTS)) for i in range(count)]
    report = seg.write([RecordRun(name, 0, records, create=True)], writer=WRITER)
    assert len(report.written) == count
    assert faults.calls["pwritev"] == 3
    assert faults.calls["allocate"] == 1  # the run's space, before its two calls
    scan = seg.scan(name)
    assert scan.records == [(key(i), i) for i in range(count)] and scan.invalid == 0


def test_a_record_of_another_key_a_flipped_byte_and_a_missing_record_are_never_served(
    tmp_path: Path, pool: memoryview
) -> None:
    seg = files(tmp_path)
    name = segment_name(WRITER, 0)
    write(seg, pool, [(0, name, 0, True), (1, name, 1, False)])
    with open(seg.path_of(name), "r+b") as file:
        file.seek(seg.offset_of(1) + HEADER_BYTES + 100)
        byte = file.read(1)
        file.seek(-1, os.SEEK_CUR)
        file.write(bytes([byte[0] ^ 0xFF]))
    out = memoryview(mmap.mmap(-1, 4 * BLOCK))
    report = read(
        seg,
        [
            (key(7), name, 0, out[:BLOCK]),  # the record holds key 0
            (key(1), name, 1, out[BLOCK : 2 * BLOCK]),  # payload flipped
            (key(2), name, 5, out[2 * BLOCK : 3 * BLOCK]),  # beyond the end
            (key(3), segment_name(WRITER, 9), 0, out[3 * BLOCK :]),  # no such segment
        ],
    )
    assert report.loaded == []
    assert "another key" in report.failed[key(7)]
    assert "checksum" in report.failed[key(1)]
    assert set(report.corrupt) == {key(7), key(1)}
    assert set(report.missing) == {key(2), key(3)}


def test_a_short_segment_tail_is_a_miss_and_the_scan_ignores_the_partial_slot(
    tmp_path: Path, pool: memoryview
) -> None:
    seg = files(tmp_path)
    name = segment_name(WRITER, 0)
    write(seg, pool, [(i, name, i, i == 0) for i in range(3)])
    os.truncate(seg.path_of(name), seg.offset_of(2) + HEADER_BYTES + 10)  # record 2 torn
    scan = seg.scan(name)
    assert scan.records == [(key(0), 0), (key(1), 1)] and scan.end == 2
    out = memoryview(mmap.mmap(-1, BLOCK))
    report = read(seg, [(key(2), name, 2, out)])
    assert key(2) in report.failed and not report.loaded


def test_scan_from_a_record_number_skips_garbage_slots(tmp_path: Path, pool: memoryview) -> None:
    seg = files(tmp_path)
    name = segment_name(WRITER, 0)
    write(seg, pool, [(i, name, i, i == 0) for i in range(4)])
    with open(seg.path_of(name), "r+b") as file:  # wreck record 2's header
        file.seek(seg.offset_of(2))
        file.write(b"\0" * 64)
    scan = seg.scan(name, start=1)
    assert scan.records == [(key(1), 1), (key(3), 3)] and scan.invalid == 1 and scan.end == 4


def test_a_segment_of_another_namespace_yields_no_records(tmp_path: Path, pool: memoryview) -> None:
    name = segment_name(WRITER, 0)
    write(files(tmp_path), pool, [(0, name, 0, True)])
    other = SegmentFiles(str(tmp_path), block_bytes=BLOCK, ns_digest=namespace_digest("ns-b"))
    scan = other.scan(name)
    assert scan.records == [] and scan.invalid == 1 and not scan.header_ok


def test_records_that_landed_before_their_segment_header_are_found(
    tmp_path: Path, pool: memoryview
) -> None:
    seg = files(tmp_path)
    name = segment_name(WRITER, 0)
    # Another job's run (records 2-3) lands first; the creating run never does.
    run = RecordRun(name, 2, [(key(2), slot(pool, 2)), (key(3), slot(pool, 3))])
    seg.write([run], writer=WRITER)
    scan = seg.scan(name)
    assert not scan.header_ok and scan.records == [(key(2), 2), (key(3), 3)]
    assert scan.invalid == 2


def test_disk_full_fails_the_run_and_every_later_one(tmp_path: Path, pool: memoryview) -> None:
    faults = FaultInjector()
    seg = files(tmp_path, faults)
    a, b = segment_name(WRITER, 0), segment_name(WRITER, 1)
    faults.fail("pwritev", errno.ENOSPC, path=a, after=1)  # the header lands, records do not
    report = write(seg, pool, [(0, a, 0, True), (1, a, 1, False), (2, b, 0, True)])
    assert report.disk_full and report.written == []
    assert set(report.failed) == {key(0), key(1), key(2)}
    assert "ENOSPC" in report.failed[key(0)]
    assert report.created == [a]  # the caller learns the segment exists


def test_a_failed_allocation_fails_the_run_as_a_full_disk(tmp_path: Path, pool: memoryview) -> None:
    faults = FaultInjector()
    seg = files(tmp_path, faults)
    name = segment_name(WRITER, 0)
    faults.fail("allocate", errno.ENOSPC)
    records = [(key(i), slot(pool, i % SLOTS)) for i in range(MAX_IOV // 2 + 1)]
    report = seg.write([RecordRun(name, 0, records, create=True)], writer=WRITER)
    assert report.disk_full and report.written == [] and len(report.failed) == len(records)
    assert faults.calls["pwritev"] == 1  # the segment header only


def test_batch_fsync_syncs_each_segment_and_the_directory_once(
    tmp_path: Path, pool: memoryview
) -> None:
    faults = FaultInjector()
    seg = files(tmp_path, faults, fsync="batch")
    a = segment_name(WRITER, 0)
    write(seg, pool, [(0, a, 0, True), (1, a, 1, False)])
    assert faults.calls["fdatasync"] == 1 and faults.calls["fsync"] == 1
    faults.calls.clear()
    write(seg, pool, [(2, a, 2, False)])
    assert faults.calls["fdatasync"] == 1 and faults.calls["fsync"] == 0
    faults.calls.clear()
    files(tmp_path, faults, fsync="none").write(
        [RecordRun(a, 3, [(key(3), slot(pool, 3))])], writer=WRITER
    )
    assert faults.calls["fdatasync"] == 0 and faults.calls["fsync"] == 0


def test_a_failed_sync_fails_every_key_of_the_call(tmp_path: Path, pool: memoryview) -> None:
    faults = FaultInjector()
    seg = files(tmp_path, faults, fsync="batch")
    faults.fail("fdatasync", errno.EIO, times=1)
    a = segment_name(WRITER, 0)
    report = write(seg, pool, [(0, a, 0, True), (1, a, 1, False)])
    assert report.written == [] and set(report.failed) == {key(0), key(1)}


def test_payload_of_the_wrong_size_is_refused_before_anything_is_written(
    tmp_path: Path, pool: memoryview
) -> None:
    seg = files(tmp_path)
    a = segment_name(WRITER, 0)
    with pytest.raises(InvalidArgumentError, match="payload"):
        seg.write([RecordRun(a, 0, [(key(0), pool[:100])], create=True)], writer=WRITER)
    assert seg.list_segments() == []


def test_segments_are_listed_with_sizes_and_deleted(tmp_path: Path, pool: memoryview) -> None:
    seg = files(tmp_path)
    a, b = segment_name(WRITER, 0), segment_name(WRITER, 1)
    write(seg, pool, [(0, a, 0, True), (1, b, 0, True)])
    (tmp_path / SEGMENTS_DIR / "notes.txt").write_text("not a segment")
    size = HEADER_BYTES + seg.record_bytes
    assert seg.list_segments() == [(a, size), (b, size)]
    assert seg.delete([a, segment_name(WRITER, 7)]) == 1
    assert seg.list_segments() == [(b, size)]


def test_segment_names_parse_back_and_bad_ones_are_refused() -> None:
    assert parse_segment_name(segment_name("00ff", 7)) == ("00ff", 7)
    assert parse_segment_name("00ff-0000007.seg") is None
    assert parse_segment_name("x.seg") is None
    with pytest.raises(InvalidArgumentError):
        segment_name("XYZ", 0)
    with pytest.raises(InvalidArgumentError):
        segment_name("ab", 1 << 32)


def test_block_sizes_off_the_page_are_padded_to_aligned_records(tmp_path: Path) -> None:
    (tmp_path / SEGMENTS_DIR).mkdir()
    seg = SegmentFiles(str(tmp_path), block_bytes=1000, ns_digest=NS)
    assert seg.record_bytes == HEADER_BYTES + 4096
    payloads = [os.urandom(1000) for _ in range(2)]
    name = segment_name(WRITER, 0)
    records = [(key(i), memoryview(bytearray(p))) for i, p in enumerate(payloads)]
    assert len(seg.write([RecordRun(name, 0, records, create=True)], writer=WRITER).written) == 2
    out = [memoryview(bytearray(1000)) for _ in range(2)]
    report = read(seg, [(key(i), name, i, out[i]) for i in range(2)])
    assert report.loaded == [key(0), key(1)]
    assert [bytes(o) for o in out] == payloads


# -- staged I/O -------------------------------------------------------------------------


def staged_files(tmp_path: Path, os_calls: OsCalls = REAL_OS, **options: object) -> SegmentFiles:
    """Segment files with O_DIRECT and a staging buffer of three records per call."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    why = probe_o_direct(str(tmp_path))
    if why is not None:
        pytest.skip(f"staging applies to direct I/O only: {why}")
    options.setdefault("staging_bytes", 3 * (HEADER_BYTES + BLOCK))
    return files(tmp_path, os_calls, o_direct=True, **options)


def test_staged_writes_put_the_same_bytes_on_disk_as_direct_ones(
    tmp_path: Path, pool: memoryview
) -> None:
    staged = staged_files(tmp_path / "staged")
    plain = files(tmp_path / "plain", o_direct=True)
    name = segment_name(WRITER, 0)
    for seg in (staged, plain):
        report = write(seg, pool, [(i, name, i, i == 0) for i in range(SLOTS)])
        assert len(report.written) == SLOTS and not report.failed
    with open(staged.path_of(name), "rb") as a, open(plain.path_of(name), "rb") as b:
        assert a.read() == b.read()


def test_staged_io_moves_at_most_the_staging_buffer_a_call(
    tmp_path: Path, pool: memoryview
) -> None:
    faults = FaultInjector()
    seg = staged_files(tmp_path, faults)
    assert seg.staged == 3
    name = segment_name(WRITER, 0)
    write(seg, pool, [(i, name, i, i == 0) for i in range(SLOTS)])
    assert faults.calls["pwritev"] == 1 + 3  # the segment header, then records 3 + 3 + 2
    out = memoryview(mmap.mmap(-1, SLOTS * BLOCK))
    faults.calls.clear()
    report = read(seg, [(key(i), name, i, out[i * BLOCK : (i + 1) * BLOCK]) for i in range(SLOTS)])
    assert report.loaded == [key(i) for i in range(SLOTS)] and not report.failed
    assert faults.calls["preadv"] == 3
    assert bytes(out) == bytes(pool)


def test_staged_io_takes_slots_at_any_address(tmp_path: Path, pool: memoryview) -> None:
    """Staged, a slot or payload need not be aligned (or writable) for direct I/O: the
    staging buffer is."""
    seg = staged_files(tmp_path)
    name = segment_name(WRITER, 0)
    write(seg, pool, [(i, name, i, i == 0) for i in range(4)])
    out = memoryview(bytearray(4 * BLOCK + 1))[1:]  # off the page, and not an mmap
    report = read(seg, [(key(i), name, i, out[i * BLOCK : (i + 1) * BLOCK]) for i in range(4)])
    assert report.loaded == [key(i) for i in range(4)]
    assert bytes(out) == bytes(pool[: 4 * BLOCK])
    records = [(key(0), memoryview(bytes(slot(pool, 0))))]  # a read-only payload too
    assert seg.write([RecordRun(name, 4, records, create=False)], writer=WRITER).written
    assert read(seg, [(key(0), name, 4, out[:BLOCK])]).loaded == [key(0)]


def test_staged_reads_serve_nothing_that_does_not_verify(tmp_path: Path, pool: memoryview) -> None:
    seg = staged_files(tmp_path)
    name = segment_name(WRITER, 0)
    write(seg, pool, [(i, name, i, i == 0) for i in range(4)])
    with open(seg.path_of(name), "r+b") as file:
        file.seek(seg.offset_of(1) + HEADER_BYTES + 100)
        byte = file.read(1)
        file.seek(-1, os.SEEK_CUR)
        file.write(bytes([byte[0] ^ 0xFF]))
    os.truncate(seg.path_of(name), seg.offset_of(3) + HEADER_BYTES + 10)  # record 3 torn
    out = memoryview(mmap.mmap(-1, 6 * BLOCK))
    wanted = [(key(0), 0), (key(1), 1), (key(9), 2), (key(3), 3), (key(4), 4)]
    report = read(seg, [(k, name, r, out[r * BLOCK : (r + 1) * BLOCK]) for k, r in wanted])
    assert report.loaded == [key(0)]
    assert "checksum" in report.failed[key(1)]
    assert "another key" in report.failed[key(9)]
    assert "short read" in report.failed[key(3)]
    assert report.missing == [key(4)]
    assert bytes(out[:BLOCK]) == bytes(slot(pool, 0))


def test_nothing_is_staged_without_direct_io(tmp_path: Path, pool: memoryview) -> None:
    faults = FaultInjector()
    seg = files(tmp_path, faults, staging_bytes=3 * (HEADER_BYTES + BLOCK))  # o_direct off
    assert seg.staged == 0
    name = segment_name(WRITER, 0)
    write(seg, pool, [(i, name, i, i == 0) for i in range(SLOTS)])
    assert faults.calls["pwritev"] == 2  # the segment header, then all eight records


# -- checkpoint ------------------------------------------------------------------------


def checkpoint(n: int) -> Checkpoint:
    rng = np.random.default_rng(n)
    return Checkpoint(
        [(segment_name(WRITER, 0), 10), (segment_name(WRITER, 1), 3)],
        rng.integers(2, 1 << 63, n, dtype=np.uint64),
        rng.integers(0, 2, n, dtype=np.uint32),
        rng.integers(0, 10, n, dtype=np.uint32),
        rng.integers(0, 1 << 31, n, dtype=np.uint32),
    )


def assert_same(a: Checkpoint, b: Checkpoint) -> None:
    assert a.segments == b.segments
    for name in ("digests", "segment_of", "record_of", "ticks"):
        assert np.array_equal(getattr(a, name), getattr(b, name))


@pytest.mark.parametrize("n", [0, 1, 1000])
async def test_a_checkpoint_reads_back_exactly(tmp_path: Path, n: int) -> None:
    seg = files(tmp_path)
    written = checkpoint(n)
    size = await write_checkpoint(seg, written, temp_suffix="t1")
    assert size == len((tmp_path / CHECKPOINT_FILE).read_bytes())
    read, why = await checkpoint_read(seg)
    assert why is None and read is not None
    assert_same(read, written)


async def test_no_checkpoint_is_reported_as_absent(tmp_path: Path) -> None:
    assert await checkpoint_read(files(tmp_path)) == (None, "no checkpoint")


@pytest.mark.parametrize(
    "damage",
    ["flip", "truncate", "extend", "empty"],
)
async def test_a_damaged_checkpoint_is_never_trusted(tmp_path: Path, damage: str) -> None:
    seg = files(tmp_path)
    await write_checkpoint(seg, checkpoint(100), temp_suffix="t1")
    path = tmp_path / CHECKPOINT_FILE
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x01
    elif damage == "truncate":
        del data[-7:]
    elif damage == "extend":
        data += b"\0" * 8
    else:
        data = bytearray()
    path.write_bytes(bytes(data))
    read, why = await checkpoint_read(seg)
    assert read is None and why is not None and "rejected" in why


async def test_a_checkpoint_of_another_namespace_or_block_size_is_refused(tmp_path: Path) -> None:
    await write_checkpoint(files(tmp_path), checkpoint(5), temp_suffix="t1")
    other_ns = SegmentFiles(str(tmp_path), block_bytes=BLOCK, ns_digest=namespace_digest("b"))
    other_size = SegmentFiles(str(tmp_path), block_bytes=BLOCK * 2, ns_digest=NS)
    for reader in (other_ns, other_size):
        read, why = await checkpoint_read(reader)
        assert read is None and "another namespace or block size" in str(why)


async def test_a_failed_checkpoint_write_keeps_the_previous_one(tmp_path: Path) -> None:
    faults = FaultInjector()
    seg = files(tmp_path, faults)
    first = checkpoint(10)
    await write_checkpoint(seg, first, temp_suffix="t1")
    faults.fail("fdatasync", errno.EIO, times=1)
    with pytest.raises(OSError):
        await write_checkpoint(seg, checkpoint(20), temp_suffix="t2")
    read, _ = await checkpoint_read(seg)
    assert read is not None
    assert_same(read, first)
    assert sorted(os.listdir(tmp_path)) == [CHECKPOINT_FILE, SEGMENTS_DIR]


def test_a_padded_header_holds_the_longest_key() -> None:
    page = bytearray(HEADER_BYTES)
    key = b"\xff" * MAX_KEY_BYTES
    encode_header(page, key=key, payload_bytes=1, ns_digest=NS, checksum=bytes(16))
    assert decode_header(page).key == key


def test_payload_checksum_sees_one_flipped_bit() -> None:
    payload = bytearray(os.urandom(1 << 20))
    before = payload_checksum(memoryview(payload), b"binding")
    payload[123456] ^= 0x10
    assert payload_checksum(memoryview(payload), b"binding") != before


def test_namespace_dirname_is_safe_readable_and_deterministic() -> None:
    name = namespace_dirname("meta-llama/Llama-3 8B;dtype=bf16;../../etc")
    assert re.fullmatch(r"[A-Za-z0-9._-]+", name)
    assert name.startswith("meta-llama_Llama-3_8B_dtype")
    assert "/" not in name and ".." not in name.split("-")[0]
    assert name == namespace_dirname("meta-llama/Llama-3 8B;dtype=bf16;../../etc")
    assert namespace_dirname("model a") != namespace_dirname("model/a")
    assert namespace_dirname("///").startswith("ns-")


@pytest.mark.parametrize("namespace", ["", None, b"bytes"])
def test_namespace_dirname_rejects_a_non_string_or_empty(namespace: object) -> None:
    with pytest.raises(InvalidArgumentError, match="non-empty string"):
        namespace_dirname(namespace)  # type: ignore[arg-type]


# -- buffers ------------------------------------------------------------------------------


def test_alignment_needs_an_aligned_address_and_length() -> None:
    page = mmap.mmap(-1, 2 * ALIGNMENT)
    view = memoryview(page)
    try:
        assert is_aligned(view[:ALIGNMENT])
        assert not is_aligned(view[:100])
        assert not is_aligned(view[1 : ALIGNMENT + 1])
        assert not is_aligned(memoryview(bytes(ALIGNMENT)))  # read-only: no address
    finally:
        view.release()
        page.close()


@pytest.mark.parametrize("nbytes", [0, 100, 4096, 3 << 20])
def test_a_thread_buffer_is_page_aligned_zeroed_and_kept_per_thread(nbytes: int) -> None:
    local = threading.local()
    view = thread_buffer(local, "pages", nbytes)
    assert view.nbytes == nbytes and not any(view[:4096])
    if nbytes:
        assert ctypes.addressof(ctypes.c_char.from_buffer(view)) % ALIGNMENT == 0
    assert thread_buffer(local, "pages", nbytes).obj is view.obj  # reused, not remapped
    seen: list[memoryview] = []
    other = threading.Thread(target=lambda: seen.append(thread_buffer(local, "pages", nbytes)))
    other.start()
    other.join()
    assert seen[0].obj is not view.obj


def test_a_thread_buffer_grows_to_what_is_asked() -> None:
    local = threading.local()
    small = thread_buffer(local, "pages", 4096, at_least=8192)
    assert thread_buffer(local, "pages", 8192).obj is small.obj  # at_least made room
    assert thread_buffer(local, "pages", 16384).nbytes == 16384
