"""DeviceCopier: checked, planned copies between the device KV cache and host-pool slots,
run by an injected backend; handles, lifecycle and statistics."""

from __future__ import annotations

import asyncio
import logging

import pytest
import torch
from _device_kv import (
    DEVICES,
    LAYOUTS,
    NUM_BLOCKS,
    NUM_SLOTS,
    CountingExecutor,
    assert_round_trip,
    block_bytes_of,
    device_block,
    layers_of,
    make_kv,
    opened,
    random_tensor,
    same_bytes,
    slot_bytes,
    snapshot,
)

from tiering.device.copier import DeviceCopier
from tiering.device.cuda_copies import CudaCopyBackend
from tiering.device.host_pool import HostPool
from tiering.device.thread_copies import ThreadCopyBackend
from tiering.errors import ClosedError, InvalidArgumentError, TransferError
from tiering.lifecycle import Lifecycle

# --------------------------------------------------------------------------- copies


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", list(LAYOUTS))
async def test_to_host_puts_each_block_byte_exact_in_its_slot(layout: str, device: str) -> None:
    async with opened(layout, device) as (copier, kv, pool):
        ids, slots = [3, 0, 11, 7], [9, 2, 3, 0]
        await copier.to_host(ids, slots)
        for block, slot in zip(ids, slots, strict=True):
            assert slot_bytes(pool, slot) == device_block(kv, block)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", list(LAYOUTS))
async def test_to_device_restores_clobbered_blocks_exactly(layout: str, device: str) -> None:
    async with opened(layout, device) as (copier, kv, _):
        ids, slots = [5, 1, 8, 2, 10], [4, 5, 6, 1, 8]
        before = snapshot(kv)
        await copier.to_host(ids, slots)
        for t in layers_of(kv):
            t[ids] = random_tensor(tuple(t[ids].shape), t.dtype, torch.Generator()).to(device)
        assert not same_bytes(kv, before)
        await copier.to_device(slots, ids)
        assert same_bytes(kv, before)


@pytest.mark.parametrize("device", DEVICES)
async def test_copies_touch_only_the_named_slots_and_blocks(device: str) -> None:
    async with opened("mixed_dtypes", device) as (copier, kv, pool):
        host_before = pool.tensor.clone()
        await copier.to_host([4, 6], [7, 2])
        changed = (pool.tensor != host_before).any(dim=1).nonzero().flatten().tolist()
        assert changed == [2, 7]
        kv_before = snapshot(kv)
        await copier.to_device([0, 9], [1, 11])
        for t, b in zip(snapshot(kv), kv_before, strict=True):
            assert (t != b).flatten(1).any(dim=1).nonzero().flatten().tolist() == [1, 11]


@pytest.mark.parametrize("device", DEVICES)
async def test_job_bigger_than_a_chunk_is_copied_in_chunks_exactly(device: str) -> None:
    kv = make_kv("mixed_dtypes", device)
    block_bytes = block_bytes_of(kv)
    with HostPool(NUM_SLOTS, block_bytes) as pool:
        async with DeviceCopier(kv, pool, staging_bytes=2 * block_bytes) as copier:
            assert copier.max_rows == 2
            await assert_round_trip(copier, kv, pool)


@pytest.mark.parametrize("device", DEVICES)
async def test_a_source_may_feed_several_destinations(device: str) -> None:
    async with opened("one_tensor", device) as (copier, kv, pool):
        await copier.to_host([5, 5, 5], [0, 1, 2])
        assert slot_bytes(pool, 0) == slot_bytes(pool, 2) == device_block(kv, 5)
        await copier.to_device([3, 3], [0, 11])
        assert device_block(kv, 0) == device_block(kv, 11) == slot_bytes(pool, 3)


async def test_empty_job_completes_at_once() -> None:
    async with opened() as (copier, _, _):
        handle = copier.to_host([], [])
        assert handle.done() and handle.error is None
        await handle


