"""The asynchronous base of every secondary tier: an actor with a bounded inbox
(docs/architecture.md#tiers-are-actors). Its tasks belong to a task group of its own
runner task, so ``start`` and ``aclose`` may be called from any task of the loop."""

from __future__ import annotations

import asyncio
import functools
import logging
from abc import abstractmethod
from collections import Counter
from collections.abc import Callable, Coroutine
from typing import Any

from tiering.errors import ClosedError, InvalidArgumentError
from tiering.lifecycle import AsyncService, Lifecycle, running_loop
from tiering.observe.statistics import FailureLog, Statistics, uncount
from tiering.options import ActorOptions
from tiering.tiers.inbox import Inbox, InboxStatistics, Lane
from tiering.tiers.io_threads import RUNNING_JOB, IoThreads
from tiering.tiers.ledger import ResultsLedger, TierJob
from tiering.tiers.tier_api import (
    JobMetadata,
    JobResult,
    OffloadKey,
    SecondaryTierManager,
    checked_job,
)
from tiering.validation import seconds

logger = logging.getLogger(__name__)

# How long aclose waits, after cancelling, for hooks to unwind before failing their
# jobs anyway: a hook that swallows cancellation must not hang the caller.
_CANCEL_GRACE_S = 1.0


class TierActor(AsyncService, SecondaryTierManager, IoThreads):
    """A secondary tier served by an asyncio actor (its contract:
    docs/architecture.md#tiers-are-actors). A failed load's slots are undefined.

    Subclasses implement :meth:`_do_store` and :meth:`_do_load` (the bulk byte work in
    ONE :meth:`run_blocking` call per job), ``lookup``, ``get_num_blocks``,
    ``get_tier_type``, optionally ``touch``/``clear``/:meth:`_usage`."""

    def __init__(
        self,
        primary_kv_view: memoryview,
        block_bytes: int,
        *,
        inbox_size: int = 64,
        max_inflight: int = 4,
        io_threads: int = 4,
        admission: str = "all",
        write_budget: int | None = None,
    ) -> None:
        """Raises InvalidArgumentError if ``primary_kv_view`` is not a writable memoryview
        of whole blocks, or an option is not as :class:`ActorOptions` says."""
        given = {
            "inbox_size": inbox_size,
            "max_inflight": max_inflight,
            "io_threads": io_threads,
            "admission": admission,
            "write_budget": write_budget,
        }
        ActorOptions.check(given, owner=type(self).__name__)  # strict: the values as given
        super().__init__(primary_kv_view, block_bytes)
        if self.primary_kv_view.readonly:
            raise InvalidArgumentError("primary_kv_view must be writable (loads write into it)")
        self.inbox_size = inbox_size
        self.max_inflight = max_inflight
        self.io_threads = io_threads
        self.admission = admission
        """The rule the engine admits blocks to this tier by (:mod:`tiering.core.admission`)."""
        self.write_budget: float | None = write_budget
        """Bytes a second the engine writes to this tier at most (None: unbounded)."""

        self._state = Lifecycle.NEW
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: asyncio.Task[None] | None = None
        self._task_group: asyncio.TaskGroup | None = None
        self._inbox: Inbox[TierJob] = Inbox(self.inbox_size, owner=type(self).__name__)
        self._ledger = ResultsLedger(owner=type(self).__name__, on_delivered=self._delivered)
        self._failures = FailureLog(logger, type(self).__name__)
        self._running: set[TierJob] = set()  # jobs whose hook runs: at most max_inflight
        self._drained: asyncio.Future[None] | None = None  # set: closed, nothing queued or running
        self._dispatch_pending = False  # a dispatch of stores is scheduled
        self._closed_event = asyncio.Event()
        IoThreads.__init__(self, self.io_threads)
        self._background: set[asyncio.Task[None]] = set()  # spawn()ed, cancelled at close
        self._stopped = False  # close decided: every job failed or finished, pool shut

        self._reserved_ids: set[int] = set()  # put_* waiting for room
        self._storing: Counter[OffloadKey] = Counter()
        # Why jobs cut short by a close fail: the message, and its cause for statistics.
        self._cancel_reason = "cancelled: tier closed before the job finished"
        self._cancel_cause = "cancelled by close"

    async def start(self) -> None:
        """Start serving on the running loop; a no-op if already open. Raises
        ClosedError once closing, InvalidArgumentError if open on another loop."""
        if self._state in (Lifecycle.CLOSING, Lifecycle.CLOSED):
            raise ClosedError(f"{self._name()} is closed and cannot be restarted")
        loop = asyncio.get_running_loop()
        if self._state is Lifecycle.OPEN:
            if loop is not self._loop:
                raise InvalidArgumentError(f"{self._name()} already runs on another event loop")
            return
        self._loop = loop
        self._state = Lifecycle.OPEN
        self._runner = loop.create_task(self._run(), name=f"{self._name()}-runner")
        self._runner.add_done_callback(self._on_runner_done)
        # Let the runner enter its TaskGroup before the caller goes on.
        await asyncio.sleep(0)

    # The deadline is part of the close protocol, not a caller-side asyncio.timeout.
    async def aclose(self, timeout: float = 5.0) -> None:  # noqa: ASYNC109
        """Close gracefully: admit nothing more (waiting ``put_*`` calls raise
        ClosedError), let queued, parked and running jobs finish within ``timeout``
        seconds, then cancel the rest, failing each with the reason; returns once
        ``CLOSED`` (a job inside a :meth:`run_blocking` call is reported once the call
        returns). Idempotent; concurrent calls all return once closed. Cancelled, it
        stops the tier hard (:meth:`shutdown`) and propagates. Raises
        InvalidArgumentError for a bad ``timeout``."""
        seconds("timeout", timeout, allow_zero=True)
        if self._state is Lifecycle.NEW:
            self._stop(notify=True)
            return
        if self._state is not Lifecycle.OPEN:
            await self._closed_event.wait()  # set once CLOSED
            return

        self._state = Lifecycle.CLOSING
        self._inbox.close()
        self._dispatch()  # the runner ends at once if nothing is queued or running
        self._cancel_background()
        runner = self._runner
        assert runner is not None
        try:
            done, _ = await asyncio.wait({runner}, timeout=timeout)
            if not done:
                self._cancel_reason = (
                    f"cancelled: tier closed and the {timeout:g}s aclose deadline passed "
                    "before the job finished"
                )
                self._cancel_cause = "cancelled by close: aclose deadline passed"
                runner.cancel()
                done, _ = await asyncio.wait({runner}, timeout=_CANCEL_GRACE_S)
                if not done and self._ledger.pending > self._ledger.busy_jobs:
                    logger.warning(
                        "%s: a job ignored cancellation; failing it without waiting", self._name()
                    )
            self._stop(notify=True)
            # Jobs cut short inside a thread call get their result when it returns.
            await self._closed_event.wait()
        except asyncio.CancelledError:
            self.shutdown()
            raise

    def shutdown(self) -> None:
        """Stop at once: cancel every task, fail every unfinished job, shut the thread
        pool down without waiting (a job inside a :meth:`run_blocking` call gets its
        failure, and the tier ``CLOSED``, once the call returns). From another thread the
        stop is scheduled on the loop; with the loop stopped, results are recorded without
        resolving futures. Idempotent; safe before :meth:`start`."""
        loop = self._loop
        loop_running = loop is not None and loop.is_running() and not loop.is_closed()
        if loop_running and running_loop() is not loop:
            assert loop is not None
            loop.call_soon_threadsafe(self.shutdown)
            return
        if self._state is Lifecycle.CLOSED or self._stopped:
            return
        if self._state is not Lifecycle.NEW:
            self._state = Lifecycle.CLOSING
        self._cancel_reason = "cancelled: tier shut down before the job finished"
        self._cancel_cause = "cancelled by shutdown"
        if loop_running:
            self._cancel_background()
            if self._runner is not None and not self._runner.done():
                self._runner.cancel()
            self._cancel_running_jobs()
        else:
            # No loop will run the tasks again, so no thread call can report back.
            self._calls_running = 0
            for job in self._ledger.undelivered():
                while job.busy:
                    self._ledger.idle(job.meta.job_id)
        self._stop(notify=loop is None or not loop.is_closed())

    def statistics(self) -> Statistics:
        """State, jobs without a result and their bytes, what :meth:`_usage` reports,
        and failures by cause (the actor's own added to the subclass's)."""
        usage = dict(self._usage())
        failures = Counter(usage.pop("failures", {}))
        failures.update(self._failures.counts)
        return Statistics(
            state=self._state,
            jobs_in_flight=self._ledger.pending,
            bytes_in_flight=self._ledger.keys_pending * self.block_bytes,
            failures=failures,
            **usage,
        )

    def inbox_statistics(self) -> InboxStatistics:
        """A snapshot of the inbox."""
        return self._inbox.statistics()

    def _usage(self) -> dict[str, Any]:
        """What the tier holds, as cheap :class:`Statistics` fields."""
        return {"used_blocks": self.get_num_blocks()}

    def __repr__(self) -> str:
        return f"<{self._name()} {self.statistics()!r}>"

    def submit_store(self, job: JobMetadata) -> None:
        """Queue a store job (CPU slots -> this tier); returns at once. Raises
        InvalidArgumentError for a malformed job (:meth:`_admit`), ClosedError unless
        open, TierBusyError if the store inbox is full (drain results and retry)."""
        self._submit_now(job, "store")

    def submit_load(self, job: JobMetadata) -> None:
        """Queue a load job (this tier -> CPU slots), as :meth:`submit_store` does."""
        self._submit_now(job, "load")

    async def put_store(self, job: JobMetadata) -> None:
        """Like :meth:`submit_store`, but wait for room instead of raising TierBusyError
        (ClosedError if the tier starts closing meanwhile); cancelled, it admits nothing."""
        await self._put(job, "store")

    async def put_load(self, job: JobMetadata) -> None:
        """Like :meth:`put_store`, for a load."""
        await self._put(job, "load")

    def _submit_now(self, job: JobMetadata, lane: Lane) -> None:
        entry = TierJob(self._admit(job), lane)
        self._inbox.put_nowait(lane, entry)
        self._register(entry)
        self._dispatch_soon(lane)

    def _send(
        self,
        lane: Lane,
        keys: tuple[OffloadKey, ...],
        slots: tuple[int, ...],
        on_done: Callable[[JobResult], None],
    ) -> bool:
        """Queue a job ``TierClient.submit`` has checked, parking it if its lane is full
        (then False); ``on_done(result)`` follows exactly once. Raises ClosedError unless
        open, queueing nothing."""
        if self._state is not Lifecycle.OPEN:
            raise ClosedError(f"the {self.get_tier_type()} tier is {self._state}")
        job = self._ledger.admit_new(lane, keys, slots, on_done, self._reserved_ids)
        self._register(job, admitted=True)
        queued = self._inbox.park(lane, job)  # the inbox is open while the tier is
        self._dispatch_soon(lane)
        return queued

    async def _put(self, job: JobMetadata, lane: Lane) -> None:
        entry = TierJob(self._admit(job), lane)
        job_id = entry.meta.job_id
        self._reserved_ids.add(job_id)
        try:
            await self._inbox.put(lane, entry)
        except ClosedError:
            raise ClosedError(f"{self._name()} closed while job {job_id} waited") from None
        finally:
            self._reserved_ids.discard(job_id)
        self._register(entry)  # no await since the inbox took it: not started yet
        self._dispatch_soon(lane)

    def _admit(self, job: JobMetadata) -> JobMetadata:
        """``job`` checked, as an immutable snapshot. Raises InvalidArgumentError for a
        non-JobMetadata, a call off the tier's loop, a job id not an int or in use, keys
        and slots :func:`checked_job` refuses; ClosedError unless open."""
        if not isinstance(job, JobMetadata):
            raise InvalidArgumentError(f"expected a JobMetadata, got {type(job).__name__}")
        if self._state is not Lifecycle.OPEN:
            state = "not started" if self._state is Lifecycle.NEW else self._state.value
            raise ClosedError(f"{self._name()} is {state}; job {job.job_id!r} not accepted")
        if running_loop() is not self._loop:
            raise InvalidArgumentError(
                f"{self._name()}: jobs must be submitted from the tier's event-loop thread"
            )
        self._ledger.check_free(job.job_id, self._reserved_ids)
        return checked_job(job.job_id, job.keys, job.block_ids, self.num_primary_slots)

    def _register(self, job: TierJob, *, admitted: bool = False) -> None:
        if not admitted:  # _admit checked its id
            self._ledger.admit(job)
        if job.lane == "store":
            self._storing.update(set(job.meta.keys))

    def result(self, job_id: int) -> asyncio.Future[JobResult]:
        """A new future of the job's :class:`JobResult` (queued, running, or finished
        and not yet drained); cancelling it affects nobody else. Raises
        InvalidArgumentError for a job never submitted or already drained."""
        if self._loop is None:
            raise InvalidArgumentError(f"{self._name()}: unknown job {job_id!r} (not started)")
        return self._ledger.waiter(job_id, self._loop)

    def get_finished(self) -> list[JobResult]:
        """Results of the jobs finished since the last call, in completion order; never
        blocks. Each comes once; then its job id is forgotten and may be reused."""
        return self._ledger.drain()

    def storing(self, key: OffloadKey) -> bool:
        """True while ``key`` is in a store job of this tier without a result yet."""
        return key in self._storing

    def spawn(self, coro: Coroutine[Any, Any, None], *, name: str) -> bool:
        """Run ``coro`` as a background task of this tier's task group, cancelled as
        soon as the tier starts closing (a close does not wait for it). Returns False,
        and closes ``coro``, when the tier is not serving."""
        task_group = self._task_group
        if task_group is None or self._state is not Lifecycle.OPEN:
            coro.close()
            return False
        task = task_group.create_task(coro, name=f"{self._name()}-{name}")
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return True

    def _cancel_background(self) -> None:
        for task in list(self._background):
            task.cancel()

    @abstractmethod
    async def _do_store(self, job: JobMetadata) -> JobResult:
        """Copy the job's CPU slots into this tier; return the job's result. Called on
        the loop thread with a checked snapshot (tuples); raising fails the whole job."""

    @abstractmethod
    async def _do_load(self, job: JobMetadata) -> JobResult:
        """Copy this tier's blocks into the job's CPU slots, as :meth:`_do_store` is
        called; keys not held here go in ``failed_keys``, the others still land."""

    async def _run(self) -> None:
        async with asyncio.TaskGroup() as task_group:
            self._task_group = task_group
            self._drained = asyncio.get_running_loop().create_future()
            try:
                self._dispatch()
                await self._drained
            finally:
                self._task_group = None  # ended or cancelled: no job starts any more

    def _dispatch_soon(self, lane: Lane) -> None:
        """Start what was just queued in ``lane``: a load at once (no queued store may
        pass it); stores once this turn of the loop ends, so that the loads queued in
        the same turn go first."""
        if lane == "load":
            self._dispatch()
        elif not self._dispatch_pending and self._loop is not None:
            self._dispatch_pending = True
            self._loop.call_soon(self._dispatch, True)

    def _dispatch(self, scheduled: bool = False) -> None:
        """Start queued jobs (loads first) while fewer than ``max_inflight`` run, each
        as a task of the runner's group (no task polls the inbox); once the inbox is
        closed and nothing is queued or running, let the runner end."""
        if scheduled:
            self._dispatch_pending = False
        task_group = self._task_group
        if task_group is None:
            return
        running = self._running
        while len(running) < self.max_inflight:
            job = self._inbox.get_nowait()
            if job is None:
                break
            running.add(job)
            job.task = task_group.create_task(
                self._run_job(job), name=f"{self._name()}-{job.lane}-{job.meta.job_id}"
            )
            job.task.add_done_callback(functools.partial(self._on_job_done, job))
        drained = self._drained
        if not running and self._inbox.closed and drained is not None and not drained.done():
            drained.set_result(None)

    async def _run_job(self, job: TierJob) -> JobResult:
        """Run one hook; turn every failure of it into a failed JobResult, decided here
        (its waiters woken on this turn of the loop), then let the next job start."""
        job_result = await self._hook_result(job)
        self._ledger.finish(job.meta.job_id, job_result)
        self._running.discard(job)
        self._dispatch()
        return job_result

    async def _hook_result(self, job: TierJob) -> JobResult:
        """The job's hook awaited: its result, or a failed one for whatever it raised
        (but the cancellation of this task)."""
        meta = job.meta
        RUNNING_JOB.set((self, meta.job_id))
        hook = self._do_load if job.lane == "load" else self._do_store
        try:
            job_result = await hook(meta)
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                raise
            # The hook's own await was cancelled, not this job: a hook failure.
            return self._hook_failed(job, "raised CancelledError", "CancelledError()", None)
        except Exception as exc:
            return self._hook_failed(job, f"raised {type(exc).__name__}", repr(exc), exc)
        if not isinstance(job_result, JobResult) or job_result.job_id != meta.job_id:
            return self._hook_failed(
                job,
                "returned no JobResult for its job",
                f"hook returned {job_result!r}, not a JobResult for job {meta.job_id}",
                None,
            )
        return job_result

    def _hook_failed(
        self, job: TierJob, cause: str, error: str, exc: BaseException | None
    ) -> JobResult:
        self._failures.record(f"{job.lane} hook {cause}", detail=error)
        logger.debug(
            "%s: %s job %d failed: %s", self._name(), job.lane, job.meta.job_id, error, exc_info=exc
        )
        return JobResult(job.meta.job_id, False, tuple(job.meta.keys), error)

    def _on_job_done(self, job: TierJob, task: asyncio.Task[JobResult]) -> None:
        if job not in self._running:
            return  # decided by its task
        job_id = job.meta.job_id
        # Ended without deciding: cancelled, or raised past _run_job (unless a close, or
        # a hook that ended late, decided it already).
        if job.result is None and task.cancelled():
            self._fail(job_id, self._cancel_reason, self._cancel_cause)
        elif job.result is None and (exc := task.exception()) is not None:
            self._fail(job_id, repr(exc), f"{job.lane} job raised {type(exc).__name__}")
        self._running.discard(job)
        self._dispatch()

    def _on_runner_done(self, runner: asyncio.Task[None]) -> None:
        if not runner.cancelled() and (exc := runner.exception()) is not None:
            logger.error("%s: serving stopped by an error", self._name(), exc_info=exc)
        if self._state is Lifecycle.OPEN:
            # Not asked to stop: fail what is left rather than leave anyone waiting.
            logger.error("%s: serving stopped unexpectedly; tier closed", self._name())
            self._state = Lifecycle.CLOSING
            self._cancel_reason = self._cancel_cause = "tier actor stopped unexpectedly"
            self._cancel_running_jobs()
            self._stop(notify=True)

    def _delivered(self, job: TierJob, job_result: JobResult) -> None:
        if job.lane == "store":
            uncount(self._storing, set(job.meta.keys))

    def _fail(self, job_id: int, reason: str, cause: str) -> None:
        if self._ledger.fail(job_id, reason):
            self._failures.record(cause, detail=reason)

    def _cancel_running_jobs(self) -> None:
        for job in self._ledger.undelivered():
            if job.task is not None and not job.task.done():
                job.task.cancel()

    def _stop(self, *, notify: bool) -> None:
        """Decide the close: every job without a result fails with the cancel reason
        (delivered once its thread calls end); CLOSED once no thread call runs."""
        if self._stopped:
            return
        self._stopped = True
        self._inbox.close()
        unqueued = "closed before the tier had room for the job"
        parked = self._inbox.unpark()
        for job in parked:
            self._ledger.fail(job.meta.job_id, unqueued, notify=notify)
        self._failures.record(self._cancel_cause, count=len(parked), detail=unqueued)
        self._inbox.drain()  # queued jobs are failed below with the rest
        undecided = self._ledger.fail_undecided(self._cancel_reason, notify=notify)
        self._failures.record(self._cancel_cause, count=len(undecided), detail=self._cancel_reason)
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._maybe_closed()

    def _maybe_closed(self) -> None:
        if not self._stopped or self._calls_running or self._state is Lifecycle.CLOSED:
            return
        self._state = Lifecycle.CLOSED
        self._closed_event.set()
        self._on_closed()

    def _on_closed(self) -> None:
        """Release what the subclass holds beyond the actor; called once, at CLOSED."""

    def _name(self) -> str:
        return type(self).__name__
