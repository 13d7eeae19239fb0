"""Prometheus metrics of a :class:`~tiering.engine.TieringEngine` and its tiers: every
metric, and why a scrape reads the engine on its loop's thread (and when on its own
instead): ``docs/metrics.md``."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from prometheus_client import REGISTRY, CollectorRegistry, start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.utils import floatToGoString

from tiering.core.job_core import LookupStatistics
from tiering.errors import InvalidArgumentError
from tiering.lifecycle import AsyncService, Lifecycle, running_loop
from tiering.observe.latency import LatencyHistogram, LatencySnapshot
from tiering.observe.statistics import Statistics
from tiering.security.tenancy import TenantLookups
from tiering.validation import seconds

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

    from tiering.engine import TieringEngine
    from tiering.observe.loop_lag import LoopLagMonitor

logger = logging.getLogger(__name__)

DEFAULT_PREFIX = "kv_tiering"
CPU_TIER = "cpu"  # the ``tier`` label of the CPU tier, whose ``level`` is "0"
_READ_ATTEMPTS = 5
_METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")


@dataclass(frozen=True, slots=True)
class _TierReading:
    name: str  # the tier type, e.g. "memory"
    level: int  # 1 = the first secondary tier
    servable: bool
    stats: Statistics


@dataclass(frozen=True, slots=True)
class _Reading:  # everything one scrape shows, read in one go
    engine: Statistics
    block_bytes: int
    cpu_idle_blocks: int
    lookups: LookupStatistics
    latency: Mapping[str, LatencySnapshot]
    tiers: tuple[_TierReading, ...]
    tenants: Mapping[str, TenantLookups]


def _read_engine(engine: TieringEngine) -> _Reading:
    tiers = []
    admissions = engine.admission_counters() or [{} for _ in engine.tiers]
    for level, (tier, admitted) in enumerate(zip(engine.tiers, admissions, strict=True), 1):
        statistics = getattr(tier, "statistics", None)
        if callable(statistics):
            stats = statistics()
        else:  # a tier written against the seed interface: only its size is known
            stats = Statistics(state=engine.state, used_blocks=tier.get_num_blocks())
        # The engine decides what a tier admits: its counts join the tier's own.
        stats = replace(stats, counters={**stats.counters, **admitted})
        servable = bool(getattr(tier, "holds_data", True))
        tiers.append(_TierReading(tier.get_tier_type(), level, servable, stats))
    return _Reading(
        engine=engine.statistics(),
        block_bytes=engine.block_bytes,
        cpu_idle_blocks=engine.manager.num_evictable,
        lookups=engine.lookup_statistics(),
        latency=engine.job_latency(),
        tiers=tuple(tiers),
        tenants=engine.tenant_statistics(),
    )


class EngineCollector:
    """A ``prometheus_client`` collector of one engine, open or closed: ``loop_lag``'s
    samples become ``<prefix>_loop_lag_seconds``; readings are taken on ``loop`` (None:
    the scrape thread), waiting up to ``snapshot_timeout`` seconds. Raises
    InvalidArgumentError for a bad ``prefix`` or ``snapshot_timeout``."""

    def __init__(
        self,
        engine: TieringEngine,
        *,
        prefix: str = DEFAULT_PREFIX,
        loop_lag: LoopLagMonitor | None = None,
        loop: asyncio.AbstractEventLoop | None = None,
        snapshot_timeout: float = 1.0,
    ) -> None:
        if not isinstance(prefix, str) or not _METRIC_NAME.fullmatch(prefix):
            raise InvalidArgumentError(
                f"prefix must be a Prometheus metric name ({_METRIC_NAME.pattern}), got {prefix!r}"
            )
        self.engine = engine
        self.prefix = prefix
        self.loop_lag = loop_lag
        self.loop = loop
        self.snapshot_timeout = seconds("snapshot_timeout", snapshot_timeout, allow_zero=False)
        # Lag samples seen are folded into one histogram (a scrape costs the new ones);
        # scrapes may run on several server threads at once.
        self._lag_lock = threading.Lock()
        self._lag = LatencyHistogram()
        self._lag_seen = 0

    def _read(self) -> _Reading:
        loop = self.loop
        if loop is None or loop.is_closed() or not loop.is_running() or running_loop() is loop:
            return self._read_here()
        reading = self._read_on_loop()
        try:
            answer = asyncio.run_coroutine_threadsafe(reading, loop)
        except RuntimeError:  # closed meanwhile: nothing changes the engine any more
            reading.close()
            return self._read_here()
        try:
            return answer.result(self.snapshot_timeout)
        except TimeoutError:
            answer.cancel()  # the reading never runs, or has run
            logger.debug("metrics: the loop did not answer in %gs", self.snapshot_timeout)
            return self._read_here()

    async def _read_on_loop(self) -> _Reading:
        return _read_engine(self.engine)

    def _read_here(self) -> _Reading:
        for _ in range(_READ_ATTEMPTS - 1):
            with contextlib.suppress(RuntimeError):  # a dict changed size under the copy
                return _read_engine(self.engine)
        return _read_engine(self.engine)

    def collect(self) -> Iterable[Metric]:
        """The metric families of a fresh reading."""
        reading = self._read()
        yield from self._engine_families(reading)
        yield from self._lookup_families(reading)
        yield from self._tenant_families(reading)
        yield from self._tier_families(reading)
        yield from self._latency_families(reading)
        monitor = self.loop_lag
        if monitor is None:
            return
        with self._lag_lock:
            samples = monitor.samples
            if len(samples) < self._lag_seen:  # the list was replaced or cleared
                self._lag, self._lag_seen = LatencyHistogram(), 0
            new = samples[self._lag_seen :]  # one C-level slice: safe while appended to
            self._lag_seen += len(new)
            observe = self._lag.observe
            for sample in new:
                observe(sample)
            lag = self._lag.snapshot()
        doc = "How late the event loop woke a periodic ticker (LoopLagMonitor samples)."
        yield HistogramMetricFamily(
            f"{self.prefix}_loop_lag_seconds", doc, buckets=_buckets(lag), sum_value=lag.sum
        )
        yield GaugeMetricFamily(
            f"{self.prefix}_loop_lag_max_seconds", "The largest loop lag seen.", lag.max
        )

    def _engine_families(self, r: _Reading) -> Iterator[Metric]:
        p, stats, counters = self.prefix, r.engine, r.engine.counters
        values = (stats.jobs_in_flight, stats.bytes_in_flight)
        for (name, doc), value in zip(_ENGINE_GAUGES, values, strict=True):
            yield GaugeMetricFamily(f"{p}_{name}", doc, value)
        for counter, name, doc in _ENGINE_COUNTERS:
            yield CounterMetricFamily(f"{p}_{name}", doc, counters.get(counter, 0))
        failures = CounterMetricFamily(
            f"{p}_failures", "Failed blocks or jobs of the engine, by cause.", labels=["reason"]
        )
        for reason, count in sorted(stats.failures.items()):
            failures.add_metric([reason], count)
        yield failures

    def _tenant_families(self, r: _Reading) -> Iterator[Metric]:
        for field, what in _TENANT_COUNTERS:
            name, doc = f"{self.prefix}_tenant_lookup_{field}", f"{what} (tenant: an opaque label)."
            family = CounterMetricFamily(name, doc, labels=["tenant"])
            for label, counts in sorted(r.tenants.items()):
                family.add_metric([label], getattr(counts, field))
            yield family

    def _lookup_families(self, r: _Reading) -> Iterator[Metric]:
        p, lookups = self.prefix, r.lookups
        misses = lookups.blocks - lookups.hit_blocks
        values = (lookups.lookups, lookups.blocks, lookups.hit_blocks, misses)
        for (name, doc), value in zip(_LOOKUP_COUNTERS, values, strict=True):
            yield CounterMetricFamily(f"{p}_{name}", doc, value)
        asked, hits, missed = (
            CounterMetricFamily(f"{p}_{name}", doc, labels=["tier", "level"])
            for name, doc in _TIER_LOOKUP_COUNTERS
        )
        # A hash is asked of the CPU tier, then of each servable tier in order, until
        # one holds it; a call stops at the first hash none holds.
        reaching = lookups.hit_blocks + lookups.first_misses
        tiers = [(CPU_TIER, 0, True)] + [(t.name, t.level, t.servable) for t in r.tiers]
        for name, level, servable in tiers:
            by_tier = lookups.hits_by_tier
            found = by_tier[level] if level < len(by_tier) else 0
            seen = reaching if servable else 0
            for family, value in ((asked, seen), (hits, found), (missed, seen - found)):
                family.add_metric([name, str(level)], value)
            if servable:
                reaching -= found
        yield from (asked, hits, missed)

    def _tier_families(self, r: _Reading) -> Iterator[Metric]:
        p, size = self.prefix, r.block_bytes
        labels = ["tier", "level"]
        gauges = {
            field: GaugeMetricFamily(f"{p}_tier_{field}", doc, labels=labels)
            for field, doc in _TIER_GAUGES
        }
        counters = {
            name: CounterMetricFamily(f"{p}_tier_{name}", doc, labels=labels)
            for name, doc in _TIER_COUNTERS
        }
        failures = CounterMetricFamily(
            f"{p}_tier_failures",
            "Failed blocks or jobs of this tier, by cause.",
            labels=[*labels, "reason"],
        )
        engine = r.engine  # the CPU tier's row: its stored, loaded and evicted blocks
        rows: list[tuple[str, int, Statistics, int, Mapping[str, int]]] = [
            (CPU_TIER, 0, engine, r.cpu_idle_blocks, engine.counters)
        ]
        for tier in r.tiers:
            stats = tier.stats
            idle = max(0, stats.used_blocks - stats.pinned_blocks)
            rows.append((tier.name, tier.level, stats, idle, stats.counters))
        for name, level, stats, idle, tier_counters in rows:
            values = [name, str(level)]
            gauges["used_blocks"].add_metric(values, stats.used_blocks)
            gauges["used_bytes"].add_metric(values, stats.used_bytes)
            gauges["idle_blocks"].add_metric(values, idle)
            gauges["pinned_blocks"].add_metric(values, stats.pinned_blocks)
            if stats.capacity_blocks:
                gauges["capacity_blocks"].add_metric(values, stats.capacity_blocks)
            if stats.capacity_bytes:
                gauges["capacity_bytes"].add_metric(values, stats.capacity_bytes)
            if level:  # the CPU tier's work in flight is the engine's
                gauges["jobs_in_flight"].add_metric(values, stats.jobs_in_flight)
                gauges["in_flight_bytes"].add_metric(values, stats.bytes_in_flight)
                for reason, count in sorted(stats.failures.items()):
                    failures.add_metric([*values, reason], count)
            for counter, family, scale in (  # the tier's counter each family shows
                ("stored_blocks", "stored_blocks", 1),
                ("stored_blocks", "stored_bytes", size),
                ("loaded_blocks", "loaded_blocks", 1),
                ("loaded_blocks", "loaded_bytes", size),
                ("evicted_blocks", "evicted_blocks", 1),
                ("corrupt_blocks", "verification_failures", 1),
                ("admitted_blocks", "admitted_blocks", 1),
                ("refused_blocks", "admission_refused_blocks", 1),
                ("over_budget_blocks", "over_budget_blocks", 1),
                ("late_blocks", "late_blocks", 1),
            ):
                if (value := tier_counters.get(counter)) is not None:
                    counters[family].add_metric(values, value * scale)
        yield from gauges.values()
        yield from counters.values()
        yield failures

    def _latency_families(self, r: _Reading) -> Iterator[Metric]:
        family = HistogramMetricFamily(
            f"{self.prefix}_job_latency_seconds",
            "Engine jobs from the store/load call to their result (failed jobs included).",
            labels=["kind"],
        )
        for kind, snapshot in sorted(r.latency.items()):
            family.add_metric([kind], _buckets(snapshot), snapshot.sum)
        yield family


_ENGINE_COUNTERS: Sequence[tuple[str, str, str]] = (
    ("bytes_to_host", "device_to_host_bytes", "Bytes copied from device blocks into CPU slots."),
    ("bytes_to_device", "host_to_device_bytes", "Bytes copied from CPU slots into device blocks."),
    ("stored_blocks", "stored_blocks", "Blocks store jobs copied from the device into CPU."),
    ("loaded_blocks", "loaded_blocks", "Blocks load jobs copied from CPU into the device."),
    ("promoted_blocks", "promoted_blocks", "Blocks loads read from a secondary tier into CPU."),
    ("cascaded_blocks", "cascaded_blocks", "Blocks write-through cascades stored in a tier."),
    ("written_back_blocks", "written_back_blocks", "Evicted CPU blocks written back to a tier."),
    ("flushed_blocks", "flushed_blocks", "Blocks flushes stored in a secondary tier."),
    ("failed_jobs", "failed_jobs", "Store and load jobs whose result was not success."),
    ("declined_blocks", "declined_blocks", "Blocks stores asked for that the policy declined."),
    ("lost_blocks", "lost_blocks", "Write-back blocks that left CPU while in no other tier."),
)
_ENGINE_GAUGES: Sequence[tuple[str, str]] = (
    ("jobs_in_flight", "Engine jobs (waiting, running or cascading) and flushes not ended."),
    ("in_flight_bytes", "Bytes the engine's copies and tier jobs in flight move now."),
)
_TENANT_COUNTERS: Sequence[tuple[str, str]] = (  # TenantLookups field, what it counts
    ("blocks", "Hashes a tenant passed to engine.lookup"),
    ("hit_blocks", "Leading hashes of a tenant's lookups found in some tier"),
)
_LOOKUP_COUNTERS: Sequence[tuple[str, str]] = (
    ("lookups", "Calls of engine.lookup."),
    ("lookup_blocks", "Hashes passed to engine.lookup."),
    ("lookup_hit_blocks", "Leading hashes engine.lookup found in some tier."),
    ("lookup_miss_blocks", "Hashes passed to engine.lookup that it did not count as hits."),
)
_TIER_LOOKUP_COUNTERS: Sequence[tuple[str, str]] = (
    ("tier_lookups", "Hashes engine.lookup asked this tier about."),
    ("tier_lookup_hits", "Hashes engine.lookup found in this tier."),
    ("tier_lookup_misses", "Hashes engine.lookup asked this tier about and did not find there."),
)
_TIER_GAUGES: Sequence[tuple[str, str]] = (
    ("used_blocks", "Blocks this tier holds now (idle ready blocks included)."),
    ("used_bytes", "Bytes this tier holds now (as the tier measures them)."),
    ("idle_blocks", "Blocks this tier holds that nothing pins: what eviction may take."),
    ("pinned_blocks", "Blocks this tier may not evict now (I/O in flight, holds)."),
    ("capacity_blocks", "The most blocks this tier may hold (absent: no block bound)."),
    ("capacity_bytes", "The most bytes this tier may hold (absent: no byte bound)."),
    ("jobs_in_flight", "Jobs submitted to this secondary tier without a result yet."),
    ("in_flight_bytes", "Payload bytes of this secondary tier's jobs in flight."),
)
_TIER_COUNTERS: Sequence[tuple[str, str]] = (
    ("stored_blocks", "Blocks stored into this tier."),
    ("stored_bytes", "Payload bytes stored into this tier (blocks x block bytes)."),
    ("loaded_blocks", "Blocks loaded out of this tier."),
    ("loaded_bytes", "Payload bytes loaded out of this tier (blocks x block bytes)."),
    ("evicted_blocks", "Blocks this tier evicted to make room."),
    ("verification_failures", "Blocks whose bytes failed verification on a load."),
    ("admitted_blocks", "Blocks offered to this secondary tier that its admission wrote."),
    ("admission_refused_blocks", "Blocks offered to this secondary tier that its rule refused."),
    ("over_budget_blocks", "Blocks this secondary tier's rule admitted over its write budget."),
    ("late_blocks", "Blocks written to this secondary tier from its backlog, after the budget."),
)


def _buckets(snapshot: LatencySnapshot) -> list[tuple[str, float]]:
    bounds = [floatToGoString(b) for b in snapshot.bounds] + ["+Inf"]
    return list(zip(bounds, snapshot.cumulative, strict=True))


def register_engine_metrics(
    engine: TieringEngine,
    *,
    registry: CollectorRegistry | None = None,
    prefix: str = DEFAULT_PREFIX,
    loop_lag: LoopLagMonitor | None = None,
    snapshot_timeout: float = 1.0,
) -> EngineCollector:
    """Register and return an :class:`EngineCollector` of ``engine`` in ``registry``
    (default: the global one); call it on the engine's loop, where scrapes then read.
    Raises as :class:`EngineCollector`, ValueError if the registry has these names."""
    collector = EngineCollector(
        engine,
        prefix=prefix,
        loop_lag=loop_lag,
        loop=running_loop(),
        snapshot_timeout=snapshot_timeout,
    )
    (REGISTRY if registry is None else registry).register(collector)
    return collector


class MetricsServer(AsyncService, AbstractContextManager["MetricsServer"]):
    """A running HTTP endpoint serving a registry at ``/metrics`` on ``addr:port``; close
    it (idempotent) with :meth:`close` / ``with`` or on the loop with :meth:`aclose`."""

    def __init__(self, server: WSGIServer, thread: threading.Thread) -> None:
        self._server = server
        self._thread = thread
        self.addr: str = server.server_address[0]
        self.port: int = server.server_address[1]
        self._state = Lifecycle.OPEN

    def close(self) -> None:
        """Stop serving, close the socket and join the thread (blocking up to 0.5 s)."""
        if self._state is Lifecycle.CLOSED:
            return
        self._state = Lifecycle.CLOSED
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

    async def start(self) -> None:
        """Nothing to start: it serves from the moment it is made."""

    async def aclose(self) -> None:
        await asyncio.to_thread(self.close)

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "serving"
        return f"<MetricsServer http://{self.addr}:{self.port}/metrics {state}>"


def serve_metrics(
    port: int, *, registry: CollectorRegistry | None = None, addr: str = "127.0.0.1"
) -> MetricsServer:
    """Serve ``registry`` (default: the global one) on ``addr:port`` (loopback by default:
    metrics name the host's tiers and sizes; port 0: a free one) from a daemon thread.
    Raises InvalidArgumentError for a ``port`` not in 0..65535, OSError if it cannot bind."""
    if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535:
        raise InvalidArgumentError(f"port must be an int in 0..65535, got {port!r}")
    server, thread = start_http_server(
        port, addr=addr, registry=REGISTRY if registry is None else registry
    )
    return MetricsServer(server, thread)


def serve_engine_metrics(
    engine: TieringEngine,
    port: int,
    *,
    addr: str = "127.0.0.1",
    prefix: str = DEFAULT_PREFIX,
    loop_lag: LoopLagMonitor | None = None,
) -> MetricsServer:
    """``engine``'s metrics in a registry of their own, served on ``addr:port`` (what
    ``--metrics-port`` does), called on the engine's loop. Raises as both functions above."""
    registry = CollectorRegistry()
    register_engine_metrics(engine, registry=registry, prefix=prefix, loop_lag=loop_lag)
    return serve_metrics(port, registry=registry, addr=addr)
