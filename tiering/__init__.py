"""kv-tiering: an asyncio engine that keeps an LLM server's KV cache in tiers.

The public API, re-exported here: the seed types and :class:`CPUOffloadingManager`
(scheduler-side bookkeeping), eviction policies, prefix-chained hashing, the
secondary-tier interface, the :class:`TierActor` base and the :class:`TierClient`, the
host pool and device transfers, the sans-I/O :class:`JobCore` and the
:class:`TieringEngine` shell over it, the :class:`Lifecycle` and :class:`Statistics`
every long-lived object shares; tenants' keys (:func:`tenant_keys`) and the
:class:`Keyring` of encryption at rest; the typed :class:`TieringConfig`, workloads
(:func:`read_mooncake`, :func:`synthetic_requests`), job latency histograms and the KV
event wire format. Secondary tiers live in ``backends`` and are built by name through
:func:`make_tier`. Replays, sweeps and metrics are in ``tiering.replay``,
``tiering.sweep`` and ``tiering.metrics`` (the last needs prometheus-client).
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
from tiering.config import TieringConfig, load_config
from tiering.device import CopyHandle, DeviceCopier, kv_block_bytes
from tiering.encryption import AuthenticationError, Keyring, UnknownKeyError
from tiering.engine import Job, TieringEngine
from tiering.errors import (
    BlockNotFoundError,
    ClosedError,
    ConfigError,
    CorruptBlockError,
    InvalidArgumentError,
    NotLoadingError,
    TierBusyError,
    TieringError,
    TraceError,
    TransferError,
    UnknownPolicyError,
    UnknownTierError,
)
from tiering.events import decode_events, encode_events
from tiering.hashing import block_hashes, namespace_root
from tiering.host_pool import HostPool
from tiering.job_core import JobCore, LookupStatistics
from tiering.latency import LatencyHistogram, LatencySnapshot
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
from tiering.tenancy import TenantLookups, tenant_keys, tenant_label
from tiering.tier_client import TierClient, TierOutcome
from tiering.workloads import Request, read_mooncake, synthetic_requests

__all__ = [
    "ARCPolicy",
    "AuthenticationError",
    "BlockHash",
    "BlockNotFoundError",
    "BlockState",
    "CPULoadStoreSpec",
    "CPUOffloadingManager",
    "ClosedError",
    "ConfigError",
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
    "Keyring",
    "LRUPolicy",
    "LatencyHistogram",
    "LatencySnapshot",
    "Lifecycle",
    "LoadStoreSpec",
    "LookupStatistics",
    "NotLoadingError",
    "OffloadingEvent",
    "OffloadingManager",
    "PrepareStoreOutput",
    "Request",
    "ResidencyIndex",
    "S3FIFOPolicy",
    "SecondaryTierManager",
    "Statistics",
    "TenantLookups",
    "TierActor",
    "TierBusyError",
    "TierClient",
    "TierOutcome",
    "TieringConfig",
    "TieringEngine",
    "TieringError",
    "TraceError",
    "TransferError",
    "UnknownKeyError",
    "UnknownPolicyError",
    "UnknownTierError",
    "as_block_hashes",
    "block_hashes",
    "decode_events",
    "encode_events",
    "kv_block_bytes",
    "load_config",
    "make_policy",
    "make_tier",
    "namespace_root",
    "policy_names",
    "read_mooncake",
    "register_policy",
    "register_tier",
    "synthetic_requests",
    "tenant_keys",
    "tenant_label",
    "tier_names",
]
