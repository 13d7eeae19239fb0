"""Our tiers under vLLM 0.33's own TieringOffloadingManager (tiering.integrations.vllm).

Every test drives vLLM's real manager and factory on CPU (see tests/_vllm_harness.py);
only the GPU worker's copies are played by the test.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from tests._engine_helpers import corrupt_block
from tests._faults import FaultInjector
from tests._nvme_helpers import nvme_tiers_built
from tests._scripts import last_json, run_script
from tests._vllm_harness import (  # skips the module without vLLM (fails in CI)
    CHUNK_BYTES,
    MODULE,
    LookupResult,
    ReqContext,
    Scheduler,
    TransferJob,
    chunk_past_the_end,
    key,
    nvme_tier,
    payload,
)
from tiering.errors import InvalidArgumentError, UnknownTierError
from tiering.integrations.vllm import (
    MemoryTierManager,
    NVMeTierManager,
    RegisteredTierManager,
    vllm_namespace,
)
from tiering.lifecycle import Lifecycle
from tiering.tiers.io_threads import STAGING_BYTES

PRIMARY = 4  # CPU chunks: small, so stores evict quickly


def blocks(prefix: str, n: int) -> dict[bytes, bytes]:
    return {key(f"{prefix}{i}"): payload(key(f"{prefix}{i}")) for i in range(n)}


def evict_all(s: Scheduler, stored: dict[bytes, bytes]) -> None:
    """Store PRIMARY other blocks, so none of ``stored`` is left in the CPU tier."""
    s.settle()
    s.store(blocks("filler", PRIMARY))
    s.settle()
    assert not any(s.in_primary(k) for k in stored)


def tier_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("kv-tiering-")]


@pytest.fixture
def scheduler(tmp_path: Path):
    made: list[Scheduler] = []

    def make(*tiers: dict, chunks: int = PRIMARY, **config) -> Scheduler:
        s = Scheduler(chunks, list(tiers) or [nvme_tier(tmp_path / "nvme")], **config)
        made.append(s)
        return s

    yield make
    for s in made:
        s.shutdown()
    assert tier_threads() == []


# -- the round trip ---------------------------------------------------------------------


def test_nvme_blocks_evicted_from_cpu_come_back_byte_exact(scheduler) -> None:
    s = scheduler()
    stored = blocks("a", PRIMARY)
    s.store(stored)
    evict_all(s, stored)

    answers = s.resolve(stored)

    assert all(answers[k] is LookupResult.HIT for k in stored)
    assert all(answers["first", k] is LookupResult.HIT_PENDING for k in stored)
    assert s.read(list(stored)) == stored
    assert isinstance(s.tier, NVMeTierManager)


def test_memory_tier_round_trip_through_vllm(scheduler) -> None:
    s = scheduler({"type": "MemoryTierManager", "module_path": MODULE, "max_blocks": 64})
    stored = blocks("m", PRIMARY)
    s.store(stored)
    evict_all(s, stored)

    answers = s.resolve(stored)
    assert all(answers[k] is LookupResult.HIT for k in stored)
    assert s.read(list(stored)) == stored
    assert isinstance(s.tier, MemoryTierManager)


def test_registered_tier_is_built_by_name_from_a_plain_config(scheduler) -> None:
    s = scheduler(
        {"type": "RegisteredTierManager", "module_path": MODULE, "tier": "memory", "max_blocks": 16}
    )
    stored = blocks("r", 2)
    s.store(stored)
    evict_all(s, stored)

    answers = s.resolve(stored)
    assert all(answers[k] is LookupResult.HIT for k in stored)
    assert s.read(list(stored)) == stored
    assert type(s.tier) is RegisteredTierManager
    assert s.tier.get_stats() is not None


def test_the_redis_tier_runs_under_vllm_by_name(scheduler, redis_server) -> None:
    s = scheduler(
        {"type": "RegisteredTierManager", "module_path": MODULE, "tier": "redis",
         "url": redis_server.url}
    )  # fmt: skip
    stored = blocks("redis", 2)
    s.store(stored)
    evict_all(s, stored)

    answers = s.resolve(stored)  # vLLM asks from its own thread; the tier never waits
    assert all(answers[k] is LookupResult.HIT for k in stored)
    assert s.read(list(stored)) == stored


def test_a_corrupted_block_fails_its_promotion_and_is_never_served(scheduler, tmp_path) -> None:
    s = scheduler()
    stored = blocks("c", 2)
    bad, good = list(stored)
    s.store(stored)
    evict_all(s, stored)
    corrupt_block(tmp_path / "nvme", bad)

    answers = s.resolve(stored)

    assert answers[good] is LookupResult.HIT
    assert answers[bad] is LookupResult.MISS
    assert not s.in_primary(bad)
    assert s.read([good]) == {good: stored[good]}


def test_a_new_manager_on_the_same_root_starts_warm(scheduler) -> None:
    first = scheduler()
    stored = blocks("w", 3)
    first.store(stored)
    first.settle()
    first.shutdown()

    second = scheduler()
    answers = second.resolve(stored)

    assert all(answers[k] is LookupResult.HIT for k in stored)
    assert second.read(list(stored)) == stored


def test_two_models_on_one_root_never_see_each_others_blocks(scheduler) -> None:
    a = scheduler(model="org/a")
    stored = blocks("n", 2)
    a.store(stored)
    a.settle()

    b = scheduler(model="org/b")

    assert all(b.resolve(stored)[k] is LookupResult.MISS for k in stored)
    assert vllm_namespace(a.spec, CHUNK_BYTES) != vllm_namespace(b.spec, CHUNK_BYTES)


# -- jobs in flight ---------------------------------------------------------------------


def _job(job_id: int, keys: list[bytes], chunks: list[int], promotion: bool) -> TransferJob:
    return TransferJob(
        job_id, keys, np.array(chunks, dtype=np.int64), promotion, ReqContext(req_id="t")
    )


def test_a_store_in_flight_is_retry_until_its_result_is_queued(scheduler, tmp_path) -> None:
    faults = FaultInjector()
    gate = faults.hold("pwritev", path=".seg")
    s = scheduler(nvme_tier(tmp_path / "nvme", os_calls=faults))
    tier = s.tier
    k = key("inflight")

    tier.submit_store(_job(10_000, [k], [0], False))
    assert gate.wait_reached(10)

    assert tier.lookup(k, ReqContext(req_id="t")) is LookupResult.RETRY
    assert tier.has_pending_work()
    assert list(tier.get_finished_jobs()) == []
    gate.open()
    tier.drain_jobs()
    (result,) = tier.get_finished_jobs()
    assert (result.job_id, result.success) == (10_000, True)
    assert result.transfer_bytes == CHUNK_BYTES
    assert tier.lookup(k, ReqContext(req_id="t")) is LookupResult.HIT
    assert not tier.has_pending_work()


def test_drain_waits_for_every_job_and_shutdown_is_idempotent(scheduler, tmp_path) -> None:
    faults = FaultInjector()
    faults.delay("pwritev", 0.05, path=".seg")
    s = scheduler(nvme_tier(tmp_path / "nvme", os_calls=faults))
    tier = s.tier
    for i in range(PRIMARY):
        tier.submit_store(_job(20_000 + i, [key(f"d{i}")], [i], False))

    tier.drain_jobs()

    results = list(tier.get_finished_jobs())
    assert sorted(r.job_id for r in results) == [20_000 + i for i in range(PRIMARY)]
    assert all(r.success for r in results)
    tier.shutdown()
    tier.shutdown()
    assert tier_threads() == []


def test_shutdown_with_jobs_in_flight_reports_every_job(scheduler, tmp_path) -> None:
    faults = FaultInjector()
    faults.delay("pwritev", 0.05, path=".seg")
    s = scheduler(nvme_tier(tmp_path / "nvme", os_calls=faults))
    tier = s.tier
    for i in range(PRIMARY):
        tier.submit_store(_job(30_000 + i, [key(f"s{i}")], [i], False))

    tier.shutdown()

    assert sorted(r.job_id for r in tier.get_finished_jobs()) == [
        30_000 + i for i in range(PRIMARY)
    ]
    assert not tier.has_pending_work()
    tier.submit_store(_job(30_100, [key("late")], [0], False))
    tier.submit_load(_job(30_101, [key("s0")], [0], True))
    assert [(r.job_id, r.success) for r in tier.get_finished_jobs()] == [
        (30_100, False),
        (30_101, False),
    ]
    assert refused(tier) == {"store": 1, "load": 1}


def refused(tier: RegisteredTierManager) -> dict[str, int]:
    """Store and load jobs the tier refused since its last ``get_stats``."""
    _types, values = tier.get_stats().metric_sections()
    return {
        kind: int(sum(values.get(f"kv_tiering:{kind}_refused_jobs", {}).values()))
        for kind in ("store", "load")
    }


def test_a_store_into_a_chunk_outside_the_cpu_tier_fails_and_vllm_goes_on(
    scheduler, monkeypatch
) -> None:
    """vLLM's complete_store calls submit_store without a try: a job we refuse fails,
    vLLM unpins its chunks, and later jobs run."""
    s = scheduler()
    bad = blocks("oob-store", 2)
    chunk_past_the_end(monkeypatch, s, "prepare_read")

    s.store(bad)  # vLLM's own cascade submits the job with chunk ids past the CPU tier
    s.settle()  # vLLM takes the failed result

    context = ReqContext(req_id="check")
    assert all(s.tier.lookup(k, context) is LookupResult.MISS for k in bad)
    assert refused(s.tier) == {"store": 1, "load": 0}
    good = blocks("oob-after", 2)
    s.store(good)
    evict_all(s, {**bad, **good})  # the refused job's chunks were unpinned: evictable
    answers = s.resolve(good)
    assert all(answers[k] is LookupResult.HIT for k in good)
    assert s.read(list(good)) == good


def test_a_promotion_into_a_chunk_outside_the_cpu_tier_fails_and_vllm_goes_on(
    scheduler, monkeypatch
) -> None:
    """vLLM's on_schedule_end calls submit_load without a try: a promotion we refuse
    fails, vLLM drops the chunk it had taken and promotes the block again."""
    s = scheduler()
    stored = blocks("oob-load", 2)
    s.store(stored)
    evict_all(s, stored)
    chunk_past_the_end(monkeypatch, s, "prepare_write")

    answers = s.resolve(stored)  # the first promotion names a chunk past the CPU tier

    assert refused(s.tier) == {"store": 0, "load": 1}
    assert all(answers[k] is LookupResult.HIT for k in stored)
    assert s.read(list(stored)) == stored


@pytest.mark.parametrize(
    ("keys", "chunks"),
    [
        ([key("far")], [PRIMARY]),  # past the CPU tier
        ([key("neg")], [-1]),
        ([key("a"), key("b")], [0]),  # as many ids as keys
        (["not bytes"], [0]),
        ([key("x")], [0.5]),
    ],
    ids=["past-the-end", "negative", "lengths", "key-not-bytes", "id-not-int"],
)
@pytest.mark.parametrize("promotion", [False, True], ids=["store", "load"])
def test_a_job_the_tier_cannot_do_fails_at_once_and_leaves_nothing_pending(
    scheduler, keys: list, chunks: list, promotion: bool
) -> None:
    tier = scheduler().tier
    job = TransferJob(40_000, keys, np.array(chunks), promotion, ReqContext(req_id="t"))

    (tier.submit_load if promotion else tier.submit_store)(job)

    assert not tier.has_pending_work()
    tier.drain_jobs()  # returns: no job is left without a result
    (result,) = tier.get_finished_jobs()
    assert (result.job_id, result.success, result.successful_keys) == (40_000, False, None)
    assert refused(tier) == {"store": int(not promotion), "load": int(promotion)}
    tier.submit_store(_job(40_001, [key("fine")], [0], False))  # the tier goes on
    tier.drain_jobs()
    (result,) = tier.get_finished_jobs()
    assert (result.job_id, result.success) == (40_001, True)


def test_refusals_are_logged_once_per_cause_and_all_counted(scheduler, caplog) -> None:
    tier = scheduler().tier
    caplog.set_level(logging.WARNING, logger="tiering.integrations.vllm")
    for job_id in (1, 2, 3):
        tier.submit_store(_job(job_id, [key(f"l{job_id}")], [PRIMARY], False))
    tier.submit_load(_job(4, [key("l4")], [PRIMARY], True))

    assert len(list(tier.get_finished_jobs())) == 4
    logged = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(logged) == 2
    assert "store job refused" in logged[0] and "job 1: slots" in logged[0]
    assert "load job refused" in logged[1]
    assert "get_stats(): kv_tiering:<kind>_refused_jobs" in logged[0]
    assert refused(tier) == {"store": 3, "load": 1}


def test_a_job_whose_id_is_in_flight_gets_no_second_result(scheduler, tmp_path) -> None:
    faults = FaultInjector()
    gate = faults.hold("pwritev", path=".seg")
    tier = scheduler(nvme_tier(tmp_path / "nvme", os_calls=faults)).tier
    tier.submit_store(_job(41_000, [key("first")], [0], False))
    try:
        assert gate.wait_reached(10)

        tier.submit_store(_job(41_000, [key("again")], [1], False))  # vLLM never does this

        assert list(tier.get_finished_jobs()) == []
        assert refused(tier) == {"store": 1, "load": 0}
    finally:
        gate.open()
    tier.drain_jobs()
    (result,) = tier.get_finished_jobs()  # one result for the id: the first job's
    assert (result.job_id, result.success) == (41_000, True)
    assert tier.lookup(key("again"), ReqContext(req_id="t")) is LookupResult.MISS


def test_a_partial_load_names_only_the_keys_that_landed(scheduler) -> None:
    s = scheduler()
    stored = blocks("p", 2)
    s.store(stored)
    s.settle()
    present, missing = next(iter(stored)), key("never stored")

    s.tier.submit_load(_job(40_000, [present, missing], [0, 1], True))
    s.tier.drain_jobs()

    (result,) = s.tier.get_finished_jobs()
    assert not result.success
    assert list(result.successful_keys) == [present]
    assert s.chunk(0) == stored[present]


def test_submit_calls_return_while_the_tier_s_io_is_stuck(scheduler, tmp_path) -> None:
    faults = FaultInjector()
    gate = faults.hold("pwritev", path=".seg")
    s = scheduler(nvme_tier(tmp_path / "nvme", os_calls=faults))
    s.tier.submit_store(_job(50_000, [key("stuck")], [0], False))
    assert gate.wait_reached(10)  # the write is held on the tier's I/O thread

    # Each call returns although no write can end (one that waited would never return).
    s.tier.submit_store(_job(50_001, [key("next")], [1], False))
    s.tier.touch([key("stuck")], ReqContext(req_id="t"))
    assert s.tier.lookup(key("next"), ReqContext(req_id="t")) is LookupResult.RETRY
    assert list(s.tier.get_finished_jobs()) == []

    gate.open()
    s.tier.drain_jobs()
    assert {r.job_id for r in s.tier.get_finished_jobs()} == {50_000, 50_001}


# -- configuration ----------------------------------------------------------------------


def test_the_printed_kv_transfer_config_runs_our_tier_under_vllm(scheduler, tmp_path) -> None:
    from vllm.config.kv_transfer import KVTransferConfig

    root = Path(__file__).resolve().parent.parent
    printed = subprocess.run(
        [sys.executable, "-m", "tiering", "vllm-config", str(tmp_path / "printed"),
         "--nvme-capacity", "64M", "--cpu", "32K"],
        cwd=root, capture_output=True, text=True, check=True, timeout=120,
    ).stdout  # fmt: skip
    config = json.loads(printed)
    KVTransferConfig(**config)  # vLLM's own check of the whole config
    extra = config["kv_connector_extra_config"]
    assert extra["spec_name"] == "TieringOffloadingSpec"

    s = scheduler(*extra["secondary_tiers"])
    stored = blocks("cfg", 2)
    s.store(stored)
    evict_all(s, stored)

    answers = s.resolve(stored)
    assert all(answers[k] is LookupResult.HIT for k in stored)
    assert s.read(list(stored)) == stored
    assert list((tmp_path / "printed").iterdir())  # the tier wrote under the printed root


def test_bench_vllm_tiers_runs_both_tiers_and_ends_with_json(tmp_path: Path) -> None:
    """A tiny run: both tiers through vLLM's manager, bytes checked, one JSON line."""
    done = run_script(
        "examples/bench_vllm_tiers.py", str(tmp_path), "--size-gib", "0.001",
        "--block-sizes", "64K", "--cpu-mib", "1", "--request-mib", "1", "--repeat", "2",
        "--step-ms", "1",
    )  # fmt: skip
    (run,) = last_json(done)["runs"]
    assert run["block_bytes"] == 64 << 10 and run["rounds"] == 2
    for side in ("ours", "vllm_fs"):
        for what in ("store", "load"):
            figure = f"{side}_{what}_GBps"
            assert 0 < run[f"{figure}_min"] <= run[figure] <= run[f"{figure}_max"]
    for what in ("store", "load"):  # a ratio of medians, and the rounds' own ratios
        assert run[f"{what}_ratio"] == pytest.approx(
            run[f"ours_{what}_GBps"] / run[f"vllm_fs_{what}_GBps"], rel=0.01
        )
        low, mid, high = (run[f"{what}_ratio_pairs_{x}"] for x in ("min", "median", "max"))
        assert 0 < low <= mid <= high
    assert run["submit_us_p99"] > 0
    # ABBA: ours first in round 1, vLLM's first in round 2
    rounds = [line for line in done.stderr.splitlines() if " round " in line]
    assert [line.split(": ")[1].split(" store")[0] for line in rounds] == [
        "ours", "vLLM fs", "vLLM fs", "ours"
    ]  # fmt: skip
    assert list(tmp_path.iterdir()) == []  # the roots are removed after the last round


