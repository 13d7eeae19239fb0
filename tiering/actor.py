"""The asynchronous base of every secondary tier: an actor with bounded inboxes.

A :class:`TierActor` owns two bounded inboxes (loads and stores), one serving task
that feeds them to the subclass's hooks, at most ``max_inflight`` job tasks, a
completion queue and a bounded thread pool for blocking byte work. Every task it
runs belongs to one :class:`asyncio.TaskGroup`, hosted by a runner task the actor
owns, so :meth:`TierActor.start` and :meth:`TierActor.aclose` may be called from
any task of the loop.

Life cycle: ``new`` -> :meth:`~TierActor.start` -> ``running`` ->
:meth:`~TierActor.aclose` (graceful) or :meth:`~TierActor.shutdown` (hard) ->
``closed``. Every admitted job yields exactly one :class:`JobResult`, whatever
happens: from its hook, from the hook's failure, or from the close that cut it short.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import functools
import logging
from abc import abstractmethod
from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from types import TracebackType
from typing import Self, TypeVar

from tiering.errors import ClosedError, InvalidArgumentError, TierBusyError
from tiering.secondary import JobMetadata, JobResult, OffloadKey, SecondaryTierManager
from tiering.validation import positive_int
from tiering.workers import init_io_worker

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

ACTOR_OPTIONS = frozenset({"inbox_size", "max_inflight", "io_threads"})
"""The keyword options every TierActor takes; subclasses forwarding ``**kwargs`` check them."""

# How long aclose waits, after cancelling, for hooks to unwind before failing their
# jobs anyway: a hook that swallows cancellation must not hang the caller.
_CANCEL_GRACE_S = 1.0


class _State(enum.Enum):
    NEW = "new"
    RUNNING = "running"
    CLOSING = "closing"
    CLOSED = "closed"


@dataclass(eq=False, slots=True)
class _Job:
    """An admitted job: queued until the serving task hands it to a job task."""

    meta: JobMetadata
    is_load: bool
    waiters: list[asyncio.Future[JobResult]] = field(default_factory=list)
    task: asyncio.Task[JobResult] | None = None
    finished: bool = False

    @property
    def kind(self) -> str:
        return "load" if self.is_load else "store"


class TierActor(SecondaryTierManager):
    """A secondary tier served by an asyncio actor; subclasses implement the two hooks.

    Guarantees:

    * ``submit_store``/``submit_load`` validate, enqueue and return at once; when they
      raise, nothing changed.
    * Queued loads are handed out before queued stores (a load is on a request's
      critical path); at most ``max_inflight`` jobs run at once.
    * Each admitted job yields exactly one :class:`JobResult`, delivered to every
      :meth:`result` future of the job and once through :meth:`get_finished`. A hook
      that raises, or returns something other than a ``JobResult`` for its job, fails
      only that job (``failed_keys`` = all its keys); the actor keeps serving.
    * A failed load may have written some of its slots; their contents are undefined.

    Subclasses implement :meth:`_do_store` and :meth:`_do_load` (called on the loop
    thread; do the bulk byte work in ONE :meth:`run_blocking` call per job), plus
    ``lookup``, ``get_num_blocks``, ``get_tier_type`` and optionally ``touch``/``clear``.
    All bookkeeping must happen on the loop thread.

    A blocking call already running on a thread cannot be interrupted: when a close
    cancels its job (deadline passed, or :meth:`shutdown`), the job is reported failed
    at once and the thread finishes its call afterwards.
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

        self._state = _State.NEW
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: asyncio.Task[None] | None = None
        self._task_group: asyncio.TaskGroup | None = None
        self._load_inbox: asyncio.Queue[_Job] = asyncio.Queue(maxsize=inbox_size)
        self._store_inbox: asyncio.Queue[_Job] = asyncio.Queue(maxsize=inbox_size)
        self._inflight = asyncio.Semaphore(max_inflight)
        self._work_ready = asyncio.Event()
        self._closed_event = asyncio.Event()
        # put_* callers waiting for inbox room; woken (all) whenever room may have appeared.
        self._room_waiters: list[asyncio.Future[None]] = []
        self._executor = ThreadPoolExecutor(
            max_workers=io_threads,
            thread_name_prefix=f"{type(self).__name__}-io",
            initializer=init_io_worker,
        )

        self._jobs: dict[int, _Job] = {}  # admitted, no result yet
        self._reserved_ids: set[int] = set()  # put_* waiting for room
        self._undrained: dict[int, JobResult] = {}  # finished, not yet taken by get_finished
        self._completed: deque[JobResult] = deque()
        self._storing: Counter[OffloadKey] = Counter()
        self._cancel_reason = "cancelled: tier closed before the job finished"

    # -- life cycle -------------------------------------------------------------------

    async def start(self) -> None:
        """Start serving on the running loop; a no-op if already running.

        Raises:
            ClosedError: the tier is closing or closed.
            InvalidArgumentError: it was started on another event loop.
        """
        if self._state in (_State.CLOSING, _State.CLOSED):
            raise ClosedError(f"{self._name()} is closed and cannot be restarted")
        loop = asyncio.get_running_loop()
        if self._state is _State.RUNNING:
            if loop is not self._loop:
                raise InvalidArgumentError(f"{self._name()} already runs on another event loop")
            return
        self._loop = loop
        self._state = _State.RUNNING
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
        reported with ``success=False`` and an error saying why. The thread pool is shut
        down. Idempotent; concurrent calls all return once the tier is closed. If the
        caller is cancelled meanwhile, the tier is stopped hard (:meth:`shutdown`).

        Raises:
            InvalidArgumentError: ``timeout`` is negative or not a number.
        """
        if (
            not isinstance(timeout, int | float)
            or isinstance(timeout, bool)
            or not timeout >= 0  # also rejects NaN
        ):
            raise InvalidArgumentError(f"timeout must be a non-negative number, got {timeout!r}")
        if self._state is _State.NEW:
            self._finalize()
            return
        if self._state is _State.CLOSED:
            return
        if self._state is _State.CLOSING:
            await self._closed_event.wait()
            return

        self._state = _State.CLOSING
        self._work_ready.set()
        self._wake_room_waiters()
        runner = self._runner
        assert runner is not None
        try:
            done, _ = await asyncio.wait({runner}, timeout=timeout)
            if not done:
                self._cancel_reason = (
                    f"cancelled: tier closed and the {timeout:g}s aclose deadline passed "
                    "before the job finished"
                )
                runner.cancel()
                done, _ = await asyncio.wait({runner}, timeout=_CANCEL_GRACE_S)
                if not done:
                    logger.warning(
                        "%s: a job ignored cancellation; failing it without waiting",
                        self._name(),
                    )
                    self._cancel_running_jobs()
        except asyncio.CancelledError:
            self.shutdown()
            raise
        self._fail_unfinished(self._cancel_reason)
        self._finalize()

    def shutdown(self) -> None:
        """Stop at once: cancel every task and fail every unfinished job now.

        Each admitted job without a result gets ``JobResult(success=False)`` before this
        returns (unless called from another thread while the loop runs: then the stop is
        scheduled on the loop). The thread pool is shut down without waiting; queued
        blocking calls are dropped. Idempotent; safe before :meth:`start` and after the
        loop has stopped.
        """
        loop = self._loop
        if loop is not None and loop.is_running() and not loop.is_closed():
            try:
                on_loop = asyncio.get_running_loop() is loop
            except RuntimeError:
                on_loop = False
            if not on_loop:
                loop.call_soon_threadsafe(self.shutdown)
                return
        if self._state is _State.CLOSED:
            return
        self._state = _State.CLOSING
        self._cancel_reason = "cancelled: tier shut down before the job finished"
        loop_usable = loop is not None and not loop.is_closed()
        if loop_usable:
            if self._runner is not None and not self._runner.done():
                self._runner.cancel()
            self._cancel_running_jobs()
        self._fail_unfinished(self._cancel_reason, notify_waiters=loop_usable)
        self._wake_room_waiters()
        self._finalize()

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    @property
    def closed(self) -> bool:
        """True once the tier accepts no more work (closing or closed)."""
        return self._state in (_State.CLOSING, _State.CLOSED)

    # -- submission -------------------------------------------------------------------

    def submit_store(self, job: JobMetadata) -> None:
        """Queue a store job (CPU slots -> this tier); returns at once.

        Raises:
            InvalidArgumentError: the job is malformed (see :meth:`_admit`).
            ClosedError: the tier is not started, closing or closed.
            TierBusyError: the store inbox is full; drain results and retry.
        """
        self._submit_now(job, is_load=False)

    def submit_load(self, job: JobMetadata) -> None:
        """Queue a load job (this tier -> CPU slots); returns at once.

        Raises:
            InvalidArgumentError: the job is malformed (see :meth:`_admit`).
            ClosedError: the tier is not started, closing or closed.
            TierBusyError: the load inbox is full; drain results and retry.
        """
        self._submit_now(job, is_load=True)

    async def put_store(self, job: JobMetadata) -> None:
        """Like :meth:`submit_store`, but wait for room in the inbox instead of raising.

        Raises:
            InvalidArgumentError, ClosedError: as :meth:`submit_store` (ClosedError also
                if the tier starts closing while this waits). Cancelling the caller while
                it waits admits nothing.
        """
        await self._put(job, is_load=False)

    async def put_load(self, job: JobMetadata) -> None:
        """Like :meth:`submit_load`, but wait for room in the inbox instead of raising.

        Raises:
            InvalidArgumentError, ClosedError: as :meth:`put_store`.
        """
        await self._put(job, is_load=True)

    def _submit_now(self, job: JobMetadata, *, is_load: bool) -> None:
        job = self._admit(job)
        inbox = self._inbox(is_load)
        if inbox.full():
            raise TierBusyError(
                f"{self._name()}: {'load' if is_load else 'store'} inbox is full "
                f"({self.inbox_size} jobs queued); drain get_finished() and retry"
            )
        self._enqueue(_Job(job, is_load), inbox)

    async def _put(self, job: JobMetadata, *, is_load: bool) -> None:
        job = self._admit(job)
        inbox = self._inbox(is_load)
        if not inbox.full():
            self._enqueue(_Job(job, is_load), inbox)
            return
        loop = asyncio.get_running_loop()
        self._reserved_ids.add(job.job_id)
        try:
            while True:
                waiter: asyncio.Future[None] = loop.create_future()
                self._room_waiters.append(waiter)
                try:
                    await waiter
                finally:
                    with contextlib.suppress(ValueError):
                        self._room_waiters.remove(waiter)
                if self._state is not _State.RUNNING:
                    raise ClosedError(f"{self._name()} closed while job {job.job_id} waited")
                if not inbox.full():
                    break
        finally:
            self._reserved_ids.discard(job.job_id)
        self._enqueue(_Job(job, is_load), inbox)

    def _admit(self, job: JobMetadata) -> JobMetadata:
        """Validate ``job`` and return an immutable snapshot of it; changes nothing.

        Raises:
            InvalidArgumentError: not a JobMetadata, called off the tier's loop, a
                job_id that is not an int or names a job whose result has not been
                drained by get_finished(), a key that is not bytes, or a slot id outside
                the host pool.
            ClosedError: the tier is not running.
        """
        if not isinstance(job, JobMetadata):
            raise InvalidArgumentError(f"expected a JobMetadata, got {type(job).__name__}")
        if self._state is not _State.RUNNING:
            state = "not started" if self._state is _State.NEW else self._state.value
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
        if job_id in self._jobs or job_id in self._reserved_ids or job_id in self._undrained:
            raise InvalidArgumentError(
                f"{self._name()}: job {job_id} is already submitted or its result not yet "
                "drained by get_finished()"
            )
        keys = tuple(job.keys)
        block_ids = tuple(job.block_ids)
        for key in keys:
            if not isinstance(key, bytes):
                raise InvalidArgumentError(
                    f"job {job_id}: keys must be bytes, got {type(key).__name__}"
                )
        limit = self.num_primary_slots
        for block_id in block_ids:
            if not isinstance(block_id, int) or isinstance(block_id, bool):
                raise InvalidArgumentError(f"job {job_id}: slot id {block_id!r} is not an int")
            if not 0 <= block_id < limit:
                raise InvalidArgumentError(
                    f"job {job_id}: slot {block_id} is outside the host pool (0..{limit - 1})"
                )
        return JobMetadata(job_id, keys, block_ids)

    def _inbox(self, is_load: bool) -> asyncio.Queue[_Job]:
        return self._load_inbox if is_load else self._store_inbox

    def _enqueue(self, job: _Job, inbox: asyncio.Queue[_Job]) -> None:
        inbox.put_nowait(job)
        self._jobs[job.meta.job_id] = job
        if not job.is_load:
            self._storing.update(set(job.meta.keys))
        self._work_ready.set()

    def _wake_room_waiters(self) -> None:
        for waiter in self._room_waiters:
            if not waiter.done():
                waiter.set_result(None)
        self._room_waiters.clear()

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
        job = self._jobs.get(job_id)
        finished = self._undrained.get(job_id)
        if self._loop is None or (job is None and finished is None):
            raise InvalidArgumentError(
                f"{self._name()}: unknown job {job_id!r} (never submitted, or its result "
                "was already drained by get_finished())"
            )
        future: asyncio.Future[JobResult] = self._loop.create_future()
        if finished is not None:
            future.set_result(finished)
        elif job is not None:
            job.waiters.append(future)
        return future

    def get_finished(self) -> list[JobResult]:
        """Results of the jobs finished since the last call, in completion order.

        Never blocks. Each result is returned exactly once; afterwards its job id is
        forgotten (``result()`` no longer knows it, and the id may be reused).
        """
        finished = list(self._completed)
        self._completed.clear()
        for job_result in finished:
            self._undrained.pop(job_result.job_id, None)
        return finished

    def storing(self, key: OffloadKey) -> bool:
        """True while ``key`` is in a queued or in-flight store job of this tier."""
        return key in self._storing

    # -- blocking work ----------------------------------------------------------------

    async def run_blocking(self, fn: Callable[..., _T], /, *args: object) -> _T:
        """Run ``fn(*args)`` on this tier's own bounded thread pool and return its result.

        Never uses the loop's default executor. Cancelling the caller cancels the call
        only if it has not started on a thread yet.

        Raises:
            ClosedError: the thread pool is shut down.
            Exception: whatever ``fn`` raises.
        """
        try:
            future = self._executor.submit(fn, *args)
        except RuntimeError as exc:
            raise ClosedError(f"{self._name()}: thread pool is shut down") from exc
        return await asyncio.wrap_future(future)

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

        Returns once closing and both inboxes are empty.
        """
        task_group = self._task_group
        assert task_group is not None
        while True:
            await self._inflight.acquire()
            job = await self._next_job()
            if job is None:
                self._inflight.release()
                return
            task = task_group.create_task(
                self._run_job(job), name=f"{self._name()}-{job.kind}-{job.meta.job_id}"
            )
            job.task = task
            task.add_done_callback(functools.partial(self._on_job_done, job))

    async def _next_job(self) -> _Job | None:
        while True:
            for inbox in (self._load_inbox, self._store_inbox):
                while not inbox.empty():
                    job = inbox.get_nowait()
                    self._wake_room_waiters()
                    if not job.finished:
                        return job
            if self._state is not _State.RUNNING:
                return None
            self._work_ready.clear()
            await self._work_ready.wait()

    async def _run_job(self, job: _Job) -> JobResult:
        """Run one hook; turn every failure of it into a failed JobResult."""
        meta = job.meta
        hook = self._do_load if job.is_load else self._do_store
        try:
            job_result = await hook(meta)
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                raise
            # The hook's own await was cancelled, not this job: a hook failure.
            return self._hook_failed(job, "CancelledError() raised inside the hook", None)
        except Exception as exc:
            return self._hook_failed(job, repr(exc), exc)
        if not isinstance(job_result, JobResult) or job_result.job_id != meta.job_id:
            return self._hook_failed(
                job, f"hook returned {job_result!r}, not a JobResult for job {meta.job_id}", None
            )
        return job_result

    def _hook_failed(self, job: _Job, error: str, exc: BaseException | None) -> JobResult:
        logger.error(
            "%s: %s job %d failed: %s", self._name(), job.kind, job.meta.job_id, error, exc_info=exc
        )
        return JobResult(job.meta.job_id, False, tuple(job.meta.keys), error)

    def _on_job_done(self, job: _Job, task: asyncio.Task[JobResult]) -> None:
        self._inflight.release()
        if task.cancelled():
            job_result = self._failure(job, self._cancel_reason)
        else:
            exc = task.exception()
            job_result = self._failure(job, repr(exc)) if exc is not None else task.result()
        self._finish(job, job_result)

    def _on_runner_done(self, runner: asyncio.Task[None]) -> None:
        if not runner.cancelled() and (exc := runner.exception()) is not None:
            logger.error("%s: serving stopped by an error", self._name(), exc_info=exc)
        if self._state is _State.RUNNING:
            # Not asked to stop: fail what is left rather than leave anyone waiting.
            logger.error("%s: serving stopped unexpectedly; tier closed", self._name())
            self._state = _State.CLOSING
            self._wake_room_waiters()
            self._fail_unfinished("tier actor stopped unexpectedly")
            self._finalize()

    # -- completion -------------------------------------------------------------------

    @staticmethod
    def _failure(job: _Job, reason: str) -> JobResult:
        return JobResult(job.meta.job_id, False, tuple(job.meta.keys), reason)

    def _finish(self, job: _Job, job_result: JobResult, *, notify_waiters: bool = True) -> None:
        """Record the one result of ``job``; later calls for the same job do nothing."""
        if job.finished:
            return
        job.finished = True
        del self._jobs[job.meta.job_id]
        if not job.is_load:
            self._storing.subtract(set(job.meta.keys))
            for key in set(job.meta.keys):
                if self._storing[key] <= 0:
                    del self._storing[key]
        self._completed.append(job_result)
        self._undrained[job.meta.job_id] = job_result
        if notify_waiters:
            for waiter in job.waiters:
                if not waiter.done():
                    waiter.set_result(job_result)
        job.waiters.clear()

    def _cancel_running_jobs(self) -> None:
        for job in list(self._jobs.values()):
            if job.task is not None and not job.task.done():
                job.task.cancel()

    def _fail_unfinished(self, reason: str, *, notify_waiters: bool = True) -> None:
        for job in list(self._jobs.values()):
            self._finish(job, self._failure(job, reason), notify_waiters=notify_waiters)

    def _finalize(self) -> None:
        self._state = _State.CLOSED
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._closed_event.set()
        self._on_closed()

    def _on_closed(self) -> None:
        """Release what the subclass holds beyond the actor; called once as the tier
        becomes closed, on the loop thread (or with no loop running)."""

    def _name(self) -> str:
        return f"{type(self).__name__}"


__all__ = ["ACTOR_OPTIONS", "TierActor"]
