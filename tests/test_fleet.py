"""A fleet of engines behind a router, sharing a Redis tier (``tiering.lab.fleet``)."""

from __future__ import annotations

import json

import pytest
import torch

from tests._redis_servers import LocalRedisServer
from tiering import TieringEngine
from tiering.cli import main
from tiering.core.scheduler_api import OffloadingEvent
from tiering.errors import InvalidArgumentError
from tiering.lab.fleet import ROUTERS, NodeOutage, Router, replay_fleet
from tiering.lab.workloads import synthetic_requests
from tiering.observe.events import encode_events


def _keys(*ids: int) -> list[bytes]:
    return [i.to_bytes(8, "big") for i in ids]


def _events(medium: str, ids: list[int], removed: bool = False) -> bytes:
    return encode_events([OffloadingEvent(_keys(*ids), 16, medium, removed)])


def test_round_robin_takes_the_nodes_in_turn() -> None:
    router = Router("round-robin", 3)
    assert [router.choose(_keys(1)) for _ in range(5)] == [0, 1, 2, 0, 1]


def test_affinity_keeps_a_first_block_on_one_node() -> None:
    router = Router("affinity", 4)
    assert len({router.choose(_keys(7, i)) for i in range(20)}) == 1


def test_least_loaded_picks_the_node_that_computed_least() -> None:
    router = Router("least-loaded", 3)
    router.served(0, blocks=10, hits=0)
    router.served(1, blocks=10, hits=8)
    router.served(2, blocks=5, hits=0)
    assert router.choose(_keys(1)) == 1  # computed 2 blocks


def test_kv_aware_follows_the_events_of_each_node_s_own_tiers() -> None:
    router = Router("kv-aware", 3)
    router.observe(1, _events("CPU", [1, 2]))
    router.observe(2, _events("NVME", [1, 2, 3]))
    router.observe(0, _events("REDIS", [1, 2, 3, 4]))  # shared: says nothing of node 0
    assert router.choose(_keys(1, 2, 3, 4)) == 2
    router.observe(2, _events("NVME", [2], removed=True))
    assert router.choose(_keys(1, 2, 3, 4)) == 1  # node 2 now holds only block 1
    with pytest.raises(InvalidArgumentError, match="router"):
        Router("random", 2)


def _factory(cpu_blocks: int, tiers: list[dict] | None = None, events: bool = True):
    def make(node: int, kv: torch.Tensor) -> TieringEngine:
        return TieringEngine(
            kv, cpu_blocks, secondary_tiers=tiers or [], cache_identity="fleet",
            enable_events=events,
        )  # fmt: skip

    return make


@pytest.mark.parametrize("router", ["round-robin", "affinity", "least-loaded", "kv-aware"])
async def test_every_router_serves_every_request_with_no_wrong_byte(router: str) -> None:
    requests = synthetic_requests(sessions=20, seed=4)
    summary = await replay_fleet(
        requests, _factory(60), nodes=3, router=router, device_blocks=64, block_bytes=512
    )
    figures = summary.to_json()
    assert figures["mismatches"] == 0 and sum(figures["requests_by_node"]) == len(requests)
    assert figures["hit_ratio"] > 0


async def test_kv_aware_routing_needs_engines_that_publish_events() -> None:
    with pytest.raises(InvalidArgumentError, match="enable_events"):
        await replay_fleet(
            synthetic_requests(sessions=2), _factory(60, events=False), nodes=2,
            router="kv-aware", device_blocks=64, block_bytes=512,
        )  # fmt: skip


async def test_a_block_one_node_computed_is_a_shared_hit_on_another(
    redis_server: LocalRedisServer,
) -> None:
    requests = synthetic_requests(sessions=30, seed=5)
    tiers = [{"type": "redis", "url": redis_server.url}]
    summary = await replay_fleet(
        requests, _factory(40, tiers), nodes=3, router="round-robin", device_blocks=64,
        block_bytes=512,
    )  # fmt: skip
    figures = summary.to_json()
    assert figures["mismatches"] == 0
    assert figures["hit_ratio_by_source"]["redis"] > 0  # served from the fleet's tier
    alone = await replay_fleet(
        requests, _factory(40), nodes=3, router="round-robin", device_blocks=64, block_bytes=512
    )
    assert summary.hit_ratio > alone.hit_ratio


