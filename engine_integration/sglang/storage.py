"""hicache's L3 inside SGLang: a `HiCacheStorage` backend loaded with `--hicache-storage-backend
dynamic`.

SGLang keeps its own L1 (GPU) and L2 (host pool) and hands pages to an L3 backend by its own
page hashes. This backend stores them in any hicache L3 (file, redis, redis+cluster,
mooncake, grpc: the cache-server daemon) as hicache objects, verified on every read:

    python -m sglang.launch_server --model-path ... --enable-hierarchical-cache \\
        --hicache-storage-backend dynamic --hicache-storage-backend-extra-config \\
        '{"backend_name": "hicache", "module_path": "engine_integration.sglang.storage",
          "class_name": "HiCacheSGLangStorage", "interface_v1": 1,
          "url": "redis://127.0.0.1:6379/0?timeout=1s"}'

What it owns: the translation of SGLang's calls, keys and host-pool pages into hicache's
batched storage API. Keys: SGLang's page hash, namespaced by what makes KV incompatible
(model, dtype and host layout of the pool, pp/cp rank and size, and the tp rank and size
except for MLA, whose KV every tp rank holds whole and only the storage writer stores). A
page is the contiguous byte ranges it occupies in the pool (`pages.PageGeometry`): one object
per range where a page has one or two (K and V), one object of all of them where it has many
(layer_first: a range per layer). Either way the pool's own bytes are read into and written
from where they lie (the storage API takes a page in pieces): no staging copy.

Threads: SGLang calls from its prefetch, prefetch-I/O and backup threads at once. Every call
goes through one `SyncBackend` (its own event loop on its own thread), so no event loop of
the caller is assumed, and no call blocks longer than the backend URL's `timeout`: a slow or
dead backend gives misses (and False), counted, never a hang.

Hybrid models (SGLang's v2 API): the extra host pools SGLang registers through
`register_mem_host_pool_v2` (sliding-window KV, Mamba state, DSA indexer, DeepSeek-V4's
compressed and state pools, the draft model's KV) are stored beside the KV pages, one
verified object per page and pool (`sidecars.py`); `batch_exists_v2` applies SGLang's
per-pool hit policies (all_pages, trailing_pages), `batch_get_v2` / `batch_set_v2` move each
pool's pages. Extra pools of an MLA model are tp-replicated (one writer) except Mamba state
and MHA pools, which are per tp rank.

Heads split across tp sizes (`tp_lcm_size`, host layout page_head, MHA): a rank stores each
page as `tp_lcm_size // tp_size` head slices, each slice's K and V objects keyed as the rank
at tp_lcm_size that holds those heads (`tp=r/tp_lcm_size`, as SGLang's Mooncake backend does
with its per-target-rank suffixes), so instances of any tp size dividing tp_lcm_size share
them; a page is a hit only if every object of every one of its slices is there and verified.
Extra pools stay per tp rank: shared only between instances of one tp size.

Not supported, refused with an error naming the setting: host layouts other than page_first,
layer_first, page_first_direct and (MHA) page_head, a `tp_lcm_size` that is not a multiple of
tp_size, that splits heads outside page_head or that does not divide the rank's KV heads,
DCP, an extra pool without bytes of its own and the block_groups hit policy. A KV anchor
without bytes (DeepSeek-V4's logical pool) is accepted: its pages are wholly in the extra
pools, so only `batch_exists_v2` with those pools reports a hit (v1 `batch_exists` reports
none), as SGLang's Mooncake backend does.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)

from engine_integration.sglang.config import StorageSettings, head_slices, shard_of
from engine_integration.sglang.kv_pool import Attached
from engine_integration.sglang.metrics import Throughput
from engine_integration.sglang.pages import PageGeometry, byte_buffer, is_logical_anchor
from engine_integration.sglang.sidecars import (
    SidecarPool,
    is_tp_sharded,
    pool_descriptor,
    restorable_prefixes,
)
from radix.keys import Namespace
from storage_backends import (
    BackendConfigError,
    BackendStats,
    BackendUnavailableError,
    SyncBackend,
    open_backend,
)

logger = logging.getLogger(__name__)


class HiCacheSGLangStorage(HiCacheStorage):
    """SGLang's L3 on hicache storage. Built by SGLang's `StorageBackendFactory` as
    `HiCacheSGLangStorage(storage_config, kwargs)`; the host pool arrives next through
    `register_mem_pool_host`, which connects (an unreachable backend fails the attach)."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict | None = None):
        self.storage_config = storage_config
        self.settings = StorageSettings.from_storage_config(storage_config)
        self.shard = shard_of(storage_config)
        self.head_slices = head_slices(storage_config)
        self.attention = "mla" if storage_config.is_mla_model else "mha"
        self.is_writer = storage_config.is_storage_writer
        try:  # a bad scheme or option fails now, before SGLang starts its threads
            open_backend(self.settings.url)
        except BackendConfigError as exc:
            raise BackendConfigError(f"extra config 'url': {exc}") from None
        self._attached: Attached | None = None
        self._attach_lock = threading.Lock()
        self._throughput = Throughput()
        self._metrics = storage_config.enable_storage_metrics
        self.num_refused_writes = 0  # set calls refused: not this rank's to write (MLA)
        self._sidecars: dict[str, SidecarPool] = {}  # extra host pools, by SGLang's pool name
        self._logical_anchor: Any = None  # a KV anchor without bytes (DeepSeek-V4), if so

    # -- attach ---------------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Take the host pool, derive its page geometry and namespace, connect the store.
        A logical anchor (DeepSeek-V4's `LogicalHostPool`: page slots, no KV bytes) is
        taken as such: its pages are carried whole by the extra pools registered next."""
        super().register_mem_pool_host(mem_pool_host)
        if is_logical_anchor(mem_pool_host):
            with self._attach_lock:
                previous, self._attached = self._attached, None
                self._logical_anchor = mem_pool_host
            if previous is not None:
                previous.store.close()
            return
        geometry = PageGeometry.of_host_pool(
            mem_pool_host, attention=self.attention, head_slices=self.head_slices
        )
        digests = [
            Namespace(
                model_id=self.settings.model_id,
                layout=geometry.descriptor,
                extra_key=shard_of(self.storage_config, head_slice=s),
            ).digest
            for s in range(self.head_slices)
        ]
        store = SyncBackend(open_backend(self.settings.url, layout=geometry.descriptor))
        try:
            store.connect()
        except BackendUnavailableError as exc:
            store.close()
            raise BackendUnavailableError(f"extra config 'url': {exc}") from None
        with self._attach_lock:
            previous, self._attached = (
                self._attached,
                Attached(mem_pool_host, geometry, store, digests),
            )
        if previous is not None:
            previous.store.close()
        logger.info(
            "hicache L3 %s attached: %s, namespace %s/%s, %d head slice(s) a page",
            store.backend.name,
            geometry.descriptor,
            self.settings.model_id,
            self.shard,
            self.head_slices,
        )

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """An extra host pool (window KV, Mamba state, DSA indexer, DeepSeek-V4 pools, the
        draft model's): stored page by page, one verified object per page, in a namespace
        of its own. The KV pool itself may come this way too (as the anchor)."""
        name = str(host_pool_name)
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        if name == PoolName.KV.value:
            attached = self._attached
            if self._logical_anchor is not None and host_pool is self._logical_anchor:
                return
            if attached is None:
                self.register_mem_pool_host(host_pool)
            elif attached.pool is not host_pool:
                raise BackendConfigError(
                    "host pool 'kv' registered through v2 is not the pool given to "
                    "register_mem_pool_host"
                )
            return
        shard = shard_of(self.storage_config, tp_sharded=is_tp_sharded(host_pool))
        store = SyncBackend(
            open_backend(self.settings.url, layout=pool_descriptor(name, host_pool))
        )
        try:
            store.connect()
        except BackendUnavailableError as exc:
            store.close()
            raise BackendUnavailableError(f"extra config 'url': {exc}") from None
        sidecar = SidecarPool(
            name, host_pool, model_id=self.settings.model_id, shard=shard, store=store
        )
        with self._attach_lock:
            previous, self._sidecars[name] = self._sidecars.get(name), sidecar
        if previous is not None:
            previous.close()
        logger.info("hicache L3: extra host pool %s attached: %s", name, sidecar.descriptor)

    # -- v2: the KV pages and the extra pools' pages of one batch ------------------------------

    def batch_exists_v2(
        self,
        keys: list[str],
        pool_transfers: list[PoolTransfer] | None = None,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> PoolTransferResult:
        """The longest KV prefix whose pages, and every extra pool's pages under its hit
        policy, are stored; each pool's own boundary; every restorable prefix length."""
        transfers = list(pool_transfers or ())
        if self._logical_anchor is not None:  # the pools alone hold the pages
            kv_pages = len(keys) if transfers else 0
        else:
            kv_pages = self.batch_exists(keys, extra_info)
        for transfer in transfers:
            self._sidecar(transfer.name)

        def present(transfer: PoolTransfer, num_pages: int) -> list[bool]:
            sidecar = self._sidecar(transfer.name)
            if transfer.hit_policy == PoolHitPolicy.ALL_PAGES:
                run = sidecar.leading_run(keys[:num_pages])
                return [i < run for i in range(num_pages)]
            return sidecar.exists_each(keys[:num_pages])

        restorable, boundaries = restorable_prefixes(kv_pages, transfers, present)
        hits = {PoolName.KV: kv_pages} if kv_pages else {}
        hits.update({PoolName(name): pages for name, pages in boundaries.items()})
        return PoolTransferResult(restorable[-1] if restorable else 0, hits, restorable)

    def batch_get_v2(
        self, transfers: list[PoolTransfer], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> dict[str, list[bool]]:
        """Read each transfer's pages into its pool; True per verified page, per pool."""
        return {t.name: self._transfer_v2("prefetch", t) for t in transfers}

    def batch_set_v2(
        self, transfers: list[PoolTransfer], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> dict[str, list[bool]]:
        """Store each transfer's pages from its pool; True per stored page, per pool."""
        return {t.name: self._transfer_v2("backup", t) for t in transfers}

    def _transfer_v2(self, kind: str, transfer: PoolTransfer) -> list[bool]:
        keys = list(transfer.keys or ())
        if str(transfer.name) == PoolName.KV.value:
            return self._move(kind, keys, transfer.host_indices)
        sidecar = self._sidecar(transfer.name)
        if kind == "prefetch":
            return sidecar.get(keys, transfer.host_indices)
        replicated = self.attention == "mla" and not is_tp_sharded(sidecar.pool)
        if replicated and keys and not self._may_write(len(keys)):
            sidecar.page_starts(keys, transfer.host_indices)  # still a checked call
            return [False] * len(keys)
        return sidecar.put(keys, transfer.host_indices)

    def _sidecar(self, name: Any) -> SidecarPool:
        sidecar = self._sidecars.get(str(name))
        if sidecar is None:
            raise ValueError(
                f"host pool {str(name)!r} was not registered (register_mem_host_pool_v2)"
            )
        return sidecar

    def _pool(self) -> Attached:
        attached = self._attached
        if attached is None and self._logical_anchor is not None:
            raise BackendConfigError(
                "the KV host pool is logical (DeepSeek-V4: no KV bytes): flat-page calls "
                "have nothing to move; its pages go through batch_get_v2 / batch_set_v2"
            )
        if attached is None:
            raise RuntimeError("HiCacheSGLangStorage: register_mem_pool_host was not called")
        return attached

    # -- zero copy: straight into and out of the host pool ----------------------------------

    def batch_exists(
        self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> int:
        """How many pages, from the first, are stored (every part of each)."""
        if self._logical_anchor is not None:
            return 0  # no KV objects: only batch_exists_v2, with the pools, can say
        attached = self._pool()
        if not keys:
            return 0
        found = attached.store.batch_exists(attached.object_keys(keys))
        return found // attached.geometry.num_objects

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_get_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Read pages into the host pool at `host_indices`; True per verified page."""
        return self._move("prefetch", keys, host_indices)

    def batch_set_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Store the host pool's pages at `host_indices` under `keys`; True per stored page."""
        return self._move("backup", keys, host_indices)

    def _move(self, kind: str, keys: list[str], host_indices: torch.Tensor) -> list[bool]:
        """One batch between L3 and the pool's own pages: read in ("prefetch") or written
        out ("backup") where they lie (no staging copy): each part of a page an object, or
        where a page has many parts (`PageGeometry.gathered`) the page one object in pieces,
        read straight into its parts and verified there. A page that fails its check is
        False: SGLang frees its host page, never reading what landed in it."""
        if self._logical_anchor is not None:
            return [True] * len(keys)  # no KV bytes: the extra pools carry the pages
        attached = self._pool()
        geometry = attached.geometry
        pages = geometry.page_numbers(host_indices, len(keys))
        if not keys or (kind == "backup" and not self._may_write(len(keys))):
            return [False] * len(keys)
        start = time.perf_counter()
        object_keys = attached.object_keys(keys)
        views = geometry.page_views(attached.buffer, pages)
        if geometry.gathered:  # one object a page: its parts are its pieces
            n = geometry.num_parts
            views = [views[i : i + n] for i in range(0, len(views), n)]
        call = attached.store.batch_get if kind == "prefetch" else attached.store.batch_put
        done = attached.per_page(call(object_keys, views))
        self._record(kind, attached, sum(done), start)
        return done

    # -- flat pages (SGLang's path without interface_v1) ------------------------------------

    def batch_get(
        self,
        keys: list[str],
        target_locations: Sequence[torch.Tensor] | None = None,
        target_sizes: Any = None,
    ) -> list[torch.Tensor | None]:
        """Read pages into flat page tensors (SGLang's dummy pages; new ones if None)."""
        attached = self._pool()
        if target_locations is None:
            target_locations = [self._flat_page(attached) for _ in keys]
        if len(target_locations) != len(keys):
            raise ValueError(f"{len(target_locations)} target_locations for {len(keys)} keys")
        views = [
            part
            for target in target_locations
            for part in attached.geometry.split_flat_page(byte_buffer(target))
        ]
        found = attached.per_page(attached.store.batch_get(attached.object_keys(keys), views))
        return [t if ok else None for t, ok in zip(target_locations, found, strict=True)]

    def get(
        self, key: str, target_location: torch.Tensor | None = None, target_sizes: Any = None
    ) -> torch.Tensor | None:
        targets = None if target_location is None else [target_location]
        return self.batch_get([key], targets)[0]

    def batch_set(
        self,
        keys: list[str],
        values: Sequence[torch.Tensor] | None = None,
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        """Store flat pages (`get_data_page(i, flat=True)`); True if every page was stored."""
        attached = self._pool()
        if values is None or len(values) != len(keys):
            raise ValueError(f"batch_set needs one flat page per key ({len(keys)} keys)")
        if not keys or not self._may_write(len(keys)):
            return not keys
        views = [
            part
            for value in values
            for part in attached.geometry.split_flat_page(byte_buffer(value.contiguous()))
        ]
        return all(attached.store.batch_put(attached.object_keys(keys), views))

    def set(
        self,
        key: str,
        value: torch.Tensor | None = None,
        target_location: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        if value is None:
            raise ValueError("set needs the flat page as value")
        return self.batch_set([key], [value])

    # -- the rest -----------------------------------------------------------------------------

    def get_stats(self):
        """SGLang's `StorageMetrics` (pages and GB/s per call since the last call), with
        hicache's backend counters (hits, misses, corrupt pages, timeouts...) as `.hicache`."""
        from sglang.srt.observability.metrics_collector import StorageMetrics

        metrics = StorageMetrics(**self.take_throughput())
        metrics.hicache = self.backend_stats()
        return metrics

    def take_throughput(self) -> dict[str, list[float]]:
        """Pages and GB/s of each get (prefetch) and set (backup) since the last take, under
        the names of SGLang's `StorageMetrics` (recorded when SGLang runs with
        --enable-metrics: `enable_storage_metrics`)."""
        return self._throughput.take()

    def backend_stats(self) -> BackendStats | None:
        attached = self._attached
        return None if attached is None else attached.store.stats()

    def clear(self) -> bool:
        """Refused: hicache's L3 is shared (other engines, other ranks), so one engine may not
        wipe it; drop its data with the store's own tools. Returns False, with a warning."""
        logger.warning(
            "hicache L3 %s: clear() ignored; the store is shared, clear it with its own tools",
            self.settings.url.split("?")[0],
        )
        return False

    def close(self) -> None:
        with self._attach_lock:
            attached, self._attached = self._attached, None
            sidecars, self._sidecars = list(self._sidecars.values()), {}
        if attached is not None:
            attached.store.close()
        for sidecar in sidecars:
            sidecar.close()

    # -- helpers ------------------------------------------------------------------------------

    def _may_write(self, num_pages: int) -> bool:
        """SGLang's single-writer rule for MLA: only the storage writer stores pages."""
        if self.is_writer:
            return True
        self.num_refused_writes += num_pages
        return False

    def _flat_page(self, attached: Attached) -> torch.Tensor:
        buffer = attached.pool.kv_buffer
        return torch.empty(
            attached.geometry.page_bytes // buffer.element_size(), dtype=buffer.dtype
        )

    def _record(self, kind: str, attached: Attached, num_pages: int, start: float) -> None:
        if self._metrics:
            elapsed = time.perf_counter() - start
            self._throughput.record(
                kind, num_pages, num_pages * attached.geometry.page_bytes, elapsed
            )