def test_the_nvme_tier_does_not_pause_for_its_private_loop_unless_told(scheduler, tmp_path) -> None:
    with nvme_tiers_built() as built:
        scheduler(nvme_tier(tmp_path / "default"))
        scheduler(nvme_tier(tmp_path / "told", gil_pause_bytes=65536))
    assert [tier.gil_pause_bytes for tier in built] == [0, 65536]


def test_the_nvme_tier_stages_direct_io_for_vllm_s_shared_memory_unless_told(
    scheduler, tmp_path
) -> None:
    """vLLM's CPU tier is a shared memory file of 4 KiB pages: the tier moves its direct
    I/O through staging buffers by default (docs/vllm.md), and blocks still come back
    byte-exact; ``staging_bytes: 0`` moves it straight to and from vLLM's memory."""
    with nvme_tiers_built() as built:
        s = scheduler(nvme_tier(tmp_path / "default"))
        scheduler(nvme_tier(tmp_path / "told", staging_bytes=0))
    assert [tier.staging_bytes for tier in built] == [STAGING_BYTES, 0]
    stored = blocks("staged", PRIMARY)
    s.store(stored)
    evict_all(s, stored)
    answers = s.resolve(stored)
    assert all(answers[k] is LookupResult.HIT for k in stored)
    assert s.read(list(stored)) == stored


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"capacity_bytes": -1}, "capacity_bytes"),
        ({"fsync": "sometimes"}, "fsync"),
        ({"start_timeout": 0}, "start_timeout"),
        ({"enable_kv_events": "yes"}, "enable_kv_events"),
        ({"tier": "memory"}, "tier"),
    ],
)
def test_a_bad_option_is_a_clear_error_and_leaves_nothing_running(
    tmp_path: Path, options: dict, named: str
) -> None:
    with pytest.raises(InvalidArgumentError, match=named):
        Scheduler(PRIMARY, [nvme_tier(tmp_path / "nvme", **options)])
    assert tier_threads() == []


