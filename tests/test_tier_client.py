"""TierClient: one way to any tier, one outcome per job, later, exactly once."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable, Iterator

import pytest
from _device_kv import slot_bytes

from backends.example import ExampleSecondaryTier
from backends.memory import MemoryTier
from tiering.device.host_pool import HostPool
from tiering.errors import InvalidArgumentError
from tiering.lifecycle import Lifecycle
from tiering.tiers.actor import TierActor
from tiering.tiers.client import TierClient, TierOutcome
from tiering.tiers.tier_api import JobMetadata, JobResult

BLOCK = 4096
SLOTS = 16


@pytest.fixture
def pool() -> Iterator[HostPool]:
    with HostPool(SLOTS, BLOCK, pin=False) as host_pool:
        yield host_pool


class GateTier(TierActor):
    """A tier keeping bytes in a dict. Hooks wait for ``gate`` (asyncio) before their one
    thread call; a store of a key in ``fail_keys`` raises; while ``hold`` is clear the
    thread call blocks on it (a threading.Event), and sets ``in_thread`` first."""

    def __init__(self, view: memoryview, **kwargs: int) -> None:
        super().__init__(view, BLOCK, **kwargs)
        self.blocks: dict[bytes, bytes] = {}
        self.gate = asyncio.Event()
        self.gate.set()
        self.fail_keys: set[bytes] = set()
        self.hold = threading.Event()
        self.hold.set()
        self.in_thread = threading.Event()
        self.thread_done = threading.Event()

    def lookup(self, key: bytes, req_context: object = None) -> bool | None:
        return key in self.blocks

    @staticmethod
    def get_tier_type() -> str:
        return "gate-test"

    def get_num_blocks(self) -> int:
        return len(self.blocks)

    def _read(self, block_ids: tuple[int, ...]) -> list[bytes]:
        self.in_thread.set()
        if not self.hold.wait(timeout=30):
            raise TimeoutError("the test never released the thread call")
        data = [bytes(self.slot(i)) for i in block_ids]
        self.thread_done.set()
        return data

    async def _do_store(self, job: JobMetadata) -> JobResult:
        await self.gate.wait()
        if self.fail_keys & set(job.keys):
            raise OSError("disk on fire")
        data = await self.run_blocking(self._read, tuple(job.block_ids))
        self.blocks.update(zip(job.keys, data, strict=True))
        return JobResult(job.job_id, True)

    async def _do_load(self, job: JobMetadata) -> JobResult:
        await self.gate.wait()
        for key, block_id in zip(job.keys, job.block_ids, strict=True):
            self.slot(block_id)[:] = self.blocks[key]
        return JobResult(job.job_id, True)


class Recorder:
    """on_done callbacks that record every call, check they never run inside submit,
    and resolve one future per job."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, TierOutcome]] = []
        self.inside_submit = False
        self.futures: list[asyncio.Future[TierOutcome]] = []

    def submit(
        self, client: TierClient, kind: str, keys: list[bytes], slots: list[int]
    ) -> asyncio.Future[TierOutcome]:
        index = len(self.futures)
        future: asyncio.Future[TierOutcome] = asyncio.get_running_loop().create_future()
        self.futures.append(future)
        self.inside_submit = True
        try:
            client.submit(kind, keys, slots, self._callback(index))  # type: ignore[arg-type]
        finally:
            self.inside_submit = False
        return future

    def _callback(self, index: int) -> Callable[[TierOutcome], None]:
        def on_done(outcome: TierOutcome) -> None:
            assert not self.inside_submit, "on_done ran inside submit"
            self.calls.append((index, outcome))
            if not self.futures[index].done():
                self.futures[index].set_result(outcome)

        return on_done

    async def all(self) -> list[TierOutcome]:
        async with asyncio.timeout(10):
            return list(await asyncio.gather(*self.futures))

    def exactly_once(self) -> bool:
        return sorted(i for i, _ in self.calls) == list(range(len(self.futures)))


def _fill(pool: HostPool, slots: range) -> dict[int, bytes]:
    data = {slot: os.urandom(BLOCK) for slot in slots}
    for slot, payload in data.items():
        pool.view[slot * BLOCK : (slot + 1) * BLOCK] = payload
    return data


def _keys(*names: str) -> list[bytes]:
    return [name.encode() for name in names]


