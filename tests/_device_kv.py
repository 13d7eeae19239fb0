"""Shared helpers of the copier tests: KV caches of real random bytes, host-slot images,
and a thread pool whose workers a test can hold and whose hops it can count."""

from __future__ import annotations

import math
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import pytest
import torch

from tiering.device.copier import CopyBackend, DeviceCopier
from tiering.device.host_pool import HostPool

NUM_BLOCKS = 12
NUM_SLOTS = 10

KV = torch.Tensor | list[torch.Tensor]

# name -> per-layer (row shape, dtype); "one_tensor" is passed as a bare tensor.
LAYOUTS: dict[str, list[tuple[tuple[int, ...], torch.dtype]]] = {
    "one_tensor": [((2, 4, 8), torch.float16)],
    "mixed_dtypes": [((2, 4, 8), torch.float16), ((3, 5), torch.float32), ((7,), torch.bfloat16)],
    "odd_bytes": [((5,), torch.uint8), ((3,), torch.float32)],
}
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Random bit patterns of every kind (NaNs included): equality is checked on bytes."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).view(shape)


def make_kv(layout: str, device: str, seed: int = 0, num_blocks: int = NUM_BLOCKS) -> KV:
    gen = torch.Generator().manual_seed(seed)
    layers = [
        random_tensor((num_blocks, *row), dtype, gen).to(device) for row, dtype in LAYOUTS[layout]
    ]
    return layers[0] if layout == "one_tensor" else layers


def layers_of(kv: KV) -> list[torch.Tensor]:
    return [kv] if isinstance(kv, torch.Tensor) else kv


def block_bytes_of(kv: KV) -> int:
    return sum(t[0].numel() * t.element_size() for t in layers_of(kv))


def device_block(kv: KV, block: int) -> bytes:
    """The host-slot image of a device block: its rows' bytes, layer after layer."""
    return b"".join(
        t[block].contiguous().view(torch.uint8).cpu().numpy().tobytes() for t in layers_of(kv)
    )


def slot_bytes(pool: HostPool, slot: int) -> bytes:
    """The bytes host slot ``slot`` holds now."""
    return pool.tensor[slot].numpy().tobytes()


def snapshot(kv: KV) -> list[torch.Tensor]:
    return [t.view(torch.uint8).cpu().clone() for t in layers_of(kv)]


def same_bytes(kv: KV, before: list[torch.Tensor]) -> bool:
    return all(torch.equal(a, b) for a, b in zip(snapshot(kv), before, strict=True))


async def assert_round_trip(copier: DeviceCopier, kv: KV, pool: HostPool) -> None:
    """Seven blocks to scattered slots (more than one staging chunk), wiped, and back."""
    ids, slots = [11, 2, 3, 9, 0, 5, 7], [0, 9, 1, 2, 8, 4, 5]
    await copier.to_host(ids, slots)
    for block, slot in zip(ids, slots, strict=True):
        assert slot_bytes(pool, slot) == device_block(kv, block)
    before = snapshot(kv)
    for t in layers_of(kv):
        t.zero_()
    await copier.to_device(slots, ids)
    for i, (t, b) in enumerate(zip(snapshot(kv), before, strict=True)):
        assert torch.equal(t[ids], b[ids]), f"layer {i}"


@asynccontextmanager
async def opened(
    layout: str = "mixed_dtypes",
    device: str = "cpu",
    *,
    backend: CopyBackend | None = None,
    **kwargs: int,
) -> AsyncIterator[tuple[DeviceCopier, KV, HostPool]]:
    """An entered copier over a fresh KV cache and a host pool of random bytes."""
    kv = make_kv(layout, device)
    with HostPool(NUM_SLOTS, block_bytes_of(kv)) as pool:
        pool.tensor.copy_(torch.randint(0, 256, pool.tensor.shape, dtype=torch.uint8))
        async with DeviceCopier(kv, pool, backend=backend, **kwargs) as copier:
            yield copier, kv, pool


class CountingExecutor(ThreadPoolExecutor):
    """A thread pool that counts its ``submit`` calls (one per hop of a copy backend)."""

    def __init__(self, workers: int) -> None:
        super().__init__(max_workers=workers, thread_name_prefix="test-copy")
        self.workers = workers
        self.submits = 0

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        self.submits += 1
        return super().submit(fn, *args, **kwargs)

    @contextmanager
    def held(self) -> Iterator[threading.Event]:
        """Occupy every worker until the yielded event is set (or the block ends).

        The holding calls are submitted through the base class: they are not counted.
        """
        gate = threading.Event()
        started = threading.Barrier(self.workers + 1)

        def hold() -> None:
            started.wait()
            gate.wait()

        for _ in range(self.workers):
            super().submit(hold)
        started.wait()
        try:
            yield gate
        finally:
            gate.set()


@contextmanager
def failing_index_copy(monkeypatch: pytest.MonkeyPatch, nth: int, message: str) -> Iterator[None]:
    """Inside the block, the ``nth`` call of ``Tensor.index_copy_`` (a scatter into a
    layer, one per layer and chunk) raises ``RuntimeError(message)``; the others copy."""
    real = torch.Tensor.index_copy_
    calls = [0]

    def fails_once(self: torch.Tensor, *args: Any) -> torch.Tensor:
        calls[0] += 1
        if calls[0] == nth:
            raise RuntimeError(message)
        return real(self, *args)

    with monkeypatch.context() as patch:
        patch.setattr(torch.Tensor, "index_copy_", fails_once)
        yield
