"""kv_layout: the device KV cache's layout, id checks and copy planning (all pure)."""

from __future__ import annotations

import pytest
import torch
from _device_kv import LAYOUTS, block_bytes_of, device_block, layers_of, make_kv
from hypothesis import given
from hypothesis import strategies as st

from tiering.device.kv_layout import (
    CopyChunk,
    SlotRun,
    describe_kv_caches,
    kv_block_bytes,
    plan_copy,
)
from tiering.errors import InvalidArgumentError
from tiering.validation import as_index_list, check_index_range

# --------------------------------------------------------------------------- plan_copy


def test_plan_orders_pairs_by_slot_and_merges_consecutive_slots() -> None:
    plan = plan_copy([10, 11, 12, 13, 14], [5, 3, 4, 9, 6], max_rows=8)
    assert plan == (
        CopyChunk(
            device_ids=(11, 12, 10, 14, 13),
            runs=(SlotRun(first_slot=3, first_row=0, length=4), SlotRun(9, 4, 1)),
        ),
    )


def test_plan_cuts_chunks_of_at_most_max_rows_and_splits_runs_at_the_cut() -> None:
    plan = plan_copy([0, 1, 2, 3, 4], [20, 21, 22, 23, 24], max_rows=2)
    assert [c.device_ids for c in plan] == [(0, 1), (2, 3), (4,)]
    assert [c.runs for c in plan] == [
        (SlotRun(20, 0, 2),),
        (SlotRun(22, 0, 2),),
        (SlotRun(24, 0, 1),),
    ]


def test_plan_keeps_repeated_slots_in_separate_runs() -> None:
    plan = plan_copy([7, 8, 9], [4, 4, 5], max_rows=10)
    assert plan[0].runs == (SlotRun(4, 0, 1), SlotRun(4, 1, 2))


def test_plan_of_one_pair_is_one_run() -> None:
    assert plan_copy([6], [2], max_rows=1) == (CopyChunk((6,), (SlotRun(2, 0, 1),)),)


def test_plan_of_nothing_is_empty() -> None:
    assert plan_copy([], [], max_rows=3) == ()


def test_plan_rejects_unequal_lengths_and_zero_rows() -> None:
    with pytest.raises(InvalidArgumentError, match="2 device block ids but 1 slots"):
        plan_copy([1, 2], [1], max_rows=4)
    with pytest.raises(InvalidArgumentError, match="max_rows must be at least 1, got 0"):
        plan_copy([1], [1], max_rows=0)


@given(
    pairs=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 30)), max_size=40),
    max_rows=st.integers(1, 12),
)
def test_plan_covers_every_pair_once_with_ascending_slot_runs(
    pairs: list[tuple[int, int]], max_rows: int
) -> None:
    ids, slots = [p[0] for p in pairs], [p[1] for p in pairs]
    plan = plan_copy(ids, slots, max_rows)
    planned: list[tuple[int, int]] = []
    for chunk in plan:
        assert 1 <= len(chunk.device_ids) <= max_rows
        row = 0
        for run in chunk.runs:
            assert run.first_row == row and run.length >= 1
            for k in range(run.length):
                planned.append((chunk.device_ids[row + k], run.first_slot + k))
            row += run.length
        assert row == len(chunk.device_ids)
    assert sorted(planned) == sorted(pairs)
    assert [s for _, s in planned] == sorted(slots)


@given(slots=st.sets(st.integers(0, 60), max_size=30))
def test_plan_uses_one_run_per_maximal_range_of_distinct_slots(slots: set[int]) -> None:
    ordered = sorted(slots)
    expected = sum(1 for i, s in enumerate(ordered) if i == 0 or ordered[i - 1] != s - 1)
    shuffled = ordered[1::2] + ordered[0::2]
    plan = plan_copy(list(range(len(shuffled))), shuffled, max_rows=len(shuffled) or 1)
    assert sum(len(c.runs) for c in plan) == expected


# --------------------------------------------------------------------------- layout


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_kv_block_bytes_is_the_sum_of_row_bytes(layout: str) -> None:
    kv = make_kv(layout, "cpu")
    assert kv_block_bytes(kv) == len(device_block(kv, 0)) == block_bytes_of(kv)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_columns_tile_a_block_and_alias_the_cache(layout: str) -> None:
    kv = make_kv(layout, "cpu")
    described = describe_kv_caches(kv)
    assert described.num_blocks == 12 and described.device == torch.device("cpu")
    end = 0
    for (layer, offset, width), tensor in zip(described.columns, layers_of(kv), strict=True):
        assert offset == end and layer.shape == (12, width)
        assert layer.dtype == described.word
        assert layer.data_ptr() == tensor.data_ptr()  # a view, not a copy
        end += width
    assert end == described.block_words == described.block_bytes // described.word_bytes


def test_layout_uses_the_widest_word_every_row_allows() -> None:
    assert describe_kv_caches(torch.zeros(4, 6, dtype=torch.float32)).word_bytes == 8
    assert describe_kv_caches([torch.zeros(4, 2), torch.zeros(4, 3)]).word_bytes == 4
    assert describe_kv_caches([torch.zeros(4, 3, dtype=torch.uint8)]).word_bytes == 1


@pytest.mark.parametrize(
    ("kv", "message"),
    [
        ([], "kv_caches is empty"),
        ([torch.zeros(4, 8), torch.zeros(5, 8)], r"kv_caches\[1\] has 5 blocks"),
        ([torch.zeros(4, 8).t()], r"kv_caches\[0\] is not contiguous"),
        (torch.zeros(()), "block dim"),
        ([torch.zeros(4, 0)], "empty rows"),
        ([torch.zeros(0, 4)], "no blocks"),
        ([torch.zeros(4, 8), "x"], r"kv_caches\[1\] must be a tensor"),
        ("kv", "tensor or a sequence of tensors, got str"),
    ],
)
def test_malformed_kv_caches_are_rejected(kv: object, message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        describe_kv_caches(kv)
    with pytest.raises(InvalidArgumentError, match=message):
        kv_block_bytes(kv)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- id checks


def test_as_index_list_takes_int_likes_and_names_the_bad_value() -> None:
    assert as_index_list("ids", torch.tensor([1, 2])) == [1, 2]
    assert as_index_list("ids", range(3)) == [0, 1, 2]
    for bad, message in (
        ([1.0], "ids must hold ints, got 1.0"),
        ([True], "ids must hold ints, got True"),
        (["1"], "ids must hold ints, got '1'"),
        (5, "ids must be a sequence of ints, got 5"),
        ("12", "ids must be a sequence of ints, got '12'"),
    ):
        with pytest.raises(InvalidArgumentError, match=message):
            as_index_list("ids", bad)


def test_check_index_range_names_the_first_bad_value() -> None:
    check_index_range("slots", [0, 9, 9], 10, unique=False)
    with pytest.raises(InvalidArgumentError, match=r"slots: 10 is outside 0\.\.9"):
        check_index_range("slots", [0, 10], 10, unique=False)
    with pytest.raises(InvalidArgumentError, match="slots: -1 is outside"):
        check_index_range("slots", [-1], 10, unique=False)
    with pytest.raises(InvalidArgumentError, match="slots: 9 appears twice"):
        check_index_range("slots", [0, 9, 9], 10, unique=True)
