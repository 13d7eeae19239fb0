"""Page-aligned anonymous memory (tiering.device.page_memory)."""

from __future__ import annotations

import mmap

import numpy as np
import pytest

from tiering.device.page_memory import HUGE_PAGE_BYTES, io_buffer


@pytest.mark.parametrize("nbytes", [1, mmap.PAGESIZE, HUGE_PAGE_BYTES + 16, 3 * HUGE_PAGE_BYTES])
def test_io_buffer_starts_on_a_huge_page_boundary_zeroed_and_writable(nbytes: int) -> None:
    buffer = io_buffer(nbytes)
    array = np.frombuffer(buffer, dtype=np.uint8)
    assert buffer.nbytes == nbytes
    assert array.ctypes.data % HUGE_PAGE_BYTES == 0
    assert not array.any()
    buffer[-1] = 7
    assert array[-1] == 7
