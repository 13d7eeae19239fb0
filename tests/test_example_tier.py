"""ExampleSecondaryTier: the seed's behaviour point by point, plus the load fix."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from backends.example import ExampleSecondaryTier
from tiering.errors import InvalidArgumentError
from tiering.tiers.tier_api import JobMetadata, JobResult

BLOCK = 16
SLOTS = 8


def _tier(max_blocks: int = 1000, simulate_async: bool = False) -> ExampleSecondaryTier:
    return ExampleSecondaryTier(
        memoryview(bytearray(SLOTS * BLOCK)), BLOCK, max_blocks, simulate_async
    )


def _job(job_id: int, keys: Sequence[bytes]) -> JobMetadata:
    return JobMetadata(job_id, list(keys), list(range(len(keys))))


def _held(tier: ExampleSecondaryTier, *keys: bytes) -> list[bool]:
    return [tier.lookup(k) for k in keys]


def test_store_completes_during_submit_and_reports_once() -> None:
    tier = _tier()
    tier.submit_store(_job(1, [b"a", b"b"]))
    assert _held(tier, b"a", b"b", b"c") == [True, True, False]
    assert tier.get_num_blocks() == 2
    assert tier.get_finished() == [JobResult(1, True)]
    assert tier.get_finished() == []


def test_store_skips_keys_already_present() -> None:
    tier = _tier(max_blocks=3)
    tier.submit_store(_job(1, [b"a", b"b"]))
    tier.submit_store(_job(2, [b"a", b"c"]))  # only c is new: fits without eviction
    assert _held(tier, b"a", b"b", b"c") == [True, True, True]
    assert tier.get_finished() == [JobResult(1, True), JobResult(2, True)]


def test_store_of_only_present_keys_yields_no_result() -> None:
    tier = _tier()
    tier.submit_store(_job(1, [b"a"]))
    tier.get_finished()
    tier.submit_store(_job(2, [b"a"]))
    assert tier.get_finished() == []


def test_store_evicts_least_recently_used_keys_outside_the_job() -> None:
    tier = _tier(max_blocks=3)
    tier.submit_store(_job(1, [b"a", b"b", b"c"]))
    tier.submit_store(_job(2, [b"a", b"d"]))  # a is LRU but in the job: b goes
    assert _held(tier, b"a", b"b", b"c", b"d") == [True, False, True, True]
    assert tier.get_num_blocks() == 3
    assert [r.job_id for r in tier.get_finished()] == [1, 2]


def test_store_gives_up_silently_when_it_cannot_evict_enough() -> None:
    tier = _tier(max_blocks=2)
    tier.submit_store(_job(1, [b"a", b"b"]))
    tier.get_finished()
    tier.submit_store(_job(2, [b"a", b"b", b"c"]))  # a and b are protected
    assert _held(tier, b"a", b"b", b"c") == [True, True, False]
    assert tier.get_finished() == []


def test_store_that_needs_more_victims_than_exist_evicts_nothing() -> None:
    tier = _tier(max_blocks=2)
    tier.submit_store(_job(1, [b"a", b"b"]))
    tier.submit_store(_job(2, [b"b", b"c", b"d"]))  # needs 2 victims, only a qualifies
    assert _held(tier, b"a", b"b", b"c", b"d") == [True, True, False, False]


def test_touch_makes_the_first_key_most_recent() -> None:
    tier = _tier(max_blocks=3)
    tier.submit_store(_job(1, [b"a", b"b", b"c"]))
    tier.touch([b"b", b"a", b"missing"])  # LRU order now c, a, b
    tier.submit_store(_job(2, [b"d"]))
    assert _held(tier, b"c") == [False]
    tier.submit_store(_job(3, [b"e"]))
    assert _held(tier, b"a", b"b", b"d", b"e") == [False, True, True, True]


def test_load_of_held_keys_succeeds_without_changing_lru_order() -> None:
    tier = _tier(max_blocks=2)
    tier.submit_store(_job(1, [b"a", b"b"]))
    tier.submit_load(_job(2, [b"a"]))
    tier.submit_store(_job(3, [b"c"]))  # a stays the LRU key despite the load
    assert _held(tier, b"a", b"b", b"c") == [False, True, True]
    assert tier.get_finished() == [JobResult(1, True), JobResult(2, True), JobResult(3, True)]


def test_load_of_a_missing_key_reports_failure_instead_of_dropping_the_job() -> None:
    tier = _tier()
    tier.submit_store(_job(1, [b"a"]))
    tier.submit_load(_job(2, [b"a", b"x", b"y"]))
    [_, result] = tier.get_finished()
    assert result.job_id == 2 and not result.success
    assert result.failed_keys == (b"x", b"y")
    assert "2 of 3" in (result.error or "")


def test_simulated_async_jobs_complete_on_the_next_get_finished_in_order() -> None:
    tier = _tier(simulate_async=True)
    tier.submit_store(_job(1, [b"a"]))
    tier.submit_load(_job(2, [b"zz"]))
    assert tier.lookup(b"a") is False  # not stored until completion
    assert tier.get_num_blocks() == 0
    results = tier.get_finished()
    assert [(r.job_id, r.success) for r in results] == [(1, True), (2, False)]
    assert results[1].failed_keys == (b"zz",)
    assert tier.lookup(b"a") is True
    assert tier.get_finished() == []


def test_simulated_async_store_evicts_at_submit_time() -> None:
    tier = _tier(max_blocks=1, simulate_async=True)
    tier.submit_store(_job(1, [b"a"]))
    tier.get_finished()
    tier.submit_store(_job(2, [b"b"]))
    assert _held(tier, b"a", b"b") == [False, False]
    assert tier.get_finished() == [JobResult(2, True)]
    assert _held(tier, b"b") == [True]


def test_simulated_async_load_checks_presence_at_submit_time() -> None:
    tier = _tier(simulate_async=True)
    tier.submit_store(_job(1, [b"a"]))
    tier.submit_load(_job(2, [b"a"]))  # a is only pending: the load fails
    assert [(r.job_id, r.success) for r in tier.get_finished()] == [(1, True), (2, False)]


def test_clear_drops_blocks_pending_jobs_and_unreported_results() -> None:
    tier = _tier(simulate_async=True)
    tier.submit_store(_job(1, [b"a"]))
    tier.get_finished()
    tier.submit_store(_job(2, [b"b"]))
    tier.clear()
    assert tier.get_num_blocks() == 0
    assert tier.get_finished() == []
    assert _held(tier, b"a", b"b") == [False, False]


def test_tier_type_is_example() -> None:
    assert ExampleSecondaryTier.get_tier_type() == "example"


@pytest.mark.parametrize(
    ("job", "message"),
    [
        (JobMetadata(1, [b"a"], [SLOTS]), r"host pool\): \d+ is outside"),
        (JobMetadata(1, ["a"], [0]), "keys must hold bytes"),
        (JobMetadata(1, [b"a"], ["0"]), "slots must hold ints"),
        ("job", "expected a JobMetadata"),
    ],
)
def test_malformed_job_raises_and_changes_nothing(job: JobMetadata, message: str) -> None:
    tier = _tier()
    for submit in (tier.submit_store, tier.submit_load):
        with pytest.raises(InvalidArgumentError, match=message):
            submit(job)
    assert tier.get_num_blocks() == 0
    assert tier.get_finished() == []


def test_negative_max_blocks_is_rejected() -> None:
    with pytest.raises(InvalidArgumentError, match="max_blocks"):
        _tier(max_blocks=-1)