async def _spin(iterations: int = 20) -> None:
    for _ in range(iterations):
        await asyncio.sleep(0)


def _tasks_named(*prefixes: str) -> list[str]:
    return [t.get_name() for t in asyncio.all_tasks() if t.get_name().startswith(prefixes)]


async def test_bytes_round_trip_through_a_memory_tier(pool: HostPool) -> None:
    data = _fill(pool, range(4))
    recorder = Recorder()
    keys = _keys("a", "b", "c", "d")
    async with TierClient(MemoryTier(pool.view, BLOCK, max_blocks=8)) as client:
        assert (client.name, client.servable) == ("memory", True)
        stored = await asyncio.wait_for(recorder.submit(client, "store", keys, [0, 1, 2, 3]), 10)
        assert stored == TierOutcome(tuple(keys))
        assert stored.ok and client.lookup(b"c") is True
        pool.view[:] = bytes(pool.nbytes)
        loaded = await asyncio.wait_for(
            recorder.submit(client, "load", [*keys, b"zz"], [8, 9, 10, 11, 12]), 10
        )
        assert loaded.landed == tuple(keys)
        assert list(loaded.failed) == [b"zz"] and "not in the memory tier" in loaded.failed[b"zz"]
        assert not loaded.ok
    for i, slot in enumerate(range(8, 12)):
        assert slot_bytes(pool, slot) == data[i]
    assert recorder.exactly_once()
    stats = client.statistics()
    assert stats.state is Lifecycle.CLOSED
    assert stats.counters["keys_landed"] == 8 and stats.counters["keys_failed"] == 1


async def test_a_full_inbox_becomes_backlog_and_every_job_lands_in_order(pool: HostPool) -> None:
    _fill(pool, range(SLOTS))
    tier = GateTier(pool.view, inbox_size=1, max_inflight=1)
    recorder = Recorder()
    async with TierClient(tier) as client:
        tier.gate.clear()
        for i in range(12):
            recorder.submit(client, "store", [f"k{i}".encode()], [i])
        assert (
            client.actor.inbox_statistics().parked == 12 - 1
        )  # the inbox holds one; nothing served yet
        assert client.statistics().jobs_in_flight == 12
        assert client.statistics().bytes_in_flight == 12 * BLOCK
        tier.gate.set()
        outcomes = await recorder.all()
    assert all(o.ok for o in outcomes)
    assert [i for i, _ in recorder.calls] == list(range(12))
    assert tier.blocks == {f"k{i}".encode(): slot_bytes(pool, i) for i in range(12)}
    assert (
        client.actor.inbox_statistics().parked == 0
        and client.statistics().counters["jobs_backlogged"] == 11
    )


async def test_a_tier_raising_in_its_hook_gives_a_failed_outcome_with_the_reason(
    pool: HostPool,
) -> None:
    tier = GateTier(pool.view)
    tier.fail_keys.add(b"bad")
    recorder = Recorder()
    async with TierClient(tier) as client:
        bad = recorder.submit(client, "store", [b"ok", b"bad"], [0, 1])
        good = recorder.submit(client, "store", [b"fine"], [2])
        outcomes = await recorder.all()
        assert dict(client.statistics().failures) == {"store failed in the tier": 1}
    assert bad.result() == outcomes[0]
    assert outcomes[0].landed == ()
    assert set(outcomes[0].failed) == {b"ok", b"bad"}
    assert all("disk on fire" in reason for reason in outcomes[0].failed.values())
    assert good.result().ok


async def test_a_store_the_example_tier_drops_silently_times_out(pool: HostPool) -> None:
    recorder = Recorder()
    tier = ExampleSecondaryTier(pool.view, BLOCK, max_blocks=4)
    async with TierClient(tier, timeout=0.05) as client:
        assert client.servable is False
        first = await asyncio.wait_for(recorder.submit(client, "store", [b"a"], [0]), 10)
        assert first.ok
        # All keys present already: the seed tier yields no result for this job.
        dropped = await asyncio.wait_for(recorder.submit(client, "store", [b"a"], [1]), 10)
    assert not dropped.ok
    assert "0.05s timeout" in dropped.failed[b"a"]
    assert recorder.exactly_once()
    assert dict(client.statistics().failures) == {"store failed in the tier": 1}
    assert dict(client.actor.statistics().failures) == {"timeout": 1}


