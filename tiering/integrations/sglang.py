"""kv-tiering's tiers as SGLang 0.5.23's HiCache storage, through its ``dynamic`` storage
backend (docs/sglang.md). Without SGLang, importing this module raises ImportError."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from tiering.errors import ClosedError, InvalidArgumentError
from tiering.hashing import NAMESPACE_FORMAT, canonical_json
from tiering.integrations.tier_thread import FRAMEWORK_DEFAULTS, TierThread, fixed_tier
from tiering.tiers.inbox import Lane

try:
    from sglang.srt.mem_cache.hicache_storage import (
        HiCacheStorage,
        HiCacheStorageConfig,
        HiCacheStorageExtraInfo,
    )
except ImportError as exc:  # pragma: no cover - exercised only without SGLang
    raise ImportError(
        "tiering.integrations.sglang needs SGLang 0.5.23 (the 'sglang' extra; .ci/install-sglang "
        f"installs it on a CPU-only machine); importing SGLang failed: {type(exc).__name__}: {exc}"
    ) from exc

if TYPE_CHECKING:
    from sglang.srt.mem_cache.pool_host import HostKVCache

# Keys of --hicache-storage-backend-extra-config that are SGLang's, not the tier's.
_SGLANG_KEYS = frozenset({"backend_name", "module_path", "class_name", "interface_v1"})
_ASK_AGAIN_S = 0.0005  # how often batch_exists asks again while the tier checks a key
# The StorageMetrics fields this storage reports.
_METRICS = ("prefetch_pgs", "backup_pgs", "prefetch_bandwidth", "backup_bandwidth")


def sglang_namespace(config: HiCacheStorageConfig, pool: HostKVCache, chunk_bytes: int) -> str:
    """The cache namespace of an SGLang rank: what its stored pages' bytes mean (the model,
    the rank's shard, without the TP rank where the KV is replicated over TP ranks as for
    MLA models, and the host pool's geometry and layout)."""
    shard: dict[str, Any] = {
        "pp": [config.pp_rank, config.pp_size],
        "attn_cp": [config.attn_cp_rank, config.attn_cp_size],
        "dcp": [config.dcp_rank, config.dcp_size],
    }
    if not config.is_mla_model:
        shard["tp"] = [config.tp_rank, config.tp_size]
    geometry = {
        name: getattr(pool, name, None)
        for name in ("layout", "page_size", "layer_num", "head_num", "head_dim", "v_head_dim")
    }
    fields = {
        "model": config.model_name,
        "shard": shard,
        "pool": type(pool).__name__,
        "format_tag": getattr(pool, "storage_format_tag", None),
        "dtype": str(pool.dtype),
        "size_per_token": pool.size_per_token,
        "geometry": geometry,
        "chunk_bytes": chunk_bytes,
    }
    return canonical_json({"sglang": fields, "format": NAMESPACE_FORMAT})


