"""Our tiers as SGLang 0.5.23's HiCache storage (tiering.integrations.sglang), driven by
SGLang's own controller and host pool on CPU (tests/_sglang_harness.py): backups in
batches of 128 pages, prefetches under each stop policy, damaged, foreign and restarted
pages, ranks, and two servers sharing one Redis, byte-exact.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import pytest

from tests._engine_helpers import corrupt_block
from tests._nvme_helpers import nvme_tiers_built
from tests._redis_helpers import client_of, damage_payload
from tests._redis_servers import LocalRedisServer
from tests._sglang_harness import (  # skips the module without SGLang (fails in CI)
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
from tiering.errors import InvalidArgumentError

from sglang.srt.mem_cache.utils import get_storage_hash_str  # isort: skip (after the guard)

MODULE = "tiering.integrations.sglang"
PAGE = 16
PAGES = 300
SHAPE = {"page_size": PAGE, "layers": 2, "heads": 2, "head_dim": 8}


def nvme(root: Path, **options: Any) -> dict[str, Any]:
    options = {"interface_v1": 1, "root": str(root), "capacity_bytes": 1 << 30, **options}
    return dynamic_config(MODULE, "NVMeHiCacheStorage", **options)


def redis(server: LocalRedisServer, **options: Any) -> dict[str, Any]:
    return dynamic_config(MODULE, "RedisHiCacheStorage", interface_v1=1, url=server.url, **options)


def opened(
    extra: dict[str, Any], layout: str = "page_first", *, pages: int = 2 * PAGES + 8, **kw: Any
) -> AbstractContextManager[Controller]:
    """SGLang's controller with our backend, over a host pool of its own."""
    return controller(make_host_pool(layout, pages=pages, **SHAPE), "dynamic", extra, **kw)


def stored(ctrl: Controller, tokens: list[int]) -> int:
    """Fill host pages for ``tokens``, back them up through SGLang, evict them; returns
    the tokens SGLang counted as written."""
    indices = ctrl.host_pool.alloc(len(tokens))
    fill_pages(ctrl.host_pool, indices, tokens)
    written = backup(ctrl, indices, tokens)
    evict(ctrl, indices)
    return written


def page_key(tokens: list[int], page: int) -> str:
    """SGLang's key of page ``page`` of ``tokens`` (its hash chain)."""
    return get_storage_hash_str(tokens, None, page_size=PAGE)[page]