def test_an_unknown_tier_name_is_an_unknown_tier_error(tmp_path: Path) -> None:
    config = {"type": "RegisteredTierManager", "module_path": MODULE, "tier": "tape"}
    with pytest.raises(UnknownTierError, match="tape"):
        Scheduler(PRIMARY, [config])
    assert tier_threads() == []


def test_events_report_blocks_stored_in_the_tier(scheduler, tmp_path) -> None:
    s = scheduler(nvme_tier(tmp_path / "nvme", enable_kv_events=True), events=True)
    stored = blocks("e", 2)
    s.store(stored)
    s.settle()

    events = [e for e in s.tier.take_events()]

    assert {k for e in events for k in e.keys} == set(stored)
    assert all(not e.removed and e.ownership == s.tier.tier_type for e in events)


def small_nvme(root: Path, **options) -> dict:
    """An NVMe tier reporting events that holds 8 blocks, in segments of 4."""
    record = 4096 + CHUNK_BYTES  # a header page and the chunk
    return nvme_tier(
        root,
        enable_kv_events=True,
        segment_bytes=4096 + 4 * record,
        capacity_bytes=8 * record,
        **options,
    )


def replay(events) -> tuple[set[bytes], set[bytes]]:
    """The keys held and the keys removed, applying ``events`` in order."""
    held: set[bytes] = set()
    removed: set[bytes] = set()
    for event in events:
        if event.removed:
            held.difference_update(event.keys)
            removed.update(event.keys)
        else:
            held.update(event.keys)
    return held, removed


