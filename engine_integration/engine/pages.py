"""Where a request's source KV pages come from: hicache, or a private pool (cache off).

`CachedPages` is the engine's whole conversation with hicache: `prefetch` when a request is
queued, `match` on admission (a locked prefix, loading layer by layer), `alloc` for new KV,
`wait_layer` before attending, and at the end `finish`: insert the full pages, free the
rest, release the match. An interleaved model's hit also needs a sidecar (engine/sidecar.py):
`serve_window` fills the request's ring from the deepest whole one at or below the match,
shortening the match to it, and `finish` stores the sidecars the request took.
`PrivatePages` has the same face over a `tiers.DevicePool` the engine owns alone: no prefix
is ever shared, nothing outlives a request.
"""

from __future__ import annotations

from typing import Protocol

import torch

from engine_integration.engine import sidecar
from engine_integration.engine.model.window import LateWindow
from hicache.controller import HiCache, Match
from hicache.errors import BackgroundTransferError
from radix.keys import TOKEN_BYTES, Namespace, encode_tokens
from tiers.allocator import PageAllocator
from tiers.device_pool import DevicePool
from tiers.errors import PoolExhaustedError
from tiers.layout import KVLayout


class PageSource(Protocol):
    page_size: int
    l3_ask_again_s: float  # how long a request's L3 lookup stands (`L3Config.ask_again_s`)
    shape: sidecar.SidecarShape | None  # an interleaved model's sidecars (None: none)

    def layer(self, i: int) -> torch.Tensor: ...

    # tokens: ids, or bytes in radix.keys.encode_tokens' encoding (a request's, encoded once)
    def prefetch(self, tokens: list[int] | bytes) -> None: ...

    # ask_l3=False: past the index, L3's answer to this request's recent lookup stands
    def match(self, tokens: list[int] | bytes, *, ask_l3: bool = True) -> Match | None: ...

    def alloc(self, num_pages: int) -> list[int]: ...

    def wait_layer(self, match: Match, layer: int) -> None: ...

    def serve_window(
        self, tokens: bytes, match: Match, window: LateWindow
    ) -> tuple[Match | None, bool]: ...

    def finish(
        self,
        tokens: list[int],
        page_ids: list[int],
        match: Match | None,
        sidecars: dict[int, torch.Tensor | None] | None = None,
    ) -> None: ...

    def abandon(self, own_page_ids: list[int], match: Match | None) -> None: ...


