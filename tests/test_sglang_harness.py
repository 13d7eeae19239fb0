"""The SGLang harness itself (tests/_sglang_harness.py), proven with SGLang's own
``file`` backend: SGLang's real controller backs pages up in batches of at most 128,
and prefetches them back under each stop policy with the bytes they were stored with.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import pytest

from tests._scripts import last_json, run_script
from tests._sglang_harness import (  # skips the module without SGLang (fails in CI)
    LAYOUTS,
    POLICIES,
    Controller,
    backup,
    check_pages,
    controller,
    dynamic_config,
    evict,
    fill_pages,
    make_host_pool,
    page_tokens,
    prefetch,
    record_calls,
)

PAGE = 16
PAGES = 300
SHAPE = {"page_size": PAGE, "layers": 2, "heads": 2, "head_dim": 8}
FILE = ("sglang.srt.mem_cache.hicache_storage", "HiCacheFile")


@pytest.fixture(params=["page_first", "layer_first"])
def layout(request: pytest.FixtureRequest) -> str:
    return request.param


def _open(
    tmp_path: Path, layout: str, *, dynamic: bool, hybrid: bool = True
) -> AbstractContextManager[Controller]:
    pool = make_host_pool(layout, pages=PAGES + 8, **SHAPE)
    if dynamic:  # SGLang's own file backend, loaded by module path as ours will be
        name, extra = "dynamic", dynamic_config(*FILE, file_storage_path=str(tmp_path))
    else:
        name, extra = "file", {"file_storage_path": str(tmp_path)}
    return controller(pool, name, extra, hybrid=hybrid)


def _stored(ctrl: Controller, tokens: list[int]) -> int:
    """Fill pages for ``tokens``, back them up, evict them from host memory."""
    indices = ctrl.host_pool.alloc(len(tokens))
    fill_pages(ctrl.host_pool, indices, tokens)
    written = backup(ctrl, indices, tokens)
    evict(ctrl, indices)
    return written


@pytest.mark.parametrize("hybrid", [True, False], ids=["hybrid", "base"])
def test_backup_and_prefetch_go_in_batches_of_128(
    tmp_path: Path, layout: str, hybrid: bool
) -> None:
    with _open(tmp_path, layout, dynamic=True, hybrid=hybrid) as ctrl:
        assert type(ctrl.backend).__name__ == "HiCacheFile"
        log = record_calls(ctrl.backend)
        tokens = page_tokens(PAGES, PAGE)
        assert _stored(ctrl, tokens) == PAGES * PAGE
        assert len(list(tmp_path.glob("*.bin"))) == PAGES
        got = prefetch(ctrl, tokens)
        assert got.tokens == got.hit_tokens == PAGES * PAGE
        check_pages(ctrl.host_pool, got.host_indices, tokens)
    assert log.sizes("batch_set") == [128, 128, 44]
    assert log.sizes("batch_get") == [128, 128, 44]
    # The server's HybridCacheController asks about every page at once; the base
    # controller slices the hit query like the transfers.
    assert log.sizes("batch_exists") == ([300] if hybrid else [128, 128, 44])
    progress = [a.completed_tokens for a in got.acks if a.completed_tokens is not None]
    assert progress == [2048, 4096, 4800]
    assert got.acks[-1].completed_req and not got.terminated


@pytest.mark.parametrize("policy", POLICIES)
def test_prefetch_under_each_policy_returns_every_page(
    tmp_path: Path, layout: str, policy: str
) -> None:
    with _open(tmp_path, layout, dynamic=False) as ctrl:
        tokens = page_tokens(PAGES, PAGE, seed=1)
        assert _stored(ctrl, tokens) == PAGES * PAGE
        # best_effort: the next scheduling step comes long after these small loads.
        got = prefetch(ctrl, tokens, policy=policy, step_s=30.0)
        assert got.tokens == PAGES * PAGE and not got.terminated
        check_pages(ctrl.host_pool, got.host_indices, tokens)


def test_a_page_with_other_bytes_fails_the_check(tmp_path: Path) -> None:
    with _open(tmp_path, "page_first", dynamic=False) as ctrl:
        tokens = page_tokens(PAGES, PAGE, seed=2)
        assert _stored(ctrl, tokens) == PAGES * PAGE
        swapped = page_tokens(PAGES, PAGE, seed=2)
        swapped[5 * PAGE] = -1  # page 5's tokens differ: its bytes belong to others
        got = prefetch(ctrl, tokens)
        with pytest.raises(AssertionError, match="page 5 "):
            check_pages(ctrl.host_pool, got.host_indices, swapped)


def test_a_cancel_stops_the_transfer_between_batches(tmp_path: Path) -> None:
    with _open(tmp_path, "page_first", dynamic=False) as ctrl:
        tokens = page_tokens(PAGES, PAGE, seed=3)
        assert _stored(ctrl, tokens) == PAGES * PAGE
        log = record_calls(ctrl.backend)
        # Hold the second batch's read until the scheduler has cancelled after the
        # first batch's ack, so that the transfer cannot finish first.
        release = threading.Event()
        read = ctrl.backend.batch_get

        def gated(keys: Sequence[str], *args: Any) -> Any:
            if len(log.sizes("batch_get")) >= 1:
                assert release.wait(30)
            return read(keys, *args)

        ctrl.backend.batch_get = gated  # type: ignore[method-assign]

        def cancel(ack: Any) -> None:
            ctrl.sglang.terminate_prefetch(ack.operation)
            release.set()

        got = prefetch(ctrl, tokens, on_ack=cancel)
        assert got.terminated
        assert got.tokens == 128 * PAGE  # what had arrived when the scheduler cancelled
        check_pages(ctrl.host_pool, got.host_indices, tokens)
        assert len(log.sizes("batch_get")) <= 2  # the third batch was never read
        assert ctrl.host_pool.available_size() == ctrl.host_pool.size - got.tokens


def test_a_hit_below_the_threshold_is_not_fetched(tmp_path: Path) -> None:
    pool = make_host_pool("page_first", pages=64, **SHAPE)
    extra = {"file_storage_path": str(tmp_path), "prefetch_threshold": 32 * PAGE}
    with controller(pool, "file", extra) as ctrl:
        assert ctrl.prefetch_threshold == 32 * PAGE
        log = record_calls(ctrl.backend)
        tokens = page_tokens(16, PAGE, seed=4)
        assert _stored(ctrl, tokens) == 16 * PAGE
        got = prefetch(ctrl, tokens)
        assert (got.hit_tokens, got.tokens, got.terminated) == (16 * PAGE, 0, True)
        assert log.sizes("batch_get") == []


def test_the_layouts_round_trip_through_the_host_pool() -> None:
    for layout in LAYOUTS:
        pool = make_host_pool(layout, pages=4, **SHAPE)
        indices = pool.alloc(4 * PAGE)
        tokens = page_tokens(4, PAGE, seed=5)
        fill_pages(pool, indices, tokens)
        check_pages(pool, indices, tokens)


def test_ranks_and_storage_overrides_reach_the_backend(tmp_path: Path) -> None:
    tokens = page_tokens(20, PAGE, seed=6)
    extra = {"file_storage_path": str(tmp_path)}
    for rank in (0, 1):
        pool = make_host_pool("page_first", pages=24, **SHAPE)
        with controller(pool, "file", extra, model_name="org/m", tp_rank=rank, tp_size=2) as ctrl:
            assert (ctrl.storage_config.tp_rank, ctrl.storage_config.tp_size) == (rank, 2)
            assert _stored(ctrl, tokens) == 20 * PAGE
    for rank in (0, 1):  # one file per page and rank: the backend keys on the rank
        assert len(list(tmp_path.glob(f"*_org-m_{rank}_2.bin"))) == 20
    # An MLA model's second rank is no storage writer: SGLang skips its backups.
    pool = make_host_pool("page_first", pages=24, **SHAPE)
    mla = {"is_mla_model": True}
    with controller(pool, "file", extra, tp_rank=1, tp_size=2, storage_overrides=mla) as ctrl:
        assert not ctrl.storage_config.is_storage_writer
        assert _stored(ctrl, page_tokens(20, PAGE, seed=7)) == 0


def test_bench_sglang_tiers_runs_both_subjects_and_ends_with_json(tmp_path: Path) -> None:
    """A tiny run with SGLang's file backend as "ours" too (loaded by module path)."""
    done = run_script(
        "examples/bench_sglang_tiers.py", "--dir", str(tmp_path), "--shapes", "small",
        "--pages", "4", "--rounds", "2", "--ours", ":".join(FILE),
        "--set", "file_storage_path={dir}", "--set", "interface_v1=0",
    )  # fmt: skip
    (run,) = last_json(done)["runs"]
    assert (run["shape"], run["pages"], run["rounds"]) == ("small", 4, 2)
    for what in ("store", "load"):
        assert run[f"file_{what}_gbps"] > 0 and run[f"ours_{what}_gbps"] > 0
        assert run[f"{what}_ratio"] == pytest.approx(
            run[f"ours_{what}_gbps"] / run[f"file_{what}_gbps"], rel=0.01
        )
    for name in ("file", "ours"):  # SGLang's legacy calls, timed on its threads
        for method in ("batch_exists", "batch_set", "batch_get"):
            assert 0 < run[f"{name}_{method}_p50_us"] <= run[f"{name}_{method}_p99_us"]
        assert f"{name}_batch_set_v1_p99_us" not in run
    rounds = [
        line.split(": ")[0].split()[-1] for line in done.stderr.splitlines() if " round " in line
    ]
    assert rounds == ["file", "ours", "ours", "file"]  # ABBA
    assert list(tmp_path.iterdir()) == []  # each shape's files are removed after it
