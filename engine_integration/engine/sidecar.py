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

Their shape and keys, which the router reads too, are in `sidecar_shape.py` (no torch);
this module moves their KV.
"""

from __future__ import annotations

import torch

from engine_integration.engine.model.window import LateWindow
from engine_integration.engine.sidecar_shape import TAG_TOKEN, SidecarShape

__all__ = ["TAG_TOKEN", "SidecarShape", "pack", "snapshot", "unpack"]


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
