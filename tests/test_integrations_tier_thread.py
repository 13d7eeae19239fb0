"""TierThread, the adapter core of the framework integrations, with the memory tier and
the NVMe tier, called from plain threads as serving frameworks call it."""

from __future__ import annotations

import threading

import pytest

from tiering.errors import InvalidArgumentError, UnknownTierError
from tiering.integrations.tier_thread import TierThread
from tiering.tiers.client import TierOutcome

BLOCK = 4096
SLOTS = 8


def _thread(view: memoryview, spec: dict[str, object] | None = None) -> TierThread:
    return TierThread(
        spec or {"type": "memory", "max_blocks": 16},
        view,
        BLOCK,
        name="kv-tiering-test",
        defaults={},
        start_timeout=30,
        job_timeout=30,
    )


def _pool() -> tuple[bytearray, memoryview]:
    memory = bytearray(BLOCK * SLOTS)
    return memory, memoryview(memory)


def test_a_job_run_from_another_thread_moves_the_bytes_both_ways() -> None:
    memory, view = _pool()
    memory[0:BLOCK] = b"k" * BLOCK
    tiers = _thread(view)
    try:
        assert tiers.run_job("store", [b"key"], [0]).ok
        outcome: list[TierOutcome] = []
        worker = threading.Thread(
            target=lambda: outcome.append(tiers.run_job("load", [b"key"], [5]))
        )
        worker.start()
        worker.join(30)
        assert outcome and outcome[0].landed == (b"key",)
        assert memory[5 * BLOCK : 6 * BLOCK] == b"k" * BLOCK
        assert tiers.run_job("load", [b"absent"], [1]).failed.keys() == {b"absent"}
    finally:
        tiers.close()


def test_close_ends_the_jobs_submitted_before_it_and_fails_those_after() -> None:
    memory, view = _pool()
    memory[:] = b"s" * len(memory)
    tiers = _thread(view)
    before: list[TierOutcome] = []
    tiers.submit("store", [b"a", b"b"], [0, 1], before.append)
    tiers.close()
    assert before[0].ok  # a graceful close loses nothing submitted before it
    after: list[TierOutcome] = []
    tiers.submit("store", [b"c"], [2], after.append)
    assert after[0].failed == {b"c": "the tier is shut down"}
    assert not tiers.alive and len(before) == len(after) == 1  # each job ended once
    tiers.close()  # idempotent


def test_a_job_whose_loop_died_fails_instead_of_waiting_forever() -> None:
    _, view = _pool()
    tiers = _thread(view)
    tiers.loop.call_soon_threadsafe(tiers.loop.stop)
    while tiers.alive:
        threading.Event().wait(0.01)
    outcome = tiers.run_job("store", [b"late"], [0])
    assert not outcome.ok and "event loop" in outcome.failed[b"late"]
    tiers.close()


def test_slots_past_the_host_memory_are_refused_and_nothing_is_queued() -> None:
    _, view = _pool()
    tiers = _thread(view)
    ended: list[TierOutcome] = []
    try:
        with pytest.raises(InvalidArgumentError, match="slots"):
            tiers.submit("store", [b"x"], [SLOTS], ended.append)
    finally:
        tiers.close()
    assert ended == []  # no job was queued: a close would have ended it


@pytest.mark.parametrize(
    ("spec", "error"),
    [
        ({"type": "no-such-tier"}, UnknownTierError),
        ({"type": "nvme", "root": "relative", "capacity_bytes": 1 << 20}, InvalidArgumentError),
    ],
)
def test_a_bad_spec_raises_and_leaves_no_thread_running(
    spec: dict[str, object], error: type[Exception]
) -> None:
    _, view = _pool()
    before = set(threading.enumerate())
    with pytest.raises(error):
        _thread(view, spec)
    assert not {t for t in threading.enumerate() if t.name == "kv-tiering-test"} - before


def test_a_bad_timeout_is_refused_before_any_thread_starts() -> None:
    _, view = _pool()
    with pytest.raises(InvalidArgumentError, match="job_timeout"):
        TierThread(
            {"type": "memory"}, view, BLOCK, name="t", defaults={}, start_timeout=1, job_timeout=0
        )


@pytest.mark.parametrize("option", [{"admission": "adaptive"}, {"write_budget": 1 << 20}])
def test_admission_under_a_frameworks_cpu_tier_is_refused_not_ignored(option: dict) -> None:
    _, view = _pool()
    name = next(iter(option))
    with pytest.raises(InvalidArgumentError, match=f"{name} is the engine's"):
        _thread(view, {"type": "memory", "max_blocks": 16, **option})
