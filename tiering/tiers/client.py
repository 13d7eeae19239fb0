"""The one way the engine reaches a secondary tier: :class:`TierClient`, whose jobs each
get one :class:`TierOutcome`, and :class:`PolledTier` for a tier written against the
seed's polled interface (docs/architecture.md#tiers-are-actors)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from types import MappingProxyType
from typing import Any

from tiering.errors import ClosedError, InvalidArgumentError
from tiering.lifecycle import AsyncService, Lifecycle, running_loop
from tiering.observe.statistics import FailureLog, Statistics
from tiering.tiers.actor import TierActor
from tiering.tiers.inbox import Lane
from tiering.tiers.tier_api import (
    JobMetadata,
    JobResult,
    OffloadKey,
    ReqContext,
    SecondaryTierManager,
    checked_job,
)
from tiering.validation import seconds

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class TierOutcome:
    """Keys that landed and keys that failed (read-only), each with a reason; together
    the job's keys."""

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


class PolledTier(TierActor):
    """A tier written against the seed's polled interface, served as a TierActor.

    Each job submits to ``tier`` and polls its ``get_finished()`` until the job's result
    comes, failing after ``timeout`` seconds (such a tier may drop a job silently) or
    with the tier's reason if the submit raises. Closing the adapter shuts ``tier`` down."""

    def __init__(self, tier: SecondaryTierManager, *, timeout: float, inbox_size: int = 64) -> None:
        """Raises: InvalidArgumentError: ``timeout`` is not a positive finite number."""
        super().__init__(
            tier.primary_kv_view,
            tier.block_bytes,
            inbox_size=inbox_size,
            max_inflight=inbox_size,
            io_threads=1,
        )
        self.tier = tier
        self.timeout = seconds("timeout", timeout, allow_zero=False)
        self._polling: set[int] = set()  # jobs waiting for their result
        self._results: dict[int, JobResult] = {}  # polled, not yet taken by their job

    def get_tier_type(self) -> str:  # type: ignore[override]
        return self.tier.get_tier_type()

    def get_num_blocks(self) -> int:
        return self.tier.get_num_blocks()

    def lookup(self, key: OffloadKey, req_context: ReqContext = None) -> bool | None:
        return self.tier.lookup(key, req_context)

    def _on_closed(self) -> None:
        self.tier.shutdown()

    async def _do_store(self, job: JobMetadata) -> JobResult:
        return await self._polled(job, self.tier.submit_store)

    async def _do_load(self, job: JobMetadata) -> JobResult:
        return await self._polled(job, self.tier.submit_load)

    async def _polled(self, job: JobMetadata, submit: Callable[[JobMetadata], None]) -> JobResult:
        keys = tuple(job.keys)
        try:
            submit(job)
        except Exception as exc:
            return JobResult(job.job_id, False, keys, f"the tier refused the job: {exc}")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        self._polling.add(job.job_id)
        try:
            self._poll()
            while (result := self._results.pop(job.job_id, None)) is None:
                if loop.time() >= deadline:
                    reason = (
                        f"no result from the {self.get_tier_type()} tier within the "
                        f"{self.timeout:g}s timeout (the tier may drop jobs silently)"
                    )
                    self._failures.record("timeout", detail=reason)
                    return JobResult(job.job_id, False, keys, reason)
                await asyncio.sleep(0.001)  # below 1 ms, asyncio.sleep busy-spins under uvloop
                self._poll()
        finally:
            self._polling.discard(job.job_id)
        return result

    def _poll(self) -> None:
        try:
            results: Iterable[Any] = list(self.tier.get_finished())
        except Exception as exc:
            self._failures.record("get_finished raised", detail=repr(exc))
            return
        for result in results:
            if isinstance(result, JobResult) and result.job_id in self._polling:
                self._results[result.job_id] = result


