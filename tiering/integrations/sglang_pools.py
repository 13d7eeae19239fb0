"""One SGLang host pool's pages in kv-tiering tiers: where a pool's pages lie in its
buffers (:class:`PageChunks`), the tiers that hold them (:class:`PoolStore`), and which
prefixes a pool's hit policy lets SGLang restore (:func:`restorable_prefixes`)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from tiering.errors import InvalidArgumentError
from tiering.integrations.tier_thread import TierThread
from tiering.tiers.client import TierOutcome
from tiering.tiers.inbox import Lane

_ASK_AGAIN_S = 0.0005  # how often a presence query asks again while a tier checks a key

TRAILING_PAGES, ALL_PAGES, BLOCK_GROUPS = "trailing_pages", "all_pages", "block_groups"
"""SGLang's ``PoolHitPolicy`` values (its enum is a ``str``, so these compare equal)."""


def pool_buffers(pool: Any) -> list[torch.Tensor]:
    """The tensors a host pool keeps its pages in: the KV buffer of a KV pool, each state
    buffer of a Mamba pool (which holds a list)."""
    buffer = pool.kv_buffer
    return list(buffer) if isinstance(buffer, list | tuple) else [buffer]


class PageChunks:
    """Where a host pool's pages lie in one of its buffers: ``chunks`` runs of
    ``chunk_bytes`` (K and V, maybe per layer, or one state row), run ``j`` of page ``p``
    at chunk ``offsets[j] + p * stride``. With ``piece_bytes``, a run longer than that
    is cut into equal pieces of at most ``piece_bytes`` where its length allows (so a
    tier moves a large state row as several blocks at once). InvalidArgumentError
    (naming the pool and its layout) unless they are whole chunks of the buffer at a
    fixed stride."""

    def __init__(self, pool: Any, buffer: torch.Tensor, *, piece_bytes: int | None = None) -> None:
        layout = getattr(pool, "layout", "?")
        where = f"host pool {type(pool).__name__} ({layout})"
        if not isinstance(buffer, torch.Tensor) or not buffer.is_contiguous():
            raise InvalidArgumentError(
                f"{where}: its pages are not in contiguous buffers, which kv-tiering's "
                "HiCache storage needs"
            )
        self.buffer = buffer
        self.page_size: int = pool.page_size
        self.pages: int = pool.page_num
        self.buffer_bytes = buffer.numel() * buffer.element_size()
        base = buffer.data_ptr()

        def chunks_of(page: int) -> tuple[list[int], list[int]]:
            first = page * self.page_size
            try:
                ptrs, sizes = pool.get_page_buffer_meta(torch.arange(first, first + self.page_size))
            except (NotImplementedError, ValueError) as exc:  # e.g. a layer_first Mamba pool
                raise InvalidArgumentError(
                    f"{where}: SGLang cannot address its pages: {exc}"
                ) from exc
            # A pool with several buffers names every buffer's runs: keep this one's.
            mine = [
                (ptr - base, size)
                for ptr, size in zip(ptrs, sizes, strict=True)
                if 0 <= ptr - base < self.buffer_bytes
            ]
            return [offset for offset, _ in mine], [size for _, size in mine]

        first, sizes = chunks_of(0)
        if not first:
            raise InvalidArgumentError(f"{where}: SGLang names no page of one of its buffers")
        self.chunk_bytes: int = sizes[0]
        self.chunks = len(first)
        second, _ = chunks_of(1) if self.pages > 1 else (first, sizes)
        last, _ = chunks_of(self.pages - 1)
        self.stride = stride = (second[0] - first[0]) // self.chunk_bytes
        whole = all(size == self.chunk_bytes for size in sizes) and not any(
            offset % self.chunk_bytes for offset in first + second + last
        )
        self.offsets = [offset // self.chunk_bytes for offset in first]
        affine = len(second) == len(last) == self.chunks and all(
            b // self.chunk_bytes == a + stride
            and c // self.chunk_bytes == a + (self.pages - 1) * stride
            for a, b, c in zip(self.offsets, second, last, strict=True)
        )
        if not (whole and affine) or (last[-1] + self.chunk_bytes) > self.buffer_bytes:
            raise InvalidArgumentError(
                f"{where}: its pages are not whole chunks of its buffer at a fixed "
                "stride, which kv-tiering's HiCache storage needs (use the page_first or "
                "layer_first layout)"
            )
        pieces = _pieces(self.chunk_bytes, piece_bytes)
        if pieces > 1:
            self.chunk_bytes //= pieces
            self.offsets = [offset * pieces + k for offset in self.offsets for k in range(pieces)]
            self.chunks, self.stride = len(self.offsets), stride * pieces
        self._offsets = torch.tensor(self.offsets, dtype=torch.int64)
        self._suffixes = [b"/%d" % j for j in range(self.chunks)]

    @property
    def page_bytes(self) -> int:
        """The bytes of one page in this buffer."""
        return self.chunks * self.chunk_bytes

    def keys(self, keys: Sequence[str]) -> list[bytes]:
        """The tier's keys of the pages ``keys``, ``chunks`` per page; InvalidArgumentError
        unless each key is a non-empty str."""
        try:
            raws = [key.encode() for key in keys]
        except AttributeError:
            raws = []
        if len(raws) != len(keys) or not all(raws):
            raise InvalidArgumentError("keys must be non-empty strings (SGLang's page hashes)")
        return [raw + suffix for raw in raws for suffix in self._suffixes]

    def slots(self, host_indices: object, pages: int) -> list[int]:
        """The chunk slots of ``pages`` pages whose token slots are ``host_indices``;
        InvalidArgumentError for indices of another length, not page-aligned or past the pool."""
        if not isinstance(host_indices, torch.Tensor) or host_indices.dim() != 1:
            raise InvalidArgumentError("host_indices must be a 1-D tensor of token slots")
        if host_indices.numel() != pages * self.page_size:
            raise InvalidArgumentError(
                f"host_indices holds {host_indices.numel()} token slots for {pages} pages "
                f"of {self.page_size} tokens"
            )
        starts = host_indices[:: self.page_size].to(torch.int64)
        page = starts // self.page_size
        if bool((starts % self.page_size).any()) or bool(((page < 0) | (page >= self.pages)).any()):
            raise InvalidArgumentError(
                f"host_indices: pages must start page-aligned inside the host pool "
                f"({self.pages} pages of {self.page_size} tokens)"
            )
        return (page[:, None] * self.stride + self._offsets[None, :]).flatten().tolist()


def _pieces(run_bytes: int, piece_bytes: int | None) -> int:
    """The fewest equal pieces of at most ``piece_bytes`` a run divides into (1: none)."""
    if piece_bytes is None or run_bytes <= piece_bytes:
        return 1
    return next(
        (n for n in range(-(-run_bytes // piece_bytes), run_bytes + 1) if run_bytes % n == 0),
        1,
    )


class PoolStore:
    """The pages of one host pool, kept by one tier per buffer (``parts``: the buffer's
    :class:`PageChunks`, the tier thread over it and the view of the buffer it reads).
    A page is held, stored or loaded only when it is so in every part: a state whose
    parts disagree counts as absent."""

    def __init__(
        self, name: str, parts: Sequence[tuple[PageChunks, TierThread, memoryview]]
    ) -> None:
        self.name = name
        self.parts = [(chunks, thread) for chunks, thread, _ in parts]
        self._views = [view for _, _, view in parts]

    @property
    def job_timeout(self) -> float:
        return self.parts[0][1].job_timeout

    def move(self, kind: Lane, keys: Sequence[str], host_indices: object) -> list[bool]:
        """Store (``kind`` "store") or load the pages ``keys`` at ``host_indices``; True for
        each page moved whole (stored pages already held count) in every part. Raises as
        :meth:`PageChunks.keys` and :meth:`PageChunks.slots` before any I/O."""
        jobs = []
        for chunks, thread in self.parts:  # all checks first: bad input moves nothing
            chunk_keys = chunks.keys(keys)
            jobs.append((chunks, thread, chunk_keys, chunks.slots(host_indices, len(keys))))
        outcomes: list[list[TierOutcome]] = []
        for _, thread, chunk_keys, slots in jobs:  # every part's job runs at once
            moved = list(zip(chunk_keys, slots, strict=True))
            if kind == "store":  # what the tier holds already is not written again
                held = thread.tier.lookup_all(chunk_keys)
                moved = [pair for pair, known in zip(moved, held, strict=True) if known is not True]
            ended: list[TierOutcome] = []
            outcomes.append(ended)
            if moved:
                job_keys, job_slots = zip(*moved, strict=True)
                thread.submit(kind, job_keys, job_slots, ended.append, checked=True)
            else:
                ended.append(TierOutcome(()))
        ok = [True] * len(keys)
        for (chunks, thread, chunk_keys, _), ended in zip(jobs, outcomes, strict=True):
            thread.wait(lambda ended=ended: bool(ended))
            failed = ended[0].failed
            if failed:
                n = chunks.chunks
                for i in range(len(keys)):
                    if any(k in failed for k in chunk_keys[i * n : (i + 1) * n]):
                        ok[i] = False
        return ok

    def held(self, keys: Sequence[str], *, prefix: bool) -> list[bool]:
        """Whether every part holds each page of ``keys`` whole. A page a tier is still
        checking is asked about again, for at most the job timeout, then counts as absent.
        With ``prefix``, pages after the first absent one are not asked about (False)."""
        known: list[bool | None] = [None] * len(keys)
        pending = list(range(len(keys)))
        deadline = None
        while True:
            for i, status in zip(pending, self._status([keys[i] for i in pending]), strict=True):
                known[i] = status
            if prefix and False in known:
                cut = known.index(False)
                known[cut:] = [False] * (len(keys) - cut)
            pending = [i for i in pending if known[i] is None]
            now = time.monotonic()
            deadline = deadline or now + self.job_timeout
            if not pending or now >= deadline:
                return [status is True for status in known]
            time.sleep(_ASK_AGAIN_S)

    def _status(self, keys: Sequence[str]) -> list[bool | None]:
        """Each page: True if every chunk of it is held, False if one is known absent,
        None while a tier still checks one."""
        status: list[bool | None] = [True] * len(keys)
        for chunks, thread in self.parts:
            answers = thread.tier.lookup_all(chunks.keys(keys))
            if all(answers):
                continue
            n = chunks.chunks
            for i in range(len(keys)):
                page = answers[i * n : (i + 1) * n]
                if False in page:
                    status[i] = False
                elif status[i] is True and not all(page):
                    status[i] = None
        return status

    def clear(self) -> None:
        """Drop every page this process's tiers hold."""
        for _, thread in self.parts:

            async def clear(thread: TierThread = thread) -> None:
                thread.tier.clear()

            thread.run(clear(), thread.job_timeout)

    def close(self) -> None:
        """Close every part's tier (calls in flight end first) and release the buffers.
        Idempotent."""
        for _, thread in self.parts:
            thread.close()
        for view in self._views:
            view.release()


def restorable_prefixes(present: Sequence[bool], policy: str, window: int) -> set[int]:
    """The prefix lengths (in pages, 1 to ``len(present)``) a pool whose entry of page
    ``i`` is held when ``present[i]`` lets SGLang restore, under its hit ``policy``:
    ``all_pages`` needs every page up to the length; ``trailing_pages`` only the last
    ``window`` of them (a Mamba state ends its prefix: window 1); ``block_groups`` gates
    nothing (every length), see :func:`block_group_pages`. InvalidArgumentError naming
    ``hit_policy`` for another policy."""
    pages = len(present)
    if policy == ALL_PAGES:
        boundary = present.index(False) if False in present else pages
        return set(range(1, boundary + 1))
    if policy == TRAILING_PAGES:
        window = max(1, window)
        run, lengths = 0, set()
        for i, held in enumerate(present):
            run = run + 1 if held else 0
            if run >= min(window, i + 1):
                lengths.add(i + 1)
        return lengths
    if policy == BLOCK_GROUPS:
        return set(range(1, pages + 1))
    raise InvalidArgumentError(
        f"hit_policy must be one of {ALL_PAGES}, {TRAILING_PAGES}, {BLOCK_GROUPS}, got {policy!r}"
    )


def block_group_pages(present: Sequence[bool], block_pages: int) -> int:
    """A ``block_groups`` pool's own verdict: the pages its leading whole blocks of
    ``block_pages`` pages cover (each block counts only if every page of it is held)."""
    if block_pages <= 0:
        return 0
    whole = 0
    for start in range(0, len(present) - block_pages + 1, block_pages):
        if not all(present[start : start + block_pages]):
            break
        whole += block_pages
    return whole
