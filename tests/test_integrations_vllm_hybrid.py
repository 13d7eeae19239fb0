"""A hybrid model's groups through our tiers under vLLM 0.33's own manager (issue 42).

The model has a full-attention group, a sliding-window group and a Mamba group, with
group indices 0, 1 and 3 (group 2 is one vLLM does not offload, e.g. not prefix
cacheable; ``get_offloading_group_ids`` skips it, so the indices keep the gap). The
group configs are vLLM's own: ``OffloadingGroupConfig`` with the window that vLLM's
``get_sliding_window_size_in_chunks`` computes from real ``SlidingWindowSpec`` and
``MambaSpec`` objects (both build on CPU: a 32-token window is 2 chunks of 16 tokens, a
Mamba group keeps 1). vLLM names each block ``make_offload_key(block_hash, group_idx)``;
its connector scheduler stores only the tail ``sliding_window_size_in_chunks`` chunks of
a windowed group, which :func:`hybrid_blocks` plays.
"""

from __future__ import annotations

import hashlib
import threading
from collections import Counter
from pathlib import Path

import pytest

from tests._vllm_harness import (  # skips the module without vLLM (fails in CI)
    MODULE,
    LookupResult,
    ReqContext,
    Scheduler,
    nvme_tier,
    payload,
)

# isort: split
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import (
    get_sliding_window_size_in_chunks,
)
from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec
from vllm.v1.kv_offload.base import get_offload_group_idx, make_offload_key
from vllm.v1.kv_offload.config import OffloadingGroupConfig

from tiering.integrations.vllm import MemoryTierManager, NVMeTierManager

TOKENS_PER_CHUNK = 16  # tokens_per_block 16, blocks_per_chunk 1 (the harness's cache)
PRIMARY = 8  # CPU chunks: a request's 7 hybrid keys fit, 8 fillers evict them all
HASHES = 4  # block hashes of one request


def _group(spec, layers: tuple[str, ...], group_id: int) -> OffloadingGroupConfig:
    return OffloadingGroupConfig(
        TOKENS_PER_CHUNK,
        layers,
        group_id,
        get_sliding_window_size_in_chunks(spec, TOKENS_PER_CHUNK),
    )


_KV = {"block_size": TOKENS_PER_CHUNK, "num_kv_heads": 1, "head_size": 64, "dtype": torch.float16}
GROUPS = (
    _group(FullAttentionSpec(**_KV), ("layers.0", "layers.2"), 0),
    _group(SlidingWindowSpec(**_KV, sliding_window=32), ("layers.1",), 1),
    _group(
        MambaSpec(block_size=TOKENS_PER_CHUNK, shapes=((4, 4),), dtypes=(torch.float16,)),
        ("layers.3",),
        3,
    ),
)
WINDOWS = {g.group_id: g.sliding_window_size_in_chunks for g in GROUPS}


def block_hash(text: str) -> bytes:
    return hashlib.sha256(text.encode()).digest()


def hybrid_blocks(prefix: str, groups: tuple[int, ...] = (0, 1, 3)) -> dict[bytes, bytes]:
    """One request's keys in ``groups``, as vLLM's scheduler offloads them: every hash
    of a full group, the tail window of the others; each key's payload its own."""
    hashes = [block_hash(f"{prefix}{i}") for i in range(HASHES)]
    out: dict[bytes, bytes] = {}
    for g in groups:
        window = WINDOWS[g]
        for h in hashes if window is None else hashes[-window:]:
            k = make_offload_key(h, g)
            out[k] = payload(k)
    return out


def evict_all(s: Scheduler, stored: dict[bytes, bytes]) -> None:
    s.settle()
    s.store(
        {make_offload_key(block_hash(f"filler{i}"), 0): bytes(s.stride) for i in range(PRIMARY)}
    )
    s.settle()
    assert not any(s.in_primary(k) for k in stored)


@pytest.fixture
def scheduler(tmp_path: Path):
    made: list[Scheduler] = []

    def make(*tiers: dict, **config) -> Scheduler:
        tiers_ = list(tiers) or [nvme_tier(tmp_path / "nvme")]
        s = Scheduler(PRIMARY, tiers_, groups=GROUPS, **config)
        made.append(s)
        return s

    yield make
    for s in made:
        s.shutdown()
    assert [t.name for t in threading.enumerate() if t.name.startswith("kv-tiering-")] == []


def test_vllm_gives_the_hybrid_groups_their_windows() -> None:
    assert WINDOWS == {0: None, 1: 2, 3: 1}
    stored = hybrid_blocks("x")
    assert Counter(get_offload_group_idx(k) for k in stored) == {0: 4, 1: 2, 3: 1}


@pytest.mark.parametrize("kind", ["nvme", "memory"])
def test_each_group_gets_its_own_bytes_back_after_cpu_eviction(scheduler, tmp_path, kind) -> None:
    memory = {"type": "MemoryTierManager", "module_path": MODULE, "max_blocks": 64}
    s = scheduler(nvme_tier(tmp_path / "nvme") if kind == "nvme" else memory)
    stored = hybrid_blocks("a")
    last = block_hash(f"a{HASHES - 1}")  # in all three groups, with three payloads
    assert len({stored[make_offload_key(last, g)] for g in (0, 1, 3)}) == 3
    s.store(stored)
    evict_all(s, stored)

    answers = s.resolve(stored)

    assert all(answers[k] is LookupResult.HIT for k in stored)
    assert s.read(list(stored)) == stored
    assert isinstance(s.tier, NVMeTierManager if kind == "nvme" else MemoryTierManager)


def test_a_hash_stored_in_one_group_misses_in_a_group_never_stored(scheduler) -> None:
    s = scheduler()
    stored = hybrid_blocks("b", groups=(0, 3))  # the sliding-window group stores nothing
    s.store(stored)
    evict_all(s, stored)
    hashes = [block_hash(f"b{i}") for i in range(HASHES)]
    never = [make_offload_key(h, 1) for h in hashes] + [make_offload_key(h, 3) for h in hashes[:-1]]

    answers = s.resolve([*stored, *never])

    assert all(answers[k] is LookupResult.HIT for k in stored)
    assert all(answers[k] is LookupResult.MISS for k in never)
    probe = ReqContext(req_id="probe")
    assert all(s.tier.lookup(k, probe) is LookupResult.MISS for k in never)
    assert s.read(list(stored)) == stored


def test_events_name_each_stored_key_with_its_own_group(scheduler, tmp_path) -> None:
    s = scheduler(nvme_tier(tmp_path / "nvme", enable_kv_events=True), events=True)
    stored = hybrid_blocks("e")
    s.store(stored)
    s.settle()

    events = list(s.tier.take_events())

    assert events and all(not e.removed and e.ownership == s.tier.tier_type for e in events)
    keys = [k for e in events for k in e.keys]
    assert sorted(keys) == sorted(stored)
    assert Counter(get_offload_group_idx(k) for k in keys) == {0: 4, 1: 2, 3: 1}


def test_a_new_manager_on_the_same_root_starts_warm_for_every_group(scheduler) -> None:
    first = scheduler()
    stored = hybrid_blocks("w")
    first.store(stored)
    first.settle()
    first.shutdown()

    second = scheduler()
    hashes = [block_hash(f"w{i}") for i in range(HASHES)]
    heads = [make_offload_key(h, 1) for h in hashes[:2]] + [make_offload_key(hashes[0], 3)]
    answers = second.resolve([*stored, *heads])

    assert all(answers[k] is LookupResult.HIT for k in stored)
    assert all(answers[k] is LookupResult.MISS for k in heads)  # never stored: tails only
    assert second.read(list(stored)) == stored