class CachedPages:
    """Pages through a HiCache, under `namespace` (model id + KV layout)."""

    def __init__(
        self, cache: HiCache, namespace: Namespace, shape: sidecar.SidecarShape | None = None
    ) -> None:
        self.cache = cache
        self.namespace = namespace
        self.page_size = cache.page_size
        self.l3_ask_again_s = cache.config.l3.ask_again_s
        self.shape = shape  # an interleaved model's sidecars (None: none)

    def layer(self, i: int) -> torch.Tensor:
        return self.cache.device_pool.layer(i)

    def prefetch(self, tokens: list[int]) -> None:
        self.cache.prefetch(tokens, self.namespace)

    def match(self, tokens: list[int], *, ask_l3: bool = True) -> Match:
        return self.cache.match(tokens, self.namespace, ask_l3=ask_l3)

    def alloc(self, num_pages: int) -> list[int]:
        return self.cache.alloc_device_pages(num_pages)

    def wait_layer(self, match: Match, layer: int) -> None:
        self.cache.wait_layer(match, layer)

    def serve_window(
        self, tokens: bytes, match: Match, window: LateWindow
    ) -> tuple[Match | None, bool]:
        """The part of `match` (of `tokens`, encoded) whose windowed KV a sidecar supplies,
        with `window` filled from it: the match itself where its own boundary's sidecar is
        whole, else shortened (`HiCache.shorten`) to the deepest boundary below it whose
        sidecar the index holds and is whole, else None (released); and whether that
        sidecar is a whole one (not a delta: a later delta may build on it)."""
        if self.shape is None:
            return match, False
        depth = match.num_tokens
        below = self.cache.branch_depths(
            tokens[: depth * TOKEN_BYTES], self.namespace, self.shape.tag_pages()
        )
        candidates = [depth] + [p * self.page_size for p in reversed(below)]
        for boundary in dict.fromkeys(b for b in candidates if 0 < b <= depth):
            window.clear()
            runs = self._load_sidecar(tokens, boundary, window)
            if runs:
                served = match if boundary == depth else self.cache.shorten(match, boundary)
                return served, runs == 1
        window.clear()
        return self.cache.shorten(match, 0), False

    def _load_sidecar(self, tokens: bytes, boundary: int, window: LateWindow) -> int:
        """Write the sidecar of `boundary` into `window` if the cache holds all of it: a
        whole one, or a delta of k pages and the whole sidecar k pages up
        (`SidecarShape.whole_runs`). Returns the runs read (1 or 2), 0 if it is not all
        there."""
        return self.shape.whole_runs(
            boundary, lambda at, delta_pages: self._load_run(tokens, at, delta_pages, window)
        )

    def _load_run(self, tokens: bytes, boundary: int, delta_pages: int, window) -> bool:
        """Write one sidecar run (whole, or a delta) into `window` if the cache has it all."""
        shape = self.shape
        path = shape.tokens(tokens, boundary, delta_pages)
        found = self.cache.match(path, self.namespace, record=False, whole=True)
        try:
            num_pages = shape.num_pages(boundary, delta_pages)
            if found.num_tokens != boundary + num_pages * self.page_size:
                return False
            try:
                for layer in range(shape.num_page_layers):
                    self.cache.wait_layer(found, layer)
            except BackgroundTransferError:  # its load failed: the pages hold wrong KV
                return False
            ids = found.device_page_ids[-num_pages:]
            sidecar.unpack(shape, boundary, delta_pages, self.layer, ids, window)
            return True
        finally:
            self.cache.release(found)

    def finish(
        self,
        tokens: list[int],
        page_ids: list[int],
        match: Match | None,
        sidecars: dict[int, torch.Tensor | None] | None = None,
    ) -> None:
        """Insert the full pages of `tokens` (page i in page_ids[i]); free the rest; store
        `sidecars` (boundary -> `sidecar.snapshot`) below their boundaries."""
        num_full = len(tokens) // self.page_size
        try:
            if num_full:
                self.cache.insert(
                    tokens[: num_full * self.page_size], page_ids[:num_full], self.namespace
                )
            if len(page_ids) > num_full:
                self.cache.free_device_pages(page_ids[num_full:])
            if sidecars:
                self._store_sidecars(encode_tokens(tokens), sidecars)
        finally:
            if match is not None:
                self.cache.release(match)

    def _store_sidecars(self, tokens: bytes, sidecars: dict[int, torch.Tensor | None]) -> None:
        """Index each sidecar (boundary -> `sidecar.snapshot`; None: a whole one the cache
        holds already), shallowest first; one closer than a span below the last whole one
        is stored as a delta over it (so a delta's base is always whole)."""
        span = self.shape.span_pages * self.page_size
        whole = None
        for boundary, kv in sorted(sidecars.items()):
            if kv is None:
                whole = boundary
                continue
            delta_pages = 0
            if whole is not None and boundary - whole < span:
                delta_pages = (boundary - whole) // self.page_size
                kv = kv[:, kv.shape[1] - delta_pages * self.page_size :]
            if self._store_sidecar(tokens, boundary, delta_pages, kv) and not delta_pages:
                whole = boundary

    def _store_sidecar(
        self, tokens: bytes, boundary: int, delta_pages: int, kv: torch.Tensor
    ) -> bool:
        """Index the sidecar `kv` of `boundary` (whole, or a delta) below the cached prefix
        `tokens[:boundary]`; False (nothing stored) when no L1 pages are free or that prefix
        left L1 meanwhile."""
        shape = self.shape
        try:
            ids = self.cache.alloc_device_pages(shape.num_pages(boundary, delta_pages))
        except PoolExhaustedError:
            return False
        num_prefix = boundary // self.page_size
        held = self.cache.held_device_pages(tokens[: boundary * TOKEN_BYTES], self.namespace)
        if len(held) < num_prefix:
            self.cache.free_device_pages(ids)
            return False
        sidecar.pack(shape, kv, self.layer, ids)
        path = shape.tokens(tokens, boundary, delta_pages)
        self.cache.insert(path, held[:num_prefix] + ids, self.namespace)
        return True

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
        self.l3_ask_again_s = 0.0  # (no L3)
        self.shape = None  # nothing outlives a request: no sidecars

    def layer(self, i: int) -> torch.Tensor:
        return self.pool.layer(i)

    def prefetch(self, tokens: list[int]) -> None:
        pass

    def match(self, tokens: list[int], *, ask_l3: bool = True) -> None:
        return None

    def alloc(self, num_pages: int) -> list[int]:
        return self.allocator.alloc(num_pages)

    def wait_layer(self, match: Match, layer: int) -> None:
        pass

    def serve_window(
        self, tokens: bytes, match: Match, window: LateWindow
    ) -> tuple[Match | None, bool]:
        return match, False

    def finish(
        self,
        tokens: list[int],
        page_ids: list[int],
        match: Match | None,
        sidecars: dict[int, torch.Tensor | None] | None = None,
    ) -> None:
        self.allocator.free(page_ids)

    def abandon(self, own_page_ids: list[int], match: Match | None) -> None:
        self.allocator.free(own_page_ids)
