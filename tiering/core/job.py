"""The awaitable handle of one engine store or load, and the results kept for polling."""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Generator, Mapping
from dataclasses import replace
from typing import Any, Literal

from tiering.core.scheduler_api import BlockHash
from tiering.tiers.tier_api import JobResult

logger = logging.getLogger(__name__)

FINISHED_KEPT = 1 << 16  # the most results a FinishedResults keeps unless told otherwise


class Job:
    """An awaitable handle of one engine store or load (docs/job-lifecycle.md#calls):
    ``await job`` returns its :class:`JobResult`, naming the caller's hashes, and never
    raises for a failed job; ``await job.cascaded`` is a store's second answer. Cancelling
    an awaiting task cancels neither."""

    __slots__ = (
        "_cascaded",
        "_cascaded_value",
        "_loop",
        "_names",
        "_result",
        "_value",
        "job_id",
        "kind",
        "started",
    )

    def __init__(
        self,
        job_id: int,
        kind: Literal["store", "load"],
        loop: asyncio.AbstractEventLoop,
        started: float = 0.0,
        names: Mapping[BlockHash, BlockHash] | None = None,
    ) -> None:
        self.job_id = job_id
        self.kind = kind
        self.started = started  # time.perf_counter() at submission, for its latency
        self._loop = loop
        self._names = names  # the caller's hash of each key the job ran on, if they differ
        # Futures are made only for an await before the result: most jobs end first.
        self._result: asyncio.Future[JobResult] | None = None
        self._value: JobResult | None = None
        self._cascaded: asyncio.Future[bool] | None = None
        self._cascaded_value: bool | None = None

    def __await__(self) -> Generator[Any, None, JobResult]:
        if self._value is not None:
            return self._value
        if self._result is None:
            self._result = self._loop.create_future()
        return (yield from asyncio.shield(self._result).__await__())

    def done(self) -> bool:
        """True once the job's result is known."""
        return self._value is not None

    def result(self) -> JobResult:
        """The result of a finished job; raises ``asyncio.InvalidStateError`` before."""
        if self._value is None:
            raise asyncio.InvalidStateError(f"job {self.job_id} has not ended")
        return self._value

    def _set_result(self, result: JobResult) -> JobResult:
        """Settle the job (the first result stays); returns it as the caller sees it."""
        names = self._names
        if names is not None and result.failed_keys:
            result = replace(result, failed_keys=tuple(names.get(k, k) for k in result.failed_keys))
        if self._value is None:
            self._value = result
            if self._result is not None and not self._result.done():
                self._result.set_result(result)
        return result

    @property
    def cascaded(self) -> Awaitable[bool]:
        """Resolves once the store's blocks are in every secondary tier that admitted
        them (see class doc)."""
        if self._cascaded is None:
            self._cascaded = self._loop.create_future()
            if self._cascaded_value is not None:
                self._cascaded.set_result(self._cascaded_value)
        return asyncio.shield(self._cascaded)

    def _set_cascaded(self, ok: bool) -> None:
        if self._cascaded_value is None:
            self._cascaded_value = ok
            if self._cascaded is not None and not self._cascaded.done():
                self._cascaded.set_result(ok)

    def __repr__(self) -> str:
        return f"<Job {self.job_id} {self.kind} {'done' if self.done() else 'running'}>"


class FinishedResults:
    """Results of finished jobs, kept for a caller that polls once per step; beyond
    ``capacity`` the oldest are dropped, with one warning for the life of the buffer."""

    def __init__(self, capacity: int | None = None) -> None:
        maxlen = FINISHED_KEPT if capacity is None else capacity
        self._results: deque[JobResult] = deque(maxlen=maxlen)
        self.dropped = 0  # results dropped unread so far

    def append(self, result: JobResult) -> None:
        if len(self._results) == self._results.maxlen:
            self.dropped += 1
            if self.dropped == 1:
                logger.warning(
                    "engine: %d job results wait in get_finished(); dropping the oldest "
                    "(await the jobs, or drain get_finished() every step)",
                    self._results.maxlen,
                )
        self._results.append(result)

    def drain(self) -> list[JobResult]:
        """The results kept, oldest first, and empty the buffer."""
        results = list(self._results)
        self._results.clear()
        return results
