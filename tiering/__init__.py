"""kv-tiering: an asyncio engine that keeps an LLM server's KV cache in tiers.

The public API, re-exported here: the seed types and :class:`CPUOffloadingManager`
(scheduler-side bookkeeping), eviction policies, prefix-chained hashing, the
secondary-tier interface, the :class:`TierActor` base and the :class:`TierClient`, the
host pool and device transfers, the sans-I/O :class:`JobCore` and the
:class:`TieringEngine` shell over it, the :class:`Lifecycle` and :class:`Statistics`
every long-lived object shares. Secondary tiers live in ``backends`` and are
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
from tiering.job_core import JobCore
from tiering.lifecycle import Lifecycle
from tiering.manager import BlockState, CPUOffloadingManager
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
from tiering.residency import ResidencyIndex
from tiering.secondary import JobMetadata, JobResult, SecondaryTierManager
from tiering.statistics import FailureLog, Statistics
from tiering.tier_client import TierClient, TierOutcome

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
    "FailureLog",
    "HostPool",
    "InvalidArgumentError",
    "Job",
    "JobCore",
    "JobMetadata",
    "JobResult",
    "LRUPolicy",
    "Lifecycle",
    "LoadStoreSpec",
    "NotLoadingError",
    "OffloadingEvent",
    "OffloadingManager",
    "PrepareStoreOutput",
    "ResidencyIndex",
    "S3FIFOPolicy",
    "SecondaryTierManager",
    "Statistics",
    "TierActor",
    "TierBusyError",
    "TierClient",
    "TierOutcome",
    "TieringEngine",
    "TieringError",
    "TransferError",
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
