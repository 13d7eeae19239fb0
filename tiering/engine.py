"""The asyncio engine: the CPU tier, the device gateway and the secondary tiers together.

:class:`TieringEngine` is the thin async shell over :class:`~tiering.planner.TransferPlanner`.
Each public call decides synchronously (validate, plan, reserve slots and pins), starts
what can start at once, and returns a :class:`Job`. The rest of the job runs as a task
owned by the engine's :class:`asyncio.TaskGroup`, so a caller that stops awaiting a job
never leaves a slot or pin behind: ownership follows the copy, not the awaiter.

Job life cycle:

* store: device → CPU slot (the copy starts at the call, ordered after the compute
  stream) → ``complete_store`` → the job resolves. Under ``write_through`` the blocks
  then cascade CPU → every secondary tier in the background (``job.cascaded``).
* load: CPU-ready blocks are pinned at the call; blocks only a secondary tier holds get
  a CPU slot at once (so two loads never promote one block twice) and are promoted
  tier → CPU; then CPU → device; the pins drop when the copy is done.
* ``write_back``: nothing cascades at store time; a block evicted from the CPU tier is
  written to the secondary tiers before its slot is refilled.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import (
    Awaitable,
    Callable,
    Coroutine,
    Generator,
    Iterable,
    Mapping,
    Sequence,
)
from types import TracebackType
from typing import Any, Literal, Self, TypeVar

import torch

from tiering.abstract import BlockHash, OffloadingEvent, as_block_hashes
from tiering.actor import TierActor
from tiering.device import CopyHandle, DeviceCopier, KVCaches, kv_block_bytes
from tiering.errors import BlockNotFoundError, ClosedError, InvalidArgumentError
from tiering.host_pool import HostPool
from tiering.manager import CPUOffloadingManager
from tiering.planner import LoadPlan, StorePlan, TransferPlanner
from tiering.policies import EvictionPolicy
from tiering.registry import TierSpec, make_tier
from tiering.secondary import JobMetadata, JobResult, SecondaryTierManager

logger = logging.getLogger(__name__)

WritePolicy = Literal["write_through", "write_back"]

_FOREIGN_POLL_S = 0.001
_Plan = TypeVar("_Plan")
_Cascades = list[tuple[int, list[tuple[BlockHash, int]]]]


class Job:
    """An awaitable handle of one engine store or load.

    ``await job`` returns its :class:`JobResult` (it never raises for a failed job).
    Cancelling a task that awaits the job does not cancel the job. For a store,
    ``await job.cascaded`` returns True once every secondary tier holds the blocks
    (at once when there is nothing to cascade, False if a tier failed).
    """

    __slots__ = ("_cascaded", "_result", "job_id", "kind")

    def __init__(
        self,
        job_id: int,
        kind: Literal["store", "load"],
        result: asyncio.Future[JobResult],
        cascaded: asyncio.Future[bool],
    ) -> None:
        self.job_id = job_id
        self.kind = kind
        self._result = result
        self._cascaded = cascaded

    def __await__(self) -> Generator[Any, None, JobResult]:
        return asyncio.shield(self._result).__await__()

    def done(self) -> bool:
        """True once the job's result is known."""
        return self._result.done()

    def result(self) -> JobResult:
        """The result of a finished job; raises ``asyncio.InvalidStateError`` before."""
        return self._result.result()

    @property
    def cascaded(self) -> Awaitable[bool]:
        """Resolves once the store's blocks are in every secondary tier (see class doc)."""
        return asyncio.shield(self._cascaded)

    def __repr__(self) -> str:
        state = "done" if self.done() else "running"
        return f"<Job {self.job_id} {self.kind} {state}>"


