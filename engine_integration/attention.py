"""Attention over paged source KV (hicache's L1 pages) and over a late layer's window.

Source layers: a request's KV pages are gathered into one contiguous (length, 2, H, D)
tensor and attended with a causal mask. In batch-invariant mode (the CPU) queries go in
blocks of B rows aligned to absolute positions, and block k always attends over exactly the
keys [0, (k + 1) * B): the same shapes, so the same arithmetic, whether the block is part
of a cold prefill, of an encoder replay after a hit, or a decode step. Keys past what has
been written are zeros and masked out (a masked key adds exactly zero). Otherwise one call
per request goes through torch's scaled_dot_product_attention (flash or memory-efficient
kernels on CUDA).

Late layers: the same, over the window: for queries in block k, keys at positions
[k * B - W, k * B + B), read from the ring plus the block's own new keys; a query at t sees
the keys in (t - W, t] that exist.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from engine_integration.window import LateWindow

# scaled_dot_product_attention(enable_gqa=...) exists from torch 2.5.
_SDPA_GROUPS = tuple(int(part) for part in torch.__version__.split(".")[:2]) >= (2, 5)


def page_slots(page_table: torch.Tensor, page_size: int, length: int) -> torch.Tensor:
    """Flat pool slots (page * page_size + offset) of a request's positions [0, length)."""
    offsets = torch.arange(page_size, device=page_table.device)
    return (page_table[:, None] * page_size + offsets).view(-1)[:length]


def gather_kv(flat_kv: torch.Tensor, slots: torch.Tensor, num_written: int) -> torch.Tensor:
    """The KV at `slots` of a pool layer viewed as (pages * page_size, 2, H, D); rows at and
    past `num_written` are zeros (the pages there hold stale or uninitialised memory)."""
    kv = flat_kv.index_select(0, slots)
    if num_written < kv.shape[0]:
        kv[num_written:] = 0
    return kv


def write_kv(flat_kv: torch.Tensor, slots: torch.Tensor, kv: torch.Tensor) -> None:
    """Store kv[i] (2, H, D) into pool slot slots[i]."""
    flat_kv.index_copy_(0, slots, kv)


def attention_length(start: int, end: int, block_rows: int | None) -> int:
    """How many key positions `source_attention` reads for queries [start, end)."""
    if block_rows is None:
        return end
    return ((end - 1) // block_rows + 1) * block_rows


def source_attention(
    q: torch.Tensor,
    start: int,
    flat_kv: torch.Tensor,
    slots: torch.Tensor,
    num_written: int,
    *,
    scale: float,
    block_rows: int | None,
) -> torch.Tensor:
    """Causal attention of queries q (n, Hq, D) at positions [start, start + n) over a
    request's paged KV: `slots` are the pool slots of positions [0, attention_length(...)),
    of which [0, num_written) are written. -> (n, Hq, D)."""
    n = q.shape[0]
    end = start + n
    if block_rows is None:
        kv = gather_kv(flat_kv, slots, num_written)
        return _sdpa(q, kv, causal_lower_right(n, end), scale)
    rows = block_rows
    kv = gather_kv(flat_kv, slots, num_written)
    # (H, length, D), laid out once: a block reads its first keys as a view (the same
    # row-major matrices), not a copy per block, which cost O(length^2) bytes a layer.
    keys = kv[:, 0].transpose(0, 1).contiguous()
    values = kv[:, 1].transpose(0, 1).contiguous()

    def attend_block(block: int, q_block: torch.Tensor) -> torch.Tensor:
        length = (block + 1) * rows
        query_positions = torch.arange(block * rows, length, device=q.device)
        key_positions = torch.arange(length, device=q.device)
        mask = key_positions[None, :] <= query_positions[:, None]  # (B, length)
        return _attend(q_block, keys[:, :length], values[:, :length], mask, scale)

    return _blockwise(q, start, rows, attend_block)


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
        mask, keys = _window_keys(kv, start, start, end, window, layer, start - width)
        out = _sdpa(q, keys, mask, scale)
        window.write(layer, torch.arange(start, end, device=q.device), kv)
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
            keys[:, 0].transpose(0, 1).contiguous(),
            keys[:, 1].transpose(0, 1).contiguous(),
            mask,
            scale,
        )
        window.write(layer, torch.arange(lo, hi, device=q.device), new_kv)
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


def _attend(q, keys, values, mask, scale):
    """Plain attention with fixed shapes: q (m, Hq, D), keys/values (H, L, D), mask (m, L)
    -> (m, Hq, D). Query heads are grouped onto their KV head (GQA) without copying keys."""
    m, num_heads, dim = q.shape
    num_kv_heads, length = keys.shape[:2]
    group = num_heads // num_kv_heads
    grouped = (
        q.view(m, num_kv_heads, group, dim)
        .permute(1, 2, 0, 3)
        .reshape(num_kv_heads, group * m, dim)
    )
    scores = torch.bmm(grouped, keys.transpose(1, 2)).view(num_kv_heads, group, m, length)
    scores = (scores * scale).masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(values.dtype)
    out = torch.bmm(probs.view(num_kv_heads, group * m, length), values)
    return out.view(num_kv_heads, group, m, dim).permute(2, 0, 1, 3).reshape(m, num_heads, dim)


def _sdpa(q, kv, mask, scale):
    """q (n, Hq, D) over kv (L, 2, H, D) through scaled_dot_product_attention."""
    num_heads = q.shape[1]
    group = num_heads // kv.shape[2]
    keys = kv[:, 0].transpose(0, 1)  # (H, L, D)
    values = kv[:, 1].transpose(0, 1)
    grouped = {}
    if group > 1 and _SDPA_GROUPS:
        grouped = {"enable_gqa": True}  # the kernel maps query heads onto KV heads
    elif group > 1:  # torch < 2.5: a copy of every key and value per query head
        keys = keys.repeat_interleave(group, dim=0)
        values = values.repeat_interleave(group, dim=0)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], keys[None], values[None], attn_mask=mask, scale=scale, **grouped
    )
    return out[0].transpose(0, 1)
