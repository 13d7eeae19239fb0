"""kv-tiering's secondary tiers under vLLM 0.33's CPU tier, with no fork of vLLM.

:class:`NVMeTierManager` and :class:`MemoryTierManager` build our NVMe and memory tiers,
:class:`RegisteredTierManager` any tier registered by name, each on a private uvloop loop
on a daemon thread; vLLM's calls hand their work over and return at once. Set-up,
options, threading, events and metrics: docs/vllm.md. Without vLLM, importing this
module raises ImportError.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Collection, Coroutine, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal, TypeVar

import uvloop

from backends.nvme_segments import STAGING_BYTES
from tiering.errors import InvalidArgumentError
from tiering.hashing import NAMESPACE_FORMAT, canonical_json
from tiering.registry import make_tier
from tiering.secondary import checked_job
from tiering.statistics import uncount
from tiering.tier_client import TierClient, TierOutcome
from tiering.validation import seconds

try:
    from vllm.v1.kv_offload.base import (
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

_T = TypeVar("_T")

# How long drain_jobs waits between checks that the loop thread still runs.
_DRAIN_CHECK_S = 1.0

# Defaults for the tiers that take these options (docs/vllm.md#how-it-works says why).
_TIER_DEFAULTS: dict[str, Any] = {"gil_pause_bytes": 0, "staging_bytes": STAGING_BYTES}

METRIC_PREFIX = "kv_tiering:"
"""Prefix of the Prometheus metrics these tiers report through vLLM."""

_TIER_LABEL = "tier_type"


def vllm_namespace(offloading_spec: OffloadingSpec, block_bytes: int) -> str:
    """The cache namespace of a vLLM engine: what its stored chunks' bytes mean (the
    fields: docs/vllm.md#how-it-works)."""
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


class _LoopThread:
    """A uvloop event loop running on a daemon thread this object owns."""

    def __init__(self, name: str) -> None:
        self.loop = uvloop.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
        finally:
            pending = [t for t in asyncio.all_tasks(self.loop) if not t.done()]
            for task in pending:
                task.cancel()
            if pending:
                self.loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            self.loop.run_until_complete(self.loop.shutdown_asyncgens())
            self.loop.close()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def run(self, coro: Coroutine[Any, Any, _T], timeout: float | None) -> _T:
        """Run ``coro`` on the loop and wait for its result on the calling thread."""
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return future.result(timeout)

    def stop(self) -> None:
        """Stop the loop (its leftover tasks are cancelled) and join the thread."""
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join()


@dataclass(slots=True)
class _Pending:
    kind: Literal["store", "load"]
    keys: list[bytes]
    started: float


