"""ThreadCopyBackend: copies on worker threads, coalesced into hops, in request order
where they overlap. Hops are counted through an injected executor."""

from __future__ import annotations

import asyncio
import dataclasses
import random
import threading

import pytest
import torch
from _device_kv import (
    NUM_BLOCKS,
    NUM_SLOTS,
    CountingExecutor,
    block_bytes_of,
    device_block,
    make_kv,
    opened,
    slot_bytes,
)

from tiering.device.copier import CopyHandle, DeviceCopier
from tiering.device.host_pool import HostPool
from tiering.device.kv_layout import describe_kv_caches
from tiering.device.thread_copies import ThreadCopyBackend
from tiering.errors import ClosedError, InvalidArgumentError, TransferError


def _counting_backend(workers: int) -> tuple[ThreadCopyBackend, CountingExecutor]:
    executor = CountingExecutor(workers)
    return ThreadCopyBackend(max_workers=workers, executor=executor), executor


def _count_calls(handles: list[CopyHandle]) -> list[int]:
    calls = [0] * len(handles)
    for i, handle in enumerate(handles):
        handle.add_done_callback(lambda _, i=i: calls.__setitem__(i, calls[i] + 1))
    return calls


async def test_copies_requested_while_a_hop_is_queued_share_one_hop() -> None:
    backend, executor = _counting_backend(1)
    async with opened("mixed_dtypes", backend=backend) as (copier, kv, pool):
        with executor.held() as gate:
            handles = [copier.to_host([b % NUM_BLOCKS], [b % NUM_SLOTS]) for b in range(3)]
            assert executor.submits == 0  # dispatch waits for the end of this iteration
            await asyncio.sleep(0)
            assert executor.submits == 1  # all three
            handles += [copier.to_host([b], [b]) for b in range(3, NUM_SLOTS)]
            await asyncio.sleep(0)
            # The hop is held and max_workers is 1: the others wait for one hop together.
            assert executor.submits == 1
            calls = _count_calls(handles)
            gate.set()
            await asyncio.gather(*handles)
        assert executor.submits == 2
        await asyncio.sleep(0)  # done callbacks run one loop step after the future
        assert calls == [1] * NUM_SLOTS
        for b in range(NUM_SLOTS):
            assert slot_bytes(pool, b) == device_block(kv, b)
    executor.shutdown()


async def test_many_small_copies_issued_back_to_back_take_few_hops() -> None:
    backend, executor = _counting_backend(2)
    async with opened("one_tensor", backend=backend) as (copier, kv, pool):
        handles = [copier.to_host([i % NUM_BLOCKS], [i % NUM_SLOTS]) for i in range(2000)]
        await asyncio.gather(*handles)
        assert all(h.done() and h.error is None for h in handles)
        # Nothing returns to the loop while it issues: they leave together.
        assert executor.submits == 1
        for slot in range(NUM_SLOTS):
            last = max(i for i in range(2000) if i % NUM_SLOTS == slot)
            assert slot_bytes(pool, slot) == device_block(kv, last % NUM_BLOCKS)
    executor.shutdown()


