"""One kv-tiering tier on a private event loop thread, for frameworks that call their
storage synchronously from threads of their own: the vLLM and SGLang adapters' core."""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from collections import deque
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, TypeVar

import uvloop

from tiering.errors import InvalidArgumentError
from tiering.tiers.client import TierClient, TierOutcome
from tiering.tiers.inbox import Lane
from tiering.tiers.io_threads import STAGING_BYTES
from tiering.tiers.registry import make_tier
from tiering.tiers.tier_api import checked_job
from tiering.validation import seconds

logger = logging.getLogger(__name__)

FRAMEWORK_DEFAULTS: dict[str, Any] = {"gil_pause_bytes": 0, "staging_bytes": STAGING_BYTES}
"""Tier options under a framework: the loop is private, so no GIL pauses; the host memory
is scattered 4 KiB pages, so direct I/O is staged (docs/vllm.md#how-it-works)."""

_T = TypeVar("_T")
_ALIVE_CHECK_S = 1.0  # how often a waiting thread checks that the loop thread still runs


class TierThread:
    """The tier that ``spec`` names (``{"type": name, **options}``), built over
    ``primary_view`` in blocks of ``block_bytes`` with ``defaults`` for options the spec
    leaves out, on a private loop thread named ``name``.

    Any thread may call every method. Each submitted job's ``on_done`` runs exactly once,
    after the tier stopped touching the job's slots (a job submitted after :meth:`close`
    began, or unended when the loop thread died, fails with a reason instead). The
    constructor raises as :func:`~tiering.tiers.registry.make_tier` for a bad spec,
    InvalidArgumentError for a bad timeout, TimeoutError if the tier did not start within
    ``start_timeout`` seconds; then nothing is left running and ``primary_view`` is released."""

    def __init__(
        self,
        spec: dict[str, Any],
        primary_view: memoryview,
        block_bytes: int,
        *,
        name: str,
        defaults: dict[str, Any],
        start_timeout: float,
        job_timeout: float,
        report_removals: bool = False,
    ) -> None:
        self._done = threading.Condition()
        self._in_flight: dict[int, tuple[Sequence[bytes], Callable[[TierOutcome], None]]] = {}
        self._tokens = itertools.count()
        self._handoff: deque[tuple[Any, ...]] = deque()
        self._wake_scheduled = False
        self._closing = False

        async def open_tier() -> TierClient:  # on the loop: the tier's actor lives there
            tier = make_tier(spec, primary_view, block_bytes, defaults=defaults)
            for option, unset in (("admission", "all"), ("write_budget", None)):
                if getattr(tier, option, unset) != unset:  # said, not silently ignored
                    tier.shutdown()
                    raise InvalidArgumentError(
                        f"tier {tier.get_tier_type()!r}: {option} is the engine's; under a "
                        "framework's own CPU tier every block it offers is written (leave "
                        f"{option} out)"
                    )
            if report_removals:
                tier.report_removals()
            client = TierClient(tier, timeout=self.job_timeout)
            try:
                await client.start()
            except BaseException:
                tier.shutdown()
                raise
            return client

        self._thread = threading.Thread(target=self._run_loop, name=name, daemon=True)
        try:
            seconds("start_timeout", start_timeout, allow_zero=False)
            self.job_timeout = seconds("job_timeout", job_timeout, allow_zero=False)
            self.num_slots = primary_view.nbytes // block_bytes
            self.loop = uvloop.new_event_loop()
            self._thread.start()
            self.client = self.run(open_tier(), start_timeout)
        except BaseException:
            self._stop_loop()
            primary_view.release()
            raise
        self.tier = self.client.tier

    def _run_loop(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
        finally:
            pending = [t for t in asyncio.all_tasks(self.loop) if not t.done()]
            for task in pending:
                task.cancel()
            if pending:
                self.loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            self.loop.run_until_complete(self.loop.shutdown_asyncgens())
            self.loop.close()

    @property
    def alive(self) -> bool:
        """True while the loop thread runs."""
        return self._thread.is_alive()

    def run(self, coro: Coroutine[Any, Any, _T], timeout: float | None) -> _T:
        """Run ``coro`` on the loop; wait for its result here, at most ``timeout`` seconds
        (TimeoutError after that; the coroutine is cancelled)."""
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout)
        except TimeoutError:
            future.cancel()
            raise

    def submit(
        self,
        kind: Lane,
        keys: Sequence[bytes],
        slots: Sequence[int],
        on_done: Callable[[TierOutcome], None],
        *,
        checked: bool = False,
    ) -> None:
        """Queue a store or load job (``keys[i]`` from or into slot ``slots[i]``); returns
        at once. With ``checked=False``, InvalidArgumentError, queueing nothing, for keys
        or slots :func:`~tiering.tiers.tier_api.checked_job` refuses."""
        if not checked:
            job = checked_job(0, keys, slots, self.num_slots)
            keys, slots = job.keys, job.block_ids
        token = next(self._tokens)
        with self._done:
            self._in_flight[token] = (keys, on_done)
            closing = self._closing
        if closing:
            self._ended(token, TierOutcome.failure(keys, "the tier is shut down"))
        else:
            self._hand_off(("submit", kind, token, keys, slots))

    def run_job(
        self, kind: Lane, keys: Sequence[bytes], slots: Sequence[int], *, checked: bool = False
    ) -> TierOutcome:
        """:meth:`submit` the job and wait for its outcome (the tier's deadlines bound it)."""
        outcomes: list[TierOutcome] = []
        self.submit(kind, keys, slots, outcomes.append, checked=checked)
        self.wait(lambda: bool(outcomes))
        return outcomes[0]

    def touch(self, keys: Sequence[bytes]) -> None:
        """Mark stored keys recently used (on the loop, soon); returns at once."""
        if not self._closing:
            self._hand_off(("touch", list(keys)))

    def wait(self, done: Callable[[], bool]) -> None:
        """Wait until ``done()`` holds (checked as jobs end) or the loop thread died (jobs fail)."""
        with self._done:
            while not done():
                if not self.alive:
                    self._fail_in_flight("the tier's event loop stopped")
                    break
                self._done.wait(_ALIVE_CHECK_S)

    def _hand_off(self, item: tuple[Any, ...]) -> None:
        self._handoff.append(item)
        # Wake the loop once per batch. The loop clears the flag before it drains, and
        # the item is appended before the flag is read, so no item is ever stranded.
        if not self._wake_scheduled:
            self._wake_scheduled = True
            try:
                self.loop.call_soon_threadsafe(self._drain_handoff)
            except RuntimeError:  # the loop is closed: close fails what is left
                self._wake_scheduled = False

    def _drain_handoff(self) -> None:
        """On the loop: pass every handed-off call to the tier client, in order."""
        self._wake_scheduled = False
        client = self.client
        while self._handoff:
            item = self._handoff.popleft()
            if item[0] == "touch":
                client.touch(item[1])
                continue
            _, kind, token, keys, slots = item
            client.submit(kind, keys, slots, lambda o, t=token: self._ended(t, o), checked=True)

    def _ended(self, token: int, outcome: TierOutcome) -> None:
        with self._done:
            entry = self._in_flight.pop(token, None)
            if entry is not None:
                entry[1](outcome)
            self._done.notify_all()

    def _fail_in_flight(self, reason: str) -> None:
        with self._done:
            for token, (keys, _) in list(self._in_flight.items()):
                self._ended(token, TierOutcome.failure(keys, reason))

    def close(self) -> None:
        """Close the tier (jobs in flight end first, within ``job_timeout``), stop the loop
        thread and fail whatever never ended. Idempotent; raises nothing (a failed close is
        logged)."""
        with self._done:
            if self._closing:
                return
            self._closing = True
        if self.alive:
            try:
                self.run(self._close(), None)
            except Exception:  # the jobs below carry the failure
                logger.exception("closing the %s tier failed", self.client.name)
        self._stop_loop()
        self._fail_in_flight("the tier shut down before the job ended")

    async def _close(self) -> None:
        self._drain_handoff()
        await self.client.aclose(self.job_timeout)

    def _stop_loop(self) -> None:
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join()


def fixed_tier(owner: type, fixed: str | None, given: object) -> str:
    """The tier an adapter class builds: its ``fixed`` one (``given`` must be None or the
    same), else ``given``. InvalidArgumentError naming ``tier`` otherwise."""
    if fixed is not None and given not in (None, fixed):
        raise InvalidArgumentError(
            f"tier: {owner.__name__} always builds the {fixed!r} tier, got {given!r}"
        )
    tier = fixed or given
    if not isinstance(tier, str) or not tier:
        raise InvalidArgumentError(
            f"tier must name a registered kv-tiering tier (e.g. 'nvme'), got {tier!r}"
        )
    return tier