async def test_concurrent_jobs_all_land() -> None:
    async with opened("mixed_dtypes", max_workers=2) as (copier, kv, pool):
        handles = [copier.to_host([b], [b]) for b in range(NUM_SLOTS)]
        await asyncio.gather(*handles)
        for b in range(NUM_SLOTS):
            assert slot_bytes(pool, b) == device_block(kv, b)


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("ids", "slots", "message"),
    [
        ([1, 2], [3], "2 device block ids but 1 slots"),
        ([NUM_BLOCKS], [0], f"device block ids: {NUM_BLOCKS} is outside"),
        ([-1], [0], "device block ids: -1 is outside"),
        ([0], [NUM_SLOTS], f"slots: {NUM_SLOTS} is outside"),
        ([0, 1], [4, 4], "slots: 4 appears twice"),
        ([1.0], [0], "device block ids must hold ints"),
        ([True], [0], "device block ids must hold ints"),
        ([0], ["1"], "slots must hold ints"),
        (5, [0], "device block ids must be a sequence"),
    ],
)
async def test_bad_to_host_raises_before_anything_is_copied(
    ids: object, slots: object, message: str
) -> None:
    executor = CountingExecutor(1)
    backend = ThreadCopyBackend(max_workers=1, executor=executor)
    async with opened(backend=backend) as (copier, kv, pool):
        host_before, kv_before = pool.tensor.clone(), snapshot(kv)
        with pytest.raises(InvalidArgumentError, match=message):
            copier.to_host(ids, slots)  # type: ignore[arg-type]
        assert copier.statistics().jobs_in_flight == 0 and executor.submits == 0
        assert torch.equal(pool.tensor, host_before) and same_bytes(kv, kv_before)
    executor.shutdown()


@pytest.mark.parametrize(
    ("slots", "ids", "message"),
    [
        ([0, 1], [2], "1 device block ids but 2 slots"),
        ([0], [NUM_BLOCKS], "is outside"),
        ([NUM_SLOTS], [0], "slots: 10 is outside"),
        ([0, 1], [6, 6], "device block ids: 6 appears twice"),
    ],
)
async def test_bad_to_device_raises_before_anything_is_copied(
    slots: list[int], ids: list[int], message: str
) -> None:
    executor = CountingExecutor(1)
    backend = ThreadCopyBackend(max_workers=1, executor=executor)
    async with opened(backend=backend) as (copier, kv, _):
        kv_before = snapshot(kv)
        with pytest.raises(InvalidArgumentError, match=message):
            copier.to_device(slots, ids)
        assert copier.statistics().jobs_in_flight == 0 and executor.submits == 0
        assert same_bytes(kv, kv_before)
    executor.shutdown()


async def test_device_block_ids_are_checked_and_bad_ones_named() -> None:
    async with opened() as (copier, _, _):
        await copier.to_host([0, NUM_BLOCKS - 1, 0], [0, 1, 2])  # ids may repeat to host
        await copier.to_host(torch.tensor([1, 2]), [3, 4])
        with pytest.raises(InvalidArgumentError, match=f"{NUM_BLOCKS} is outside"):
            copier.to_host([0, NUM_BLOCKS], [0, 1])
        with pytest.raises(InvalidArgumentError, match="must hold ints"):
            copier.to_device([0], [0.5])  # type: ignore[list-item]
        assert copier.statistics().jobs_in_flight == 0


def test_block_size_mismatch_is_rejected() -> None:
    kv = make_kv("mixed_dtypes", "cpu")
    with (
        HostPool(4, block_bytes_of(kv) + 2) as pool,
        pytest.raises(InvalidArgumentError, match="slot is"),
    ):
        DeviceCopier(kv, pool)


def test_malformed_kv_caches_are_rejected_by_the_copier() -> None:
    with HostPool(4, 32) as pool, pytest.raises(InvalidArgumentError, match="not contiguous"):
        DeviceCopier([torch.zeros(4, 8).t()], pool)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"staging_bytes": 0}, "staging_bytes must be a positive int, got 0"),
        ({"max_workers": -1}, "max_workers must be a positive int, got -1"),
        ({"max_workers": True}, "max_workers must be a positive int, got True"),
        ({"backend": "threads"}, "backend must be a CopyBackend, got 'threads'"),
    ],
)
def test_bad_options_are_rejected(kwargs: dict[str, object], message: str) -> None:
    with HostPool(4, 32) as pool, pytest.raises(InvalidArgumentError, match=message):
        DeviceCopier(torch.zeros(4, 8), pool, **kwargs)  # type: ignore[arg-type]


