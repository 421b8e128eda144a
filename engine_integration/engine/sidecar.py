"""Sidecars: an interleaved model's windowed layers' KV, kept by the cache only where a hit
needs it (docs/architecture.md, "Interleaved sliding-window layers").

A hit at page boundary b needs, of a windowed layer (window W), only the KV of positions
[b - W + 1, b); the positions from b on are the request's own. Pages hold the full layers'
KV alone, so the windowed layers' part a hit needs is a *sidecar* of b: their KV of the last
`span_pages` = ceil((W - 1) / page_size) pages before b (fewer near the start), packed into
pages of the cache's own layout, one (layer, page) piece of page_size positions per page
layer, in order (piece u = page p * num_windowed_layers + layer j goes to sidecar page
u // num_page_layers, page layer u % num_page_layers).

In the index a sidecar is a run of `num_pages(b)` pages below b's page whose tokens are
`TAG_TOKEN`s, an id no vocabulary the engine takes reaches (the engine refuses prompt ids
>= vocab_size). Its keys chain on from b's page key under the request's namespace, so it is
stored, moved through L1/L2/L3, evicted, written to L3 and verified (checksum, namespace,
MAC where set) as any page: a missing, evicted or damaged sidecar page is a miss, and the
hit shortens to the deepest boundary whose sidecar is whole (`HiCache.shorten`).

The engine writes a sidecar where a later request can hit: at the end of each finished
sequence (its last full page, from the request's ring), at its prompt's lookup end, and at
the depth the index held past the hit it was served (the ring is copied when the prefill
reaches those boundaries: `snapshot`). Where two of one request's boundaries are closer
than a sidecar's span, the deeper one is a *delta*: only its windowed KV past the shallower
one (k pages, tag `TAG_TOKEN - k`), whole together with the sidecar k pages up its path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine_integration.engine.model.config import ModelConfig
from engine_integration.engine.model.window import LateWindow
from radix.keys import TOKEN_BYTES

TAG_TOKEN = 0xFFFF_FFFF  # a whole sidecar's; TAG_TOKEN - k: a delta of k pages


@dataclass(frozen=True)
class SidecarShape:
    """How the sidecars of one model and page size are laid out."""

    page_size: int
    num_windowed_layers: int
    num_page_layers: int
    span_pages: int  # pages of windowed KV a sidecar holds (fewer near the start)

    @classmethod
    def of(cls, config: ModelConfig, page_size: int) -> SidecarShape | None:
        """None for a model without windowed source layers."""
        if not config.windowed_layers:
            return None
        return cls(
            page_size=page_size,
            num_windowed_layers=len(config.windowed_layers),
            num_page_layers=config.num_page_layers,
            span_pages=-(-(config.window_tokens - 1) // page_size),
        )

    @property
    def ring_slots(self) -> int:
        """Ring slots a request needs so that a sidecar of its last full page can still be
        read off the ring (one page more than a sidecar's span)."""
        return (self.span_pages + 1) * self.page_size

    def tag_page(self, delta_pages: int = 0) -> list[int]:
        """The first page of a sidecar's run in the index: a whole sidecar's, or a delta's of
        `delta_pages` pages."""
        return [TAG_TOKEN - delta_pages] * self.page_size

    def tag_pages(self) -> list[list[int]]:
        """The first page of every kind of sidecar run (whole, then each delta)."""
        return [self.tag_page(k) for k in range(self.span_pages)]

    def pages_before(self, boundary: int) -> int:
        """Pages of windowed KV the whole sidecar of `boundary` holds."""
        return min(self.span_pages, boundary // self.page_size)

    def window_pages(self, boundary: int, delta_pages: int = 0) -> int:
        """Pages of windowed KV the sidecar of `boundary` holds: whole, or a delta's."""
        return delta_pages or self.pages_before(boundary)

    def num_pages(self, boundary: int, delta_pages: int = 0) -> int:
        """Cache pages the sidecar of `boundary` takes (whole, or a delta)."""
        pieces = self.num_windowed_layers * self.window_pages(boundary, delta_pages)
        return -(-pieces // self.num_page_layers)

    def tokens(self, tokens: bytes, boundary: int, delta_pages: int = 0) -> bytes:
        """The index tokens of the sidecar of `boundary` of `tokens` (encoded): the prefix,
        then the tag pages (a whole sidecar's, or a delta's)."""
        tag = (TAG_TOKEN - delta_pages).to_bytes(TOKEN_BYTES, "little")
        num_tokens = self.num_pages(boundary, delta_pages) * self.page_size
        return tokens[: boundary * TOKEN_BYTES] + tag * num_tokens


def snapshot(shape: SidecarShape, window: LateWindow, boundary: int) -> torch.Tensor | None:
    """The windowed layers' KV of the sidecar of `boundary`, read off the request's ring:
    (layers, positions, 2, H, D); None if the ring no longer holds all of them."""
    start = boundary - shape.pages_before(boundary) * shape.page_size
    parts = []
    for layer in range(shape.num_windowed_layers):
        kv, valid = window.read(layer, start, boundary)
        if not bool(valid.all()):
            return None
        parts.append(kv)
    return torch.stack(parts)


def pack(shape: SidecarShape, kv: torch.Tensor, page_layer, page_ids: list[int]) -> None:
    """Write a `snapshot` into the cache pages `page_ids` (`page_layer(i)`: page layer i of
    the L1 pool, (pages, page_size, 2, H, D)); unused pieces of the last page are zeros."""
    size = shape.page_size
    pieces = kv.shape[1] // size
    for u in range(pieces * shape.num_windowed_layers):
        page, layer = divmod(u, shape.num_windowed_layers)
        target = page_layer(u % shape.num_page_layers)[page_ids[u // shape.num_page_layers]]
        target.copy_(kv[layer, page * size : (page + 1) * size])
    for u in range(pieces * shape.num_windowed_layers, len(page_ids) * shape.num_page_layers):
        page_layer(u % shape.num_page_layers)[page_ids[u // shape.num_page_layers]].zero_()


def unpack(
    shape: SidecarShape,
    boundary: int,
    delta_pages: int,
    page_layer,
    page_ids: list[int],
    window: LateWindow,
) -> None:
    """Write the sidecar of `boundary` (whole, or a delta) held in `page_ids` into the
    request's ring."""
    size = shape.page_size
    pieces = shape.window_pages(boundary, delta_pages)
    start = boundary - pieces * size
    for u in range(pieces * shape.num_windowed_layers):
        page, layer = divmod(u, shape.num_windowed_layers)
        source = page_layer(u % shape.num_page_layers)[page_ids[u // shape.num_page_layers]]
        window.write(layer, start + page * size, source)
