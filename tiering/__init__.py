"""kv-tiering: an asyncio engine that keeps an LLM server's KV cache in tiers."""

from tiering.abstract import (
    BlockHash,
    CPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingEvent,
    OffloadingManager,
    PrepareStoreOutput,
)
from tiering.errors import (
    BlockNotFoundError,
    ClosedError,
    CorruptBlockError,
    InvalidArgumentError,
    NotLoadingError,
    TierBusyError,
    TieringError,
    TransferError,
    UnknownPolicyError,
    UnknownTierError,
)
from tiering.policies import EvictionPolicy, LRUPolicy, make_policy, register_policy
from tiering.secondary import JobMetadata, JobResult, SecondaryTierManager

__all__ = [
    "BlockHash",
    "BlockNotFoundError",
    "CPULoadStoreSpec",
    "ClosedError",
    "CorruptBlockError",
    "EvictionPolicy",
    "InvalidArgumentError",
    "JobMetadata",
    "JobResult",
    "LRUPolicy",
    "LoadStoreSpec",
    "NotLoadingError",
    "OffloadingEvent",
    "OffloadingManager",
    "PrepareStoreOutput",
    "SecondaryTierManager",
    "TierBusyError",
    "TieringError",
    "TransferError",
    "UnknownPolicyError",
    "UnknownTierError",
    "make_policy",
    "register_policy",
]
