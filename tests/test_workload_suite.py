"""The generated workload families and the policy suite (``tiering.lab.workload_suite``)."""

from __future__ import annotations

import pytest

from tiering.errors import InvalidArgumentError, TraceError
from tiering.lab.replay import simulate
from tiering.lab.sweep import footprint
from tiering.lab.workload_suite import FAMILIES, WORKLOADS, generate, run_suite
from tiering.lab.workloads import TOKENS_PER_BLOCK


@pytest.mark.parametrize("name", list(FAMILIES))
def test_a_family_is_seeded_ordered_and_prefix_chained(name: str) -> None:
    requests = generate(name, seed=3)
    assert requests == generate(name, seed=3)
    assert requests != generate(name, seed=4)
    assert [r.arrival_s for r in requests] == sorted(r.arrival_s for r in requests)
    parent_of: dict[int, int | None] = {}
    for r in requests:
        # One parent per id: equal ids mean equal prefixes, as in the Mooncake traces.
        for parent, block in zip((None, *r.block_ids), r.block_ids, strict=False):
            assert parent_of.setdefault(block, parent) == parent
        # Every prompt ends with a partial block of its own.
        assert r.full_blocks == len(r.block_ids) - 1
        assert 0 < r.input_tokens - r.full_blocks * TOKENS_PER_BLOCK < TOKENS_PER_BLOCK


def test_each_family_has_reuse_and_first_sightings() -> None:
    """Each family has blocks asked for again and blocks no cache can hit (first seen)."""
    for name in FAMILIES:
        requests = generate(name)
        seen: set[int] = set()
        reused = 0
        for r in requests:
            reused += sum(1 for b in r.block_ids if b in seen)
            seen.update(r.block_ids)
        total = sum(len(r.block_ids) for r in requests)
        assert 0.1 < reused / total < 0.95, name


def test_every_family_is_a_workload_the_config_accepts() -> None:
    assert ("synthetic", *FAMILIES) == WORKLOADS


def test_an_unknown_workload_is_refused_before_any_replay() -> None:
    with pytest.raises(InvalidArgumentError, match="workload must be one of"):
        generate("nope")
    with pytest.raises(TraceError, match="cannot read the trace 'nope'"):
        run_suite(["chat", "nope"], ["lru"])


def test_the_suite_reports_each_policy_against_the_better_of_lru_and_arc() -> None:
    result = run_suite(["scan"], ["s3fifo"], fractions=(0.02,), modes=(True,))
    assert result.policies == ("s3fifo", "lru", "arc")
    (point,) = result.points
    requests = generate("scan")
    blocks = round(footprint(requests, full_blocks_only=True) * 0.02)
    assert point.capacity_blocks == blocks
    for policy in result.policies:
        model = simulate(requests, cpu_blocks=blocks, policy=policy, full_blocks_only=True)
        assert point.hit_ratios[policy] == model.hit_ratio
    best = max(point.hit_ratios["lru"], point.hit_ratios["arc"])
    assert point.ratio("s3fifo") == point.hit_ratios["s3fifo"] / best
    assert max(point.ratio("lru"), point.ratio("arc")) == 1.0
    assert result.worst("s3fifo") == point.ratio("s3fifo")
    assert result.to_json()["worst_ratio"]["s3fifo"] == round(point.ratio("s3fifo"), 4)
    assert "scan full" in result.table()


def test_the_suite_gives_the_same_points_on_two_processes() -> None:
    args = (["shift", "synthetic"], ["lru", "arc"])
    kwargs = {"fractions": (0.01, 0.1), "modes": (False,)}
    assert run_suite(*args, **kwargs, jobs=2) == run_suite(*args, **kwargs, jobs=1)
