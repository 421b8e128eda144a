"""SGLang's extra host pools (v2 storage API): one verified hicache object per page and pool.

A hybrid model's KV is more than the full-attention pool: SGLang registers extra host pools
through `register_mem_host_pool_v2` (sliding-window KV, Mamba state, the DSA indexer,
DeepSeek-V4's compressed c4/c128 and state pools, the draft model's KV) and moves them with
`batch_get_v2` / `batch_set_v2`, keyed by the same page hashes as the KV pages.

What this module owns:

- `SidecarPool`: one registered pool. Its page is SGLang's own flat page of that pool
  (`get_data_page(i, flat=True)`, `get_dummy_flat_data_page()`, `set_from_flat_data_page`),
  stored as ONE hicache object under a namespace of its own (the pool's name, class, layout,
  dtype and page bytes), so it is verified as a whole: a missing, damaged, foreign or
  stale page of a pool is a miss for that whole page, and a read lands in a staging page
  first, reaching the pool only once verified (never a partial load).
- `restorable_prefixes`: SGLang's per-pool hit policies (`PoolHitPolicy`) over which pages
  each pool holds, as SGLang's own backends compute them.

It does not know the KV anchor's page geometry (`pages.py`) nor the store's URL.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import xxhash

from engine_integration.sglang.pages import byte_buffer
from radix.keys import Namespace
from storage_backends import BackendConfigError, SyncBackend

# SGLang's tp-sharded extra pools: their bytes differ per tp rank even for an MLA model
# (Mamba / linear-attention state is split by heads; an MHA draft or window pool by heads).
TP_SHARDED_CLASSES = ("MambaPoolHost", "MHATokenToKVPoolHost")


def pool_descriptor(name: str, pool: Any) -> str:
    """What the bytes of one page of `pool` mean: a reader with another answer misses.
    Refuses a pool without SGLang's flat-page calls, or whose pages are empty."""
    for method in ("get_data_page", "get_dummy_flat_data_page", "set_from_flat_data_page"):
        if not callable(getattr(pool, method, None)):
            raise BackendConfigError(
                f"host pool {name!r} ({type(pool).__name__}) has no {method}: hicache "
                "stores an extra pool by SGLang's flat pages"
            )
    dummy = pool.get_dummy_flat_data_page()
    if dummy.numel() == 0:
        raise BackendConfigError(
            f"host pool {name!r} ({type(pool).__name__}) has empty pages (a logical pool "
            "with no bytes of its own): nothing to store"
        )
    dummy = pool.get_dummy_flat_data_page()
    page_bytes = dummy.numel() * dummy.element_size()
    return (
        f"sglang-pool;name={name};class={type(pool).__name__};"
        f"layout={getattr(pool, 'layout', None)};dtype={_dtype_name(getattr(pool, 'dtype', None))};"
        f"page={_page_size(pool)};page_bytes={page_bytes}"
    )


def is_tp_sharded(pool: Any) -> bool:
    """Whether the pool's pages differ per tp rank when the KV pool is MLA (replicated)."""
    return any(cls.__name__ in TP_SHARDED_CLASSES for cls in type(pool).__mro__)


