"""Tests of backends.nvme.segment_index: the segment layout's sans-I/O index."""

from __future__ import annotations

import os
import tracemalloc

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from backends.nvme.segment_format import Checkpoint, SegmentScan, segment_name
from backends.nvme.segment_index import KeyTable, Placement, SegmentIndex, key_digest
from tiering.errors import InvalidArgumentError

WRITER = "ab"


def index(capacity: int = 64, per_segment: int = 8, **options: float) -> SegmentIndex:
    return SegmentIndex(capacity, records_per_segment=per_segment, writer=WRITER, **options)


def store(idx: SegmentIndex, digests: list[int]) -> list[Placement]:
    """Make room, place and commit ``digests`` (as a store job whose writes all landed)."""
    fit, _ = idx.make_room(len(digests))
    assert fit == len(digests)
    placed = idx.place(len(digests))
    for digest, placement in zip(digests, placed, strict=True):
        idx.commit(digest, placement)
    return placed


# -- KeyTable ----------------------------------------------------------------------------


class KeyTableMachine(RuleBasedStateMachine):
    """The table against a dict, with digests crowded into few home slots."""

    def __init__(self) -> None:
        super().__init__()
        self.table = KeyTable(40)
        self.model: dict[int, tuple[int, int]] = {}

    digests = st.integers(1, 12).map(lambda i: i * 64 + (i % 3))  # collide modulo 64

    @precondition(lambda self: len(self.model) < 40)
    @rule(digest=digests, loc=st.integers(0, 1 << 40), tick=st.integers(0, 1 << 31))
    def put(self, digest: int, loc: int, tick: int) -> None:
        old = self.table.put(digest, loc, tick)
        assert old == (self.model[digest][0] if digest in self.model else None)
        self.model[digest] = (loc, tick)

    @rule(digest=digests)
    def delete(self, digest: int) -> None:
        old = self.table.delete(digest)
        expected = self.model.pop(digest, None)
        assert old == (expected[0] if expected else None)

    @rule(digest=digests, tick=st.integers(0, 1 << 31))
    def touch(self, digest: int, tick: int) -> None:
        assert self.table.touch(digest, tick) == (digest in self.model)
        if digest in self.model:
            self.model[digest] = (self.model[digest][0], tick)

    @invariant()
    def matches_the_model(self) -> None:
        assert len(self.table) == len(self.model)
        for digest in range(1, 13 * 64):
            expected = self.model.get(digest)
            assert self.table.get(digest) == (expected[0] if expected else None)
            assert self.table.tick_of(digest) == (expected[1] if expected else None)
        every = list(range(1, 13 * 64))
        assert self.table.present(every).tolist() == [d in self.model for d in every]
        digests, locs, ticks = self.table.entries()
        got = {int(d): (int(loc), int(t)) for d, loc, t in zip(digests, locs, ticks, strict=True)}
        assert got == self.model


TestKeyTable = KeyTableMachine.TestCase
TestKeyTable.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_a_full_key_table_refuses_a_new_digest_and_keeps_the_old_ones() -> None:
    table = KeyTable(3)
    for digest in (5, 6, 7):
        table.put(digest, digest * 10, 0)
    with pytest.raises(InvalidArgumentError, match="full"):
        table.put(8, 80, 0)
    table.put(5, 51, 1)  # replacing stays possible
    assert [table.get(d) for d in (5, 6, 7, 8)] == [51, 60, 70, None]


def test_key_digests_are_never_zero_and_differ_by_key() -> None:
    digests = {key_digest(os.urandom(32)) for _ in range(1000)}
    assert 0 not in digests and len(digests) == 1000


# -- SegmentIndex --------------------------------------------------------------------------


KEYS = {i: f"key-{i}".encode() for i in range(1, 41)}
DIGEST = {i: key_digest(key) for i, key in KEYS.items()}


