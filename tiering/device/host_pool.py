"""The CPU tier's memory: one page-aligned, optionally pinned buffer of fixed-size slots;
slot ``i`` is bytes ``[i * block_bytes, (i + 1) * block_bytes)``. Why an anonymous
``mmap`` pinned in place: docs/architecture.md#the-host-pool."""

from __future__ import annotations

import contextlib
import mmap
import weakref
from typing import Any, Self

import torch

from tiering.device.page_memory import private_mapping
from tiering.errors import ClosedError, InvalidArgumentError, TieringError
from tiering.validation import positive_int

# Portable: every device may copy from it; mapped: kernels may read and write it in place
# (the CUDA backend's layer-by-layer loads).
_CUDA_HOST_REGISTER_FLAGS = 1 | 2  # cudaHostRegisterPortable | cudaHostRegisterMapped


def _cuda_host_register(address: int, nbytes: int) -> None:
    try:
        cudart = torch.cuda.cudart()
        # The binding returns a cudaError_t enum whose only named value is `success`;
        # compare its integer value (0) rather than rebuild the enum from an unknown code.
        code = int(cudart.cudaHostRegister(address, nbytes, _CUDA_HOST_REGISTER_FLAGS))
    except Exception as exc:  # CUDA could not be initialised
        raise TieringError(f"cannot page-lock the {nbytes}-byte host pool: {exc}") from exc
    if code != 0:
        try:
            text = str(cudart.cudaGetErrorString(cudart.cudaError(code)))
        except Exception:  # an older binding or a code the enum cannot hold
            text = "no description"
        raise TieringError(
            f"cannot page-lock the {nbytes}-byte host pool: cudaHostRegister returned "
            f"cudaError {code} ({text})"
        )


def _cuda_host_unregister(address: int) -> None:
    # Best effort: at teardown the CUDA context may already be gone, and the memory is
    # unmapped (or left to the views still alive) either way.
    with contextlib.suppress(Exception):
        torch.cuda.cudart().cudaHostUnregister(address)


class HostPool:
    """``num_blocks`` slots of ``block_bytes`` bytes each in one page-aligned buffer:
    ``view`` (secondary tiers) and ``tensor`` (device copies) alias the same zero-filled
    bytes, page-locked for CUDA DMA and mapped for CUDA kernels when ``pinned``
    (``pin=None``: if CUDA is available). Raises InvalidArgumentError for bad sizes or
    ``pin``, TieringError if page-locking fails. After ``close()`` both accessors raise
    ClosedError, and the mapping goes once no view or tensor handed out is alive."""

    def __init__(self, num_blocks: int, block_bytes: int, *, pin: bool | None = None) -> None:
        self.num_blocks = positive_int("num_blocks", num_blocks)
        self.block_bytes = positive_int("block_bytes", block_bytes)
        if pin is None:
            pin = torch.cuda.is_available()
        elif not isinstance(pin, bool):
            raise InvalidArgumentError(f"pin must be True, False or None, got {pin!r}")
        elif pin and not torch.cuda.is_available():
            raise InvalidArgumentError(
                "pin=True needs CUDA, and torch.cuda.is_available() is False"
            )
        self.nbytes = self.num_blocks * self.block_bytes

        self._mmap: mmap.mmap | None = private_mapping(self.nbytes)
        # Over a memoryview, not the mapping: torch.frombuffer releases its own buffer
        # export, so only this view's keeps mmap.close() from unmapping a live tensor.
        flat = torch.frombuffer(memoryview(self._mmap), dtype=torch.uint8)
        self._tensor: torch.Tensor | None = flat.view(self.num_blocks, self.block_bytes)
        self._view: memoryview | None = memoryview(self._mmap)
        address = flat.data_ptr()
        self.pinned = False
        """True while the buffer is page-locked for CUDA (False once closed)."""
        self._unpin: weakref.finalize[Any, Any] | None = None
        if pin:
            try:
                _cuda_host_register(address, self.nbytes)
            except BaseException:
                self._release_memory()
                raise
            self.pinned = True
            # Unpin if the pool is dropped without close(); not at interpreter exit,
            # when the CUDA runtime may already be torn down.
            self._unpin = weakref.finalize(self, _cuda_host_unregister, address)
            self._unpin.atexit = False

    @property
    def closed(self) -> bool:
        return self._tensor is None

    @property
    def view(self) -> memoryview:
        """The whole buffer as a flat writable ``memoryview``."""
        return self._check_open()[1]

    @property
    def tensor(self) -> torch.Tensor:
        """The whole buffer as a ``uint8`` tensor ``[num_blocks, block_bytes]``."""
        return self._check_open()[0]

    def close(self) -> None:
        """Unpin and release the buffer; idempotent."""
        if self.closed:
            return
        if self._unpin is not None:
            self._unpin()  # cudaHostUnregister, at most once
            self._unpin = None
        self.pinned = False
        self._release_memory()

    def __enter__(self) -> Self:
        self._check_open()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else ("pinned" if self.pinned else "pageable")
        return f"HostPool(num_blocks={self.num_blocks}, block_bytes={self.block_bytes}, {state})"

    def _check_open(self) -> tuple[torch.Tensor, memoryview]:
        if self._tensor is None or self._view is None:
            raise ClosedError("the host pool is closed")
        return self._tensor, self._view

    def _release_memory(self) -> None:
        view, self._view = self._view, None
        self._tensor = None  # drops the storage, and with it torch's export, if unshared
        mapping, self._mmap = self._mmap, None
        if view is not None:
            # A consumer may hold a buffer export of it; then it stays valid until dropped.
            with contextlib.suppress(BufferError):
                view.release()
        if mapping is not None:
            # If views handed out are alive, the mapping is unmapped with the last one.
            with contextlib.suppress(BufferError):
                mapping.close()
