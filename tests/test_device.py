"""DeviceCopier: KV blocks between the device KV cache and host-pool slots; plan_copy."""

from __future__ import annotations

import asyncio
import contextlib
import math
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tiering.device import CopyChunk, DeviceCopier, SlotRun, kv_block_bytes, plan_copy
from tiering.errors import ClosedError, InvalidArgumentError, TransferError
from tiering.host_pool import HostPool

NUM_BLOCKS = 12
NUM_SLOTS = 10

# name -> per-layer (row shape, dtype); "one_tensor" is passed as a bare tensor.
LAYOUTS: dict[str, list[tuple[tuple[int, ...], torch.dtype]]] = {
    "one_tensor": [((2, 4, 8), torch.float16)],
    "mixed_dtypes": [((2, 4, 8), torch.float16), ((3, 5), torch.float32), ((7,), torch.bfloat16)],
    "odd_bytes": [((5,), torch.uint8), ((3,), torch.float32)],
}
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def _random_tensor(
    shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator
) -> torch.Tensor:
    """Random bit patterns of every kind (NaNs included): equality is checked on bytes."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).view(shape)


def make_kv(
    layout: str, device: str, seed: int = 0, num_blocks: int = NUM_BLOCKS
) -> torch.Tensor | list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    layers = [
        _random_tensor((num_blocks, *row), dtype, gen).to(device) for row, dtype in LAYOUTS[layout]
    ]
    return layers[0] if layout == "one_tensor" else layers


def _layers(kv: torch.Tensor | list[torch.Tensor]) -> list[torch.Tensor]:
    return [kv] if isinstance(kv, torch.Tensor) else kv


def block_bytes_of(kv: torch.Tensor | list[torch.Tensor]) -> int:
    return sum(t[0].numel() * t.element_size() for t in _layers(kv))


def device_block(kv: torch.Tensor | list[torch.Tensor], block: int) -> bytes:
    """The host-slot image of a device block: its rows' bytes, layer after layer."""
    return b"".join(
        t[block].contiguous().view(torch.uint8).cpu().numpy().tobytes() for t in _layers(kv)
    )


def snapshot(kv: torch.Tensor | list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.view(torch.uint8).cpu().clone() for t in _layers(kv)]


async def assert_round_trip(
    copier: DeviceCopier, kv: torch.Tensor | list[torch.Tensor], pool: HostPool
) -> None:
    """Seven blocks to scattered slots (more than one staging chunk), wiped, and back."""
    ids, slots = [11, 2, 3, 9, 0, 5, 7], [0, 9, 1, 2, 8, 4, 5]
    await copier.to_host(ids, slots)
    for block, slot in zip(ids, slots, strict=True):
        assert bytes(pool.slot_view(slot)) == device_block(kv, block)
    before = snapshot(kv)
    for t in _layers(kv):
        t.zero_()
    await copier.to_device(slots, ids)
    for i, (t, b) in enumerate(zip(snapshot(kv), before, strict=True)):
        assert torch.equal(t[ids], b[ids]), f"layer {i}"


def same_bytes(kv: torch.Tensor | list[torch.Tensor], before: list[torch.Tensor]) -> bool:
    return all(torch.equal(a, b) for a, b in zip(snapshot(kv), before, strict=True))


@asynccontextmanager
async def opened(
    layout: str = "mixed_dtypes", device: str = "cpu", **kwargs: int
) -> AsyncIterator[tuple[DeviceCopier, torch.Tensor | list[torch.Tensor], HostPool]]:
    kv = make_kv(layout, device)
    with HostPool(NUM_SLOTS, block_bytes_of(kv)) as pool:
        pool.tensor.copy_(torch.randint(0, 256, pool.tensor.shape, dtype=torch.uint8))
        async with DeviceCopier(kv, pool, **kwargs) as copier:
            yield copier, kv, pool


# --------------------------------------------------------------------------- plan_copy


def test_plan_orders_pairs_by_slot_and_merges_consecutive_slots() -> None:
    plan = plan_copy([10, 11, 12, 13, 14], [5, 3, 4, 9, 6], max_rows=8)
    assert plan == (
        CopyChunk(
            device_ids=(11, 12, 10, 14, 13),
            runs=(SlotRun(first_slot=3, first_row=0, length=4), SlotRun(9, 4, 1)),
        ),
    )