class SidecarPool:
    """One extra host pool of SGLang's, stored page by page in its own namespace. `store`
    is opened by the caller with `layout=pool_descriptor(name, pool)`."""

    def __init__(
        self, name: str, pool: Any, *, model_id: str, shard: str, store: SyncBackend
    ) -> None:
        self.name = name
        self.pool = pool
        self.page_size = _page_size(pool)
        self.descriptor = pool_descriptor(name, pool)
        dummy = pool.get_dummy_flat_data_page()
        self.page_bytes = dummy.numel() * dummy.element_size()
        self.store = store
        self.digest = Namespace(model_id=model_id, layout=self.descriptor, extra_key=shard).digest

    def object_keys(self, keys: Sequence[str]) -> list[bytes]:
        hasher = xxhash.xxh3_128()
        out = []
        for key in keys:
            if type(key) is not str:
                raise ValueError(f"pool {self.name!r}: keys must be str page hashes, got {key!r}")
            raw = key.encode()
            hasher.reset()
            hasher.update(self.digest)
            hasher.update(len(raw).to_bytes(4, "little"))
            hasher.update(raw)
            out.append(hasher.digest())
        return out

    def page_starts(self, keys: Sequence[str], host_indices: torch.Tensor | None) -> list[int]:
        """The first host index of each key's page (SGLang passes page_size per key)."""
        if not isinstance(host_indices, torch.Tensor) or host_indices.dim() != 1:
            raise ValueError(f"pool {self.name!r}: host_indices must be a 1-D tensor")
        if host_indices.numel() != len(keys) * self.page_size:
            raise ValueError(
                f"pool {self.name!r}: host_indices has {host_indices.numel()} entries for "
                f"{len(keys)} keys of {self.page_size} slots"
            )
        firsts = host_indices.to(device="cpu", dtype=torch.int64)[:: self.page_size]
        return [int(i) for i in firsts.tolist()]

    def exists_each(self, keys: Sequence[str]) -> list[bool]:
        """Presence of each key's page (presence only: a corrupt page misses at get)."""
        object_keys = self.object_keys(keys)
        return [self.store.batch_exists([key]) == 1 for key in object_keys]

    def leading_run(self, keys: Sequence[str]) -> int:
        return self.store.batch_exists(self.object_keys(keys)) if keys else 0

    def get(self, keys: Sequence[str], host_indices: torch.Tensor | None) -> list[bool]:
        """Read each page into a staging page; verified pages only reach the pool."""
        starts = self.page_starts(keys, host_indices)
        if not keys:
            return []
        staging = [self.pool.get_dummy_flat_data_page() for _ in keys]
        found = self.store.batch_get(
            self.object_keys(keys), [byte_buffer(page) for page in staging]
        )
        for start, page, ok in zip(starts, staging, found, strict=True):
            if ok:
                self.pool.set_from_flat_data_page(start, page)
        return list(found)

    def put(self, keys: Sequence[str], host_indices: torch.Tensor | None) -> list[bool]:
        starts = self.page_starts(keys, host_indices)
        if not keys:
            return []
        pages = [self.pool.get_data_page(start, flat=True).contiguous() for start in starts]
        return list(self.store.batch_put(self.object_keys(keys), [byte_buffer(p) for p in pages]))

    def close(self) -> None:
        self.store.close()


def restorable_prefixes(
    kv_pages: int,
    transfers: Sequence[Any],
    present: Callable[[Any, int], list[bool]],
) -> tuple[list[int], dict[str, int]]:
    """The KV prefix lengths (in pages) every pool can restore, and each pool's boundary.

    `present(transfer, n)` gives, for the pool of `transfer`, whether each of the first `n`
    KV pages has its page of that pool. Policies, as SGLang's backends apply them:
    ALL_PAGES: every page up to the prefix; TRAILING_PAGES: the last len(transfer.keys) pages
    before it (so a prefix may be restorable while a shorter one is not).
    """
    from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy

    supported = (PoolHitPolicy.ALL_PAGES, PoolHitPolicy.TRAILING_PAGES)
    for transfer in transfers:  # refused whatever is stored: a policy we cannot honour
        if transfer.hit_policy not in supported:
            raise BackendConfigError(
                f"pool {_value(transfer.name)!r}: hit policy {_value(transfer.hit_policy)!r} is "
                "not supported "
                "by hicache's SGLang backend (nor by SGLang's file and Mooncake backends)"
            )
    restorable = list(range(1, kv_pages + 1))
    boundaries: dict[str, int] = {}
    for transfer in transfers:
        if not restorable:
            break
        exists = present(transfer, kv_pages)
        if transfer.hit_policy == PoolHitPolicy.ALL_PAGES:
            boundary = exists.index(False) if False in exists else kv_pages
            ok = set(range(1, boundary + 1))
        else:  # TRAILING_PAGES
            window = max(1, len(transfer.keys or ()))
            ok = {end for end in range(1, kv_pages + 1) if all(exists[max(0, end - window) : end])}
            boundary = max(ok, default=0)
        if boundary:
            boundaries[str(transfer.name)] = boundary
        restorable = [end for end in restorable if end in ok]
    return restorable, boundaries


def _page_size(pool: Any) -> int:
    return int(getattr(pool, "page_size", 1) or 1)


def _dtype_name(dtype: object) -> str:
    return str(dtype).removeprefix("torch.")


def _value(member: object) -> object:
    return getattr(member, "value", member)
