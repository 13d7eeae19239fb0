"""The one way the engine reaches a secondary tier: :class:`TierClient` and :class:`TierOutcome`.

Whatever the tier is, a :class:`~tiering.actor.TierActor` with a bounded inbox or a tier
written against the seed interface that must be polled, the engine submits a job with
:meth:`TierClient.submit` and later receives one :class:`TierOutcome`: the keys that
landed and the keys that failed, each with a reason. Everything a tier can do wrong
(refuse the job, be closed, be full, raise, never answer) becomes a failed outcome.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections import deque
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType, TracebackType
from typing import Self

from tiering.actor import TierActor
from tiering.errors import InvalidArgumentError, TierBusyError
from tiering.inbox import Lane
from tiering.lifecycle import Lifecycle
from tiering.secondary import JobMetadata, JobResult, OffloadKey, ReqContext, SecondaryTierManager
from tiering.statistics import FailureLog, Statistics
from tiering.validation import seconds

logger = logging.getLogger(__name__)


# Polled tiers are asked for results every millisecond while a job is outstanding
# (asyncio.sleep below 1 ms busy-spins under uvloop).
_POLL_S = 0.001


@dataclass(frozen=True, slots=True)
class TierOutcome:
    """Keys that landed and keys that failed, each with a reason.

    ``landed`` and ``failed`` together are the job's keys; ``failed`` is read-only.
    """

    landed: tuple[bytes, ...]
    failed: Mapping[bytes, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "failed", MappingProxyType(dict(self.failed)))

    @property
    def ok(self) -> bool:
        """True if no key failed."""
        return not self.failed

    @classmethod
    def from_result(cls, keys: Sequence[bytes], result: JobResult) -> TierOutcome:
        """Read a :class:`JobResult` the one documented way (see its docstring)."""
        if result.success:
            return cls(tuple(keys))
        reason = result.error or "the tier reported a failure without a reason"
        named = set(result.failed_keys) & set(keys)
        if not named:  # failed as a whole: nothing may be counted as transferred
            return cls.failure(keys, reason)
        return cls(tuple(k for k in keys if k not in named), dict.fromkeys(named, reason))

    @classmethod
    def failure(cls, keys: Sequence[bytes], reason: str) -> TierOutcome:
        """Every key failed for ``reason``."""
        return cls((), dict.fromkeys(keys, reason))


@dataclass(eq=False, slots=True)
class _Job:
    meta: JobMetadata
    kind: Lane
    on_done: Callable[[TierOutcome], None]
    deadline: float = math.inf  # polled tiers only


class TierClient:
    """The engine's handle on one secondary tier, actor or polled.

    Guarantees of :meth:`submit`: it never blocks, never awaits and never raises for
    anything the tier does; ``on_done`` is called exactly once per submit, always later
    on the event loop (never from inside ``submit``), and, for a
    :class:`~tiering.actor.TierActor`, only once the tier has stopped touching the
    job's slots. For a polled tier the client cannot know when the tier stops touching
    the slots: a job it has no result for after ``timeout`` seconds is reported failed
    (reason naming the timeout), and the tier might still touch its slots afterwards.

    When an actor's inbox is full, jobs wait in the client's own FIFO backlog (one per
    kind) and a pump task submits them in order as room appears.

    Life cycle: ``NEW`` -> :meth:`start` -> ``OPEN`` -> :meth:`aclose` or :meth:`shutdown`
    -> ``CLOSING`` -> ``CLOSED`` once every job has its outcome and every task ended.
    """

    def __init__(self, tier: SecondaryTierManager, *, timeout: float = 30.0) -> None:
        """Wrap ``tier`` (not started here).

        Raises:
            InvalidArgumentError: ``tier`` is not a SecondaryTierManager, or ``timeout``
                is not a positive finite number.
        """
        if not isinstance(tier, SecondaryTierManager):
            raise InvalidArgumentError(
                f"tier must be a SecondaryTierManager, got {type(tier).__name__}"
            )
        seconds("timeout", timeout, allow_zero=False)
        self.tier = tier
        self.timeout = float(timeout)
        self.name: str = tier.get_tier_type()
        self.servable: bool = bool(getattr(tier, "holds_data", True))
        self._actor: TierActor | None = tier if isinstance(tier, TierActor) else None

        self._state = Lifecycle.NEW
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: asyncio.Task[None] | None = None
        self._next_id = 0
        self._jobs: dict[int, _Job] = {}  # submitted, outcome not yet delivered
        self._keys_in_flight = 0
        self._backlog: dict[Lane, deque[_Job]] = {"load": deque(), "store": deque()}
        self._pump_wake: dict[Lane, asyncio.Event] = {
            "load": asyncio.Event(),
            "store": asyncio.Event(),
        }
        self._polled: deque[_Job] = deque()  # polled tiers: by deadline
        self._poll_wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._closed_event = asyncio.Event()
        self._close_hooked = False
        self._failures = FailureLog(logger, f"tier client {self.name}")
        self._counters = {
            "jobs_submitted": 0,
            "jobs_backlogged": 0,
            "keys_landed": 0,
            "keys_failed": 0,
        }

    # -- life cycle -------------------------------------------------------------------

    async def start(self) -> None:
        """Start the tier (if it is a TierActor) and the client's tasks; no-op if open.

        Raises:
            ClosedError, TieringError: as the tier's ``start`` (the client stays NEW).
            InvalidArgumentError: the client is closing or closed.
        """
        if self._state is Lifecycle.OPEN:
            return
        if self._state is not Lifecycle.NEW:
            raise InvalidArgumentError(f"tier client {self.name} is {self._state}; cannot start")
        if self._actor is not None:
            await self._actor.start()
        loop = asyncio.get_running_loop()
        self._loop = loop
        self._state = Lifecycle.OPEN
        self._runner = loop.create_task(self._run(), name=f"tier-client-{self.name}")
        await asyncio.sleep(0)  # let the runner enter its TaskGroup

    # The deadline is part of the close protocol, so it is a parameter.
    async def aclose(self, timeout: float) -> None:  # noqa: ASYNC109
        """Close gracefully: admit nothing more, let outstanding jobs finish within
        ``timeout`` seconds, then close the tier (an actor fails what is left and
        reports it; jobs of a polled tier still without a result are failed). Every
        outstanding job's ``on_done`` has been called when this returns. Idempotent. If
        the caller is cancelled meanwhile, the client and tier are stopped hard
        (:meth:`shutdown`) and the cancellation propagates.

        Raises:
            InvalidArgumentError: ``timeout`` is negative or not a finite number.
        """
        seconds("timeout", timeout, allow_zero=True)
        if self._state is Lifecycle.CLOSED:
            return
        if self._state is Lifecycle.CLOSING:
            await self._closed_event.wait()
            return
        if self._state is Lifecycle.NEW:
            self._state = Lifecycle.CLOSING
            self.tier.shutdown()
            self._maybe_closed()
            return
        self._state = Lifecycle.CLOSING
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        try:
            if self._jobs:
                async with asyncio.timeout_at(deadline):
                    await self._idle.wait()
        except TimeoutError:
            pass
        except asyncio.CancelledError:
            self.shutdown()
            raise
        try:
            await self._stop_runner()
            self._fail_backlog("the client closed before the tier had room for the job")
            if self._actor is not None:
                await self._actor.aclose(max(0.0, deadline - loop.time()))
                self._collect_actor_results()
            else:
                self.tier.shutdown()
            self._fail_all("the client closed before the tier reported a result", "client closed")
            self._maybe_closed()
            await self._closed_event.wait()
        except asyncio.CancelledError:
            self.shutdown()
            raise

    def shutdown(self) -> None:
        """Stop hard, now: cancel the client's tasks and stop the tier
        (``tier.shutdown()``). Jobs in the backlog or at a polled tier get failed
        outcomes at once; an actor's jobs get theirs as the actor reports them (a job
        inside a blocking call only once that call returns). Synchronous, idempotent;
        outcomes are delivered on the loop, or here if the loop no longer runs."""
        if self._state is Lifecycle.CLOSED:
            return
        self._state = Lifecycle.CLOSING
        if self._runner is not None and not self._runner.done():
            self._runner.cancel()
        self._fail_backlog("the client shut down before the tier had room for the job")
        self.tier.shutdown()
        loop_running = self._loop is not None and self._loop.is_running()
        if self._actor is None or not loop_running:
            self._fail_all("the client shut down before the tier reported a result", "shutdown")
        self._maybe_closed()

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose(self.timeout)

    @property
    def state(self) -> Lifecycle:
        """Where the client is in its life cycle."""
        return self._state

    @property
    def backlog(self) -> int:
        """Jobs waiting in the client for room in the tier's inbox now."""
        return len(self._backlog["load"]) + len(self._backlog["store"])

    # -- pass-through queries ---------------------------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext = None) -> bool | None:
        """The tier's answer: True held, False not, None in transfer."""
        return self.tier.lookup(key, req_context)

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext = None) -> None:
        """Mark keys recently used in the tier, ``keys[0]`` most recently."""
        self.tier.touch(keys, req_context)

    def hold(self, keys: Collection[OffloadKey]) -> None:
        """Keep ``keys`` from eviction until :meth:`release` (see SecondaryTierManager)."""
        self.tier.hold(keys)

    def release(self, keys: Collection[OffloadKey]) -> None:
        """Undo one :meth:`hold` of each key."""
        self.tier.release(keys)

    # -- submission -------------------------------------------------------------------

    def submit(
        self,
        kind: Lane,
        keys: Sequence[bytes],
        slots: Sequence[int],
        on_done: Callable[[TierOutcome], None],
    ) -> None:
        """Send a store (CPU slots -> tier) or load (tier -> CPU slots) job.

        Never blocks or awaits; ``on_done(outcome)`` is called exactly once, later, on
        the loop (see the class docstring). A closed client or tier, a full inbox that
        stays full, a tier that raises, a tier that never answers: all end as a failed
        outcome, never as an exception here.

        Raises:
            InvalidArgumentError: ``kind`` is not "store"/"load", ``keys``/``slots`` are
                not sequences of equal length, a key is not bytes, a slot is not an
                int, or ``on_done`` is not callable. Nothing is submitted.
        """
        meta = self._validated(kind, keys, slots, on_done)
        loop = self._loop_for_submit()
        self._next_id += 1
        job = _Job(JobMetadata(self._next_id, meta[0], meta[1]), kind, on_done)
        self._jobs[job.meta.job_id] = job
        self._keys_in_flight += len(job.meta.keys)
        self._idle.clear()
        self._counters["jobs_submitted"] += 1
        if self._state is not Lifecycle.OPEN:
            self._finish_soon(loop, job, f"the {self.name} tier client is {self._state}", "closed")
            return
        if self._actor is not None:
            self._submit_to_actor(loop, job)
        else:
            self._submit_to_polled(loop, job)

    def _submit_to_actor(self, loop: asyncio.AbstractEventLoop, job: _Job) -> None:
        assert self._actor is not None
        backlog = self._backlog[job.kind]
        if not backlog:
            submit = self._actor.submit_load if job.kind == "load" else self._actor.submit_store
            try:
                submit(job.meta)
            except TierBusyError:
                pass  # back-pressure: into the backlog
            except Exception as exc:
                self._finish_soon(loop, job, f"the tier refused the job: {exc}", "refused")
                return
            else:
                self._attach(job)
                return
        backlog.append(job)
        self._counters["jobs_backlogged"] += 1
        self._pump_wake[job.kind].set()

    def _submit_to_polled(self, loop: asyncio.AbstractEventLoop, job: _Job) -> None:
        submit = self.tier.submit_load if job.kind == "load" else self.tier.submit_store
        try:
            submit(job.meta)
        except Exception as exc:
            self._finish_soon(loop, job, f"the tier refused the job: {exc}", "refused")
            return
        job.deadline = loop.time() + self.timeout
        self._polled.append(job)
        self._poll_wake.set()

    # -- statistics -------------------------------------------------------------------

    def statistics(self) -> Statistics:
        """The client's own snapshot: state, jobs (in the backlog, at the tier) without an
        outcome and their bytes, counters (``jobs_submitted``, ``jobs_backlogged``,
        ``keys_landed``, ``keys_failed``) and failed jobs by cause."""
        return Statistics(
            state=self._state,
            jobs_in_flight=len(self._jobs),
            bytes_in_flight=self._keys_in_flight * self.tier.block_bytes,
            counters=self._counters,
            failures=self._failures.counts,
        )

    def __repr__(self) -> str:
        return f"<TierClient {self.name} backlog={self.backlog} {self.statistics()!r}>"

    # -- tasks ------------------------------------------------------------------------

    async def _run(self) -> None:
        async with asyncio.TaskGroup() as task_group:
            if self._actor is not None:
                for kind in ("load", "store"):
                    task_group.create_task(self._pump(kind), name=f"tier-client-{self.name}-pump")
            else:
                task_group.create_task(self._poll(), name=f"tier-client-{self.name}-poll")

    async def _pump(self, kind: Lane) -> None:
        """Submit the backlog of ``kind`` in order, waiting for room in the inbox."""
        assert self._actor is not None
        backlog, wake = self._backlog[kind], self._pump_wake[kind]
        put = self._actor.put_load if kind == "load" else self._actor.put_store
        while True:
            if not backlog:
                wake.clear()
                await wake.wait()
                continue
            job = backlog[0]
            try:
                await put(job.meta)  # cancelled while waiting: nothing admitted
            except Exception as exc:
                backlog.popleft()
                self._finish(job, f"the tier refused the job: {exc}", "refused")
                continue
            backlog.popleft()
            self._attach(job)

    async def _poll(self) -> None:
        """Drain a polled tier's results, and time jobs out, while any is outstanding."""
        assert self._loop is not None
        while True:
            if not self._polled:
                self._poll_wake.clear()
                await self._poll_wake.wait()
                continue
            self._drain_polled()
            now = self._loop.time()
            while self._polled and (
                self._polled[0].meta.job_id not in self._jobs or self._polled[0].deadline <= now
            ):
                job = self._polled.popleft()
                if job.meta.job_id in self._jobs:
                    self._finish(
                        job,
                        f"no result from the {self.name} tier within the {self.timeout:g}s "
                        "timeout (the tier may drop jobs silently)",
                        "timeout",
                    )
            await asyncio.sleep(_POLL_S)

    def _drain_polled(self) -> None:
        try:
            results = list(self.tier.get_finished())
        except Exception as exc:
            self._failures.record("get_finished raised", detail=repr(exc))
            return
        for result in results:
            job = self._jobs.get(result.job_id) if isinstance(result, JobResult) else None
            if job is not None:
                self._deliver_result(job, result)

    async def _stop_runner(self) -> None:
        runner = self._runner
        if runner is not None and not runner.done():
            runner.cancel()
            await asyncio.wait({runner})

    # -- outcomes ---------------------------------------------------------------------

    def _attach(self, job: _Job) -> None:
        assert self._actor is not None
        future = self._actor.result(job.meta.job_id)
        future.add_done_callback(lambda f: self._on_actor_result(job, f))

    def _on_actor_result(self, job: _Job, future: asyncio.Future[JobResult]) -> None:
        assert self._actor is not None
        if future.cancelled():
            self._finish(job, "the tier's result was cancelled", "no result")
        else:
            self._deliver_result(job, future.result())
        # Results reach the client through result(); drain them so the tier forgets them.
        self._actor.get_finished()

    def _collect_actor_results(self) -> None:
        """After the actor closed: deliver results whose callbacks have not run yet."""
        assert self._actor is not None
        for result in self._actor.get_finished():
            job = self._jobs.get(result.job_id)
            if job is not None:
                self._deliver_result(job, result)

    def _deliver_result(self, job: _Job, result: JobResult) -> None:
        outcome = TierOutcome.from_result(job.meta.keys, result)
        if not outcome.ok and job.meta.job_id in self._jobs:
            self._failures.record(f"{job.kind} failed in the tier", detail=result.error or "")
        self._deliver(job, outcome)

    def _finish_soon(
        self, loop: asyncio.AbstractEventLoop, job: _Job, reason: str, cause: str
    ) -> None:
        loop.call_soon(self._finish, job, reason, cause)

    def _finish(self, job: _Job, reason: str, cause: str) -> None:
        if job.meta.job_id in self._jobs:
            self._failures.record(cause, detail=reason)
            self._deliver(job, TierOutcome.failure(job.meta.keys, reason))

    def _deliver(self, job: _Job, outcome: TierOutcome) -> None:
        """Call ``on_done`` once for ``job``; later calls for it do nothing."""
        if self._jobs.pop(job.meta.job_id, None) is None:
            return
        self._keys_in_flight -= len(job.meta.keys)
        self._counters["keys_landed"] += len(outcome.landed)
        self._counters["keys_failed"] += len(outcome.failed)
        try:
            job.on_done(outcome)
        except Exception:
            logger.exception("tier client %s: on_done of job %d raised", self.name, job.meta.job_id)
        if not self._jobs:
            self._idle.set()
            self._maybe_closed()

    def _fail_backlog(self, reason: str) -> None:
        for kind in ("load", "store"):
            backlog = self._backlog[kind]  # type: ignore[index]
            while backlog:
                job = backlog.popleft()
                self._finish_later(job, reason, "client closed")

    def _fail_all(self, reason: str, cause: str) -> None:
        for job in list(self._jobs.values()):
            self._finish_later(job, reason, cause)
        self._polled.clear()

    def _finish_later(self, job: _Job, reason: str, cause: str) -> None:
        loop = self._loop
        if loop is not None and loop.is_running() and not loop.is_closed():
            loop.call_soon(self._finish, job, reason, cause)
        else:
            self._finish(job, reason, cause)

    def _maybe_closed(self) -> None:
        if self._state is not Lifecycle.CLOSING or self._jobs:
            return
        if self._runner is not None and not self._runner.done():
            if not self._close_hooked:
                self._close_hooked = True
                self._runner.add_done_callback(lambda _: self._maybe_closed())
            return
        self._state = Lifecycle.CLOSED
        self._closed_event.set()

    # -- validation -------------------------------------------------------------------

    def _loop_for_submit(self) -> asyncio.AbstractEventLoop:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        if loop is None or (self._loop is not None and loop is not self._loop):
            raise InvalidArgumentError(
                f"tier client {self.name}: submit must be called on the client's event loop"
            )
        return loop

    @staticmethod
    def _validated(
        kind: object, keys: object, slots: object, on_done: object
    ) -> tuple[tuple[bytes, ...], tuple[int, ...]]:
        if kind not in ("store", "load"):
            raise InvalidArgumentError(f"kind must be 'store' or 'load', got {kind!r}")
        if not isinstance(keys, Sequence) or isinstance(keys, bytes | str):
            raise InvalidArgumentError(f"keys must be a sequence of bytes, got {keys!r}")
        if not isinstance(slots, Sequence) or isinstance(slots, bytes | str):
            raise InvalidArgumentError(f"slots must be a sequence of ints, got {slots!r}")
        if len(keys) != len(slots):
            raise InvalidArgumentError(f"{len(keys)} keys but {len(slots)} slots")
        for key in keys:
            if not isinstance(key, bytes):
                raise InvalidArgumentError(f"keys must be bytes, got {key!r}")
        for slot in slots:
            if not isinstance(slot, int) or isinstance(slot, bool):
                raise InvalidArgumentError(f"slots must be ints, got {slot!r}")
        if not callable(on_done):
            raise InvalidArgumentError(f"on_done must be callable, got {on_done!r}")
        return tuple(keys), tuple(slots)


__all__ = ["TierClient", "TierOutcome"]
