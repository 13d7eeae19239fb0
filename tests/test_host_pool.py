"""HostPool: the CPU tier's page-aligned slot buffer."""

from __future__ import annotations

import gc
import mmap
import os

import numpy as np
import pytest
import torch

from tiering.device.host_pool import HostPool
from tiering.errors import ClosedError, InvalidArgumentError, TieringError

needs_no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only path")


def _mapped_regions() -> list[tuple[int, int]]:
    with open("/proc/self/maps") as maps:
        lines = maps.readlines()
    regions = []
    for line in lines:
        start, end = line.split(maxsplit=1)[0].split("-")
        regions.append((int(start, 16), int(end, 16)))
    return regions


def _is_mapped(address: int, nbytes: int) -> bool:
    return any(start <= address and address + nbytes <= end for start, end in _mapped_regions())


def test_buffer_is_page_aligned() -> None:
    with HostPool(3, 1000) as pool:
        address = pool.tensor.data_ptr()
        assert address % 4096 == 0 and address % mmap.PAGESIZE == 0


def test_sizes_and_shapes_match_the_arguments() -> None:
    with HostPool(5, 48) as pool:
        assert (pool.num_blocks, pool.block_bytes, pool.nbytes) == (5, 48, 240)
        assert pool.tensor.shape == (5, 48) and pool.tensor.dtype == torch.uint8
        assert pool.view.format == "B" and pool.view.nbytes == 240 and not pool.view.readonly


def test_buffer_starts_zeroed() -> None:
    with HostPool(4, 64) as pool:
        assert bytes(pool.view) == bytes(pool.nbytes)


def test_write_through_tensor_is_seen_through_view() -> None:
    with HostPool(4, 16) as pool:
        pool.tensor[2] = torch.arange(16, dtype=torch.uint8)
        assert bytes(pool.view[32:48]) == bytes(range(16))


def test_write_through_view_is_seen_through_tensor() -> None:
    with HostPool(4, 16) as pool:
        pool.view[16:32] = b"\xab" * 16
        assert torch.equal(pool.tensor[1], torch.full((16,), 0xAB, dtype=torch.uint8))
        assert pool.tensor[0].sum().item() == 0 and pool.tensor[2].sum().item() == 0


def test_numpy_view_of_the_memoryview_shares_memory() -> None:
    with HostPool(2, 8) as pool:
        array = np.frombuffer(pool.view, dtype=np.uint8)
        pool.tensor[1].fill_(9)
        assert array[8:].tolist() == [9] * 8
        del array


@pytest.mark.parametrize("bad", [0, -1, 1.5, "4", True, None])
def test_bad_num_blocks_is_rejected(bad: object) -> None:
    with pytest.raises(InvalidArgumentError, match="num_blocks"):
        HostPool(bad, 64)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [0, -8, 2.0, b"1", False])
def test_bad_block_bytes_is_rejected(bad: object) -> None:
    with pytest.raises(InvalidArgumentError, match="block_bytes"):
        HostPool(4, bad)  # type: ignore[arg-type]


def test_integer_like_sizes_are_accepted() -> None:
    with HostPool(np.int64(3), np.int32(16)) as pool:  # type: ignore[arg-type]
        assert (pool.num_blocks, pool.block_bytes) == (3, 16)


def test_pin_must_be_bool_or_none() -> None:
    with pytest.raises(InvalidArgumentError, match="pin"):
        HostPool(1, 8, pin="yes")  # type: ignore[arg-type]


@needs_no_cuda
def test_pin_true_without_cuda_is_rejected() -> None:
    with pytest.raises(InvalidArgumentError, match="CUDA"):
        HostPool(1, 8, pin=True)


@needs_no_cuda
def test_default_is_unpinned_without_cuda() -> None:
    with HostPool(1, 8) as pool:
        assert not pool.pinned


def test_pin_false_gives_pageable_memory() -> None:
    with HostPool(2, 4096, pin=False) as pool:
        assert not pool.pinned
        assert not pool.tensor.is_pinned()


