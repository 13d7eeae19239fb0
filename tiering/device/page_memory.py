"""Page-aligned anonymous memory, without torch: the mapping behind the host pool, and the
direct-I/O buffers of the NVMe tier and its command-line tools."""

from __future__ import annotations

import contextlib
import ctypes
import mmap

HUGE_PAGE_BYTES = 2 << 20
"""The size (and alignment) of a transparent huge page on x86-64 and most arm64 kernels."""


def private_mapping(nbytes: int) -> mmap.mmap:
    """``nbytes`` of zeroed, page-aligned anonymous memory that transparent huge pages may
    back: ``MAP_PRIVATE`` (THP skip shmem) and, from 2 MiB up, ``MADV_HUGEPAGE``."""
    mapping = mmap.mmap(
        -1,
        nbytes,
        flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
        prot=mmap.PROT_READ | mmap.PROT_WRITE,
    )
    if nbytes >= HUGE_PAGE_BYTES and hasattr(mmap, "MADV_HUGEPAGE"):
        with contextlib.suppress(OSError):  # only a hint; THP may be disabled
            mapping.madvise(mmap.MADV_HUGEPAGE)
    return mapping


def io_buffer(nbytes: int) -> memoryview:
    """``nbytes`` of zeroed memory for direct I/O that starts on a 2 MiB boundary, so that
    where transparent huge pages back it, every aligned 2 MiB is one physically contiguous
    page (a direct write is split into one segment per scattered page; docs/security.md).
    The memory stays mapped while any view of it lives."""
    mapping = private_mapping(nbytes + HUGE_PAGE_BYTES)
    address = ctypes.addressof(ctypes.c_char.from_buffer(mapping))  # a momentary export
    start = -address % HUGE_PAGE_BYTES
    return memoryview(mapping)[start : start + nbytes]
