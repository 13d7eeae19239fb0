"""A hybrid model's state through our tiers as SGLang 0.5.23's HiCache storage (its v2
calls), driven by SGLang's own ``HybridCacheController`` and host pools on CPU
(tests/_sglang_harness.py): attention + Mamba (a state per radix node, ``trailing_pages``
of 1), attention + sliding window (the window's pages, ``trailing_pages`` of 4), and a
pool indexed like the KV (``all_pages``); 300 pages in six nodes, byte-exact, through
the NVMe, Redis and memory tiers; damaged and missing state, a restart, two TP ranks.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from tests._engine_helpers import corrupt_block
from tests._redis_helpers import client_of, damage_payload
from tests._redis_servers import LocalRedisServer
from tests._sglang_harness import (  # skips the module without SGLang (fails in CI)
    Controller,
    Prefetched,
    backup,
    check_pages,
    check_states,
    controller,
    dynamic_config,
    evict,
    fill_pages,
    fill_states,
    make_host_pool,
    make_mamba_pool,
    page_tokens,
    prefetch,
    record_calls,
    state_transfer,
)
from tiering.errors import InvalidArgumentError
from tiering.integrations.sglang_pools import PageChunks

from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName  # isort: skip
from sglang.srt.mem_cache.hicache_storage import PoolTransfer  # isort: skip
from sglang.srt.mem_cache.utils import get_storage_hash_str  # isort: skip

MODULE = "tiering.integrations.sglang"
PAGE = 16
NODE = 50  # pages per radix node
NODES = 6
PAGES = NODE * NODES
SHAPE = {"page_size": PAGE, "layers": 2, "heads": 2, "head_dim": 8}
WINDOW = 4  # the sliding window, in pages
SWA_TAIL = 8  # the pages of each node whose sliding-window KV the node keeps


@dataclass(frozen=True)
class Model:
    """A hybrid model shape: its state pool's name, how a node's state is kept (the
    node's last ``tail`` pages; 0: every page, in the KV's own slots) and the window
    a prefetch asks for."""

    pool: str
    policy: str
    tail: int
    window: int
    temporal: tuple[int, ...] = (2, 4, 8)  # a Mamba layer's SSM state

    def make_pool(self) -> Any:
        if self.pool == "mamba":
            return make_mamba_pool(slots=40, layers=2, temporal=self.temporal)
        pages = 2 * PAGES + 8 if self.tail == 0 else 64  # "indexer": the KV's slots
        return make_host_pool("page_first", pages=pages, page_size=PAGE, layers=1, heads=1,
                              head_dim=8)  # fmt: skip

    def placeholder(self) -> PoolTransfer:
        if self.tail == 0:  # a pool indexed like the KV: loaded with each KV batch
            return PoolTransfer(
                name=PoolName(self.pool),
                hit_policy=PoolHitPolicy(self.policy),
                indices_from_pool=PoolName.KV,
            )
        return state_transfer(self.pool, ["__placeholder__"] * self.window, policy=self.policy)


MAMBA = Model("mamba", "trailing_pages", tail=1, window=1)
# A state row of 8 KiB, eight times a KV run (1 KiB): stored in pieces of a run each.
WIDE_MAMBA = Model("mamba", "trailing_pages", tail=1, window=1, temporal=(4, 16, 16))
SWA = Model("swa", "trailing_pages", tail=SWA_TAIL, window=WINDOW)
INDEXER = Model("indexer", "all_pages", tail=0, window=0)


def nvme(root: Path, **options: Any) -> dict[str, Any]:
    options = {"interface_v1": 1, "root": str(root), "capacity_bytes": 1 << 30, **options}
    return dynamic_config(MODULE, "NVMeHiCacheStorage", **options)


def redis(server: LocalRedisServer, **options: Any) -> dict[str, Any]:
    return dynamic_config(MODULE, "RedisHiCacheStorage", interface_v1=1, url=server.url, **options)


@contextmanager
def opened(model: Model, extra: dict[str, Any], **kw: Any) -> Iterator[Controller]:
    """SGLang's hybrid controller with our backend over a KV and a state host pool."""
    kv = make_host_pool("page_first", pages=2 * PAGES + 8, **SHAPE)
    with controller(kv, "dynamic", extra, sidecars={model.pool: model.make_pool()}, **kw) as ctrl:
        yield ctrl