class TieringEngine:
    """KV blocks across device, CPU and secondary tiers, driven by one asyncio loop.

    Use as ``async with TieringEngine(kv_caches, num_cpu_blocks) as engine:``, entered
    and left in one task on the loop that calls it. Methods are for that loop's thread.

    Args:
        kv_caches: the serving framework's device KV cache: one tensor or per-layer
            tensors whose first dimension is the block id (CUDA or CPU).
        num_cpu_blocks: slots of the CPU tier (the host pool).
        policy: the CPU tier's eviction policy, by name or instance.
        secondary_tiers: tiers below the CPU tier, fastest first. Each is a registered
            type name, a mapping ``{"type": name, **kwargs}``, or a factory
            ``(primary_kv_view, block_bytes) -> SecondaryTierManager``.
        write_policy: ``"write_through"`` (every stored block cascades to every
            secondary tier) or ``"write_back"`` (a block cascades when evicted from CPU).
        block_size: tokens per block (reported in events).
        enable_events: collect :class:`OffloadingEvent` records for ``take_events``.
        cache_identity: what the KV bytes mean beyond their layout, typically the model
            id and revision (and e.g. the tensor-parallel rank). With the KV layout it
            forms ``engine.namespace``, which persistent tiers that take a ``namespace``
            (NVMe) receive unless their spec sets one: a different model or layout can
            then never read this engine's blocks.
        tier_timeout: seconds to wait for a result from a tier that is not a
            :class:`TierActor` (such a tier may drop a job silently).
        room_timeout: seconds a store or load waits for CPU slots to free up when every
            slot is pinned or being filled; then it fails.
        close_timeout: seconds a graceful close waits for running jobs before
            cancelling them.

    Raises:
        InvalidArgumentError: a malformed KV cache, size, write policy or tier spec.
        UnknownPolicyError / UnknownTierError: a name nothing is registered under.
    """

    def __init__(
        self,
        kv_caches: KVCaches,
        num_cpu_blocks: int,
        *,
        policy: str | EvictionPolicy = "lru",
        secondary_tiers: Sequence[TierSpec] = (),
        write_policy: WritePolicy = "write_through",
        block_size: int = 16,
        enable_events: bool = False,
        cache_identity: str | Mapping[str, Any] = "",
        tier_timeout: float = 30.0,
        room_timeout: float = 5.0,
        close_timeout: float = 10.0,
    ) -> None:
        if write_policy not in ("write_through", "write_back"):
            raise InvalidArgumentError(
                f"write_policy must be 'write_through' or 'write_back', got {write_policy!r}"
            )
        self.block_bytes = kv_block_bytes(kv_caches)
        self.namespace = cache_namespace(cache_identity, kv_caches, block_size)
        self.manager = CPUOffloadingManager(
            num_cpu_blocks, block_size=block_size, policy=policy, enable_events=enable_events
        )
        self.write_policy: WritePolicy = write_policy
        self.block_size = block_size
        self.enable_events = enable_events
        self._kv_caches = kv_caches
        self._tier_specs = list(secondary_tiers)
        self._tier_timeout = tier_timeout
        self._close_timeout = close_timeout
        self._room_timeout = room_timeout
        self.tiers: list[SecondaryTierManager] = []
        self._pool: HostPool | None = None
        self._copier: DeviceCopier | None = None
        self._planner: TransferPlanner | None = None
        self._stack: contextlib.AsyncExitStack | None = None
        self._task_group: asyncio.TaskGroup | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._state: Literal["new", "open", "closing", "closed"] = "new"
        self._tasks: set[asyncio.Task[None]] = set()
        self._fills: dict[BlockHash, asyncio.Future[bool]] = {}
        self._finished: list[JobResult] = []
        self._open_jobs: dict[int, Job] = {}
        self._tier_events: list[OffloadingEvent] = []
        self._next_job_id = 0
        self._next_tier_job_id = 0
        self._foreign_waiting: dict[tuple[int, int], asyncio.Future[JobResult]] = {}
        self._foreign_wakeup: asyncio.Event | None = None
        self._room_freed = asyncio.Event()
        self.stats = {
            "bytes_to_host": 0,
            "bytes_to_device": 0,
            "promoted_blocks": 0,
            "cascaded_blocks": 0,
            "written_back_blocks": 0,
            "failed_jobs": 0,
        }

    # ------------------------------------------------------------------ lifetime

    async def __aenter__(self) -> Self:
        if self._state != "new":
            raise ClosedError("a TieringEngine can be entered once")
        self._loop = asyncio.get_running_loop()
        async with contextlib.AsyncExitStack() as stack:
            # Off the loop: page-locking a pool of many GiB takes seconds.
            pool = await asyncio.to_thread(HostPool, self.manager.num_blocks, self.block_bytes)
            stack.callback(pool.close)
            self._copier = await stack.enter_async_context(DeviceCopier(self._kv_caches, pool))
            for spec in self._tier_specs:
                tier = make_tier(
                    spec, pool.view, self.block_bytes, defaults={"namespace": self.namespace}
                )
                stack.callback(tier.shutdown)
                if isinstance(tier, TierActor):
                    await tier.start()
                    stack.push_async_callback(tier.aclose, self._close_timeout)
                self.tiers.append(tier)
            self._task_group = await stack.enter_async_context(asyncio.TaskGroup())
            self._pool = pool
            self._planner = TransferPlanner(
                self.manager,
                [t.lookup for t in self.tiers],
                servable=[getattr(t, "holds_data", True) for t in self.tiers],
            )
            if any(not isinstance(t, TierActor) for t in self.tiers):
                self._foreign_wakeup = asyncio.Event()
                self._spawn(self._pump_foreign_tiers(), name="pump")
            self._stack = stack.pop_all()
        self._state = "open"
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close gracefully: stop admitting jobs, let running ones finish within
        ``close_timeout``, cancel the rest (their results report failure), then stop the
        tiers, the copier and the host pool. Under ``write_back`` the CPU tier's blocks
        are first flushed to the secondary tiers (within ``close_timeout``). Idempotent."""
        stack, self._stack = self._stack, None
        if stack is None:
            self._state = "closed"
            return
        self._state = "closing"
        assert self._loop is not None
        deadline = self._loop.time() + self._close_timeout
        if self.write_policy == "write_back" and self.tiers:
            # Write-back holds the only copy of blocks stored since their last eviction.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._flush(), self._close_timeout)
        while True:
            # Re-read each time: a job that waited for room may have started its copy task.
            jobs = [t for t in self._tasks if not t.done() and t.get_name() != "pump"]
            remaining = deadline - self._loop.time()
            if not jobs or remaining <= 0:
                break
            await asyncio.wait(jobs, timeout=remaining)
        for task in self._tasks:
            task.cancel()
        try:
            await stack.aclose()
        finally:
            self._state = "closed"
            self._fail_unfinished()

    async def flush(self) -> bool:
        """Copy every ready CPU block to each secondary tier that lacks it.

        Under ``write_back`` this makes the lower tiers complete (a graceful close does it
        too, within ``close_timeout``); under ``write_through`` it retries cascades that
        failed. Returns True if every tier took every block.

        Raises:
            ClosedError: the engine is not open.
        """
        self._check_open()
        return await self._flush()

    async def _flush(self) -> bool:
        return await self._run_cascades(self._plan_cascades(self.manager.ready_hashes()))

    def close(self) -> None:
        """Hard stop, synchronous and idempotent: cancel every job task and stop the tiers.

        Prefer ``aclose`` (or leaving the ``async with``); this is the fallback when the
        loop cannot wait. The host pool and the copier are released by the ``aclose`` that
        leaving the ``async with`` still performs, once the copies in flight have ended.
        """
        if self._state in ("new", "closed"):
            self._state = "closed"
            return
        self._state = "closing"
        for task in list(self._tasks):
            task.cancel()
        for tier in self.tiers:
            tier.shutdown()
        self._fail_unfinished()

    def _check_open(self) -> None:
        if self._state != "open":
            raise ClosedError(f"the engine is {self._state}; no new jobs are accepted")

    @property
    def host_pool(self) -> HostPool:
        """The CPU tier's memory (valid while the engine is open)."""
        if self._pool is None:
            raise ClosedError("the engine is not open")
        return self._pool

    # ------------------------------------------------------------------- queries

    def lookup(self, block_hashes: Iterable[BlockHash]) -> int:
        """Leading hashes that are ready in the CPU tier or stored in a secondary tier."""
        self._check_open()
        assert self._planner is not None
        return self._planner.lookup(block_hashes)

    def touch(self, block_hashes: Iterable[BlockHash]) -> None:
        """Mark blocks recently used in every tier, the first hash most recently."""
        self._check_open()
        hashes = as_block_hashes(block_hashes)
        self.manager.touch(hashes)
        for tier in self.tiers:
            tier.touch(hashes)

    def take_events(self) -> list[OffloadingEvent]:
        """CPU-tier events, then secondary-tier store events, since the last call."""
        events = self.manager.take_events()
        events.extend(self._tier_events)
        self._tier_events = []
        return events

    def get_finished(self) -> list[JobResult]:
        """Results of the engine jobs that finished since the last call; never blocks."""
        finished, self._finished = self._finished, []
        return finished

    # -------------------------------------------------------------------- stores

    def store(self, block_hashes: Iterable[BlockHash], device_block_ids: Sequence[int]) -> Job:
        """Copy device blocks into the CPU tier (then, by policy, to secondary tiers).

        Blocks already in the CPU tier are skipped. The job resolves once the new blocks
        are ready in CPU; the device blocks may then be reused. If every CPU slot is
        pinned or being filled, the job waits up to ``room_timeout`` for one to free up,
        then fails (``success=False``) having changed nothing.

        Raises:
            ClosedError: the engine is not open.
            InvalidArgumentError: non-bytes hashes, a length mismatch, or a device block
                id outside the device KV cache; nothing changed.
        """
        self._check_open()
        assert self._planner is not None and self._copier is not None
        hashes = as_block_hashes(block_hashes)
        ids = list(device_block_ids)
        self._copier.check_block_ids(ids)
        planner = self._planner
        return self._admit(
            "store", hashes, lambda: planner.plan_store(hashes, ids), self._start_store
        )

    def _admit(
        self,
        kind: Literal["store", "load"],
        hashes: Sequence[BlockHash],
        plan: Callable[[], _Plan | None],
        start: Callable[[Job, _Plan], None],
    ) -> Job:
        """Plan now and start, or wait for CPU room in a task; the job either way."""
        first = plan()  # raises (changing nothing) on bad input
        job = self._new_job(kind)
        if first is not None:
            start(job, first)
        elif len(set(hashes)) > self.manager.num_blocks:
            self._fail_at_once(job, hashes, f"the {kind} is larger than the CPU tier")
        else:
            self._spawn(self._start_when_room(job, hashes, plan, start))
        return job

    async def _start_when_room(
        self,
        job: Job,
        hashes: Sequence[BlockHash],
        plan: Callable[[], _Plan | None],
        start: Callable[[Job, _Plan], None],
    ) -> None:
        try:
            ready = await self._when_room(plan)
        except BlockNotFoundError as exc:  # a load's block left every tier meanwhile
            self._fail_at_once(job, hashes, str(exc))
            return
        if ready is None:
            self._fail_at_once(job, hashes, f"no CPU slot freed up within {self._room_timeout} s")
        else:
            start(job, ready)

    def _start_store(self, job: Job, plan: StorePlan) -> None:
        assert self._copier is not None and self._loop is not None
        for h in plan.hashes:
            self._fills[h] = self._loop.create_future()
        if not plan.hashes:
            self._store_done(job, plan, None)
        elif self.write_policy == "write_back" and plan.evicted:
            self._spawn(self._run_store(job, plan))  # the victims leave before the refill
        else:
            # The common case needs no task: the copy's completion finishes the job.
            copy = self._copier.to_host(plan.device_ids, plan.slots)
            copy.add_done_callback(lambda done: self._store_done(job, plan, done.error))

    async def _run_store(self, job: Job, plan: StorePlan) -> None:
        """A store whose slots must first be written back, then copied into."""
        assert self._copier is not None
        copy = None
        error: BaseException | None = None
        try:
            await self._write_back(plan.evicted, plan.evicted_slots)
            copy = self._copier.to_host(plan.device_ids, plan.slots)
            await copy
        except Exception as exc:  # a failed copy fails this job only
            error = exc
        finally:
            if copy is None or copy.done():
                self._store_done(job, plan, error)
            else:  # cancelled mid-copy: the slots stay filling until the copy has ended
                copy.add_done_callback(lambda done: self._store_done(job, plan, done.error))

    def _store_done(self, job: Job, plan: StorePlan, error: BaseException | None) -> None:
        """The device -> CPU copy ended: publish the blocks, resolve the job, cascade."""
        ok = error is None
        if ok:
            self._end_fills(plan.hashes, [])
            self.stats["bytes_to_host"] += len(plan.hashes) * self.block_bytes
            self._finish(job, JobResult(job.job_id, True))
        else:
            reason = f"device to CPU copy failed: {error!r}"
            logger.warning("store job %d: %s", job.job_id, reason)
            self._end_fills([], plan.hashes)
            self._finish(job, JobResult(job.job_id, False, tuple(plan.hashes), reason))
        if not (ok and plan.hashes and self.tiers and self.write_policy == "write_through"):
            self._set_cascaded(job, ok)
        elif self._state != "open":
            self._set_cascaded(job, False)
        else:
            # Pin the blocks for every tier now, in the step that made them ready: no
            # eviction may slip in before they have reached the lower tiers.
            self._spawn(self._cascade_job(job, self._plan_cascades(plan.hashes)))

    async def _cascade_job(self, job: Job, cascades: _Cascades) -> None:
        self._set_cascaded(job, await self._run_cascades(cascades))

    def _plan_cascades(self, hashes: list[BlockHash]) -> _Cascades:
        """Pin, per tier, the ready blocks of ``hashes`` it lacks: ``(tier, [(hash, slot)])``."""
        assert self._planner is not None
        return [(t, self._planner.plan_cascade(hashes, t)) for t in range(len(self.tiers))]

    async def _run_cascades(self, cascades: _Cascades) -> bool:
        """Copy planned cascades to their tiers; True if every block landed."""
        try:
            results = await asyncio.gather(*(self._cascade(t, items) for t, items in cascades))
        finally:
            for _, items in cascades:  # the pins drop only once no tier reads the slots
                self._release([k for k, _ in items])
        return all(results)

    async def _cascade(self, t: int, items: list[tuple[BlockHash, int]]) -> bool:
        """Copy pinned, ready CPU blocks ``(hash, slot)`` to tier ``t``; True if all landed."""
        if not items:
            return True
        keys = [k for k, _ in items]
        result = await self._tier_job(t, "store", keys, [s for _, s in items])
        self._record_tier_store(t, keys, result)
        self.stats["cascaded_blocks"] += len(keys) - len(result.failed_keys)
        return result.success

    async def _write_back(self, victims: list[BlockHash], slots: list[int]) -> None:
        """Write evicted blocks (still intact in their old slots) to the secondary tiers."""
        if not victims or self.write_policy != "write_back" or not self.tiers:
            return

        async def to_tier(t: int) -> None:
            look = self.tiers[t].lookup
            items = [(k, s) for k, s in zip(victims, slots, strict=True) if look(k) is not True]
            if items:
                keys = [k for k, _ in items]
                result = await self._tier_job(t, "store", keys, [s for _, s in items])
                self._record_tier_store(t, keys, result)
                self.stats["written_back_blocks"] += len(keys) - len(result.failed_keys)

        await asyncio.gather(*(to_tier(t) for t in range(len(self.tiers))))

    # --------------------------------------------------------------------- loads

    def load(self, block_hashes: Iterable[BlockHash], device_block_ids: Sequence[int]) -> Job:
        """Copy blocks into device blocks, promoting them from a secondary tier if needed.

        A block being stored or promoted by another job is awaited, not copied twice.
        Keys that could not be read (a tier failed or the data did not verify) are
        reported in ``failed_keys``; the others still land on the device. If the CPU
        tier has no room for the promotions, the job waits for room as a store does.

        Raises:
            ClosedError: the engine is not open.
            InvalidArgumentError: non-bytes hashes, a length mismatch, or device block ids
                out of range or repeated; nothing changed.
            BlockNotFoundError: a hash no tier holds; nothing changed.
        """
        self._check_open()
        assert self._planner is not None and self._copier is not None
        hashes = as_block_hashes(block_hashes)
        ids = list(device_block_ids)
        self._copier.check_block_ids(ids)
        if len(set(ids)) != len(ids):
            raise InvalidArgumentError("device_block_ids repeats a block; each is written once")
        planner = self._planner
        plan = lambda: planner.plan_load(hashes, ids)  # noqa: E731 -- retried when room frees
        return self._admit("load", hashes, plan, self._start_load)

    def _start_load(self, job: Job, plan: LoadPlan) -> None:
        assert self._loop is not None and self._copier is not None
        if not plan.awaited and not plan.evicted:
            # Every block is ready and pinned in CPU: no task, the copy finishes the job.
            copy = self._copier.to_device(plan.slots, plan.device_ids)
            copy.add_done_callback(lambda done: self._load_from_cpu_done(job, plan, done.error))
            return
        for items in plan.promotions.values():
            for h, _ in items:
                self._fills[h] = self._loop.create_future()
        # Every awaited block is mid-fill now, so its future exists; take it before the
        # fill can end and drop it.
        awaited = {h: self._fills[h] for h in dict.fromkeys(plan.awaited)}
        self._spawn(self._run_load(job, plan, awaited))

    async def _when_room(self, plan: Callable[[], _Plan | None]) -> _Plan | None:
        """Retry ``plan`` each time CPU slots or pins are released, until the deadline."""
        assert self._loop is not None
        deadline = self._loop.time() + self._room_timeout
        while True:
            self._room_freed.clear()  # before planning, so no release goes unseen
            result = plan()
            remaining = deadline - self._loop.time()
            if result is not None or remaining <= 0:
                return result
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._room_freed.wait(), remaining)

    def _fail_at_once(self, job: Job, hashes: Sequence[BlockHash], reason: str) -> None:
        self._finish(job, JobResult(job.job_id, False, tuple(hashes), reason))
        self._set_cascaded(job, False)

    def _set_cascaded(self, job: Job, value: bool) -> None:
        """Resolve ``job.cascaded``: the last thing that happens to a job."""
        self._open_jobs.pop(job.job_id, None)
        if not job._cascaded.done():
            job._cascaded.set_result(value)

    async def _run_load(
        self, job: Job, plan: LoadPlan, awaited: dict[BlockHash, asyncio.Future[bool]]
    ) -> None:
        assert self._copier is not None and self._planner is not None
        planner = self._planner
        held: list[BlockHash] = list(plan.pinned)  # pins this job owns
        taken: set[BlockHash] = set()  # awaited blocks whose pins are in ``held``
        failed: set[BlockHash] = set()
        promoted = [h for items in plan.promotions.values() for h, _ in items]
        copy = None
        error = None
        landed = False
        try:
            try:
                await self._write_back(plan.evicted, plan.evicted_slots)
                await asyncio.gather(
                    *(self._promote(t, items) for t, items in plan.promotions.items())
                )
            finally:
                # Whatever happened, no promotion of ours is left half-done.
                self._end_fills([], [h for h in promoted if h in self._fills])
            for h, fill in awaited.items():
                if await asyncio.shield(fill):
                    held.extend([h] * plan.awaited.count(h))
                    taken.add(h)
                else:
                    failed.add(h)
            pairs = [
                (s, d)
                for h, s, d in zip(plan.hashes, plan.slots, plan.device_ids, strict=True)
                if h not in failed
            ]
            if pairs:
                copy = self._copier.to_device([s for s, _ in pairs], [d for _, d in pairs])
                await copy
                self.stats["bytes_to_device"] += len(pairs) * self.block_bytes
            landed = True
        except Exception as exc:  # a failed copy or tier fails this job only
            error = f"load failed: {exc!r}"
            logger.warning("load job %d: %s", job.job_id, error)
        finally:
            if not landed:  # failed, or cancelled by a close: nothing is known to be there
                failed.update(plan.hashes)
                error = error or "the engine closed before the load finished"
            for h, fill in awaited.items():
                if h in taken:
                    continue
                n = plan.awaited.count(h)
                if not fill.done():
                    planner.cancel_wait(h, n)  # a later fill must not pin for us
                elif fill.result():
                    held.extend([h] * n)  # landed while we were cancelled: ours to drop
            self._after(copy, lambda: self._release(held))
            failed_keys = tuple(h for h in plan.hashes if h in failed)
            if error is None and failed_keys:
                error = f"{len(failed_keys)} block(s) could not be read from a tier"
            self._finish(job, JobResult(job.job_id, not failed_keys, failed_keys, error))
            self._set_cascaded(job, True)

    def _load_from_cpu_done(self, job: Job, plan: LoadPlan, error: BaseException | None) -> None:
        self._release(plan.pinned)
        if error is None:
            self.stats["bytes_to_device"] += len(plan.hashes) * self.block_bytes
            self._finish(job, JobResult(job.job_id, True))
        else:
            reason = f"load failed: {error!r}"
            logger.warning("load job %d: %s", job.job_id, reason)
            self._finish(job, JobResult(job.job_id, False, tuple(plan.hashes), reason))
        self._set_cascaded(job, True)

    async def _promote(self, t: int, items: list[tuple[BlockHash, int]]) -> None:
        keys = [k for k, _ in items]
        result = await self._tier_job(t, "load", keys, [s for _, s in items])
        bad = set(result.failed_keys) if result.failed_keys else set()
        if not result.success and not bad:
            bad = set(keys)
        ok = [k for k in keys if k not in bad]
        self.stats["promoted_blocks"] += len(ok)
        self._end_fills(ok, [k for k in keys if k in bad])

    # ------------------------------------------------------------- fill futures

    def _release(self, held: list[BlockHash]) -> None:
        assert self._planner is not None
        self._planner.release(held)
        self._room_freed.set()

    def _end_fills(self, ok: list[BlockHash], failed: list[BlockHash]) -> None:
        """Apply finished CPU fills and wake the loads waiting for them, in one step."""
        assert self._planner is not None
        self._planner.finish_fill(ok, failed)
        self._room_freed.set()
        for hashes, landed in ((ok, True), (failed, False)):
            for h in hashes:
                fill = self._fills.pop(h, None)
                if fill is not None and not fill.done():
                    fill.set_result(landed)

    def _fail_unfinished(self) -> None:
        """Resolve what a close cut short: no awaiter of a job or fill waits forever."""
        for fill in self._fills.values():
            if not fill.done():
                fill.set_result(False)
        self._fills.clear()
        for job in list(self._open_jobs.values()):
            self._fail_at_once(job, (), "the engine closed before the job finished")
        self._open_jobs.clear()

    # -------------------------------------------------------------- tier driving

    async def _tier_job(
        self, t: int, kind: Literal["store", "load"], keys: list[BlockHash], slots: list[int]
    ) -> JobResult:
        """Run one job on tier ``t``; tier failures come back as a failed result."""
        tier = self.tiers[t]
        self._next_tier_job_id += 1
        meta = JobMetadata(self._next_tier_job_id, keys, slots)
        try:
            if isinstance(tier, TierActor):
                await (tier.put_load(meta) if kind == "load" else tier.put_store(meta))
                result = await asyncio.shield(tier.result(meta.job_id))
                tier.get_finished()  # results are consumed through the future above
                return result
            waiter = self._loop.create_future()  # type: ignore[union-attr]
            self._foreign_waiting[(t, meta.job_id)] = waiter
            (tier.submit_load if kind == "load" else tier.submit_store)(meta)
            assert self._foreign_wakeup is not None
            self._foreign_wakeup.set()
            try:
                return await asyncio.wait_for(asyncio.shield(waiter), self._tier_timeout)
            finally:
                self._foreign_waiting.pop((t, meta.job_id), None)
        except (Exception, TimeoutError) as exc:
            logger.warning("%s job on tier %s failed: %r", kind, tier.get_tier_type(), exc)
            return JobResult(meta.job_id, False, tuple(keys), repr(exc))

    async def _pump_foreign_tiers(self) -> None:
        """Poll tiers that are not actors for results; idle while none is awaited."""
        assert self._foreign_wakeup is not None
        while True:
            if not self._foreign_waiting:
                self._foreign_wakeup.clear()
                await self._foreign_wakeup.wait()
            for t, tier in enumerate(self.tiers):
                if isinstance(tier, TierActor):
                    continue
                for result in tier.get_finished():
                    waiter = self._foreign_waiting.get((t, result.job_id))
                    if waiter is not None and not waiter.done():
                        waiter.set_result(result)
            await asyncio.sleep(_FOREIGN_POLL_S)

    def _record_tier_store(self, t: int, keys: list[BlockHash], result: JobResult) -> None:
        if not self.enable_events:
            return
        bad = set(result.failed_keys)
        stored = [k for k in keys if k not in bad] if (result.success or bad) else []
        if stored:
            medium = self.tiers[t].get_tier_type().upper()
            self._tier_events.append(OffloadingEvent(stored, self.block_size, medium, False))

    # --------------------------------------------------------------- job helpers

    def _new_job(self, kind: Literal["store", "load"]) -> Job:
        assert self._loop is not None
        self._next_job_id += 1
        job = Job(self._next_job_id, kind, self._loop.create_future(), self._loop.create_future())
        self._open_jobs[job.job_id] = job
        return job

    def _finish(self, job: Job, result: JobResult) -> None:
        if job._result.done():
            return
        if not result.success:
            self.stats["failed_jobs"] += 1
        job._result.set_result(result)
        self._finished.append(result)

    @staticmethod
    def _after(copy: CopyHandle | None, action: Callable[[], None]) -> None:
        """Run ``action`` now, or when ``copy`` ends if it may still touch its slots."""
        if copy is None or copy.done():
            action()
        else:
            copy.add_done_callback(lambda _: action())

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str = "job") -> None:
        assert self._task_group is not None
        task = self._task_group.create_task(self._guarded(coro), name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        # A task cancelled before its first step never starts ``coro``: close it quietly.
        task.add_done_callback(lambda _: coro.close())

    @staticmethod
    async def _guarded(coro: Coroutine[Any, Any, None]) -> None:
        # A bug in one job must not cancel its siblings through the TaskGroup.
        try:
            await coro
        except Exception:
            logger.exception("engine task failed")


NAMESPACE_FORMAT = 1
"""Bumped when the meaning of the bytes of a stored block changes."""


def cache_namespace(identity: str | Mapping[str, Any], kv_caches: KVCaches, block_size: int) -> str:
    """A canonical string naming what a stored block's bytes mean.

    It covers ``identity`` (the model and whatever else the caller says), the block
    size in tokens, and every layer's dtype and per-block shape, so two engines share
    blocks only if all of these agree.

    Raises:
        InvalidArgumentError: ``identity`` is not a string or a JSON-encodable mapping.
    """
    tensors = [kv_caches] if isinstance(kv_caches, torch.Tensor) else list(kv_caches)
    layout = [[str(t.dtype).removeprefix("torch."), list(t.shape[1:])] for t in tensors]
    if not isinstance(identity, str | Mapping):
        raise InvalidArgumentError(
            f"cache_identity must be a string or a mapping, got {type(identity).__name__}"
        )
    try:
        return json.dumps(
            {
                "identity": identity,
                "block_size": block_size,
                "layout": layout,
                "format": NAMESPACE_FORMAT,
            },
            sort_keys=True,
            separators=(",", ":"),
        )
    except (TypeError, ValueError) as exc:
        raise InvalidArgumentError(f"cache_identity is not JSON-encodable: {exc}") from exc