def test_every_accessor_raises_closed_error_after_close() -> None:
    pool = HostPool(2, 8)
    pool.close()
    assert pool.closed
    for use in (
        lambda: pool.view,
        lambda: pool.tensor,
    ):
        with pytest.raises(ClosedError):
            use()
    assert (pool.num_blocks, pool.block_bytes, pool.nbytes) == (2, 8, 16)


def test_close_is_idempotent() -> None:
    pool = HostPool(2, 8)
    pool.close()
    pool.close()
    assert pool.closed and not pool.pinned


def test_context_manager_closes_the_pool() -> None:
    with HostPool(2, 8) as pool:
        assert not pool.closed
    assert pool.closed


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs /proc/self/maps")
def test_close_unmaps_the_buffer() -> None:
    pool = HostPool(4, 2 << 20)
    address, nbytes = pool.tensor.data_ptr(), pool.nbytes
    assert _is_mapped(address, nbytes)
    pool.close()
    assert not _is_mapped(address, nbytes)


def test_close_keeps_memory_alive_for_a_view_still_held() -> None:
    pool = HostPool(3, 4096)
    slot = pool.tensor[1]
    slot.fill_(7)
    flat = pool.view[4096:8192]
    pool.close()
    # Reading after close must see the bytes, not unmapped memory.
    assert slot.sum().item() == 7 * 4096
    assert bytes(flat) == b"\x07" * 4096


class _FakeCudart:
    """Records the page-locking calls HostPool makes; ``register_error`` is the code returned."""

    cudaError = int

    def __init__(self, register_error: int = 0) -> None:
        self.register_error = register_error
        self.calls: list[tuple[object, ...]] = []

    def cudaHostRegister(self, address: int, nbytes: int, flags: int) -> int:
        self.calls.append(("register", address, nbytes, flags))
        return self.register_error

    def cudaHostUnregister(self, address: int) -> int:
        self.calls.append(("unregister", address))
        return 0

    def cudaGetErrorString(self, code: int) -> str:
        return "out of memory" if code == 2 else "unknown"


@pytest.fixture
def fake_cudart(monkeypatch: pytest.MonkeyPatch) -> _FakeCudart:
    """CUDA reported available, with the runtime calls answered by a recorder (no GPU used)."""
    cudart = _FakeCudart()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    return cudart


def test_pinning_registers_the_whole_buffer_once_and_close_unregisters_it(
    fake_cudart: _FakeCudart,
) -> None:
    pool = HostPool(3, 4096)  # pin=None pins when CUDA is available
    address = pool.tensor.data_ptr()
    assert pool.pinned
    assert fake_cudart.calls == [("register", address, 3 * 4096, 3)]  # portable | mapped
    pool.close()
    pool.close()
    assert fake_cudart.calls[1:] == [("unregister", address)]
    assert not pool.pinned


def test_pool_dropped_without_close_is_unregistered(fake_cudart: _FakeCudart) -> None:
    pool = HostPool(2, 4096, pin=True)
    address = pool.tensor.data_ptr()
    del pool
    gc.collect()
    assert fake_cudart.calls[-1] == ("unregister", address)


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs /proc/self/maps")
def test_failed_page_lock_raises_tiering_error_and_unmaps_the_buffer(
    fake_cudart: _FakeCudart,
) -> None:
    fake_cudart.register_error = 2
    with pytest.raises(TieringError, match=r"cudaError 2 \(out of memory\)"):
        HostPool(4, 2 << 20, pin=True)
    [(_, address, nbytes, _)] = fake_cudart.calls  # registered once, never unregistered
    gc.collect()
    assert not _is_mapped(address, nbytes)


@pytest.mark.cuda
def test_pool_is_pinned_by_default_with_cuda() -> None:
    with HostPool(4, 1 << 20) as pool:
        assert pool.pinned
        assert pool.tensor.is_pinned()
        assert pool.tensor[3].is_pinned()
        assert pool.tensor.data_ptr() % 4096 == 0


@pytest.mark.cuda
def test_pinned_pool_is_unpinned_on_close_while_a_view_lives() -> None:
    pool = HostPool(2, 1 << 20, pin=True)
    slot = pool.tensor[0]
    assert slot.is_pinned()
    pool.close()
    assert not slot.is_pinned()
    slot.fill_(3)
    assert slot.sum().item() == 3 << 20
