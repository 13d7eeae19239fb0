"""The thread copy backend: KV copies in host memory on a small thread pool, coalesced
into *hops* (docs/architecture.md#gpu-copies). A hop (one call on a worker) runs every
copy queued when it is dispatched, in order, and posts their outcomes at once; a merged
group that fails is rerun one by one, so a faulty copy fails alone. A hop waits while it
conflicts with one in flight."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import operator
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from tiering.device.kv_layout import CopyOutcome, Direction, KVLayout, PlannedCopy
from tiering.errors import ClosedError, InvalidArgumentError
from tiering.tiers.io_threads import init_io_worker
from tiering.validation import positive_int

_GROUP_BLOCK_BYTES = 64 << 10
"""Copies of blocks up to this size in one hop are merged (one gather and one scatter
per layer for the group: a torch call per copy would cost more than its bytes)."""


@dataclass(slots=True, eq=False)
class _Hop:
    copies: list[PlannedCopy]
    outcomes: list[CopyOutcome] | None = None  # set by the worker before it posts
    work: concurrent.futures.Future[None] | None = None
    _access: tuple[set[int], set[int]] | None = None

    def conflicts(self, other: _Hop) -> bool:
        """True if one hop writes what the other reads or writes."""
        reads, writes = self._reads_writes()
        other_reads, other_writes = other._reads_writes()
        return not (
            writes.isdisjoint(other_writes)
            and writes.isdisjoint(other_reads)
            and reads.isdisjoint(other_writes)
        )

    def _reads_writes(self) -> tuple[set[int], set[int]]:
        """What the hop reads and writes (worked out when a later hop must check): host
        slots as themselves, device block ``b`` as ``~b``, so one set holds both kinds."""
        if self._access is None:
            reads: set[int] = set()
            writes: set[int] = set()
            for copy in self.copies:
                blocks = map(operator.invert, copy.device_ids)
                if copy.direction is Direction.TO_HOST:
                    writes.update(copy.slots)
                    reads.update(blocks)
                else:
                    writes.update(blocks)
                    reads.update(copy.slots)
            self._access = reads, writes
        return self._access


class ThreadCopyBackend:
    """A :class:`~tiering.device.copier.CopyBackend` for a host-memory KV cache, on threads.
    ``max_workers`` bounds the hops in flight and sizes the pool made when no ``executor``
    is given (a given one is not shut down). Raises InvalidArgumentError for a bad
    ``max_workers`` or ``executor``."""

    def __init__(self, *, max_workers: int = 2, executor: Executor | None = None) -> None:
        self.max_workers = positive_int("max_workers", max_workers)
        if executor is not None and not isinstance(executor, Executor):
            raise InvalidArgumentError(
                f"executor must be a concurrent.futures.Executor, got {executor!r}"
            )
        self._given_executor = executor
        self.executor: Executor | None = None  # the hops run on it while open
        self._loop: asyncio.AbstractEventLoop | None = None
        self._host: torch.Tensor | None = None
        self._columns: tuple[tuple[torch.Tensor, int, int], ...] = ()
        self._block_bytes = 0
        self._on_done: Callable[[Sequence[CopyOutcome]], None] | None = None
        self._queue: list[PlannedCopy] = []
        self._hops: set[_Hop] = set()  # dispatched; outcomes not delivered yet
        self._dispatch_soon = False  # a dispatch is scheduled for this loop iteration

    async def open(
        self,
        layout: KVLayout,
        host: torch.Tensor,
        *,
        max_rows: int,
        on_done: Callable[[Sequence[CopyOutcome]], None],
    ) -> None:
        """Start serving copies between ``layout``'s tensors and ``host`` (``max_rows`` is
        unused). Raises ClosedError if opened before, InvalidArgumentError if the KV cache
        is not in host memory."""
        if self._loop is not None:
            raise ClosedError("a ThreadCopyBackend can be opened only once")
        if layout.device.type != "cpu":
            raise InvalidArgumentError(
                f"the thread copy backend needs a KV cache in host memory, not on {layout.device}"
            )
        self._loop = asyncio.get_running_loop()
        self._host = host
        self._columns = layout.columns
        self._block_bytes = layout.block_bytes
        self._on_done = on_done
        self.executor = self._given_executor or ThreadPoolExecutor(
            max_workers=self.max_workers,
            thread_name_prefix="device-copy",
            initializer=init_io_worker,
        )

    def submit(self, copy: PlannedCopy) -> None:
        """Queue ``copy`` for the hop dispatched at the end of this loop iteration, so that
        copies requested together leave together and no worker competes for the GIL."""
        self._queue.append(copy)
        if not self._dispatch_soon:
            self._dispatch_soon = True
            assert self._loop is not None
            self._loop.call_soon(self._dispatch, True)

    def drain_blocking(self) -> None:
        assert self._on_done is not None
        while self._hops or self._queue:
            running = [hop.work for hop in self._hops if hop.work is not None]
            concurrent.futures.wait(running)
            for hop in list(self._hops):
                self._hops.discard(hop)
                self._on_done(self._outcomes_of(hop))
            self._dispatch()  # nothing runs now: whatever is queued goes at once

    async def aclose(self) -> None:
        self.close(wait=True)

    def close(self, *, wait: bool = False) -> None:
        executor, self.executor = self.executor, None
        if executor is not None and executor is not self._given_executor:
            executor.shutdown(wait=wait)

    def _dispatch(self, scheduled: bool = False) -> None:
        if scheduled:
            self._dispatch_soon = False
        if not self._queue or len(self._hops) >= self.max_workers:
            return
        hop = _Hop(self._queue)
        if any(running.conflicts(hop) for running in self._hops):
            return  # the hop it conflicts with dispatches again when it ends
        self._queue = []
        self._hops.add(hop)
        assert self._on_done is not None
        try:
            if self.executor is None:
                raise ClosedError("the thread copy backend is closed")
            hop.work = self.executor.submit(self._run_hop, hop)
        except RuntimeError as exc:  # the executor was shut down under us
            self._hops.discard(hop)
            self._on_done([(copy, exc) for copy in hop.copies])

    def _run_hop(self, hop: _Hop) -> None:
        outcomes: list[CopyOutcome] = []
        try:
            for group in self._groups(hop.copies):
                if len(group) > 1:
                    # If it fails, they run one by one below: only the faulty copy fails.
                    with contextlib.suppress(Exception):
                        self._copy_group(group)
                        outcomes.extend((copy, None) for copy in group)
                        continue
                for copy in group:
                    try:
                        self._copy(copy)
                    except Exception as exc:
                        outcomes.append((copy, exc))
                    else:
                        outcomes.append((copy, None))
        finally:
            hop.outcomes = outcomes
            assert self._loop is not None
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody to tell
                self._loop.call_soon_threadsafe(self._hop_done, hop)

    def _groups(self, copies: list[PlannedCopy]) -> Iterator[list[PlannedCopy]]:
        """Cut ``copies`` into runs that may execute as one: consecutive small copies of
        one direction with disjoint destinations. Big copies go alone."""
        if self._block_bytes > _GROUP_BLOCK_BYTES:
            yield from ([copy] for copy in copies)
            return
        group: list[PlannedCopy] = []
        written: set[int] = set()
        for copy in copies:
            targets = copy.slots if copy.direction is Direction.TO_HOST else copy.device_ids
            if group and (
                copy.direction is not group[0].direction or not written.isdisjoint(targets)
            ):
                yield group
                group, written = [], set()
            group.append(copy)
            written.update(targets)
        if group:
            yield group

    def _copy_group(self, group: list[PlannedCopy]) -> None:
        assert self._host is not None
        host, columns = self._host, self._columns
        ids = torch.tensor([b for copy in group for b in copy.device_ids], dtype=torch.int64)
        slots = torch.tensor([s for copy in group for s in copy.slots], dtype=torch.int64)
        if group[0].direction is Direction.TO_HOST:
            for layer, offset, width in columns:
                rows = torch.index_select(layer, 0, ids)
                host[:, offset : offset + width].index_copy_(0, slots, rows)
        else:
            rows = torch.index_select(host, 0, slots)
            waiting = [copy.progress for copy in group if copy.progress is not None]
            for i, (layer, offset, width) in enumerate(columns):
                layer.index_copy_(0, ids, rows[:, offset : offset + width])
                for progress in waiting:
                    progress.mark(i)

    def _hop_done(self, hop: _Hop) -> None:
        if hop not in self._hops:
            return  # drain_blocking delivered it already
        self._hops.discard(hop)
        self._dispatch()
        assert self._on_done is not None
        self._on_done(self._outcomes_of(hop))

    @staticmethod
    def _outcomes_of(hop: _Hop) -> list[CopyOutcome]:
        done = hop.outcomes or []
        if len(done) == len(hop.copies):
            return done
        # A BaseException stopped the worker part-way: the rest never ran.
        stopped = RuntimeError("the copy worker stopped before this copy ran")
        return done + [(copy, stopped) for copy in hop.copies[len(done) :]]

    def _copy(self, copy: PlannedCopy) -> None:
        assert self._host is not None
        host, progress = self._host, copy.progress
        to_host = copy.direction is Direction.TO_HOST
        pairs = []  # (device block ids, host rows) of each run of consecutive slots
        for chunk in copy.chunks:
            index = torch.tensor(chunk.device_ids, dtype=torch.int64)
            for run in chunk.runs:
                ids = index[run.first_row : run.first_row + run.length]
                pairs.append((ids, host[run.first_slot : run.first_slot + run.length]))
        # Layer by layer, so that a layer-by-layer load can mark each one as it lands.
        for i, (layer, offset, width) in enumerate(self._columns):
            for ids, rows in pairs:
                if to_host:
                    torch.index_select(layer, 0, ids, out=rows[:, offset : offset + width])
                else:
                    layer.index_copy_(0, ids, rows[:, offset : offset + width])
            if progress is not None:
                progress.mark(i)
