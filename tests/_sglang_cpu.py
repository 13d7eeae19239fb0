"""SGLang 0.5.23's HiCache controller and host pool on a CPU-only machine, driven as its
scheduler drives them: what the SGLang tests and ``examples/bench_sglang_tiers.py`` run.

Nothing of SGLang is re-implemented or patched. :func:`make_host_pool` builds its real
``MHATokenToKVPoolHost``; :func:`controller` its real controller, whose storage backend
SGLang's own factory creates (``file``, ``dynamic``, ...) and whose daemon threads make
every storage call. Only what needs a GPU is stood in for: the device KV pool's
allocator (the controller reads ``get_kvcache()`` and nothing else of it, as long as no
device transfer is asked for) and the process groups (``tp_group=None`` makes SGLang's
all-reduces no-ops). :func:`backup` and :func:`prefetch` then make the calls SGLang's
``UnifiedRadixCache`` makes on the scheduler thread (``write_storage`` and its ack; the
prefetch, its hit query's result, the host allocation, the transfer and its acks under
a stop policy), reading the same queues.

By default the controller is ``HybridCacheController`` over a one-entry
``HostPoolGroup``: what SGLang 0.5.23 builds for a plain MHA model
(``hybrid_pool_assembler.build_kv_only_stack``). Its hit query makes one
``batch_exists`` call with every page's key; the base ``HiCacheController`` (still used
by SGLang's decode-side offload) slices the query into batches of 128 pages.

Importing this module imports SGLang (ImportError without it); it first calls
:func:`hide_missing_torchvision`, whose docstring says why.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import importlib
import importlib.util
import json
import sys
import threading
import time
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from queue import Empty
from typing import Any, Literal

import torch

__all__ = [
    "LAYOUTS",
    "POLICIES",
    "STORAGE_CALLS",
    "Call",
    "CallLog",
    "Controller",
    "Prefetched",
    "backup",
    "check_pages",
    "check_states",
    "controller",
    "dynamic_config",
    "evict",
    "fill_pages",
    "fill_states",
    "hide_missing_torchvision",
    "hit_query",
    "make_host_pool",
    "make_mamba_pool",
    "page_tokens",
    "prefetch",
    "record_calls",
    "state_transfer",
]

_STAND_INS = ("torchvision", "torchvision.transforms", "torchvision.transforms.functional")


class _InterpolationMode(enum.Enum):
    """The names SGLang's modules read from torchvision's enum, at import time only."""

    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


def _torchvision_imports() -> bool:
    """Whether a real torchvision imports here (a failed attempt leaves no module behind)."""
    loaded = sys.modules.get("torchvision")
    if loaded is not None:
        return not getattr(loaded, "__kv_tiering_stand_in__", False)
    if importlib.util.find_spec("torchvision") is None:
        return False
    try:
        importlib.import_module("torchvision")
    except Exception:  # a CUDA build under a CPU torch raises RuntimeError, others ImportError
        for name in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")]:
            del sys.modules[name]
        return False
    return True


def hide_missing_torchvision() -> None:
    """Lets SGLang's import chain run on a machine whose torchvision does not match its
    torch (CPU-only CI); does nothing when torchvision imports.

    SGLang's host pool and controller import, through its multimodal and OCR configs,
    ``torchvision.transforms`` (and ``InterpolationMode``) at import time; HiCache uses
    none of it, and the torchvision wheels reachable for a CPU torch are CUDA builds that
    fail on import. So, when no real torchvision imports: transformers caches
    ``is_torchvision_available()`` as False (no model code takes a torchvision path),
    then stand-in modules ``torchvision``, ``torchvision.transforms`` and
    ``torchvision.transforms.functional`` (the last two holding an ``InterpolationMode``
    enum) go into ``sys.modules``. Call it before importing SGLang; again, it does nothing.
    """
    if _torchvision_imports() or "torchvision" in sys.modules:  # real, or our stand-ins
        return
    from transformers.utils import import_utils

    # find_spec answers None for a name bound to None in sys.modules, so transformers'
    # probe caches False; the stand-ins (which have no spec) only come after it.
    sys.modules["torchvision"] = None  # type: ignore[assignment]
    try:
        import_utils.is_torchvision_available.cache_clear()
        import_utils.is_torchvision_available()
    finally:
        del sys.modules["torchvision"]
    modules = {name: types.ModuleType(name) for name in _STAND_INS}
    for name, module in modules.items():
        module.__kv_tiering_stand_in__ = True  # type: ignore[attr-defined]
        sys.modules[name] = module
    modules["torchvision"].transforms = modules["torchvision.transforms"]  # type: ignore[attr-defined]
    modules["torchvision.transforms"].functional = modules[  # type: ignore[attr-defined]
        "torchvision.transforms.functional"
    ]
    for name in _STAND_INS[1:]:  # SGLang imports the enum from both
        modules[name].InterpolationMode = _InterpolationMode  # type: ignore[attr-defined]


hide_missing_torchvision()

from sglang.srt.managers.cache_controller import (  # noqa: E402
    HiCacheController,
    PrefetchAck,
)
from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle  # noqa: E402
from sglang.srt.mem_cache.device_pool_info import (  # noqa: E402
    KVBufferLayout,
    KVBuffers,
    MambaStateBufferInfo,
    MHABufferInfo,
)
from sglang.srt.mem_cache.hicache_storage import (  # noqa: E402
    HiCacheStorage,
    HiCacheStorageConfig,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
)
from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import (  # noqa: E402
    HybridCacheController,
)
from sglang.srt.mem_cache.pool_host.group import HostPoolGroup, PoolEntry  # noqa: E402
from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost  # noqa: E402
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.utils import get_storage_hash_str  # noqa: E402
from sglang.srt.runtime_context import get_parallel  # noqa: E402

LAYOUTS = ("page_first", "layer_first", "page_first_direct")
"""The host-pool layouts SGLang's ``direct`` I/O backend serves on CPU."""

