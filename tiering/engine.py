"""The asyncio engine: the thin shell that carries out :class:`~tiering.core.job_core.JobCore`'s
effects (copies through the :class:`DeviceCopier`, tier jobs through one :class:`TierClient` per
tier, results to :class:`Job` handles, room timers) and feeds every completion back; no job owns
a task."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import partial
from time import perf_counter
from typing import Any, Literal

from tiering.config import TieringConfig
from tiering.core import job_core
from tiering.core.admission import make_gates
from tiering.core.cpu_tier import CPUOffloadingManager
from tiering.core.job import FinishedResults, Job
from tiering.core.policies import DEFAULT_POLICY, EvictionPolicy
from tiering.core.scheduler_api import BlockHash, OffloadingEvent
from tiering.device.copier import DeviceCopier
from tiering.device.host_pool import HostPool
from tiering.device.kv_layout import KVCaches, describe_kv_caches, kv_block_bytes
from tiering.device.layer_progress import LayerProgress, check_progress
from tiering.errors import ClosedError, ConfigError, InvalidArgumentError, TieringError
from tiering.hashing import cache_namespace
from tiering.lifecycle import AsyncService, Lifecycle
from tiering.observe.latency import LatencyHistogram, LatencySnapshot
from tiering.observe.statistics import Statistics
from tiering.security.tenancy import Tenancy, TenantLookups, check_tenant, tenant_label
from tiering.tiers.client import TierClient, TierOutcome
from tiering.tiers.registry import TierSpec, make_tier, tier_specs
from tiering.tiers.tier_api import JobResult, SecondaryTierManager, tier_capacity_blocks
from tiering.validation import check_host_memory, hash_list, positive_int, seconds

logger = logging.getLogger(__name__)

WritePolicy = Literal["write_through", "write_back"]


class TieringEngine(AsyncService):
    """KV blocks across device, CPU and secondary tiers, driven by one asyncio loop.

    Use as ``async with TieringEngine(kv_caches, num_cpu_blocks) as engine:``, entered
    and left in one task on the loop whose thread calls it. ``kv_caches``: the device KV
    cache (a tensor, or per-layer tensors, indexed by block id first); ``num_cpu_blocks``:
    the CPU tier's slots; ``secondary_tiers``: fastest first, each a registered name,
    ``{"type": name, **options}`` or a factory ``(primary_kv_view, block_bytes)``;
    ``cache_identity`` and the KV layout form ``engine.namespace``, which tiers taking a
    ``namespace`` receive. The other options: docs/config.md.

    ``lookup``, ``touch``, ``store`` and ``load`` take an optional ``tenant``, whose blocks
    live under keys scoped to it in every tier (:mod:`tiering.security.tenancy`, except
    prefixes shared with :meth:`share_prefix`); results name the caller's hashes, events
    and tiers the scoped keys. Every call raises ClosedError unless the engine is open,
    and InvalidArgumentError (naming the argument) for a malformed one, changing nothing;
    so does the constructor (allocating nothing), and UnknownPolicyError /
    UnknownTierError for a name nothing is registered under."""

    def __init__(
        self,
        kv_caches: KVCaches,
        num_cpu_blocks: int,
        *,
        policy: str | EvictionPolicy = DEFAULT_POLICY,
        secondary_tiers: Sequence[TierSpec] = (),
        write_policy: WritePolicy = "write_through",
        block_size: int = 16,
        enable_events: bool = False,
        cache_identity: str | Mapping[str, Any] = "",
        tier_timeout: float = 30.0,
        room_timeout: float = 5.0,
        close_timeout: float = 10.0,
        shared_blocks: Iterable[BlockHash] = (),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not callable(clock):
            raise InvalidArgumentError(f"clock must be callable, got {clock!r:.60}")
        self._clock = clock
        self._tenancy = Tenancy(shared_blocks)
        layout = describe_kv_caches(kv_caches)
        self.block_bytes = layout.block_bytes
        self.num_layers = len(layout.layers)
        """The KV cache's tensors: the layers a load's ``LayerProgress`` counts."""
        num_cpu_blocks = positive_int("num_cpu_blocks", num_cpu_blocks)
        check_host_memory(num_cpu_blocks, self.block_bytes)
        if not isinstance(enable_events, bool):
            raise InvalidArgumentError(f"enable_events must be a bool, got {enable_events!r}")
        self._tier_timeout = seconds("tier_timeout", tier_timeout, allow_zero=False)
        self._room_timeout = seconds("room_timeout", room_timeout, allow_zero=True)
        self._close_timeout = seconds("close_timeout", close_timeout, allow_zero=True)
        self.block_size = positive_int("block_size", block_size)
        self.namespace = cache_namespace(cache_identity, kv_caches, block_size)
        self.manager = CPUOffloadingManager(
            num_cpu_blocks, block_size=block_size, policy=policy, enable_events=enable_events
        )
        self.write_policy: WritePolicy = write_policy
        self.enable_events = enable_events
        self._state = Lifecycle.NEW
        self._kv_caches = kv_caches
        self._specs = tier_specs(secondary_tiers)
        # What the engine runs on, made at start and closed in the one safe order: the
        # tiers (they use host-pool slots), the copier (slots and device blocks), the pool.
        self._pool: HostPool | None = None
        self._copier: DeviceCopier | None = None
        self.tiers: list[SecondaryTierManager] = []
        """The secondary tiers, fastest first (built when the engine is entered)."""
        self._clients: list[TierClient] = []  # one per tier, in its order
        # Until entered, a core without tiers answers the queries and checks the policy.
        self._core = job_core.JobCore(
            self.manager, (), num_device_blocks=0, block_bytes=0, write_policy=write_policy
        )
        self._loop: asyncio.AbstractEventLoop | None = None
        self._jobs: dict[int, Job] = {}  # jobs without their cascaded answer yet
        self._flushes: dict[int, asyncio.Future[bool]] = {}
        self._timers: dict[int, asyncio.TimerHandle] = {}
        self._progress: dict[int, LayerProgress] = {}  # layer-by-layer loads not copying yet
        self._observing = False  # a call of the core's observe_requests is scheduled
        self._finished = FinishedResults()
        self._drained = asyncio.Event()
        self._closed = asyncio.Event()
        self._latency = {"store": LatencyHistogram(), "load": LatencyHistogram()}
        # Bound once: a bound method made per copy or tier job is one more allocation.
        self._on_copy_end = self._copy_ended
        self._on_tier_end = self._tier_ended
        self._run_effect: dict[type, Callable[[Any], None]] = {
            job_core.CopyToHost: self._copy,
            job_core.CopyToDevice: self._copy,
            job_core.TierStore: self._send,
            job_core.TierLoad: self._send,
            job_core.Resolve: self._resolve,
            job_core.Cascaded: self._cascaded,
            job_core.FlushDone: self._flush_done,
            job_core.WaitForRoom: self._wait_for_room,
            job_core.Drained: lambda _: self._drained.set(),
        }

    @classmethod
    def from_config(
        cls,
        config: TieringConfig,
        kv_caches: KVCaches,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> TieringEngine:
        """The engine ``config`` describes over ``kv_caches``, not yet entered
        (``engine.cpu_bytes``: as many CPU slots as fit), its write budgets counted on
        ``clock``. Raises ConfigError for a non-TieringConfig or a ``cpu_bytes`` holding
        no block, else as the constructor."""
        if not isinstance(config, TieringConfig):
            raise ConfigError(f"config = {config!r:.60}: expected a TieringConfig", field="config")
        options = dict(config.engine)  # the constructor's arguments, by name
        num_cpu_blocks, cpu_bytes = options.pop("cpu_blocks"), options.pop("cpu_bytes")
        if num_cpu_blocks is None:
            block_bytes = kv_block_bytes(kv_caches)
            num_cpu_blocks = (cpu_bytes or 0) // block_bytes
            if num_cpu_blocks == 0:
                raise ConfigError(
                    f"engine.cpu_bytes = {cpu_bytes!r}: holds no block of this KV cache "
                    f"({block_bytes} bytes per block)",
                    field="engine.cpu_bytes",
                )
        tiers = [tier.spec() for tier in config.tiers]
        return cls(kv_caches, num_cpu_blocks, secondary_tiers=tiers, clock=clock, **options)

    async def start(self) -> None:
        """Allocate the host pool, start the copier and the tiers (each reporting the keys
        it removes, with ``enable_events``), and open. Raises ClosedError if entered before,
        TieringError if the pool or a tier cannot start (everything started is released)."""
        if self._state is not Lifecycle.NEW:
            raise ClosedError("a TieringEngine can be entered once")
        self._loop = asyncio.get_running_loop()
        self._state = Lifecycle.CLOSING  # until open: a failure below leaves it closed
        n, size = self.manager.num_blocks, self.block_bytes
        try:
            try:
                # Off the loop: page-locking a pool of many GiB takes seconds.
                self._pool = pool = await asyncio.to_thread(HostPool, n, size)
            except (MemoryError, OSError) as exc:
                raise TieringError(
                    f"cannot allocate the host pool for num_cpu_blocks={n} ({n * size} bytes): "
                    f"{exc!r}"
                ) from exc
            self._copier = copier = DeviceCopier(self._kv_caches, pool)
            await copier.start()
            defaults = {"namespace": self.namespace}
            for spec in self._specs:
                tier = make_tier(spec, pool.view, size, defaults=defaults)
                client = TierClient(tier, timeout=self._tier_timeout)
                if self.enable_events:
                    tier.report_removals()
                self.tiers.append(tier)
                self._clients.append(client)
                await client.start()
        except BaseException:
            self._release_now()
            raise
        gates = make_gates(
            [getattr(tier, "admission", "all") for tier in self.tiers],
            [tier_capacity_blocks(tier) for tier in self.tiers],
            n,
            [getattr(tier, "write_budget", None) for tier in self.tiers],
            block_bytes=size,
            clock=self._clock,
        )
        self._core = job_core.JobCore(
            self.manager,
            self._clients,
            num_device_blocks=copier.num_device_blocks,
            block_bytes=self.block_bytes,
            write_policy=self.write_policy,
            room_timeout=self._room_timeout,
            enable_events=self.enable_events,
            take_removed=[tier.take_removed for tier in self.tiers],
            gates=gates,
        )
        self._state = Lifecycle.OPEN

    async def aclose(self) -> JobResult:
        """Close gracefully within ``close_timeout`` (docs/job-lifecycle.md#close); what
        the deadline cuts short (everything, if cancelled) stops as :meth:`close` does.
        Idempotent; returns the close's result (:meth:`JobCore.close_result`)."""
        if self._state is Lifecycle.NEW:
            return self.close()
        if self._state is not Lifecycle.OPEN:
            await self._closed.wait()
            return self._core.close_result()
        assert self._loop is not None
        self._state = Lifecycle.CLOSING
        deadline = self._loop.time() + self._close_timeout
        try:
            self._execute(self._core.begin_close())
            try:
                async with asyncio.timeout_at(deadline):
                    await self._drained.wait()
            except TimeoutError:
                logger.warning(
                    "engine: close_timeout (%gs) passed with work in flight; stopping hard",
                    self._close_timeout,
                )
                self._execute(self._core.hard_close())
            # The tiers' jobs get until the deadline to end; then every copy has ended too.
            for client in self._clients:
                await client.aclose(max(0.0, deadline - self._loop.time()))
            if self._copier is not None:
                await self._copier.aclose()
        finally:
            self._release_now()
        return self._core.close_result()

    def close(self) -> JobResult:
        """Hard stop, synchronous and idempotent: every unfinished job fails now, the tiers
        and copier stop, the host pool is released; returns the close's result."""
        self._release_now()
        return self._core.close_result()

    def _release_now(self) -> None:
        self._execute(self._core.hard_close())  # every job and flush answered
        result = self._core.close_result()
        if self._state is not Lifecycle.CLOSED and not result.success:
            logger.warning(
                "engine: closed without writing every CPU block back to every "
                "secondary tier (those in none are lost, see lost_blocks): %s",
                result.error,
            )
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()
        for client in self._clients:
            client.shutdown()
        if self._copier is not None:
            self._copier.close()  # its copies in flight waited for
        if self._pool is not None:
            self._pool.close()  # mapped on while a tier holds a view
        self._state = Lifecycle.CLOSED
        self._closed.set()

    @property
    def host_pool(self) -> HostPool:
        """The CPU tier's memory, while the engine is open."""
        if self._state is not Lifecycle.OPEN or self._pool is None:
            raise ClosedError(f"the engine is {self._state}; its host pool is not available")
        return self._pool

    def statistics(self) -> Statistics:
        """The CPU tier, the work in flight, :data:`~tiering.core.job_core.COUNTERS`, failures."""
        core, manager, size = self._core, self.manager, self.block_bytes
        return Statistics(
            state=self._state,
            jobs_in_flight=core.jobs_in_flight,
            bytes_in_flight=core.blocks_in_flight * size,
            used_blocks=len(manager),
            capacity_blocks=manager.num_blocks,
            used_bytes=len(manager) * size,
            capacity_bytes=manager.num_blocks * size,
            pinned_blocks=manager.num_pinned,
            counters=core.counters,
            failures=core.failures.counts,
        )

    def admission_counters(self) -> list[dict[str, int]]:
        """Per secondary tier, fastest first: the blocks offered to it that it admitted,
        that its admission rule refused and that were over its write budget
        (:meth:`~tiering.core.admission.WriteGate.counters`); empty before it is entered."""
        return [gate.counters() for gate in self._core.gates]

    def job_latency(self) -> Mapping[str, LatencySnapshot]:
        """``"store"`` and ``"load"`` latencies so far, from the call to the job's result
        (failed jobs too), on ``time.perf_counter``."""
        return {kind: histogram.snapshot() for kind, histogram in self._latency.items()}

    def lookup_statistics(self) -> job_core.LookupStatistics:
        """What :meth:`lookup` has answered so far; zeros before the engine is entered."""
        return self._core.lookup_statistics()

    def __repr__(self) -> str:
        return f"<TieringEngine {self.statistics()!r}>"

    def lookup(self, block_hashes: Sequence[BlockHash], *, tenant: str | None = None) -> int:
        """Leading hashes (of ``tenant``'s blocks) ready in the CPU tier or stored in a
        secondary tier."""
        core = self._open_core()
        if tenant is None:
            hit = core.lookup(block_hashes)
        else:
            hit = core.lookup(self.tenant_keys(block_hashes, tenant), tenant_label(tenant))
        if not self._observing and core.observations_pending:
            # The admission rules' bookkeeping runs after the caller's step, not in it.
            assert self._loop is not None
            self._observing = True
            self._loop.call_soon(self._observe_requests)
        return hit

    def _observe_requests(self) -> None:
        self._observing = False
        self._core.observe_requests()

    def touch(self, block_hashes: Sequence[BlockHash], *, tenant: str | None = None) -> None:
        """Mark blocks (of ``tenant``) recently used in every tier, the first most."""
        self._open_core()  # raises unless open
        hashes = self.tenant_keys(block_hashes, tenant)
        self.manager.touch(hashes)
        for client in self._clients:
            client.touch(hashes)

    def tenant_keys(
        self, block_hashes: Sequence[BlockHash], tenant: str | None = None
    ) -> list[BlockHash]:
        """The keys ``tenant``'s blocks are stored under (and events name): without a
        tenant, the hashes themselves."""
        hashes = hash_list("block_hashes", block_hashes)
        keys = self._tenancy.keys(hashes, check_tenant(tenant))
        return keys if isinstance(keys, list) else list(keys)

    def share_prefix(self, block_hashes: Iterable[BlockHash]) -> None:
        """Let every tenant hit on these blocks (a public prefix's hashes), for good: a
        call's leading shared blocks keep their plain hash, the rest are the tenant's own."""
        self._tenancy.share(block_hashes)

    def tenant_statistics(self) -> dict[str, TenantLookups]:
        """Lookups per tenant label (:meth:`~tiering.core.job_core.JobCore.tenant_statistics`)."""
        return self._core.tenant_statistics()

    def take_events(self) -> list[OffloadingEvent]:
        """Events since the last call (with ``enable_events``): the CPU tier's, then the
        secondary tiers', each medium's in order."""
        events = self.manager.take_events()
        events.extend(self._core.take_tier_events())
        return events

    def get_finished(self) -> list[JobResult]:
        """Results of the jobs finished since the last call; never blocks. Beyond
        :data:`~tiering.core.job.FINISHED_KEPT` undrained, the oldest go, with one warning."""
        return self._finished.drain()

    def store(
        self,
        block_hashes: Sequence[BlockHash],
        device_block_ids: Sequence[int],
        *,
        tenant: str | None = None,
    ) -> Job:
        """Copy device blocks into the CPU tier (then, by policy, to secondary tiers); returns
        at once (:meth:`~tiering.core.job_core.JobCore.store`). Once the job resolves the
        device blocks may be reused."""
        return self._call("store", block_hashes, device_block_ids, tenant)

    def load(
        self,
        block_hashes: Sequence[BlockHash],
        device_block_ids: Sequence[int],
        *,
        tenant: str | None = None,
        progress: LayerProgress | None = None,
    ) -> Job:
        """Copy blocks into device blocks, promoting them from a secondary tier if
        needed; returns at once (:meth:`~tiering.core.job_core.JobCore.load`). Raises
        BlockNotFoundError for a hash no tier holds, changing nothing.

        ``progress``, a fresh ``LayerProgress(engine.num_layers)``, is marked layer by
        layer as the copy lands, so a forward may read layer ``i`` before the job ends;
        if any block of the load fails, every layer not marked fails (recompute)."""
        if check_progress(progress, self.num_layers) is not None and any(
            p is progress for p in self._progress.values()
        ):
            raise InvalidArgumentError(f"progress is in use already: {progress!r}")
        return self._call("load", block_hashes, device_block_ids, tenant, progress)

    async def flush(self) -> bool:
        """Copy every ready CPU block to each secondary tier that lacks it; True if every
        tier took every block. Cancelling the caller does not stop the flush."""
        flush_id, effects = self._open_core().flush()
        assert self._loop is not None
        future: asyncio.Future[bool] = self._loop.create_future()
        self._flushes[flush_id] = future
        self._execute(effects)
        return await asyncio.shield(future)

    def _call(
        self,
        kind: Literal["store", "load"],
        block_hashes: Sequence[BlockHash],
        device_block_ids: Sequence[int],
        tenant: str | None,
        progress: LayerProgress | None = None,
    ) -> Job:
        started = perf_counter()
        core = self._open_core()
        # Without a tenant the core checks the caller's hashes itself.
        keys = block_hashes if tenant is None else self.tenant_keys(block_hashes, tenant)
        job_id, effects = (core.store if kind == "store" else core.load)(keys, device_block_ids)
        names = None if keys is block_hashes else dict(zip(keys, block_hashes, strict=True))
        assert self._loop is not None
        job = self._jobs[job_id] = Job(job_id, kind, self._loop, started, names)
        if progress is not None:
            self._progress[job_id] = progress  # handed to the job's copy to the device
        self._execute(effects)
        return job

    def _execute(self, effects: list[job_core.Effect]) -> None:
        run = self._run_effect
        for effect in effects:
            run[type(effect)](effect)

    def _copy(self, effect: job_core.CopyToHost | job_core.CopyToDevice) -> None:
        """Start the copy ``effect`` asks for, marking its load's progress as layers land."""
        assert self._copier is not None
        to_host = type(effect) is job_core.CopyToHost
        progress = None
        if self._progress and isinstance(effect, job_core.CopyToDevice):
            progress = self._progress.pop(effect.job, None)
            if progress is not None and not effect.whole:
                progress.fail("a block of the load failed before its copy")
                progress = None
        try:
            self._copier.submit(
                to_host, effect.device_ids, effect.slots, self._on_copy_end, effect.op, progress
            )
        except TieringError as exc:  # the copier is closed: the copy never started
            if progress is not None:
                progress.fail(exc)
            asyncio.get_running_loop().call_soon(self._on_copy_end, effect.op, exc)

    def _send(self, effect: job_core.TierStore | job_core.TierLoad) -> None:
        kind = "store" if type(effect) is job_core.TierStore else "load"
        done = partial(self._on_tier_end, effect.op)
        self._clients[effect.tier].submit(kind, effect.keys, effect.slots, done, checked=True)

    def _copy_ended(self, op: int, error: BaseException | None) -> None:
        self._execute(self._core.copy_done(op, None if error is None else repr(error)))

    def _tier_ended(self, op: int, outcome: TierOutcome) -> None:
        self._execute(self._core.tier_done(op, outcome))

    def _resolve(self, effect: job_core.Resolve) -> None:
        job = self._jobs[effect.job]
        if self._progress and (progress := self._progress.pop(effect.job, None)) is not None:
            # The load ended without a copy of its own: nothing to copy, or nothing left.
            if effect.result.success:
                progress.mark_all()
            else:
                progress.fail(effect.result.error or "the load failed")
        self._latency[job.kind].observe(perf_counter() - job.started)
        self._finished.append(job._set_result(effect.result))
        if job.kind == "load":
            job._set_cascaded(True)
            del self._jobs[effect.job]
        if (timer := self._timers.pop(effect.job, None)) is not None:
            timer.cancel()

    def _cascaded(self, effect: job_core.Cascaded) -> None:
        if (job := self._jobs.pop(effect.job, None)) is not None:
            job._set_cascaded(effect.ok)

    def _flush_done(self, effect: job_core.FlushDone) -> None:
        if (future := self._flushes.pop(effect.flush, None)) and not future.done():
            future.set_result(effect.ok)

    def _wait_for_room(self, effect: job_core.WaitForRoom) -> None:
        assert self._loop is not None
        self._timers[effect.job] = self._loop.call_later(
            effect.seconds, self._room_expired, effect.job
        )

    def _room_expired(self, job_id: int) -> None:
        self._timers.pop(job_id, None)
        self._execute(self._core.room_expired(job_id))

    def _open_core(self) -> job_core.JobCore:
        if self._state is not Lifecycle.OPEN:
            raise ClosedError(f"the engine is {self._state}; no new jobs are accepted")
        return self._core