class SegmentIndexMachine(RuleBasedStateMachine):
    """Random store jobs that overlap (each placed, then landed: committed, or abandoned
    for a failed write), removals, reads (pins), holds, evictions and checkpoints.

    The model is the location of each key's newest committed record, and the disk: the
    committed records of each segment not deleted. The checks: an indexed key is where
    its newest record is (or was dropped by an eviction the model saw); pinned, held
    and active segments, and those with a write in flight, are never evicted; the
    records on disk never exceed the capacity after room was granted; and a hard stop
    at any step loses nothing committed: the last checkpoint plus a scan of each segment
    from where that checkpoint stopped covering it restore every key where it is.
    """

    def __init__(self) -> None:
        super().__init__()
        self.idx = index(capacity=48, per_segment=6, hot_fraction=0.3)
        self.where: dict[int, tuple[str, int]] = {}
        self.pins: dict[str, int] = {}
        self.held: dict[int, int] = {}
        self.jobs: list[list[tuple[int, Placement]]] = []  # placed, not landed
        self.disk: dict[str, dict[int, int]] = {}  # segment -> record -> key committed
        self.records: dict[str, int] = {}  # segment -> records placed in it
        self.checkpoint: Checkpoint | None = None

    keys = st.integers(1, 40)

    @rule(batch=st.lists(keys, min_size=1, max_size=7, unique=True))
    def store_starts(self, batch: list[int]) -> None:
        # As the tier does, a key being written is not written again until that ends.
        writing = {key for job in self.jobs for key, _ in job}
        batch = [key for key in batch if key not in writing]
        fit, evictions = self.idx.make_room(len(batch))
        self._evicted(evictions)
        placed = self.idx.place(fit)
        for placement in placed:
            self.records[placement.segment] = placement.record + 1
        self.jobs.append(list(zip(batch, placed, strict=False)))
        assert self.idx.used_records <= self.idx.capacity_records

    @precondition(lambda self: self.jobs)
    @rule(data=st.data(), fail=st.sets(st.integers(0, 6)))
    def store_lands(self, data: st.DataObject, fail: set[int]) -> None:
        job = self.jobs.pop(data.draw(st.integers(0, len(self.jobs) - 1)))
        for n, (key, placement) in enumerate(job):
            if n in fail:
                self.idx.abandon(placement)
                continue
            self.idx.commit(DIGEST[key], placement)
            self.where[key] = (placement.segment, placement.record)
            self.disk.setdefault(placement.segment, {})[placement.record] = key

    def _evicted(self, evictions: list) -> None:
        writing = {placement.segment for job in self.jobs for _, placement in job}
        for eviction in evictions:
            assert eviction.segment not in self.pins, "a pinned segment was evicted"
            assert eviction.segment not in writing, "a segment being written was evicted"
            for key, (segment, _) in list(self.where.items()):
                if segment == eviction.segment:
                    assert key not in self.held, "a held key was evicted"
                    del self.where[key]
            self.disk.pop(eviction.segment, None)  # its file is deleted
            self.records.pop(eviction.segment, None)
            assert {d for d, _ in eviction.reinsert} <= set(DIGEST.values())

    @rule(key=keys)
    def remove(self, key: int) -> None:
        assert self.idx.remove(DIGEST[key]) == (key in self.where)
        if key in self.where:  # its record failed verification: it never counts again
            segment, record = self.where.pop(key)
            del self.disk[segment][record]

    @precondition(lambda self: self.where)
    @rule(data=st.data())
    def read_starts(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(sorted(self.where)))
        segment, _ = self.idx.locate(DIGEST[key])  # type: ignore[misc]
        self.idx.pin(segment)
        self.pins[segment] = self.pins.get(segment, 0) + 1

    @precondition(lambda self: self.idx.segments)
    @rule()
    def read_of_the_oldest_segment_starts(self) -> None:
        segment = self.idx.segments[0]  # the next victim, unless pinned
        self.idx.pin(segment)
        self.pins[segment] = self.pins.get(segment, 0) + 1

    @precondition(lambda self: self.pins)
    @rule(data=st.data())
    def read_ends(self, data: st.DataObject) -> None:
        segment = data.draw(st.sampled_from(sorted(self.pins)))
        self.idx.unpin(segment)
        self.pins[segment] -= 1
        if not self.pins[segment]:
            del self.pins[segment]

    @rule(key=keys)
    def hold(self, key: int) -> None:
        self.idx.hold([DIGEST[key]])
        self.held[key] = self.held.get(key, 0) + 1

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(sorted(self.held)))
        self.idx.release([DIGEST[key]])
        self.held[key] -= 1
        if not self.held[key]:
            del self.held[key]

    @rule(keys=st.lists(keys, max_size=5))
    def touch(self, keys: list[int]) -> None:
        self.idx.touch([DIGEST[key] for key in keys])

    @rule()
    def checkpoint_written(self) -> None:
        self.checkpoint = self.idx.snapshot(self.idx.checkpoint_segments())

    @invariant()
    def locations_match_the_model(self) -> None:
        assert len(self.idx) == len(self.where)
        for key in KEYS:
            assert self.idx.locate(DIGEST[key]) == self.where.get(key)

    @invariant()
    def a_hard_stop_now_loses_nothing_committed(self) -> None:
        covered = dict(self.checkpoint.segments) if self.checkpoint is not None else {}
        on_disk = [(name, self.records[name]) for name in self.idx.segments]
        scans = {
            name: SegmentScan(
                [
                    (KEYS[key], r)
                    for r, key in sorted(self.disk.get(name, {}).items())
                    if r >= start
                ],
                records,
                0,
            )
            for name, records in on_disk
            if (start := min(covered.get(name, 0), records)) < records or name not in covered
        }
        restored = index(capacity=48, per_segment=6)
        restored.restore(self.checkpoint, on_disk, scans)
        for key, where in self.where.items():
            assert restored.locate(DIGEST[key]) == where, f"key {key} lost by a hard stop"


