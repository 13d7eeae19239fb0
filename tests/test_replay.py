"""Replays: the bookkeeping model and the real engine agree (``tiering.lab.replay``)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tiering.lab
from tests._engine_helpers import block_copies, flip_byte
from tests._scripts import TRACE
from tiering import TieringEngine
from tiering.errors import InvalidArgumentError
from tiering.lab.replay import CacheModel, SegmentLayout, replay, simulate
from tiering.lab.workloads import Request, read_mooncake, synthetic_requests

BLOCK = 1024


def _tree_workload(paths: list[list[int]]) -> list[Request]:
    """Requests whose ids are prefix-chained: a request's i-th id names its first i+1
    choices, so equal ids always mean equal prefixes."""
    ids: dict[tuple[int, ...], int] = {}
    requests = []
    for t, path in enumerate(paths):
        chain = tuple(ids.setdefault(tuple(path[: i + 1]), len(ids)) for i in range(len(path)))
        requests.append(Request(float(t), chain, len(chain) * 512, 0))
    return requests


workloads = st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=6), min_size=1, max_size=40)


@settings(max_examples=60, deadline=None)
@given(paths=workloads, cpu_blocks=st.integers(6, 12))  # room for any request's blocks
def test_with_an_unbounded_tier_every_block_seen_before_is_a_hit(
    paths: list[list[int]], cpu_blocks: int
) -> None:
    requests = _tree_workload(paths)
    model = simulate(requests, cpu_blocks=cpu_blocks, tier_blocks=[None])
    seen: set[int] = set()
    ideal = 0
    for r in requests:
        ideal += sum(1 for i in r.block_ids if i in seen)  # prefix-chained: a seen block's
        seen.update(r.block_ids)  # whole prefix was seen too, so the hits are leading
    assert sum(model.hits.values()) == ideal
    assert model.blocks == sum(len(r.block_ids) for r in requests)


def test_the_model_counts_where_each_hit_comes_from() -> None:
    model = CacheModel(2, tier_blocks=[None])
    a, b, c = (bytes([i]) * 8 for i in range(3))
    assert model.request([a, b]) == 0
    assert model.request([c]) == 0  # evicts a (least recent) from the CPU tier
    assert model.request([a, b]) == 2
    assert model.hits == {"cpu": 1, "tier0": 1}


def _engine_factory(cpu_blocks: int, tiers: list[dict] | None = None):
    return lambda kv: TieringEngine(kv, cpu_blocks, secondary_tiers=tiers or [])


async def test_the_engine_hits_what_the_model_promised_cpu_only() -> None:
    requests = synthetic_requests(sessions=60, seed=1)
    model = simulate(requests, cpu_blocks=40)
    summary = await replay(requests, _engine_factory(40), device_blocks=64, block_bytes=BLOCK)
    assert summary.mismatches == 0 and summary.failed_loads == 0
    assert summary.hit_blocks == sum(model.hits.values()) > 0
    assert summary.hits_by_tier == {"cpu": model.hits["cpu"]}


async def test_the_engine_hits_what_the_model_promised_with_a_memory_tier() -> None:
    requests = synthetic_requests(sessions=60, seed=2)
    model = simulate(requests, cpu_blocks=30, tier_blocks=[None])
    tiers = [{"type": "memory", "max_blocks": 10_000}]
    make = _engine_factory(30, tiers)
    summary = await replay(requests, make, device_blocks=64, block_bytes=BLOCK, settle=True)
    assert summary.mismatches == 0
    assert summary.hits_by_tier == {"cpu": model.hits["cpu"], "memory": model.hits["tier0"]}
    assert summary.hits_by_tier["memory"] > 0  # the tier served some
    paths = summary.bytes_by_path
    assert paths["device->cpu"] == paths["cpu->memory"]  # write-through: all of it
    assert paths["memory->cpu"] == model.hits["tier0"] * BLOCK


@pytest.mark.parametrize(
    "tier",
    [
        {"type": "memory", "max_blocks": 60},
        {"type": "nvme", "capacity_bytes": 1 << 20, "segment_bytes": 128 << 10},
    ],
    ids=["memory", "nvme-segments"],
)
async def test_the_engine_hits_what_the_model_promised_while_its_tier_evicts(
    tmp_path: Path, tier: dict
) -> None:
    requests = synthetic_requests(sessions=60, seed=7)
    if tier["type"] == "nvme":
        tier = {**tier, "root": str(tmp_path), "min_free_bytes": 0}
    make = _engine_factory(40, [tier])
    summary = await replay(requests, make, device_blocks=64, block_bytes=4096, settle=True)
    assert summary.tier_counters[tier["type"]]["evicted_blocks"] > 0
    layouts = list(summary.tier_layouts.values())  # the tier's real capacity and layout
    model = simulate(requests, cpu_blocks=40, tier_blocks=layouts)
    assert summary.hits_by_tier == {"cpu": model.hits["cpu"], tier["type"]: model.hits["tier0"]}
    assert model.hits["tier0"] > 0


@pytest.mark.parametrize(
    ("field", "value"),
    [("capacity_records", 0), ("records_per_segment", -1), ("moves_per_job", 1.5),
     ("hot_fraction", 1.5)],
)  # fmt: skip
def test_a_segment_layout_refuses_a_bad_value_naming_it(field: str, value: object) -> None:
    good = {"capacity_records": 64, "records_per_segment": 8, "hot_fraction": 0.25}
    with pytest.raises(InvalidArgumentError, match=field):
        SegmentLayout(**{**good, "moves_per_job": 16, field: value})  # type: ignore[arg-type]


async def test_the_model_sends_each_tenants_requests_under_the_tenants_keys() -> None:
    requests = synthetic_requests(sessions=60, seed=7)
    make = lambda kv: TieringEngine(kv, 40, policy="adaptive")  # noqa: E731
    summary = await replay(requests, make, device_blocks=64, block_bytes=BLOCK, tenants=2)
    # Adaptive samples keys for its shadow caches: only the tenants' real keys agree.
    model = simulate(requests, cpu_blocks=40, policy="adaptive", tenants=2)
    assert summary.hit_blocks == sum(model.hits.values()) > 0


async def test_the_shared_trace_through_cpu_and_nvme_matches_the_model(tmp_path: Path) -> None:
    requests = read_mooncake(TRACE, limit=600)
    model = simulate(requests, cpu_blocks=300, tier_blocks=[None])
    tiers = [{"type": "nvme", "root": str(tmp_path), "capacity_bytes": 1 << 30}]
    make = _engine_factory(300, tiers)
    summary = await replay(requests, make, device_blocks=400, block_bytes=4096, settle=True)
    assert summary.mismatches == 0
    assert summary.hits_by_tier == {"cpu": model.hits["cpu"], "nvme": model.hits["tier0"]}
    assert summary.to_json()["hit_ratio"] == round(model.hit_ratio, 4)


async def test_blocks_a_full_tier_refused_are_counted_apart_from_failed_ones() -> None:
    # Write-back: the close writes the CPU tier's blocks to the memory tier in jobs of 64
    # new blocks, more than its 20 hold; it stores what fits and refuses the rest.
    requests = synthetic_requests(sessions=20, seed=3)
    tiers = [{"type": "memory", "max_blocks": 20}]

    def make(kv: torch.Tensor) -> TieringEngine:
        return TieringEngine(kv, 200, secondary_tiers=tiers, write_policy="write_back")

    summary = await replay(requests, make, device_blocks=64, block_bytes=BLOCK)
    refused = summary.refused_blocks_by_tier["memory"]
    assert refused >= 64 - 20
    assert refused == summary.tier_failures["memory"]["no room"]  # the tier's own count
    assert summary.tier_failures["cpu"]["memory tier store failed"] >= refused  # the engine's
    assert summary.failed_blocks_by_tier == {"memory": {"load": 0, "store": 0}}
    assert summary.failure_causes == {} and summary.failed_stores == 0
    assert summary.to_json()["refused_blocks_by_tier"] == {"memory": refused}


async def test_what_failed_is_counted_by_the_cause_its_tier_gives(tmp_path: Path) -> None:
    requests = synthetic_requests(sessions=20, seed=3)
    tiers = [{"type": "nvme", "root": str(tmp_path), "capacity_bytes": 1 << 30,
              "min_free_bytes": 0}]  # fmt: skip
    make = _engine_factory(200, tiers)
    first = await replay(requests, make, device_blocks=64, block_bytes=BLOCK)
    assert first.failure_causes == {} and first.failed_loads == 0
    for path, offset, length in [c for copies in block_copies(tmp_path).values() for c in copies]:
        flip_byte(path, offset + length - 1)  # every block the first replay left
    summary = await replay(requests, make, device_blocks=64, block_bytes=BLOCK)
    failed = summary.failed_blocks_by_tier["nvme"]["load"]
    assert failed > 0 and summary.failed_loads > 0 and summary.mismatches == 0
    assert summary.failure_causes == {"corrupt block": failed}
    assert summary.refused_blocks_by_tier == {"nvme": 0}


async def test_wrong_bytes_in_a_tier_are_counted_as_mismatches() -> None:
    requests = [Request(0.0, (1, 2), 1024, 0), Request(1.0, (1, 2), 1024, 0)]
    engines: list[TieringEngine] = []

    def make(kv: torch.Tensor) -> TieringEngine:
        engines.append(TieringEngine(kv, 8))
        return engines[-1]

    def corrupt(done: int, _summary: object) -> None:
        if done == 1:  # after the first request stored both blocks
            engine = engines[0]
            slot = engine.manager.slot_of((2).to_bytes(8, "big"))
            engine.host_pool.view[slot * BLOCK] ^= 0xFF

    summary = await replay(requests, make, device_blocks=4, block_bytes=BLOCK, on_request=corrupt)
    assert summary.hit_blocks == 2 and summary.mismatches == 1


async def test_a_request_longer_than_the_device_cache_is_refused_before_starting() -> None:
    requests = [Request(0.0, tuple(range(10)), 10 * 512, 0)]
    started: list[object] = []
    with pytest.raises(InvalidArgumentError, match=r"device_blocks \(4\).*give at least 10"):
        await replay(requests, started.append, device_blocks=4, block_bytes=BLOCK)  # type: ignore[arg-type]
    assert started == []


@pytest.mark.parametrize("size", [1000, 64, 8])
async def test_blocks_of_any_size_are_computed_and_checked(size: int) -> None:
    requests = synthetic_requests(sessions=10, seed=3)
    summary = await replay(requests, _engine_factory(200), device_blocks=64, block_bytes=size)
    assert summary.hit_blocks > 0 and summary.mismatches == 0


def test_lru_at_10000_blocks_on_the_shared_trace_hits_0_4239() -> None:
    model = simulate(read_mooncake(TRACE), cpu_blocks=10_000, policy="lru")
    assert round(model.hit_ratio, 4) == 0.4239


async def test_the_engine_replays_the_shared_trace_at_lru_10000_to_0_4239() -> None:
    requests = read_mooncake(TRACE)
    make = lambda kv: TieringEngine(kv, 10_000, policy="lru")  # noqa: E731
    summary = await replay(requests, make, device_blocks=400, block_bytes=512)
    assert summary.mismatches == 0 and summary.failed_loads == summary.failed_stores == 0
    assert round(summary.hit_ratio, 4) == 0.4239  # the bookkeeping's figure: no hit lost


def test_no_module_of_the_lab_imports_backends() -> None:
    """The replay builds the NVMe tier's model by the tier's name (the registry's lazy
    table): tiering.lab imports no backends module, at import time or inside a function."""
    for path in Path(tiering.lab.__file__).parent.glob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        modules = [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
        modules += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        assert [m for m in modules if m.split(".")[0] == "backends"] == [], path.name
