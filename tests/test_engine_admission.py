"""What the engine writes to a lower tier: each admission rule and the write budget,
through the public API with real tiers (tiering/core/admission.py, write_budget.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests._clock import FakeClock
from tests._engine_helpers import assert_holds, h, make_kv, put, wipe
from tiering import TieringEngine
from tiering.errors import InvalidArgumentError
from tiering.lab.replay import TraceClock, replay, simulate
from tiering.lab.workloads import synthetic_requests
from tiering.observe.metrics import EngineCollector
from tiering.tiers.registry import make_tier

BLOCK = 512  # bytes of one block of make_kv's cache


async def serve(engine: TieringEngine, kv: list, keys: list[bytes]) -> int:
    """One request as a server runs it: look up, load the hit prefix, store the rest."""
    hit = engine.lookup(keys)
    if hit:
        assert (await engine.load(keys[:hit], range(hit))).success
    if hit < len(keys):
        ids = range(hit, len(keys))
        put(kv, keys[hit:], ids)
        job = engine.store(keys[hit:], ids)
        assert (await job).success
        assert await job.cascaded
    return hit


def memory(admission: str = "all", **options: object) -> dict:
    return {"type": "memory", "max_blocks": 64, "admission": admission, **options}


async def test_admitting_everything_writes_every_block_and_counts_it() -> None:
    kv = make_kv()
    async with TieringEngine(kv, 8, secondary_tiers=[memory()]) as engine:
        await serve(engine, kv, [h(1), h(2), h(3)])
        assert [engine.tiers[0].lookup(h(i)) for i in (1, 2, 3)] == [True] * 3
        counts = engine.admission_counters()[0]
        assert (counts["admitted_blocks"], counts["refused_blocks"]) == (3, 0)


async def test_seen_twice_refuses_a_first_sight_and_admits_the_second() -> None:
    kv = make_kv()
    async with TieringEngine(kv, 2, secondary_tiers=[memory("seen-twice")]) as engine:
        await serve(engine, kv, [h(1)])
        assert engine.tiers[0].lookup(h(1)) is False  # refused: simply not written
        await serve(engine, kv, [h(2), h(3)])  # the CPU tier of 2 lets block 1 go
        assert engine.lookup([h(1)]) == 0
        await serve(engine, kv, [h(1)])  # its second request: stored again, admitted
        assert engine.tiers[0].lookup(h(1)) is True
        counts = engine.admission_counters()[0]
        assert (counts["admitted_blocks"], counts["refused_blocks"]) == (1, 3)
        await serve(engine, kv, [h(4), h(5)])  # block 1 leaves the CPU tier again
        wipe(kv, [0])
        assert await serve(engine, kv, [h(1)]) == 1  # and is served from the lower tier
        assert_holds(kv, [h(1)], [0])


async def test_a_lookup_asked_again_before_its_request_ran_is_seen_once() -> None:
    kv = make_kv()
    async with TieringEngine(kv, 4, secondary_tiers=[memory("seen-twice")]) as engine:
        for _ in range(3):  # a scheduler polling a waiting request
            assert engine.lookup([h(1), h(2)]) == 0
        await serve(engine, kv, [h(1), h(2)])
        assert engine.admission_counters()[0]["refused_blocks"] == 2
        assert engine.tiers[0].get_num_blocks() == 0


async def test_refused_blocks_make_no_store_event() -> None:
    kv = make_kv()
    tiers = [memory("seen-twice")]
    async with TieringEngine(kv, 4, secondary_tiers=tiers, enable_events=True) as engine:
        await serve(engine, kv, [h(1), h(2)])
        events = engine.take_events()
        assert events and all(event.medium == "CPU" for event in events)
        assert engine.tiers[0].get_num_blocks() == 0
        assert engine.statistics().counters["cascaded_blocks"] == 0


async def test_the_write_budget_admits_what_it_has_earned_and_never_fails_a_store() -> None:
    kv, clock = make_kv(), FakeClock(100.0)
    tiers = [memory(write_budget=2 * BLOCK)]  # two blocks a second, at most two saved up
    async with TieringEngine(kv, 16, secondary_tiers=tiers, clock=clock) as engine:
        await serve(engine, kv, [h(i) for i in range(1, 6)])  # five blocks at once
        held = [engine.tiers[0].lookup(h(i)) for i in range(1, 6)]
        assert held == [True, True, False, False, False]  # the request's leading blocks
        clock.now += 60  # a quiet minute saves up no more than a second's worth
        await serve(engine, kv, [h(i) for i in range(10, 15)])
        assert engine.tiers[0].get_num_blocks() == 4  # blocks 1, 2, 10 and 11
        assert engine.admission_counters()[0] == {
            "admitted_blocks": 4,
            "refused_blocks": 0,
            "over_budget_blocks": 6,
            "late_blocks": 0,
            "backlog_blocks": 6,  # blocks 3 to 5 and 12 to 14, still in the CPU tier
        }
        assert engine.statistics().counters["failed_jobs"] == 0


async def test_blocks_over_the_budget_are_written_later_from_the_backlog() -> None:
    kv, clock = make_kv(), FakeClock(100.0)
    tiers = [memory(write_budget=2 * BLOCK)]
    async with TieringEngine(kv, 16, secondary_tiers=tiers, clock=clock) as engine:
        await serve(engine, kv, [h(1), h(2), h(3), h(4)])  # 3 and 4 wait
        clock.now += 1.0  # two blocks earned: the offer's first, then the backlog's oldest
        await serve(engine, kv, [h(5)])
        held = [engine.tiers[0].lookup(h(i)) for i in range(1, 6)]
        assert held == [True, True, True, False, True]
        counts = engine.admission_counters()[0]
        assert (counts["late_blocks"], counts["backlog_blocks"]) == (1, 1)


async def test_a_flush_writes_past_the_budget_and_the_budget_pays_for_it() -> None:
    kv, clock = make_kv(), FakeClock(100.0)
    tiers = [memory(write_budget=2 * BLOCK)]
    async with TieringEngine(
        kv, 16, secondary_tiers=tiers, clock=clock, write_policy="write_back"
    ) as engine:
        await serve(engine, kv, [h(i) for i in range(1, 7)])  # write-back: nothing offered
        assert await engine.flush()
        assert engine.tiers[0].get_num_blocks() == 6  # every block, whatever the budget
        clock.now += 1.0  # two blocks earned: still four short of what the flush spent
        await serve(engine, kv, [h(i) for i in range(20, 36)])  # evicts blocks 1..6
        assert engine.admission_counters()[0]["admitted_blocks"] == 0


async def test_a_budget_below_one_block_a_second_still_admits_now_and_then() -> None:
    kv, clock = make_kv(), FakeClock(100.0)
    tiers = [memory(write_budget=BLOCK // 4)]  # a block every four seconds
    async with TieringEngine(kv, 16, secondary_tiers=tiers, clock=clock) as engine:
        for i in range(8):
            await serve(engine, kv, [h(i + 1)])
            clock.now += 1.0
        assert engine.tiers[0].get_num_blocks() == 2  # at 0 s (saved up) and at 4 s


@pytest.mark.parametrize(
    ("option", "value"),
    [("admission", "sometimes"), ("admission", 2), ("write_budget", 0), ("write_budget", "x")],
)
def test_a_bad_admission_option_is_refused_naming_it(option: str, value: object) -> None:
    view = memoryview(bytearray(4 * BLOCK))
    with pytest.raises(InvalidArgumentError, match=rf"tier 'memory'.*{option}"):
        make_tier({"type": "memory", option: value}, view, BLOCK)


def test_an_nvme_tier_turns_drive_writes_per_day_into_its_budget(tmp_path: Path) -> None:
    from backends.nvme.tier import NVMeTier

    view = memoryview(bytearray(4 * 4096))
    options = {"root": tmp_path, "namespace": "ns", "capacity_bytes": 86400 << 10}
    tier = NVMeTier(view, 4096, **options, drive_writes_per_day=2)
    assert tier.write_budget == 2 << 10  # twice its capacity a day: 2 KiB a second
    tier = NVMeTier(view, 4096, **options, drive_writes_per_day=2, write_budget=1000)
    assert tier.write_budget == 1000  # the tighter of the two
    with pytest.raises(InvalidArgumentError, match="drive_writes_per_day"):
        NVMeTier(view, 4096, **options, drive_writes_per_day=0)


async def test_the_tier_metrics_show_what_admission_did() -> None:
    kv = make_kv()
    async with TieringEngine(kv, 2, secondary_tiers=[memory("seen-twice")]) as engine:
        await serve(engine, kv, [h(1), h(2)])
        samples = {
            sample.name: sample.value
            for family in EngineCollector(engine).collect()
            for sample in family.samples
            if sample.labels.get("tier") == "memory"
        }
    assert samples["kv_tiering_tier_admission_refused_blocks_total"] == 2
    assert samples["kv_tiering_tier_admitted_blocks_total"] == 0
    assert samples["kv_tiering_tier_over_budget_blocks_total"] == 0


@pytest.mark.parametrize(
    ("rule", "budget_blocks_per_s"),
    [("all", None), ("seen-twice", None), ("adaptive", None), ("adaptive", 0.5)],
)
async def test_the_engine_admits_exactly_as_the_bookkeeping_replay_does(
    rule: str, budget_blocks_per_s: float | None
) -> None:
    requests = synthetic_requests(sessions=40, system_prompts=4, seed=3)
    budget = None if budget_blocks_per_s is None else int(budget_blocks_per_s * BLOCK)
    tier = {"type": "memory", "max_blocks": 48, "admission": rule, "write_budget": budget}
    clock = TraceClock()

    def make_engine(kv: object) -> TieringEngine:
        return TieringEngine(kv, 24, secondary_tiers=[tier], clock=clock)

    summary = await replay(
        requests, make_engine, block_bytes=BLOCK, settle=True, verify=True, clock=clock
    )
    model = simulate(
        requests,
        cpu_blocks=24,
        tier_blocks=[48],
        tier_admission=[rule],
        tier_budget=[budget_blocks_per_s],
    )
    admitted = summary.admission_by_tier["memory"]
    assert summary.mismatches == 0
    assert summary.hit_blocks == sum(model.hits.values())
    assert admitted["admitted_blocks"] == model.written["tier0"]
    offered = admitted["refused_blocks"] + admitted["over_budget_blocks"]
    assert offered == model.refused["tier0"]
    if rule != "all":
        assert offered > 0  # the rule or the budget did refuse some, here
