"""Eviction policies, selectable by name (``"lru"``, the default; ``"arc"``,
``"s3fifo"``, ``"adaptive"``). A retired name stays accepted as an alias of the policy
that replaced it (``"prefix-lfu"``: ``"adaptive"``)."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable

from tiering.core.policies.adaptive import AdaptivePolicy as AdaptivePolicy
from tiering.core.policies.arc import ARCPolicy as ARCPolicy
from tiering.core.policies.base import EvictionPolicy as EvictionPolicy
from tiering.core.policies.lru import LRUPolicy as LRUPolicy
from tiering.core.policies.s3fifo import S3FIFOPolicy as S3FIFOPolicy
from tiering.errors import UnknownPolicyError

logger = logging.getLogger(__name__)

# Not "adaptive": a block it declines skips the tiers below too, and its bookkeeping slows
# a full tier's stores (docs/benchmarks.md, the default eviction policy).
DEFAULT_POLICY = "lru"
"""The CPU tier's eviction policy wherever none is named (engine, manager, config,
replay and its model)."""

_POLICIES: dict[str, Callable[[], EvictionPolicy]] = {
    "lru": LRUPolicy,
    "arc": ARCPolicy,
    "s3fifo": S3FIFOPolicy,
    "adaptive": AdaptivePolicy,
}

_RETIRED: dict[str, str] = {"prefix-lfu": "adaptive"}  # retired name: its replacement

_warned: set[str] = set()  # retired names already warned about in this process


def register_policy(name: str, factory: Callable[[], EvictionPolicy]) -> None:
    """Make ``factory`` selectable as ``policy=name`` (replacing any, a retired alias too)."""
    _POLICIES[name] = factory
    _RETIRED.pop(name, None)


def policy_names() -> list[str]:
    """The names that ``make_policy`` accepts, sorted (retired aliases left out)."""
    return sorted(_POLICIES)


def policy_name(name: str) -> str:
    """The name ``name`` stands for: a retired name's replacement, once per process with
    a DeprecationWarning and a logged warning naming it; any other string unchanged
    (whether it is registered is :func:`make_policy`'s check)."""
    replacement = _RETIRED.get(name) if isinstance(name, str) else None
    if replacement is None:
        return name
    if name not in _warned:
        _warned.add(name)
        message = (
            f"eviction policy {name!r} is retired and now means {replacement!r}; "
            f"ask for {replacement!r}"
        )
        warnings.warn(message, DeprecationWarning, stacklevel=2)
        logger.warning(message)
    return replacement


def make_policy(policy: str | EvictionPolicy, capacity: int) -> EvictionPolicy:
    """A policy bound to ``capacity`` blocks, from a registered name (or a retired one,
    see :func:`policy_name`) or an instance. Raises UnknownPolicyError for any other
    ``policy``, InvalidArgumentError for a bad ``capacity``."""
    if isinstance(policy, EvictionPolicy):
        instance = policy
    else:
        factory = _POLICIES.get(policy_name(policy)) if isinstance(policy, str) else None
        if factory is None:
            raise UnknownPolicyError(
                f"unknown eviction policy {policy!r}; choose one of {policy_names()} "
                "or pass an EvictionPolicy instance"
            )
        instance = factory()
    instance.bind(capacity)
    return instance
