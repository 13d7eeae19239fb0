"""kv-tiering's tiers as SGLang 0.5.23's HiCache storage, through its ``dynamic`` storage
backend (docs/sglang.md). Without SGLang, importing this module raises ImportError."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from tiering.errors import ClosedError, InvalidArgumentError
from tiering.hashing import NAMESPACE_FORMAT, canonical_json
from tiering.integrations.sglang_pools import (
    ALL_PAGES,
    BLOCK_GROUPS,
    PageChunks,
    PoolStore,
    block_group_pages,
    pool_buffers,
    restorable_prefixes,
)
from tiering.integrations.tier_thread import FRAMEWORK_DEFAULTS, TierThread, fixed_tier
from tiering.tiers.inbox import Lane
from tiering.tiers.registry import check_options

try:
    from sglang.srt.mem_cache.hicache_storage import (
        HiCacheStorage,
        HiCacheStorageConfig,
        HiCacheStorageExtraInfo,
        PoolTransfer,
        PoolTransferResult,
    )
except ImportError as exc:  # pragma: no cover - exercised only without SGLang
    raise ImportError(
        "tiering.integrations.sglang needs SGLang 0.5.23 (the 'sglang' extra; .ci/install-sglang "
        f"installs it on a CPU-only machine); importing SGLang failed: {type(exc).__name__}: {exc}"
    ) from exc

if TYPE_CHECKING:
    from sglang.srt.mem_cache.pool_host import HostKVCache

logger = logging.getLogger(__name__)

# Keys of --hicache-storage-backend-extra-config that are SGLang's, not the tier's.
_SGLANG_KEYS = frozenset({"backend_name", "module_path", "class_name", "interface_v1"})
# The StorageMetrics fields this storage reports.
_METRICS = ("prefetch_pgs", "backup_pgs", "prefetch_bandwidth", "backup_bandwidth")


def sglang_namespace(
    config: HiCacheStorageConfig,
    pool: HostKVCache,
    chunk_bytes: int,
    *,
    part: tuple[str, int] | None = None,
) -> str:
    """The cache namespace of an SGLang rank: what its stored pages' bytes mean (the model,
    the rank's shard, without the TP rank where the KV is replicated over TP ranks as for
    MLA models, and the host pool's geometry and layout). ``part`` names a state pool
    and one of its buffers (a Mamba state is sharded over TP ranks even under MLA)."""
    shard: dict[str, Any] = {
        "pp": [config.pp_rank, config.pp_size],
        "attn_cp": [config.attn_cp_rank, config.attn_cp_size],
        "dcp": [config.dcp_rank, config.dcp_size],
    }
    if not config.is_mla_model or _rank_sharded(part[0] if part else "kv"):
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
    if part is not None:  # the KV pool's namespace stays what it was before pools had parts
        buffer = pool_buffers(pool)[part[1]]
        fields["part"] = {"pool": part[0], "buffer": part[1], "dtype": str(buffer.dtype)}
        fields["part"]["shape"] = list(buffer.shape[1:])
    return canonical_json({"sglang": fields, "format": NAMESPACE_FORMAT})


def _rank_sharded(pool_name: str) -> bool:
    """Whether every TP rank holds its own shard of the pool even where the KV is
    replicated over TP ranks (MLA): SGLang backs Mamba state up on every rank."""
    return pool_name == "mamba"


def _pool_name(name: object) -> str:
    """SGLang's ``PoolName`` (a str enum) or a plain name, as the plain name."""
    return str(getattr(name, "value", name))


def _shares(given: object) -> dict[str, float]:
    """The ``pool_shares`` option: a mapping of pool name to a positive weight."""
    if given is None:
        return {}
    bad = not isinstance(given, dict) or not all(
        isinstance(k, str) and isinstance(v, int | float) and not isinstance(v, bool) and v > 0
        for k, v in given.items()
    )
    if bad:
        raise InvalidArgumentError(
            "pool_shares must map pool names (kv, mamba, swa, ...) to positive weights, "
            f"got {given!r}"
        )
    return {k: float(v) for k, v in given.items()}