def test_the_command_reports_the_shared_tier_against_none(
    redis_server: LocalRedisServer, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["replay", "--limit", "150", "--cpu", "60", "--block-bytes", "1K", "--nodes", "3"]
    argv += ["--router", "kv-aware", "--transport", "zmq"]
    assert main([*argv, "--redis", redis_server.url, "--json"]) == 0
    figures = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    shared, baseline = figures["shared"], figures["baseline"]
    assert shared["mismatches"] == baseline["mismatches"] == 0
    assert "redis" not in baseline["hit_ratio_by_source"]
    redis_ops = shared["shared_tier_counters"]["redis"]
    assert redis_ops["stored_blocks"] > 0 and redis_ops["lookup_round_trips"] > 0
    assert shared["bytes_by_path"]["cpu->redis"] == redis_ops["stored_blocks"] * 1024
    assert baseline["own_capacity_blocks"] == 3 * 60 and baseline["footprint_blocks"] > 0
    assert shared["job_latency_ms"]["load"]["count"] > 0
    assert figures["gain"] == round(shared["hit_ratio"] / baseline["hit_ratio"], 3) > 1


def test_bench_fleet_runs_every_router_and_ends_with_json(redis_server: LocalRedisServer) -> None:
    from tests._scripts import last_json, run_script

    done = run_script(
        "examples/bench_fleet.py", "--url", redis_server.url, "--limit", "60", "--nodes", "2"
    )
    result = last_json(done)
    assert [run["router"] for run in result["runs"]] == list(ROUTERS)
    assert all(run["mismatches"] == 0 and run["shared_hit_ratio"] > 0 for run in result["runs"])


def test_a_down_node_gets_no_request_under_any_rule() -> None:
    for rule in ("round-robin", "affinity", "least-loaded", "kv-aware"):
        router = Router(rule, 3)
        assert {router.choose(_keys(i), down={1}) for i in range(30)} <= {0, 2}
        with pytest.raises(InvalidArgumentError, match="down"):
            router.choose(_keys(1), down={0, 1, 2})


async def test_a_node_killed_and_restarted_leaves_the_others_serving_every_byte(
    tmp_path,
) -> None:
    requests = synthetic_requests(sessions=40, seed=6)
    tiers = [{"type": "nvme", "root": str(tmp_path / "nvme"), "capacity_bytes": 1 << 24}]

    def make(node: int, kv: torch.Tensor) -> TieringEngine:
        root = {**tiers[0], "root": str(tmp_path / f"nvme-{node}")}
        return TieringEngine(kv, 40, secondary_tiers=[root], enable_events=True)

    served: list[list[int]] = []
    summary = await replay_fleet(
        requests, make, nodes=3, router="least-loaded", device_blocks=64, block_bytes=512,
        outages=[NodeOutage(node=1, at=40, requests=30)], window=10,
        on_request=lambda done, s: served.append(list(s.routed)),
    )  # fmt: skip
    figures = summary.to_json()
    assert figures["mismatches"] == 0 and figures["requests"] == len(requests)
    assert served[69][1] == served[39][1]  # nothing went to node 1 while it was down
    assert served[-1][1] > served[69][1]  # and it served again once restarted
    assert figures["restarts"] == 1 and len(figures["timeline"]) == -(-len(requests) // 10)


async def test_redis_restarted_mid_replay_dips_and_recovers_with_no_wrong_byte(
    redis_server: LocalRedisServer,
) -> None:
    requests = synthetic_requests(sessions=60, seed=7)
    tiers = [{"type": "redis", "url": redis_server.url, "timeout_s": 0.5,
              "breaker_failures": 1, "breaker_backoff_s": 0.05}]  # fmt: skip

    def restart(done: int, _summary: object) -> None:
        if done == 60:
            redis_server.kill()
        elif done == 90:
            redis_server.start()  # empty: it kept nothing

    summary = await replay_fleet(
        requests, _factory(40, tiers), nodes=3, router="round-robin", device_blocks=64,
        block_bytes=512, window=30, on_request=restart,
    )  # fmt: skip
    figures = summary.to_json()
    assert figures["mismatches"] == 0 and figures["requests"] == len(requests)
    timeline = [point["hit_ratio"] for point in figures["timeline"]]
    assert timeline[2] < timeline[1]  # requests 60-90: Redis is gone
    assert max(timeline[4:]) > timeline[2]  # it came back, and so did the shared hits


async def test_kv_aware_routing_over_zeromq_decides_as_it_does_in_process() -> None:
    pytest.importorskip("zmq", reason="pip install 'kv-tiering[events]'")
    requests = synthetic_requests(sessions=25, seed=8)
    runs = {}
    for transport in ("direct", "zmq"):
        summary = await replay_fleet(
            requests, _factory(60), nodes=3, router="kv-aware", device_blocks=64,
            block_bytes=512, transport=transport,
        )  # fmt: skip
        runs[transport] = summary.to_json()
    assert runs["zmq"]["lost_event_batches"] == 0
    assert runs["zmq"]["requests_by_node"] == runs["direct"]["requests_by_node"]
    assert runs["zmq"]["hit_ratio"] == runs["direct"]["hit_ratio"] > 0
    assert runs["zmq"]["mismatches"] == 0
