"""Small KV layouts and CPU caches for tests of the controller and its users."""

from __future__ import annotations

import torch

from hicache.config import HiCacheConfig, L1Config, L2Config, L3Config, PolicyConfig
from hicache.controller import HiCache
from radix.keys import Namespace
from tiers.layout import KVLayout

MHA = KVLayout(kind="mha", num_layers=2, page_size=4, dtype="float32", num_kv_heads=2, head_dim=4)
NS = Namespace(model_id="test-model", layout="test-layout")  # every test prompt's namespace
MLA = KVLayout(kind="mla", num_layers=3, page_size=4, dtype="bfloat16", kv_lora_rank=6, rope_dim=2)


def make_cache(
    layout: KVLayout = MHA,
    *,
    l1_pages: int = 16,
    l2_pages: int = 32,
    l3_url: str | None = None,
    **policy,
) -> HiCache:
    l3 = {k[3:]: policy.pop(k) for k in list(policy) if k.startswith("l3_")}
    config = HiCacheConfig(
        layout=layout,
        l1=L1Config(device="cpu", num_pages=l1_pages),
        l2=L2Config(
            budget_bytes=l2_pages * layout.bytes_per_page, reserve_bytes=0, pin_memory=False
        ),
        l3=L3Config(url=l3_url, **l3),
        policy=PolicyConfig(**policy),
    )
    return HiCache(config)


def fill_pages(cache: HiCache, device_page_ids: list[int], seed: int) -> torch.Tensor:
    """Write fresh random KV into the pages (all layers); returns what was written."""
    generator = torch.Generator().manual_seed(seed)
    kv = cache.device_pool.kv  # (L, P, S, *token_shape)
    values = torch.randn(
        (kv.shape[0], len(device_page_ids), *kv.shape[2:]), generator=generator
    ).to(kv.dtype)
    kv[:, device_page_ids] = values
    return values.clone()


def read_pages(cache: HiCache, device_page_ids: list[int]) -> torch.Tensor:
    return cache.device_pool.kv[:, device_page_ids].clone()


def tokens_for(prefix: int, num_pages: int, page_size: int = 4, tail: int = 1) -> list[int]:
    """A prompt of `num_pages` full pages (plus `tail` tokens) unique to `prefix`."""
    return [prefix * 1000 + i for i in range(num_pages * page_size + tail)]


def put(cache: HiCache, tokens: list[int], seed: int) -> torch.Tensor:
    """Run a 'request': allocate pages for its full pages, write KV, insert. Returns the KV."""
    num_pages = len(tokens) // cache.page_size
    ids = cache.alloc_device_pages(num_pages)
    values = fill_pages(cache, ids, seed)
    cache.insert(tokens, ids, NS)
    return values