Policy = Literal["best_effort", "wait_complete", "timeout"]
POLICIES: tuple[Policy, ...] = ("best_effort", "wait_complete", "timeout")
"""SGLang's ``--hicache-storage-prefetch-policy`` choices."""

SETTLE_S = 120.0
"""A hang guard on every wait for SGLang's threads, far beyond any test's I/O."""


# -- the host pool --------------------------------------------------------------------------


class _DevicePool:
    """The device KV pool as the controller sees it while no device transfer runs."""

    device = torch.device("cpu")

    def __init__(self, layers: int) -> None:
        self.layer_num = layers

    def register_layer_transfer_counter(self, counter: Any) -> None:
        self.layer_transfer_counter = counter


class _Allocator:
    """The device allocator's one method the controller calls outside device transfers."""

    def __init__(self, layers: int) -> None:
        self._pool = _DevicePool(layers)

    def get_kvcache(self) -> _DevicePool:
        return self._pool


def make_host_pool(
    layout: str,
    *,
    pages: int,
    page_size: int,
    layers: int,
    heads: int,
    head_dim: int,
    dtype: torch.dtype = torch.bfloat16,
) -> MHATokenToKVPoolHost:
    """SGLang's own MHA host pool on CPU (not pinned), holding ``pages`` pages of
    ``page_size`` tokens in ``layout`` (one of :data:`LAYOUTS`).

    It is built from one page of per-layer CPU K/V tensors in SGLang's ``MHABufferInfo``
    (layout NHD), as a model runner's device pool would describe itself; those stand-in
    device tensors are never copied to or from.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    k = tuple(torch.zeros(page_size, heads, head_dim, dtype=dtype) for _ in range(layers))
    v = tuple(torch.zeros(page_size, heads, head_dim, dtype=dtype) for _ in range(layers))

    def pointers(tensors: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.uint64)

    info = MHABufferInfo(
        buffers=KVBuffers(
            k=k, v=v, k_data_ptrs=pointers(k), v_data_ptrs=pointers(v), layout=KVBufferLayout.NHD
        ),
        page_size=page_size,
        head_num=heads,
        head_dim=head_dim,
        v_head_dim=head_dim,
        dtype=dtype,
        device=torch.device("cpu"),
    )
    return MHATokenToKVPoolHost(
        info,
        host_to_device_ratio=1.0,
        host_size=0,
        page_size=page_size,
        layout=layout,
        pin_memory=False,
        device="cpu",
        device_capacity_tokens=page_size,
        start_layer=0,
        end_layer=layers - 1,
        host_token_capacity=pages * page_size,
    )


def make_mamba_pool(
    *,
    slots: int,
    layers: int,
    temporal: tuple[int, ...] = (2, 4, 8),
    conv: Sequence[tuple[int, ...]] = ((6, 3), (4, 3)),
    side_states: Sequence[tuple[int, ...]] = (),
) -> MambaPoolHost:
    """SGLang's own Mamba state host pool on CPU (not pinned, ``page_first``): ``slots``
    state slots of ``layers`` layers, each a float32 SSM state of shape ``temporal`` and
    bf16 conv states of the shapes ``conv``, one buffer each, and float32 per-slot side
    states of the shapes ``side_states`` (as a model runner's ``MambaStateBufferInfo``
    describes its device pool; those stand-in device tensors are never copied to or
    from)."""
    info = MambaStateBufferInfo(
        temporal=torch.zeros(layers, slots, *temporal, dtype=torch.float32),
        conv=tuple(torch.zeros(layers, slots, *shape, dtype=torch.bfloat16) for shape in conv),
        extra_checkpoint_buffers=tuple(torch.zeros(slots, *shape) for shape in side_states),
    )
    return MambaPoolHost(
        info, 1.0, 0, device_capacity=slots, pin_memory=False, device="cpu", layout="page_first"
    )


# -- the controller -------------------------------------------------------------------------


@dataclass(frozen=True)
class Controller:
    """SGLang's controller with its storage backend attached, and the scheduler-side
    settings the extra config carried (SGLang pops them before the backend sees it)."""

    sglang: HiCacheController
    host_pool: MHATokenToKVPoolHost
    prefetch_threshold: int
    """Tokens: a smaller storage hit is not fetched."""
    timeout_base_s: float
    timeout_per_page_s: float

    @property
    def backend(self) -> HiCacheStorage:
        """The storage backend object SGLang's factory built (and registered the pool on)."""
        backend = self.sglang.storage_backend
        assert backend is not None, "the controller's storage backend is detached"
        return backend

    @property
    def storage_config(self) -> HiCacheStorageConfig:
        return self.sglang.storage_config

    @property
    def page_size(self) -> int:
        return self.sglang.page_size