class PageChunks:
    """Where a host pool's pages lie in its buffer: ``chunks`` runs of ``chunk_bytes`` (K
    and V, maybe per layer), run ``j`` of page ``p`` at chunk ``offsets[j] + p * stride``.
    InvalidArgumentError (naming the layout) unless they are whole chunks of one buffer."""

    def __init__(self, pool: HostKVCache) -> None:
        buffer = pool.kv_buffer
        layout = getattr(pool, "layout", "?")
        if not isinstance(buffer, torch.Tensor) or not buffer.is_contiguous():
            raise InvalidArgumentError(
                f"host pool {type(pool).__name__} ({layout}): its KV is not one contiguous "
                "buffer, which kv-tiering's HiCache storage needs"
            )
        self.page_size: int = pool.page_size
        self.pages: int = pool.page_num
        self.buffer_bytes = buffer.numel() * buffer.element_size()
        base = buffer.data_ptr()

        def chunks_of(page: int) -> tuple[list[int], list[int]]:
            first = page * self.page_size
            ptrs, sizes = pool.get_page_buffer_meta(torch.arange(first, first + self.page_size))
            return [ptr - base for ptr in ptrs], list(sizes)

        first, sizes = chunks_of(0)
        self.chunk_bytes: int = sizes[0]
        self.chunks = len(first)
        second, _ = chunks_of(1) if self.pages > 1 else (first, sizes)
        last, _ = chunks_of(self.pages - 1)
        self.stride = stride = (second[0] - first[0]) // self.chunk_bytes
        whole = all(size == self.chunk_bytes for size in sizes) and not any(
            offset % self.chunk_bytes for offset in first + second + last
        )
        self.offsets = [offset // self.chunk_bytes for offset in first]
        affine = all(
            b // self.chunk_bytes == a + stride
            and c // self.chunk_bytes == a + (self.pages - 1) * stride
            for a, b, c in zip(self.offsets, second, last, strict=True)
        )
        if not (whole and affine) or (last[-1] + self.chunk_bytes) > self.buffer_bytes:
            raise InvalidArgumentError(
                f"host pool {type(pool).__name__} ({layout}): its pages are not whole "
                "chunks of its buffer at a fixed stride, which kv-tiering's HiCache "
                "storage needs (use the page_first or layer_first layout)"
            )
        self._offsets = torch.tensor(self.offsets, dtype=torch.int64)
        self._suffixes = [b"/%d" % j for j in range(self.chunks)]

    def keys(self, keys: Sequence[str]) -> list[bytes]:
        """The tier's keys of the pages ``keys``, ``chunks`` per page; InvalidArgumentError
        unless each key is a non-empty str."""
        try:
            raws = [key.encode() for key in keys]
        except AttributeError:
            raws = []
        if len(raws) != len(keys) or not all(raws):
            raise InvalidArgumentError("keys must be non-empty strings (SGLang's page hashes)")
        return [raw + suffix for raw in raws for suffix in self._suffixes]

    def slots(self, host_indices: torch.Tensor, pages: int) -> list[int]:
        """The chunk slots of ``pages`` pages whose token slots are ``host_indices``;
        InvalidArgumentError for indices of another length, not page-aligned or past the pool."""
        if not isinstance(host_indices, torch.Tensor) or host_indices.dim() != 1:
            raise InvalidArgumentError("host_indices must be a 1-D tensor of token slots")
        if host_indices.numel() != pages * self.page_size:
            raise InvalidArgumentError(
                f"host_indices holds {host_indices.numel()} token slots for {pages} pages "
                f"of {self.page_size} tokens"
            )
        starts = host_indices[:: self.page_size].to(torch.int64)
        page = starts // self.page_size
        if bool((starts % self.page_size).any()) or bool(((page < 0) | (page >= self.pages)).any()):
            raise InvalidArgumentError(
                f"host_indices: pages must start page-aligned inside the host pool "
                f"({self.pages} pages of {self.page_size} tokens)"
            )
        return (page[:, None] * self.stride + self._offsets[None, :]).flatten().tolist()


class TieringHiCacheStorage(HiCacheStorage):
    """SGLang HiCache storage backed by the kv-tiering tier registered as ``tier`` (the
    subclasses fix it), built as ``cls(storage_config, kwargs)``; the tier's options,
    ``namespace``, ``start_timeout`` and ``job_timeout`` come in
    ``storage_config.extra_config`` (docs/sglang.md#set-up).

    A page is stored and served whole, never with wrong bytes; ranks that are not storage
    writers store nothing; every call waits for its batch's I/O and no longer.

    The tier is built when SGLang registers its host pool; InvalidArgumentError there for
    a bad option or a host pool the tier cannot move pages of in place, UnknownTierError
    for an unknown ``tier``, TimeoutError if it did not start within ``start_timeout``.
    Calls before that, or after :meth:`close`, raise ClosedError."""

    tier_name: ClassVar[str | None] = None

    def __init__(
        self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None
    ) -> None:
        options = {
            k: v for k, v in (storage_config.extra_config or {}).items() if k not in _SGLANG_KEYS
        }
        self.tier_type = fixed_tier(type(self), type(self).tier_name, options.pop("tier", None))
        self._namespace: str | None = options.pop("namespace", None)
        self._start_timeout = options.pop("start_timeout", 600.0)
        self._job_timeout = options.pop("job_timeout", 30.0)
        self._options = options
        self.storage_config = storage_config
        self._thread: TierThread | None = None
        self._view: memoryview | None = None
        self._lock = threading.Lock()
        self._metrics: dict[str, list[Any]] = {name: [] for name in _METRICS}

    def register_mem_pool_host(self, mem_pool_host: HostKVCache) -> None:
        """Build the tier over the host pool's pages and start it on a private loop thread
        (raises as the class says; nothing is left running)."""
        if self._thread is not None:
            raise InvalidArgumentError("the host pool is already registered")
        pages = PageChunks(mem_pool_host)
        view = memoryview(mem_pool_host.kv_buffer.reshape(-1).view(torch.uint8).numpy())
        namespace = self._namespace or sglang_namespace(
            self.storage_config, mem_pool_host, pages.chunk_bytes
        )
        self._thread = TierThread(
            {"type": self.tier_type, **self._options},
            view,
            pages.chunk_bytes,
            name=f"kv-tiering-sglang-{self.tier_type}",
            defaults={"namespace": namespace, **FRAMEWORK_DEFAULTS},
            start_timeout=self._start_timeout,
            job_timeout=self._job_timeout,
        )
        super().register_mem_pool_host(mem_pool_host)
        self.pages, self._view = pages, view

    def _running(self) -> TierThread:
        thread = self._thread
        if thread is None or self._view is None:
            raise ClosedError(
                "kv-tiering's HiCache storage is not running (no host pool registered, or closed)"
            )
        return thread

    # -- SGLang's zero-copy interface ---------------------------------------------

    def batch_set_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Store the pages at ``host_indices`` under ``keys``; True for each page stored
        whole or already held (every page, on a rank that is not a storage writer)."""
        if not self.storage_config.is_storage_writer:
            return [True] * len(keys)
        return self._move("store", keys, host_indices)

    def batch_get_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Load ``keys`` into ``host_indices``; True for each page landed whole and verified."""
        return self._move("load", keys, host_indices)

    def _move(self, kind: Lane, keys: list[str], host_indices: torch.Tensor) -> list[bool]:
        thread = self._running()
        started = time.perf_counter()
        chunk_keys = self.pages.keys(keys)
        slots = self.pages.slots(host_indices, len(keys))
        moved = list(zip(chunk_keys, slots, strict=True))
        if kind == "store":  # what the tier holds already is not written again
            held = thread.tier.lookup_all(chunk_keys)
            moved = [pair for pair, known in zip(moved, held, strict=True) if known is not True]
        failed = {}
        if moved:
            job_keys, job_slots = zip(*moved, strict=True)
            failed = thread.run_job(kind, job_keys, job_slots, checked=True).failed
        n = self.pages.chunks
        result = [
            not failed or not any(k in failed for k in chunk_keys[i * n : (i + 1) * n])
            for i in range(len(keys))
        ]
        elapsed, done = time.perf_counter() - started, sum(result)
        if self.storage_config.enable_storage_metrics and done and elapsed > 0:
            call = "backup" if kind == "store" else "prefetch"
            gb = done * self.pages.chunks * self.pages.chunk_bytes / 1e9
            with self._lock:
                self._metrics[f"{call}_pgs"].append(done)
                self._metrics[f"{call}_bandwidth"].append(gb / elapsed)
        return result

    def batch_exists(
        self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> int:
        """How many of ``keys``, from the first, the tier holds whole (a key it is still
        checking is asked about again, for at most ``job_timeout``)."""
        thread = self._running()
        n = self.pages.chunks
        chunk_keys = self.pages.keys(keys)
        first, deadline = 0, None  # the first chunk not known to be held
        while True:
            answers = thread.tier.lookup_all(chunk_keys[first:])
            if all(answers):
                return len(keys)
            unknown = next(i for i, held in enumerate(answers) if held is not True)
            page = (first + unknown) // n
            start = page * n - first
            now = time.monotonic()
            deadline = deadline or now + thread.job_timeout
            if False in answers[start : start + n] or now >= deadline:
                return page
            first = page * n
            time.sleep(_ASK_AGAIN_S)

    # -- SGLang's classic interface: pages as flat tensors, through borrowed host pages --

    def exists(self, key: str) -> bool:
        """True if the tier holds the page ``key`` whole."""
        return self.batch_exists([key]) == 1

    def batch_set(
        self,
        keys: list[str],
        values: Sequence[torch.Tensor] | None = None,
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        """Store flat pages ``values`` under ``keys`` through host pages borrowed for the
        call; True if all were stored (False if the pool has none free)."""
        if values is None or len(values) != len(keys):
            raise InvalidArgumentError("values must hold one flat page per key")
        if not self.storage_config.is_storage_writer:
            return True
        pool = self.mem_pool_host
        with self._borrowed(len(keys)) as indices:
            if indices is None:
                return False
            for i, value in enumerate(values):
                pool.set_from_flat_data_page(int(indices[i * self.pages.page_size]), value)
            return all(self._move("store", keys, indices))

    def set(
        self,
        key: str,
        value: torch.Tensor | None = None,
        target_location: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        """:meth:`batch_set` of one page."""
        return self.batch_set([key], [value] if value is not None else None)

    def batch_get(
        self,
        keys: list[str],
        target_locations: Sequence[torch.Tensor] | None = None,
        target_sizes: Any = None,
    ) -> list[torch.Tensor | None]:
        """Each page of ``keys`` as a flat tensor (into ``target_locations[i]`` where given),
        or None where it did not land whole and verified (or no host page was free)."""
        pool = self.mem_pool_host
        with self._borrowed(len(keys)) as indices:
            if indices is None:
                return [None] * len(keys)
            landed = self._move("load", keys, indices)
            out: list[torch.Tensor | None] = []
            for i, ok in enumerate(landed):
                page = pool.get_data_page(int(indices[i * self.pages.page_size]), flat=True)
                if not ok:
                    out.append(None)
                elif target_locations is not None:
                    out.append(target_locations[i].copy_(page))
                else:
                    out.append(page.clone())
            return out

    def get(
        self, key: str, target_location: torch.Tensor | None = None, target_sizes: Any = None
    ) -> torch.Tensor | None:
        """:meth:`batch_get` of one page."""
        targets = [target_location] if target_location is not None else None
        return self.batch_get([key], targets)[0]

    @contextmanager
    def _borrowed(self, pages: int) -> Iterator[torch.Tensor | None]:
        """Token slots of ``pages`` host pages from the pool (None if it has none free),
        freed when the ``with`` block ends."""
        pool = self.mem_pool_host
        indices = pool.alloc(pages * self.pages.page_size)
        try:
            yield indices
        finally:
            if indices is not None:
                pool.free(indices)

    def clear(self) -> None:
        """Drop every page the tier holds for this process (a Redis server's keys stay)."""
        thread = self._running()

        async def clear() -> None:
            thread.tier.clear()

        thread.run(clear(), thread.job_timeout)

    def get_stats(self) -> Any:
        """With ``enable_storage_metrics``: SGLang's StorageMetrics (pages and GB/s of each
        call) since the last call; else None."""
        if not self.storage_config.enable_storage_metrics:
            return None
        from sglang.srt.observability.metrics_collector import StorageMetrics

        with self._lock:
            metrics, self._metrics = self._metrics, {name: [] for name in _METRICS}
        stats = StorageMetrics()
        for name, values in metrics.items():
            getattr(stats, name).extend(values)
        return stats

    def close(self) -> None:
        """Close the tier (calls in flight end first) and release the host pool. Idempotent."""
        thread, view = self._thread, self._view
        self._view = None
        if thread is not None and view is not None:
            thread.close()
            view.release()

    def __repr__(self) -> str:
        tier = self._thread.tier if self._thread is not None else None
        return f"<{type(self).__name__} {self.tier_type} over {tier!r}>"


class NVMeHiCacheStorage(TieringHiCacheStorage):
    """kv-tiering's NVMe tier as HiCache storage (``root`` and ``capacity_bytes`` required)."""

    tier_name = "nvme"


class RedisHiCacheStorage(TieringHiCacheStorage):
    """kv-tiering's Redis tier as HiCache storage (``url`` required); ranks and engines
    sharing a server share what it holds, each under its namespace."""

    tier_name = "redis"


class MemoryHiCacheStorage(TieringHiCacheStorage):
    """kv-tiering's memory tier (a bounded in-process store) as HiCache storage."""

    tier_name = "memory"
