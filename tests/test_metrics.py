"""Prometheus metrics of a real engine, scraped over HTTP and parsed: exact figures."""

from __future__ import annotations

import asyncio
import urllib.request
from collections.abc import Mapping

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tiering import TieringEngine
from tiering.errors import InvalidArgumentError
from tiering.observe.loop_lag import LoopLagMonitor
from tiering.observe.metrics import (
    EngineCollector,
    register_engine_metrics,
    serve_engine_metrics,
    serve_metrics,
)

BLOCK_BYTES = 4 * 64 * 2  # one row of torch.randn(16, 4, 64).half()
Samples = Mapping[tuple[str, frozenset[tuple[str, str]]], float]


def key(i: int) -> bytes:
    return b"metrics:" + i.to_bytes(4, "big")


def parse(text: str) -> tuple[Samples, dict[str, str]]:
    """Every sample by (name, labels), and every family's type."""
    samples: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
    types = {}
    for family in text_string_to_metric_families(text):
        types[family.name] = family.type
        for sample in family.samples:
            samples[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return samples, types


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


async def scrape(port: int) -> str:
    def get() -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as answer:
            return answer.read().decode()

    # Off the loop: the collector reads the engine on the loop while the scrape waits.
    return await asyncio.to_thread(get)


async def workload(engine: TieringEngine) -> int:
    """Stores, a lookup and loads with known outcomes; returns the lookup's answer."""
    first = engine.store([key(i) for i in range(4)], [0, 1, 2, 3])
    assert (await first).success and await first.cascaded
    second = engine.store([key(4), key(5)], [4, 5])  # 4 CPU slots: evicts 2
    assert (await second).success and await second.cascaded
    hit = engine.lookup([key(i) for i in range(6)] + [key(99)])
    assert (await engine.load([key(0)], [10])).success  # promoted from memory: evicts 1
    assert (await engine.load([key(4), key(5)], [11, 12])).success
    return hit


async def test_scraped_metrics_match_what_the_engine_did() -> None:
    kv = torch.randn(16, 4, 64).half()
    tiers = [{"type": "memory", "max_blocks": 8}]
    registry = CollectorRegistry()
    async with TieringEngine(kv, 4, secondary_tiers=tiers) as engine:
        register_engine_metrics(engine, registry=registry)
        assert await workload(engine) == 6  # key(0), key(1) only in memory; key(99) nowhere
        server = serve_metrics(0, registry=registry)
        try:
            text = await scrape(server.port)
        finally:
            await server.aclose()
    samples, types = parse(text)
    p = "kv_tiering"
    cpu = {"tier": "cpu", "level": "0"}
    mem = {"tier": "memory", "level": "1"}
    expected_counters = {
        "stored_blocks": 6,
        "loaded_blocks": 3,
        "promoted_blocks": 1,
        "cascaded_blocks": 6,
        "written_back_blocks": 0,
        "flushed_blocks": 0,
        "failed_jobs": 0,
        "device_to_host_bytes": 6 * BLOCK_BYTES,
        "host_to_device_bytes": 3 * BLOCK_BYTES,
        "lookups": 1,
        "lookup_blocks": 7,
        "lookup_hit_blocks": 6,
        "lookup_miss_blocks": 1,
    }
    for name, want in expected_counters.items():
        assert types[f"{p}_{name}"] == "counter", name
        assert value(samples, f"{p}_{name}_total") == want, name
    assert value(samples, f"{p}_jobs_in_flight") == 0
    assert value(samples, f"{p}_in_flight_bytes") == 0
    assert not [s for s in samples if s[0] == f"{p}_failures_total"]
    # Lookup: 7 hashes asked of the CPU tier (4 there); 3 asked of memory (2 there).
    assert value(samples, f"{p}_tier_lookups_total", **cpu) == 7
    assert value(samples, f"{p}_tier_lookup_hits_total", **cpu) == 4
    assert value(samples, f"{p}_tier_lookup_misses_total", **cpu) == 3
    assert value(samples, f"{p}_tier_lookups_total", **mem) == 3
    assert value(samples, f"{p}_tier_lookup_hits_total", **mem) == 2
    assert value(samples, f"{p}_tier_lookup_misses_total", **mem) == 1
    # Per tier.
    tier_figures = {
        "tier_stored_blocks_total": (6, 6),
        "tier_stored_bytes_total": (6 * BLOCK_BYTES, 6 * BLOCK_BYTES),
        "tier_loaded_blocks_total": (3, 1),
        "tier_loaded_bytes_total": (3 * BLOCK_BYTES, BLOCK_BYTES),
        "tier_evicted_blocks_total": (3, 0),
        "tier_used_blocks": (4, 6),
        "tier_used_bytes": (4 * BLOCK_BYTES, 6 * BLOCK_BYTES),
        "tier_idle_blocks": (4, 6),
        "tier_pinned_blocks": (0, 0),
        "tier_capacity_blocks": (4, 8),
        "tier_capacity_bytes": (4 * BLOCK_BYTES, 8 * BLOCK_BYTES),
    }
    for name, (at_cpu, at_memory) in tier_figures.items():
        assert value(samples, f"{p}_{name}", **cpu) == at_cpu, name
        assert value(samples, f"{p}_{name}", **mem) == at_memory, name
    assert value(samples, f"{p}_tier_jobs_in_flight", **mem) == 0
    assert (f"{p}_tier_jobs_in_flight", frozenset(cpu.items())) not in samples
    # The memory tier does not verify bytes: no verification figure for it.
    assert not [s for s in samples if s[0] == f"{p}_tier_verification_failures_total"]
    # Latency histograms: one observation per job.
    assert types[f"{p}_job_latency_seconds"] == "histogram"
    for kind, jobs in (("store", 2), ("load", 2)):
        assert value(samples, f"{p}_job_latency_seconds_count", kind=kind) == jobs
        assert value(samples, f"{p}_job_latency_seconds_bucket", kind=kind, le="+Inf") == jobs
        assert value(samples, f"{p}_job_latency_seconds_sum", kind=kind) > 0
        buckets = sorted(
            (float(dict(labels)["le"]), v)
            for (name, labels), v in samples.items()
            if name == f"{p}_job_latency_seconds_bucket" and dict(labels)["kind"] == kind
        )
        assert [v for _, v in buckets] == sorted(v for _, v in buckets)  # cumulative


async def test_the_loop_thread_reading_and_the_http_reading_agree() -> None:
    kv = torch.randn(16, 4, 64).half()
    registry = CollectorRegistry()
    async with TieringEngine(kv, 4, secondary_tiers=[{"type": "memory"}]) as engine:
        register_engine_metrics(engine, registry=registry, prefix="kvt_test")
        await workload(engine)
        on_loop = parse(generate_latest(registry).decode())[0]  # read here, on the loop
        async with serve_metrics(0, registry=registry) as server:
            over_http = parse(await scrape(server.port))[0]
    assert on_loop == over_http
    assert value(on_loop, "kvt_test_stored_blocks_total") == 6


async def test_two_tiers_of_one_type_are_told_apart_by_level() -> None:
    kv = torch.randn(16, 4, 64).half()
    tiers = [{"type": "memory", "max_blocks": 2}, {"type": "memory", "max_blocks": 8}]
    async with TieringEngine(kv, 8, secondary_tiers=tiers) as engine:
        registry = CollectorRegistry()
        register_engine_metrics(engine, registry=registry)
        for i in range(3):  # one job each: the small tier evicts its oldest
            job = engine.store([key(i)], [i])
            assert (await job).success and await job.cascaded
        samples = parse(generate_latest(registry).decode())[0]
    small = {"tier": "memory", "level": "1"}
    large = {"tier": "memory", "level": "2"}
    assert value(samples, "kv_tiering_tier_used_blocks", **small) == 2
    assert value(samples, "kv_tiering_tier_used_blocks", **large) == 3
    assert value(samples, "kv_tiering_tier_evicted_blocks_total", **small) == 1
    assert value(samples, "kv_tiering_tier_evicted_blocks_total", **large) == 0


async def test_loop_lag_samples_become_a_histogram() -> None:
    kv = torch.randn(16, 4, 64).half()
    registry = CollectorRegistry()
    async with TieringEngine(kv, 4) as engine:
        async with LoopLagMonitor() as lag:
            register_engine_metrics(engine, registry=registry, loop_lag=lag, prefix="lagged")
            for _ in range(1000):
                if len(lag.samples) >= 5:
                    break
                await asyncio.sleep(0.002)
            first = parse(generate_latest(registry).decode())[0]  # folds in the samples so far
            assert value(first, "lagged_loop_lag_seconds_count") >= 5
        # The monitor has stopped: the next scrape must have counted every sample once.
        async with serve_metrics(0, registry=registry) as server:
            samples = parse(await scrape(server.port))[0]
    assert value(samples, "lagged_loop_lag_seconds_count") == len(lag.samples)
    assert value(samples, "lagged_loop_lag_seconds_sum") == pytest.approx(sum(lag.samples))
    assert value(samples, "lagged_loop_lag_max_seconds") == pytest.approx(lag.max_ms / 1e3)


async def test_serve_engine_metrics_is_one_call() -> None:
    kv = torch.randn(16, 4, 64).half()
    async with (
        TieringEngine(kv, 4) as engine,
        serve_engine_metrics(engine, 0, prefix="one_call") as server,
    ):
        assert (await engine.store([key(1), key(2)], [1, 2])).success
        samples = parse(await scrape(server.port))[0]
    assert value(samples, "one_call_stored_blocks_total") == 2
    assert value(samples, "one_call_job_latency_seconds_count", kind="store") == 1


async def test_a_collector_reads_every_scrape_afresh() -> None:
    kv = torch.randn(16, 4, 64).half()
    async with TieringEngine(kv, 4) as engine:
        collector = EngineCollector(engine, loop=asyncio.get_running_loop())
        registry = CollectorRegistry()
        registry.register(collector)
        before = parse(generate_latest(registry).decode())[0]
        assert (await engine.store([key(1)], [1])).success
        after = parse(generate_latest(registry).decode())[0]
    assert value(before, "kv_tiering_stored_blocks_total") == 0
    assert value(after, "kv_tiering_stored_blocks_total") == 1


def test_a_collector_of_an_engine_never_entered_reads_zeros() -> None:
    engine = TieringEngine(torch.randn(16, 4, 64).half(), 4)
    registry = CollectorRegistry()
    register_engine_metrics(engine, registry=registry)  # no loop running: reads here
    samples = parse(generate_latest(registry).decode())[0]
    assert value(samples, "kv_tiering_lookups_total") == 0
    assert value(samples, "kv_tiering_tier_capacity_blocks", tier="cpu", level="0") == 4


@pytest.mark.parametrize("prefix", ["", "9lives", "kv-tiering", "kv tiering", 3])
def test_bad_prefixes_are_refused(prefix: object) -> None:
    engine = TieringEngine(torch.randn(16, 4, 64).half(), 4)
    with pytest.raises(InvalidArgumentError, match="prefix"):
        register_engine_metrics(engine, registry=CollectorRegistry(), prefix=prefix)  # type: ignore[arg-type]


@pytest.mark.parametrize("port", [-1, 65536, "9000", True])
def test_bad_ports_are_refused(port: object) -> None:
    with pytest.raises(InvalidArgumentError, match="port"):
        serve_metrics(port, registry=CollectorRegistry())  # type: ignore[arg-type]


def test_closing_the_server_frees_the_port_and_is_idempotent() -> None:
    server = serve_metrics(0, registry=CollectorRegistry())
    port = server.port
    server.close()
    server.close()
    again = serve_metrics(port, registry=CollectorRegistry())  # the port is free again
    again.close()
    assert "closed" in repr(again)