def _with_storage_overrides(
    base: type[HiCacheController], overrides: Mapping[str, Any]
) -> type[HiCacheController]:
    """``base`` whose storage config (which the backend is built with) has ``overrides``:
    the fields SGLang derives from what a CPU run lacks (an MLA device pool, DP ranks)."""
    if not overrides:
        return base

    class Overridden(base):  # type: ignore[valid-type, misc]
        def _generate_storage_config(self, *args: Any, **kwargs: Any) -> HiCacheStorageConfig:
            return replace(super()._generate_storage_config(*args, **kwargs), **overrides)

    return Overridden


def dynamic_config(module_path: str, class_name: str, **options: Any) -> dict[str, Any]:
    """The extra config that loads ``module_path.class_name`` through SGLang's ``dynamic``
    backend factory, with ``options`` (tier options, ``interface_v1``, ``prefetch_*``)."""
    return {
        "backend_name": class_name.lower(),
        "module_path": module_path,
        "class_name": class_name,
        **options,
    }


@contextmanager
def controller(
    host_pool: MHATokenToKVPoolHost,
    backend_name: str,
    extra_config: Mapping[str, Any] | None = None,
    *,
    model_name: str | None = "org/model",
    tp_rank: int = 0,
    tp_size: int = 1,
    hybrid: bool = True,
    storage_overrides: Mapping[str, Any] | None = None,
    sidecars: Mapping[str, Any] | None = None,
) -> Iterator[Controller]:
    """SGLang's controller over ``host_pool`` with the storage backend ``backend_name``
    (``"file"``, ``"dynamic"``, ...), as ``--hicache-storage-backend`` and
    ``--hicache-storage-backend-extra-config`` (``extra_config``, given as the JSON a user
    writes: for ``dynamic`` it carries ``backend_name``, ``module_path``, ``class_name``
    and ``interface_v1``) would make it, for TP rank ``tp_rank`` of ``tp_size``.

    SGLang parses the extra config (popping ``prefetch_threshold``,
    ``prefetch_timeout_base``, ``prefetch_timeout_per_ki_token``, ...), builds the backend
    through its factory, registers the host pool on it and starts its four storage
    threads. ``hybrid`` picks ``HybridCacheController`` (the server's, see the module
    docstring) or the base ``HiCacheController``; ``storage_overrides`` replaces fields of
    the ``HiCacheStorageConfig`` SGLang derives (e.g. ``is_mla_model=True``). With
    ``sidecars`` (pool name, e.g. ``"mamba"`` or ``"swa"``, to host pool) the group holds
    those pools beside the KV one, as SGLang assembles it for a hybrid model, and the
    backend gets each through ``register_mem_host_pool_v2``. On exit the backend is
    detached as SGLang detaches it: its threads joined, then ``close()``.
    """
    parse = HybridCacheController.parse_storage_backend_extra_config
    extra, threshold, base_s, per_ki_token_s, _ = parse(json.dumps(dict(extra_config or {})))
    page_size = host_pool.page_size
    cls = _with_storage_overrides(
        HybridCacheController if hybrid else HiCacheController, storage_overrides or {}
    )
    pool: Any = host_pool
    if hybrid:
        pool = HostPoolGroup(
            [
                PoolEntry(
                    name=PoolName.KV,
                    host_pool=host_pool,
                    device_pool=_DevicePool(host_pool.layer_num),
                    layer_mapper=lambda layer: layer,
                    is_primary_index_anchor=True,
                ),
                *(
                    PoolEntry(
                        name=PoolName(name),
                        host_pool=pool,
                        device_pool=_DevicePool(host_pool.layer_num),
                        layer_mapper=lambda layer: layer,
                    )
                    for name, pool in (sidecars or {}).items()
                ),
            ]
        )
    # The storage config reads the ranks from SGLang's runtime context, which only a
    # launched server fills in.
    with get_parallel().override(
        attn_dcp_size=1, attn_dcp_rank=0, tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1
    ):
        ctrl = cls(
            _Allocator(host_pool.layer_num),
            pool,
            page_size,
            None,
            threading.Event(),
            io_backend="direct",
            storage_backend=backend_name,
            prefetch_threshold=threshold,
            model_name=model_name,
            storage_backend_extra_config=extra,
        )
    try:
        yield Controller(
            sglang=ctrl,
            host_pool=host_pool,
            prefetch_threshold=ctrl.prefetch_threshold,
            timeout_base_s=base_s,
            timeout_per_page_s=page_size / 1024 * per_ki_token_s,
        )
    finally:
        ctrl.detach_storage_backend()