TestSegmentIndex = SegmentIndexMachine.TestCase
TestSegmentIndex.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_segments_fill_in_order_and_the_first_record_creates_each() -> None:
    idx = index(per_segment=3)
    placed = idx.place(5)
    a, b = segment_name(WRITER, 0), segment_name(WRITER, 1)
    assert placed == [
        Placement(a, 0, True),
        Placement(a, 1, False),
        Placement(a, 2, False),
        Placement(b, 0, True),
        Placement(b, 1, False),
    ]
    assert idx.used_records == 5 and idx.room() == 59


def test_placing_more_than_the_room_is_refused() -> None:
    idx = index(capacity=4, per_segment=2)
    with pytest.raises(InvalidArgumentError, match="do not fit"):
        idx.place(5)


def test_the_oldest_segment_goes_first_and_its_recent_blocks_come_back_to_be_rewritten() -> None:
    idx = index(capacity=12, per_segment=4, hot_fraction=0.5)
    store(idx, [1, 2, 3, 4])
    store(idx, [5, 6, 7, 8])
    idx.touch([2])  # used recently: rewritten rather than dropped
    for d in range(10, 13):
        store(idx, [d])  # ticks move on, so blocks 1, 3, 4 are cold
    fit, evictions = idx.make_room(0)
    assert fit == 0 and evictions == []
    store(idx, [20])  # fills the active segment
    fit, evictions = idx.make_room(4)
    assert fit == 4
    [eviction] = evictions
    assert eviction.segment == segment_name(WRITER, 0)
    assert eviction.dropped == [0, 2, 3] and eviction.reinsert == [(2, 1)]  # records
    assert all(d not in idx for d in (1, 2, 3, 4))


