"""Capacity sweeps and their plot (``tiering.lab.sweep``)."""

from __future__ import annotations

import pytest

from tiering.errors import InvalidArgumentError
from tiering.lab.replay import simulate
from tiering.lab.sweep import capacities_from, footprint, plot_sweep, sweep
from tiering.lab.workloads import Request, synthetic_requests


def test_a_sweep_replays_every_capacity_with_every_policy() -> None:
    requests = synthetic_requests(sessions=40, seed=5)
    result = sweep(requests, [200, 50], ["lru", "arc"])
    assert [(p.capacity_blocks, p.policy) for p in result.points] == [
        (50, "lru"),
        (50, "arc"),
        (200, "lru"),
        (200, "arc"),
    ]
    for point in result.points:
        expected = simulate(requests, cpu_blocks=point.capacity_blocks, policy=point.policy)
        assert point.hit_ratio == expected.hit_ratio
        assert point.capacity_fraction == point.capacity_blocks / result.footprint_blocks
    lru = [p.hit_ratio for p in result.points if p.policy == "lru"]
    assert lru[0] <= lru[1]  # more room, no fewer hits (LRU is a stack policy)
    table = result.table()
    assert "lru" in table and "arc" in table and f"{lru[1]:.4f}" in table
    assert result.to_json()["points"][0]["capacity_blocks"] == 50


def test_footprint_counts_distinct_blocks_and_full_blocks_only_drops_partials() -> None:
    requests = [Request(0, (1, 2, 3), 2 * 512 + 7, 0), Request(1, (1, 2, 4), 3 * 512, 0)]
    assert footprint(requests) == 4
    assert footprint(requests, full_blocks_only=True) == 3  # 3 was partial


def test_capacities_take_blocks_and_percentages_of_the_footprint() -> None:
    assert capacities_from("5%,1000,50%,5%", 10_000) == [500, 1000, 5000]
    assert capacities_from("0.001%", 100) == [1]  # at least one block
    for bad in ("0", "-5", "x", "0%", "101%", "5%,"):
        with pytest.raises(InvalidArgumentError, match="capacities"):
            capacities_from(bad, 100)


def test_a_sweep_refuses_an_empty_workload_or_capacity_list() -> None:
    with pytest.raises(InvalidArgumentError, match="requests"):
        sweep([], [10])
    with pytest.raises(InvalidArgumentError, match="capacities"):
        sweep(synthetic_requests(sessions=2), [])


def test_the_plot_is_a_png(tmp_path) -> None:
    pytest.importorskip("matplotlib", reason="pip install 'kv-tiering[plot]'")
    result = sweep(synthetic_requests(sessions=20), [10, 40, 160], ["lru", "s3fifo"])
    path = plot_sweep(result, tmp_path / "sweep.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(InvalidArgumentError, match="cannot write"):
        plot_sweep(result, tmp_path / "no" / "such" / "dir.png")