STORAGE_CALLS = ("batch_exists", "batch_get_v1", "batch_set_v1", "batch_get", "batch_set")
"""The backend methods SGLang's storage threads call for a KV-only model."""


@dataclass(frozen=True)
class Call:
    """One call SGLang's threads made into the backend."""

    name: str
    keys: int
    ns: int


class CallLog:
    """Every call SGLang's threads make into one backend object: :func:`record_calls`
    replaces the backend's methods by timing wrappers on the instance (after SGLang built
    it), so the controller's own code and the backend's class stay untouched."""

    def __init__(self) -> None:
        self.calls: list[Call] = []  # list.append is atomic: no lock on SGLang's threads

    def sizes(self, name: str) -> list[int]:
        """The number of keys of each call of ``name``, in order."""
        return [c.keys for c in self.calls if c.name == name]

    def durations_ns(self, name: str) -> list[int]:
        return [c.ns for c in self.calls if c.name == name]


def _key_count(first: Sequence[Any]) -> int:
    """The keys of a call: its key list's, or a v2 call's transfers' together."""
    if first and isinstance(first[0], PoolTransfer):
        return sum(len(transfer.keys or ()) for transfer in first)
    return len(first)


def record_calls(backend: HiCacheStorage, names: Sequence[str] = STORAGE_CALLS) -> CallLog:
    """Start logging each call of ``names`` on ``backend`` (the object SGLang built, e.g.
    ``Controller.backend``): its key count (a v2 call's: all its transfers' keys) and
    how long it ran on SGLang's thread."""
    log = CallLog()

    def timed(name: str, call: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(call)
        def wrapper(keys: Sequence[Any], *args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter_ns()
            try:
                return call(keys, *args, **kwargs)
            finally:
                log.calls.append(Call(name, _key_count(keys), time.perf_counter_ns() - start))

        return wrapper

    for name in names:
        setattr(backend, name, timed(name, getattr(backend, name)))
    return log


# -- the scheduler's calls ------------------------------------------------------------------


def page_tokens(pages: int, page_size: int, *, seed: int = 0) -> list[int]:
    """Token ids for ``pages`` full pages, distinct per ``seed`` (so are their keys)."""
    start = seed * pages * page_size
    return list(range(start, start + pages * page_size))


def _page_payload(tokens: Sequence[int], like: torch.Tensor) -> torch.Tensor:
    """A flat page's bytes that belong to the page's ``tokens`` alone."""
    digest = hashlib.sha256(json.dumps(list(tokens)).encode()).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))
    raw = torch.randint(
        0, 256, (like.numel() * like.element_size(),), dtype=torch.uint8, generator=generator
    )
    return raw.view(like.dtype)