class TieringHiCacheStorage(HiCacheStorage):
    """SGLang HiCache storage backed by the kv-tiering tier registered as ``tier`` (the
    subclasses fix it), built as ``cls(storage_config, kwargs)``; the tier's options,
    ``namespace``, ``pool_shares``, ``start_timeout`` and ``job_timeout`` come in
    ``storage_config.extra_config`` (docs/sglang.md#set-up).

    A page (of KV, or a pool's state) is stored and served whole, never with wrong bytes;
    ranks that are not storage writers store no KV (nor state of a pool SGLang backs up
    on the writer rank only); every call waits for its batch's I/O and no longer.

    The tiers are built when SGLang has registered its host pools (one tier per buffer
    of each pool; a tier's ``capacity_bytes`` is split over the pools by ``pool_shares``,
    equal by default, and within a pool by the bytes of a page in each buffer);
    InvalidArgumentError there for a bad option or a host pool the tier cannot move pages
    of in place, UnknownTierError for an unknown ``tier``, TimeoutError if a tier did not
    start within ``start_timeout`` (then nothing is left running). Calls before that, or
    after :meth:`close`, raise ClosedError. A pool registered after that is not served."""

    tier_name: ClassVar[str | None] = None

    def __init__(
        self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None
    ) -> None:
        options = {
            k: v for k, v in (storage_config.extra_config or {}).items() if k not in _SGLANG_KEYS
        }
        self.tier_type = fixed_tier(type(self), type(self).tier_name, options.pop("tier", None))
        self._namespace: str | None = options.pop("namespace", None)
        self._shares = _shares(options.pop("pool_shares", None))
        self._start_timeout = options.pop("start_timeout", 600.0)
        self._job_timeout = options.pop("job_timeout", 30.0)
        self._options = options
        self.storage_config = storage_config
        self._host_pools: dict[str, HostKVCache] = {}
        self._stores: dict[str, PoolStore] | None = None
        self._lock = threading.Lock()
        self._metrics: dict[str, list[Any]] = {name: [] for name in _METRICS}

    def register_mem_pool_host(self, mem_pool_host: HostKVCache) -> None:
        """Take the KV host pool (its tiers start with :meth:`on_host_pools_registered`);
        InvalidArgumentError if one is registered already."""
        if "kv" in self._host_pools:
            raise InvalidArgumentError("the host pool is already registered")
        super().register_mem_pool_host(mem_pool_host)
        self._host_pools["kv"] = mem_pool_host

    def register_mem_host_pool_v2(self, host_pool: HostKVCache, host_pool_name: object) -> None:
        """Take a host pool of a hybrid model (``mamba``, ``swa``, ...); one that arrives
        after :meth:`on_host_pools_registered` is not served (its pages count as absent)."""
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        name = _pool_name(host_pool_name)
        if self._stores is not None:
            if name not in self._stores:
                logger.warning("host pool %r registered after start: not stored", name)
        elif name != "kv":
            self._host_pools[name] = host_pool

    def on_host_pools_registered(self) -> None:
        """Build one tier per buffer of every registered host pool and start each on a
        private loop thread (raises as the class says; nothing is left running)."""
        if self._stores is not None:
            return
        if "kv" not in self._host_pools:
            raise InvalidArgumentError("no KV host pool is registered")
        unknown = sorted(set(self._shares) - set(self._host_pools))
        if unknown:
            raise InvalidArgumentError(
                f"pool_shares names {unknown}, which SGLang did not register (its pools: "
                f"{sorted(self._host_pools)})"
            )
        kv = PageChunks(self._host_pools["kv"], self._host_pools["kv"].kv_buffer)
        # A state row longer than a KV run is cut into pieces no longer than one, which
        # the tiers move at once, as they move a page's runs.
        parts = {
            name: [kv]
            if name == "kv"
            else [PageChunks(pool, b, piece_bytes=kv.chunk_bytes) for b in pool_buffers(pool)]
            for name, pool in self._host_pools.items()
        }
        # The tier's options as it reads them (a bad one fails here, naming it), for the
        # capacity to split.
        checked = check_options(
            self.tier_type, self._options, defaults={"namespace": "-", **FRAMEWORK_DEFAULTS}
        )
        capacity = checked.get("capacity_bytes")
        capacity = capacity if isinstance(capacity, int) else None
        weights = {name: self._shares.get(name, 1.0) for name in parts}
        stores: dict[str, PoolStore] = {}
        try:
            for name, chunks in parts.items():
                options = dict(self._options)
                pool_bytes = sum(c.page_bytes for c in chunks)
                built = []
                for index, buffer_chunks in enumerate(chunks):
                    if capacity is not None:
                        share = weights[name] / sum(weights.values())
                        options["capacity_bytes"] = max(
                            1, int(capacity * share * buffer_chunks.page_bytes / pool_bytes)
                        )
                    built.append(self._open(name, index, buffer_chunks, options))
                    stores[name] = PoolStore(name, built)
        except BaseException:
            for store in stores.values():
                store.close()
            raise
        self._stores = stores

    def _open(
        self, name: str, index: int, chunks: PageChunks, options: dict[str, Any]
    ) -> tuple[PageChunks, TierThread, memoryview]:
        """A tier thread over one buffer of the pool ``name``."""
        pool = self._host_pools[name]
        part = None if name == "kv" else (name, index)
        if self._namespace is not None:
            namespace = self._namespace if part is None else f"{self._namespace}/{name}.{index}"
        else:
            namespace = sglang_namespace(self.storage_config, pool, chunks.chunk_bytes, part=part)
        view = memoryview(chunks.buffer.reshape(-1).view(torch.uint8).numpy())
        try:
            thread = TierThread(
                {"type": self.tier_type, **options},
                view,
                chunks.chunk_bytes,
                name=f"kv-tiering-sglang-{self.tier_type}-{name}.{index}",
                defaults={"namespace": namespace, **FRAMEWORK_DEFAULTS},
                start_timeout=self._start_timeout,
                job_timeout=self._job_timeout,
            )
        except InvalidArgumentError as exc:
            if part is None:
                raise
            raise InvalidArgumentError(f"host pool {name!r} (buffer {index}): {exc}") from exc
        return chunks, thread, view

    def _store(self, name: str = "kv") -> PoolStore | None:
        """The running store of the pool ``name`` (None if that pool is not served);
        ClosedError before the tiers start or after :meth:`close`."""
        stores = self._stores
        if stores is None:
            raise ClosedError(
                "kv-tiering's HiCache storage is not running (its host pools are not "
                "registered yet, or it is closed)"
            )
        return stores.get(name)

    @property
    def pages(self) -> PageChunks:
        """Where the KV host pool's pages lie (ClosedError as :meth:`_store`)."""
        return self._kv().parts[0][0]

    def _kv(self) -> PoolStore:
        store = self._store()
        assert store is not None, "the KV pool always has a store"
        return store

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
        store = self._kv()
        started = time.perf_counter()
        result = store.move(kind, keys, host_indices)
        elapsed, done = time.perf_counter() - started, sum(result)
        if self.storage_config.enable_storage_metrics and done and elapsed > 0:
            call = "backup" if kind == "store" else "prefetch"
            gb = done * self.pages.page_bytes / 1e9
            with self._lock:
                self._metrics[f"{call}_pgs"].append(done)
                self._metrics[f"{call}_bandwidth"].append(gb / elapsed)
        return result

    def batch_exists(
        self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> int:
        """How many of ``keys``, from the first, the tier holds whole (a key it is still
        checking is asked about again, for at most ``job_timeout``)."""
        return self._kv_prefix(keys)

    def _kv_prefix(self, keys: list[str]) -> int:
        held = self._kv().held(keys, prefix=True)
        return held.index(False) if False in held else len(keys)

    # -- SGLang's multi-pool interface (hybrid models) -----------------------------

    def batch_exists_v2(
        self,
        keys: list[str],
        pool_transfers: list[PoolTransfer] | None = None,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> PoolTransferResult:
        """The usable prefix of ``keys`` (KV pages): its KV pages held whole, and each
        pool of ``pool_transfers`` held as its hit policy needs (``trailing_pages``: the
        last ``len(keys)`` pages before the prefix's end; ``all_pages``: every page;
        ``block_groups`` gates nothing and reports its leading whole blocks). The result
        holds that prefix, each pool's longest restorable prefix, and every prefix length
        this rank can restore. A pool that is not served makes no prefix usable."""
        kv_pages = self._kv_prefix(keys)
        restorable = set(range(1, kv_pages + 1))
        hits: dict[str, int] = {"kv": kv_pages} if kv_pages else {}
        for transfer in pool_transfers or ():
            name, store = _pool_name(transfer.name), self._store(_pool_name(transfer.name))
            policy = _pool_name(transfer.hit_policy)
            if store is None or not restorable:
                restorable = set()
                continue
            present = store.held(keys[:kv_pages], prefix=policy == ALL_PAGES)
            if policy == BLOCK_GROUPS:
                hits[name] = block_group_pages(present, transfer.block_pages)
                continue
            lengths = restorable_prefixes(present, policy, len(transfer.keys or ()))
            if lengths:
                hits[name] = max(lengths)
            restorable &= lengths
        ordered = sorted(restorable)
        return PoolTransferResult(ordered[-1] if ordered else 0, hits, ordered)

    def batch_get_v2(
        self, transfers: list[PoolTransfer], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> dict[str, list[bool]]:
        """Load each transfer's pages (``keys`` into ``host_indices`` of its pool); per
        pool, True for each page landed whole and verified in every buffer of the pool
        (False throughout for a pool that is not served)."""
        return {_pool_name(t.name): self._move_pool("load", t) for t in transfers}

    def batch_set_v2(
        self, transfers: list[PoolTransfer], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> dict[str, list[bool]]:
        """Store each transfer's pages; per pool, True for each page stored whole or
        already held (every page of a pool this rank does not write: a rank that is not
        a storage writer writes only rank-sharded pools such as Mamba state)."""
        return {_pool_name(t.name): self._move_pool("store", t) for t in transfers}

    def _move_pool(self, kind: Lane, transfer: PoolTransfer) -> list[bool]:
        name, keys = _pool_name(transfer.name), list(transfer.keys or ())
        store = self._store(name)
        if store is None:
            return [False] * len(keys)
        writer = self.storage_config.is_storage_writer or _rank_sharded(name)
        if kind == "store" and not writer:
            return [True] * len(keys)
        return store.move(kind, keys, transfer.host_indices)

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
        """Drop every page the tiers hold for this process (a Redis server's keys stay)."""
        self._kv()
        for store in (self._stores or {}).values():
            store.clear()

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
        """Close the tiers (calls in flight end first) and release the host pools.
        Idempotent."""
        stores, self._stores = self._stores, None
        for store in (stores or {}).values():
            store.close()

    def __repr__(self) -> str:
        store = (self._stores or {}).get("kv")
        tier = store.parts[0][1].tier if store is not None else None
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