def state_pool(ctrl: Controller, model: Model) -> Any:
    return ctrl.sglang.mem_pool_host.entry_map[PoolName(model.pool)].host_pool


def chain(tokens: Sequence[int]) -> list[str]:
    """SGLang's page keys of ``tokens`` (its hash chain)."""
    return get_storage_hash_str(list(tokens), None, page_size=PAGE)


def store_nodes(
    ctrl: Controller,
    model: Model,
    tokens: list[int],
    *,
    tag: str = "r0",
    states: Sequence[int] = (),
) -> None:
    """Back ``tokens`` up as SGLang's radix cache backs up its nodes of ``NODE`` pages:
    each node's KV pages and its state (only the nodes ``states`` keep one, all if
    empty), filled with bytes of their own, then evicted from host memory."""
    keys, pool, written = chain(tokens), state_pool(ctrl, model), []
    for node in range(len(keys) // NODE):
        first, last = node * NODE, (node + 1) * NODE
        kv = ctrl.host_pool.alloc(NODE * PAGE)
        fill_pages(ctrl.host_pool, kv, tokens[first * PAGE : last * PAGE])
        extra, state = [], None
        if not states or node in states:
            if model.tail == 0:  # indexed like the KV: its pages sit in the KV's slots
                fill_states(pool, kv, keys[first:last], tag)
                extra = [PoolTransfer(name=PoolName(model.pool), indices_from_pool=PoolName.KV,
                                      hit_policy=PoolHitPolicy(model.policy))]  # fmt: skip
            else:
                state_keys = keys[last - model.tail : last]
                state = pool.alloc(model.tail * pool.page_size)
                fill_states(pool, state, state_keys, tag)
                extra = [state_transfer(model.pool, state_keys, state, model.policy)]
        prior = keys[first - 1] if first else None
        tokens_of_node = tokens[first * PAGE : last * PAGE]
        written.append(backup(ctrl, kv, tokens_of_node, prior_hash=prior, extra_pools=extra))
        evict(ctrl, kv)
        if state is not None:
            pool.free(state)
    return written


def fetch(ctrl: Controller, model: Model, tokens: list[int], **kw: Any) -> Prefetched:
    return prefetch(ctrl, tokens, extra_pools=[model.placeholder()], **kw)


def check_fetched(
    ctrl: Controller, model: Model, got: Prefetched, tokens: list[int], tag: str
) -> None:
    """The KV pages and the state SGLang loaded hold exactly what was stored."""
    check_pages(ctrl.host_pool, got.host_indices, tokens[: got.tokens])
    keys, pool = chain(tokens), state_pool(ctrl, model)
    if model.tail == 0:
        check_states(pool, got.host_indices, keys[: got.tokens // PAGE], tag)
        return
    state = got.states[model.pool]
    assert state.keys == keys[got.tokens // PAGE - len(state.keys) : got.tokens // PAGE]
    check_states(pool, state.host_indices, state.keys, tag)


def expected_restorable(model: Model, stored: set[int], pages: int) -> list[int]:
    """The prefix lengths SGLang's hit policy allows when the state pool holds the
    pages ``stored`` (an independent reading of SGLang's definition)."""
    if model.policy == "all_pages":
        end = next((p for p in range(pages) if p not in stored), pages)
        return list(range(1, end + 1))
    return [p for p in range(1, pages + 1)
            if all(i in stored for i in range(max(0, p - model.window), p))]  # fmt: skip


def state_pages(model: Model, nodes: Sequence[int] = range(NODES)) -> set[int]:
    """The pages whose state the nodes ``nodes`` keep."""
    if model.tail == 0:
        return {p for node in nodes for p in range(node * NODE, (node + 1) * NODE)}
    return {p for node in nodes for p in range((node + 1) * NODE - model.tail, (node + 1) * NODE)}


@pytest.fixture(params=["nvme", "redis", "memory"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> dict[str, Any]:
    if request.param == "nvme":
        return nvme(tmp_path / "kv")
    if request.param == "memory":  # room for every part's blocks: 300 pages of 2 runs
        return dynamic_config(MODULE, "MemoryHiCacheStorage", interface_v1=1, max_blocks=1024)
    return redis(request.getfixturevalue("redis_server"))


@pytest.mark.parametrize(
    "model", [MAMBA, WIDE_MAMBA, SWA, INDEXER], ids=["mamba", "wide-mamba", "swa", "indexer"]
)
def test_a_hybrid_prefix_comes_back_with_its_state_byte_exact(
    backend: dict[str, Any], model: Model
) -> None:
    tokens = page_tokens(PAGES, PAGE, seed=20)
    with opened(model, backend) as ctrl:
        log = record_calls(ctrl.backend, ("batch_set_v2", "batch_get_v2", "batch_exists_v2"))
        assert store_nodes(ctrl, model, tokens) == [NODE * PAGE] * NODES
        got = fetch(ctrl, model, tokens)
        assert got.hit_tokens == got.tokens == PAGES * PAGE and got.usable
        check_fetched(ctrl, model, got, tokens, "r0")
    assert log.sizes("batch_exists_v2") == [PAGES]  # the whole query in one call
    if model.tail:  # a node's state pages in one call; the window's in one
        assert log.sizes("batch_set_v2") == [model.tail] * NODES
        assert log.sizes("batch_get_v2") == [model.window]
    else:  # a pool indexed like the KV: a whole node's pages, then with each KV batch
        assert log.sizes("batch_set_v2") == [NODE] * NODES
        assert log.sizes("batch_get_v2") == [128, 128, 44, 0]


@pytest.mark.parametrize("model", [MAMBA, SWA, INDEXER], ids=lambda m: m.pool)
def test_a_prefix_is_a_hit_exactly_where_the_policy_finds_its_state(
    tmp_path: Path, model: Model
) -> None:
    tokens = page_tokens(PAGES, PAGE, seed=21)
    kept = (0, 1, 2, 4)  # nodes 3 and 5 kept no state
    keys = chain(tokens)
    with opened(model, nvme(tmp_path)) as ctrl:
        store_nodes(ctrl, model, tokens, states=kept)
        result = ctrl.backend.batch_exists_v2(keys, [model.placeholder()])
        restorable = expected_restorable(model, state_pages(model, kept), PAGES)
        assert result.restorable_prefix_pages == restorable
        assert result.kv_hit_pages == restorable[-1] == (150 if model.tail == 0 else 250)
        got = fetch(ctrl, model, tokens)  # SGLang fetches the usable prefix, whole
        assert got.tokens == restorable[-1] * PAGE and got.usable
        check_fetched(ctrl, model, got, tokens, "r0")


def test_a_prompt_past_the_stored_prefix_resumes_at_the_last_node_with_state(
    tmp_path: Path,
) -> None:
    tokens = page_tokens(PAGES + 20, PAGE, seed=22)
    with opened(MAMBA, nvme(tmp_path)) as ctrl:
        store_nodes(ctrl, MAMBA, tokens[: PAGES * PAGE])
        got = fetch(ctrl, MAMBA, tokens)
        assert got.tokens == PAGES * PAGE and got.usable
        check_fetched(ctrl, MAMBA, got, tokens, "r0")


def test_a_damaged_state_is_never_served_and_shortens_the_next_hit(tmp_path: Path) -> None:
    tokens = page_tokens(PAGES, PAGE, seed=23)
    keys = chain(tokens)
    with opened(MAMBA, nvme(tmp_path)) as ctrl:
        store_nodes(ctrl, MAMBA, tokens)
        corrupt_block(namespace_dir(tmp_path, '"part":{"buffer":0,'), keys[-1].encode() + b"/0")
        got = fetch(ctrl, MAMBA, tokens)
        assert got.pool_hits.get("mamba", 0) == 0 and not got.usable  # SGLang drops it
        evict(ctrl, got.host_indices)
        state_pool(ctrl, MAMBA).free(got.states["mamba"].host_indices)
        again = fetch(ctrl, MAMBA, tokens, request_id="again")
        assert again.tokens == (PAGES - NODE) * PAGE and again.usable
        check_fetched(ctrl, MAMBA, again, tokens, "r0")


def test_a_damaged_state_on_redis_is_never_served(redis_server: LocalRedisServer) -> None:
    tokens = page_tokens(PAGES, PAGE, seed=24)
    keys = chain(tokens)
    with opened(SWA, redis(redis_server)) as ctrl:
        store_nodes(ctrl, SWA, tokens)
        client = client_of(redis_server)
        try:  # the last window page's SWA KV; the KV page of that key stays whole
            names = [n for n in client.keys("*") if n.endswith(keys[-1].encode() + b"/0")]
            sizes = {n: client.strlen(n) for n in names}
            damage_payload(client, min(names, key=sizes.__getitem__))  # the SWA page is smaller
        finally:
            client.close()
        got = fetch(ctrl, SWA, tokens)
        assert got.pool_hits.get("swa", 0) < WINDOW and not got.usable


def test_a_restarted_server_serves_the_state_the_last_one_stored(tmp_path: Path) -> None:
    tokens = page_tokens(PAGES, PAGE, seed=25)
    with opened(MAMBA, nvme(tmp_path)) as ctrl:
        store_nodes(ctrl, MAMBA, tokens)
    with opened(MAMBA, nvme(tmp_path)) as ctrl:  # a new process: new host pools, new tiers
        got = fetch(ctrl, MAMBA, tokens)
        assert got.tokens == PAGES * PAGE and got.usable
        check_fetched(ctrl, MAMBA, got, tokens, "r0")


def test_a_state_row_longer_than_a_kv_run_is_cut_into_pieces_of_a_run() -> None:
    pool = WIDE_MAMBA.make_pool()
    temporal = pool.kv_buffer[0]
    row = temporal[0].numel() * temporal.element_size()
    pieces = PageChunks(pool, temporal, piece_bytes=1024)
    assert row == 8192 and (pieces.chunks, pieces.chunk_bytes) == (8, 1024)
    slots = pieces.slots(torch.tensor([3]), 1)  # slot 3's row, piece by piece, in order
    assert [s * 1024 for s in slots] == list(range(3 * row, 4 * row, 1024))
    assert PageChunks(pool, temporal).chunks == 1  # uncut without a piece size


@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
def test_two_tp_ranks_each_get_their_own_state(tmp_path: Path, mla: bool) -> None:
    """Each rank keeps its own Mamba shard; under MLA only rank 0 writes the KV, which
    both ranks share. Rank 1 keeps no state for the last node: SGLang intersects the
    ranks' restorable lengths, so both resume one node earlier."""
    tokens = page_tokens(PAGES, PAGE, seed=26)
    keys = chain(tokens)
    overrides = {"is_mla_model": mla}
    results = []
    for rank in (0, 1):
        kept = range(NODES) if rank == 0 else range(NODES - 1)
        with opened(MAMBA, nvme(tmp_path), tp_rank=rank, tp_size=2,
                    storage_overrides=overrides) as ctrl:  # fmt: skip
            written = store_nodes(ctrl, MAMBA, tokens, tag=f"r{rank}", states=kept)
            # a rank that writes no KV (MLA) backs up what it has: a node's state
            full = rank == 0 or not mla or kept == range(NODES)
            assert written == [NODE * PAGE] * (NODES if full else NODES - 1) + [0] * (not full)
            results.append(ctrl.backend.batch_exists_v2(keys, [MAMBA.placeholder()]))
    assert results[0].kv_hit_pages == PAGES and results[1].kv_hit_pages == PAGES - NODE
    agreed = set(results[0].restorable_prefix_pages) & set(results[1].restorable_prefix_pages)
    assert max(agreed) == PAGES - NODE
    for rank in (0, 1):
        with opened(MAMBA, nvme(tmp_path), tp_rank=rank, tp_size=2,
                    storage_overrides=overrides) as ctrl:  # fmt: skip
            got = fetch(ctrl, MAMBA, tokens[: max(agreed) * PAGE])
            assert got.tokens == max(agreed) * PAGE and got.usable
            check_fetched(ctrl, MAMBA, got, tokens, f"r{rank}")


def test_block_groups_report_their_leading_whole_blocks_and_gate_nothing(tmp_path: Path) -> None:
    tokens = page_tokens(PAGES, PAGE, seed=27)
    keys = chain(tokens)
    with opened(INDEXER, nvme(tmp_path)) as ctrl:
        store_nodes(ctrl, INDEXER, tokens, states=(0, 1, 2, 4))
        groups = PoolTransfer(name=PoolName.INDEXER, hit_policy=PoolHitPolicy.BLOCK_GROUPS,
                              block_pages=32, group_pages=1)  # fmt: skip
        result = ctrl.backend.batch_exists_v2(keys, [groups])
        assert result.kv_hit_pages == PAGES
        assert result.extra_pool_hit_pages == {"kv": PAGES, "indexer": 128}  # 4 blocks of 32


def test_a_state_pool_registered_late_is_not_served(tmp_path: Path) -> None:
    tokens = page_tokens(NODE, PAGE, seed=28)
    keys = chain(tokens)
    with opened(MAMBA, nvme(tmp_path)) as ctrl:
        store_nodes(ctrl, MAMBA, tokens)
        late = make_host_pool("page_first", pages=64, page_size=PAGE, layers=1, heads=1, head_dim=8)
        ctrl.backend.register_mem_host_pool_v2(late, PoolName.SWA)
        swa = state_transfer("swa", ["__placeholder__"] * WINDOW)
        assert ctrl.backend.batch_exists_v2(keys, [MAMBA.placeholder(), swa]).kv_hit_pages == 0
        indices = late.alloc(WINDOW * PAGE)
        transfer = state_transfer("swa", keys[-WINDOW:], indices)
        assert ctrl.backend.batch_get_v2([transfer]) == {"swa": [False] * WINDOW}


def test_the_capacity_is_split_over_the_pools_by_their_shares(tmp_path: Path) -> None:
    extra = nvme(tmp_path, capacity_bytes=1 << 30, pool_shares={"kv": 3, "mamba": 1})
    with opened(MAMBA, extra) as ctrl:
        stores = ctrl.backend._stores
        capacities = {name: [t.tier.capacity_bytes for _, t in s.parts]
                      for name, s in stores.items()}  # fmt: skip
    assert capacities["kv"] == [3 << 28]
    assert sum(capacities["mamba"]) <= 1 << 28 and len(capacities["mamba"]) == 3


def test_a_mamba_pool_sglang_gives_no_addresses_for_fails_sglang_s_attach(tmp_path: Path) -> None:
    kv = make_host_pool("page_first", pages=64, **SHAPE)
    sidecars = {"mamba": make_mamba_pool(slots=8, layers=2, side_states=[(5,)])}
    refused = pytest.raises(InvalidArgumentError, match=r"MambaPoolHost.*side states")
    with refused, controller(kv, "dynamic", nvme(tmp_path), sidecars=sidecars):
        pass


@pytest.mark.parametrize(
    "shares", [{"mamba": 0}, {"mambaa": 1}, ["kv"]], ids=["zero", "typo", "list"]
)
def test_bad_pool_shares_fail_sglang_s_attach_naming_them(tmp_path: Path, shares: Any) -> None:
    with (
        pytest.raises(InvalidArgumentError, match="pool_shares"),
        opened(MAMBA, nvme(tmp_path, pool_shares=shares)),
    ):
        pass


def namespace_dir(root: Path, marker: str) -> Path:
    """The NVMe namespace directory under ``root`` whose namespace holds ``marker``."""
    found = [p.parent for p in root.rglob("NAMESPACE")
             if marker in json.loads(p.read_text())["namespace"]]  # fmt: skip
    assert len(found) == 1, f"{len(found)} namespaces under {root} hold {marker!r}"
    return found[0]