def test_plan_cuts_chunks_of_at_most_max_rows_and_splits_runs_at_the_cut() -> None:
    plan = plan_copy([0, 1, 2, 3, 4], [20, 21, 22, 23, 24], max_rows=2)
    assert [c.device_ids for c in plan] == [(0, 1), (2, 3), (4,)]
    assert [c.runs for c in plan] == [
        (SlotRun(20, 0, 2),),
        (SlotRun(22, 0, 2),),
        (SlotRun(24, 0, 1),),
    ]


def test_plan_keeps_repeated_slots_in_separate_runs() -> None:
    plan = plan_copy([7, 8, 9], [4, 4, 5], max_rows=10)
    assert plan[0].runs == (SlotRun(4, 0, 1), SlotRun(4, 1, 2))


def test_plan_of_nothing_is_empty() -> None:
    assert plan_copy([], [], max_rows=3) == ()


def test_plan_rejects_unequal_lengths_and_zero_rows() -> None:
    with pytest.raises(InvalidArgumentError, match="2 device block ids but 1 slots"):
        plan_copy([1, 2], [1], max_rows=4)
    with pytest.raises(InvalidArgumentError, match="max_rows"):
        plan_copy([1], [1], max_rows=0)


@given(
    pairs=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 30)), max_size=40),
    max_rows=st.integers(1, 12),
)
def test_plan_covers_every_pair_once_with_ascending_slot_runs(
    pairs: list[tuple[int, int]], max_rows: int
) -> None:
    ids, slots = [p[0] for p in pairs], [p[1] for p in pairs]
    plan = plan_copy(ids, slots, max_rows)
    planned: list[tuple[int, int]] = []
    for chunk in plan:
        assert 1 <= len(chunk.device_ids) <= max_rows
        row = 0
        for run in chunk.runs:
            assert run.first_row == row and run.length >= 1
            for k in range(run.length):
                planned.append((chunk.device_ids[row + k], run.first_slot + k))
            row += run.length
        assert row == len(chunk.device_ids)
    assert sorted(planned) == sorted(pairs)
    assert [s for _, s in planned] == sorted(slots)


@given(slots=st.sets(st.integers(0, 60), max_size=30))
def test_plan_uses_one_run_per_maximal_range_of_distinct_slots(slots: set[int]) -> None:
    ordered = sorted(slots)
    expected = sum(1 for i, s in enumerate(ordered) if i == 0 or ordered[i - 1] != s - 1)
    shuffled = ordered[1::2] + ordered[0::2]
    plan = plan_copy(list(range(len(shuffled))), shuffled, max_rows=len(shuffled) or 1)
    assert sum(len(c.runs) for c in plan) == expected


# --------------------------------------------------------------------------- copies


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", list(LAYOUTS))
async def test_to_host_puts_each_block_byte_exact_in_its_slot(layout: str, device: str) -> None:
    async with opened(layout, device) as (copier, kv, pool):
        ids, slots = [3, 0, 11, 7], [9, 2, 3, 0]
        await copier.to_host(ids, slots)
        for block, slot in zip(ids, slots, strict=True):
            assert bytes(pool.slot_view(slot)) == device_block(kv, block)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", list(LAYOUTS))
async def test_to_device_restores_clobbered_blocks_exactly(layout: str, device: str) -> None:
    async with opened(layout, device) as (copier, kv, _):
        ids, slots = [5, 1, 8, 2, 10], [4, 5, 6, 1, 8]
        before = snapshot(kv)
        await copier.to_host(ids, slots)
        for t in _layers(kv):
            t[ids] = _random_tensor(tuple(t[ids].shape), t.dtype, torch.Generator()).to(device)
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
async def test_job_bigger_than_staging_is_copied_in_chunks_exactly(device: str) -> None:
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
        assert bytes(pool.slot_view(0)) == bytes(pool.slot_view(2)) == device_block(kv, 5)
        await copier.to_device([3, 3], [0, 11])
        assert device_block(kv, 0) == device_block(kv, 11) == bytes(pool.slot_view(3))


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
            assert bytes(pool.slot_view(b)) == device_block(kv, b)


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
    async with opened() as (copier, kv, pool):
        host_before, kv_before = pool.tensor.clone(), snapshot(kv)
        with pytest.raises(InvalidArgumentError, match=message):
            copier.to_host(ids, slots)  # type: ignore[arg-type]
        assert copier.in_flight == 0
        await asyncio.sleep(0.01)  # a copy wrongly started would have had time to land
        assert torch.equal(pool.tensor, host_before) and same_bytes(kv, kv_before)


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
    async with opened() as (copier, kv, _):
        kv_before = snapshot(kv)
        with pytest.raises(InvalidArgumentError, match=message):
            copier.to_device(slots, ids)
        assert copier.in_flight == 0
        await asyncio.sleep(0.01)
        assert same_bytes(kv, kv_before)


