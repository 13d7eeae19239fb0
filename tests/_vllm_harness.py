"""vLLM 0.33's own tiering manager on CPU, with the test playing vLLM's scheduler.

vLLM's ``TieringOffloadingManager`` runs unpatched: its CPU primary tier (a shared
region in /dev/shm), its factory building our tier from a plain config dict, its
cascade, eviction and promotion logic. Only the GPU worker cannot run without CUDA, so
:class:`Scheduler` writes and reads the primary view at the chunk ids vLLM hands out,
and makes the connector scheduler's manager calls in the same order, under the same
lock.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import os
import time
from collections.abc import Iterable, Mapping
from typing import Any

import pytest

os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # keep stdout clean

if os.environ.get("KV_TIERING_REQUIRE_VLLM") == "1":  # CI: a missing vLLM is a failure
    import vllm.v1.kv_offload.tiering.manager  # noqa: F401
else:
    pytest.importorskip("vllm.v1.kv_offload.tiering.manager")

from vllm.v1.kv_offload import config as vconfig
from vllm.v1.kv_offload.base import (
    LookupResult,
    ReqContext,
    ScheduleEndContext,
    make_offload_key,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.factory import OffloadingSpecFactory
from vllm.v1.kv_offload.tiering.base import TransferJob

__all__ = ["LookupResult", "ReqContext", "TransferJob"]  # for the tests, after the skip

CHUNK_BYTES = 8192
MODULE = "tiering.integrations.vllm"
SETTLE_S = 30.0
_engine_ids = itertools.count()


def key(text: str) -> bytes:
    """An offload key as vLLM makes one: a 32-byte block hash and group 0."""
    return make_offload_key(hashlib.sha256(text.encode()).digest(), 0)


def payload(k: bytes, size: int = CHUNK_BYTES) -> bytes:
    """Bytes that belong to ``k`` alone."""
    seed = hashlib.sha256(k).digest()
    return (seed * (size // len(seed) + 1))[:size]


def offloading_config(
    chunks: int,
    tiers: list[dict[str, Any]],
    *,
    model: str = "org/model",
    chunk_bytes: int = CHUNK_BYTES,
    events: bool = False,
    groups: tuple[vconfig.OffloadingGroupConfig, ...] | None = None,
) -> vconfig.OffloadingConfig:
    """A model whose chunk is ``chunk_bytes``, ``chunks`` in the CPU tier: one
    full-attention group, or ``groups`` (vLLM's own group configs, e.g. a hybrid's)."""
    if groups is None:
        groups = (vconfig.OffloadingGroupConfig(16, ("layers.0",), 0),)
    return vconfig.OffloadingConfig(
        groups=groups,
        worker_kv_bytes_per_block=chunk_bytes,
        enable_kv_cache_events=events,
        extra_config={
            "spec_name": "TieringOffloadingSpec",
            "cpu_bytes_to_use": chunks * chunk_bytes,
            "secondary_tiers": tiers,
        },
        engine_id=f"kv-tiering-test-{os.getpid()}-{next(_engine_ids)}",
        model=vconfig.OffloadingModelConfig(name=model, dtype="float16"),
        cache=vconfig.OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=vconfig.OffloadingParallelConfig(
            rank=0,
            world_size=1,
            tp_size=1,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=True,
        ),
    )


def nvme_tier(root: os.PathLike[str] | str, **options: Any) -> dict[str, Any]:
    """The config entry of our NVMe tier, as a user writes it."""
    return {
        "type": "NVMeTierManager",
        "module_path": MODULE,
        "root": str(root),
        "capacity_bytes": 64 << 20,
        **options,
    }


class Scheduler:
    """vLLM's connector scheduler and worker around one manager, as the tests need them."""

    def __init__(self, chunks: int, tiers: list[dict[str, Any]], **config: Any) -> None:
        self.chunks = chunks
        self.spec = OffloadingSpecFactory.create_spec(offloading_config(chunks, tiers, **config))
        self.manager = self.spec.get_manager()
        view = self.manager.primary_tier.get_kv_memoryview()
        self.stride = view.strides[0]
        self._flat = view.cast("B")
        self._requests = itertools.count()

    @property
    def tier(self) -> Any:
        """The (first) secondary tier vLLM built."""
        return self.manager.secondary_tiers[0]

    def request(self) -> ReqContext:
        context = ReqContext(req_id=f"req-{next(self._requests)}")
        with self.manager.lock:
            self.manager.on_new_request(context)
        return context

    def finish(self, context: ReqContext) -> None:
        with self.manager.lock:
            self.manager.on_request_finished(context)

    def chunk(self, chunk_id: int) -> bytes:
        return bytes(self._flat[chunk_id * self.stride : (chunk_id + 1) * self.stride])

    def store(self, blocks: Mapping[bytes, bytes]) -> None:
        """One request stores ``blocks`` into the CPU tier, which cascades them."""
        context = self.request()
        keys = list(blocks)
        with self.manager.lock:
            out = self.manager.prepare_store(keys, context)
        assert out is not None, "the CPU tier had no room"
        for k, chunk in zip(out.keys_to_store, out.store_spec.chunk_ids, strict=True):
            start = int(chunk) * self.stride
            self._flat[start : start + self.stride] = blocks[k]
        with self.manager.lock:
            self.manager.complete_store(out.keys_to_store, context)
            self.manager.on_request_finished(context)
        self.step()

    def step(self) -> None:
        with self.manager.lock:
            self.manager.on_schedule_end(ScheduleEndContext((), ()))

    def settle(self, bound_s: float = SETTLE_S) -> None:
        """Step until no tier job is in flight."""
        deadline = time.monotonic() + bound_s
        while True:
            with self.manager.lock:
                pending = self.manager.has_pending_work()
            if not pending:
                return
            assert time.monotonic() < deadline, "vLLM's manager did not settle"
            self.step()
            time.sleep(0.002)

    def lookup(self, k: bytes, context: ReqContext) -> LookupResult:
        with self.manager.lock:
            return self.manager.lookup(k, context)

    def resolve(self, keys: Iterable[bytes], bound_s: float = SETTLE_S) -> dict[bytes, Any]:
        """Look each key up, stepping, until every answer is HIT or MISS (the first
        answer of each key is recorded too, as ``"first"``)."""
        context = self.request()
        answers: dict[bytes, Any] = {}
        deadline = time.monotonic() + bound_s
        todo = list(keys)
        while todo:
            assert time.monotonic() < deadline, f"lookups did not resolve: {answers}"
            for k in list(todo):
                answer = self.lookup(k, context)
                answers.setdefault(("first", k), answer)
                if answer in (LookupResult.HIT, LookupResult.MISS):
                    answers[k] = answer
                    todo.remove(k)
            if todo:
                self.step()
                time.sleep(0.002)
        self.finish(context)
        return answers

    def read(self, keys: list[bytes]) -> dict[bytes, bytes]:
        """Load HIT keys out of the CPU tier, as the worker would (their bytes)."""
        context = self.request()
        with self.manager.lock:
            spec = self.manager.prepare_load(keys, context)
        data = {k: self.chunk(int(c)) for k, c in zip(keys, spec.chunk_ids, strict=True)}
        with self.manager.lock:
            self.manager.complete_load(keys, context)
            self.manager.on_request_finished(context)
        return data

    def in_primary(self, k: bytes) -> bool:
        return self.manager.primary_tier.lookup(k, ReqContext(req_id="probe")) in (
            LookupResult.HIT,
            LookupResult.HIT_PENDING,
        )

    def shutdown(self) -> None:
        self.manager.shutdown()
        self._flat.release()


def chunk_past_the_end(monkeypatch: pytest.MonkeyPatch, scheduler: Scheduler, method: str) -> None:
    """Fault: the next call of the CPU tier's ``method`` (``prepare_read``, which pins the
    chunks a cascade reads, or ``prepare_write``, which takes the chunks a promotion
    writes) allocates as usual but hands vLLM's manager one chunk id past the CPU tier's
    last chunk for each key, as a bug in vLLM could."""
    primary = scheduler.manager.primary_tier
    real = getattr(primary, method)
    armed = [True]

    def wrong_ids(spec: Any) -> CPULoadStoreSpec:
        return CPULoadStoreSpec([scheduler.chunks] * len(spec.chunk_ids))

    def faulty(keys: Any, context: ReqContext) -> Any:
        out = real(keys, context)
        if not armed[0] or out is None:
            return out
        armed[0] = False
        if method == "prepare_read":
            return wrong_ids(out)
        return dataclasses.replace(out, store_spec=wrong_ids(out.store_spec))

    monkeypatch.setattr(primary, method, faulty)
