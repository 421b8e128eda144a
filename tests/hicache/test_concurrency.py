"""Many threads using one cache while evictions and transfers run."""

from __future__ import annotations

import random
import threading

import torch

from tests.support.caches import NS, tokens_for
from tiers.errors import PoolExhaustedError


def page_value(tokens: list[int], page: int, page_size: int) -> float:
    """The KV every page of a prompt is filled with: a function of the page's prefix."""
    return float(sum(tokens[: (page + 1) * page_size]) % 9973)


def test_threads_never_see_a_page_freed_under_them(cache_factory, tmp_path):
    cache = cache_factory(
        l1_pages=48,
        l2_pages=64,
        l3_url=f"file://{tmp_path}?capacity=1GiB",
        write_policy="write_through",
        prefetch_policy="wait_complete",
    )
    size = cache.page_size
    prompts = [tokens_for(p % 6, 2 + p % 5, tail=0) + [p] * size for p in range(24)]
    errors: list[str] = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(60):
            tokens = rng.choice(prompts)
            num_pages = len(tokens) // size
            match = cache.match(tokens, NS)
            for layer in range(cache.layout.num_layers):
                cache.wait_layer(match, layer)
            kv = cache.device_pool.kv
            for page, page_id in enumerate(match.device_page_ids):
                expected = page_value(tokens, page, size)
                if not bool((kv[:, page_id] == expected).all()):
                    errors.append(f"page {page} of a prompt changed while locked")
            try:
                new_ids = cache.alloc_device_pages(num_pages - match.num_pages)
            except PoolExhaustedError:
                cache.release(match)
                continue
            for offset, page_id in enumerate(new_ids):
                kv[:, page_id] = page_value(tokens, match.num_pages + offset, size)
            cache.insert(tokens, match.device_page_ids + new_ids, NS)
            cache.release(match)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads)
    assert not errors, errors[:3]
    cache.flush()
    cache.check_invariants()
    stats = cache.stats()
    assert stats.requests == 8 * 60
    assert stats.evicted_pages["l1"] > 0  # the pools were small enough to churn
    assert sum(stats.hit_pages.values()) > 0
    assert torch.is_tensor(cache.device_pool.kv)
