"""The scheduler-side offloading interface (vLLM's ``kv_offload.abstract`` semantics) a
serving framework's scheduler programs against: it asks an :class:`OffloadingManager`
which prefix blocks are offloaded, prepares loads and stores, and collects
:class:`OffloadingEvent` records for a KV-aware router."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass, field

BlockHash = bytes
"""A block's identity: bytes naming its tokens and everything before them."""


class LoadStoreSpec(ABC):
    """Where a worker finds (load) or puts (store) the bytes of some blocks."""

    @staticmethod
    @abstractmethod
    def medium() -> str:
        """The name of the medium this spec addresses, e.g. ``"CPU"``."""


@dataclass(slots=True)
class CPULoadStoreSpec(LoadStoreSpec):
    """Blocks addressed by CPU slot ids (rows of the host pool), in order."""

    block_ids: list[int]

    @staticmethod
    def medium() -> str:
        return "CPU"


@dataclass(slots=True)
class PrepareStoreOutput:
    """What a ``prepare_store`` decided: ``block_hashes_to_store[i]`` goes to slot
    ``store_spec.block_ids[i]``; ``block_hashes_evicted[i]`` left ``evicted_block_ids[i]``
    (beyond the seed type: write-back reads a victim before its slot is refilled)."""

    block_hashes_to_store: list[BlockHash]
    store_spec: LoadStoreSpec
    block_hashes_evicted: list[BlockHash]
    evicted_block_ids: list[int] = field(default_factory=list)


@dataclass(slots=True)
class OffloadingEvent:
    """Blocks that became stored (``removed=False``) or left (``removed=True``) a medium."""

    block_hashes: list[BlockHash]
    block_size: int
    medium: str
    removed: bool


class OffloadingManager(ABC):
    """Scheduler-side bookkeeping of offloaded blocks; does no I/O."""

    @abstractmethod
    def lookup(self, block_hashes: Iterable[BlockHash]) -> int:
        """Length of the leading run of ``block_hashes`` that are offloaded and ready."""

    @abstractmethod
    def prepare_load(self, block_hashes: Iterable[BlockHash]) -> LoadStoreSpec:
        """Pin the blocks for reading and say where they are; see implementations."""

    def touch(self, block_hashes: Iterable[BlockHash]) -> None:  # noqa: B027
        """Mark the blocks as recently used, the first one most recently."""

    def complete_load(self, block_hashes: Iterable[BlockHash]) -> None:  # noqa: B027
        """Release the readers added by ``prepare_load``."""

    @abstractmethod
    def prepare_store(self, block_hashes: Iterable[BlockHash]) -> PrepareStoreOutput | None:
        """Reserve room for the blocks not yet present; ``None`` if they cannot fit."""

    def complete_store(  # noqa: B027
        self, block_hashes: Iterable[BlockHash], success: bool = True
    ) -> None:
        """Mark prepared blocks stored, or drop the not-yet-ready ones on failure."""

    def take_events(self) -> Iterable[OffloadingEvent]:
        """Events collected since the last call, oldest first."""
        return ()
