"""CudaCopyBackend: copy streams, staging, fences and pooled events polled by the loop.

Without a GPU the stream path runs on CPU tensors through a runtime the test builds:
streams and events are recorders, and an event fires when the test says so. The copies
(gathers, staging, slot runs) are real. The tests marked ``cuda`` use the real runtime.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from contextlib import AbstractContextManager, asynccontextmanager
from typing import Any

import pytest
import torch
from _device_kv import (
    KV,
    LAYOUTS,
    NUM_BLOCKS,
    NUM_SLOTS,
    assert_round_trip,
    block_bytes_of,
    device_block,
    failing_index_copy,
    layers_of,
    make_kv,
    opened,
    slot_bytes,
)

from tiering.device.copier import DeviceCopier
from tiering.device.cuda_copies import CudaCopyBackend, CudaRuntime
from tiering.device.host_pool import HostPool
from tiering.device.kv_layout import Direction, describe_kv_caches
from tiering.device.layer_progress import LayerProgress
from tiering.errors import TransferError


class _FakeStream:
    def __init__(self) -> None:
        self.waited: list[tuple[_FakeEvent, _FakeStream | None]] = []
        self.synchronized = 0

    def wait_event(self, event: Any) -> None:
        self.waited.append((event, event.stream))

    def synchronize(self) -> None:
        self.synchronized += 1


class _FakeEvent:
    def __init__(self, runtime: _FakeRuntime) -> None:
        self.runtime = runtime
        self.stream: _FakeStream | None = None

    def record(self, stream: Any = None) -> None:
        self.stream = stream

    def query(self) -> bool:
        return self.runtime.fired


class _FakeRuntime(CudaRuntime):
    """Streams and events that record what they are asked; events fire on ``fired``."""

    def __init__(self, *, maps_host: bool = False) -> None:
        self.maps_host = maps_host  # kernels may read the host pool in place
        self.fired = True
        self.current = _FakeStream()
        self.streams: list[_FakeStream] = []
        self.recorded_streams: list[tuple[torch.Tensor, Any]] = []

    def new_stream(self, device: torch.device) -> _FakeStream:
        self.streams.append(_FakeStream())
        return self.streams[-1]

    def new_event(self) -> _FakeEvent:
        return _FakeEvent(self)

    def current_stream(self, device: torch.device) -> _FakeStream:
        return self.current

    def on_device(self, device: torch.device) -> AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def use_stream(self, stream: Any) -> AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        self.recorded_streams.append((tensor, stream))

    def mapped(self, host: torch.Tensor, device: torch.device) -> torch.Tensor:
        if not self.maps_host:
            raise RuntimeError("the fake pool is not mapped")
        return host  # a CPU "device": kernels see the pool as it is


def lane(runtime: _FakeRuntime, direction: Direction) -> tuple[_FakeStream, _FakeStream]:
    """The stream that carries ``direction``'s blocks over the link and the one that
    gathers or scatters their rows: the backend opens them in that order, per direction."""
    i = list(Direction).index(direction)
    return runtime.streams[2 * i], runtime.streams[2 * i + 1]


@asynccontextmanager
async def stream_path(
    layout: str, staging_rows: int, *, maps_host: bool = False
) -> AsyncIterator[tuple[DeviceCopier, KV, HostPool, CudaCopyBackend, _FakeRuntime]]:
    kv = make_kv(layout, "cpu")
    block_bytes = block_bytes_of(kv)
    runtime = _FakeRuntime(maps_host=maps_host)
    backend = CudaCopyBackend(runtime=runtime)
    with HostPool(NUM_SLOTS, block_bytes) as pool:
        staging = staging_rows * block_bytes
        async with DeviceCopier(kv, pool, staging_bytes=staging, backend=backend) as copier:
            yield copier, kv, pool, backend, runtime


@pytest.mark.parametrize("staging_rows", [1, 3, 64])
@pytest.mark.parametrize("layout", list(LAYOUTS))
async def test_stream_path_copies_exactly_through_the_staging_buffer(
    layout: str, staging_rows: int
) -> None:
    async with stream_path(layout, staging_rows) as (copier, kv, pool, _, _):
        await assert_round_trip(copier, kv, pool)


async def test_stream_path_orders_each_job_after_the_current_stream() -> None:
    async with stream_path("mixed_dtypes", 4) as (copier, kv, _, _, runtime):
        streams = [s for d in Direction for s in lane(runtime, d)]
        assert len({id(s) for s in streams}) == len(runtime.streams) == 4  # two per direction
        for stream in streams:  # the KV cache is marked as used on every copy stream
            used = sum(s is stream for t, s in runtime.recorded_streams if len(t) == NUM_BLOCKS)
            assert used == len(layers_of(kv))
        await copier.to_host([1], [1])
        await copier.to_device([1], [2])
        for direction in Direction:  # both streams wait for one fence on the current stream
            link, kernels = lane(runtime, direction)
            assert link.waited[0][1] is runtime.current
            assert kernels.waited[0] == link.waited[0]


@pytest.mark.parametrize("direction", list(Direction))
async def test_stream_path_pipelines_chunks_through_two_staging_buffers(
    direction: Direction,
) -> None:
    async with stream_path("mixed_dtypes", 1) as (copier, kv, pool, _, runtime):
        pool.tensor.copy_(torch.randint(0, 256, pool.tensor.shape, dtype=torch.uint8))
        link, kernels = lane(runtime, direction)
        if direction is Direction.TO_HOST:  # three chunks of one block each
            await copier.to_host([0, 1, 2], [3, 4, 5])
            producer, consumer = kernels, link
        else:
            await copier.to_device([3, 4, 5], [6, 7, 8])
            producer, consumer = link, kernels
        blocks = (0, 1, 2) if direction is Direction.TO_HOST else (6, 7, 8)
        for block, slot in zip(blocks, (3, 4, 5), strict=True):
            assert slot_bytes(pool, slot) == device_block(kv, block)
        # The producer reuses buffer b once the consumer has emptied it (buffers 0, 1,
        # then 0 again, only that one recorded by then); the consumer takes each chunk
        # once filled, then joins the producer's stream to end the job.
        made = [(e, s) for e, s in producer.waited[1:]]  # type: ignore[attr-defined]
        assert [s for _, s in made] == [None, None, consumer]
        assert made[0][0] is made[2][0] and made[0][0] is not made[1][0]
        taken = [s for _, s in consumer.waited[1:]]  # type: ignore[attr-defined]
        assert taken == [producer] * 4
        # Staging memory is marked as used on the consumer's stream too.
        staged = [s for t, s in runtime.recorded_streams if len(t) == 1]
        assert staged and all(s is consumer for s in staged)


async def test_stream_path_handle_completes_only_once_its_event_fired() -> None:
    async with stream_path("one_tensor", 4) as (copier, _, _, backend, runtime):
        runtime.fired = False
        handles = [copier.to_host([b], [b]) for b in range(3)]
        for _ in range(20):  # many polls, past the back-off to the timer
            await asyncio.sleep(0.001)
        assert not any(h.done() for h in handles) and copier.statistics().jobs_in_flight == 3
        runtime.fired = True
        await asyncio.gather(*handles)
        assert copier.statistics().jobs_in_flight == 0
        assert backend.events_created == 3
        await copier.to_host([4], [4])
        assert backend.events_created == 3  # an idle event is reused
    assert backend._lanes == {}  # staging buffers released at exit


@pytest.mark.parametrize("maps_host", [False, True])
@pytest.mark.parametrize("staging_rows", [1, 64])
@pytest.mark.parametrize("layout", ["one_tensor", "mixed_dtypes"])
async def test_stream_path_marks_each_layer_behind_an_event_on_the_scatter_stream(
    layout: str, staging_rows: int, maps_host: bool
) -> None:
    path = stream_path(layout, staging_rows, maps_host=maps_host)
    async with path as (copier, kv, _pool, _, runtime):
        await copier.to_host([1, 2, 3], [0, 1, 2])
        want = [t[[1, 2, 3]].view(torch.uint8).clone() for t in layers_of(kv)]
        for t in layers_of(kv):
            t.zero_()
        runtime.fired = False
        progress = LayerProgress(copier.num_layers)
        handle = copier.to_device([0, 1, 2], [5, 6, 7], progress=progress)
        # Marked at enqueue, once per layer even across chunks, and ready only once
        # the marker's event fires; the bytes are already there (the fake copies at once).
        markers = progress._events
        assert all(m is not None for m in markers) and len(markers) == len(layers_of(kv))
        assert len({id(m.event) for m in markers}) == len(markers)  # type: ignore[union-attr]
        link, scatter = lane(runtime, Direction.TO_DEVICE)
        assert all(m.event.stream is scatter for m in markers)  # type: ignore[union-attr]
        assert not any(progress.ready(i) for i in range(progress.num_layers))
        assert (len(link.waited) == 1) is maps_host  # layer-major: the link only fences
        progress.wait(0, timeout=0)  # the host does not wait: the current stream does
        assert runtime.current.waited == [(markers[0].event, scatter)]  # type: ignore[union-attr]
        runtime.fired = True
        await handle
        assert all(progress.ready(i) for i in range(progress.num_layers))
        for t, w in zip(layers_of(kv), want, strict=True):
            assert torch.equal(t[[5, 6, 7]].view(torch.uint8), w)


class _LayerOrder(LayerProgress):
    """Records, as each layer is marked, which layers' rows of ``ids`` already hold what
    host ``slots`` hold."""

    def __init__(self, kv: KV, pool: HostPool, slots: list[int], ids: list[int]) -> None:
        layout = describe_kv_caches(kv)
        super().__init__(len(layout.layers))
        host = pool.tensor.view(layout.word)
        self.want = [host[slots, o : o + w].clone() for _, o, w in layout.columns]
        self.layers, self.ids = layout.layers, ids
        self.seen: list[list[bool]] = []

    def mark(self, layer: int, event: Any = None) -> None:
        self.seen.append(
            [torch.equal(t[self.ids], w) for t, w in zip(self.layers, self.want, strict=True)]
        )
        super().mark(layer, event)


@pytest.mark.parametrize("layout", ["one_tensor", "mixed_dtypes"])
async def test_a_layer_by_layer_load_from_a_mapped_pool_lands_layer_after_layer(
    layout: str,
) -> None:
    async with stream_path(layout, 1, maps_host=True) as (copier, kv, pool, _, runtime):
        pool.tensor.copy_(torch.randint(0, 256, pool.tensor.shape, dtype=torch.uint8))
        for t in layers_of(kv):
            t.zero_()
        slots, ids = [2, 0, 9], [5, 6, 7]  # three chunks of one row
        progress = _LayerOrder(kv, pool, slots, ids)
        await copier.to_device(slots, ids, progress=progress)
        n = progress.num_layers
        assert progress.seen == [[j <= i for j in range(n)] for i in range(n)]
        for slot, block in zip(slots, ids, strict=True):
            assert slot_bytes(pool, slot) == device_block(kv, block)
        link, kernels = lane(runtime, Direction.TO_DEVICE)
        assert link.waited == kernels.waited[:1]  # the fence only
        assert link.waited[0][1] is runtime.current
        # A load that marks no layers still stages whole blocks through the link.
        await copier.to_device([1], [0])
        assert len(link.waited) > 1  # type: ignore[attr-defined]
        assert slot_bytes(pool, 1) == device_block(kv, 0)


@pytest.mark.parametrize("maps_host", [False, True])
async def test_stream_path_an_enqueue_failure_fails_the_layers_not_marked(
    monkeypatch: pytest.MonkeyPatch, maps_host: bool
) -> None:
    async with stream_path("mixed_dtypes", 64, maps_host=maps_host) as (copier, _, _, _, _):
        progress = LayerProgress(copier.num_layers)
        with (
            failing_index_copy(monkeypatch, 3, "simulated scatter fault"),  # the third layer
            pytest.raises(TransferError, match="simulated scatter fault"),
        ):
            await copier.to_device([0], [1], progress=progress)
        progress.wait(1)
        with pytest.raises(TransferError, match="simulated scatter fault"):
            progress.wait(2)


@pytest.mark.cuda
@pytest.mark.parametrize("layout", ["one_tensor", "mixed_dtypes"])
async def test_cuda_a_layer_read_after_its_wait_sees_the_loaded_bytes(layout: str) -> None:
    async with opened(layout, "cuda") as (copier, kv, _pool):
        assert isinstance(copier.backend, CudaCopyBackend)
        assert copier.backend._host_mapped is not None  # layer-major from the mapped pool
        want = [t.clone() for t in layers_of(kv)]
        await copier.to_host([1, 2, 3], [0, 1, 2])
        for t in layers_of(kv):
            t.zero_()
        progress = LayerProgress(copier.num_layers)
        torch.cuda._sleep(100_000_000)  # the copy queues behind a busy compute stream
        handle = copier.to_device([0, 1, 2], [5, 6, 7], progress=progress)
        seen = []
        for i, t in enumerate(layers_of(kv)):
            progress.wait(i)  # the compute stream waits for layer i's copies only
            seen.append(t[[5, 6, 7]].clone())  # a kernel on the compute stream
        torch.cuda.synchronize()
        for got, w in zip(seen, want, strict=True):
            assert torch.equal(got.view(torch.uint8), w[[1, 2, 3]].view(torch.uint8))
        await handle


async def test_stream_path_exit_waits_for_events_and_a_cancelled_exit_synchronizes() -> None:
    runtime = _FakeRuntime()
    backend = CudaCopyBackend(runtime=runtime)
    kv = make_kv("one_tensor", "cpu")
    with HostPool(NUM_SLOTS, block_bytes_of(kv)) as pool:
        copier = DeviceCopier(kv, pool, backend=backend)
        entered = asyncio.Event()
        handles = []

        async def body() -> None:
            async with copier:
                runtime.fired = False
                handles.append(copier.to_host([2], [3]))
                entered.set()
                await asyncio.Event().wait()

        task = asyncio.create_task(body())
        await entered.wait()
        task.cancel()
        for _ in range(100):
            if copier.closed:
                break
            await asyncio.sleep(0)
        assert copier.closed and not handles[0].done()
        runtime.fired = True  # what a synchronized stream would show
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert handles[0].done() and handles[0].error is None
        assert all(s.synchronized == 1 for s in runtime.streams)
        assert copier.statistics().jobs_in_flight == 0 and backend._lanes == {}


async def test_stream_path_an_enqueue_failure_fails_only_that_job(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with stream_path("mixed_dtypes", 4) as (copier, _, _, _, _):
        with monkeypatch.context() as patch:

            def broken_scatter(*args: object, **kwargs: object) -> None:
                raise RuntimeError("simulated scatter fault")

            patch.setattr(torch.Tensor, "index_copy_", broken_scatter)
            load = copier.to_device([1], [1])
            with pytest.raises(TransferError, match="simulated scatter fault"):
                await load
        await copier.to_host([5], [5])
        assert copier.statistics().failures == {"to_device copy failed": 1}


# --------------------------------------------------------------------------- CUDA only


@pytest.mark.cuda
async def test_cuda_events_are_pooled_and_reused() -> None:
    backend = CudaCopyBackend()
    async with opened("mixed_dtypes", "cuda", backend=backend) as (copier, _, _):
        for i in range(40):
            await copier.to_host([i % NUM_BLOCKS], [i % NUM_SLOTS])
        assert backend.events_created == 1
        await asyncio.gather(*(copier.to_host([b], [b]) for b in range(NUM_SLOTS)))
        assert backend.events_created <= NUM_SLOTS
        assert backend.events_idle == backend.events_created
        assert copier.statistics().jobs_in_flight == 0


@pytest.mark.cuda
async def test_cuda_unawaited_copies_are_completed_by_the_poller() -> None:
    async with opened("mixed_dtypes", "cuda") as (copier, _, _):
        handles = [copier.to_host([b], [b]) for b in range(NUM_SLOTS)]
        ended = asyncio.Event()
        handles[-1].add_done_callback(lambda _: ended.set())
        await ended.wait()
        await asyncio.gather(*handles)
        assert all(h.done() for h in handles)