def fill_pages(
    host_pool: MHATokenToKVPoolHost, host_indices: torch.Tensor, token_ids: Sequence[int]
) -> None:
    """Write into each page of ``host_indices`` bytes that belong to its tokens (through
    SGLang's ``set_from_flat_data_page``, so in the pool's own layout)."""
    size = host_pool.page_size
    like = host_pool.get_dummy_flat_data_page()
    for i in range(len(host_indices) // size):
        page = _page_payload(token_ids[i * size : (i + 1) * size], like)
        host_pool.set_from_flat_data_page(int(host_indices[i * size]), page)


def check_pages(
    host_pool: MHATokenToKVPoolHost,
    host_indices: torch.Tensor,
    token_ids: Sequence[int],
    *,
    every: int = 1,
) -> None:
    """Raise AssertionError unless each page of ``host_indices`` (one in ``every``) holds
    exactly the bytes :func:`fill_pages` wrote for its tokens. Bytes, not values, are
    compared: random bf16 bits include NaNs."""
    size = host_pool.page_size
    like = host_pool.get_dummy_flat_data_page()
    for i in range(0, len(host_indices) // size, every):
        expected = _page_payload(token_ids[i * size : (i + 1) * size], like)
        got = host_pool.get_data_page(int(host_indices[i * size]), flat=True).contiguous()
        if not torch.equal(got.view(torch.uint8), expected.view(torch.uint8)):
            raise AssertionError(
                f"page {i} (host index {int(host_indices[i * size])}) "
                "holds other bytes than were stored for its tokens"
            )


def backup(
    ctrl: Controller,
    host_indices: torch.Tensor,
    token_ids: Sequence[int],
    *,
    prior_hash: str | None = None,
    extra_pools: Sequence[PoolTransfer] | None = None,
) -> int:
    """Back the pages at ``host_indices`` (holding ``token_ids``) up to storage, as the
    radix cache's ``write_backup_storage`` does (keys: SGLang's page hash chain, going on
    from ``prior_hash``, the parent node's last page), and wait for the backup thread's
    ack. ``extra_pools`` are a hybrid model's state transfers for the node (see
    :func:`state_transfer`). Returns the tokens SGLang counted as written (it stops at
    the first failed batch)."""
    keys = get_storage_hash_str(list(token_ids), prior_hash, page_size=ctrl.page_size)
    pools = {"extra_pools": list(extra_pools)} if extra_pools else {}  # hybrid only
    operation_id = ctrl.sglang.write_storage(host_indices, list(token_ids), keys, **pools)
    operation = ctrl.sglang.ack_backup_queue.get(timeout=SETTLE_S)
    assert operation.id == operation_id, "an ack for another backup"
    return int(operation.completed_tokens)


def state_transfer(
    pool: str,
    keys: Sequence[str],
    host_indices: torch.Tensor | None = None,
    policy: str = "trailing_pages",
) -> PoolTransfer:
    """A hybrid model's transfer of pool ``pool`` as SGLang's radix cache builds it: for
    a backup, the node's state pages ``keys`` at ``host_indices`` of that pool; for a
    prefetch, placeholders (one per page of the pool's window) and no indices."""
    return PoolTransfer(
        name=PoolName(pool),
        host_indices=host_indices,
        keys=list(keys),
        hit_policy=PoolHitPolicy(policy),
    )


def _state_payload(tag: str, key: str, like: torch.Tensor) -> torch.Tensor:
    """A state page's bytes that belong to ``tag`` and ``key`` alone, in ``like``'s dtype."""
    digest = hashlib.sha256(f"{tag}:{key}".encode()).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))
    size = like.numel() * like.element_size()
    return torch.randint(0, 256, (size,), dtype=torch.uint8, generator=generator).view(like.dtype)


