"""Device transfers: copy KV blocks between the device KV cache and host-pool slots.

The device KV cache is one tensor or a list of per-layer tensors whose first dimension is
the block id. A block's bytes in a host slot are its rows across those tensors, in list
order: ``[layer 0 row][layer 1 row]...``.

A job is planned by a pure function (:func:`plan_copy`): its (device block, slot) pairs are
ordered by slot and cut into chunks that fit a bounded staging buffer laid out
``[rows, block_bytes]``; each chunk lists the runs of consecutive slots it covers. A chunk
moves with one gather (or scatter) per layer between the device tensors and the staging
buffer, plus one copy per run between the staging buffer and the host pool, whatever the
number of blocks. The same code runs on both paths:

- CUDA: everything is enqueued on a copy stream of its own (one per direction, so stores
  and loads use both copy engines), ordered after the caller's current stream; one pooled
  CUDA event per job marks its end, and one poller task on the event loop completes the
  job's handle when the event has fired.
- CPU (no CUDA): the job runs in one hop on a small thread pool the copier owns (torch
  releases the GIL in its kernels); the handle completes when that call returns.
"""

from __future__ import annotations

import asyncio
import contextlib
import operator
import threading
from collections.abc import Callable, Generator, Sequence
from concurrent.futures import Future as ConcurrentFuture
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from enum import Enum
from types import TracebackType
from typing import Any, Self

import torch

from tiering.errors import ClosedError, InvalidArgumentError, TransferError
from tiering.host_pool import HostPool
from tiering.validation import positive_int
from tiering.workers import init_io_worker

DEFAULT_STAGING_BYTES = 64 << 20
"""Default size of one staging buffer; a job bigger than this is copied in chunks."""

_IMMEDIATE_POLLS = 2
"""Event polls done with a bare yield (no timer) before backing off to ``_POLL_INTERVAL_S``."""
_POLL_INTERVAL_S = 0.001
"""Back-off between event polls: below ~1 ms ``asyncio.sleep`` busy-spins under uvloop."""
_IDLE_EVENTS_KEPT = 64

# Widest first: gathers move whole words when every row and offset allows it.
_WORD_DTYPES = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))

KVCaches = torch.Tensor | Sequence[torch.Tensor]


# --------------------------------------------------------------------------- planning


@dataclass(frozen=True, slots=True)
class SlotRun:
    """``length`` consecutive host slots from ``first_slot``, staging rows from ``first_row``."""

    first_slot: int
    first_row: int
    length: int


@dataclass(frozen=True, slots=True)
class CopyChunk:
    """A part of a job that fits the staging buffer.

    Staging row ``r`` holds device block ``device_ids[r]``; ``runs`` map the rows, in order,
    onto host slots and together cover every row exactly once.
    """

    device_ids: tuple[int, ...]
    runs: tuple[SlotRun, ...]


def plan_copy(
    device_ids: Sequence[int], slots: Sequence[int], max_rows: int
) -> tuple[CopyChunk, ...]:
    """Plan a job copying device block ``device_ids[i]`` to/from host slot ``slots[i]``.

    Pairs are ordered by slot so that slots given in any order still form the fewest runs;
    the order inside a job carries no meaning. Each chunk holds at most ``max_rows`` pairs.
    Equal slots (allowed as sources) stay separate runs. Pure: does no I/O.

    Raises InvalidArgumentError if the lengths differ or ``max_rows < 1``.
    """
    if len(device_ids) != len(slots):
        raise InvalidArgumentError(f"{len(device_ids)} device block ids but {len(slots)} slots")
    if max_rows < 1:
        raise InvalidArgumentError(f"max_rows must be at least 1, got {max_rows}")
    order = sorted(range(len(slots)), key=slots.__getitem__)
    chunks: list[CopyChunk] = []
    for start in range(0, len(order), max_rows):
        part = order[start : start + max_rows]
        runs: list[SlotRun] = []
        for row, pair in enumerate(part):
            slot = slots[pair]
            last = runs[-1] if runs else None
            if last is not None and slot == last.first_slot + last.length:
                runs[-1] = SlotRun(last.first_slot, last.first_row, last.length + 1)
            else:
                runs.append(SlotRun(slot, row, 1))
        chunks.append(CopyChunk(tuple(device_ids[pair] for pair in part), tuple(runs)))
    return tuple(chunks)


