"""kv-tiering's tiers as vLLM 0.33's secondary tiers, under its CPU tier (docs/vllm.md).
Without vLLM, importing this module raises ImportError."""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, ClassVar

from tiering.errors import InvalidArgumentError
from tiering.hashing import NAMESPACE_FORMAT, canonical_json
from tiering.integrations.tier_thread import FRAMEWORK_DEFAULTS, TierThread, fixed_tier
from tiering.observe.statistics import FailureLog, uncount
from tiering.tiers.client import TierOutcome
from tiering.tiers.inbox import Lane
from tiering.tiers.tier_api import checked_job

try:
    from vllm.v1.kv_offload.base import (
        Locality,
        LookupResult,
        Medium,
        OffloadingCounterMetadata,
        OffloadingEvent,
        OffloadingGaugeMetadata,
        OffloadingMetricMetadata,
        RequestOffloadingContext,
    )
    from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob
except ImportError as exc:  # pragma: no cover - exercised only without vLLM
    raise ImportError(
        "tiering.integrations.vllm needs vLLM 0.33 (the 'vllm' extra: "
        "pip install 'kv-tiering[vllm]'); importing vLLM failed: "
        f"{type(exc).__name__}: {exc}"
    ) from exc

if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
        OffloadingConnectorStats,
    )
    from vllm.v1.kv_offload.base import OffloadingSpec, OffloadKey, ReqContext
    from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector

logger = logging.getLogger(__name__)

METRIC_PREFIX = "kv_tiering:"
"""Prefix of the Prometheus metrics these tiers report through vLLM."""

_COUNTERS = (  # each kind of job's counters: name, meaning
    ("jobs", "Jobs ended"),
    ("blocks", "Blocks moved"),
    ("bytes", "Bytes moved"),
    ("failed_blocks", "Blocks that failed (not stored, or not loaded)"),
    ("refused_jobs", "Jobs refused (bad keys or chunk ids, an id in flight, shut down)"),
)


def vllm_namespace(offloading_spec: OffloadingSpec, block_bytes: int) -> str:
    """The cache namespace of a vLLM engine: what its stored chunks' bytes mean."""
    config = offloading_spec.config
    parallel = config.parallel
    agnostic = parallel.is_parallelism_agnostic or config.replicated_layout
    fields: dict[str, Any] = {
        "model": config.model.name,
        "dtype": config.model.dtype,
        "groups": [[g.tokens_per_block, list(g.layer_names)] for g in config.groups],
        "tokens_per_hash": config.cache.tokens_per_hash,
        "blocks_per_chunk": config.cache.blocks_per_chunk,
        "worker_kv_bytes_per_block": config.worker_kv_bytes_per_block,
        "chunk_bytes": block_bytes,
        "replicated_layout": config.replicated_layout,
        "canonical_layout": config.canonical_layout,
        "kv_cache_layout": config.kv_cache_layout,
        "parallel": None,
    }
    if not agnostic:
        sizes = (parallel.tp_size, parallel.pp_size, parallel.pcp_size, parallel.dcp_size)
        fields["parallel"] = [*sizes, parallel.rank]
    return canonical_json({"vllm": fields, "format": NAMESPACE_FORMAT})


@dataclass(slots=True)
class _Pending:
    kind: Lane
    keys: list[bytes]
    started: float


