"""Helpers shared by the NVMe tests: a host-pool-like buffer, jobs through the actor API,
the checkpoint a start reads."""

from __future__ import annotations

import contextlib
import itertools
import mmap
import os
import unittest.mock
from collections.abc import Iterator, Sequence
from typing import Any

from backends.nvme.recovery import recover
from backends.nvme.segment_format import Checkpoint
from backends.nvme.segment_index import SegmentIndex
from backends.nvme.segments import SegmentFiles
from backends.nvme.tier import NVMeTier
from tiering.tiers import registry
from tiering.tiers.actor import TierActor
from tiering.tiers.tier_api import JobMetadata, JobResult

_job_ids = itertools.count(1)


def next_job_id() -> int:
    """A job id no other job of this test process has."""
    return next(_job_ids)


@contextlib.contextmanager
def random_pool(block_bytes: int, slots: int) -> Iterator[memoryview]:
    """A page-aligned buffer of ``slots`` blocks of random bytes, like the host pool."""
    buffer = mmap.mmap(-1, block_bytes * slots)
    view = memoryview(buffer)
    view[:] = os.urandom(block_bytes * slots)
    try:
        yield view
    finally:
        view.release()
        buffer.close()


async def store_job(tier: TierActor, keys: Sequence[bytes], slots: Sequence[int]) -> JobResult:
    """Submit a store of ``keys`` from ``slots`` and wait for its result."""
    job = JobMetadata(next_job_id(), list(keys), list(slots))
    tier.submit_store(job)
    return await tier.result(job.job_id)


async def load_job(tier: TierActor, keys: Sequence[bytes], slots: Sequence[int]) -> JobResult:
    """Submit a load of ``keys`` into ``slots`` and wait for its result."""
    job = JobMetadata(next_job_id(), list(keys), list(slots))
    tier.submit_load(job)
    return await tier.result(job.job_id)


@contextlib.contextmanager
def nvme_tiers_built() -> Iterator[list[NVMeTier]]:
    """Every NVMe tier built by name (``"nvme"``) inside the block, in order: the registry
    builds a subclass that keeps each one, so a test sees the tier an adapter built."""
    built: list[NVMeTier] = []

    class KeptNVMeTier(NVMeTier):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            built.append(self)

    # The registrations are restored afterwards: the next test builds the plain tier.
    with unittest.mock.patch.dict(registry._REGISTERED):
        registry.register_tier("nvme", KeptNVMeTier)
        yield built


async def checkpoint_read(files: SegmentFiles) -> tuple[Checkpoint | None, str | None]:
    """The checkpoint a start of the tier takes from ``files``' directory, or None and
    why none: what a read-only recovery (as ``tiering inspect`` makes) finds."""
    found = await recover(
        files,
        lambda records: SegmentIndex(max(1, records), records_per_segment=64, writer="0"),
        writer="0",
        read_only=True,
    )
    return found.checkpoint, found.checkpoint_note
