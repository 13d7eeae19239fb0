"""ResultsLedger: one result per job, to every waiter and once to drain; busy jobs wait."""

from __future__ import annotations

import asyncio

import pytest

from tiering.errors import InvalidArgumentError
from tiering.tiers.ledger import ResultsLedger, TierJob
from tiering.tiers.tier_api import JobMetadata, JobResult


def _job(job_id: object, keys: list[bytes]) -> TierJob:
    return TierJob(JobMetadata(job_id, keys, range(len(keys))), "store")  # type: ignore[arg-type]


async def test_one_result_reaches_every_waiter_and_drain_once_then_the_id_is_free() -> None:
    delivered: list[tuple[int, JobResult]] = []
    ledger = ResultsLedger(on_delivered=lambda j, r: delivered.append((j.meta.job_id, r)))
    loop = asyncio.get_running_loop()
    ledger.admit(_job(1, [b"a", b"b"]))
    early = ledger.waiter(1, loop)
    assert ledger.pending == 1 and ledger.keys_pending == 2
    assert ledger.finish(1, JobResult(1, True))
    assert not ledger.finish(1, JobResult(1, False, (b"a",), "late"))  # first one wins
    late = ledger.waiter(1, loop)
    assert early.result() == late.result() == JobResult(1, True)
    assert delivered == [(1, JobResult(1, True))]
    assert ledger.pending == 0 and ledger.keys_pending == 0
    with pytest.raises(InvalidArgumentError, match="job 1 is already submitted"):
        ledger.check_free(1)
    assert ledger.drain() == [JobResult(1, True)]
    assert ledger.drain() == []
    with pytest.raises(InvalidArgumentError, match="unknown job 1"):
        ledger.waiter(1, loop)
    ledger.check_free(1)  # drained ids may be reused


async def test_a_busy_job_gets_its_result_only_when_it_is_idle_again() -> None:
    ledger = ResultsLedger()
    ledger.admit(_job(7, [b"k"]))
    waiter = ledger.waiter(7, asyncio.get_running_loop())
    ledger.busy(7)
    ledger.busy(7)
    assert ledger.fail(7, "cancelled")
    assert not waiter.done() and ledger.drain() == [] and ledger.pending == 1
    ledger.idle(7)
    assert not waiter.done() and ledger.busy_jobs == 1
    ledger.idle(7)
    assert waiter.result() == JobResult(7, False, (b"k",), "cancelled")
    assert ledger.drain() == [waiter.result()]
    assert ledger.busy_jobs == 0


async def test_fail_undecided_fails_every_job_without_a_result() -> None:
    ledger = ResultsLedger()
    for job_id in (1, 2, 3):
        ledger.admit(_job(job_id, [bytes([job_id])]))
    ledger.finish(2, JobResult(2, True))
    ledger.busy(3)
    assert ledger.fail_undecided("closed") == [1, 3]
    assert ledger.drain() == [JobResult(2, True), JobResult(1, False, (b"\x01",), "closed")]
    ledger.idle(3)
    assert ledger.drain() == [JobResult(3, False, (b"\x03",), "closed")]
    assert ledger.pending == 0


@pytest.mark.parametrize("job_id", ["1", 1.0, True, None])
def test_a_job_id_that_is_not_an_int_is_rejected(job_id: object) -> None:
    ledger = ResultsLedger()
    with pytest.raises(InvalidArgumentError, match="job_id must be an int"):
        ledger.check_free(job_id)


def test_misuse_raises_and_changes_nothing() -> None:
    ledger = ResultsLedger(owner="tier-x")
    ledger.admit(_job(1, [b"a"]))
    with pytest.raises(InvalidArgumentError, match="result for job 2 given for job 1"):
        ledger.finish(1, JobResult(2, True))
    with pytest.raises(InvalidArgumentError, match="tier-x: unknown job 5"):
        ledger.finish(5, JobResult(5, True))
    with pytest.raises(InvalidArgumentError, match="not busy"):
        ledger.idle(1)
    with pytest.raises(InvalidArgumentError, match="not pending"):
        ledger.busy(9)
    assert ledger.pending == 1 and ledger.drain() == []
    assert 1 in ledger and 5 not in ledger


def test_admit_new_takes_an_id_in_use_nowhere_and_delivers_to_on_done() -> None:
    ledger = ResultsLedger()
    ledger.admit(_job(0, [b"user"]))  # a caller's own id
    results: list[JobResult] = []
    job = ledger.admit_new("load", (b"a",), (3,), results.append, taken={1})
    assert job.meta == JobMetadata(2, (b"a",), (3,)) and job.lane == "load"
    assert 2 in ledger and ledger.pending == 2
    assert ledger.admit_new("store", (b"b",), (4,), results.append).meta.job_id == 3
    ledger.finish(2, JobResult(2, True))
    assert results == [JobResult(2, True)] and 2 not in ledger  # delivered, id freed
    assert ledger.drain() == []  # on_done jobs are never drained
