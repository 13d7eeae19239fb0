"""The threads that move bytes off the event loop: every thread pool of the engine (device
copies, tier I/O) starts its threads with :func:`init_io_worker`; :class:`IoThreads` is a
tier's pool and the hop onto it."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future as ThreadFuture
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

from tiering.errors import ClosedError

if TYPE_CHECKING:
    from tiering.tiers.ledger import ResultsLedger

_T = TypeVar("_T")

IO_WORKER_NICENESS = 5
"""How much lower than the loop thread the I/O workers are scheduled (Linux nice)."""

STAGING_BYTES = 32 << 20
"""The default staging buffer of an I/O thread that stages copies (device copies, NVMe
records under a framework's tier)."""

RUNNING_JOB: contextvars.ContextVar[tuple[IoThreads | None, int]] = contextvars.ContextVar(
    "tiering_tier_job", default=(None, 0)
)
"""The tier and the job whose hook the current task runs: its thread calls mark it busy."""


def init_io_worker() -> None:
    """Configure the calling thread as a bulk I/O worker: one torch intra-op thread and a
    lower scheduling priority (docs/architecture.md#the-event-loop-rule), both for this
    thread alone; best effort, never raises."""
    with contextlib.suppress(Exception):
        import torch

        torch.set_num_threads(1)
    with contextlib.suppress(OSError, AttributeError):
        tid = threading.get_native_id()
        os.setpriority(
            os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + IO_WORKER_NICENESS
        )


def deliver(
    loop: asyncio.AbstractEventLoop, done: asyncio.Future[Any], value: Any, *, raised: bool = False
) -> None:
    """From any thread: hand ``value`` to ``done`` on ``loop`` with one wake-up (its
    awaiter raises it if ``raised``); nothing if ``done`` is already done (its awaiter
    was cancelled) or the loop is closed (nobody waits any more)."""
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(_settle, done, value, raised)


def _settle(done: asyncio.Future[Any], value: Any, raised: bool) -> None:
    if done.done():
        return
    if raised:
        done.set_exception(value)
    else:
        done.set_result(value)


def _call_then_deliver(
    loop: asyncio.AbstractEventLoop,
    done: asyncio.Future[_T],
    fn: Callable[..., _T],
    args: tuple[object, ...],
) -> None:
    """On a pool thread: ``fn(*args)``, its value or error delivered to ``done``.
    Nothing is raised here: the pool's own future would keep the error's frames, and
    the memory they name, alive."""
    try:
        value: Any = fn(*args)
    except BaseException as exc:  # handed over whole: the awaiter raises it
        deliver(loop, done, exc, raised=True)
    else:
        deliver(loop, done, value)


class IoThreads:
    """A tier's thread pool and the hop onto it, a base of
    :class:`~tiering.tiers.actor.TierActor`: it counts the calls running (the tier
    closes once none does, :meth:`_maybe_closed`) and marks the job of the hook that
    makes a call busy in the tier's ledger meanwhile (:data:`RUNNING_JOB`)."""

    _ledger: ResultsLedger

    def __init__(self, threads: int) -> None:
        self._executor = ThreadPoolExecutor(
            max_workers=threads,
            thread_name_prefix=f"{type(self).__name__}-io",
            initializer=init_io_worker,
        )
        self._calls_running = 0  # run_blocking calls started and not yet returned

    async def run_blocking(self, fn: Callable[..., _T], /, *args: object) -> _T:
        """``fn(*args)`` run on this tier's thread pool. Cancelled before the call starts,
        it is dropped; after, it waits until ``fn`` returns (its outcome discarded), so
        nothing the thread uses is released under it. From a job's hook, the job's result
        is held back meanwhile. Raises ClosedError once the pool is shut down, else
        whatever ``fn`` raises."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[_T] = loop.create_future()
        try:
            call = self._executor.submit(_call_then_deliver, loop, done, fn, args)
        except RuntimeError as exc:
            raise ClosedError(f"{type(self).__name__}: thread pool is shut down") from exc
        return await self.wait_call(call, done)

    async def wait_call(self, call: ThreadFuture[Any], done: asyncio.Future[_T]) -> _T:
        """Await ``done``, the outcome of ``call``: work on a thread of this tier (its
        pool's, or one of its own that runs ``call`` as a pool does, delivering with
        :func:`deliver`), as :meth:`run_blocking` awaits it. Cancelled, ``call`` is
        withdrawn if it has not started, else waited for."""
        tier, job_id = RUNNING_JOB.get()
        marked = tier is self and job_id in self._ledger
        if marked:
            self._ledger.busy(job_id)
        self._calls_running += 1
        try:
            return await done
        except asyncio.CancelledError:
            if not done.cancelled():
                done.exception()  # delivered, and discarded: the cancellation wins
            elif not call.cancel():  # started: the thread has to end first
                ended = asyncio.wrap_future(call)
                while not ended.done():
                    try:
                        await asyncio.wait({ended})
                    except asyncio.CancelledError:
                        continue  # already cancelled
            raise
        finally:
            if self._calls_running > 0:
                self._calls_running -= 1
            if marked and self._ledger.is_busy(job_id):
                self._ledger.idle(job_id)
            if self._calls_running == 0:
                self._maybe_closed()

    def _maybe_closed(self) -> None:
        """Called whenever no thread call runs any more."""
