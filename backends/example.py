"""The reference secondary tier of the seed: presence-only, synchronous, LRU-bounded. It
exercises the secondary-tier protocol, reproducing the seed's behaviour on purpose,
quirks included, with one deliberate fix (see :class:`ExampleSecondaryTier`)."""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Collection

from pydantic import Field

from tiering.errors import InvalidArgumentError
from tiering.options import Options
from tiering.tiers.tier_api import (
    JobMetadata,
    JobResult,
    OffloadKey,
    ReqContext,
    SecondaryTierManager,
    checked_job,
)


class ExampleOptions(Options):
    """The example tier's options: room for ``max_blocks`` keys; with
    ``simulate_async``, results come on the next :meth:`~ExampleSecondaryTier.get_finished`."""

    max_blocks: int = Field(1000, ge=0)
    simulate_async: bool = False


class ExampleSecondaryTier(SecondaryTierManager):
    """A presence-only tier of at most ``max_blocks`` keys, evicting least recently used,
    as the seed's:

    * A store records the job's keys that are not yet present. If all are present it
      does nothing and yields **no result**. If room is short, it evicts least recently
      used keys that are not in the job; if it cannot find enough, it gives up
      silently: nothing is evicted or stored and the job yields **no result**.
    * A load of held keys succeeds without touching the LRU order.
    * With ``simulate_async`` a job's result (and a store's insertion) happens on the
      next :meth:`get_finished`; eviction still happens at submit time. Otherwise it
      happens during the submit call.
    * ``touch`` makes ``keys[0]`` the most recent; ``clear`` also drops pending and
      unreported results.

    The fix: a load naming a key the tier does not hold yields ``JobResult(job_id,
    success=False, failed_keys=<the missing keys>)``, not nothing.

    Malformed jobs (not a JobMetadata, non-bytes keys, slot ids outside the host pool)
    raise :class:`InvalidArgumentError` and change nothing.

    It stores no bytes (``holds_data = False``): an engine never loads from it."""

    holds_data = False
    Options = ExampleOptions

    def __init__(
        self,
        primary_kv_view: memoryview,
        block_bytes: int,
        max_blocks: int = 1000,
        simulate_async: bool = False,
    ) -> None:
        """The seed's signature, checked by :class:`ExampleOptions`. Raises
        InvalidArgumentError for a bad view, block size or option."""
        options = {"max_blocks": max_blocks, "simulate_async": simulate_async}
        checked = ExampleOptions.check(options, owner="ExampleSecondaryTier")
        super().__init__(primary_kv_view, block_bytes)
        self.max_blocks = checked.max_blocks
        self.simulate_async = checked.simulate_async
        self._blocks: OrderedDict[OffloadKey, None] = OrderedDict()  # oldest first
        # Accepted jobs not completed yet: the keys a store inserts, and the result.
        self._pending: list[tuple[tuple[OffloadKey, ...], JobResult]] = []
        self._completed: list[JobResult] = []

    def lookup(self, key: OffloadKey, req_context: ReqContext = None) -> bool:
        """True if ``key`` is held (a pending async store does not count yet)."""
        return key in self._blocks

    def submit_store(self, job_metadata: JobMetadata) -> None:
        job = self._validated(job_metadata)
        to_store = tuple(key for key in job.keys if key not in self._blocks)
        if not to_store:
            return
        shortfall = len(to_store) - (self.max_blocks - len(self._blocks))
        if shortfall > 0:
            protected = set(job.keys)
            outside = (key for key in self._blocks if key not in protected)  # oldest first
            victims = list(itertools.islice(outside, shortfall))
            if len(victims) < shortfall:
                return
            for key in victims:
                del self._blocks[key]
        self._accept(to_store, JobResult(job.job_id, True))

    def submit_load(self, job_metadata: JobMetadata) -> None:
        job = self._validated(job_metadata)
        missing = tuple(key for key in job.keys if key not in self._blocks)
        result = JobResult(job.job_id, True)
        if missing:
            why = f"{len(missing)} of {len(job.keys)} blocks are not in the example tier"
            result = JobResult(job.job_id, False, missing, why)
        self._accept((), result)

    def get_finished(self) -> list[JobResult]:
        """Complete pending jobs (async mode), then return and forget all results."""
        pending, self._pending = self._pending, []
        for keys, result in pending:
            self._complete(keys, result)
        finished, self._completed = self._completed, []
        return finished

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext = None) -> None:
        for key in reversed(list(keys)):
            if key in self._blocks:
                self._blocks.move_to_end(key)

    @staticmethod
    def get_tier_type() -> str:
        return "example"

    def get_num_blocks(self) -> int:
        return len(self._blocks)

    def clear(self) -> None:
        self._blocks.clear()
        self._pending.clear()
        self._completed.clear()

    def _accept(self, keys: tuple[OffloadKey, ...], result: JobResult) -> None:
        if self.simulate_async:
            self._pending.append((keys, result))
        else:
            self._complete(keys, result)

    def _complete(self, keys: tuple[OffloadKey, ...], result: JobResult) -> None:
        self._blocks.update(dict.fromkeys(keys))
        self._completed.append(result)

    def _validated(self, job: JobMetadata) -> JobMetadata:
        if not isinstance(job, JobMetadata):
            raise InvalidArgumentError(f"expected a JobMetadata, got {type(job).__name__}")
        return checked_job(job.job_id, job.keys, job.block_ids, self.num_primary_slots)