def test_closed_pool_is_rejected() -> None:
    pool = HostPool(4, 32)
    pool.close()
    with pytest.raises(InvalidArgumentError, match="closed"):
        DeviceCopier(torch.zeros(4, 8), pool)


async def test_call_off_the_loop_thread_is_rejected() -> None:
    async with opened() as (copier, _, _):
        with pytest.raises(InvalidArgumentError, match="event loop"):
            await asyncio.to_thread(copier.to_host, [0], [0])


# --------------------------------------------------------------------------- backends


def test_the_default_backend_follows_the_kv_cache_device() -> None:
    with HostPool(4, 32) as pool:
        copier = DeviceCopier(torch.zeros(4, 8), pool, max_workers=3)
        assert isinstance(copier.backend, ThreadCopyBackend)
        assert copier.backend.max_workers == 3


async def test_a_failed_backend_open_leaves_the_copier_closed() -> None:
    class FailingOpen(ThreadCopyBackend):
        async def open(self, *args: object, **kwargs: object) -> None:
            raise RuntimeError("no workers today")

    with HostPool(NUM_SLOTS, 32) as pool:
        copier = DeviceCopier(torch.zeros(NUM_BLOCKS, 8), pool, backend=FailingOpen())
        with pytest.raises(RuntimeError, match="no workers today"):
            await copier.start()
        assert copier.state is Lifecycle.CLOSED
        with pytest.raises(ClosedError):
            copier.to_host([0], [0])


# --------------------------------------------------------------------------- lifetime


async def test_copy_before_enter_raises_closed_error() -> None:
    kv = make_kv("one_tensor", "cpu")
    with HostPool(NUM_SLOTS, block_bytes_of(kv)) as pool, pytest.raises(ClosedError):
        DeviceCopier(kv, pool).to_host([0], [0])


async def test_the_state_moves_through_the_lifecycle() -> None:
    kv = make_kv("one_tensor", "cpu")
    with HostPool(NUM_SLOTS, block_bytes_of(kv)) as pool:
        copier = DeviceCopier(kv, pool)
        assert copier.state is Lifecycle.NEW and not copier.closed
        async with copier:
            assert copier.state is Lifecycle.OPEN and not copier.closed
        assert copier.state is Lifecycle.CLOSED and copier.closed


async def test_copying_after_close_raises_closed_error() -> None:
    async with opened() as (copier, _, _):
        pass
    assert copier.closed
    with pytest.raises(ClosedError):
        await copier.to_host([0], [0])
    with pytest.raises(ClosedError):
        await copier.to_device([0], [0])
    with pytest.raises(ClosedError):
        async with copier:
            pass


async def test_copy_after_the_pool_closed_raises_closed_error() -> None:
    kv = make_kv("one_tensor", "cpu")
    pool = HostPool(NUM_SLOTS, block_bytes_of(kv))
    async with DeviceCopier(kv, pool) as copier:
        pool.close()
        with pytest.raises(ClosedError, match="host pool"):
            copier.to_host([0], [0])


async def test_cancelling_a_waiter_does_not_cancel_the_copy() -> None:
    executor = CountingExecutor(1)
    backend = ThreadCopyBackend(max_workers=1, executor=executor)
    async with opened("mixed_dtypes", backend=backend) as (copier, kv, pool):
        with executor.held() as gate:
            handle = copier.to_host([2, 3], [5, 6])

            async def wait_for_copy() -> None:
                await handle

            waiter = asyncio.create_task(wait_for_copy())
            await asyncio.sleep(0)
            waiter.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiter
            assert not handle.done() and copier.statistics().jobs_in_flight == 1
            gate.set()
            await handle
        assert handle.done() and handle.error is None
        assert slot_bytes(pool, 5) == device_block(kv, 2)
        assert slot_bytes(pool, 6) == device_block(kv, 3)
    executor.shutdown()


async def test_an_unawaited_copy_still_runs_and_reports_through_its_callback() -> None:
    async with opened() as (copier, kv, pool):
        ended = asyncio.Event()
        seen: list[bool] = []
        handle = copier.to_host([9], [1])
        handle.add_done_callback(lambda h: (seen.append(h.done()), ended.set()))
        await ended.wait()
        assert seen == [True]
        assert slot_bytes(pool, 1) == device_block(kv, 9)