def fill_states(pool: Any, host_indices: torch.Tensor, keys: Sequence[str], tag: str) -> None:
    """Write into each page of ``host_indices`` of a state pool (Mamba slots, SWA pages)
    bytes that belong to ``tag`` (the rank, say) and its page key alone."""
    like = pool.get_dummy_flat_data_page()
    for i, key in enumerate(keys):
        index = int(host_indices[i * pool.page_size])
        pool.set_from_flat_data_page(index, _state_payload(tag, key, like))


def check_states(pool: Any, host_indices: torch.Tensor, keys: Sequence[str], tag: str) -> None:
    """Raise AssertionError unless each page of ``host_indices`` holds exactly the bytes
    :func:`fill_states` wrote for ``tag`` and its key."""
    like = pool.get_dummy_flat_data_page()
    for i, key in enumerate(keys):
        index = int(host_indices[i * pool.page_size])
        got = pool.get_data_page(index, flat=True).contiguous().view(torch.uint8)
        if not torch.equal(got, _state_payload(tag, key, like).view(torch.uint8)):
            raise AssertionError(f"state page {i} (host index {index}) holds other bytes")


def evict(ctrl: Controller, host_indices: torch.Tensor) -> None:
    """Drop pages from host memory, as eviction does, zeroing them first so that a later
    load must bring their bytes back from storage (the pool may hand the slots out again)."""
    zero = ctrl.host_pool.get_dummy_flat_data_page()
    for start in range(0, len(host_indices), ctrl.page_size):
        ctrl.host_pool.set_from_flat_data_page(int(host_indices[start]), zero)
    ctrl.host_pool.free(host_indices)


