"""Sliding-window attention over a request's window ring (window.py), the late layers' and
the windowed source layers', and of rows whose ring holds no key they see
(`fresh_window_attention`). The SDPA call is `attention.sdpa`, shared with the source layers.

Late layers, in batch-invariant mode, block by block over the window: for queries in block
k, keys at positions [k * B - W, k * B + B), read from the ring plus the block's own new
keys; a query at t sees the keys in (t - W, t] that exist.
"""

from __future__ import annotations

import functools

import torch

from engine_integration.engine.model.attention import sdpa
from engine_integration.engine.model.window import LateWindow


def window_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    start: int,
    window: LateWindow,
    layer: int,
    *,
    scale: float,
    block_rows: int | None,
) -> torch.Tensor:
    """Sliding-window attention of queries q (n, Hq, D) at positions [start, start + n),
    whose own new KV is kv (n, 2, H, D), over the window ring of `layer`; writes the new KV
    into the ring. -> (n, Hq, D)."""
    n = q.shape[0]
    end = start + n
    width = window.window_tokens
    if block_rows is None:
        if window.holds_from(layer, start - width + 1):
            mask, keys = _window_keys(kv, start, start, end, window, layer, start - width)
        else:  # the ring holds no key these queries see (a prefill's first late rows)
            mask, keys = _sliding_bias(n, width, q.dtype, q.device), kv
        out = sdpa(q, keys, mask, scale)
        window.write(layer, start, kv)
        return out
    rows = block_rows

    def attend_block(block: int, q_block: torch.Tensor) -> torch.Tensor:
        lo, hi = max(start, block * rows), min(end, (block + 1) * rows)
        new_kv = kv[lo - start : hi - start]
        mask, keys = _window_keys(
            new_kv, lo, block * rows, (block + 1) * rows, window, layer, block * rows - width
        )
        out = _attend(
            q_block,
            keys[:, 0].permute(1, 2, 0).contiguous(),
            keys[:, 1].transpose(0, 1).contiguous(),
            ~mask,
            scale,
        )
        window.write(layer, lo, new_kv)
        return out

    return _blockwise(q, start, rows, attend_block)


def _blockwise(q: torch.Tensor, start: int, rows: int, attend_block) -> torch.Tensor:
    """Queries q (n, Hq, D) at positions [start, start + n), zero-padded into the blocks of
    `rows` positions they fall in; `attend_block(block, q_block)` answers each block, in
    order. Returns the real rows."""
    n = q.shape[0]
    first, last = start // rows, (start + n - 1) // rows
    offset = start - first * rows
    padded = q.new_zeros(((last - first + 1) * rows, *q.shape[1:]))
    padded[offset : offset + n] = q
    out = torch.empty_like(padded)
    for number, block in enumerate(range(first, last + 1)):
        part = slice(number * rows, (number + 1) * rows)
        out[part] = attend_block(block, padded[part])
    return out[offset : offset + n]


def fresh_window_attention(q: torch.Tensor, kv: torch.Tensor, width: int, *, scale: float):
    """`window_attention` of rows whose ring holds no key they see (a prefill's first late
    rows): queries q (n, Hq, D) over their own keys kv (n, 2, H, D), each seeing the keys
    of the last `width` positions up to its own; dense batches only. The mask is built here,
    not cached: inside a CUDA graph it is part of the graph, so nothing outside it must stay
    alive for the replays. -> (n, Hq, D)."""
    return sdpa(q, kv, _sliding_bias_of(q.shape[0], width, q.dtype, q.device), scale)


@functools.lru_cache(maxsize=8)
def _sliding_bias(n: int, width: int, dtype: torch.dtype, device) -> torch.Tensor:
    """`_sliding_bias_of`, built once per shape and reused by every late layer and step."""
    return _sliding_bias_of(n, width, dtype, device)


def _sliding_bias_of(n: int, width: int, dtype: torch.dtype, device) -> torch.Tensor:
    """The additive mask of n consecutive queries over their own n keys, each seeing the
    keys in (t - width, t]. Its rows are padded to a multiple of 16 keys (the
    memory-efficient kernel's alignment: it would pad a copy on every call otherwise)."""
    query = torch.arange(n, device=device)[:, None]
    key = torch.arange(n, device=device)[None, :]
    hidden = (key > query) | (key <= query - width)
    bias = torch.zeros(n, -(-n // 16) * 16, dtype=dtype, device=device)
    return bias[:, :n].masked_fill_(hidden, float("-inf"))


def _window_keys(new_kv, new_start, q_start, q_end, window, layer, key_start):
    """Queries at positions [q_start, q_end) over keys [key_start, q_end): the ring's,
    with the new KV (positions new_start ...) laid over them."""
    width = window.window_tokens
    keys, valid = window.read(layer, key_start, q_end)
    new_offset = new_start - key_start
    keys[new_offset : new_offset + new_kv.shape[0]] = new_kv
    valid[new_offset : new_offset + new_kv.shape[0]] = True
    device = keys.device
    query_positions = torch.arange(q_start, q_end, device=device)[:, None]
    key_positions = torch.arange(key_start, q_end, device=device)[None, :]
    in_window = (key_positions <= query_positions) & (key_positions > query_positions - width)
    # A query always sees itself: padding rows then never have an empty (NaN) softmax.
    mask = (in_window & valid[None, :]) | (key_positions == query_positions)
    return mask, keys


def _attend(q, keys, values, mask, scale, *, masked_from=0):
    """Plain attention with fixed shapes: q (m, Hq, D), keys (H, D, L), values (H, L, D);
    mask (m, L - masked_from) is True where a key is hidden from a query (keys before
    `masked_from` are seen by all) -> (m, Hq, D). Query heads are grouped onto their KV
    head (GQA) without copying keys."""
    m, num_heads, dim = q.shape
    num_kv_heads, length = keys.shape[0], keys.shape[2]
    group = num_heads // num_kv_heads
    grouped = (  # scaled here: q is smaller than the scores
        (q * scale)
        .view(m, num_kv_heads, group, dim)
        .permute(1, 2, 0, 3)
        .reshape(num_kv_heads, group * m, dim)
    )
    scores = torch.bmm(grouped, keys).view(num_kv_heads, group, m, length)
    scores[..., masked_from:].masked_fill_(mask, float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(values.dtype)
    out = torch.bmm(probs.view(num_kv_heads, group * m, length), values)
    return out.view(num_kv_heads, group, m, dim).permute(2, 0, 1, 3).reshape(m, num_heads, dim)
