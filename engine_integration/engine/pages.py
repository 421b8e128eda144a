"""Where a request's source KV pages come from: hicache, or a private pool (cache off).

`CachedPages` is the engine's whole conversation with hicache: `prefetch` when a request is
queued, `match` on admission (a locked prefix, loading layer by layer), `alloc` for new KV,
`wait_layer` before attending, and at the end `finish`: insert the full pages, free the
rest, release the match. `PrivatePages` has the same face over a `tiers.DevicePool` the
engine owns alone: no prefix is ever shared, nothing outlives a request.
"""

from __future__ import annotations

from typing import Protocol

import torch

from hicache.controller import HiCache, Match
from radix.keys import Namespace
from tiers.allocator import PageAllocator
from tiers.device_pool import DevicePool
from tiers.layout import KVLayout


class PageSource(Protocol):
    page_size: int

    def layer(self, i: int) -> torch.Tensor: ...

    # tokens: ids, or bytes in radix.keys.encode_tokens' encoding (a request's, encoded once)
    def prefetch(self, tokens: list[int] | bytes) -> None: ...

    def match(self, tokens: list[int] | bytes) -> Match | None: ...

    def alloc(self, num_pages: int) -> list[int]: ...

    def wait_layer(self, match: Match, layer: int) -> None: ...

    def finish(self, tokens: list[int], page_ids: list[int], match: Match | None) -> None: ...

    def abandon(self, own_page_ids: list[int], match: Match | None) -> None: ...


class CachedPages:
    """Pages through a HiCache, under `namespace` (model id + KV layout)."""

    def __init__(self, cache: HiCache, namespace: Namespace) -> None:
        self.cache = cache
        self.namespace = namespace
        self.page_size = cache.page_size

    def layer(self, i: int) -> torch.Tensor:
        return self.cache.device_pool.layer(i)

    def prefetch(self, tokens: list[int]) -> None:
        self.cache.prefetch(tokens, self.namespace)

    def match(self, tokens: list[int]) -> Match:
        return self.cache.match(tokens, self.namespace)

    def alloc(self, num_pages: int) -> list[int]:
        return self.cache.alloc_device_pages(num_pages)

    def wait_layer(self, match: Match, layer: int) -> None:
        self.cache.wait_layer(match, layer)

    def finish(self, tokens: list[int], page_ids: list[int], match: Match | None) -> None:
        """Insert the full pages of `tokens` (page i in page_ids[i]); free the rest."""
        num_full = len(tokens) // self.page_size
        try:
            if num_full:
                self.cache.insert(
                    tokens[: num_full * self.page_size], page_ids[:num_full], self.namespace
                )
            if len(page_ids) > num_full:
                self.cache.free_device_pages(page_ids[num_full:])
        finally:
            if match is not None:
                self.cache.release(match)

    def abandon(self, own_page_ids: list[int], match: Match | None) -> None:
        """Give back a request's own pages unused (an abort) and release its match."""
        try:
            if own_page_ids:
                self.cache.free_device_pages(own_page_ids)
        finally:
            if match is not None:
                self.cache.release(match)


class PrivatePages:
    """A pool of `num_pages` pages of `layout` on `device` that only this engine uses, with
    its one allocator (the pool itself is memory only)."""

    def __init__(self, layout: KVLayout, num_pages: int, device) -> None:
        self.pool = DevicePool(layout, num_pages, device)
        self.allocator = PageAllocator(num_pages, name="private L1")
        self.page_size = layout.page_size

    def layer(self, i: int) -> torch.Tensor:
        return self.pool.layer(i)

    def prefetch(self, tokens: list[int]) -> None:
        pass

    def match(self, tokens: list[int]) -> None:
        return None

    def alloc(self, num_pages: int) -> list[int]:
        return self.allocator.alloc(num_pages)

    def wait_layer(self, match: Match, layer: int) -> None:
        pass

    def finish(self, tokens: list[int], page_ids: list[int], match: Match | None) -> None:
        self.allocator.free(page_ids)

    def abandon(self, own_page_ids: list[int], match: Match | None) -> None:
        self.allocator.free(own_page_ids)