@dataclass
class Prefetched:
    """What one prefetch brought into host memory."""

    host_indices: torch.Tensor
    """The loaded tokens' slots (``tokens`` long); the caller frees them."""
    tokens: int
    hit_tokens: int
    """What the hit query found (after SGLang's rank agreement)."""
    acks: list[PrefetchAck]
    """Every ack the scheduler drained, in order; the last has ``completed_req``."""
    terminated: bool
    """Whether the scheduler cut the transfer (policy, deadline or ``on_ack``)."""
    states: dict[str, PoolTransfer] = field(default_factory=dict)
    """A hybrid model's state transfers as SGLang left them (their real ``keys``, and
    the ``host_indices`` of the pool's pages they loaded into); the caller frees them."""
    pool_hits: dict[str, int] = field(default_factory=dict)
    """The pages of each state pool that landed (SGLang's ack, after rank agreement)."""

    @property
    def usable(self) -> bool:
        """Whether SGLang's radix cache takes the prefetch (``_handle_prefetch_result``):
        a hybrid one only whole, every state pool's pages landed with the KV."""
        return self.tokens == self.hit_tokens and all(
            self.pool_hits.get(name, 0) == len(t.keys or ()) for name, t in self.states.items()
        )


def _wait_s(ctrl: Controller, policy: Policy, pages: int, step_s: float) -> float:
    """How long the scheduler lets a prefetch run before terminating it."""
    if policy == "best_effort":  # until the request's next scheduling step
        return step_s
    if policy == "timeout":
        return ctrl.timeout_base_s + pages * ctrl.timeout_per_page_s
    if policy == "wait_complete":
        return SETTLE_S
    raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")


def hit_query(
    ctrl: Controller,
    token_ids: Sequence[int],
    request_id: str = "req",
    *,
    prior_hash: str | None = None,
    extra_pools: Sequence[PoolTransfer] | None = None,
) -> tuple[Any, int]:
    """Start SGLang's prefetch of ``token_ids`` (pages going on from ``prior_hash``) and
    wait for its hit query (its prefetch thread asks the backend's ``batch_exists``, or
    ``batch_exists_v2`` with a hybrid model's ``extra_pools``): the operation, and the
    tokens hit. The caller goes on with the operation or revokes it
    (``terminate_prefetch``)."""
    sglang = ctrl.sglang
    tokens = list(token_ids)
    if isinstance(sglang, HybridCacheController):
        pools = list(extra_pools or []) or None
        handle = CacheRequestHandle(request_id, 0)
        operation = sglang.prefetch(handle, tokens, prior_hash, extra_pools=pools)
    else:
        assert not extra_pools, "only the hybrid controller carries state pools"
        operation = sglang.prefetch(request_id, tokens, prior_hash)
    answered = sglang.prefetch_hit_queue.get(timeout=SETTLE_S)
    assert answered is operation, "a hit query answer for another prefetch"
    return operation, int(operation.storage_hit_count)


def _stage_states(ctrl: Controller, operation: Any, hit_pages: int) -> dict[str, PoolTransfer]:
    """Host pages for each state pool's window of the hit, as the radix cache binds them
    (``_alloc_prefetch_aux_staging``): ``min(window, hit pages)`` pages per pool."""
    staged = {}
    for transfer in getattr(operation, "pool_transfers", None) or []:  # the base has none
        if transfer.indices_from_pool is not None:  # loaded into the KV's slots
            continue
        pool = ctrl.sglang.mem_pool_host.entry_map[transfer.name].host_pool
        tokens = min(len(transfer.keys or ()), hit_pages) * pool.page_size
        transfer.host_indices = pool.alloc(tokens)
        if transfer.host_indices is None:
            raise RuntimeError(f"the {transfer.name.value} host pool has no room")
        staged[transfer.name.value] = transfer
    return staged