def test_a_pinned_or_held_segment_is_skipped_and_room_can_fall_short() -> None:
    idx = index(capacity=8, per_segment=4, hot_fraction=0)
    store(idx, [1, 2, 3, 4])
    store(idx, [5, 6, 7, 8])
    idx.pin(segment_name(WRITER, 0))
    idx.hold([6])
    fit, evictions = idx.make_room(2)
    assert fit == 0 and evictions == []
    idx.release([6])
    fit, evictions = idx.make_room(2)  # the second segment is the active one: kept
    assert fit == 0 and evictions == []
    idx.unpin(segment_name(WRITER, 0))
    fit, evictions = idx.make_room(2)
    assert fit == 2 and [e.segment for e in evictions] == [segment_name(WRITER, 0)]


def test_a_newer_record_of_a_digest_makes_the_older_one_dead_space() -> None:
    idx = index(per_segment=4)
    store(idx, [1, 2])
    store(idx, [1])
    assert idx.locate(1) == (segment_name(WRITER, 0), 2)
    assert len(idx) == 2 and idx.used_records == 3  # the first record of 1 is dead space


def test_restore_reads_the_checkpoint_then_the_scanned_tails() -> None:
    idx = index(per_segment=4)
    store(idx, [1, 2, 3])
    snapshot = idx.snapshot()
    a, b = segment_name(WRITER, 0), segment_name(WRITER, 1)
    # After the checkpoint: record 3 of a (key k9) and a new segment b were written.
    k9, k10 = b"k" * 9, b"k" * 10
    scans = {a: SegmentScan([(k9, 3)], 4, 0), b: SegmentScan([(k10, 0)], 1, 0)}
    restored = index(per_segment=4)
    assert restored.restore(snapshot, [(a, 4), (b, 1)], scans) == 5
    assert restored.locate(key_digest(k9)) == (a, 3)
    assert restored.locate(key_digest(k10)) == (b, 0)
    assert restored.locate(2) == (a, 1)
    assert restored.place(1) == [Placement(segment_name(WRITER, 2), 0, True)]


def test_restore_drops_entries_of_vanished_segments_and_keeps_the_newest_within_capacity() -> None:
    idx = index(capacity=6, per_segment=2)
    store(idx, [1, 2])
    store(idx, [3, 4])
    store(idx, [5, 6])
    snapshot = idx.snapshot()
    names = [segment_name(WRITER, i) for i in range(3)]
    on_disk = [(names[0], 2), (names[2], 2)]  # segment 1 was deleted since
    restored = index(capacity=2, per_segment=2)  # and the new cap holds one segment
    restored.restore(snapshot, on_disk, {})
    assert [restored.locate(d) for d in (1, 3, 5)] == [None, None, (names[2], 0)]
    assert restored.excess_segments(on_disk) == [names[0]]


def test_the_index_takes_well_under_100_bytes_per_block() -> None:
    capacity = 200_000
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        idx = index(capacity=capacity, per_segment=4096)
        for first in range(0, capacity, 250):  # store jobs of 250 blocks
            for i, placement in enumerate(idx.place(250), first):
                idx.commit(key_digest(i.to_bytes(8, "big")), placement)
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert len(idx) == capacity
    assert held / capacity < 100


def test_a_sparse_segment_is_compacted_before_the_oldest_and_all_its_blocks_come_back() -> None:
    idx = index(capacity=12, per_segment=4, hot_fraction=0, compact_below=0.5)
    store(idx, [1, 2, 3, 4])
    store(idx, [5, 6, 7, 8])
    store(idx, [9])  # the third segment is the one being written
    for digest in (5, 6, 7):  # failed verification: the second segment is 1/4 live
        assert idx.remove(digest)
    fit, [eviction] = idx.make_room(4)
    assert fit == 4 and eviction.segment == segment_name(WRITER, 1)
    assert eviction.dropped == [] and eviction.reinsert == [(8, 3)]
    assert all(d in idx for d in (1, 2, 3, 4))
