"""Tenant isolation (tiering.security.tenancy and the engine's ``tenant`` argument, issue 14): a
tenant never hits, loads or times another tenant's blocks, except the leading blocks of
prefixes shared on purpose."""

from __future__ import annotations

import asyncio
import urllib.request
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests._engine_helpers import corrupt_block, make_kv
from tiering import TieringEngine, tenant_keys, tenant_label
from tiering.errors import BlockNotFoundError, InvalidArgumentError
from tiering.hashing import block_hashes
from tiering.lab.replay import replay
from tiering.lab.workloads import synthetic_requests
from tiering.observe.events import encode_events
from tiering.observe.metrics import serve_engine_metrics
from tiering.security.tenancy import Tenancy
from tiering.validation import hash_list

PROMPT = block_hashes(list(range(64)), 16)  # four blocks
SYSTEM = PROMPT[:2]


def device(kv: list[torch.Tensor], blocks: range | list[int]) -> list[bytes]:
    """Each device block's bytes, over every layer."""
    return [b"".join(layer[i].view(torch.uint8).numpy().tobytes() for layer in kv) for i in blocks]


async def test_two_tenants_sending_one_prompt_never_see_each_others_blocks() -> None:
    kv = make_kv(16)
    async with TieringEngine(kv, 8) as engine:
        assert (await engine.store(PROMPT, range(4), tenant="alice")).success
        assert engine.lookup(PROMPT, tenant="alice") == 4
        assert engine.lookup(PROMPT, tenant="bob") == 0
        assert engine.lookup(PROMPT) == 0  # nor do untenanted calls
        with pytest.raises(BlockNotFoundError):
            engine.load(PROMPT[:1], [8], tenant="bob")
        assert (await engine.store(PROMPT, range(4, 8), tenant="bob")).success
        assert (await engine.load(PROMPT, range(8, 12), tenant="alice")).success
        assert (await engine.load(PROMPT, range(12, 16), tenant="bob")).success
    assert device(kv, range(8, 12)) == device(kv, range(4)) != device(kv, range(4, 8))
    assert device(kv, range(12, 16)) == device(kv, range(4, 8))


async def test_a_shared_prefix_is_hit_by_every_tenant_and_the_rest_is_not() -> None:
    kv = make_kv(16)
    async with TieringEngine(kv, 8, shared_blocks=SYSTEM[:1]) as engine:
        engine.share_prefix(SYSTEM[1:])
        assert (await engine.store(PROMPT, range(4), tenant="alice")).success
        assert engine.lookup(PROMPT, tenant="bob") == 2
        assert engine.lookup(PROMPT) == 2
        assert (await engine.load(PROMPT[:2], [8, 9], tenant="bob")).success
    assert device(kv, [8, 9]) == device(kv, [0, 1])


def test_a_shared_block_after_a_tenant_block_is_the_tenants() -> None:
    private = block_hashes(list(range(100, 132)), 16)
    keys = tenant_keys([private[0], SYSTEM[0]], "alice", shared_blocks=SYSTEM)
    assert keys[1] != SYSTEM[0]  # only *leading* shared blocks keep their hash
    assert tenant_keys(SYSTEM, "alice", shared_blocks=SYSTEM) == SYSTEM
    assert tenant_keys(PROMPT, None) == PROMPT


def test_tenant_keys_are_stable_distinct_and_hide_the_tenant() -> None:
    alice, bob = tenant_keys(PROMPT, "alice"), tenant_keys(PROMPT, "bob")
    assert alice == tenant_keys(PROMPT, "alice")
    assert len(set(alice) | set(bob) | set(PROMPT)) == 12
    assert all(len(k) == 32 and b"alice" not in k for k in alice)
    assert tenant_label("alice") == tenant_label("alice") != tenant_label("bob")
    assert "alice" not in tenant_label("alice") and len(tenant_label("alice")) == 16


async def test_results_name_the_callers_hashes(tmp_path: Path) -> None:
    kv = make_kv(16)
    tiers = [{"type": "nvme", "root": tmp_path / "nvme", "capacity_bytes": 1 << 24}]
    async with TieringEngine(kv, 4, secondary_tiers=tiers) as engine:
        job = engine.store(PROMPT, range(4), tenant="alice")
        assert (await job).success and await job.cascaded
        other = block_hashes(list(range(500, 564)), 16)
        assert (await engine.store(other, range(4, 8), tenant="alice")).success  # evicts
        assert engine.lookup(PROMPT, tenant="alice") == 4  # now from the NVMe tier
        corrupt_block(tmp_path / "nvme", engine.tenant_keys(PROMPT, "alice")[2])
        result = await engine.load(PROMPT, range(8, 12), tenant="alice")
    assert not result.success and result.failed_keys == (PROMPT[2],)