# --------------------------------------------------------------------------- layout


def _copy_runs_directly(
    direction: _Direction,
    columns: tuple[tuple[torch.Tensor, int, int], ...],
    host: torch.Tensor,
    index: torch.Tensor,
    runs: tuple[SlotRun, ...],
) -> None:
    for run in runs:
        ids = index[run.first_row : run.first_row + run.length]
        slots = host[run.first_slot : run.first_slot + run.length]
        for layer, offset, width in columns:
            if direction is _Direction.TO_HOST:
                torch.index_select(layer, 0, ids, out=slots[:, offset : offset + width])
            else:
                layer.index_copy_(0, ids, slots[:, offset : offset + width])


@dataclass(frozen=True, slots=True)
class _Layout:
    """The device KV cache seen as words: layer ``i`` fills columns ``offsets[i]:+widths[i]``."""

    layers: tuple[torch.Tensor, ...]  # each [num_blocks, widths[i]] of dtype `word`
    offsets: tuple[int, ...]
    widths: tuple[int, ...]
    word: torch.dtype
    word_bytes: int
    num_blocks: int
    block_bytes: int
    device: torch.device


def _describe_kv_caches(kv_caches: object) -> _Layout:
    if isinstance(kv_caches, torch.Tensor):
        tensors: list[torch.Tensor] = [kv_caches]
    elif isinstance(kv_caches, Sequence) and not isinstance(kv_caches, str | bytes):
        tensors = list(kv_caches)
    else:
        raise InvalidArgumentError(
            f"kv_caches must be a tensor or a sequence of tensors, got {type(kv_caches).__name__}"
        )
    if not tensors:
        raise InvalidArgumentError("kv_caches is empty")
    first = tensors[0]
    if not isinstance(first, torch.Tensor) or first.dim() == 0:
        raise InvalidArgumentError("kv_caches[0] must be a tensor with a block dim")
    num_blocks, device = first.shape[0], first.device
    if num_blocks <= 0:
        raise InvalidArgumentError("the device KV cache has no blocks")
    if device.type not in ("cuda", "cpu"):
        raise InvalidArgumentError(f"device KV cache on {device}: only cuda and cpu are supported")
    row_bytes: list[int] = []
    for i, tensor in enumerate(tensors):
        if not isinstance(tensor, torch.Tensor) or tensor.dim() == 0:
            raise InvalidArgumentError(f"kv_caches[{i}] must be a tensor with a block dim")
        if tensor.shape[0] != num_blocks:
            raise InvalidArgumentError(
                f"kv_caches[{i}] has {tensor.shape[0]} blocks, kv_caches[0] has {num_blocks}"
            )
        if tensor.device != device:
            raise InvalidArgumentError(f"kv_caches[{i}] is on {tensor.device}, not {device}")
        if not tensor.is_contiguous():
            raise InvalidArgumentError(f"kv_caches[{i}] is not contiguous")
        if tensor.is_sparse or tensor.is_quantized:
            raise InvalidArgumentError(f"kv_caches[{i}] must be a dense tensor")
        nbytes = tensor.numel() // num_blocks * tensor.element_size()
        if nbytes == 0:
            raise InvalidArgumentError(f"kv_caches[{i}] has empty rows")
        row_bytes.append(nbytes)
    word_bytes, word = next(
        (size, dtype)
        for size, dtype in _WORD_DTYPES
        if all(n % size == 0 for n in row_bytes) and all(t.data_ptr() % size == 0 for t in tensors)
    )
    layers = tuple(t.detach().view(num_blocks, -1).view(torch.uint8).view(word) for t in tensors)
    widths = tuple(n // word_bytes for n in row_bytes)
    offsets = tuple(sum(widths[:i]) for i in range(len(widths)))
    return _Layout(
        layers=layers,
        offsets=offsets,
        widths=widths,
        word=word,
        word_bytes=word_bytes,
        num_blocks=num_blocks,
        block_bytes=sum(row_bytes),
        device=device,
    )


def kv_block_bytes(kv_caches: KVCaches) -> int:
    """Bytes of one block of ``kv_caches``: the sum of its rows' bytes across the tensors.

    Raises InvalidArgumentError if the layout is malformed (as :class:`DeviceCopier` would).
    """
    return _describe_kv_caches(kv_caches).block_bytes


def _as_index_list(name: str, values: object) -> list[int]:
    if isinstance(values, str | bytes) or not hasattr(values, "__len__"):
        raise InvalidArgumentError(f"{name} must be a sequence of ints, got {values!r}")
    out: list[int] = []
    for value in values:  # type: ignore[attr-defined]
        if isinstance(value, bool):
            raise InvalidArgumentError(f"{name} must hold ints, got {value!r}")
        try:
            out.append(operator.index(value))
        except TypeError:
            raise InvalidArgumentError(f"{name} must hold ints, got {value!r}") from None
    return out


def _check_range(name: str, values: list[int], limit: int, *, unique: bool) -> None:
    for value in values:
        if not 0 <= value < limit:
            raise InvalidArgumentError(f"{name}: {value} is outside 0..{limit - 1}")
    if unique and len(set(values)) != len(values):
        seen: set[int] = set()
        for value in values:
            if value in seen:
                raise InvalidArgumentError(
                    f"{name}: {value} appears twice; a destination is written once"
                )
            seen.add(value)


# --------------------------------------------------------------------------- handles


class CopyHandle:
    """A started copy. ``await handle`` returns once the bytes are in place.

    Awaiting raises :class:`~tiering.errors.TransferError` if the copy failed. The copy runs
    whether or not anyone awaits the handle, and cancelling a task that awaits it does not
    cancel the copy: the handle turns done only when the copy has really ended, so memory
    it touches may be reused only then.
    """

    __slots__ = ("_future", "num_blocks")

    def __init__(self, future: asyncio.Future[None], num_blocks: int) -> None:
        self._future = future
        self.num_blocks = num_blocks
        future.add_done_callback(_retrieve_exception)

    def done(self) -> bool:
        """True once the copy has ended (successfully or not)."""
        return self._future.done()

    @property
    def error(self) -> TransferError | None:
        """Why the copy failed; None while it runs or if it succeeded."""
        if not self._future.done():
            return None
        return self._future.exception()  # type: ignore[return-value]

    def add_done_callback(self, callback: Callable[[CopyHandle], object]) -> None:
        """Call ``callback(handle)`` on the event loop when the copy ends."""
        self._future.add_done_callback(lambda _: callback(self))

    def __await__(self) -> Generator[Any, None, None]:
        return asyncio.shield(self._future).__await__()

    def __repr__(self) -> str:
        state = "pending" if not self.done() else ("failed" if self.error else "done")
        return f"<CopyHandle {self.num_blocks} blocks {state}>"


def _retrieve_exception(future: asyncio.Future[None]) -> None:
    # A failure is reported through the handle; an unawaited one must not be logged as
    # "exception never retrieved".
    if not future.cancelled():
        future.exception()


class _Direction(Enum):
    TO_HOST = "to_host"
    TO_DEVICE = "to_device"


@dataclass(slots=True)
class _Job:
    future: asyncio.Future[None]
    direction: _Direction
    event: torch.cuda.Event | None = None
    error: BaseException | None = None


# --------------------------------------------------------------------------- resources


class _StagingBuffer:
    """A ``[rows, block words]`` buffer that grows on demand up to ``max_rows``."""

    def __init__(self, layout: _Layout, max_rows: int) -> None:
        self._layout = layout
        self._max_rows = max_rows
        self._buffer: torch.Tensor | None = None

    def rows(self, n: int) -> torch.Tensor:
        buffer = self._buffer
        if buffer is None or buffer.shape[0] < n:
            # On CUDA this runs inside the copy stream's context, so the caching allocator
            # ties the memory to that stream: dropping the old buffer is stream-ordered.
            rows = min(self._max_rows, max(n, 2 * (0 if buffer is None else buffer.shape[0])))
            width = self._layout.block_bytes // self._layout.word_bytes
            buffer = torch.empty((rows, width), dtype=self._layout.word, device=self._layout.device)
            self._buffer = buffer
        return buffer[:n]


class _EventPool:
    """Reusable CUDA events; keeps at most ``keep`` idle ones."""

    def __init__(self, keep: int) -> None:
        self._idle: list[torch.cuda.Event] = []
        self._keep = keep
        self.created = 0

    def acquire(self) -> torch.cuda.Event:
        if self._idle:
            return self._idle.pop()
        self.created += 1
        return torch.cuda.Event()

    def release(self, event: torch.cuda.Event) -> None:
        if len(self._idle) < self._keep:
            self._idle.append(event)

    @property
    def idle(self) -> int:
        return len(self._idle)


@dataclass(slots=True)
class _Lane:
    """One direction on CUDA: its copy stream, its staging buffer, its ordering event."""

    stream: torch.cuda.Stream
    staging: _StagingBuffer
    fence: torch.cuda.Event


# --------------------------------------------------------------------------- copier


class DeviceCopier:
    """Copies whole KV blocks between the device KV cache and slots of a host pool.

    Use as ``async with DeviceCopier(kv_caches, host_pool) as copier:``; call its methods on
    the event loop that entered it, and enter and exit it in the same task. Leaving the
    block waits until every started copy has ended (if that wait is cancelled it blocks
    until they have, since their memory must not be released under them). Close the copier
    before the host pool.

    ``kv_caches``: a tensor or a sequence of per-layer tensors, first dim = block id, each
    contiguous, all on one device with the same number of blocks; dtypes may differ.
    ``staging_bytes`` bounds each staging buffer (at least one block is always allowed);
    ``max_workers`` sizes the thread pool of the CPU path.

    Raises InvalidArgumentError if the layout is malformed, the block size differs from
    ``host_pool.block_bytes``, the pool is closed, or the KV cache is on CUDA and the pool
    is not pinned (an unpinned copy would block the event loop).
    """

    def __init__(
        self,
        kv_caches: KVCaches,
        host_pool: HostPool,
        *,
        staging_bytes: int = DEFAULT_STAGING_BYTES,
        max_workers: int = 2,
    ) -> None:
        if not isinstance(host_pool, HostPool):
            raise InvalidArgumentError(f"host_pool must be a HostPool, got {host_pool!r}")
        if host_pool.closed:
            raise InvalidArgumentError("host_pool is closed")
        positive_int("staging_bytes", staging_bytes)
        positive_int("max_workers", max_workers)
        layout = _describe_kv_caches(kv_caches)
        if layout.block_bytes != host_pool.block_bytes:
            raise InvalidArgumentError(
                f"a device block is {layout.block_bytes} bytes but a host slot is "
                f"{host_pool.block_bytes}"
            )
        if layout.device.type == "cuda" and not host_pool.pinned:
            raise InvalidArgumentError("copies with a CUDA KV cache need a pinned host pool")
        self._layout = layout
        self._pool = host_pool
        self._host = host_pool.tensor.view(layout.word)  # [slots, block words]
        self._max_rows = max(1, staging_bytes // layout.block_bytes)
        self._max_workers = max_workers
        self._is_cuda = layout.device.type == "cuda"
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        self._in_flight: dict[asyncio.Future[None], _Job] = {}
        # CUDA path
        self._lanes: dict[_Direction, _Lane] = {}
        self._events = _EventPool(_IDLE_EVENTS_KEPT)
        self._task_group: asyncio.TaskGroup | None = None
        self._wakeup: asyncio.Event | None = None
        # CPU path
        self._executor: ThreadPoolExecutor | None = None
        self._idle_staging: list[_StagingBuffer] = []
        self._staging_lock = threading.Lock()

    # ----------------------------------------------------------------- properties

    @property
    def num_device_blocks(self) -> int:
        """Number of blocks of the device KV cache."""
        return self._layout.num_blocks

    @property
    def block_bytes(self) -> int:
        """Bytes per block (= the host pool's slot size)."""
        return self._layout.block_bytes

    @property
    def device(self) -> torch.device:
        """The device of the KV cache."""
        return self._layout.device

    @property
    def host_pool(self) -> HostPool:
        """The host pool whose slots this copier reads and writes."""
        return self._pool

    @property
    def max_rows(self) -> int:
        """Blocks per chunk (staging buffer rows)."""
        return self._max_rows

    @property
    def in_flight(self) -> int:
        """Number of started copies that have not ended."""
        return len(self._in_flight)

    # ----------------------------------------------------------------- lifetime

    async def __aenter__(self) -> Self:
        if self._loop is not None or self._closed:
            raise ClosedError("a DeviceCopier can be entered only once")
        self._loop = asyncio.get_running_loop()
        if self._is_cuda:
            device = self._layout.device
            with torch.cuda.device(device):
                for direction in _Direction:
                    stream = torch.cuda.Stream(device)
                    self._lanes[direction] = _Lane(
                        stream, _StagingBuffer(self._layout, self._max_rows), torch.cuda.Event()
                    )
                    # If the caller frees the KV cache, the allocator waits for copies
                    # already queued on this stream before it reuses the memory. Memory
                    # from another allocator may refuse; the copier's own references and
                    # its draining exit still cover the copier's lifetime.
                    for layer in self._layout.layers:
                        with contextlib.suppress(RuntimeError):
                            layer.record_stream(stream)
            self._wakeup = asyncio.Event()
            self._task_group = asyncio.TaskGroup()
            await self._task_group.__aenter__()
            self._task_group.create_task(self._poll_events(), name="DeviceCopier.poller")
        else:
            self._executor = ThreadPoolExecutor(
                max_workers=self._max_workers,
                thread_name_prefix="device-copy",
                initializer=init_io_worker,
            )
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._closed = True
        try:
            if self._in_flight:
                await asyncio.wait(list(self._in_flight))
        except BaseException:
            self._drain_blocking()
            await self._stop()
            raise
        await self._stop()

    @property
    def closed(self) -> bool:
        """True once the ``async with`` block was left."""
        return self._closed

    # ----------------------------------------------------------------- API

    def check_block_ids(self, device_ids: Sequence[int]) -> None:
        """Raise InvalidArgumentError unless every id is an int in ``[0, num_device_blocks)``."""
        _check_range(
            "device block ids",
            _as_index_list("device block ids", device_ids),
            self._layout.num_blocks,
            unique=False,
        )

    def to_host(self, device_ids: Sequence[int], slots: Sequence[int]) -> CopyHandle:
        """Start copying device block ``device_ids[i]`` into host slot ``slots[i]``.

        Returns at once. Device ids may repeat; slots may not. Raises (with nothing started)
        InvalidArgumentError for unequal lengths, an id out of range or not an int, or a
        repeated slot; ClosedError if the copier is not entered, left, or the pool closed.
        """
        ids = _as_index_list("device block ids", device_ids)
        slot_list = _as_index_list("slots", slots)
        self._check_job(ids, slot_list, _Direction.TO_HOST)
        return self._start(_Direction.TO_HOST, ids, slot_list)

    def to_device(self, slots: Sequence[int], device_ids: Sequence[int]) -> CopyHandle:
        """Start copying host slot ``slots[i]`` into device block ``device_ids[i]``.

        Returns at once. Slots may repeat; device ids may not. Raises like :meth:`to_host`.
        """
        slot_list = _as_index_list("slots", slots)
        ids = _as_index_list("device block ids", device_ids)
        self._check_job(ids, slot_list, _Direction.TO_DEVICE)
        return self._start(_Direction.TO_DEVICE, ids, slot_list)

    # ----------------------------------------------------------------- internals

    def _check_job(self, ids: list[int], slots: list[int], direction: _Direction) -> None:
        if self._loop is None or self._closed:
            raise ClosedError("the DeviceCopier is not open (use `async with`)")
        if self._pool.closed:
            raise ClosedError("the host pool is closed")
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is not self._loop:
            raise InvalidArgumentError("call the DeviceCopier on the event loop that entered it")
        if len(ids) != len(slots):
            raise InvalidArgumentError(f"{len(ids)} device block ids but {len(slots)} slots")
        to_host = direction is _Direction.TO_HOST
        _check_range("device block ids", ids, self._layout.num_blocks, unique=not to_host)
        _check_range("slots", slots, self._pool.num_blocks, unique=to_host)

    def _start(self, direction: _Direction, ids: list[int], slots: list[int]) -> CopyHandle:
        assert self._loop is not None
        future: asyncio.Future[None] = self._loop.create_future()
        handle = CopyHandle(future, len(ids))
        if not ids:
            future.set_result(None)
            return handle
        chunks = plan_copy(ids, slots, self._max_rows)
        job = _Job(future, direction)
        self._in_flight[future] = job
        if self._is_cuda:
            self._launch_cuda(job, chunks)
        else:
            assert self._executor is not None
            work = self._executor.submit(self._run_cpu_job, direction, chunks)
            work.add_done_callback(lambda done: self._on_cpu_job_done(job, done))
        return handle

    def _copy_chunks(
        self, direction: _Direction, chunks: tuple[CopyChunk, ...], staging: _StagingBuffer
    ) -> None:
        """Enqueue (CUDA) or run (CPU) a job's copies; the one body both paths share."""
        layout, host = self._layout, self._host
        columns = tuple(zip(layout.layers, layout.offsets, layout.widths, strict=True))
        for chunk in chunks:
            index = self._index_tensor(chunk.device_ids)
            if not self._is_cuda:
                # In host memory, gather and scatter straight between the layers and the
                # slot rows: one pass over the bytes, where staging would take two.
                _copy_runs_directly(direction, columns, host, index, chunk.runs)
                continue
            rows = staging.rows(len(chunk.device_ids))
            if direction is _Direction.TO_HOST:
                for layer, offset, width in columns:
                    torch.index_select(layer, 0, index, out=rows[:, offset : offset + width])
                for run in chunk.runs:
                    host[run.first_slot : run.first_slot + run.length].copy_(
                        rows[run.first_row : run.first_row + run.length], non_blocking=True
                    )
            else:
                for run in chunk.runs:
                    rows[run.first_row : run.first_row + run.length].copy_(
                        host[run.first_slot : run.first_slot + run.length], non_blocking=True
                    )
                for layer, offset, width in columns:
                    layer.index_copy_(0, index, rows[:, offset : offset + width])

    def _index_tensor(self, device_ids: tuple[int, ...]) -> torch.Tensor:
        if self._layout.device.type != "cuda":
            return torch.tensor(device_ids, dtype=torch.int64)
        # Pinned so the upload is asynchronous on the copy stream; the pinned allocator
        # keeps the host block until that upload has run.
        staged = torch.tensor(device_ids, dtype=torch.int64, pin_memory=True)
        return staged.to(self._layout.device, non_blocking=True)

    # CUDA path ------------------------------------------------------------------

    def _launch_cuda(self, job: _Job, chunks: tuple[CopyChunk, ...]) -> None:
        lane = self._lanes[job.direction]
        try:
            with torch.cuda.device(self._layout.device):
                # Order after everything already queued on the caller's stream, through a
                # reused event (Stream.wait_stream would create one per job).
                lane.fence.record(torch.cuda.current_stream(self._layout.device))
                lane.stream.wait_event(lane.fence)
                with torch.cuda.stream(lane.stream):
                    try:
                        self._copy_chunks(job.direction, chunks, lane.staging)
                    except Exception as exc:
                        job.error = exc  # reported once what was enqueued has drained
                    job.event = self._events.acquire()
                    job.event.record(lane.stream)
        except Exception as exc:
            # No event marks the job's end, and copies may already be queued: wait for the
            # lane (blocking, on this failure path only) so that the handle never ends
            # while a queued copy can still touch the job's slots or blocks.
            with contextlib.suppress(Exception):
                lane.stream.synchronize()
            self._finish(job, job.error or exc)
            return
        assert self._wakeup is not None
        self._wakeup.set()

    async def _poll_events(self) -> None:
        assert self._wakeup is not None
        unfinished_polls = 0
        while True:
            if not self._in_flight:
                if self._closed:
                    return
                self._wakeup.clear()
                await self._wakeup.wait()
                unfinished_polls = 0
                continue
            if self._complete_fired_jobs():
                unfinished_polls = 0
            else:
                unfinished_polls += 1
            # A bare yield (call_soon) for the first polls catches short copies at once;
            # then a 1 ms timer: never a busy spin, never more than ~1 ms late.
            await asyncio.sleep(0 if unfinished_polls <= _IMMEDIATE_POLLS else _POLL_INTERVAL_S)

    def _complete_fired_jobs(self) -> bool:
        fired: list[tuple[_Job, BaseException | None]] = []
        for job in self._in_flight.values():
            if job.event is None:
                continue
            try:
                if not job.event.query():
                    continue
                error = job.error
            except Exception as exc:  # a failed kernel surfaces here (sticky CUDA error)
                error = exc
            fired.append((job, error))
        for job, error in fired:
            self._finish(job, error)
        return bool(fired)

    # CPU path -------------------------------------------------------------------

    def _run_cpu_job(self, direction: _Direction, chunks: tuple[CopyChunk, ...]) -> None:
        with self._staging_lock:
            staging = (
                self._idle_staging.pop()
                if self._idle_staging
                else _StagingBuffer(self._layout, self._max_rows)
            )
        try:
            self._copy_chunks(direction, chunks, staging)
        finally:
            with self._staging_lock:
                self._idle_staging.append(staging)

    def _on_cpu_job_done(self, job: _Job, done: ConcurrentFuture[None]) -> None:
        # Runs on the worker thread; job.error is also read by _drain_blocking after
        # the executor's shutdown has joined this thread.
        job.error = done.exception()
        assert self._loop is not None
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is left to tell
            self._loop.call_soon_threadsafe(self._finish, job, job.error)

    # shared ---------------------------------------------------------------------

    def _finish(self, job: _Job, error: BaseException | None) -> None:
        self._in_flight.pop(job.future, None)
        if job.event is not None:
            self._events.release(job.event)
            job.event = None
        if job.future.done():
            return
        if error is None:
            job.future.set_result(None)
        else:
            failure = TransferError(f"{job.direction.value} copy failed: {error!r}")
            failure.__cause__ = error
            job.future.set_exception(failure)

    def _drain_blocking(self) -> None:
        """Wait, blocking the thread, until every started copy has ended, and complete them."""
        if self._is_cuda:
            for lane in self._lanes.values():
                # A failure surfaces again in the per-job event query below.
                with contextlib.suppress(Exception):
                    lane.stream.synchronize()
            self._complete_fired_jobs()
        elif self._executor is not None:
            self._executor.shutdown(wait=True)
            # The workers' completions were posted to the loop; deliver them now.
            for job in list(self._in_flight.values()):
                self._finish(job, job.error)

    async def _stop(self) -> None:
        """Release resources once no copy is in flight (the poller then returns by itself)."""
        self._closed = True
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        if self._task_group is not None:
            task_group, self._task_group = self._task_group, None
            assert self._wakeup is not None
            self._wakeup.set()
            # Not the body's exception: a TaskGroup would wrap it in an ExceptionGroup.
            await task_group.__aexit__(None, None, None)
        # Every job's event has fired, so nothing queued on the lanes uses their staging
        # buffers any more: hand the device memory back now, not when the copier is dropped.
        self._lanes.clear()