async def test_a_failing_copy_in_a_hop_fails_only_its_own_handle(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    backend, executor = _counting_backend(1)
    workers: set[int] = set()
    real_gather = torch.index_select

    def gather_failing_on_block_7(
        layer: torch.Tensor, dim: int, index: torch.Tensor, **kwargs: torch.Tensor
    ) -> torch.Tensor:
        workers.add(threading.get_ident())
        if 7 in index.tolist():
            raise RuntimeError("simulated fault reading block 7")
        return real_gather(layer, dim, index, **kwargs)

    async with opened("mixed_dtypes", backend=backend) as (copier, kv, pool):
        before = [slot_bytes(pool, s) for s in range(NUM_SLOTS)]
        with executor.held() as gate, monkeypatch.context() as patch:
            patch.setattr(torch, "index_select", gather_failing_on_block_7)
            first = copier.to_host([0], [0])
            await asyncio.sleep(0)  # the first leaves alone, in its own hop
            batch = [copier.to_host([b], [b]) for b in (5, 6, 7, 8, 9)]
            gate.set()
            await first
            outcomes = await asyncio.gather(*batch, return_exceptions=True)
        assert executor.submits == 2  # the five shared one hop
        assert [isinstance(o, TransferError) for o in outcomes] == [0, 0, 1, 0, 0]
        assert "simulated fault reading block 7" in str(outcomes[2])
        assert batch[2].error is not None and batch[3].error is None
        for b in (0, 5, 6, 8, 9):
            assert slot_bytes(pool, b) == device_block(kv, b)
        assert slot_bytes(pool, 7) == before[7]  # failed before writing anything
        assert threading.get_ident() not in workers  # no copy ran on the loop thread
        stats = copier.statistics()
        assert stats.counters["copies_to_host"] == 5 and stats.failures == {
            "to_host copy failed": 1
        }
    executor.shutdown()


async def test_an_overlapping_copy_waits_for_the_hop_it_depends_on() -> None:
    backend, executor = _counting_backend(2)
    async with opened("mixed_dtypes", backend=backend) as (copier, kv, pool):
        with executor.held() as gate:
            store = copier.to_host([1], [3])  # writes slot 3
            await asyncio.sleep(0)  # its hop leaves
            load = copier.to_device([3], [5])  # reads slot 3: must see block 1
            later = copier.to_host([8], [9])  # independent, but queued behind `load`
            await asyncio.sleep(0)
            # A worker is free, yet the overlapping copy was not dispatched beside the first.
            assert executor.submits == 1
            gate.set()
            await asyncio.gather(store, load, later)
        assert executor.submits == 2
        assert device_block(kv, 5) == device_block(kv, 1) == slot_bytes(pool, 3)
        assert slot_bytes(pool, 9) == device_block(kv, 8)
    executor.shutdown()


async def test_an_independent_copy_takes_a_free_worker_at_once() -> None:
    backend, executor = _counting_backend(2)
    async with opened("mixed_dtypes", backend=backend) as (copier, kv, pool):
        with executor.held() as gate:
            handles = [copier.to_host([1], [3])]
            await asyncio.sleep(0)
            handles.append(copier.to_device([4], [6]))
            await asyncio.sleep(0)
            assert executor.submits == 2
            handles.append(copier.to_host([2], [7]))  # both hops in flight: it waits
            await asyncio.sleep(0)
            assert executor.submits == 2
            gate.set()
            await asyncio.gather(*handles)
        assert executor.submits == 3
        assert slot_bytes(pool, 3) == device_block(kv, 1)
        assert device_block(kv, 6) == slot_bytes(pool, 4)
        assert slot_bytes(pool, 7) == device_block(kv, 2)
    executor.shutdown()


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("layout", ["one_tensor", "mixed_dtypes"])
async def test_random_overlapping_copies_end_as_if_run_one_by_one(layout: str, seed: int) -> None:
    rng = random.Random(seed)
    kv = make_kv(layout, "cpu", seed=seed, num_blocks=8)
    with HostPool(6, block_bytes_of(kv)) as pool:
        pool.tensor.copy_(torch.randint(0, 256, pool.tensor.shape, dtype=torch.uint8))
        # The model: every copy applied in request order.
        blocks = [device_block(kv, b) for b in range(8)]
        slots = [slot_bytes(pool, s) for s in range(6)]
        async with DeviceCopier(kv, pool, max_workers=2) as copier:
            handles = []
            for _ in range(300):
                n = rng.randint(1, 3)
                ids, targets = rng.sample(range(8), n), rng.sample(range(6), n)
                if rng.random() < 0.5:
                    handles.append(copier.to_host(ids, targets))
                    for b, s in zip(ids, targets, strict=True):
                        slots[s] = blocks[b]
                else:
                    handles.append(copier.to_device(targets, ids))
                    for b, s in zip(ids, targets, strict=True):
                        blocks[b] = slots[s]
                if rng.random() < 0.1:
                    await asyncio.sleep(0)  # let some hops end between requests
            await asyncio.gather(*handles)
        assert [device_block(kv, b) for b in range(8)] == blocks
        assert [slot_bytes(pool, s) for s in range(6)] == slots


async def test_a_backend_serves_one_copier_and_needs_host_memory() -> None:
    backend = ThreadCopyBackend()
    layout = describe_kv_caches(torch.zeros(4, 8))
    on_cuda = dataclasses.replace(layout, device=torch.device("cuda"))
    with pytest.raises(InvalidArgumentError, match="host memory, not on cuda"):
        await backend.open(on_cuda, torch.zeros(4, 4), max_rows=1, on_done=lambda _: None)
    await backend.open(layout, torch.zeros(4, 4), max_rows=1, on_done=lambda _: None)
    with pytest.raises(ClosedError, match="only once"):
        await backend.open(layout, torch.zeros(4, 4), max_rows=1, on_done=lambda _: None)
    await backend.aclose()


def test_bad_backend_options_are_rejected() -> None:
    with pytest.raises(InvalidArgumentError, match="max_workers must be a positive int, got 0"):
        ThreadCopyBackend(max_workers=0)
    with pytest.raises(InvalidArgumentError, match="executor must be a concurrent"):
        ThreadCopyBackend(executor="pool")  # type: ignore[arg-type]


async def test_a_given_executor_is_left_running_after_close() -> None:
    backend, executor = _counting_backend(1)
    async with opened(backend=backend) as (copier, _, _):
        await copier.to_host([1], [1])
    assert executor.submit(lambda: 42).result() == 42
    executor.shutdown()


async def test_copies_after_the_executor_shut_down_fail_with_their_handles() -> None:
    backend, executor = _counting_backend(1)
    async with opened(backend=backend) as (copier, _, _):
        executor.shutdown()
        handle = copier.to_host([1], [1])
        with pytest.raises(TransferError, match="shutdown"):
            await handle
        assert copier.statistics().jobs_in_flight == 0