async def test_start_reports_each_copy_once_through_on_done() -> None:
    async with opened() as (copier, kv, pool):
        ended = asyncio.Event()
        seen: list[tuple[int, object]] = []

        def on_done(token: int, error: object) -> None:
            seen.append((token, error))
            if len(seen) == 2:
                ended.set()

        copier.submit(True, [9], [1], on_done, 109)
        copier.submit(True, [], [], on_done, 100)
        await ended.wait()
        await asyncio.sleep(0)
        assert sorted(seen) == [(100, None), (109, None)]
        assert slot_bytes(pool, 1) == device_block(kv, 9)


async def test_leaving_the_block_waits_for_copies_in_flight() -> None:
    kv = make_kv("mixed_dtypes", "cpu")
    executor = CountingExecutor(1)
    with HostPool(NUM_SLOTS, block_bytes_of(kv)) as pool:
        backend = ThreadCopyBackend(max_workers=1, executor=executor)
        async with DeviceCopier(kv, pool, backend=backend) as copier:
            with executor.held() as gate:
                handle = copier.to_host([4], [0])
                asyncio.get_running_loop().call_soon(gate.set)
        assert handle.done() and handle.error is None
        assert copier.statistics().jobs_in_flight == 0
        assert slot_bytes(pool, 0) == device_block(kv, 4)
    executor.shutdown()


async def test_a_cancelled_exit_blocks_until_the_copies_ended_and_closes() -> None:
    kv = make_kv("mixed_dtypes", "cpu")
    executor = CountingExecutor(1)
    with HostPool(NUM_SLOTS, block_bytes_of(kv)) as pool:
        backend = ThreadCopyBackend(max_workers=1, executor=executor)
        copier = DeviceCopier(kv, pool, backend=backend)
        handles = []
        entered = asyncio.Event()

        async def body() -> None:
            async with copier:
                handles.append(copier.to_host([4], [0]))
                await asyncio.sleep(0)  # its hop leaves
                handles.append(copier.to_host([5], [1]))  # queued behind the first hop
                await asyncio.sleep(0)
                entered.set()
                await asyncio.Event().wait()

        with executor.held() as gate:
            task = asyncio.create_task(body())
            await entered.wait()
            task.cancel()  # leaves the body: the exit now waits for the copies
            for _ in range(100):
                if copier.state is Lifecycle.CLOSING:
                    break
                await asyncio.sleep(0)
            assert copier.state is Lifecycle.CLOSING and copier.statistics().jobs_in_flight == 2
            gate.set()
            task.cancel()  # cancels that wait: the exit drains, blocking
            with pytest.raises(asyncio.CancelledError):
                await task
        assert copier.state is Lifecycle.CLOSED and copier.statistics().jobs_in_flight == 0
        assert all(h.done() and h.error is None for h in handles)
        assert slot_bytes(pool, 0) == device_block(kv, 4)
        assert slot_bytes(pool, 1) == device_block(kv, 5)
        assert executor.submits == 2
    executor.shutdown()


@pytest.mark.parametrize("device", DEVICES)
async def test_a_failed_copy_raises_transfer_error_and_the_copier_keeps_working(
    monkeypatch: pytest.MonkeyPatch, device: str, caplog: pytest.LogCaptureFixture
) -> None:
    async with opened("mixed_dtypes", device) as (copier, kv, pool):

        def broken_gather(*args: object, **kwargs: object) -> torch.Tensor:
            raise RuntimeError("simulated gather fault")

        with monkeypatch.context() as patch, caplog.at_level(logging.WARNING):
            patch.setattr(torch, "index_select", broken_gather)
            handles = [copier.to_host([1], [1]), copier.to_host([2], [2])]
            for handle in handles:
                with pytest.raises(TransferError, match="simulated gather fault"):
                    await handle
        assert isinstance(handles[0].error, TransferError)
        assert copier.statistics().failures == {"to_host copy failed": 2}
        assert sum("to_host copy failed" in r.getMessage() for r in caplog.records) == 1
        await copier.to_host([1], [1])
        assert slot_bytes(pool, 1) == device_block(kv, 1)


# --------------------------------------------------------------------------- statistics


