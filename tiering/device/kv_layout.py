"""The device KV cache's layout, and the planning of copies between it and host slots
(pure: no streams, no threads, no I/O). A block's bytes in a host slot are its rows
across the KV cache's tensors, in list order."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from tiering.errors import InvalidArgumentError

if TYPE_CHECKING:
    from tiering.device.layer_progress import LayerProgress

KVCaches = torch.Tensor | Sequence[torch.Tensor]
"""A device KV cache: one tensor, or one tensor per layer; first dim = block id."""

# Widest first: gathers move whole words when every row and offset allows it.
_WORD_DTYPES = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))


@dataclass(frozen=True, slots=True)
class KVLayout:
    """A checked device KV cache seen as words: layer ``i`` (``layers[i]``, shape
    ``[num_blocks, widths[i]]``, dtype ``word``) fills columns ``offsets[i] : offsets[i]
    + widths[i]`` of a block's ``block_words`` words."""

    layers: tuple[torch.Tensor, ...]
    offsets: tuple[int, ...]
    widths: tuple[int, ...]
    word: torch.dtype
    word_bytes: int
    num_blocks: int
    block_bytes: int
    device: torch.device

    @property
    def columns(self) -> tuple[tuple[torch.Tensor, int, int], ...]:
        """``(layer, offset, width)`` for every layer, in order."""
        return tuple(zip(self.layers, self.offsets, self.widths, strict=True))

    @property
    def block_words(self) -> int:
        """Words per block (the width of a host slot seen as ``word``)."""
        return self.block_bytes // self.word_bytes


def describe_kv_caches(kv_caches: object) -> KVLayout:
    """``kv_caches`` as a :class:`KVLayout` aliasing its memory: a tensor or sequence of
    tensors, each dense, contiguous, with a block dim and non-empty rows, all on one cuda
    or cpu device with one number of blocks (dtypes may differ); else InvalidArgumentError
    naming the offending tensor."""
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
    row_bytes: list[int] = []
    for i, tensor in enumerate(tensors):
        if not isinstance(tensor, torch.Tensor) or tensor.dim() == 0:
            raise InvalidArgumentError(f"kv_caches[{i}] must be a tensor with a block dim")
        if i == 0:
            num_blocks, device = tensor.shape[0], tensor.device
            if num_blocks <= 0:
                raise InvalidArgumentError("the device KV cache has no blocks")
            if device.type not in ("cuda", "cpu"):
                raise InvalidArgumentError(
                    f"device KV cache on {device}: only cuda and cpu are supported"
                )
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
    return KVLayout(layers, offsets, widths, word, word_bytes, num_blocks, sum(row_bytes), device)


def kv_block_bytes(kv_caches: KVCaches) -> int:
    """Bytes of one block of ``kv_caches``; raises as :func:`describe_kv_caches`."""
    return describe_kv_caches(kv_caches).block_bytes


class Direction(enum.Enum):
    """Which way a copy moves bytes."""

    TO_HOST = "to_host"
    TO_DEVICE = "to_device"


@dataclass(frozen=True, slots=True)
class SlotRun:
    """``length`` consecutive host slots from ``first_slot``, staging rows from ``first_row``."""

    first_slot: int
    first_row: int
    length: int


@dataclass(frozen=True, slots=True)
class CopyChunk:
    """A part of a job that fits the staging buffer: row ``r`` holds device block
    ``device_ids[r]``; ``runs`` map the rows, in order, onto host slots, each row once."""

    device_ids: tuple[int, ...]
    runs: tuple[SlotRun, ...]


def plan_copy(
    device_ids: Sequence[int], slots: Sequence[int], max_rows: int
) -> tuple[CopyChunk, ...]:
    """Plan copying device block ``device_ids[i]`` to/from host slot ``slots[i]`` in
    chunks of at most ``max_rows`` pairs, ordered by slot for the fewest runs. Raises
    InvalidArgumentError if the lengths differ or ``max_rows < 1``."""
    if len(device_ids) != len(slots):
        raise InvalidArgumentError(f"{len(device_ids)} device block ids but {len(slots)} slots")
    if max_rows < 1:
        raise InvalidArgumentError(f"max_rows must be at least 1, got {max_rows}")
    if len(slots) == 1:  # the scheduler's common case, without the sort
        return (CopyChunk((device_ids[0],), (SlotRun(slots[0], 0, 1),)),)
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


@dataclass(eq=False, slots=True, repr=False)
class PlannedCopy:
    """One checked copy job, as a copy backend receives it: device block
    ``device_ids[i]`` to or from host slot ``slots[i]``; ``chunks`` is planned on first
    use. ``progress`` (a copy to the device only) wants each layer marked as its rows of
    every block land, in layer order. Compared by identity: a backend reports a job's end
    by handing it back."""

    direction: Direction
    device_ids: Sequence[int]
    slots: Sequence[int]
    max_rows: int
    progress: LayerProgress | None = None
    _chunks: tuple[CopyChunk, ...] | None = field(default=None, init=False)

    @property
    def chunks(self) -> tuple[CopyChunk, ...]:
        if self._chunks is None:
            self._chunks = plan_copy(self.device_ids, self.slots, self.max_rows)
        return self._chunks

    def __repr__(self) -> str:
        return f"<PlannedCopy {self.direction.value} {len(self.device_ids)} blocks>"


CopyOutcome = tuple[PlannedCopy, BaseException | None]
"""How a backend reports a copy's end: the job, and the error that failed it (or None)."""