class RegisteredTierManager(SecondaryTierManager):
    """A vLLM secondary tier backed by the kv-tiering tier registered as ``tier`` (the
    subclasses fix it); the other options: docs/vllm.md#set-up.

    Every job's :class:`JobResult` is reported exactly once, by ``get_finished_jobs``; a
    load reports only keys whose bytes landed and verified; no call but ``drain_jobs`` and
    ``shutdown`` waits for I/O; ``submit_store`` and ``submit_load`` raise nothing. The
    constructor raises InvalidArgumentError for a bad option (nothing is left running),
    UnknownTierError for an unknown ``tier``, TimeoutError if the tier did not start
    within ``start_timeout``."""

    tier_name: ClassVar[str | None] = None
    medium: ClassVar[Medium | None] = None

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: BackpressureDetector | None = None,
        *,
        tier: str | None = None,
        namespace: str | None = None,
        enable_kv_events: bool = False,
        start_timeout: float = 600.0,
        job_timeout: float = 30.0,
        locality: str | None = None,
        **options: Any,
    ) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        name = fixed_tier(type(self), type(self).tier_name, tier)
        if not isinstance(enable_kv_events, bool):
            raise InvalidArgumentError(f"enable_kv_events must be a bool, got {enable_kv_events!r}")
        if locality is not None:
            try:
                self.locality = Locality(locality)
            except ValueError as exc:
                raise InvalidArgumentError(f"locality: {exc}") from exc
        block_bytes = self.block_size_bytes
        # vLLM's view is 2-D (chunks x stride) with format 'b'; our tiers take flat bytes.
        self._flat_view = primary_kv_view.cast("B")
        self._namespace = namespace or vllm_namespace(offloading_spec, block_bytes)
        events = enable_kv_events and offloading_spec.kv_events_config.enable_kv_cache_events
        self._events: list[OffloadingEvent] | None = [] if events else None
        self._lock = threading.Lock()
        self._pending: dict[int, _Pending] = {}  # submitted, result not queued yet
        self._storing: Counter[bytes] = Counter()  # keys of those that are stores
        self._finished: list[JobResult] = []
        self._counters: Counter[str] = Counter()
        self._refusals = FailureLog(
            logger,
            f"kv-tiering's vLLM tier {tier_type}",
            counts_at=f"get_stats(): {METRIC_PREFIX}<kind>_refused_jobs",
        )
        self._closed = False
        self._thread = TierThread(
            {"type": name, **options},
            self._flat_view,
            block_bytes,
            name=f"kv-tiering-{tier_type}",
            defaults={"namespace": self._namespace, **FRAMEWORK_DEFAULTS},
            start_timeout=start_timeout,
            job_timeout=job_timeout,
            report_removals=self._events is not None,
        )
        self._tier = self._thread.tier

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        """HIT if the tier holds ``key``; RETRY while a store of it is in flight; else MISS."""
        held = self._tier.lookup(key)
        if held:
            return LookupResult.HIT
        if held is None or key in self._storing:
            return LookupResult.RETRY
        return LookupResult.MISS

    def has_pending_work(self) -> bool:
        """True while a submitted job has no result queued yet."""
        return bool(self._pending)

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def submit_store(self, job_metadata: TransferJob) -> None:
        """Queue a cascade of primary chunks into the tier, as :meth:`_submit` says."""
        self._submit("store", job_metadata)

    def submit_load(self, job_metadata: TransferJob) -> None:
        """Queue a promotion of stored chunks into primary chunks, as :meth:`_submit` says."""
        self._submit("load", job_metadata)

    def _submit(self, kind: Lane, job: TransferJob) -> None:
        """Hand ``job`` to the tier and return at once, raising nothing (vLLM calls it
        without a try), or refuse it: bad keys or chunk ids, or the tier shut down. A
        refused job's failed result is queued at once, the refusal counted
        (``<kind>_refused_jobs``) and logged once per cause; a job whose id is already in
        flight gets no result of its own (the first job's)."""
        # Checked here, on vLLM's thread: the loop side takes a job as it is.
        job_id = job.job_id
        try:
            checked = checked_job(job_id, job.keys, job.chunk_ids, self._thread.num_slots)
        except InvalidArgumentError as exc:
            with self._lock:
                self._refuse(kind, job_id, "bad keys or chunk ids", f"job {job_id}: {exc}")
            return
        keys, slots = list(checked.keys), list(checked.block_ids)
        with self._lock:
            if self._closed:
                self._refuse(kind, job_id, "the tier is shut down")
                return
            if job_id in self._pending:
                # A second result for the id would trip vLLM's bookkeeping (`not in _jobs`).
                self._refuse(kind, None, "job id already in flight", f"job {job_id}")
                return
            self._pending[job_id] = _Pending(kind, keys, time.monotonic())
            if kind == "store":
                self._storing.update(keys)
        self._thread.submit(kind, keys, slots, partial(self._job_ended, job_id), checked=True)

    def _refuse(self, kind: Lane, job_id: int | None, cause: str, detail: str = "") -> None:
        """Under the lock: count and log a refused job; queue its failed result (if ``job_id``)."""
        self._refusals.record(f"{kind} job refused: {cause}", detail=detail)
        self._counters[f"{kind}_refused_jobs"] += 1
        if job_id is not None:
            result = JobResult(job_id, False, transfer_time=0.0, transfer_bytes=0)
            self._finished.append(result)
            self._counters[f"{kind}_jobs"] += 1

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        """Mark stored keys recently used (on the loop, soon); returns at once."""
        self._thread.touch(list(keys))

    def _job_ended(self, job_id: int, outcome: TierOutcome) -> None:
        """Any thread: queue vLLM's result for a job (once)."""
        with self._lock:
            pending = self._pending.pop(job_id, None)
            if pending is None:
                return
            landed = outcome.landed
            if outcome.ok:
                result = JobResult(job_id, True)
            else:
                # A subset commits only those keys; None (nothing landed) drops all.
                result = JobResult(job_id, False, successful_keys=list(landed) or None)
            result.transfer_bytes = len(landed) * self.block_size_bytes
            result.transfer_time = time.monotonic() - pending.started
            self._finished.append(result)
            kind = pending.kind
            if self._events is not None:
                self._take_removals(self._events)  # what left the tier before this job ended
            if kind == "store":
                uncount(self._storing, pending.keys)
                if self._events is not None and landed:
                    self._events.append(self._event(list(landed), removed=False))
            self._counters[f"{kind}_jobs"] += 1
            self._counters[f"{kind}_blocks"] += len(landed)
            self._counters[f"{kind}_bytes"] += result.transfer_bytes
            self._counters[f"{kind}_failed_blocks"] += len(outcome.failed)
        if outcome.failed:
            logger.debug("%s job %d: %d keys failed", kind, job_id, len(outcome.failed))

    def get_finished_jobs(self) -> Iterable[JobResult]:
        """Results of the jobs that ended since the last call; never blocks on I/O."""
        with self._lock:
            finished, self._finished = self._finished, []
        return finished

    def take_events(self) -> Iterable[OffloadingEvent]:
        """The tier's events since the last call, in order (with ``enable_kv_events``):
        blocks stored, and blocks removed (evicted, or dropped unverified)."""
        if self._events is None:
            return ()
        with self._lock:
            self._take_removals(self._events)
            events, self._events = self._events, []
        return events

    def _event(self, keys: list[OffloadKey], *, removed: bool) -> OffloadingEvent:
        medium, locality, owner = self.medium, self.locality, self.tier_type
        return OffloadingEvent(keys, medium, removed, locality=locality, ownership=owner)

    def _take_removals(self, events: list[OffloadingEvent]) -> None:
        """Under the lock: the tier's removals so far become the next event."""
        if removed := self._tier.take_removed():
            events.append(self._event(removed, removed=True))

    def drain_jobs(self) -> None:
        """Block until every submitted job's result is queued; aborts no transfer."""
        self._thread.wait(lambda: not self._pending)

    def shutdown(self) -> None:
        """Close the tier (jobs in flight end first) and release the primary view. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._thread.close()
        self._tier.primary_kv_view.release()
        self._flat_view.release()

    @classmethod
    def build_metric_definitions(
        cls, extra_config: dict[str, Any]
    ) -> dict[str, OffloadingMetricMetadata]:
        """Prometheus metrics these tiers report, labelled by vLLM's tier type."""
        labels = ("tier_type",)
        counters = {
            f"{METRIC_PREFIX}{kind}_{what}": OffloadingCounterMetadata(
                f"{doc} by kv-tiering's tier ({kind} jobs)", labels
            )
            for kind in ("store", "load")
            for what, doc in _COUNTERS
        }
        gauges = {
            "stored_blocks": "Blocks kv-tiering's tier holds now",
            "jobs_in_flight": "Jobs submitted to kv-tiering's tier without a result yet",
        }
        return counters | {
            f"{METRIC_PREFIX}{name}": OffloadingGaugeMetadata(doc, labels)
            for name, doc in gauges.items()
        }

    def get_stats(self) -> OffloadingConnectorStats | None:
        """Counters since the last call, and gauges now."""
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
            OffloadingConnectorStats,
        )

        with self._lock:
            counters, self._counters = self._counters, Counter()
            in_flight = len(self._pending)
        stats = OffloadingConnectorStats()
        labels = (self.tier_type,)
        for name, value in counters.items():
            if value:
                stats.increase_counter(f"{METRIC_PREFIX}{name}", value, labels)
        stats.set_gauge(f"{METRIC_PREFIX}stored_blocks", self._tier.get_num_blocks(), labels)
        stats.set_gauge(f"{METRIC_PREFIX}jobs_in_flight", in_flight, labels)
        return stats

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.tier_type} over {self._tier!r}>"


class NVMeTierManager(RegisteredTierManager):
    """kv-tiering's NVMe tier under vLLM (``root`` and ``capacity_bytes`` required)."""

    tier_name = "nvme"
    medium = Medium.STORAGE


class MemoryTierManager(RegisteredTierManager):
    """kv-tiering's memory tier (a bounded in-process store) under vLLM."""

    tier_name = "memory"
    medium = Medium.CPU