def test_events_replayed_in_order_give_what_the_tier_holds(scheduler, tmp_path) -> None:
    s = scheduler(small_nvme(tmp_path / "nvme"), events=True)
    every: list[bytes] = []
    for batch in range(4):  # 16 blocks through a tier of 8: segments are evicted
        stored = blocks(f"batch{batch}-", PRIMARY)
        every += stored
        s.store(stored)
        s.settle()

    held, removed = replay(s.tier.take_events())

    context = ReqContext(req_id="check")
    assert held == {k for k in every if s.tier.lookup(k, context) is LookupResult.HIT}
    assert removed == set(every) - held and len(removed) >= 8  # every eviction was told


def test_events_of_jobs_that_end_during_shutdown_are_read_after_it(scheduler, tmp_path) -> None:
    """vLLM drains events after its manager's shutdown: a store that ends while the
    shutdown drains it, and the eviction it makes, are told then."""
    faults = FaultInjector()
    with nvme_tiers_built() as built:
        s = scheduler(small_nvme(tmp_path / "nvme", os_calls=faults), events=True)
    every: list[bytes] = []
    for batch in range(2):  # the tier is full
        stored = blocks(f"before{batch}-", PRIMARY)
        every += stored
        s.store(stored)
        s.settle()
    before = [e for e in s.manager.take_events() if e.ownership == s.tier.tier_type]
    gate = faults.hold("pwritev", path=".seg")
    last = blocks("at-close-", PRIMARY)
    every += last
    s.store(last)  # evicts the oldest segment, then waits to be written
    closing = threading.Thread(target=s.shutdown)
    try:
        assert gate.wait_reached(10)
        closing.start()
        deadline = time.monotonic() + 30  # a bound on the wait, not a timing
        while built[0].state is not Lifecycle.CLOSING:
            assert time.monotonic() < deadline, "the shutdown never began"
            time.sleep(0.001)
    finally:
        gate.open()
    closing.join(60)
    assert not closing.is_alive()

    after = [e for e in s.manager.take_events() if e.ownership == s.tier.tier_type]

    assert set(last) <= {k for e in after if not e.removed for k in e.keys}
    assert {k for e in after if e.removed for k in e.keys} == set(blocks("before0-", PRIMARY))
    held, _ = replay(before + after)
    reopened = scheduler(small_nvme(tmp_path / "nvme"))
    context = ReqContext(req_id="check")
    assert held == {k for k in every if reopened.tier.lookup(k, context) is LookupResult.HIT}


def test_metric_definitions_cover_every_reported_name(scheduler) -> None:
    s = scheduler()
    s.store(blocks("x", 2))
    s.settle()

    stats = s.tier.get_stats()
    names = set(NVMeTierManager.build_metric_definitions({}))
    _types, values = stats.metric_sections()

    assert set(values) <= names
    assert sum(values["kv_tiering:store_blocks"].values()) == 2


def test_importing_without_vllm_names_the_extra() -> None:
    code = (
        "import sys; sys.modules['vllm'] = None\n"
        "try:\n    import tiering.integrations.vllm\n"
        "except ImportError as e:\n    print(e)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    ).stdout
    assert "kv-tiering[vllm]" in out
