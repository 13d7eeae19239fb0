"""Encrypted payloads on NVMe: a sealed write cannot go straight from the host pool (the
slot keeps its plaintext, and AES-GCM adds a tag), so :class:`PayloadSealer` lends each
I/O thread page-aligned buffers to seal into. The cipher runs without the GIL but not
without a core: a thread yields the CPU after each block, for the loop's thread.
"""

from __future__ import annotations

import os
import threading

from backends.nvme.os_calls import ALIGNMENT, thread_buffer
from tiering.security.encryption import TAG_BYTES, BlockCipher, Seal
from tiering.tiers.block_record import record_binding

SEAL_BATCH_BYTES = 8 << 20
"""Sealing-buffer memory per worker thread (the fastest size tried, docs/nvme.md)."""


class PayloadSealer:
    """Seals one namespace's payloads of ``block_bytes`` with ``cipher``; each thread
    gets its own buffers."""

    def __init__(self, cipher: BlockCipher, block_bytes: int, ns_digest: bytes) -> None:
        self.cipher = cipher
        self.block_bytes = block_bytes
        self.ns_digest = ns_digest
        # Payloads packed at page-aligned offsets, not one page further apart for their
        # tags: a 2 MiB payload then fills exactly one huge page of the buffer.
        self.stride = -(-block_bytes // ALIGNMENT) * ALIGNMENT
        self.batch = max(1, SEAL_BATCH_BYTES // self.stride)
        """The most buffers :meth:`buffers` lends a thread at once."""
        self._local = threading.local()

    def buffers(self, count: int) -> list[memoryview]:
        """``count`` (at most :attr:`batch`) page-aligned buffers of ``block_bytes +
        TAG_BYTES``, this thread's until its next call. Seal into them in order: a tag
        (kept by its :class:`Seal`) spills into the next buffer, which overwrites it."""
        if not 0 < count <= self.batch:
            raise ValueError(f"count must be in 1..{self.batch}, got {count}")
        arena = thread_buffer(self._local, "arena", self.batch * self.stride + TAG_BYTES)
        size = self.block_bytes + TAG_BYTES
        return [arena[i * self.stride : i * self.stride + size] for i in range(count)]

    def seal(self, key: bytes, payload: memoryview, buffer: memoryview) -> Seal:
        """Seal ``payload`` (``key``'s block, bound by :func:`record_binding` with no
        tenant) into ``buffer``; its first ``block_bytes`` go to disk, the seal into
        the header."""
        binding = record_binding(self.ns_digest, b"", key)
        seal = self.cipher.seal_into(payload, buffer, binding)
        os.sched_yield()
        return seal
