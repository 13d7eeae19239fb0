"""Eviction policies, selectable by name (``"lru"``, ``"arc"``, ``"s3fifo"``,
``"prefix-lfu"``, ``"adaptive"``)."""

from __future__ import annotations

from collections.abc import Callable

from tiering.errors import UnknownPolicyError
from tiering.policies.adaptive import AdaptivePolicy
from tiering.policies.arc import ARCPolicy
from tiering.policies.base import EvictionPolicy
from tiering.policies.lru import LRUPolicy
from tiering.policies.prefix_lfu import PrefixLFUPolicy
from tiering.policies.s3fifo import S3FIFOPolicy

_POLICIES: dict[str, Callable[[], EvictionPolicy]] = {
    "lru": LRUPolicy,
    "arc": ARCPolicy,
    "s3fifo": S3FIFOPolicy,
    "prefix-lfu": PrefixLFUPolicy,
    "adaptive": AdaptivePolicy,
}


def register_policy(name: str, factory: Callable[[], EvictionPolicy]) -> None:
    """Make ``factory`` selectable as ``policy=name``; a later registration replaces it."""
    _POLICIES[name] = factory


def policy_names() -> list[str]:
    """The names that ``make_policy`` accepts, sorted."""
    return sorted(_POLICIES)


def make_policy(policy: str | EvictionPolicy, capacity: int) -> EvictionPolicy:
    """A policy bound to ``capacity`` blocks, from a registered name or an instance.
    Raises UnknownPolicyError for any other ``policy``, InvalidArgumentError for a bad
    ``capacity``."""
    if isinstance(policy, EvictionPolicy):
        instance = policy
    elif isinstance(policy, str) and policy in _POLICIES:
        instance = _POLICIES[policy]()
    else:
        raise UnknownPolicyError(
            f"unknown eviction policy {policy!r}; choose one of {policy_names()} "
            "or pass an EvictionPolicy instance"
        )
    instance.bind(capacity)
    return instance


__all__ = [
    "ARCPolicy",
    "AdaptivePolicy",
    "EvictionPolicy",
    "LRUPolicy",
    "PrefixLFUPolicy",
    "S3FIFOPolicy",
    "make_policy",
    "policy_names",
    "register_policy",
]
