"""Device transfers: :class:`DeviceCopier` checks each copy of KV blocks between the device
KV cache and host-pool slots and hands it to a :class:`CopyBackend`, which runs it."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Generator, Sequence
from typing import Any, Protocol, cast

import torch

from tiering.device.cuda_copies import CudaCopyBackend
from tiering.device.host_pool import HostPool
from tiering.device.kv_layout import (
    CopyOutcome,
    Direction,
    KVCaches,
    KVLayout,
    PlannedCopy,
    describe_kv_caches,
)
from tiering.device.layer_progress import LayerProgress, check_progress
from tiering.device.thread_copies import ThreadCopyBackend
from tiering.errors import ClosedError, InvalidArgumentError, TransferError
from tiering.lifecycle import AsyncService, Lifecycle, running_loop
from tiering.observe.statistics import FailureLog, Statistics
from tiering.tiers.io_threads import STAGING_BYTES
from tiering.validation import as_index_list, check_index_range, positive_int

_log = logging.getLogger(__name__)


class CopyBackend(Protocol):
    """What :class:`DeviceCopier` needs of a copy backend, called on its loop: ``open``
    once (``host`` is the pool as ``[slots, block words]``); ``submit`` returns at once,
    and ``on_done`` gets each copy's outcome on the loop exactly once, when nothing of it
    can still run; ``drain_blocking`` blocks until all are reported; ``aclose`` releases
    the backend once none is in flight, ``close`` (idempotent) after ``drain_blocking``
    without awaiting."""

    async def open(
        self,
        layout: KVLayout,
        host: torch.Tensor,
        *,
        max_rows: int,
        on_done: Callable[[Sequence[CopyOutcome]], None],
    ) -> None: ...
    def submit(self, copy: PlannedCopy) -> None: ...
    def drain_blocking(self) -> None: ...
    async def aclose(self) -> None: ...
    def close(self) -> None: ...


class CopyHandle:
    """A started copy. ``await handle`` returns once the bytes are in place, or raises
    :class:`~tiering.errors.TransferError`. Cancelling an awaiting task does not cancel
    the copy: the handle turns done only when the copy has really ended."""

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
        return self._future.exception() if self._future.done() else None  # type: ignore[return-value]

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


class _InFlight(PlannedCopy):
    """A copy handed to the backend, and whom its end is told: a future or ``on_done``."""

    __slots__ = ("future", "nbytes", "on_done", "token")
    future: asyncio.Future[None] | None
    nbytes: int
    on_done: Callable[[int, TransferError | None], object] | None
    token: int


class DeviceCopier(AsyncService):
    """Copies whole KV blocks between the device KV cache and slots of a host pool.

    Use as ``async with DeviceCopier(kv_caches, host_pool) as copier:`` on one loop and
    task, before closing the host pool; leaving waits (blocking if cancelled) until every
    started copy has ended. ``staging_bytes`` sizes a staging buffer (the CUDA backend
    pipelines two per direction) and so bounds the blocks per chunk (at least one).
    ``backend`` defaults to a :class:`~tiering.device.cuda_copies.CudaCopyBackend` for a
    CUDA KV cache, else a :class:`~tiering.device.thread_copies.ThreadCopyBackend` of
    ``max_workers`` threads, and serves this copier alone. Raises InvalidArgumentError for
    a malformed layout, a block size other than the pool's, a closed pool, or a CUDA KV
    cache with an unpinned pool (its copies would block the event loop)."""

    def __init__(
        self,
        kv_caches: KVCaches,
        host_pool: HostPool,
        *,
        staging_bytes: int = STAGING_BYTES,
        max_workers: int = 2,
        backend: CopyBackend | None = None,
    ) -> None:
        if not isinstance(host_pool, HostPool):
            raise InvalidArgumentError(f"host_pool must be a HostPool, got {host_pool!r}")
        if host_pool.closed:
            raise InvalidArgumentError("host_pool is closed")
        positive_int("staging_bytes", staging_bytes)
        positive_int("max_workers", max_workers)
        layout = describe_kv_caches(kv_caches)
        if layout.block_bytes != host_pool.block_bytes:
            raise InvalidArgumentError(
                f"a device block is {layout.block_bytes} bytes but a host slot is "
                f"{host_pool.block_bytes}"
            )
        if layout.device.type == "cuda" and not host_pool.pinned:
            raise InvalidArgumentError("copies with a CUDA KV cache need a pinned host pool")
        if backend is None:
            backend = (
                CudaCopyBackend()
                if layout.device.type == "cuda"
                else ThreadCopyBackend(max_workers=max_workers)
            )
        elif not all(
            callable(getattr(backend, name, None))
            for name in ("open", "submit", "drain_blocking", "aclose", "close")
        ):
            raise InvalidArgumentError(f"backend must be a CopyBackend, got {backend!r}")
        self._layout = layout
        self.num_device_blocks: int = layout.num_blocks
        self.block_bytes: int = layout.block_bytes  # the host pool's slot size
        self.device: torch.device = layout.device  # the KV cache's
        self.host_pool = host_pool
        self.backend: CopyBackend = backend
        self.max_rows = max(1, staging_bytes // layout.block_bytes)  # per planned chunk
        self._loop: asyncio.AbstractEventLoop | None = None
        self._state = Lifecycle.NEW
        self._in_flight: set[_InFlight] = set()
        self._bytes_in_flight = 0
        self._all_ended: asyncio.Future[None] | None = None  # set once none is in flight
        # [copies, bytes] by direction; plain lists: an Enum's hash is Python code.
        self._to_host_done = [0, 0]
        self._to_device_done = [0, 0]
        self._failures = FailureLog(_log, "DeviceCopier")

    @property
    def num_layers(self) -> int:
        """Tensors of the KV cache: the layers a :class:`LayerProgress` of a load counts."""
        return len(self._layout.layers)

    def statistics(self) -> Statistics:
        """State, copies and bytes in flight, counters (``copies_to_host``,
        ``copies_to_device``, ``bytes_to_host``, ``bytes_to_device``), failures by cause."""
        return Statistics(
            state=self._state,
            jobs_in_flight=len(self._in_flight),
            bytes_in_flight=self._bytes_in_flight,
            counters={
                "copies_to_host": self._to_host_done[0],
                "copies_to_device": self._to_device_done[0],
                "bytes_to_host": self._to_host_done[1],
                "bytes_to_device": self._to_device_done[1],
            },
            failures=self._failures.counts,
        )

    def __repr__(self) -> str:
        return (
            f"<DeviceCopier {self._layout.num_blocks} blocks of {self._layout.block_bytes} B "
            f"on {self._layout.device} via {type(self.backend).__name__}: "
            f"{self.statistics()!r}>"
        )

    async def start(self) -> None:
        """Open the backend on the running loop. Raises ClosedError if started before or
        the pool is closed, else what the backend's ``open`` raises (then it is closed)."""
        if self._state is not Lifecycle.NEW:
            raise ClosedError("a DeviceCopier can be entered only once")
        if self.host_pool.closed:
            raise ClosedError("the host pool is closed")
        self._loop = asyncio.get_running_loop()
        host = self.host_pool.tensor.view(self._layout.word)  # [slots, block words]
        try:
            await self.backend.open(
                self._layout, host, max_rows=self.max_rows, on_done=self._on_done
            )
        except BaseException:
            self._state = Lifecycle.CLOSING
            await self._stop()  # whatever the backend made before it failed
            raise
        self._state = Lifecycle.OPEN

    async def aclose(self) -> None:
        """Wait until every started copy has ended (blocking, if cancelled), then release
        the backend; idempotent."""
        if self._state in (Lifecycle.NEW, Lifecycle.CLOSED):  # never opened, or close()d
            self._state = Lifecycle.CLOSED
            return
        self._state = Lifecycle.CLOSING
        try:
            if self._in_flight:
                assert self._loop is not None
                self._all_ended = self._loop.create_future()
                await self._all_ended
        except BaseException:
            self.backend.drain_blocking()
            await self._stop()
            raise
        await self._stop()

    def close(self) -> None:
        """Hard stop, idempotent: block until every started copy has ended, then release
        the backend; for when the loop cannot wait (prefer leaving the ``async with``)."""
        if self._state is Lifecycle.CLOSED:
            return
        self._state = Lifecycle.CLOSING
        try:
            if self._in_flight:
                self.backend.drain_blocking()
        finally:
            self.backend.close()
            self._state = Lifecycle.CLOSED

    async def _stop(self) -> None:
        try:
            await self.backend.aclose()
        finally:
            self._state = Lifecycle.CLOSED

    def to_host(self, device_ids: Sequence[int], slots: Sequence[int]) -> CopyHandle:
        """Start copying device block ``device_ids[i]`` into host slot ``slots[i]`` (ids
        may repeat, slots not); returns at once. Raises, starting nothing,
        InvalidArgumentError for bad arguments, ClosedError unless copier and pool are open."""
        return self._start(Direction.TO_HOST, device_ids, slots)

    def to_device(
        self,
        slots: Sequence[int],
        device_ids: Sequence[int],
        *,
        progress: LayerProgress | None = None,
    ) -> CopyHandle:
        """Start copying host slot ``slots[i]`` into device block ``device_ids[i]``; slots
        may repeat, device ids may not. ``progress`` gets each layer marked as it lands
        (every layer by the time the handle is done, or failed if the copy fails). Raises
        like :meth:`to_host`, and InvalidArgumentError for a ``progress`` that is not a
        fresh LayerProgress of :attr:`num_layers` layers."""
        check_progress(progress, self.num_layers)
        return self._start(Direction.TO_DEVICE, device_ids, slots, progress)

    def submit(
        self,
        to_host: bool,
        device_ids: list[int],
        slots: list[int],
        on_done: Callable[[int, TransferError | None], object],
        token: int,
        progress: LayerProgress | None = None,
    ) -> None:
        """:meth:`to_host` / :meth:`to_device` for a hot path, with arguments the caller
        has checked (the lists must not change afterwards; ``progress`` only to the
        device): ``on_done(token, error)`` follows on the loop once the copy has ended.
        Raises ClosedError if not open."""
        if self._state is not Lifecycle.OPEN:
            raise ClosedError(f"the DeviceCopier is {self._state} (use `async with`)")
        direction = Direction.TO_HOST if to_host else Direction.TO_DEVICE
        self._hand_over(direction, device_ids, slots, None, on_done, token, progress)

    def _start(
        self,
        direction: Direction,
        device_ids: Sequence[int],
        slots: Sequence[int],
        progress: LayerProgress | None = None,
    ) -> CopyHandle:
        ids = as_index_list("device block ids", device_ids)
        slot_list = as_index_list("slots", slots)
        if self._state is not Lifecycle.OPEN:
            raise ClosedError(f"the DeviceCopier is {self._state} (use `async with`)")
        if self.host_pool.closed:
            raise ClosedError("the host pool is closed")
        running = running_loop()
        if running is not self._loop:
            raise InvalidArgumentError("call the DeviceCopier on the event loop that entered it")
        if len(ids) != len(slot_list):
            raise InvalidArgumentError(f"{len(ids)} device block ids but {len(slot_list)} slots")
        to_host = direction is Direction.TO_HOST
        check_index_range("device block ids", ids, self._layout.num_blocks, unique=not to_host)
        check_index_range("slots", slot_list, self.host_pool.num_blocks, unique=to_host)
        future: asyncio.Future[None] = running.create_future()
        self._hand_over(direction, ids, slot_list, future, None, 0, progress)
        return CopyHandle(future, len(ids))

    def _hand_over(
        self,
        direction: Direction,
        ids: list[int],
        slots: list[int],
        future: asyncio.Future[None] | None,
        on_done: Callable[[int, TransferError | None], object] | None,
        token: int = 0,
        progress: LayerProgress | None = None,
    ) -> None:
        if not ids:  # nothing to copy: done now (an on_done still follows later)
            if progress is not None:
                progress.mark_all()
            if future is not None:
                future.set_result(None)
            else:
                self._loop.call_soon(on_done, token, None)  # type: ignore[arg-type, union-attr]
            return
        nbytes = len(ids) * self._layout.block_bytes
        copy = _InFlight(direction, ids, slots, self.max_rows, progress)
        copy.nbytes, copy.future, copy.on_done, copy.token = nbytes, future, on_done, token
        self._in_flight.add(copy)
        self._bytes_in_flight += nbytes
        self.backend.submit(copy)

    def _on_done(self, outcomes: Sequence[CopyOutcome]) -> None:
        try:
            for copy, error in outcomes:
                if copy not in self._in_flight:
                    continue
                job = cast(_InFlight, copy)  # the backend hands back what it was given
                self._in_flight.discard(job)
                self._bytes_in_flight -= job.nbytes
                progress = job.progress
                if progress is not None:  # a forward may wait on it from another thread
                    if error is None:
                        progress.mark_all()  # what a backend copying whole blocks left unmarked
                    else:
                        progress.fail(error)
                future = job.future
                if future is not None and future.done():  # the loop is being torn down
                    continue
                direction = job.direction
                failure = None
                if error is None:
                    to_host = direction is Direction.TO_HOST
                    done = self._to_host_done if to_host else self._to_device_done
                    done[0] += 1
                    done[1] += job.nbytes
                else:
                    self._failures.record(f"{direction.value} copy failed", detail=repr(error))
                    failure = TransferError(f"{direction.value} copy failed: {error!r}")
                    failure.__cause__ = error
                if job.on_done is not None:
                    try:
                        job.on_done(job.token, failure)
                    except Exception:  # one caller's bug must not lose the other outcomes
                        _log.exception("DeviceCopier: a copy's on_done callback raised")
                elif failure is None:
                    future.set_result(None)  # type: ignore[union-attr]
                else:
                    future.set_exception(failure)  # type: ignore[union-attr]
        finally:
            ended = self._all_ended
            if ended is not None and not self._in_flight and not ended.done():
                ended.set_result(None)
