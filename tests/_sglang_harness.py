"""SGLang 0.5.23's own HiCache controller on CPU, with the test playing its scheduler.

The driver lives in :mod:`tiering.integrations.sglang_cpu` (the benchmark uses it too):
SGLang's real ``MHATokenToKVPoolHost`` (:func:`make_host_pool`), its real controller
with a storage backend built by its own factory (:func:`controller`), and the calls its
radix cache makes on the scheduler thread (:func:`backup`, :func:`prefetch`,
:func:`evict`). This module adds the import guard: with ``KV_TIERING_REQUIRE_SGLANG=1``
(CI) a missing SGLang fails the importing test module, otherwise it is skipped.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

if os.environ.get("KV_TIERING_REQUIRE_SGLANG") == "1":  # CI: a missing SGLang is a failure
    import sglang.srt.mem_cache.hicache_storage  # noqa: F401
else:
    pytest.importorskip("sglang.srt.mem_cache.hicache_storage")

from tiering.integrations.sglang_cpu import (
    LAYOUTS,
    POLICIES,
    STORAGE_CALLS,
    CallLog,
    Controller,
    Prefetched,
    backup,
    check_pages,
    controller,
    evict,
    fill_pages,
    make_host_pool,
    page_tokens,
    prefetch,
    record_calls,
)

__all__ = [
    "LAYOUTS",
    "POLICIES",
    "STORAGE_CALLS",
    "CallLog",
    "Controller",
    "Prefetched",
    "backup",
    "check_pages",
    "controller",
    "dynamic_config",
    "evict",
    "fill_pages",
    "make_host_pool",
    "page_tokens",
    "prefetch",
    "record_calls",
]


def dynamic_config(module_path: str, class_name: str, **options: Any) -> dict[str, Any]:
    """The extra config that loads ``module_path.class_name`` through SGLang's ``dynamic``
    backend, with ``options`` (tier options, ``interface_v1``, ``prefetch_*``) beside."""
    return {
        "backend_name": class_name.lower(),
        "module_path": module_path,
        "class_name": class_name,
        **options,
    }
