"""A tier's job records and its results ledger: exactly one :class:`JobResult` per job.
One event loop thread; nothing here is thread-safe."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field

from tiering.errors import InvalidArgumentError
from tiering.tiers.inbox import Lane
from tiering.tiers.tier_api import JobMetadata, JobResult


@dataclass(eq=False, slots=True)
class TierJob:
    """One job of a tier: what to move, how it is served, and its one result."""

    meta: JobMetadata
    lane: Lane
    on_done: Callable[[JobResult], None] | None = None  # set: delivered here, not drained
    task: asyncio.Task[JobResult] | None = None
    waiters: list[asyncio.Future[JobResult]] = field(default_factory=list)
    busy: int = 0
    result: JobResult | None = None  # decided; delivered once not busy
    delivered: bool = False


class ResultsLedger:
    """Jobs by id and their one result each, delivered to the job's ``on_done``
    (forgotten at once), or to every :meth:`waiter` future and once to :meth:`drain`,
    which frees the id. A *busy* job's result (a thread call of it still touches its
    slots) is held back until it stops being busy. ``on_delivered(job, result)`` is
    called as a result is delivered, before anyone else sees it."""

    def __init__(
        self,
        *,
        owner: str = "tier",
        on_delivered: Callable[[TierJob, JobResult], None] | None = None,
    ) -> None:
        self._owner = owner
        self._on_delivered = on_delivered
        self._jobs: dict[int, TierJob] = {}  # admitted and not yet drained
        self._next_id = 0  # where admit_new looks for a free id
        self._finished: deque[JobResult] = deque()  # delivered, not yet drained
        self.pending = 0
        """Jobs admitted whose result is not delivered yet."""
        self.keys_pending = 0
        """Keys of the jobs counted by :attr:`pending`."""

    def admit(self, job: TierJob) -> None:
        """Start tracking ``job``, whose id the caller checked with :meth:`check_free`."""
        self._jobs[job.meta.job_id] = job
        self.pending += 1
        self.keys_pending += len(job.meta.keys)

    def admit_new(
        self,
        lane: Lane,
        keys: tuple[bytes, ...],
        slots: tuple[int, ...],
        on_done: Callable[[JobResult], None],
        taken: Collection[int] = (),
    ) -> TierJob:
        """Admit and return a job of ``keys`` and ``slots`` delivered to ``on_done``,
        under an id neither in use here nor in ``taken``."""
        while self._next_id in self._jobs or self._next_id in taken:
            self._next_id += 1
        job = TierJob(JobMetadata(self._next_id, keys, slots), lane, on_done)
        self._next_id += 1
        self.admit(job)
        return job

    def check_free(self, job_id: object, taken: Collection[int] = ()) -> None:
        """Raise InvalidArgumentError unless ``job_id`` is an int that is neither in use
        here (pending, or its result not drained) nor in ``taken``."""
        if not isinstance(job_id, int) or isinstance(job_id, bool):
            raise InvalidArgumentError(f"job_id must be an int, got {job_id!r}")
        if job_id in self._jobs or job_id in taken:
            raise InvalidArgumentError(
                f"{self._owner}: job {job_id} is already submitted or its result not yet "
                "drained by get_finished()"
            )

    def __contains__(self, job_id: object) -> bool:
        return job_id in self._jobs

    def undelivered(self) -> Iterator[TierJob]:
        """The jobs whose result is not delivered yet (a snapshot)."""
        return iter([job for job in self._jobs.values() if not job.delivered])

    @property
    def busy_jobs(self) -> int:
        """Jobs whose work still touches their slots."""
        return sum(1 for job in self._jobs.values() if job.busy)

    def busy(self, job_id: int) -> None:
        """Mark one more piece of work of the job as touching its slots (counts)."""
        job = self._jobs.get(job_id)
        if job is None or job.delivered:
            raise InvalidArgumentError(f"{self._owner}: job {job_id!r} is not pending")
        job.busy += 1

    def idle(self, job_id: int) -> None:
        """Undo one :meth:`busy`; delivers a held-back result when the count reaches 0."""
        job = self._jobs.get(job_id)
        if job is None or job.busy <= 0:
            raise InvalidArgumentError(f"{self._owner}: job {job_id!r} is not busy")
        job.busy -= 1
        if not job.busy and job.result is not None and not job.delivered:
            self._deliver(job, notify=True)

    def is_busy(self, job_id: int) -> bool:
        """True while some work of the job still touches its slots."""
        job = self._jobs.get(job_id)
        return job is not None and job.busy > 0

    def finish(self, job_id: int, result: JobResult, *, notify: bool = True) -> bool:
        """Decide the job's one result (the first decision wins; True if this one did),
        delivered now or once the job stops being busy; ``notify=False`` leaves waiters
        unresolved. Raises InvalidArgumentError for an unknown job or a result of another
        job id."""
        job = self._jobs.get(job_id)
        if job is None:
            raise InvalidArgumentError(f"{self._owner}: unknown job {job_id!r}")
        if result.job_id != job_id:
            raise InvalidArgumentError(
                f"{self._owner}: result for job {result.job_id} given for job {job_id}"
            )
        if job.result is not None:
            return False
        job.result = result
        if not job.busy:
            self._deliver(job, notify=notify)
        return True

    def fail(self, job_id: int, reason: str, *, notify: bool = True) -> bool:
        """:meth:`finish` with a failure naming every key of the job and ``reason``."""
        job = self._jobs.get(job_id)
        keys = () if job is None else tuple(job.meta.keys)  # unknown: finish raises
        return self.finish(job_id, JobResult(job_id, False, keys, reason), notify=notify)

    def fail_undecided(self, reason: str, *, notify: bool = True) -> list[int]:
        """Fail every job without a result yet (busy ones too); returns their ids."""
        undecided = [job_id for job_id, job in self._jobs.items() if job.result is None]
        for job_id in undecided:
            self.fail(job_id, reason, notify=notify)
        return undecided

    def waiter(self, job_id: int, loop: asyncio.AbstractEventLoop) -> asyncio.Future[JobResult]:
        """A new future of the job's result (resolved if delivered already); raises
        InvalidArgumentError for a job never admitted or already drained."""
        job = self._jobs.get(job_id)
        if job is None:
            raise InvalidArgumentError(
                f"{self._owner}: unknown job {job_id!r} (never submitted, or its result "
                "was already drained by get_finished())"
            )
        future: asyncio.Future[JobResult] = loop.create_future()
        if job.delivered:
            assert job.result is not None
            future.set_result(job.result)
        else:
            job.waiters.append(future)
        return future

    def drain(self) -> list[JobResult]:
        """Delivered results not drained before, in delivery order; their ids are freed."""
        drained = list(self._finished)
        self._finished.clear()
        for result in drained:
            del self._jobs[result.job_id]
        return drained

    def _deliver(self, job: TierJob, *, notify: bool) -> None:
        result = job.result
        assert result is not None
        job.delivered = True
        self.pending -= 1
        self.keys_pending -= len(job.meta.keys)
        if job.on_done is None:
            self._finished.append(result)
        else:
            del self._jobs[job.meta.job_id]
        if self._on_delivered is not None:
            self._on_delivered(job, result)
        if job.on_done is not None:
            job.on_done(result)
        elif notify:
            for waiter in job.waiters:
                if not waiter.done():
                    waiter.set_result(result)
        job.waiters.clear()