async def test_check_block_ids_accepts_valid_ids_and_names_bad_ones() -> None:
    async with opened() as (copier, _, _):
        copier.check_block_ids([0, NUM_BLOCKS - 1, 0])
        copier.check_block_ids(torch.tensor([1, 2]))
        with pytest.raises(InvalidArgumentError, match=f"{NUM_BLOCKS} is outside"):
            copier.check_block_ids([0, NUM_BLOCKS])
        with pytest.raises(InvalidArgumentError, match="must hold ints"):
            copier.check_block_ids([0.5])


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_kv_block_bytes_is_the_sum_of_row_bytes(layout: str) -> None:
    kv = make_kv(layout, "cpu")
    assert kv_block_bytes(kv) == len(device_block(kv, 0)) == block_bytes_of(kv)


def test_block_size_mismatch_is_rejected() -> None:
    kv = make_kv("mixed_dtypes", "cpu")
    with (
        HostPool(4, block_bytes_of(kv) + 2) as pool,
        pytest.raises(InvalidArgumentError, match="slot is"),
    ):
        DeviceCopier(kv, pool)


@pytest.mark.parametrize(
    ("kv", "message"),
    [
        ([], "empty"),
        ([torch.zeros(4, 8), torch.zeros(5, 8)], "has 5 blocks"),
        ([torch.zeros(4, 8).t()], "not contiguous"),
        (torch.zeros(()), "block dim"),
        ([torch.zeros(4, 0)], "empty rows"),
        ("kv", "tensor or a sequence"),
    ],
)
def test_malformed_kv_caches_are_rejected(kv: object, message: str) -> None:
    with HostPool(4, 32) as pool, pytest.raises(InvalidArgumentError, match=message):
        DeviceCopier(kv, pool)  # type: ignore[arg-type]


def test_closed_pool_is_rejected() -> None:
    pool = HostPool(4, 32)
    pool.close()
    with pytest.raises(InvalidArgumentError, match="closed"):
        DeviceCopier(torch.zeros(4, 8), pool)


async def test_call_off_the_loop_thread_is_rejected() -> None:
    async with opened() as (copier, _, _):
        with pytest.raises(InvalidArgumentError, match="event loop"):
            await asyncio.to_thread(copier.to_host, [0], [0])


# --------------------------------------------------------------------------- lifetime


async def test_copy_before_enter_raises_closed_error() -> None:
    kv = make_kv("one_tensor", "cpu")
    with HostPool(NUM_SLOTS, block_bytes_of(kv)) as pool, pytest.raises(ClosedError):
        DeviceCopier(kv, pool).to_host([0], [0])


async def test_awaiting_a_copy_after_close_raises_closed_error() -> None:
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


@contextmanager
def _hold_workers(copier: DeviceCopier, workers: int) -> Iterator[threading.Event]:
    """Occupy the CPU path's worker threads until the yielded event is set (or the block ends)."""
    gate = threading.Event()
    started = threading.Barrier(workers + 1)

    def hold() -> None:
        started.wait()
        gate.wait()

    assert copier._executor is not None
    for _ in range(workers):
        copier._executor.submit(hold)
    started.wait()
    try:
        yield gate
    finally:
        gate.set()


async def test_cancelling_a_waiter_does_not_cancel_the_copy() -> None:
    async with opened("mixed_dtypes", max_workers=1) as (copier, kv, pool):
        with _hold_workers(copier, 1) as gate:
            handle = copier.to_host([2, 3], [5, 6])

            async def wait_for_copy() -> None:
                await handle

            waiter = asyncio.create_task(wait_for_copy())
            await asyncio.sleep(0)
            waiter.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiter
            assert not handle.done() and copier.in_flight == 1
            gate.set()
            await handle
        assert handle.done() and handle.error is None
        assert bytes(pool.slot_view(5)) == device_block(kv, 2)
        assert bytes(pool.slot_view(6)) == device_block(kv, 3)


async def test_an_unawaited_copy_still_runs_and_reports_through_its_callback() -> None:
    async with opened() as (copier, kv, pool):
        ended = asyncio.Event()
        seen: list[bool] = []
        handle = copier.to_host([9], [1])
        handle.add_done_callback(lambda h: (seen.append(h.done()), ended.set()))
        await ended.wait()
        assert seen == [True]
        assert bytes(pool.slot_view(1)) == device_block(kv, 9)


