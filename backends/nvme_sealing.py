"""Encrypted payloads on NVMe: the per-thread buffers a write seals into.

The NVMe tier moves plain payloads straight between the host pool and the disk. With
a keyring a write cannot: the host pool's slot must keep its plaintext, and AES-GCM
writes a tag after the ciphertext. So a :class:`PayloadSealer` lends each worker thread a
few page-aligned buffers (O_DIRECT still applies) on huge pages where the kernel gives
them (:func:`tiering.host_pool.io_buffer` says why that matters): a write seals the slot
into one and writes that. A read needs none: the ciphertext goes straight into the slot
and :func:`backends.block_record.verify_payload` opens it there.

Blocking, for the tier's worker threads only. The cipher runs without the GIL but not
without a core: I/O threads sealing or opening a job's blocks back to back keep the
event loop's thread off the CPU, so a thread gives up the CPU after each block
(``os.sched_yield``; :meth:`PayloadSealer.seal` here, the reader after opening).
"""

from __future__ import annotations

import os
import threading

from backends.block_record import record_binding
from backends.nvme_os import ALIGNMENT, thread_buffer
from tiering.encryption import TAG_BYTES, BlockCipher, Seal

SEAL_BATCH_BYTES = 8 << 20
"""Sealing-buffer memory per worker thread: a job's records are sealed and written this
many bytes at a time (the fastest of the sizes tried, docs/nvme.md)."""


class PayloadSealer:
    """Seals one namespace's payloads of ``block_bytes`` with ``cipher``.

    Thread-safe: each thread gets its own buffers.
    """

    def __init__(self, cipher: BlockCipher, *, block_bytes: int, ns_digest: bytes) -> None:
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
        TAG_BYTES``, this thread's, valid until its next call.

        Seal into them in order: a buffer's last ``TAG_BYTES`` may be the next one's
        first, so a seal's tag (which its :class:`Seal` keeps) spills into the next
        buffer, whose own seal then overwrites it.
        """
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
