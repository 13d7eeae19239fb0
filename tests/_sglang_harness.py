"""SGLang 0.5.23's own HiCache controller on CPU, with the test playing its scheduler.

The driver lives in ``tests/_sglang_cpu.py`` (the benchmark loads it too):
SGLang's real ``MHATokenToKVPoolHost`` (:func:`make_host_pool`), its real controller
with a storage backend built by its own factory (:func:`controller`), and the calls its
radix cache makes on the scheduler thread (:func:`backup`, :func:`prefetch`,
:func:`evict`). This module adds the import guard: with ``KV_TIERING_REQUIRE_SGLANG=1``
(CI) a missing SGLang fails the importing test module, otherwise it is skipped.
"""

from __future__ import annotations

import os

import pytest

if os.environ.get("KV_TIERING_REQUIRE_SGLANG") == "1":  # CI: a missing SGLang is a failure
    import sglang.srt.mem_cache.hicache_storage  # noqa: F401
else:
    pytest.importorskip("sglang.srt.mem_cache.hicache_storage")

from tests import _sglang_cpu
from tests._sglang_cpu import *  # noqa: F403  (the driver's API, for the tests)

__all__ = _sglang_cpu.__all__