async def test_leaving_the_block_waits_for_copies_in_flight() -> None:
    kv = make_kv("mixed_dtypes", "cpu")
    with HostPool(NUM_SLOTS, block_bytes_of(kv)) as pool:
        async with DeviceCopier(kv, pool, max_workers=1) as copier:
            with _hold_workers(copier, 1) as gate:
                handle = copier.to_host([4], [0])
                asyncio.get_running_loop().call_soon(gate.set)
        assert handle.done() and handle.error is None
        assert copier.in_flight == 0
        assert bytes(pool.slot_view(0)) == device_block(kv, 4)


@pytest.mark.parametrize("device", DEVICES)
async def test_a_failed_copy_raises_transfer_error_and_the_copier_keeps_working(
    monkeypatch: pytest.MonkeyPatch, device: str
) -> None:
    async with opened("mixed_dtypes", device) as (copier, kv, pool):

        def broken_gather(*args: object, **kwargs: object) -> torch.Tensor:
            raise RuntimeError("simulated gather fault")

        with monkeypatch.context() as patch:
            patch.setattr(torch, "index_select", broken_gather)
            handle = copier.to_host([1], [1])
            with pytest.raises(TransferError, match="simulated gather fault"):
                await handle
        assert isinstance(handle.error, TransferError)
        await copier.to_host([1], [1])
        assert bytes(pool.slot_view(1)) == device_block(kv, 1)


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
async def test_cuda_pool_used_by_the_copier_is_pinned() -> None:
    async with opened("mixed_dtypes", "cuda") as (copier, _, pool):
        assert copier.device.type == "cuda"
        assert pool.pinned and pool.tensor.is_pinned()


@pytest.mark.cuda
async def test_cuda_copy_is_ordered_after_the_compute_stream() -> None:
    async with opened("one_tensor", "cuda") as (copier, kv, pool):
        assert isinstance(kv, torch.Tensor)
        ones = torch.full_like(kv[0], 1.5)
        twos = torch.full_like(kv[0], 2.5)
        pool.slot_tensor(1).copy_(ones.view(torch.uint8).flatten().cpu())
        compute = torch.cuda.Stream()
        with torch.cuda.stream(compute):
            torch.cuda._sleep(200_000_000)  # keeps the compute stream busy for ~0.1 s
            kv[3].copy_(twos)
            store = copier.to_host([3], [0])  # must see the write queued just before
            kv[7].copy_(twos)
            load = copier.to_device([1], [7])  # must land after that write, not under it
        await store
        assert bytes(pool.slot_view(0)) == twos.view(torch.uint8).cpu().numpy().tobytes()
        await load
        assert torch.equal(kv[7].cpu(), ones.cpu())


@pytest.mark.cuda
async def test_cuda_handle_completes_only_after_the_bytes_landed() -> None:
    async with opened("mixed_dtypes", "cuda") as (copier, kv, pool):
        torch.cuda._sleep(200_000_000)  # delay the copy behind a busy compute stream
        handle = copier.to_host([1, 2, 3], [4, 5, 6])
        await handle
        for block, slot in ((1, 4), (2, 5), (3, 6)):
            assert bytes(pool.slot_view(slot)) == device_block(kv, block)


@pytest.mark.cuda
async def test_cuda_events_are_pooled_and_reused() -> None:
    async with opened("mixed_dtypes", "cuda") as (copier, _, _):
        for i in range(40):
            await copier.to_host([i % NUM_BLOCKS], [i % NUM_SLOTS])
        assert copier._events.created == 1
        await asyncio.gather(*(copier.to_host([b], [b]) for b in range(NUM_SLOTS)))
        assert copier._events.created <= NUM_SLOTS
        assert copier._events.idle == copier._events.created
        assert copier.in_flight == 0


@pytest.mark.cuda
async def test_cuda_unawaited_copies_are_completed_by_the_poller() -> None:
    async with opened("mixed_dtypes", "cuda") as (copier, _, _):
        handles = [copier.to_host([b], [b]) for b in range(NUM_SLOTS)]
        ended = asyncio.Event()
        handles[-1].add_done_callback(lambda _: ended.set())
        await ended.wait()
        await asyncio.gather(*handles)
        assert all(h.done() for h in handles)