async def test_on_done_is_never_called_inside_submit(pool: HostPool) -> None:
    recorder = Recorder()
    example = ExampleSecondaryTier(pool.view, BLOCK)  # completes jobs inside its submit
    async with TierClient(example) as client:
        recorder.submit(client, "store", [b"a"], [0])
        assert recorder.calls == []
        await recorder.all()  # queued loads go before stores: store first
        recorder.submit(client, "load", [b"a"], [1])
        recorder.submit(client, "load", [b"a"], [SLOTS])  # the tier raises in submit
        assert len(recorder.calls) == 1
        outcomes = await recorder.all()
    assert [o.ok for o in outcomes] == [True, True, False]
    assert (
        "refused" in outcomes[2].failed[b"a"]
        and f"host pool): {SLOTS} is outside" in outcomes[2].failed[b"a"]
    )
    closed = Recorder()
    closed.submit(client, "store", [b"b"], [0])  # a closed client: failed, later
    assert closed.calls == []
    [outcome] = await closed.all()
    assert "closed" in outcome.failed[b"b"]


async def test_each_on_done_is_called_exactly_once_whatever_happens(pool: HostPool) -> None:
    tier = GateTier(pool.view, inbox_size=1, max_inflight=1)
    tier.fail_keys.add(b"f3")
    recorder = Recorder()
    client = TierClient(tier)
    await client.start()
    for i in range(8):
        recorder.submit(client, "store" if i % 2 else "load", [f"f{i}".encode()], [i])
    tier.gate.clear()
    for i in range(8, 12):
        recorder.submit(client, "store", [f"f{i}".encode()], [i])
    await _spin()
    await client.aclose(timeout=0.01)
    await _spin()
    assert recorder.exactly_once()
    assert len(recorder.calls) == 12


async def test_after_close_every_outstanding_job_has_an_outcome(pool: HostPool) -> None:
    tier = GateTier(pool.view, inbox_size=1, max_inflight=1)
    recorder = Recorder()
    client = TierClient(tier)
    await client.start()
    tier.gate.clear()
    for i in range(6):
        recorder.submit(client, "store", [f"c{i}".encode()], [i])
    # The tier takes the first job (it waits at the gate) and the pump refills the inbox.
    for _ in range(5000):
        if client.actor.inbox_statistics().parked == 4:
            break
        await asyncio.sleep(0.001)
    assert client.actor.inbox_statistics().parked == 4
    await client.aclose(timeout=0.01)
    assert len(recorder.calls) == 6  # all delivered before aclose returned
    outcomes = [f.result() for f in recorder.futures]
    assert not any(o.ok for o in outcomes)
    reasons = [next(iter(o.failed.values())) for o in outcomes]
    assert all("deadline" in r for r in reasons[:2])  # admitted: the actor failed them
    assert all("before the tier had room" in r for r in reasons[2:])
    assert client.state is Lifecycle.CLOSED and tier.state is Lifecycle.CLOSED
    assert client.statistics().jobs_in_flight == 0


async def test_a_cancelled_aclose_still_releases_every_task(pool: HostPool) -> None:
    tier = GateTier(pool.view, inbox_size=2, max_inflight=2)
    recorder = Recorder()
    client = TierClient(tier)
    await client.start()
    tier.gate.clear()
    for i in range(8):
        recorder.submit(client, "store", [f"x{i}".encode()], [i])
    assert _tasks_named("tier-client-gate-test", "GateTier")
    closing = asyncio.create_task(client.aclose(timeout=60))
    await asyncio.sleep(0.001)
    closing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await closing
    await _spin()
    assert _tasks_named("tier-client-gate-test", "GateTier") == []
    assert client.state is Lifecycle.CLOSED and tier.state is Lifecycle.CLOSED
    assert recorder.exactly_once()
    assert not any(o.ok for _, o in recorder.calls)


