"""The job handle and the result buffer for polling callers (``tiering.core.job``)."""

from __future__ import annotations

import asyncio
import logging

import pytest

from tiering.core.job import FinishedResults, Job
from tiering.tiers.tier_api import JobResult


def result(job_id: int) -> JobResult:
    return JobResult(job_id=job_id, success=True)


def test_drain_returns_the_results_oldest_first_and_empties_the_buffer() -> None:
    finished = FinishedResults()
    for job_id in (3, 1, 2):
        finished.append(result(job_id))
    assert [r.job_id for r in finished.drain()] == [3, 1, 2]
    assert finished.drain() == []


def test_a_full_buffer_drops_the_oldest_and_warns_once(caplog: pytest.LogCaptureFixture) -> None:
    finished = FinishedResults(capacity=2)
    with caplog.at_level(logging.WARNING, logger="tiering.core.job"):
        for job_id in range(5):
            finished.append(result(job_id))
    assert [r.job_id for r in finished.drain()] == [3, 4]
    assert finished.dropped == 3
    assert len(caplog.records) == 1
    assert "dropping the oldest" in caplog.records[0].message


# -- the awaitable handle ------------------------------------------------------------


async def test_a_job_that_ended_before_the_await_returns_its_result() -> None:
    job = Job(7, "store", asyncio.get_running_loop())
    assert not job.done()
    with pytest.raises(asyncio.InvalidStateError):
        job.result()
    job._set_result(result(7))
    assert job.done() and job.result() == result(7)
    assert await job == result(7)
    assert await job == result(7)  # every await sees the one result


async def test_an_await_before_the_result_waits_for_it() -> None:
    job = Job(8, "load", asyncio.get_running_loop())
    waiter = asyncio.create_task(_await(job))
    await asyncio.sleep(0)
    assert not waiter.done()
    job._set_result(result(8))
    assert await waiter == result(8)


async def test_cancelling_an_awaiter_leaves_the_job_for_the_others() -> None:
    job = Job(9, "store", asyncio.get_running_loop())
    first, second = asyncio.create_task(_await(job)), asyncio.create_task(_await(job))
    await asyncio.sleep(0)
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    job._set_result(result(9))
    assert await second == result(9)
    job._set_result(JobResult(job_id=9, success=False))  # a result is set once
    assert job.result() == result(9)


async def _await(job: Job) -> JobResult:
    return await job
