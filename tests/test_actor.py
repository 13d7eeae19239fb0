"""TierActor: admission, ordering, back-pressure, failure isolation and shutdown."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections import defaultdict
from collections.abc import Callable

import pytest

from tiering.errors import ClosedError, InvalidArgumentError, TierBusyError
from tiering.lifecycle import Lifecycle
from tiering.tiers.actor import TierActor
from tiering.tiers.tier_api import JobMetadata, JobResult

BLOCK = 64
SLOTS = 8


class CopyTier(TierActor):
    """A test tier keeping blocks as bytes; each job copies in one run_blocking call.

    Jobs whose id is in ``gated`` wait for ``gate`` first; ``entered[job_id]`` is set
    once a hook starts; ``fail_ids`` make the store hook raise.
    """

    def __init__(self, view: memoryview, block_bytes: int = BLOCK, **kwargs: int) -> None:
        super().__init__(view, block_bytes, **kwargs)
        self.blocks: dict[bytes, bytes] = {}
        self.order: list[tuple[str, int]] = []
        self.entered: defaultdict[int, asyncio.Event] = defaultdict(asyncio.Event)
        self.gate = asyncio.Event()
        self.gated: set[int] = set()
        self.fail_ids: set[int] = set()
        self.wrong_id_ids: set[int] = set()
        self.self_cancel_ids: set[int] = set()
        self.stubborn_ids: set[int] = set()  # these ignore one cancellation while gated
        self.stubborn_release = asyncio.Event()
        self.running = 0
        self.max_running = 0
        self.thread_names: list[str] = []

    def lookup(self, key: bytes, req_context: object = None) -> bool | None:
        if key in self.blocks:
            return True
        return None if self.storing(key) else False

    @staticmethod
    def get_tier_type() -> str:
        return "copy-test"

    def get_num_blocks(self) -> int:
        return len(self.blocks)

    async def _enter(self, kind: str, job: JobMetadata) -> None:
        self.order.append((kind, job.job_id))
        self.running += 1
        self.max_running = max(self.max_running, self.running)
        self.entered[job.job_id].set()
        if job.job_id in self.gated:
            try:
                await self.gate.wait()
            except asyncio.CancelledError:
                if job.job_id not in self.stubborn_ids:
                    raise
                await self.stubborn_release.wait()
        if job.job_id in self.self_cancel_ids:
            raise asyncio.CancelledError

    def _read_slots(self, block_ids: tuple[int, ...]) -> list[bytes]:
        self.thread_names.append(threading.current_thread().name)
        return [bytes(self.slot(i)) for i in block_ids]

    def _write_slots(self, writes: list[tuple[int, bytes]]) -> None:
        self.thread_names.append(threading.current_thread().name)
        for block_id, data in writes:
            self.slot(block_id)[:] = data

    async def _do_store(self, job: JobMetadata) -> JobResult:
        await self._enter("store", job)
        try:
            if job.job_id in self.fail_ids:
                raise OSError("disk on fire")
            data = await self.run_blocking(self._read_slots, tuple(job.block_ids))
            self.blocks.update(zip(job.keys, data, strict=True))
            reported_id = job.job_id + 1000 if job.job_id in self.wrong_id_ids else job.job_id
            return JobResult(reported_id, True)
        finally:
            self.running -= 1

    async def _do_load(self, job: JobMetadata) -> JobResult:
        await self._enter("load", job)
        try:
            missing = tuple(k for k in job.keys if k not in self.blocks)
            writes = [
                (b, self.blocks[k])
                for k, b in zip(job.keys, job.block_ids, strict=True)
                if k in self.blocks
            ]
            await self.run_blocking(self._write_slots, writes)
            return JobResult(job.job_id, not missing, missing, "missing" if missing else None)
        finally:
            self.running -= 1


def _pool() -> memoryview:
    return memoryview(bytearray(SLOTS * BLOCK))


def _store(job_id: int, *pairs: tuple[bytes, int]) -> JobMetadata:
    return JobMetadata(job_id, [k for k, _ in pairs], [b for _, b in pairs])


async def _entered(tier: CopyTier, job_id: int) -> None:
    async with asyncio.timeout(5):
        await tier.entered[job_id].wait()


async def _results(tier: TierActor, *job_ids: int) -> list[JobResult]:
    async with asyncio.timeout(5):
        return [await tier.result(job_id) for job_id in job_ids]


async def test_store_then_load_copies_the_exact_bytes_back_into_other_slots() -> None:
    view = _pool()
    payload = [os.urandom(BLOCK) for _ in range(2)]
    view[0:BLOCK] = payload[0]
    view[BLOCK : 2 * BLOCK] = payload[1]
    async with CopyTier(view) as tier:
        tier.submit_store(_store(1, (b"a", 0), (b"b", 1)))
        assert (await _results(tier, 1))[0].success
        view[:] = bytes(len(view))
        tier.submit_load(_store(2, (b"a", 5), (b"b", 6)))
        assert (await _results(tier, 2))[0].success
    assert bytes(view[5 * BLOCK : 6 * BLOCK]) == payload[0]
    assert bytes(view[6 * BLOCK : 7 * BLOCK]) == payload[1]


async def test_each_result_arrives_once_via_result_and_once_via_get_finished() -> None:
    async with CopyTier(_pool()) as tier:
        for job_id in (1, 2, 3):
            tier.submit_store(_store(job_id, (bytes([job_id]), job_id)))
        awaited = await _results(tier, 1, 2, 3)
        drained = tier.get_finished()
        assert sorted(r.job_id for r in drained) == [1, 2, 3]
        assert sorted(drained, key=lambda r: r.job_id) == awaited
        assert tier.get_finished() == []
        with pytest.raises(InvalidArgumentError, match="unknown job 1"):
            tier.result(1)


async def test_result_of_a_finished_but_undrained_job_is_already_resolved() -> None:
    async with CopyTier(_pool()) as tier:
        tier.submit_store(_store(1, (b"k", 0)))
        await _results(tier, 1)
        future = tier.result(1)
        assert future.done() and future.result() == JobResult(1, True)


async def test_result_of_an_unknown_job_raises_invalid_argument() -> None:
    async with CopyTier(_pool()) as tier:
        with pytest.raises(InvalidArgumentError, match="unknown job 42"):
            tier.result(42)


async def test_queued_loads_are_served_before_queued_stores() -> None:
    async with CopyTier(_pool(), max_inflight=1) as tier:
        tier.gated.add(1)
        tier.submit_store(_store(1, (b"s1", 0)))
        await _entered(tier, 1)
        tier.submit_store(_store(2, (b"s2", 1)))
        tier.submit_store(_store(3, (b"s3", 2)))
        tier.submit_load(_store(4, (b"s1", 3)))
        tier.submit_load(_store(5, (b"s1", 4)))
        tier.gate.set()
        await _results(tier, 1, 2, 3, 4, 5)
    assert tier.order == [("store", 1), ("load", 4), ("load", 5), ("store", 2), ("store", 3)]


async def test_a_load_queued_in_the_turn_of_a_store_starts_first_on_an_idle_tier() -> None:
    async with CopyTier(_pool(), max_inflight=1) as tier:
        tier.submit_store(_store(1, (b"s1", 0)))
        tier.submit_load(_store(2, (b"s1", 1)))
        await _results(tier, 1, 2)
    assert tier.order == [("load", 2), ("store", 1)]


async def test_no_more_than_max_inflight_jobs_run_at_once() -> None:
    async with CopyTier(_pool(), max_inflight=2) as tier:
        tier.gated.update(range(1, 6))
        for job_id in range(1, 6):
            tier.submit_store(_store(job_id, (bytes([job_id]), job_id)))
        await _entered(tier, 1)
        await _entered(tier, 2)
        for _ in range(20):
            await asyncio.sleep(0)
        assert tier.running == 2
        assert len(tier.order) == 2
        tier.gate.set()
        results = await _results(tier, *range(1, 6))
    assert all(r.success for r in results)
    assert tier.max_running == 2


async def test_full_inbox_raises_tier_busy_and_changes_nothing() -> None:
    async with CopyTier(_pool(), inbox_size=2, max_inflight=1) as tier:
        tier.gated.add(1)
        tier.submit_store(_store(1, (b"k1", 0)))
        await _entered(tier, 1)
        tier.submit_store(_store(2, (b"k2", 1)))
        tier.submit_store(_store(3, (b"k3", 2)))
        with pytest.raises(TierBusyError, match="store inbox is full"):
            tier.submit_store(_store(4, (b"k4", 3)))
        assert not tier.storing(b"k4")
        with pytest.raises(InvalidArgumentError):
            tier.result(4)
        tier.submit_load(_store(5, (b"k1", 4)))  # the load inbox is separate
        tier.gate.set()
        await _results(tier, 1, 2, 3, 5)
        assert sorted(r.job_id for r in tier.get_finished()) == [1, 2, 3, 5]
    assert b"k4" not in tier.blocks


async def test_put_store_waits_for_room_instead_of_raising() -> None:
    async with CopyTier(_pool(), inbox_size=1, max_inflight=1) as tier:
        tier.gated.add(1)
        tier.submit_store(_store(1, (b"k1", 0)))
        await _entered(tier, 1)
        tier.submit_store(_store(2, (b"k2", 1)))
        put = asyncio.create_task(tier.put_store(_store(3, (b"k3", 2))))
        for _ in range(10):
            await asyncio.sleep(0)
        assert not put.done()
        tier.gate.set()
        async with asyncio.timeout(5):
            await put
        results = await _results(tier, 1, 2, 3)
    assert all(r.success for r in results)
    assert set(tier.blocks) == {b"k1", b"k2", b"k3"}


async def test_put_load_waiting_for_room_raises_closed_error_when_close_begins() -> None:
    async with CopyTier(_pool(), inbox_size=1, max_inflight=1) as tier:
        tier.gated.add(1)
        tier.submit_load(_store(1, (b"x", 0)))
        await _entered(tier, 1)
        tier.submit_load(_store(2, (b"x", 1)))
        put = asyncio.create_task(tier.put_load(_store(3, (b"x", 2))))
        await asyncio.sleep(0)
        closing = asyncio.create_task(tier.aclose())
        with pytest.raises(ClosedError):
            async with asyncio.timeout(5):
                await put
        tier.gate.set()
        await closing
    assert [r.job_id for r in tier.get_finished()] == [1, 2]


async def test_cancelling_a_waiting_put_admits_nothing() -> None:
    async with CopyTier(_pool(), inbox_size=1, max_inflight=1) as tier:
        tier.gated.add(1)
        tier.submit_store(_store(1, (b"k1", 0)))
        await _entered(tier, 1)
        tier.submit_store(_store(2, (b"k2", 1)))
        put = asyncio.create_task(tier.put_store(_store(3, (b"k3", 2))))
        await asyncio.sleep(0)
        put.cancel()
        with pytest.raises(asyncio.CancelledError):
            await put
        assert not tier.storing(b"k3")
        tier.gate.set()
        await _results(tier, 1, 2)
        tier.submit_store(_store(3, (b"k3", 2)))  # the id was never taken
        await _results(tier, 3)


@pytest.mark.parametrize(
    ("job", "message"),
    [
        (JobMetadata(7, [b"ok", "text"], [0, 1]), "keys must hold bytes"),
        (JobMetadata(7, [b"ok"], [SLOTS]), "of the host pool.*outside 0..7"),
        (JobMetadata(7, [b"ok"], [-1]), "of the host pool.*outside 0..7"),
        (JobMetadata(7, [b"ok"], [True]), "slots must hold ints"),
        ("not a job", "expected a JobMetadata"),
    ],
)
async def test_invalid_job_raises_and_changes_nothing(job: JobMetadata, message: str) -> None:
    async with CopyTier(_pool()) as tier:
        for submit in (tier.submit_store, tier.submit_load):
            with pytest.raises(InvalidArgumentError, match=message):
                submit(job)
        with pytest.raises(InvalidArgumentError, match=message):
            await tier.put_store(job)
        assert not tier.storing(b"ok")
        assert tier.get_finished() == []
        tier.submit_store(_store(7, (b"ok", 0)))  # the id is still free
        assert (await _results(tier, 7))[0].success


async def test_duplicate_job_id_in_flight_raises_and_changes_nothing() -> None:
    async with CopyTier(_pool()) as tier:
        tier.gated.add(1)
        tier.submit_store(_store(1, (b"a", 0)))
        with pytest.raises(InvalidArgumentError, match="job 1 is already submitted"):
            tier.submit_load(_store(1, (b"b", 1)))
        assert not tier.storing(b"b")
        tier.gate.set()
        await _results(tier, 1)
        assert [r.job_id for r in tier.get_finished()] == [1]
        tier.submit_store(_store(1, (b"b", 1)))  # drained ids may be reused
        await _results(tier, 1)


async def test_hook_that_raises_fails_only_that_job_and_each_cause_is_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="tiering.tiers.actor")
    async with CopyTier(_pool(), max_inflight=1) as tier:
        tier.fail_ids.update({1, 3})
        tier.submit_store(_store(1, (b"a", 0), (b"b", 1)))
        tier.submit_store(_store(2, (b"c", 2)))
        tier.submit_store(_store(3, (b"d", 3)))
        failed, ok, failed_again = await _results(tier, 1, 2, 3)
        failures = dict(tier.statistics().failures)
    assert failed == JobResult(1, False, (b"a", b"b"), "OSError('disk on fire')")
    assert ok == JobResult(2, True)
    assert not failed_again.success and failed_again.failed_keys == (b"d",)
    assert tier.blocks.keys() == {b"c"}
    assert failures == {"store hook raised OSError": 2}
    records = [r for r in caplog.records if "store hook raised OSError" in r.getMessage()]
    assert len(records) == 1
    assert "disk on fire" in records[0].getMessage()


async def test_hook_returning_another_job_id_fails_that_job() -> None:
    async with CopyTier(_pool()) as tier:
        tier.wrong_id_ids.add(3)
        tier.submit_store(_store(3, (b"a", 0)))
        tier.submit_store(_store(4, (b"b", 1)))
        bad, good = await _results(tier, 3, 4)
    assert not bad.success and bad.failed_keys == (b"a",)
    assert "not a JobResult for job 3" in (bad.error or "")
    assert good.success


async def test_hook_raising_cancelled_error_on_its_own_fails_only_that_job() -> None:
    async with CopyTier(_pool(), max_inflight=1) as tier:
        tier.self_cancel_ids.add(1)
        tier.submit_store(_store(1, (b"a", 0)))
        tier.submit_store(_store(2, (b"b", 1)))
        bad, good = await _results(tier, 1, 2)
    assert not bad.success and "CancelledError" in (bad.error or "")
    assert good.success


async def test_aclose_does_not_hang_on_a_hook_that_ignores_cancellation(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("tiering.tiers.actor._CANCEL_GRACE_S", 0.01)
    tier = CopyTier(_pool())
    await tier.start()
    tier.gated.add(1)
    tier.stubborn_ids.add(1)
    tier.submit_store(_store(1, (b"a", 0)))
    await _entered(tier, 1)
    async with asyncio.timeout(5):
        await tier.aclose(timeout=0.01)
    [result] = tier.get_finished()
    assert not result.success and "deadline" in (result.error or "")
    tier.stubborn_release.set()  # let the stubborn hook end so the loop closes cleanly
    for _ in range(10):
        await asyncio.sleep(0)
    assert tier.get_finished() == []  # its late return is not a second result


async def test_cancelling_aclose_stops_the_tier_hard() -> None:
    tier = CopyTier(_pool())
    await tier.start()
    tier.gated.add(1)
    tier.submit_store(_store(1, (b"a", 0)))
    await _entered(tier, 1)
    closing = asyncio.create_task(tier.aclose(timeout=60))
    await asyncio.sleep(0)
    closing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await closing
    [result] = tier.get_finished()
    assert not result.success and "shut down" in (result.error or "")
    assert tier.closed


async def test_shutdown_from_another_thread_is_carried_out_on_the_loop() -> None:
    tier = CopyTier(_pool())
    await tier.start()
    tier.gated.add(1)
    tier.submit_store(_store(1, (b"a", 0)))
    await _entered(tier, 1)
    await asyncio.to_thread(tier.shutdown)
    [result] = await _results(tier, 1)
    assert not result.success
    assert tier.closed


async def test_cancelling_an_awaiter_of_result_does_not_cancel_the_job() -> None:
    async with CopyTier(_pool()) as tier:
        tier.gated.add(1)
        tier.submit_store(_store(1, (b"a", 0)))
        waiting = tier.result(1)

        async def wait_for_result() -> JobResult:
            return await waiting

        awaiter = asyncio.create_task(wait_for_result())
        await _entered(tier, 1)
        awaiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await awaiter
        assert waiting.cancelled()  # the awaiter's own future, not the job
        tier.gate.set()
        assert (await _results(tier, 1))[0].success
        assert tier.get_finished() == [JobResult(1, True)]
    assert b"a" in tier.blocks


async def test_aclose_finishes_queued_and_inflight_jobs_within_the_deadline() -> None:
    tier = CopyTier(_pool(), max_inflight=1)
    await tier.start()
    tier.gated.add(1)
    tier.submit_store(_store(1, (b"a", 0)))
    tier.submit_store(_store(2, (b"b", 1)))
    await _entered(tier, 1)
    closing = asyncio.create_task(tier.aclose(timeout=5))
    await asyncio.sleep(0)
    with pytest.raises(ClosedError):
        tier.submit_store(_store(3, (b"c", 2)))
    tier.gate.set()
    await closing
    assert sorted(tier.get_finished(), key=lambda r: r.job_id) == [
        JobResult(1, True),
        JobResult(2, True),
    ]
    assert tier.closed


async def test_aclose_past_the_deadline_cancels_and_reports_failure() -> None:
    tier = CopyTier(_pool(), max_inflight=1)
    await tier.start()
    tier.gated.update({1, 2})
    tier.submit_store(_store(1, (b"a", 0)))
    tier.submit_load(_store(2, (b"b", 1)))
    await _entered(tier, 2)  # the load went first; the store is still queued
    futures = [tier.result(1), tier.result(2)]
    await tier.aclose(timeout=0.01)
    results = {r.job_id: r for r in tier.get_finished()}
    assert results.keys() == {1, 2}
    for job_id, key in ((1, b"a"), (2, b"b")):
        assert not results[job_id].success
        assert results[job_id].failed_keys == (key,)
        assert "deadline" in (results[job_id].error or "")
    assert [f.result() for f in futures] == [results[1], results[2]]
    assert tier.order == [("load", 2)]


async def test_shutdown_is_idempotent_and_fails_every_unfinished_job() -> None:
    tier = CopyTier(_pool(), max_inflight=1)
    await tier.start()
    tier.gated.add(1)
    tier.submit_store(_store(1, (b"a", 0)))
    tier.submit_store(_store(2, (b"b", 1)))
    await _entered(tier, 1)
    future = tier.result(1)
    tier.shutdown()
    results = tier.get_finished()
    assert [(r.job_id, r.success) for r in results] == [(1, False), (2, False)]
    assert all("shut down" in (r.error or "") for r in results)
    assert future.done() and not future.result().success
    tier.shutdown()
    for _ in range(10):
        await asyncio.sleep(0)
    assert tier.get_finished() == []
    with pytest.raises(ClosedError):
        tier.submit_store(_store(3, (b"c", 2)))
    await tier.aclose()  # still idempotent after a hard stop


async def test_submit_before_start_or_after_close_raises_closed_error() -> None:
    tier = CopyTier(_pool())
    with pytest.raises(ClosedError, match="not started"):
        tier.submit_store(_store(1, (b"a", 0)))
    async with tier:
        pass
    with pytest.raises(ClosedError):
        tier.submit_load(_store(1, (b"a", 0)))
    with pytest.raises(ClosedError):
        await tier.put_store(_store(1, (b"a", 0)))
    with pytest.raises(ClosedError):
        await tier.start()


async def test_concurrent_aclose_calls_all_return_after_the_close() -> None:
    tier = CopyTier(_pool())
    await tier.start()
    tier.gated.add(1)
    tier.submit_store(_store(1, (b"a", 0)))
    first = asyncio.create_task(tier.aclose())
    second = asyncio.create_task(tier.aclose())
    await asyncio.sleep(0)
    assert not first.done() and not second.done()
    tier.gate.set()
    async with asyncio.timeout(5):
        await asyncio.gather(first, second)
    assert tier.get_finished() == [JobResult(1, True)]


async def test_run_blocking_runs_on_the_actors_own_threads() -> None:
    async with CopyTier(_pool(), io_threads=1) as tier:
        tier.submit_store(_store(1, (b"a", 0)))
        await _results(tier, 1)
        name = await tier.run_blocking(lambda: threading.current_thread().name)
    assert name.startswith("CopyTier-io")
    assert tier.thread_names and all(n.startswith("CopyTier-io") for n in tier.thread_names)
    with pytest.raises(ClosedError):
        await tier.run_blocking(lambda: None)


async def test_storing_is_true_while_a_store_is_queued_or_in_flight() -> None:
    async with CopyTier(_pool(), max_inflight=1) as tier:
        tier.gated.add(1)
        tier.submit_store(_store(1, (b"a", 0)))
        tier.submit_store(_store(2, (b"b", 1)))
        assert tier.storing(b"a") and tier.storing(b"b")
        assert tier.lookup(b"b") is None
        await _entered(tier, 1)
        assert tier.storing(b"a")
        tier.gate.set()
        await _results(tier, 1, 2)
        assert not tier.storing(b"a") and not tier.storing(b"b")
        assert tier.lookup(b"b") is True


@pytest.mark.parametrize("kwarg", ["inbox_size", "max_inflight", "io_threads"])
def test_non_positive_sizes_are_rejected(kwarg: str) -> None:
    with pytest.raises(InvalidArgumentError, match=kwarg):
        CopyTier(_pool(), **{kwarg: 0})


def test_read_only_host_pool_is_rejected() -> None:
    with pytest.raises(InvalidArgumentError, match="writable"):
        CopyTier(memoryview(bytes(SLOTS * BLOCK)))


class HeldTier(CopyTier):
    """A CopyTier whose store thread call blocks on a threading.Event (``release``)."""

    def __init__(self, view: memoryview, **kwargs: int) -> None:
        super().__init__(view, **kwargs)
        self.release = threading.Event()
        self.in_thread = threading.Event()
        self.thread_done = threading.Event()

    def _read_slots(self, block_ids: tuple[int, ...]) -> list[bytes]:
        self.in_thread.set()
        if not self.release.wait(timeout=30):
            raise TimeoutError("test never released the thread call")
        data = super()._read_slots(block_ids)
        self.thread_done.set()
        return data


def _tasks_of(name_prefix: str) -> list[asyncio.Task[object]]:
    return [t for t in asyncio.all_tasks() if t.get_name().startswith(name_prefix)]


async def _spin(iterations: int = 20) -> None:
    for _ in range(iterations):
        await asyncio.sleep(0)


async def _until_thread_started(tier: HeldTier) -> None:
    assert await asyncio.to_thread(tier.in_thread.wait, 5)


async def _eventually(predicate: Callable[[], bool]) -> None:
    """Poll ``predicate`` for up to about 5 s (a bound on waiting, not a timing check)."""
    for _ in range(5000):
        if predicate():
            return
        await asyncio.sleep(0.001)
    raise AssertionError("condition not reached")


async def test_state_follows_the_lifecycle() -> None:
    tier = CopyTier(_pool())
    assert tier.state is Lifecycle.NEW
    await tier.start()
    assert tier.state is Lifecycle.OPEN
    await tier.aclose()
    assert tier.state is Lifecycle.CLOSED
    with pytest.raises(AttributeError):
        tier.state = Lifecycle.OPEN  # type: ignore[misc]


async def test_statistics_count_queued_and_running_jobs_and_their_bytes() -> None:
    async with CopyTier(_pool(), max_inflight=1) as tier:
        tier.gated.add(1)
        tier.submit_store(_store(1, (b"a", 0), (b"b", 1)))
        tier.submit_store(_store(2, (b"c", 2)))
        await _entered(tier, 1)
        stats = tier.statistics()
        assert stats.state is Lifecycle.OPEN
        assert stats.jobs_in_flight == 2
        assert stats.bytes_in_flight == 3 * BLOCK
        assert stats.used_blocks == 0
        assert "2 jobs" in repr(tier) and "CopyTier" in repr(tier)
        assert tier.inbox_statistics().queued_stores == 1
        tier.gate.set()
        await _results(tier, 1, 2)
        stats = tier.statistics()
        assert (stats.jobs_in_flight, stats.bytes_in_flight, stats.used_blocks) == (0, 0, 3)


async def test_close_failures_are_counted_by_cause() -> None:
    tier = CopyTier(_pool(), max_inflight=1)
    await tier.start()
    tier.gated.add(1)
    for job_id in (1, 2, 3):
        tier.submit_store(_store(job_id, (bytes([job_id]), job_id)))
    await _entered(tier, 1)
    tier.shutdown()
    assert dict(tier.statistics().failures) == {"cancelled by shutdown": 3}
    assert tier.statistics().state is Lifecycle.CLOSED


async def test_shutdown_delivers_the_result_of_a_job_in_a_thread_call_only_after_it_returns() -> (
    None
):
    view = _pool()
    view[0:BLOCK] = os.urandom(BLOCK)
    tier = HeldTier(view)
    await tier.start()
    tier.submit_store(_store(1, (b"a", 0)))
    future = tier.result(1)
    await _until_thread_started(tier)
    tier.shutdown()  # returns although the thread call still runs
    assert tier.state is Lifecycle.CLOSING
    await _spin()
    assert not future.done()
    assert tier.get_finished() == []
    assert tier.statistics().jobs_in_flight == 1
    tier.release.set()
    async with asyncio.timeout(5):
        result = await future
    assert tier.thread_done.is_set()  # the thread had finished touching the slot
    assert not result.success and "shut down" in (result.error or "")
    assert tier.get_finished() == [result]
    assert tier.state is Lifecycle.CLOSED


async def test_aclose_past_its_deadline_waits_for_a_running_thread_call() -> None:
    tier = HeldTier(_pool())
    await tier.start()
    tier.submit_store(_store(1, (b"a", 0)))
    future = tier.result(1)
    await _until_thread_started(tier)
    closing = asyncio.create_task(tier.aclose(timeout=0.001))
    # Wait (untimed) until the close has cancelled the job: its deadline has passed.
    await _eventually(lambda: any(t.cancelling() for t in _tasks_of("HeldTier-store-1")))
    await _spin()
    assert not closing.done() and not future.done()
    assert tier.state is Lifecycle.CLOSING
    tier.release.set()
    async with asyncio.timeout(5):
        await closing
    assert tier.thread_done.is_set()
    result = future.result()
    assert not result.success and "deadline" in (result.error or "")
    assert tier.state is Lifecycle.CLOSED
    assert _tasks_of("HeldTier") == []


async def test_a_cancelled_aclose_still_ends_every_task_and_thread_of_the_tier() -> None:
    class LeakCheckTier(CopyTier):
        pass

    tier = LeakCheckTier(_pool(), max_inflight=2)
    await tier.start()
    tier.gated.update(range(1, 9))
    for job_id in range(1, 9):
        tier.submit_store(_store(job_id, (bytes([job_id]), job_id % SLOTS)))
    await _entered(tier, 1)
    assert _tasks_of("LeakCheckTier")
    closing = asyncio.create_task(tier.aclose(timeout=60))
    await asyncio.sleep(0.001)
    closing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await closing
    await _spin()
    assert _tasks_of("LeakCheckTier") == []
    assert tier.state is Lifecycle.CLOSED
    results = tier.get_finished()
    assert sorted(r.job_id for r in results) == list(range(1, 9))
    assert not any(r.success for r in results)
    # Idle pool threads exit once told to.
    await _eventually(
        lambda: not any(t.name.startswith("LeakCheckTier-io") for t in threading.enumerate())
    )


async def test_a_thread_call_of_a_hook_is_awaited_before_the_hook_unwinds() -> None:
    tier = HeldTier(_pool())
    await tier.start()
    unwound_after_thread: list[bool] = []
    original = tier._do_store

    async def store(job: JobMetadata) -> JobResult:
        try:
            return await original(job)
        except asyncio.CancelledError:
            unwound_after_thread.append(tier.thread_done.is_set())
            raise

    tier._do_store = store  # type: ignore[method-assign]
    tier.submit_store(_store(1, (b"a", 0)))
    await _until_thread_started(tier)
    tier.shutdown()
    tier.release.set()
    async with asyncio.timeout(5):
        await tier.result(1)
    assert unwound_after_thread == [True]


# -- background tasks -------------------------------------------------------------------


async def test_a_spawned_task_runs_until_close_begins_and_never_delays_it() -> None:
    ticks = 0

    async def forever() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0.001)

    tier = CopyTier(_pool())
    assert not tier.spawn(forever(), name="early")  # not serving yet: refused
    await tier.start()
    assert tier.spawn(forever(), name="ticker")
    await asyncio.sleep(0.01)
    assert ticks > 0
    async with asyncio.timeout(1):  # far below aclose's 5 s deadline
        await tier.aclose()
    stopped = ticks
    await asyncio.sleep(0.01)
    assert ticks == stopped
    assert not tier.spawn(forever(), name="late")