async def test_statistics_count_copies_and_bytes_in_flight_and_done() -> None:
    executor = CountingExecutor(1)
    backend = ThreadCopyBackend(max_workers=1, executor=executor)
    async with opened("mixed_dtypes", backend=backend) as (copier, kv, _):
        block = block_bytes_of(kv)
        assert copier.statistics().state is Lifecycle.OPEN
        with executor.held() as gate:
            store = copier.to_host([1, 2, 3], [1, 2, 3])
            load = copier.to_device([4], [5])
            stats = copier.statistics()
            assert (stats.jobs_in_flight, stats.bytes_in_flight) == (2, 4 * block)
            assert "2 jobs" in repr(copier)
            gate.set()
            await store
            await load
        stats = copier.statistics()
        assert (stats.jobs_in_flight, stats.bytes_in_flight) == (0, 0)
        assert dict(stats.counters) == {
            "copies_to_host": 1,
            "copies_to_device": 1,
            "bytes_to_host": 3 * block,
            "bytes_to_device": block,
        }
        assert stats.failures == {}
        assert "copies_to_host=1" in repr(copier) and "ThreadCopyBackend" in repr(copier)
    assert copier.statistics().state is Lifecycle.CLOSED
    executor.shutdown()


# --------------------------------------------------------------------------- CUDA only


@pytest.mark.cuda
def test_cuda_copies_need_a_pinned_pool() -> None:
    kv = make_kv("mixed_dtypes", "cuda")
    with (
        HostPool(4, block_bytes_of(kv), pin=False) as pool,
        pytest.raises(InvalidArgumentError, match="pinned"),
    ):
        DeviceCopier(kv, pool)


@pytest.mark.cuda
async def test_cuda_pool_used_by_the_copier_is_pinned_and_the_backend_is_cuda() -> None:
    async with opened("mixed_dtypes", "cuda") as (copier, _, pool):
        assert copier.device.type == "cuda"
        assert isinstance(copier.backend, CudaCopyBackend)
        assert pool.pinned and pool.tensor.is_pinned()


@pytest.mark.cuda
async def test_cuda_copy_is_ordered_after_the_compute_stream() -> None:
    async with opened("one_tensor", "cuda") as (copier, kv, pool):
        assert isinstance(kv, torch.Tensor)
        ones = torch.full_like(kv[0], 1.5)
        twos = torch.full_like(kv[0], 2.5)
        pool.tensor[1].copy_(ones.view(torch.uint8).flatten().cpu())
        compute = torch.cuda.Stream()
        with torch.cuda.stream(compute):
            torch.cuda._sleep(200_000_000)  # keeps the compute stream busy for ~0.1 s
            kv[3].copy_(twos)
            store = copier.to_host([3], [0])  # must see the write queued just before
            kv[7].copy_(twos)
            load = copier.to_device([1], [7])  # must land after that write, not under it
        await store
        assert slot_bytes(pool, 0) == twos.view(torch.uint8).cpu().numpy().tobytes()
        await load
        assert torch.equal(kv[7].cpu(), ones.cpu())


@pytest.mark.cuda
async def test_cuda_handle_completes_only_after_the_bytes_landed() -> None:
    async with opened("mixed_dtypes", "cuda") as (copier, kv, pool):
        torch.cuda._sleep(200_000_000)  # delay the copy behind a busy compute stream
        handle = copier.to_host([1, 2, 3], [4, 5, 6])
        await handle
        for block, slot in ((1, 4), (2, 5), (3, 6)):
            assert slot_bytes(pool, slot) == device_block(kv, block)


@pytest.mark.cuda
async def test_cuda_leaving_the_block_waits_for_copies_in_flight() -> None:
    kv = make_kv("mixed_dtypes", "cuda")
    with HostPool(NUM_SLOTS, block_bytes_of(kv)) as pool:
        async with DeviceCopier(kv, pool) as copier:
            torch.cuda._sleep(200_000_000)  # the copy is still queued when the block ends
            handle = copier.to_host([4, 5], [0, 1])
            assert not handle.done()
        assert handle.done() and handle.error is None and copier.statistics().jobs_in_flight == 0
        assert slot_bytes(pool, 0) == device_block(kv, 4)
        assert slot_bytes(pool, 1) == device_block(kv, 5)