class TierClient(AsyncService):
    """The engine's handle on one secondary tier, actor or polled
    (docs/architecture.md#tiers-are-actors); its life cycle is the tier's.

    :meth:`submit` never blocks, awaits or raises for anything the tier does (refusing,
    closed, raising, never answering: a failed outcome); ``on_done`` is called exactly
    once per job, later on the loop, once the tier has stopped touching the job's slots.
    ``timeout`` bounds a polled tier's jobs. Raises InvalidArgumentError for a
    non-SecondaryTierManager ``tier`` or a bad ``timeout``."""

    def __init__(self, tier: SecondaryTierManager, *, timeout: float = 30.0) -> None:
        if not isinstance(tier, SecondaryTierManager):
            raise InvalidArgumentError(
                f"tier must be a SecondaryTierManager, got {type(tier).__name__}"
            )
        self.timeout = seconds("timeout", timeout, allow_zero=False)
        self.tier = tier
        self.actor = tier if isinstance(tier, TierActor) else PolledTier(tier, timeout=timeout)
        self.name: str = tier.get_tier_type()
        self.servable: bool = bool(getattr(tier, "holds_data", True))
        self._failures = FailureLog(logger, f"tier client {self.name}")
        self._counters = dict.fromkeys(
            ("jobs_submitted", "jobs_backlogged", "keys_landed", "keys_failed"), 0
        )
        self._jobs_in_flight = 0
        self._keys_in_flight = 0
        # Queries go straight to the tier: synchronous and cheap.
        self.lookup: Callable[..., bool | None] = tier.lookup
        self.touch: Callable[..., None] = tier.touch
        self.hold: Callable[[Collection[OffloadKey]], None] = tier.hold
        self.release: Callable[[Collection[OffloadKey]], None] = tier.release

    async def start(self) -> None:
        """Start the tier (a no-op if open); raises as the tier's ``start``."""
        await self.actor.start()

    async def aclose(self, timeout: float | None = None) -> None:  # noqa: ASYNC109
        """Close the tier gracefully (:meth:`TierActor.aclose`) within ``timeout``
        seconds (the client's ``timeout`` if None)."""
        await self.actor.aclose(self.timeout if timeout is None else timeout)

    def shutdown(self) -> None:
        """Stop the tier hard, now (:meth:`TierActor.shutdown`); synchronous, idempotent."""
        self.actor.shutdown()

    @property
    def state(self) -> Lifecycle:
        """Where the tier is in its life cycle."""
        return self.actor.state

    def submit(
        self,
        kind: Lane,
        keys: Sequence[bytes],
        slots: Sequence[int],
        on_done: Callable[[TierOutcome], None],
        *,
        checked: bool = False,
    ) -> None:
        """Queue a store (CPU slots -> tier) or load (tier -> CPU slots) job: ``keys[i]``
        moves from or into CPU slot ``slots[i]``; ``on_done(outcome)`` follows. With
        ``checked=False``, InvalidArgumentError, queueing nothing, for a ``kind`` not
        "store"/"load", arguments :func:`~tiering.tiers.tier_api.checked_job` refuses, an
        ``on_done`` not callable or a call off the tier's event loop."""
        if not checked:
            loop = running_loop()
            if loop is None or self.actor._loop not in (None, loop):
                raise InvalidArgumentError(
                    f"tier client {self.name}: submit must be called on the tier's event loop"
                )
            if kind not in ("store", "load"):
                raise InvalidArgumentError(f"kind must be 'store' or 'load', got {kind!r}")
            job = checked_job(0, keys, slots)
            if not callable(on_done):
                raise InvalidArgumentError(f"on_done must be callable, got {on_done!r}")
            keys, slots = job.keys, job.block_ids
        keys = tuple(keys)
        self._counters["jobs_submitted"] += 1
        self._jobs_in_flight += 1
        self._keys_in_flight += len(keys)
        done = partial(self._ended, kind, keys, on_done)
        try:
            queued = self.actor._send(kind, keys, tuple(slots), done)
        except ClosedError as exc:
            asyncio.get_running_loop().call_soon(done, JobResult(0, False, keys, str(exc)))
            return
        if not queued:
            self._counters["jobs_backlogged"] += 1

    def _ended(
        self,
        kind: Lane,
        keys: tuple[bytes, ...],
        on_done: Callable[[TierOutcome], None],
        result: JobResult,
    ) -> None:
        outcome = TierOutcome.from_result(keys, result)
        self._jobs_in_flight -= 1
        self._keys_in_flight -= len(keys)
        self._counters["keys_landed"] += len(outcome.landed)
        self._counters["keys_failed"] += len(outcome.failed)
        if not outcome.ok:
            self._failures.record(f"{kind} failed in the tier", detail=result.error or "")
        try:
            on_done(outcome)
        except Exception:
            logger.exception("tier client %s: on_done of a %s job raised", self.name, kind)

    def statistics(self) -> Statistics:
        """The tier's state, jobs without an outcome and their bytes, counters
        (``jobs_submitted``, ``jobs_backlogged``, ``keys_landed``, ``keys_failed``) and
        failed jobs by cause."""
        return Statistics(
            state=self.state,
            jobs_in_flight=self._jobs_in_flight,
            bytes_in_flight=self._keys_in_flight * self.tier.block_bytes,
            counters=self._counters,
            failures=self._failures.counts,
        )

    def __repr__(self) -> str:
        parked = self.actor.inbox_statistics().parked
        return f"<TierClient {self.name} backlog={parked} {self.statistics()!r}>"