def prefetch(
    ctrl: Controller,
    token_ids: Sequence[int],
    *,
    policy: Policy = "wait_complete",
    step_s: float = 1.0,
    on_ack: Callable[[PrefetchAck], None] | None = None,
    request_id: str = "req",
    prior_hash: str | None = None,
    extra_pools: Sequence[PoolTransfer] | None = None,
) -> Prefetched:
    """Prefetch ``token_ids`` from storage into host memory through SGLang's own path:
    ``prefetch`` (its thread runs the hit query), the scheduler's hit handling (below
    ``prefetch_threshold`` tokens nothing is fetched; else host slots are allocated and
    the operation goes to the transfer thread, which loads batch by batch and acks each),
    then the stop ``policy`` as the radix cache applies it: ``wait_complete`` waits for
    the last ack; ``timeout`` terminates at SGLang's deadline (base + pages x per page);
    ``best_effort`` terminates after ``step_s`` (the wait until the request's next
    scheduling step). A terminated transfer stops between batches. ``on_ack`` sees each
    progress ack as the scheduler drains it; it may cancel with
    ``ctrl.sglang.terminate_prefetch(ack.operation)``. Slots of pages not loaded are freed.
    A hybrid model's ``extra_pools`` (:func:`state_transfer` placeholders) are staged in
    their pools once the hit is known and loaded after the KV (``Prefetched.states``).
    """
    sglang = ctrl.sglang
    operation, hit = hit_query(
        ctrl, token_ids, request_id, prior_hash=prior_hash, extra_pools=extra_pools
    )
    empty = torch.empty(0, dtype=torch.int64)
    if hit < ctrl.prefetch_threshold:  # the radix cache revokes it
        sglang.terminate_prefetch(operation)
        return Prefetched(empty, 0, hit, [], True)
    host_indices = sglang.mem_pool_host.alloc(hit)
    if host_indices is None:
        raise RuntimeError(f"the host pool has no room for {hit} prefetched tokens")
    operation.host_indices = host_indices
    operation.hash_value = operation.hash_value[: hit // ctrl.page_size]
    states = _stage_states(ctrl, operation, hit // ctrl.page_size)
    deadline = time.monotonic() + _wait_s(ctrl, policy, hit // ctrl.page_size, step_s)
    sglang.prefetch_buffer.put(operation)
    acks: list[PrefetchAck] = []
    pool_hits: dict[str, int] = {}
    used: int | None = None  # the tokens the scheduler took, once it terminated
    guard = time.monotonic() + SETTLE_S
    while not acks or not acks[-1].completed_req:
        assert time.monotonic() < guard, "SGLang's prefetch never completed"
        # Like a scheduler step: drain the acks that arrived, then check the policy.
        wait = 0.05 if used is not None else max(0.0, min(0.05, deadline - time.monotonic()))
        try:
            ack = sglang.ack_prefetch_queue.get(timeout=wait)
        except Empty:
            if used is None and time.monotonic() >= deadline:
                sglang.terminate_prefetch(operation)
                used = int(operation.completed_tokens)
            continue
        acks.append(ack)
        if ack.pool_hits is not None:
            pool_hits = {name: int(pages) for name, pages in ack.pool_hits.items() if pages}
        if ack.completed_tokens is not None and used is None:
            # After a termination SGLang no longer counts progress (the tail it
            # loaded anyway is released): hence only until then.
            operation.completed_tokens = ack.completed_tokens
            if on_ack is not None:
                on_ack(ack)
            if operation.is_terminated():
                used = int(operation.completed_tokens)
    loaded = int(operation.completed_tokens) if used is None else used
    # Only now, with the transfer thread done with them, may the tail's slots go back.
    if loaded < len(host_indices):
        sglang.mem_pool_host.free(host_indices[loaded:])
    return Prefetched(host_indices[:loaded], loaded, hit, acks, used is not None, states, pool_hits)
