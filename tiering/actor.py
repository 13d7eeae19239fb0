"""The asynchronous base of every secondary tier: an actor with a bounded inbox.

A :class:`TierActor` owns an :class:`~tiering.inbox.Inbox` (two bounded lanes, loads
before stores), one serving task that feeds it to the subclass's hooks, at most
``max_inflight`` job tasks, a :class:`~tiering.ledger.ResultsLedger` and a bounded thread
pool for blocking byte work. Every task it runs belongs to one
:class:`asyncio.TaskGroup`, hosted by a runner task the actor owns, so
:meth:`TierActor.start` and :meth:`TierActor.aclose` may be called from any task of the
loop.

Life cycle (:class:`~tiering.lifecycle.Lifecycle`): ``NEW`` -> :meth:`~TierActor.start`
-> ``OPEN`` -> :meth:`~TierActor.aclose` (graceful) or :meth:`~TierActor.shutdown`
(hard) -> ``CLOSING`` -> ``CLOSED`` once every job is answered and no blocking call of
it runs (tasks it cancelled may still be unwinding on the loop). Every
admitted job yields exactly one :class:`JobResult`, whatever happens: from its hook,
from the hook's failure, or from the close that cut it short, and never while a
blocking call of the job still runs on a thread.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
from abc import abstractmethod
from collections import Counter
from collections.abc import Callable, Coroutine
from concurrent.futures import Future as ThreadFuture
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from tiering.errors import ClosedError, InvalidArgumentError
from tiering.inbox import Inbox, InboxStatistics, Lane
from tiering.ledger import ResultsLedger, TierJob
from tiering.lifecycle import AsyncService, Lifecycle
from tiering.secondary import (
    JobMetadata,
    JobResult,
    OffloadKey,
    SecondaryTierManager,
    checked_job,
)
from tiering.statistics import FailureLog, Statistics
from tiering.validation import positive_int, seconds
from tiering.workers import init_io_worker

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

ACTOR_OPTIONS = frozenset({"inbox_size", "max_inflight", "io_threads"})
"""The keyword options every TierActor takes; subclasses forwarding ``**kwargs`` check them."""

# How long aclose waits, after cancelling, for hooks to unwind before failing their
# jobs anyway: a hook that swallows cancellation must not hang the caller. (Jobs inside
# a blocking call are not "hanging": their result waits for the call, see run_blocking.)
_CANCEL_GRACE_S = 1.0

# The job a job task runs, so run_blocking can mark that job busy while its call runs.
_CURRENT_JOB: contextvars.ContextVar[tuple[TierActor, int] | None] = contextvars.ContextVar(
    "tiering_actor_job", default=None
)


class TierActor(AsyncService, SecondaryTierManager):
    """A secondary tier served by an asyncio actor; subclasses implement the two hooks.

    Guarantees:

    * ``submit_store``/``submit_load`` validate, enqueue and return at once; when they
      raise, nothing changed.
    * Queued loads are handed out before queued stores (a load is on a request's
      critical path); at most ``max_inflight`` jobs run at once.
    * Each admitted job yields exactly one :class:`JobResult`, delivered to every
      :meth:`result` future of the job and once through :meth:`get_finished`. A hook
      that raises, or returns something other than a ``JobResult`` for its job, fails
      only that job (``failed_keys`` = all its keys); the actor keeps serving. Such
      failures are counted by cause in ``statistics().failures`` and logged once per
      cause.
    * A job's result is never delivered while a :meth:`run_blocking` call made by the
      job still runs on a thread: whoever sees the result may reuse the job's slots.
    * A failed load may have written some of its slots; their contents are undefined.

    Subclasses implement :meth:`_do_store` and :meth:`_do_load` (called on the loop
    thread; do the bulk byte work in ONE :meth:`run_blocking` call per job), plus
    ``lookup``, ``get_num_blocks``, ``get_tier_type`` and optionally ``touch``/``clear``
    and :meth:`_usage`. All bookkeeping must happen on the loop thread.
    """

    def __init__(
        self,
        primary_kv_view: memoryview,
        block_bytes: int,
        *,
        inbox_size: int = 64,
        max_inflight: int = 4,
        io_threads: int = 4,
    ) -> None:
        """Create a tier that is not yet started.

        Raises:
            InvalidArgumentError: ``primary_kv_view`` is not a writable memoryview of
                whole blocks, or ``block_bytes``, ``inbox_size``, ``max_inflight`` or
                ``io_threads`` is not a positive int.
        """
        super().__init__(primary_kv_view, block_bytes)
        if self.primary_kv_view.readonly:
            raise InvalidArgumentError("primary_kv_view must be writable (loads write into it)")
        self.inbox_size = positive_int("inbox_size", inbox_size)
        self.max_inflight = positive_int("max_inflight", max_inflight)
        self.io_threads = positive_int("io_threads", io_threads)

        self._state = Lifecycle.NEW
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: asyncio.Task[None] | None = None
        self._task_group: asyncio.TaskGroup | None = None
        self._inbox: Inbox[TierJob] = Inbox(inbox_size, owner=type(self).__name__)
        self._ledger = ResultsLedger(owner=type(self).__name__, on_delivered=self._delivered)
        self._failures = FailureLog(logger, type(self).__name__)
        self._inflight = asyncio.Semaphore(max_inflight)
        self._closed_event = asyncio.Event()
        self._executor = ThreadPoolExecutor(
            max_workers=io_threads,
            thread_name_prefix=f"{type(self).__name__}-io",
            initializer=init_io_worker,
        )
        self._calls_running = 0  # run_blocking calls started and not yet returned
        self._background: set[asyncio.Task[None]] = set()  # spawn()ed, cancelled at close
        self._stopped = False  # close decided: every job failed or finished, pool shut

        self._next_id = 0  # for jobs the engine sends
        self._reserved_ids: set[int] = set()  # put_* waiting for room
        self._storing: Counter[OffloadKey] = Counter()
        # Why jobs cut short by a close fail: the message, and its cause for statistics.
        self._cancel_reason = "cancelled: tier closed before the job finished"
        self._cancel_cause = "cancelled by close"

    # -- life cycle -------------------------------------------------------------------

    async def start(self) -> None:
        """Start serving on the running loop; a no-op if already open.

        Raises:
            ClosedError: the tier is closing or closed.
            InvalidArgumentError: it was started on another event loop.
        """
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

    # The deadline is part of the close protocol (graceful phase, then cancel), so it
    # is a parameter rather than a caller-side asyncio.timeout.
    async def aclose(self, timeout: float = 5.0) -> None:  # noqa: ASYNC109
        """Close gracefully: admit nothing more, finish admitted jobs, then stop.

        Submissions raise :class:`ClosedError` from the moment this is called, and
        ``put_*`` calls waiting for room raise it too. Queued and in-flight jobs run to
        completion if they finish within ``timeout`` seconds; the rest are cancelled and
        reported with ``success=False`` and an error saying why. A job cancelled inside
        a :meth:`run_blocking` call is reported only once that call has returned, so this
        returns within about ``timeout`` plus the remaining time of the blocking calls
        running at the deadline. On return the state is ``CLOSED``: no thread call or
        result of the tier is left pending (a hook that swallowed its cancellation may
        still be unwinding on the loop). Idempotent; concurrent calls all return
        once the tier is closed. If the caller is cancelled meanwhile, the tier is
        stopped hard (:meth:`shutdown`) and the cancellation propagates.

        Raises:
            InvalidArgumentError: ``timeout`` is negative or not a number.
        """
        seconds("timeout", timeout, allow_zero=True)
        if self._state is Lifecycle.NEW:
            self._stop(notify=True)
            return
        if self._state is Lifecycle.CLOSED:
            return
        if self._state is Lifecycle.CLOSING:
            await self._closed_event.wait()
            return

        self._state = Lifecycle.CLOSING
        self._inbox.close()
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
                        "%s: a job ignored cancellation; failing it without waiting",
                        self._name(),
                    )
            self._stop(notify=True)
            # Jobs cut short inside a thread call get their result when it returns.
            await self._closed_event.wait()
        except asyncio.CancelledError:
            self.shutdown()
            raise

    def shutdown(self) -> None:
        """Stop at once: cancel every task and fail every unfinished job.

        Each admitted job without a result is failed before this returns, except a job
        whose :meth:`run_blocking` call is running on a thread: a thread cannot be
        interrupted, so this may return while such calls still run, and those jobs'
        failures are delivered (and the state becomes ``CLOSED``) on the loop once the
        calls have returned. Called from another thread while the loop runs, the stop is
        scheduled on the loop. After the loop has stopped, results are recorded at once
        (there is nothing left to wait on) without resolving :meth:`result` futures.
        The thread pool is shut down without waiting; queued blocking calls are dropped.
        Idempotent; safe before :meth:`start`.
        """
        loop = self._loop
        loop_running = loop is not None and loop.is_running() and not loop.is_closed()
        if loop_running:
            try:
                on_loop = asyncio.get_running_loop() is loop
            except RuntimeError:
                on_loop = False
            if not on_loop:
                assert loop is not None
                loop.call_soon_threadsafe(self.shutdown)
                return
        if self._state is Lifecycle.CLOSED or self._stopped:
            return
        if self._state is not Lifecycle.NEW:
            self._state = Lifecycle.CLOSING
        self._inbox.close()
        if loop_running:
            self._cancel_background()
        self._cancel_reason = "cancelled: tier shut down before the job finished"
        self._cancel_cause = "cancelled by shutdown"
        if loop_running:
            if self._runner is not None and not self._runner.done():
                self._runner.cancel()
            self._cancel_running_jobs()
        else:
            # No loop will run the tasks again, so no thread call can report back.
            self._calls_running = 0
            for job in self._ledger.undelivered():
                while job.busy:
                    self._ledger.idle(job.meta.job_id)
        usable = loop is None or not loop.is_closed()
        self._stop(notify=usable)

    @property
    def state(self) -> Lifecycle:
        """Where the tier is in its life cycle (read-only)."""
        return self._state

    @property
    def closed(self) -> bool:
        """True once the tier accepts no more work (closing or closed)."""
        return self._state in (Lifecycle.CLOSING, Lifecycle.CLOSED)

    # -- statistics -------------------------------------------------------------------

    def statistics(self) -> Statistics:
        """A snapshot: state, jobs (queued or running) and their bytes in flight,
        plus what :meth:`_usage` reports; ``failures`` adds the actor's own (hooks that
        raised, jobs cancelled by a close) to the subclass's."""
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
        """A snapshot of the inbox: queued loads and stores, its bound, waiting tasks."""
        return self._inbox.statistics()

    def _usage(self) -> dict[str, Any]:
        """What the tier holds, as :class:`Statistics` fields (``used_blocks``,
        ``capacity_bytes``, ``pinned_blocks``, ``counters``, ``failures``...).

        Subclasses override it; the default reports ``used_blocks`` only. Called on the
        loop thread; must be cheap.
        """
        return {"used_blocks": self.get_num_blocks()}

    def __repr__(self) -> str:
        return f"<{self._name()} {self.statistics()!r}>"

    # -- submission -------------------------------------------------------------------

    def submit_store(self, job: JobMetadata) -> None:
        """Queue a store job (CPU slots -> this tier); returns at once.

        Raises:
            InvalidArgumentError: the job is malformed (see :meth:`_admit`).
            ClosedError: the tier is not started, closing or closed.
            TierBusyError: the store inbox is full; drain results and retry.
        """
        self._submit_now(job, "store")

    def submit_load(self, job: JobMetadata) -> None:
        """Queue a load job (this tier -> CPU slots); returns at once.

        Raises:
            InvalidArgumentError: the job is malformed (see :meth:`_admit`).
            ClosedError: the tier is not started, closing or closed.
            TierBusyError: the load inbox is full; drain results and retry.
        """
        self._submit_now(job, "load")

    async def put_store(self, job: JobMetadata) -> None:
        """Like :meth:`submit_store`, but wait for room in the inbox instead of raising.

        Raises:
            InvalidArgumentError, ClosedError: as :meth:`submit_store` (ClosedError also
                if the tier starts closing while this waits). Cancelling the caller while
                it waits admits nothing.
        """
        await self._put(job, "store")

    async def put_load(self, job: JobMetadata) -> None:
        """Like :meth:`submit_load`, but wait for room in the inbox instead of raising.

        Raises:
            InvalidArgumentError, ClosedError: as :meth:`put_store`.
        """
        await self._put(job, "load")

    def _submit_now(self, job: JobMetadata, lane: Lane) -> None:
        entry = TierJob(self._admit(job), lane)
        self._inbox.put_nowait(lane, entry)
        self._register(entry)

    def _send(
        self,
        lane: Lane,
        keys: tuple[OffloadKey, ...],
        slots: tuple[int, ...],
        on_done: Callable[[JobResult], None],
    ) -> bool:
        """Queue a job whose arguments the caller has checked (the engine's road, through
        :meth:`TierClient.send <tiering.tier_client.TierClient.send>`); a full lane parks
        it rather than refuse it; returns False if it was parked. ``on_done(result)`` is
        called exactly once, later on the loop (or at once if a close finds no loop
        running), never inside this call.

        Raises:
            ClosedError: the tier is not open; nothing was queued.
        """
        if self._state is not Lifecycle.OPEN:
            raise ClosedError(f"the {self.get_tier_type()} tier is {self._state}")
        while self._next_id in self._ledger or self._next_id in self._reserved_ids:
            self._next_id += 1
        job = TierJob(JobMetadata(self._next_id, keys, slots), lane, on_done)
        self._next_id += 1
        queued = self._inbox.park(lane, job)
        self._register(job)
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
        # No await between the inbox taking the job and this: the server cannot see it
        # before it is registered.
        self._register(entry)

    def _admit(self, job: JobMetadata) -> JobMetadata:
        """Validate ``job`` and return an immutable snapshot of it; changes nothing.

        Raises:
            InvalidArgumentError: not a JobMetadata, called off the tier's loop, a
                job_id that is not an int or names a job whose result has not been
                drained by get_finished(), a key that is not bytes, or a slot id outside
                the host pool.
            ClosedError: the tier is not open.
        """
        if not isinstance(job, JobMetadata):
            raise InvalidArgumentError(f"expected a JobMetadata, got {type(job).__name__}")
        if self._state is not Lifecycle.OPEN:
            state = "not started" if self._state is Lifecycle.NEW else self._state.value
            raise ClosedError(f"{self._name()} is {state}; job {job.job_id!r} not accepted")
        try:
            on_loop = asyncio.get_running_loop() is self._loop
        except RuntimeError:
            on_loop = False
        if not on_loop:
            raise InvalidArgumentError(
                f"{self._name()}: jobs must be submitted from the tier's event-loop thread"
            )
        job_id = job.job_id
        if not isinstance(job_id, int) or isinstance(job_id, bool):
            raise InvalidArgumentError(f"job_id must be an int, got {job_id!r}")
        if job_id in self._ledger or job_id in self._reserved_ids:
            raise InvalidArgumentError(
                f"{self._name()}: job {job_id} is already submitted or its result not yet "
                "drained by get_finished()"
            )
        return checked_job(job_id, job.keys, job.block_ids, self.num_primary_slots)

    def _register(self, job: TierJob) -> None:
        self._ledger.admit(job)
        if job.lane == "store":
            self._storing.update(set(job.meta.keys))

    # -- results ----------------------------------------------------------------------

    def result(self, job_id: int) -> asyncio.Future[JobResult]:
        """A future that resolves to the job's :class:`JobResult`.

        Works for a job that is queued, in flight, or finished but not yet drained by
        :meth:`get_finished`. It never raises for a failed job (``success=False``
        instead). Each call returns a new future, so cancelling one awaiter affects
        neither the job nor other awaiters.

        Raises:
            InvalidArgumentError: no such job (never submitted, or already drained).
        """
        if self._loop is None:
            raise InvalidArgumentError(f"{self._name()}: unknown job {job_id!r} (not started)")
        return self._ledger.waiter(job_id, self._loop)

    def get_finished(self) -> list[JobResult]:
        """Results of the jobs finished since the last call, in completion order.

        Never blocks. Each result is returned exactly once; afterwards its job id is
        forgotten (``result()`` no longer knows it, and the id may be reused).
        """
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

    # -- blocking work ----------------------------------------------------------------

    async def run_blocking(self, fn: Callable[..., _T], /, *args: object) -> _T:
        """Run ``fn(*args)`` on this tier's own bounded thread pool and return its result.

        Never uses the loop's default executor. Cancelling the caller before the call
        has started on a thread drops the call; once it has started, the caller's
        cancellation is held back until ``fn`` returns (its result or error is then
        discarded and :class:`asyncio.CancelledError` raised), so the code around the
        call never releases what the thread still uses. Called from a job's hook, the
        job's result is not delivered while the call runs.

        Raises:
            ClosedError: the thread pool is shut down.
            asyncio.CancelledError: the caller was cancelled (see above).
            Exception: whatever ``fn`` raises.
        """
        try:
            call = self._executor.submit(fn, *args)
        except RuntimeError as exc:
            raise ClosedError(f"{self._name()}: thread pool is shut down") from exc
        current = _CURRENT_JOB.get()
        job_id = current[1] if current is not None and current[0] is self else None
        if job_id is not None and job_id in self._ledger:
            self._ledger.busy(job_id)
        else:
            job_id = None
        self._calls_running += 1
        done = asyncio.wrap_future(call)
        try:
            return await self._wait_call(call, done)
        finally:
            self._call_ended(job_id)

    @staticmethod
    async def _wait_call(call: ThreadFuture[_T], done: asyncio.Future[_T]) -> _T:
        try:
            return await asyncio.shield(done)
        except asyncio.CancelledError:
            if done.done() or call.cancel():
                raise  # finished, or never started: nothing runs on a thread any more
            while not done.done():
                try:
                    await asyncio.wait({done})
                except asyncio.CancelledError:
                    continue  # already cancelled; the thread has to end first
            if not done.cancelled():
                done.exception()  # discarded: the cancellation wins
            raise

    def _call_ended(self, job_id: int | None) -> None:
        if self._calls_running > 0:
            self._calls_running -= 1
        if job_id is not None and self._ledger.is_busy(job_id):
            self._ledger.idle(job_id)
        if self._calls_running == 0:
            self._maybe_closed()

    # -- subclass hooks ---------------------------------------------------------------

    @abstractmethod
    async def _do_store(self, job: JobMetadata) -> JobResult:
        """Copy the job's CPU slots into this tier; return the job's result.

        Called on the loop thread with a validated snapshot (tuples of bytes keys and
        in-range slot ids). Raising fails the whole job.
        """

    @abstractmethod
    async def _do_load(self, job: JobMetadata) -> JobResult:
        """Copy this tier's blocks into the job's CPU slots; return the job's result.

        Same calling convention as :meth:`_do_store`. Keys not held here belong in
        ``failed_keys``; the others should still land.
        """

    # -- serving ----------------------------------------------------------------------

    async def _run(self) -> None:
        async with asyncio.TaskGroup() as task_group:
            self._task_group = task_group
            task_group.create_task(self._serve(), name=f"{self._name()}-serve")

    async def _serve(self) -> None:
        """Hand queued jobs to job tasks, loads first, at most ``max_inflight`` at once.

        Returns once the inbox is closed and empty.
        """
        task_group = self._task_group
        assert task_group is not None
        while True:
            await self._inflight.acquire()
            job = await self._inbox.get()
            if job is None:
                self._inflight.release()
                return
            task = task_group.create_task(
                self._run_job(job), name=f"{self._name()}-{job.lane}-{job.meta.job_id}"
            )
            job.task = task
            task.add_done_callback(functools.partial(self._on_job_done, job))

    async def _run_job(self, job: TierJob) -> JobResult:
        """Run one hook; turn every failure of it into a failed JobResult."""
        meta = job.meta
        _CURRENT_JOB.set((self, meta.job_id))
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
        self._inflight.release()
        job_id = job.meta.job_id
        if job.result is not None:
            return  # decided already (a close failed it; a stubborn hook ended late)
        if task.cancelled():
            self._fail(job_id, self._cancel_reason, self._cancel_cause)
        elif (exc := task.exception()) is not None:
            self._fail(job_id, repr(exc), f"{job.lane} job raised {type(exc).__name__}")
        else:
            self._ledger.finish(job_id, task.result())

    def _on_runner_done(self, runner: asyncio.Task[None]) -> None:
        if not runner.cancelled() and (exc := runner.exception()) is not None:
            logger.error("%s: serving stopped by an error", self._name(), exc_info=exc)
        if self._state is Lifecycle.OPEN:
            # Not asked to stop: fail what is left rather than leave anyone waiting.
            logger.error("%s: serving stopped unexpectedly; tier closed", self._name())
            self._state = Lifecycle.CLOSING
            self._inbox.close()
            self._cancel_reason = "tier actor stopped unexpectedly"
            self._cancel_cause = "tier actor stopped unexpectedly"
            self._cancel_running_jobs()
            self._stop(notify=True)

    # -- completion and closing -------------------------------------------------------

    def _delivered(self, job: TierJob, job_result: JobResult) -> None:
        if job.lane == "store":
            keys = set(job.meta.keys)
            self._storing.subtract(keys)
            for key in keys:
                if self._storing[key] <= 0:
                    del self._storing[key]

    def _fail(self, job_id: int, reason: str, cause: str) -> None:
        if self._ledger.fail(job_id, reason):
            self._failures.record(cause, detail=reason)

    def _cancel_running_jobs(self) -> None:
        for job in self._ledger.undelivered():
            if job.task is not None and not job.task.done():
                job.task.cancel()

    def _stop(self, *, notify: bool) -> None:
        """Decide the close: nothing queued or new is served, every job without a
        result fails with the cancel reason (delivered once its thread calls end), the
        pool stops taking calls. The tier becomes CLOSED once no thread call runs."""
        if self._stopped:
            return
        self._stopped = True
        self._inbox.close()
        unqueued = "the tier closed before the tier had room for the job"
        for job in self._inbox.unpark():
            self._fail(job.meta.job_id, unqueued, self._cancel_cause)
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
        """Release what the subclass holds beyond the actor; called once as the tier
        becomes CLOSED (no blocking call of it still runs, except after a
        :meth:`shutdown` with the loop stopped), on the loop thread or with no loop
        running."""

    def _name(self) -> str:
        return f"{type(self).__name__}"


__all__ = ["ACTOR_OPTIONS", "TierActor"]
