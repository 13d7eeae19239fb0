"""The awaitable handle of one engine store or load."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Generator
from typing import Any, Literal

from tiering.secondary import JobResult


class Job:
    """An awaitable handle of one engine store or load.

    ``await job`` returns its :class:`JobResult` (it never raises for a failed job).
    Cancelling a task that awaits the job does not cancel the job. For a store,
    ``await job.cascaded`` returns True once every secondary tier holds its blocks (at
    once when there is nothing to cascade, as under write-back) and False if a tier
    failed, the store failed or the engine closed first; for a load it is True once the
    load ended.
    """

    __slots__ = ("_cascaded", "_cascaded_value", "_result", "job_id", "kind")

    def __init__(
        self, job_id: int, kind: Literal["store", "load"], result: asyncio.Future[JobResult]
    ):
        self.job_id = job_id
        self.kind = kind
        self._result = result
        self._cascaded: asyncio.Future[bool] | None = None
        self._cascaded_value: bool | None = None

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
        if self._cascaded is None:
            self._cascaded = self._result.get_loop().create_future()
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


__all__ = ["Job"]
