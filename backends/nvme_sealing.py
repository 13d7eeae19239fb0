"""Encrypted payloads on NVMe: seal on the way to disk, open on the way back.

The NVMe tier moves plain payloads straight between the host pool and the disk. With
a keyring a write cannot: the host pool's slot must keep its plaintext, and AES-GCM
writes a tag after the ciphertext. So a :class:`PayloadSealer` lends each worker thread a
few page-aligned buffers (O_DIRECT still applies) on huge pages where the kernel gives
them (:func:`tiering.host_pool.io_buffer` says why that matters): a write seals the slot
into one and writes that. A read needs none: the ciphertext goes straight into the slot,
as a plain payload does, and is opened where it lies (a slot whose block does not
authenticate holds garbage, and the tier reports its key failed, as for a checksum
mismatch; a failed key's slot is never served). Opened in place, sealed loads cost no
more than plain ones (docs/security.md has the figures).

Blocking, for the tier's worker threads only. The cipher runs without the GIL but not
without a core: I/O threads opening a job's blocks back to back keep the event loop's
thread off the CPU, so a thread gives up the CPU after each block it seals or opens
(``os.sched_yield``).
"""

from __future__ import annotations

import os
import threading

from backends.nvme_format import BlockHeader
from backends.nvme_os import ALIGNMENT
from tiering.encryption import TAG_BYTES, BlockCipher, Seal, associated_data
from tiering.errors import CorruptBlockError
from tiering.host_pool import io_buffer

SEAL_BATCH_BYTES = 8 << 20
"""Sealing-buffer memory per worker thread: a job's records are sealed and written this
many bytes at a time (the fastest of the sizes tried, docs/nvme.md)."""


class PayloadSealer:
    """Seals and opens one namespace's payloads of ``block_bytes`` with ``cipher``.

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
        arena: memoryview | None = getattr(self._local, "arena", None)
        if arena is None:
            arena = io_buffer(self.batch * self.stride + TAG_BYTES)
            self._local.arena = arena
        size = self.block_bytes + TAG_BYTES
        return [arena[i * self.stride : i * self.stride + size] for i in range(count)]

    def seal(self, key: bytes, payload: memoryview, buffer: memoryview) -> Seal:
        """Seal ``payload`` (``key``'s block) into ``buffer``; the first ``block_bytes``
        of it are what goes to disk, the seal goes into the header."""
        seal = self.cipher.seal_into(payload, buffer, associated_data(self.ns_digest, key))
        os.sched_yield()
        return seal

    def open(self, header: BlockHeader, slot: memoryview) -> None:
        """Open, where it lies, the ciphertext read into ``slot`` (the block ``header``
        describes, already checked against the expected key and namespace).

        Raises:
            CorruptBlockError: the block is not sealed, or it does not open (an unknown
                key id, a wrong key, altered or moved bytes); ``slot`` then holds
                garbage.
        """
        if header.seal is None:
            raise CorruptBlockError("block is not encrypted, and this tier reads only sealed ones")
        aad = associated_data(self.ns_digest, header.key)
        self.cipher.open_in_place(header.seal, slot, aad)
        os.sched_yield()
