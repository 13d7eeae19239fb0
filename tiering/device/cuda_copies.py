"""The CUDA copy backend: KV copies on copy streams, their ends seen by polling events
(docs/architecture.md#gpu-copies). CUDA calls go through a :class:`CudaRuntime`, which
tests replace to run on CPU tensors."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from tiering.device.kv_layout import CopyChunk, CopyOutcome, Direction, KVLayout, PlannedCopy
from tiering.device.layer_progress import LayerProgress
from tiering.errors import ClosedError

# The first polls yield bare (call_soon), catching short copies at once; then a 1 ms
# timer (below ~1 ms asyncio.sleep busy-spins under uvloop).
_IMMEDIATE_POLLS = 2
_POLL_INTERVAL_S = 0.001
_IDLE_EVENTS_KEPT = 64

_log = logging.getLogger(__name__)


class CudaStream(Protocol):
    def wait_event(self, event: Any) -> None: ...
    def synchronize(self) -> None: ...


class CudaEvent(Protocol):
    def record(self, stream: Any = None) -> None: ...
    def query(self) -> bool: ...


class CudaRuntime:
    """The CUDA calls of :class:`CudaCopyBackend`, forwarded to ``torch.cuda``."""

    def new_stream(self, device: torch.device) -> CudaStream:
        return torch.cuda.Stream(device)

    def new_event(self) -> CudaEvent:
        return torch.cuda.Event()

    def current_stream(self, device: torch.device) -> CudaStream:
        return torch.cuda.current_stream(device)

    def on_device(self, device: torch.device) -> AbstractContextManager[Any]:
        return torch.cuda.device(device)

    def use_stream(self, stream: CudaStream) -> AbstractContextManager[Any]:
        return torch.cuda.stream(stream)  # type: ignore[arg-type]

    def record_stream(self, tensor: torch.Tensor, stream: CudaStream) -> None:
        tensor.record_stream(stream)  # type: ignore[arg-type]

    def mapped(self, host: torch.Tensor, device: torch.device) -> torch.Tensor:
        """``host`` (page-locked and mapped) as a tensor on ``device`` whose kernels read
        and write it in place over the link; raises if the memory is not mapped."""
        flat = host.view(-1).view(torch.uint8)
        on_device = torch.as_tensor(_CudaArray(flat), device=device)
        if on_device.data_ptr() != flat.data_ptr():  # a copy would read a stale snapshot
            raise RuntimeError("torch copied the host pool instead of mapping it")
        return on_device.view(host.dtype).view(host.shape)


class _CudaArray:
    """A ``__cuda_array_interface__`` over a host tensor's memory (with unified
    addressing, mapped host memory has the same address on the device)."""

    def __init__(self, flat: torch.Tensor) -> None:
        self._keep = flat  # the memory stays while the device tensor holds this object
        self.__cuda_array_interface__ = {
            "shape": (flat.numel(),),
            "typestr": "|u1",
            "data": (flat.data_ptr(), False),
            "version": 3,
            "strides": None,
        }


class _StagingBuffer:
    """A ``[rows, block words]`` buffer that grows on demand up to ``max_rows``."""

    def __init__(self, layout: KVLayout, max_rows: int) -> None:
        self._layout = layout
        self._max_rows = max_rows
        self._buffer: torch.Tensor | None = None

    def rows(self, n: int, runtime: CudaRuntime, also: CudaStream | None) -> torch.Tensor:
        """The first ``n`` rows; call it in the context of the stream that writes them
        first, ``also`` being the other stream that uses them, if any."""
        buffer = self._buffer
        if buffer is None or buffer.shape[0] < n:
            # Made on the current stream and marked as used on ``also``: dropping the
            # old buffer waits for both streams.
            rows = min(self._max_rows, max(n, 2 * (0 if buffer is None else buffer.shape[0])))
            layout = self._layout
            buffer = torch.empty(
                (rows, layout.block_words), dtype=layout.word, device=layout.device
            )
            if also is not None:
                runtime.record_stream(buffer, also)
            self._buffer = buffer
        return buffer[:n]


@dataclass(slots=True)
class _Lane:
    """One direction's pipeline: ``stream`` carries staged blocks over the link,
    ``kernels`` gathers or scatters their rows on the device; staging buffer ``b`` is
    ``filled[b]`` for its consumer and ``emptied[b]`` for its producer (``layers``: the
    rows of one layer in a layer-major load); ``fence`` orders a job after the caller's
    stream, ``joined`` ends it on one stream."""

    stream: CudaStream
    kernels: CudaStream
    staging: tuple[_StagingBuffer, _StagingBuffer]
    layers: _StagingBuffer
    filled: tuple[CudaEvent, CudaEvent]
    emptied: tuple[CudaEvent, CudaEvent]
    fence: CudaEvent
    joined: CudaEvent
    turn: int = 0  # the staging buffer the next chunk uses

    def streams(self) -> tuple[CudaStream, CudaStream]:
        return self.stream, self.kernels


@dataclass(frozen=True, slots=True)
class _LayerMarker:
    """A layer's copies for a :class:`~tiering.device.layer_progress.LayerProgress`: an event
    recorded on the copy stream after them."""

    event: CudaEvent
    runtime: CudaRuntime
    device: torch.device

    def query(self) -> bool:
        return self.event.query()

    def wait(self) -> None:
        self.runtime.current_stream(self.device).wait_event(self.event)


@dataclass(slots=True)
class _Pending:
    event: CudaEvent | None = None
    error: BaseException | None = None  # raised while enqueuing; reported once drained


class CudaCopyBackend:
    """Runs copies between a CUDA KV cache and a pinned host pool on copy streams; a
    :class:`~tiering.device.copier.CopyBackend`."""

    def __init__(self, *, runtime: CudaRuntime | None = None) -> None:
        self._runtime = runtime or CudaRuntime()
        self._idle_events: list[CudaEvent] = []  # fired events kept for reuse
        self.events_created = 0  # CUDA events made so far, pooled and reused
        self._lanes: dict[Direction, _Lane] = {}
        self._pending: dict[PlannedCopy, _Pending] = {}
        self._layout: KVLayout | None = None
        self._host: torch.Tensor | None = None
        self._host_mapped: torch.Tensor | None = None  # the pool as kernels see it
        self._on_done: Callable[[Sequence[CopyOutcome]], None] | None = None
        self._task_group: asyncio.TaskGroup | None = None
        self._poller: asyncio.Task[None] | None = None
        self._wakeup: asyncio.Event | None = None
        self._closing = False

    async def open(
        self,
        layout: KVLayout,
        host: torch.Tensor,
        *,
        max_rows: int,
        on_done: Callable[[Sequence[CopyOutcome]], None],
    ) -> None:
        """Make both lanes (two staging buffers of up to ``max_rows`` rows each) and start
        the poller; ClosedError if opened before."""
        if self._layout is not None:
            raise ClosedError("a CudaCopyBackend can be opened only once")
        self._layout, self._host, self._on_done = layout, host, on_done
        runtime, device = self._runtime, layout.device
        with runtime.on_device(device):
            for direction in Direction:
                lane = _Lane(
                    runtime.new_stream(device),
                    runtime.new_stream(device),
                    (_StagingBuffer(layout, max_rows), _StagingBuffer(layout, max_rows)),
                    _StagingBuffer(layout, max_rows),
                    (runtime.new_event(), runtime.new_event()),
                    (runtime.new_event(), runtime.new_event()),
                    runtime.new_event(),
                    runtime.new_event(),
                )
                self._lanes[direction] = lane
                # So that freeing the KV cache waits for copies queued on these streams.
                # Other allocators may refuse: the copier's references and draining exit
                # still cover its lifetime.
                for layer in layout.layers:
                    for stream in lane.streams():
                        with contextlib.suppress(RuntimeError):
                            runtime.record_stream(layer, stream)
            try:
                self._host_mapped = runtime.mapped(host, device)
            except Exception as exc:  # layer-by-layer loads then mark after staged chunks
                _log.info("CudaCopyBackend: the host pool is not mapped for kernels: %r", exc)
        self._wakeup = asyncio.Event()
        self._task_group = asyncio.TaskGroup()
        await self._task_group.__aenter__()
        self._poller = self._task_group.create_task(
            self._poll_events(), name="CudaCopyBackend.poller"
        )

    def submit(self, copy: PlannedCopy) -> None:
        """Enqueue ``copy`` on its direction's lane, ordered after the caller's stream."""
        assert self._layout is not None and self._wakeup is not None
        lane = self._lanes[copy.direction]
        pending = _Pending()
        self._pending[copy] = pending
        runtime, device = self._runtime, self._layout.device
        layer_major = copy.progress is not None and self._host_mapped is not None
        # A job starts on one stream of the lane and ends on the other (a layer-major
        # load runs on the scatter stream alone).
        if layer_major:
            first = last = lane.kernels
        elif copy.direction is Direction.TO_HOST:
            first, last = lane.kernels, lane.stream
        else:
            first, last = lane.stream, lane.kernels
        try:
            with runtime.on_device(device):
                # Order after everything already queued on the caller's stream, through a
                # reused event (Stream.wait_stream would create one per job).
                lane.fence.record(runtime.current_stream(device))
                for stream in lane.streams():
                    stream.wait_event(lane.fence)
                try:
                    if layer_major:
                        self._load_layer_major(copy, lane)
                    else:
                        chunks = copy.chunks
                        for n, chunk in enumerate(chunks, 1):
                            # The last chunk completes each layer: mark it there.
                            marks = copy.progress if n == len(chunks) else None
                            self._copy_chunk(copy.direction, chunk, lane, marks)
                except Exception as exc:
                    pending.error = exc  # reported once what was enqueued has drained
                # The end waits for both streams, even after a failure part-way.
                lane.joined.record(first)
                last.wait_event(lane.joined)
                if self._idle_events:
                    pending.event = self._idle_events.pop()
                else:
                    self.events_created += 1
                    pending.event = runtime.new_event()
                pending.event.record(last)
        except Exception as exc:
            # No event marks the job's end and copies may be queued: wait for the lane
            # (blocking, on this failure path only) so the job never ends before them.
            for stream in lane.streams():
                with contextlib.suppress(Exception):
                    stream.synchronize()
            self._report([(copy, pending.error or exc)])
            return
        self._wakeup.set()

    def drain_blocking(self) -> None:
        for lane in self._lanes.values():
            for stream in lane.streams():
                # A failure surfaces again in the per-job event query below.
                with contextlib.suppress(Exception):
                    stream.synchronize()
        self._report_fired()

    async def aclose(self) -> None:
        self._closing = True
        if self._task_group is not None:
            task_group, self._task_group = self._task_group, None
            assert self._wakeup is not None
            self._wakeup.set()
            # Not the caller's exception: a TaskGroup would wrap it in an ExceptionGroup.
            await task_group.__aexit__(None, None, None)
        # Every job's event has fired: hand the staging buffers' device memory back now.
        self._lanes.clear()

    def close(self) -> None:
        self._closing = True
        self._task_group = None
        if self._poller is not None:
            self._poller.cancel()
            self._poller = None
        self._lanes.clear()

    def _copy_chunk(
        self, direction: Direction, chunk: CopyChunk, lane: _Lane, progress: LayerProgress | None
    ) -> None:
        """Enqueue one chunk through the lane's next staging buffer: a gather of every
        layer's rows then one DMA per slot run (to the host), or the DMAs then the
        scatters (to the device), each on its stream, ordered by the buffer's events."""
        assert self._layout is not None and self._host is not None
        host, runtime, columns = self._host, self._runtime, self._layout.columns
        b, lane.turn = lane.turn, 1 - lane.turn
        staging, filled, emptied = lane.staging[b], lane.filled[b], lane.emptied[b]
        n = len(chunk.device_ids)
        if direction is Direction.TO_HOST:
            with runtime.use_stream(lane.kernels):
                lane.kernels.wait_event(emptied)  # its last DMA out has run
                rows = staging.rows(n, runtime, lane.stream)
                index = self._index_tensor(chunk.device_ids)
                for layer, offset, width in columns:
                    torch.index_select(layer, 0, index, out=rows[:, offset : offset + width])
                filled.record(lane.kernels)
            with runtime.use_stream(lane.stream):
                lane.stream.wait_event(filled)
                for run in chunk.runs:
                    host[run.first_slot : run.first_slot + run.length].copy_(
                        rows[run.first_row : run.first_row + run.length], non_blocking=True
                    )
                emptied.record(lane.stream)
            return
        with runtime.use_stream(lane.stream):
            lane.stream.wait_event(emptied)  # its last scatter has run
            rows = staging.rows(n, runtime, lane.kernels)
            for run in chunk.runs:
                rows[run.first_row : run.first_row + run.length].copy_(
                    host[run.first_slot : run.first_slot + run.length], non_blocking=True
                )
            filled.record(lane.stream)
        with runtime.use_stream(lane.kernels):
            lane.kernels.wait_event(filled)
            index = self._index_tensor(chunk.device_ids)
            for i, (layer, offset, width) in enumerate(columns):
                layer.index_copy_(0, index, rows[:, offset : offset + width])
                if progress is not None:
                    event = runtime.new_event()  # the caller keeps it: not pooled
                    event.record(lane.kernels)
                    progress.mark(i, _LayerMarker(event, runtime, self._layout.device))
            emptied.record(lane.kernels)

    def _load_layer_major(self, copy: PlannedCopy, lane: _Lane) -> None:
        """Enqueue a load that marks its layers: per layer and chunk, one kernel reads the
        rows from the mapped host pool and one scatters them; then the layer's event."""
        assert self._layout is not None and self._host_mapped is not None
        assert copy.progress is not None
        host, runtime, progress = self._host_mapped, self._runtime, copy.progress
        with runtime.use_stream(lane.kernels):
            plans = []
            for chunk in copy.chunks:
                slots = [
                    s for r in chunk.runs for s in range(r.first_slot, r.first_slot + r.length)
                ]
                ids = self._index_tensor(chunk.device_ids)
                plans.append((ids, self._index_tensor(tuple(slots))))
            rows = max(len(chunk.device_ids) for chunk in copy.chunks)
            flat = lane.layers.rows(rows, runtime, None).view(-1)
            for i, (layer, offset, width) in enumerate(self._layout.columns):
                part = host[:, offset : offset + width]
                for ids, slots in plans:
                    staged = flat[: len(ids) * width].view(len(ids), width)
                    torch.index_select(part, 0, slots, out=staged)
                    layer.index_copy_(0, ids, staged)
                event = runtime.new_event()  # the caller keeps it: not pooled
                event.record(lane.kernels)
                progress.mark(i, _LayerMarker(event, runtime, self._layout.device))

    def _index_tensor(self, indices: tuple[int, ...]) -> torch.Tensor:
        """``indices`` (device block ids or slots) on the device, for the current stream."""
        assert self._layout is not None
        if self._layout.device.type != "cuda":
            return torch.tensor(indices, dtype=torch.int64)
        # Pinned so the upload is asynchronous on the current stream; the pinned allocator
        # keeps the host block until that upload has run.
        staged = torch.tensor(indices, dtype=torch.int64, pin_memory=True)
        return staged.to(self._layout.device, non_blocking=True)

    async def _poll_events(self) -> None:
        assert self._wakeup is not None
        unfinished_polls = 0
        while True:
            if not self._pending:
                if self._closing:
                    return
                self._wakeup.clear()
                await self._wakeup.wait()
                unfinished_polls = 0
                continue
            if self._report_fired():
                unfinished_polls = 0
            else:
                unfinished_polls += 1
            await asyncio.sleep(0 if unfinished_polls <= _IMMEDIATE_POLLS else _POLL_INTERVAL_S)

    def _report_fired(self) -> bool:
        fired: list[CopyOutcome] = []
        for copy, pending in self._pending.items():
            if pending.event is None:
                continue
            try:
                if not pending.event.query():
                    continue
                error = pending.error
            except Exception as exc:  # a failed kernel surfaces here (sticky CUDA error)
                error = exc
            fired.append((copy, error))
        if fired:
            self._report(fired)
        return bool(fired)

    def _report(self, outcomes: list[CopyOutcome]) -> None:
        idle = self._idle_events
        for copy, _ in outcomes:
            pending = self._pending.pop(copy, None)
            if pending is not None and pending.event is not None and len(idle) < _IDLE_EVENTS_KEPT:
                idle.append(pending.event)
        assert self._on_done is not None
        self._on_done(outcomes)