class RegisteredTierManager(SecondaryTierManager):
    """A vLLM secondary tier backed by the kv-tiering tier registered as ``tier`` (the
    subclasses fix it); the other options: docs/vllm.md#set-up.

    Every job's :class:`JobResult` is reported exactly once, by ``get_finished_jobs``; a
    load reports only keys whose bytes landed and verified; no call but ``drain_jobs``
    and ``shutdown`` waits for I/O. The constructor raises InvalidArgumentError for a bad
    option (nothing is left running), UnknownTierError for an unknown ``tier``,
    TimeoutError if the tier did not start within ``start_timeout``.
    """

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
        name = self._tier_name(tier)
        if not isinstance(enable_kv_events, bool):
            raise InvalidArgumentError(f"enable_kv_events must be a bool, got {enable_kv_events!r}")
        seconds("start_timeout", start_timeout, allow_zero=False)
        seconds("job_timeout", job_timeout, allow_zero=False)
        if locality is not None:
            from vllm.v1.kv_offload.base import Locality

            try:
                self.locality = Locality(locality)
            except ValueError as exc:
                raise InvalidArgumentError(f"locality: {exc}") from exc
        block_bytes = self.block_size_bytes
        # vLLM's view is 2-D (chunks x stride) with format 'b'; our tiers take flat bytes.
        self._flat_view = primary_kv_view.cast("B")
        self._num_slots = len(self._flat_view) // block_bytes
        self._namespace = namespace or vllm_namespace(offloading_spec, block_bytes)
        self._events: list[OffloadingEvent] | None = (
            []
            if enable_kv_events and offloading_spec.kv_events_config.enable_kv_cache_events
            else None
        )
        self._lock = threading.Condition()
        self._pending: dict[int, _Pending] = {}  # submitted, result not queued yet
        self._storing: Counter[bytes] = Counter()  # keys of those that are stores
        self._finished: list[JobResult] = []
        self._handoff: deque[tuple[Any, ...]] = deque()
        self._wake_scheduled = False
        self._counters: Counter[str] = Counter()
        self._closed = False
        spec = {"type": name, **options}
        self._loop = _LoopThread(f"kv-tiering-{tier_type}")
        try:
            self._client = self._loop.run(self._open(spec, block_bytes, job_timeout), start_timeout)
        except BaseException:
            self._loop.stop()
            self._flat_view.release()
            raise
        self._tier = self._client.tier

    def _tier_name(self, tier: str | None) -> str:
        fixed = type(self).tier_name
        if fixed is not None and tier not in (None, fixed):
            raise InvalidArgumentError(
                f"tier: {type(self).__name__} always builds the {fixed!r} tier, got {tier!r}"
            )
        tier = fixed or tier
        if not isinstance(tier, str) or not tier:
            raise InvalidArgumentError(
                f"tier must name a registered kv-tiering tier (e.g. 'nvme'), got {tier!r}"
            )
        return tier

    async def _open(self, spec: dict[str, Any], block_bytes: int, job_timeout: float) -> TierClient:
        defaults = {"namespace": self._namespace, **_TIER_DEFAULTS}
        tier = make_tier(spec, self._flat_view, block_bytes, defaults=defaults)
        if self._events is not None:
            tier.report_removals()
        client = TierClient(tier, timeout=job_timeout)
        try:
            await client.start()
        except BaseException:
            tier.shutdown()
            raise
        return client

    @property
    def kv_tier(self) -> Any:
        """The kv-tiering tier behind this manager, for inspection; it runs on the private
        loop, so call nothing that starts I/O."""
        return self._tier

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
        """Queue a cascade of primary chunks into the tier; returns at once."""
        self._submit("store", job_metadata)

    def submit_load(self, job_metadata: TransferJob) -> None:
        """Queue a promotion of stored chunks into primary chunks; returns at once."""
        self._submit("load", job_metadata)

    def _submit(self, kind: Literal["store", "load"], job: TransferJob) -> None:
        # Checked here, on vLLM's thread, so that bad input raises to vLLM and the loop
        # side takes it as it is (a job refused there would never end).
        try:
            checked = checked_job(job.job_id, job.keys, job.chunk_ids, self._num_slots)
        except InvalidArgumentError as exc:
            raise InvalidArgumentError(f"job {job.job_id}: {exc}") from None
        keys, slots = list(checked.keys), list(checked.block_ids)
        with self._lock:
            if job.job_id in self._pending:
                raise InvalidArgumentError(f"job id {job.job_id} is already in flight")
            self._pending[job.job_id] = _Pending(kind, keys, time.monotonic())
            if kind == "store":
                self._storing.update(keys)
            closed = self._closed
        if closed:
            self._job_ended(job.job_id, TierOutcome.failure(keys, "the tier is shut down"))
            return
        self._hand_off(("submit", kind, job.job_id, keys, slots))

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        """Mark stored keys recently used (on the loop, soon); returns at once."""
        if not self._closed:
            self._hand_off(("touch", list(keys)))

    def _hand_off(self, item: tuple[Any, ...]) -> None:
        self._handoff.append(item)
        # Wake the loop once per batch. The loop clears the flag before it drains, and
        # the item is appended before the flag is read, so no item is ever stranded.
        if not self._wake_scheduled:
            self._wake_scheduled = True
            try:
                self._loop.loop.call_soon_threadsafe(self._drain_handoff)
            except RuntimeError:  # the loop is closed: shutdown fails what is left
                self._wake_scheduled = False

    def _drain_handoff(self) -> None:
        """On the loop: pass every handed-off call to the tier client, in order."""
        self._wake_scheduled = False
        client = self._client
        while self._handoff:
            item = self._handoff.popleft()
            if item[0] == "touch":
                client.touch(item[1])
                continue
            _, kind, job_id, keys, slots = item
            client.submit(
                kind, keys, slots, lambda o, j=job_id: self._job_ended(j, o), checked=True
            )

    def _job_ended(self, job_id: int, outcome: TierOutcome) -> None:
        """Any thread: queue vLLM's result for a job (once) and wake ``drain_jobs``."""
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
            self._lock.notify_all()
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
        return OffloadingEvent(
            keys=keys,
            medium=self.medium,
            removed=removed,
            locality=self.locality,
            ownership=self.tier_type,
        )

    def _take_removals(self, events: list[OffloadingEvent]) -> None:
        """Under the lock: the tier's removals so far become the next event."""
        removed = self._tier.take_removed()
        if removed:
            events.append(self._event(removed, removed=True))

    def drain_jobs(self) -> None:
        """Block until every submitted job's result is queued; aborts no transfer."""
        with self._lock:
            while self._pending:
                if not self._loop.alive:
                    self._fail_pending_locked("the tier's event loop stopped")
                    break
                self._lock.wait(_DRAIN_CHECK_S)

    def _fail_pending_locked(self, reason: str) -> None:
        for job_id, pending in list(self._pending.items()):  # the lock is reentrant
            self._job_ended(job_id, TierOutcome.failure(pending.keys, reason))

    def shutdown(self) -> None:
        """Close the tier gracefully (jobs in flight end first), stop the loop thread and
        release the primary view. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self._loop.alive:
            try:
                self._loop.run(self._close(), None)
            except Exception:
                logger.exception("%s: closing the tier failed", type(self).__name__)
        self._loop.stop()
        with self._lock:
            self._fail_pending_locked("the tier shut down before the job ended")
        self._tier.primary_kv_view.release()
        self._flat_view.release()

    async def _close(self) -> None:
        self._drain_handoff()
        await self._client.aclose(self._client.timeout)

    @classmethod
    def build_metric_definitions(
        cls, extra_config: dict[str, Any]
    ) -> dict[str, OffloadingMetricMetadata]:
        """Prometheus metrics these tiers report, labelled by vLLM's tier type."""
        labels = (_TIER_LABEL,)
        counters = {
            f"{METRIC_PREFIX}{kind}_{what}": OffloadingCounterMetadata(
                f"{doc} by kv-tiering's tier ({kind} jobs)", labels
            )
            for kind in ("store", "load")
            for what, doc in (
                ("jobs", "Jobs ended"),
                ("blocks", "Blocks moved"),
                ("bytes", "Bytes moved"),
                ("failed_blocks", "Blocks that failed (not stored, or not loaded)"),
            )
        }
        gauges = {
            f"{METRIC_PREFIX}stored_blocks": OffloadingGaugeMetadata(
                "Blocks kv-tiering's tier holds now", labels
            ),
            f"{METRIC_PREFIX}jobs_in_flight": OffloadingGaugeMetadata(
                "Jobs submitted to kv-tiering's tier without a result yet", labels
            ),
        }
        return {**counters, **gauges}

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
        return f"<{type(self).__name__} {self.tier_type} over {self._client.tier!r}>"


class NVMeTierManager(RegisteredTierManager):
    """kv-tiering's NVMe tier under vLLM (``root`` and ``capacity_bytes`` required)."""

    tier_name = "nvme"
    medium = Medium.STORAGE


class MemoryTierManager(RegisteredTierManager):
    """kv-tiering's memory tier (a bounded in-process store) under vLLM."""

    tier_name = "memory"
    medium = Medium.CPU
