"""kv-tiering: an asyncio engine that keeps an LLM server's KV cache in tiers.

The public API, re-exported here (``__all__``), each name imported from its module when
first used (so ``tiering --help`` or :mod:`tiering.cli_args` does not pay for torch);
secondary tiers live in ``backends``, built by name through :func:`make_tier`; replays,
sweeps and metrics are in ``tiering.lab`` and ``tiering.observe.metrics``."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tiering.config import TieringConfig, load_config
    from tiering.core.cpu_tier import BlockState, CPUOffloadingManager
    from tiering.core.job import Job
    from tiering.core.job_core import JobCore, LookupStatistics
    from tiering.core.policies import (
        ARCPolicy,
        EvictionPolicy,
        LRUPolicy,
        S3FIFOPolicy,
        make_policy,
        policy_names,
        register_policy,
    )
    from tiering.core.scheduler_api import (
        BlockHash,
        CPULoadStoreSpec,
        LoadStoreSpec,
        OffloadingEvent,
        OffloadingManager,
        PrepareStoreOutput,
    )
    from tiering.device.copier import CopyHandle, DeviceCopier
    from tiering.device.host_pool import HostPool
    from tiering.device.kv_layout import kv_block_bytes
    from tiering.device.layer_progress import LayerProgress
    from tiering.engine import TieringEngine
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
    from tiering.hashing import block_hashes, namespace_root
    from tiering.lab.workloads import Request, read_mooncake, synthetic_requests
    from tiering.lifecycle import Lifecycle
    from tiering.observe.events import decode_events, encode_events
    from tiering.observe.latency import LatencyHistogram, LatencySnapshot
    from tiering.observe.statistics import FailureLog, Statistics
    from tiering.security.encryption import AuthenticationError, Keyring, UnknownKeyError
    from tiering.security.tenancy import TenantLookups, tenant_keys, tenant_label
    from tiering.tiers.actor import TierActor
    from tiering.tiers.client import TierClient, TierOutcome
    from tiering.tiers.registry import make_tier, register_tier, tier_names
    from tiering.tiers.residency_index import ResidencyIndex
    from tiering.tiers.tier_api import JobMetadata, JobResult, SecondaryTierManager
    from tiering.validation import as_block_hashes

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
    "LayerProgress",
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


def _modules() -> dict[str, str]:
    """Each public name's module, as the ``TYPE_CHECKING`` imports above name it (read from
    this file, so the names are listed only there and in ``__all__``, which ruff's F401 and
    F822 keep alike)."""
    import ast

    with open(__file__, encoding="utf-8") as source:
        block = next(node for node in ast.parse(source.read()).body if isinstance(node, ast.If))
    imports = [node for node in block.body if isinstance(node, ast.ImportFrom)]
    return {alias.name: str(node.module) for node in imports for alias in node.names}


_MODULE_OF = _modules()


def __getattr__(name: str) -> object:
    """A public name, imported from its module on first use (then cached here)."""
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'tiering' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
