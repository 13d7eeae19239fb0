"""kv-tiering: an asyncio engine that keeps an LLM server's KV cache in tiers.

The public API, re-exported here: the seed types and :class:`CPUOffloadingManager`
(scheduler-side bookkeeping), eviction policies, prefix-chained hashing, the
secondary-tier interface and the :class:`TierActor` base, the host pool and device
transfers, and :class:`TieringEngine`. Secondary tiers live in ``backends`` and are
built by name through :func:`make_tier`.
"""

from tiering.abstract import (
    BlockHash,
    CPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingEvent,
    OffloadingManager,
    PrepareStoreOutput,
    as_block_hashes,
)
from tiering.actor import TierActor
from tiering.device import CopyHandle, DeviceCopier, kv_block_bytes
from tiering.engine import Job, TieringEngine
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
from tiering.hashing import block_hashes, namespace_root
from tiering.host_pool import HostPool
from tiering.manager import BlockState, CPUOffloadingManager
from tiering.planner import TransferPlanner
from tiering.policies import (
    ARCPolicy,
    EvictionPolicy,
    LRUPolicy,
    S3FIFOPolicy,
    make_policy,
    policy_names,
    register_policy,
)
from tiering.registry import make_tier, register_tier, tier_names
from tiering.secondary import JobMetadata, JobResult, SecondaryTierManager

__all__ = [
    "ARCPolicy",
    "BlockHash",
    "BlockNotFoundError",
    "BlockState",
    "CPULoadStoreSpec",
    "CPUOffloadingManager",
    "ClosedError",
    "CopyHandle",
    "CorruptBlockError",
    "DeviceCopier",
    "EvictionPolicy",
    "HostPool",
    "InvalidArgumentError",
    "Job",
    "JobMetadata",
    "JobResult",
    "LRUPolicy",
    "LoadStoreSpec",
    "NotLoadingError",
    "OffloadingEvent",
    "OffloadingManager",
    "PrepareStoreOutput",
    "S3FIFOPolicy",
    "SecondaryTierManager",
    "TierActor",
    "TierBusyError",
    "TieringEngine",
    "TieringError",
    "TransferError",
    "TransferPlanner",
    "UnknownPolicyError",
    "UnknownTierError",
    "as_block_hashes",
    "block_hashes",
    "kv_block_bytes",
    "make_policy",
    "make_tier",
    "namespace_root",
    "policy_names",
    "register_policy",
    "register_tier",
    "tier_names",
]
