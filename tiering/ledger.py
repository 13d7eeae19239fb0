"""A tier's results ledger: exactly one :class:`JobResult` per admitted job.

The ledger knows every job id from admission until its result has been drained by
:meth:`ResultsLedger.drain` (the tier's ``get_finished()``). It delivers each job's one
result to every :meth:`ResultsLedger.waiter` future of the job and queues it once for
draining. Only then may the id be admitted again.

A job can be *busy*: while anything it started still touches its CPU slots (a blocking
call running on a thread), its result is held back, whoever produced it, and delivered
the moment the job stops being busy. So a caller that sees a result may reuse the slots.
Everything runs on one event loop thread; nothing here is thread-safe.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from tiering.errors import InvalidArgumentError
from tiering.secondary import JobResult, OffloadKey


@dataclass(eq=False, slots=True)
class _Entry:
    keys: tuple[OffloadKey, ...]
    waiters: list[asyncio.Future[JobResult]] = field(default_factory=list)
    busy: int = 0
    result: JobResult | None = None  # decided; delivered once not busy
    delivered: bool = False


class ResultsLedger:
    """Job ids, their waiters and their one result each.

    ``on_delivered(job_id, result)``, if given, is called once per job at the moment its
    result is delivered (before waiters are resolved), for the owner's bookkeeping.
    """

    def __init__(
        self,
        *,
        owner: str = "tier",
        on_delivered: Callable[[int, JobResult], None] | None = None,
    ) -> None:
        self._owner = owner
        self._on_delivered = on_delivered
        self._entries: dict[int, _Entry] = {}  # admitted and not yet drained
        self._finished: deque[JobResult] = deque()  # delivered, not yet drained
        self._pending = 0  # jobs without a delivered result
        self._keys_pending = 0  # and their keys

    # -- admission --------------------------------------------------------------------

    def admit(self, job_id: int, keys: Sequence[OffloadKey]) -> None:
        """Start tracking ``job_id``; it must not be known (pending or undrained).

        Raises:
            InvalidArgumentError: ``job_id`` is not an int, or is in use.
        """
        if not isinstance(job_id, int) or isinstance(job_id, bool):
            raise InvalidArgumentError(f"job_id must be an int, got {job_id!r}")
        if job_id in self._entries:
            raise InvalidArgumentError(
                f"{self._owner}: job {job_id} is already submitted or its result not yet "
                "drained by get_finished()"
            )
        entry = _Entry(tuple(keys))
        self._entries[job_id] = entry
        self._pending += 1
        self._keys_pending += len(entry.keys)

    def __contains__(self, job_id: object) -> bool:
        return job_id in self._entries

    # -- busy jobs --------------------------------------------------------------------

    def busy(self, job_id: int) -> None:
        """Mark one more piece of work of the job as touching its slots (counts)."""
        entry = self._entries.get(job_id)
        if entry is None or entry.delivered:
            raise InvalidArgumentError(f"{self._owner}: job {job_id!r} is not pending")
        entry.busy += 1

    def idle(self, job_id: int) -> None:
        """Undo one :meth:`busy`; delivers a held-back result when the count reaches 0."""
        entry = self._entries.get(job_id)
        if entry is None or entry.busy <= 0:
            raise InvalidArgumentError(f"{self._owner}: job {job_id!r} is not busy")
        entry.busy -= 1
        if not entry.busy and entry.result is not None and not entry.delivered:
            self._deliver(job_id, entry, notify=True)

    def is_busy(self, job_id: int) -> bool:
        """True while some work of the job still touches its slots."""
        entry = self._entries.get(job_id)
        return entry is not None and entry.busy > 0

    # -- results ----------------------------------------------------------------------

    def finish(self, job_id: int, result: JobResult, *, notify: bool = True) -> bool:
        """Decide the job's one result; the first decision wins, later ones are ignored.

        The result is delivered now, or once the job stops being busy. ``notify=False``
        (only for a loop that can no longer run callbacks) skips resolving waiters.
        Returns True if this call decided the result.

        Raises:
            InvalidArgumentError: unknown job, or ``result`` is for another job id.
        """
        entry = self._entries.get(job_id)
        if entry is None:
            raise InvalidArgumentError(f"{self._owner}: unknown job {job_id!r}")
        if result.job_id != job_id:
            raise InvalidArgumentError(
                f"{self._owner}: result for job {result.job_id} given for job {job_id}"
            )
        if entry.result is not None:
            return False
        entry.result = result
        if not entry.busy:
            self._deliver(job_id, entry, notify=notify)
        return True

    def fail(self, job_id: int, reason: str, *, notify: bool = True) -> bool:
        """:meth:`finish` with a failure naming every key of the job and ``reason``."""
        entry = self._entries.get(job_id)
        if entry is None:
            raise InvalidArgumentError(f"{self._owner}: unknown job {job_id!r}")
        return self.finish(job_id, JobResult(job_id, False, entry.keys, reason), notify=notify)

    def fail_undecided(self, reason: str, *, notify: bool = True) -> list[int]:
        """Fail every job without a result yet; returns their ids (busy ones included:
        their failures are delivered when they stop being busy)."""
        undecided = [job_id for job_id, e in self._entries.items() if e.result is None]
        for job_id in undecided:
            self.fail(job_id, reason, notify=notify)
        return undecided

    def waiter(self, job_id: int, loop: asyncio.AbstractEventLoop) -> asyncio.Future[JobResult]:
        """A new future resolving to the job's result (already resolved if delivered).

        Raises:
            InvalidArgumentError: unknown job (never admitted, or already drained).
        """
        entry = self._entries.get(job_id)
        if entry is None:
            raise InvalidArgumentError(
                f"{self._owner}: unknown job {job_id!r} (never submitted, or its result "
                "was already drained by get_finished())"
            )
        future: asyncio.Future[JobResult] = loop.create_future()
        if entry.delivered:
            assert entry.result is not None
            future.set_result(entry.result)
        else:
            entry.waiters.append(future)
        return future

    def drain(self) -> list[JobResult]:
        """Delivered results not drained before, in delivery order; their ids are freed."""
        drained = list(self._finished)
        self._finished.clear()
        for result in drained:
            del self._entries[result.job_id]
        return drained

    # -- state ------------------------------------------------------------------------

    @property
    def pending(self) -> int:
        """Jobs admitted whose result is not delivered yet."""
        return self._pending

    @property
    def keys_pending(self) -> int:
        """Keys of the jobs counted by :attr:`pending`."""
        return self._keys_pending

    @property
    def busy_jobs(self) -> int:
        """Jobs whose work still touches their slots."""
        return sum(1 for e in self._entries.values() if e.busy)

    # -- internals --------------------------------------------------------------------

    def _deliver(self, job_id: int, entry: _Entry, *, notify: bool) -> None:
        result = entry.result
        assert result is not None
        entry.delivered = True
        self._pending -= 1
        self._keys_pending -= len(entry.keys)
        self._finished.append(result)
        if self._on_delivered is not None:
            self._on_delivered(job_id, result)
        if notify:
            for waiter in entry.waiters:
                if not waiter.done():
                    waiter.set_result(result)
        entry.waiters.clear()


__all__ = ["ResultsLedger"]