@pytest.mark.cuda
async def test_cuda_leaving_the_block_waits_for_copies_in_flight() -> None:
    kv = make_kv("mixed_dtypes", "cuda")
    with HostPool(NUM_SLOTS, block_bytes_of(kv)) as pool:
        async with DeviceCopier(kv, pool) as copier:
            torch.cuda._sleep(200_000_000)  # the copy is still queued when the block ends
            handle = copier.to_host([4, 5], [0, 1])
            assert not handle.done()
        assert handle.done() and handle.error is None and copier.in_flight == 0
        assert bytes(pool.slot_view(0)) == device_block(kv, 4)
        assert bytes(pool.slot_view(1)) == device_block(kv, 5)


# ------------------------------------------------------- stream path, fake CUDA primitives
# The CUDA branch (staging buffers, fence, events, poller) driven on CPU tensors: streams
# and events are recorders and an event fires when the test says so. The copies are real.


@dataclass
class _FakeCuda:
    fired: bool = True
    current: _FakeStream = field(default_factory=lambda: _FakeStream())
    recorded_streams: list[tuple[torch.Tensor, _FakeStream]] = field(default_factory=list)


class _FakeStream:
    def __init__(self, *args: object, **kwargs: object) -> None:
        self.waited: list[tuple[_FakeEvent, _FakeStream | None]] = []

    def wait_event(self, event: _FakeEvent) -> None:
        self.waited.append((event, event.stream))

    def synchronize(self) -> None:
        pass


class _FakeEvent:
    cuda: _FakeCuda

    def __init__(self, *args: object, **kwargs: object) -> None:
        self.stream: _FakeStream | None = None

    def record(self, stream: _FakeStream | None = None) -> None:
        self.stream = stream

    def query(self) -> bool:
        return self.cuda.fired


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> _FakeCuda:
    cuda = _FakeCuda()
    event_class = type("_BoundFakeEvent", (_FakeEvent,), {"cuda": cuda})
    monkeypatch.setattr(torch.cuda, "Stream", _FakeStream)
    monkeypatch.setattr(torch.cuda, "Event", event_class)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: cuda.current)
    monkeypatch.setattr(
        torch.Tensor,
        "record_stream",
        lambda tensor, stream: cuda.recorded_streams.append((tensor, stream)),
    )
    return cuda


@asynccontextmanager
async def stream_path_copier(
    layout: str, staging_rows: int
) -> AsyncIterator[tuple[DeviceCopier, torch.Tensor | list[torch.Tensor], HostPool]]:
    kv = make_kv(layout, "cpu")
    block_bytes = block_bytes_of(kv)
    with HostPool(NUM_SLOTS, block_bytes) as pool:
        copier = DeviceCopier(kv, pool, staging_bytes=staging_rows * block_bytes)
        copier._is_cuda = True  # take the stream branch with CPU tensors
        async with copier:
            yield copier, kv, pool


@pytest.mark.parametrize("staging_rows", [1, 3, 64])
@pytest.mark.parametrize("layout", list(LAYOUTS))
async def test_stream_path_copies_exactly_through_the_staging_buffer(
    fake_cuda: _FakeCuda, layout: str, staging_rows: int
) -> None:
    async with stream_path_copier(layout, staging_rows) as (copier, kv, pool):
        await assert_round_trip(copier, kv, pool)


async def test_stream_path_orders_each_job_after_the_current_stream(fake_cuda: _FakeCuda) -> None:
    async with stream_path_copier("mixed_dtypes", 4) as (copier, kv, _):
        lanes = list(copier._lanes.values())
        assert len({id(lane.stream) for lane in lanes}) == 2  # one stream per direction
        for lane in lanes:  # the KV cache is marked as used on both copy streams
            assert sum(s is lane.stream for _, s in fake_cuda.recorded_streams) == len(_layers(kv))
        await copier.to_host([1], [1])
        await copier.to_device([1], [2])
        for lane in lanes:
            [(fence, fence_stream)] = lane.stream.waited
            assert fence is lane.fence and fence_stream is fake_cuda.current


async def test_stream_path_handle_completes_only_once_its_event_fired(
    fake_cuda: _FakeCuda,
) -> None:
    async with stream_path_copier("one_tensor", 4) as (copier, _, _):
        fake_cuda.fired = False
        handles = [copier.to_host([b], [b]) for b in range(3)]
        await asyncio.sleep(0.02)  # many polls, with back-off
        assert not any(h.done() for h in handles) and copier.in_flight == 3
        fake_cuda.fired = True
        await asyncio.gather(*handles)
        assert copier.in_flight == 0
        assert copier._events.created == 3 and copier._events.idle == 3
        await copier.to_host([4], [4])
        assert copier._events.created == 3  # an idle event is reused
    assert copier._lanes == {}  # staging buffers released at exit