@pytest.mark.parametrize("tenant", ["", "x" * 257, 7, b"alice"])
async def test_a_bad_tenant_is_refused_naming_it_and_nothing_changes(tenant: object) -> None:
    async with TieringEngine(make_kv(8), 4) as engine:
        for call in (
            lambda: engine.store(PROMPT[:1], [0], tenant=tenant),  # type: ignore[arg-type]
            lambda: engine.lookup(PROMPT, tenant=tenant),  # type: ignore[arg-type]
            lambda: engine.touch(PROMPT, tenant=tenant),  # type: ignore[arg-type]
        ):
            with pytest.raises(InvalidArgumentError, match="tenant must be None or a string"):
                call()
        assert engine.statistics().used_blocks == 0
        with pytest.raises(InvalidArgumentError, match="block_hashes must hold bytes"):
            engine.share_prefix(["text"])  # type: ignore[list-item]


async def test_events_and_metrics_never_carry_the_tenant_id() -> None:
    async with TieringEngine(make_kv(8), 4, enable_events=True) as engine:
        assert (await engine.store(PROMPT, range(4), tenant="alice@example.com")).success
        engine.lookup(PROMPT, tenant="alice@example.com")
        engine.lookup(PROMPT, tenant="bob@example.com")
        events = encode_events(engine.take_events()).decode()
        stats = engine.tenant_statistics()
        with serve_engine_metrics(engine, 0) as metrics:
            url = f"http://127.0.0.1:{metrics.port}/metrics"
            text = await asyncio.to_thread(lambda: urllib.request.urlopen(url).read().decode())
    assert "example.com" not in events + text + repr(stats)
    assert PROMPT[0].hex() not in events  # events name the tenant's keys
    assert engine.tenant_keys(PROMPT, "alice@example.com")[0].hex() in events
    alice, bob = tenant_label("alice@example.com"), tenant_label("bob@example.com")
    assert (stats[alice].blocks, stats[alice].hit_blocks) == (4, 4)
    assert (stats[bob].blocks, stats[bob].hit_blocks) == (4, 0)
    assert f'kv_tiering_tenant_lookup_hit_blocks_total{{tenant="{alice}"}} 4.0' in text


async def test_a_replay_of_two_tenants_with_identical_prompts_has_no_cross_tenant_hit(
    tmp_path: Path,
) -> None:
    requests = synthetic_requests(sessions=40, seed=5)
    tiers = [{"type": "nvme", "root": tmp_path / "nvme", "capacity_bytes": 1 << 26}]

    def engine(kv: torch.Tensor) -> TieringEngine:
        return TieringEngine(kv, 48, secondary_tiers=tiers)

    summary = await replay(requests, engine, device_blocks=64, block_bytes=1024, tenants=2)
    assert summary.requests == 2 * len(requests) and summary.tenants == 2
    assert summary.hit_blocks > 0  # each tenant hits on its own earlier prompts
    assert summary.cross_tenant_hits == 0 and summary.mismatches == 0


class _SharingEngine(TieringEngine):
    """An engine whose tenants all share one key space: what isolation prevents."""

    def tenant_keys(self, block_hashes, tenant=None):  # type: ignore[no-untyped-def]
        return hash_list("block_hashes", block_hashes)


async def test_the_replay_counts_cross_tenant_hits_when_isolation_is_missing() -> None:
    requests = synthetic_requests(sessions=40, seed=5)
    summary = await replay(
        requests, lambda kv: _SharingEngine(kv, 48), device_blocks=64, block_bytes=1024, tenants=2
    )
    assert summary.cross_tenant_hits > 0


hashes = st.lists(st.binary(min_size=1, max_size=40), min_size=0, max_size=12)


@settings(max_examples=200, deadline=None)
@given(
    calls=hashes,
    shared=hashes,
    tenants=st.lists(st.text(min_size=1, max_size=8), min_size=2, max_size=2, unique=True),
)
def test_only_the_leading_shared_blocks_are_common_to_tenants(
    calls: list[bytes], shared: list[bytes], tenants: list[str]
) -> None:
    tenancy = Tenancy(shared)
    a, b = (list(tenancy.keys(calls, t)) for t in tenants)
    common = next((i for i, h in enumerate(calls) if h not in set(shared)), len(calls))
    assert a[:common] == b[:common] == calls[:common]
    assert not set(a[common:]) & set(b[common:])  # nothing else in common
    assert not set(a[common:]) & set(calls)  # nor with untenanted calls
    assert a == list(tenancy.keys(calls, tenants[0]))  # stable