@pytest.fixture(params=["page_first", "layer_first"])
def layout(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(params=["nvme", "redis"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[dict[str, Any]]:
    if request.param == "nvme":
        yield nvme(tmp_path / "kv")
    else:
        server = request.getfixturevalue("redis_server")
        yield redis(server)


def test_backups_and_prefetches_move_every_page_byte_exact(
    backend: dict[str, Any], layout: str
) -> None:
    tokens = page_tokens(PAGES, PAGE)
    metrics = {"enable_storage_metrics": True}
    with opened(backend, layout, storage_overrides=metrics) as ctrl:
        log = record_calls(ctrl.backend)
        assert type(ctrl.backend).__module__ == MODULE
        assert stored(ctrl, tokens) == PAGES * PAGE
        got = prefetch(ctrl, tokens)
        assert got.tokens == got.hit_tokens == PAGES * PAGE
        check_pages(ctrl.host_pool, got.host_indices, tokens)
        progress = [a.completed_tokens for a in got.acks if a.completed_tokens is not None]
        assert progress == [2048, 4096, 4800]  # one ack per batch
        stats = ctrl.backend.get_stats()  # the pages each call moved whole
        assert stats.backup_pgs == stats.prefetch_pgs == [128, 128, 44]
    assert log.sizes("batch_set_v1") == log.sizes("batch_get_v1") == [128, 128, 44]
    assert log.sizes("batch_set") == log.sizes("batch_get") == []  # the zero-copy calls


@pytest.mark.parametrize("policy", POLICIES)
def test_a_prefetch_under_each_stop_policy_brings_every_page(
    backend: dict[str, Any], policy: str
) -> None:
    tokens = page_tokens(PAGES, PAGE, seed=1)
    with opened(backend) as ctrl:
        assert stored(ctrl, tokens) == PAGES * PAGE
        got = prefetch(ctrl, tokens, policy=policy, step_s=30.0)
        assert got.tokens == PAGES * PAGE and not got.terminated
        check_pages(ctrl.host_pool, got.host_indices, tokens)


def test_a_cancel_between_batches_keeps_the_pages_that_landed(tmp_path: Path) -> None:
    tokens = page_tokens(PAGES, PAGE, seed=2)
    with opened(nvme(tmp_path)) as ctrl:
        assert stored(ctrl, tokens) == PAGES * PAGE
        got = prefetch(
            ctrl, tokens, on_ack=lambda ack: ctrl.sglang.terminate_prefetch(ack.operation)
        )
        assert got.terminated and got.tokens % (128 * PAGE) == 0 and got.tokens < PAGES * PAGE
        check_pages(ctrl.host_pool, got.host_indices, tokens)


def test_a_damaged_page_on_disk_is_never_served_and_ends_the_hit(tmp_path: Path) -> None:
    tokens = page_tokens(PAGES, PAGE, seed=3)
    with opened(nvme(tmp_path)) as ctrl:
        assert stored(ctrl, tokens) == PAGES * PAGE
        corrupt_block(tmp_path, page_key(tokens, 5).encode() + b"/1")  # page 5's V run
        got = prefetch(ctrl, tokens)
        assert got.tokens == 5 * PAGE  # SGLang takes the pages before the damaged one
        check_pages(ctrl.host_pool, got.host_indices, tokens[: 5 * PAGE])
        evict(ctrl, got.host_indices)
        again = prefetch(ctrl, tokens, request_id="again")
        assert again.hit_tokens == 5 * PAGE  # the damaged page became a miss


def test_a_damaged_page_on_redis_is_never_served(redis_server: LocalRedisServer) -> None:
    tokens = page_tokens(PAGES, PAGE, seed=4)
    with opened(redis(redis_server)) as ctrl:
        assert stored(ctrl, tokens) == PAGES * PAGE
        suffix = page_key(tokens, 7).encode() + b"/0"
        client = client_of(redis_server)
        try:
            (name,) = [n for n in client.keys("*") if n.endswith(suffix)]
            damage_payload(client, name)
        finally:
            client.close()
        got = prefetch(ctrl, tokens)
        assert got.tokens == 7 * PAGE
        check_pages(ctrl.host_pool, got.host_indices, tokens[: 7 * PAGE])


def test_a_restarted_server_serves_what_the_last_one_stored(tmp_path: Path) -> None:
    tokens = page_tokens(PAGES, PAGE, seed=5)
    with opened(nvme(tmp_path)) as ctrl:
        assert stored(ctrl, tokens) == PAGES * PAGE
    with opened(nvme(tmp_path)) as ctrl:  # a new process: new host pool, new tier
        got = prefetch(ctrl, tokens)
        assert got.tokens == PAGES * PAGE
        check_pages(ctrl.host_pool, got.host_indices, tokens)


def test_a_backup_of_pages_the_tier_holds_writes_nothing_again(tmp_path: Path) -> None:
    tokens = page_tokens(64, PAGE, seed=13)
    with nvme_tiers_built() as built, opened(nvme(tmp_path)) as ctrl:
        assert stored(ctrl, tokens) == 64 * PAGE
        used = built[0].used_bytes
        assert stored(ctrl, tokens) == 64 * PAGE  # SGLang counts them as backed up
        assert built[0].used_bytes == used


@pytest.mark.parametrize(
    "other",
    [
        {"model_name": "org/other-model"},
        {"tp_rank": 1, "tp_size": 2},
        {"layout": "layer_first"},
    ],
    ids=["model", "tp-rank", "layout"],
)
def test_pages_of_another_model_rank_or_layout_never_load(
    tmp_path: Path, other: dict[str, Any]
) -> None:
    tokens = page_tokens(64, PAGE, seed=6)
    with opened(nvme(tmp_path)) as ctrl:
        assert stored(ctrl, tokens) == 64 * PAGE
    other = dict(other)
    layout = other.pop("layout", "page_first")
    with opened(nvme(tmp_path), layout, **other) as ctrl:
        assert ctrl.backend.batch_exists([page_key(tokens, 0)]) == 0
        got = prefetch(ctrl, tokens)
        assert (got.hit_tokens, got.tokens) == (0, 0)


def test_an_mla_replica_stores_nothing_and_loads_what_the_writer_stored(
    tmp_path: Path,
) -> None:
    tokens = page_tokens(64, PAGE, seed=7)
    mla = {"is_mla_model": True}
    with opened(nvme(tmp_path), tp_rank=1, tp_size=2, storage_overrides=mla) as ctrl:
        assert not ctrl.storage_config.is_storage_writer
        keys = get_storage_hash_str(tokens, None, page_size=PAGE)
        assert ctrl.backend.batch_set_v1(keys, ctrl.host_pool.alloc(len(tokens))) == [True] * 64
        assert ctrl.backend.batch_exists(keys) == 0  # nothing stored
    with opened(nvme(tmp_path), tp_rank=0, tp_size=2, storage_overrides=mla) as ctrl:
        assert stored(ctrl, tokens) == 64 * PAGE  # the writer
    with opened(nvme(tmp_path), tp_rank=1, tp_size=2, storage_overrides=mla) as ctrl:
        got = prefetch(ctrl, tokens)  # the replica reads the writer's pages
        assert got.tokens == 64 * PAGE
        check_pages(ctrl.host_pool, got.host_indices, tokens)


def test_two_servers_share_one_redis_and_other_ranks_see_none_of_it(
    redis_server: LocalRedisServer,
) -> None:
    tokens = page_tokens(PAGES, PAGE, seed=8)
    with opened(redis(redis_server)) as writer, opened(redis(redis_server)) as reader:
        assert stored(writer, tokens) == PAGES * PAGE
        got = prefetch(reader, tokens)
        assert got.tokens == PAGES * PAGE
        check_pages(reader.host_pool, got.host_indices, tokens)
    with opened(redis(redis_server), tp_rank=1, tp_size=2) as other_rank:
        assert prefetch(other_rank, tokens).hit_tokens == 0


def test_the_classic_calls_serve_sglang_without_interface_v1(tmp_path: Path, layout: str) -> None:
    tokens = page_tokens(40, PAGE, seed=9)
    with opened(nvme(tmp_path, interface_v1=0), layout) as ctrl:
        log = record_calls(ctrl.backend)
        assert stored(ctrl, tokens) == 40 * PAGE
        got = prefetch(ctrl, tokens)
        assert got.tokens == 40 * PAGE
        check_pages(ctrl.host_pool, got.host_indices, tokens)
    assert log.sizes("batch_set") == log.sizes("batch_get") == [40]


def test_batch_exists_counts_the_leading_pages_held_whole(tmp_path: Path) -> None:
    tokens = page_tokens(20, PAGE, seed=10)
    keys = get_storage_hash_str(tokens, None, page_size=PAGE)
    with opened(nvme(tmp_path)) as ctrl:
        assert stored(ctrl, tokens) == 20 * PAGE
        storage = ctrl.backend
        assert storage.batch_exists(keys) == 20
        assert storage.batch_exists([*keys[:3], "absent", *keys[4:]]) == 3
        assert storage.exists(keys[0]) and not storage.exists("absent")
        corrupt_block(tmp_path, keys[2].encode() + b"/0")
        host = ctrl.host_pool.alloc(20 * PAGE)
        assert storage.batch_get_v1(keys, host) == [True, True, False, *[True] * 17]
        assert storage.batch_exists(keys) == 2  # the damaged page's run is gone


def test_stats_and_clear_do_what_sglang_expects(tmp_path: Path) -> None:
    tokens = page_tokens(PAGES, PAGE, seed=11)
    overrides = {"enable_storage_metrics": True}
    with opened(nvme(tmp_path), storage_overrides=overrides) as ctrl:
        assert stored(ctrl, tokens) == PAGES * PAGE
        stats = ctrl.backend.get_stats()
        assert stats.backup_pgs == [128, 128, 44] and all(v > 0 for v in stats.backup_bandwidth)
        assert ctrl.backend.get_stats().backup_pgs == []  # since the last call
        ctrl.backend.clear()
        assert prefetch(ctrl, tokens).hit_tokens == 0


def test_a_bad_tier_option_fails_sglang_s_attach_naming_it(tmp_path: Path) -> None:
    extra = dynamic_config(MODULE, "NVMeHiCacheStorage", interface_v1=1, root=str(tmp_path))
    with pytest.raises(InvalidArgumentError, match="capacity_bytes"), opened(extra):
        pass


def test_what_tiering_sglang_config_prints_runs_sglang_with_our_tier(tmp_path: Path) -> None:
    from sglang.srt.server_args import ServerArgs

    printed = subprocess.run(
        [sys.executable, "-m", "tiering", "sglang-config", str(tmp_path / "kv"),
         "--nvme-capacity", "1G"],
        capture_output=True, text=True, check=True, timeout=60,
    ).stdout  # fmt: skip
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = parser.parse_args(["--model-path", "org/model", *printed.split()])
    assert args.enable_hierarchical_cache and args.hicache_storage_backend == "dynamic"
    tokens = page_tokens(64, PAGE, seed=12)
    pool = make_host_pool(args.hicache_mem_layout, pages=200, **SHAPE)
    extra = json.loads(args.hicache_storage_backend_extra_config)
    with controller(pool, args.hicache_storage_backend, extra) as ctrl:
        assert type(ctrl.backend).__name__ == "NVMeHiCacheStorage"
        assert stored(ctrl, tokens) == 64 * PAGE
        got = prefetch(ctrl, tokens, policy=args.hicache_storage_prefetch_policy)
        assert got.tokens == 64 * PAGE
        check_pages(ctrl.host_pool, got.host_indices, tokens)
