"""Policies by name: the registry, the default, and a retired name as an alias of its
replacement (``tiering.core.policies``)."""

from __future__ import annotations

import pytest

from tests._scripts import run_script
from tiering.core.policies import (
    DEFAULT_POLICY,
    AdaptivePolicy,
    EvictionPolicy,
    make_policy,
    policy_names,
)
from tiering.errors import UnknownPolicyError


def test_the_default_policy_is_a_registered_one() -> None:
    assert isinstance(make_policy(DEFAULT_POLICY, 4), EvictionPolicy)


RETIRED_WARNING = "ignore:eviction policy 'prefix-lfu' is retired:DeprecationWarning"
"""For tests that use the alias in this process: whether it warns here is the order's."""


@pytest.mark.filterwarnings(RETIRED_WARNING)
def test_the_retired_prefix_lfu_builds_the_adaptive_policy() -> None:
    policy = make_policy("prefix-lfu", 8)
    assert isinstance(policy, AdaptivePolicy) and policy.capacity == 8


def test_a_retired_name_is_not_listed() -> None:
    assert policy_names() == ["adaptive", "arc", "lru", "s3fifo"]


def test_an_unknown_name_lists_the_registered_ones_only() -> None:
    with pytest.raises(UnknownPolicyError, match=r"'fifo'.*\['adaptive', 'arc', 'lru', 's3fifo'\]"):
        make_policy("fifo", 8)


# A fresh interpreter: whether the warning was given is per process.
_TWICE = """
import warnings
from tiering.core.policies import make_policy
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    kinds = [type(make_policy("prefix-lfu", 4)).__name__ for _ in range(2)]
print(kinds, [str(w.message) for w in caught if w.category is DeprecationWarning])
"""


def test_a_retired_name_warns_once_per_process_naming_its_replacement() -> None:
    done = run_script("-c", _TWICE)
    assert done.returncode == 0, done.stderr
    message = "eviction policy 'prefix-lfu' is retired and now means 'adaptive'; ask for 'adaptive'"
    assert done.stdout.strip() == f"['AdaptivePolicy', 'AdaptivePolicy'] [{message!r}]"
    assert done.stderr.splitlines() == [message]  # the logged line, once


_REGISTERED = """
from tiering.core.policies import LRUPolicy, make_policy, register_policy
register_policy("prefix-lfu", LRUPolicy)
print(type(make_policy("prefix-lfu", 4)).__name__)
"""


def test_registering_a_retired_name_replaces_the_alias() -> None:
    done = run_script("-c", _REGISTERED)
    assert (done.returncode, done.stdout.strip(), done.stderr) == (0, "LRUPolicy", "")
