"""Workloads (``tiering.lab.workloads``): the Mooncake trace reader, synthetic chat traffic."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from tests._scripts import TRACE
from tiering.errors import InvalidArgumentError
from tiering.lab.workloads import (
    TOKENS_PER_BLOCK,
    Request,
    TraceError,
    read_mooncake,
    synthetic_requests,
)


def _line(**fields: object) -> str:
    record = {"timestamp": 0, "input_length": 600, "output_length": 10, "hash_ids": [1, 2]}
    record.update(fields)
    return json.dumps(record)


def test_a_trace_reads_in_file_order_skipping_blank_lines(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text(_line(timestamp=1500, hash_ids=[7, 8]) + "\n\n" + _line(timestamp=2000) + "\n")
    first, second = read_mooncake(trace)
    assert first == Request(1.5, (7, 8), 600, 10)
    assert second.arrival_s == 2.0 and second.block_ids == (1, 2)
    assert read_mooncake(trace, limit=1) == [first]


@pytest.mark.parametrize(
    ("line", "why"),
    [
        ("not json", "Expecting value"),
        ("[1, 2]", "the line: Input should be a valid dictionary"),
        (
            json.dumps({"timestamp": 0}),
            "input_length: missing; output_length: missing; hash_ids: missing",
        ),
        (_line(timestamp=-1), "timestamp: Input should be greater than or equal to 0, got -1"),
        (_line(timestamp="now"), "timestamp: Input should be a valid number, got 'now'"),
        (_line(timestamp=float("inf")), "timestamp: Input should be a finite number"),
        (_line(input_length=1.5), "input_length: Input should be a valid integer, got 1.5"),
        (_line(output_length=True), "output_length: Input should be a valid integer, got True"),
        (_line(hash_ids=5), "hash_ids: Input should be a valid list"),
        (_line(hash_ids=[1, "x"]), "hash_ids\\[1\\]: Input should be a valid integer, got 'x'"),
        (_line(hash_ids=[1 << 64]), "hash_ids\\[0\\]: Input should be less than or equal to 1844"),
    ],
)
def test_a_malformed_line_is_named_by_number(tmp_path: Path, line: str, why: str) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text(_line() + "\n" + line + "\n")
    with pytest.raises(TraceError, match=rf"t\.jsonl:2: not a Mooncake trace line: .*{why}"):
        read_mooncake(trace)


def test_a_line_that_is_not_json_is_named_by_the_files_line_alone(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text(_line() + "\n\n" + '{"timestamp": 0,' + "\n")
    with pytest.raises(TraceError) as caught:
        read_mooncake(trace)
    assert str(caught.value) == (
        f"{trace}:3: not a Mooncake trace line: not JSON: Expecting property name enclosed "
        "in double quotes at column 17"
    )


def test_a_missing_or_empty_trace_is_a_trace_error(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="cannot read"):
        read_mooncake(tmp_path / "absent.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(TraceError, match="holds no requests"):
        read_mooncake(tmp_path / "empty.jsonl")
    with pytest.raises(InvalidArgumentError, match="limit"):
        read_mooncake(tmp_path / "empty.jsonl", limit=0)


def test_keys_are_8_byte_ids_and_full_blocks_only_drops_a_partial_last_block() -> None:
    partial = Request(0.0, (1, 2, 3), 2 * TOKENS_PER_BLOCK + 1, 0)
    assert partial.keys() == [i.to_bytes(8, "big") for i in (1, 2, 3)]
    assert partial.keys(full_blocks_only=True) == partial.keys()[:2]
    whole = Request(0.0, (1, 2), 2 * TOKENS_PER_BLOCK, 0)
    assert whole.keys(full_blocks_only=True) == whole.keys()


def test_synthetic_traffic_is_the_same_for_a_seed_and_ordered_by_arrival() -> None:
    once, again = synthetic_requests(sessions=20, seed=3), synthetic_requests(sessions=20, seed=3)
    assert once == again
    assert once != synthetic_requests(sessions=20, seed=4)
    assert [r.arrival_s for r in once] == sorted(r.arrival_s for r in once)
    assert len(once) == 20 * 4


def test_synthetic_sessions_share_system_prompts_and_their_own_history() -> None:
    requests = synthetic_requests(sessions=50, system_prompts=2, system_prompt_blocks=3)
    heads = {r.block_ids[:3] for r in requests}
    assert len(heads) == 2  # every prompt starts with one of the two system prompts
    by_session: dict[int | None, list[Request]] = {}
    for r in requests:
        by_session.setdefault(r.session, []).append(r)
    for turns in by_session.values():
        for earlier, later in itertools.pairwise(turns):
            full = earlier.block_ids[: earlier.full_blocks]
            assert later.block_ids[: len(full)] == full  # the conversation so far
    partials = [r.block_ids[-1] for r in requests]
    every_id = [i for r in requests for i in r.block_ids]
    assert all(every_id.count(p) == 1 for p in partials)  # nobody repeats a partial block


@pytest.mark.parametrize(
    ("argument", "value"),
    [
        ("sessions", 0),
        ("turns_per_session", -1),
        ("system_prompts", 1.5),
        ("user_blocks_per_turn", -1),
        ("rate_per_s", 0),
        ("think_time_s", float("nan")),
        ("seed", "x"),
    ],
)
def test_a_bad_synthetic_argument_is_named(argument: str, value: object) -> None:
    with pytest.raises(InvalidArgumentError, match=argument):
        synthetic_requests(**{argument: value})  # type: ignore[arg-type]


def test_the_shared_trace_reads_whole() -> None:
    requests = read_mooncake(TRACE)
    assert len(requests) == 3993
    assert sum(len(r.block_ids) for r in requests) == 121_877
    assert len({i for r in requests for i in r.block_ids}) == 43_924
