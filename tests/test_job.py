"""The job handle's result buffer for polling callers (``tiering.job``)."""

from __future__ import annotations

import logging

import pytest

from tiering.job import FinishedResults
from tiering.secondary import JobResult


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
    with caplog.at_level(logging.WARNING, logger="tiering.job"):
        for job_id in range(5):
            finished.append(result(job_id))
    assert [r.job_id for r in finished.drain()] == [3, 4]
    assert finished.dropped == 3
    assert len(caplog.records) == 1
    assert "dropping the oldest" in caplog.records[0].message