async def test_an_outcome_waits_for_the_tiers_thread_call_to_end(pool: HostPool) -> None:
    tier = GateTier(pool.view)
    tier.hold.clear()
    recorder = Recorder()
    client = TierClient(tier)
    await client.start()
    future = recorder.submit(client, "store", [b"a"], [0])
    assert await asyncio.to_thread(tier.in_thread.wait, 5)
    client.shutdown()
    await _spin()
    assert not future.done()  # the thread still reads slot 0
    assert client.state is Lifecycle.CLOSING
    tier.hold.set()
    async with asyncio.timeout(5):
        outcome = await future
    assert tier.thread_done.is_set()
    assert not outcome.ok and "shut down" in outcome.failed[b"a"]
    await _spin()
    assert client.state is Lifecycle.CLOSED
    client.shutdown()  # idempotent
    await client.aclose(1)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("copy", [b"a"], [0]), "kind must be"),
        (("store", [b"a", b"b"], [0]), "2 keys but 1 slots"),
        (("store", ["a"], [0]), "keys must hold bytes"),
        (("store", b"ab", [0, 1]), "keys must be a sequence"),
        (("store", None, [0]), "keys must be an iterable"),
        (("load", [b"a"], [True]), "slots must hold ints"),
        (("load", [b"a"], [0.0]), "slots must hold ints"),
        (("load", [b"a"], 5), "slots must be a sequence"),
    ],
)
async def test_malformed_arguments_raise_and_submit_nothing(
    pool: HostPool, args: tuple[object, object, object], message: str
) -> None:
    calls: list[TierOutcome] = []
    async with TierClient(MemoryTier(pool.view, BLOCK)) as client:
        with pytest.raises(InvalidArgumentError, match=message):
            client.submit(*args, calls.append)  # type: ignore[arg-type]
        with pytest.raises(InvalidArgumentError, match="on_done must be callable"):
            client.submit("store", [b"a"], [0], None)  # type: ignore[arg-type]
        await _spin()
        assert client.statistics().counters["jobs_submitted"] == 0
    assert calls == []


@pytest.mark.parametrize("timeout", [0, -1, float("nan"), float("inf"), "1", True])
def test_a_bad_timeout_is_rejected(pool: HostPool, timeout: object) -> None:
    with pytest.raises(InvalidArgumentError, match="timeout"):
        TierClient(ExampleSecondaryTier(pool.view, BLOCK), timeout=timeout)  # type: ignore[arg-type]


def test_a_tier_that_is_not_a_secondary_tier_is_rejected() -> None:
    with pytest.raises(InvalidArgumentError, match="SecondaryTierManager, got dict"):
        TierClient({})  # type: ignore[arg-type]


def test_job_results_are_read_the_one_documented_way() -> None:
    keys = [b"a", b"b", b"c"]
    assert TierOutcome.from_result(keys, JobResult(1, True)) == TierOutcome((b"a", b"b", b"c"))
    partial = TierOutcome.from_result(keys, JobResult(1, False, (b"b",), "gone"))
    assert partial.landed == (b"a", b"c") and dict(partial.failed) == {b"b": "gone"}
    whole = TierOutcome.from_result(keys, JobResult(1, False, (), None))
    assert whole.landed == () and set(whole.failed) == set(keys)
    assert not whole.ok
    with pytest.raises(TypeError):
        whole.failed[b"a"] = "x"  # type: ignore[index]


async def test_hold_release_touch_and_lookup_reach_the_tier(pool: HostPool) -> None:
    tier = MemoryTier(pool.view, BLOCK, max_blocks=2)
    recorder = Recorder()
    async with TierClient(tier) as client:
        recorder.submit(client, "store", [b"a", b"b"], [0, 1])
        await recorder.all()
        client.hold([b"a"])  # a is the least recently used, but held
        recorder.submit(client, "store", [b"c"], [2])
        await recorder.all()
        assert client.lookup(b"a") is True and client.lookup(b"b") is False
        client.release([b"a"])
        client.touch([b"c"])  # c most recent: a is the next to go
        recorder.submit(client, "store", [b"d"], [3])
        await recorder.all()
        assert client.lookup(b"a") is False and client.lookup(b"c") is True
        assert client.lookup(b"z") is False
        assert "memory" in repr(client)


async def test_submit_off_the_tiers_event_loop_is_refused(pool: HostPool) -> None:
    calls: list[TierOutcome] = []
    async with TierClient(MemoryTier(pool.view, BLOCK)) as client:
        with pytest.raises(InvalidArgumentError, match="event loop"):
            await asyncio.to_thread(client.submit, "store", [b"a"], [0], calls.append)
        assert client.statistics().counters["jobs_submitted"] == 0
    assert calls == []
