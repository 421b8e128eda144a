"""Attention over paged source KV (hicache's L1 pages), and the SDPA and flash calls it
shares with the late layers' window (`window_attention.py`).

Source layers: a request's KV pages are gathered into one contiguous tensor and attended
with a causal mask. In batch-invariant mode queries are padded to runs of 4 rows aligned to
absolute positions, and every call a query takes part in has a key range fixed by its
position alone, whether it is part of a cold prefill, of an encoder replay after a hit, or
a decode step: the other rows of the call only change the gemm's row count, which leaves a
row's bits alone (rows.py), and keys past what has been written are zeros and masked out
(a masked key adds exactly zero). On the CPU the keys [0, p] of a query at p are split at
nested tiles (1,024, 256 and 128 positions with 16-row blocks) and each part is one flash
call shared by every query that sees it, merged by log-sum-exp (`nested_tile_attention`);
elsewhere the queries of each 128-position tile attend over exactly the keys up to the
tile's end in one masked call (`tiled_attention`); both in `tile_attention.py`. Otherwise
one call per request goes through torch's scaled_dot_product_attention (flash or
memory-efficient kernels on CUDA).
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn.functional as F
from torch.backends.cuda import SDPAParams
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import CausalBias, causal_lower_right

from engine_integration.engine.model.tile_attention import (
    QUERY_ROWS,
    TILE_BLOCKS,
    nested_tile_attention,
    tile_levels,
    tiled_attention,
)

# scaled_dot_product_attention(enable_gqa=...) exists from torch 2.5.
_SDPA_GROUPS = tuple(int(part) for part in torch.__version__.split(".")[:2]) >= (2, 5)
# On CUDA, every backend but cuDNN's: given a boolean mask (a late layer's window) SDPA picks
# cuDNN, which builds an execution plan for each new pair of lengths on its first call, and
# every request brings new lengths. On the H200: 50-1,100 ms for a shape's first call
# against 0.3 ms after; the memory-efficient kernel takes 0.6 ms from the first call on.
_CUDA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
# The flash kernel itself (what SDPA calls for a causal bias), called directly from torch 2.5
# on (where it maps query heads onto KV heads and its check takes `enable_gqa`).
_FLASH_OP = (
    getattr(torch.ops.aten, "_scaled_dot_product_flash_attention", None) if _SDPA_GROUPS else None
)


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
    request's paged KV: `slots` are the pool slots of positions [0, start + n), of which
    [0, num_written) are written. -> (n, Hq, D)."""
    n = q.shape[0]
    end = start + n
    if block_rows is None:
        kv = gather_kv(flat_kv, slots, num_written)
        if _flash_takes(q, kv):
            return _flash_lower_right(q, kv, scale)
        return sdpa(q, kv, causal_lower_right(n, end), scale)
    first = start // QUERY_ROWS * QUERY_ROWS
    padded = q  # queries at [first, first + m), m a multiple of QUERY_ROWS
    if start != first or end % QUERY_ROWS:
        padded = q.new_zeros((-(-end // QUERY_ROWS) * QUERY_ROWS - first, *q.shape[1:]))
        padded[start - first : end - first] = q
    num_positions = first + padded.shape[0]
    if q.device.type == "cpu":
        tiles = tile_levels(block_rows)
        keys, values = _kv_head_keys(flat_kv, slots[:num_written], num_positions, tiles[-1])
        out = nested_tile_attention(padded, first, keys, values, scale, tiles=tiles)
    else:
        tile = TILE_BLOCKS * block_rows
        keys, values = _key_tiles(flat_kv, slots[:num_written], num_positions, tile, q.shape[1])
        out = tiled_attention(padded, first, keys, values, scale, tile=tile)
    return out[start - first : end - first]


def _kv_head_keys(flat_kv, slots, num_positions, tile):
    """Keys and values (H, L, D) of positions [0, len(slots)), one per KV head, zero past
    them up to L = num_positions rounded up to whole tiles."""
    kv = flat_kv.index_select(0, slots)  # (written, 2, H, D)
    num_written = kv.shape[0]
    shape = (kv.shape[2], -(-num_positions // tile) * tile, kv.shape[3])
    keys, values = kv.new_empty(shape), kv.new_empty(shape)
    for part, tensor in enumerate((keys, values)):
        tensor[:, :num_written] = kv[:, part].transpose(0, 1)
        tensor[:, num_written:] = 0
    return keys, values


def _key_tiles(flat_kv, slots, num_positions, tile, num_heads):
    """Keys and values (Hq, L, D) of positions [0, len(slots)), one per query head, zero
    past them up to L = num_positions rounded up to whole tiles."""
    kv = flat_kv.index_select(0, slots)  # (written, 2, H, D)
    group = num_heads // kv.shape[2]
    shape = (num_heads, -(-num_positions // tile) * tile, kv.shape[3])
    keys, values = kv.new_zeros(shape), kv.new_zeros(shape)
    keys[:, : kv.shape[0]] = kv[:, 0].transpose(0, 1).repeat_interleave(group, dim=0)
    values[:, : kv.shape[0]] = kv[:, 1].transpose(0, 1).repeat_interleave(group, dim=0)
    return keys, values


@functools.cache
def _flash_ready(device: torch.device, dtype: torch.dtype, num_heads: int, kv_heads: int, dim: int):
    """Whether torch's flash kernel takes causal attention of this shape here (asked once,
    of torch's own check, on a small sample)."""
    q = torch.zeros(1, num_heads, 8, dim, dtype=dtype, device=device)
    kv = torch.zeros(1, kv_heads, 16, dim, dtype=dtype, device=device)
    params = SDPAParams(q, kv, kv, None, 0.0, False, num_heads != kv_heads)
    return bool(torch.backends.cuda.can_use_flash_attention(params, debug=False))


def _flash_takes(q: torch.Tensor, kv: torch.Tensor) -> bool:
    return (
        q.is_cuda
        and _FLASH_OP is not None
        and _flash_ready(q.device, q.dtype, q.shape[1], kv.shape[2], q.shape[2])
    )


def _flash_lower_right(q: torch.Tensor, kv: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of queries q (n, Hq, D), the last n positions, over kv (L, 2, H,
    D), straight through torch's flash kernel (whose causal mask is aligned to the last
    key, as `causal_lower_right` asks for): what SDPA given that bias runs, without the
    Python it goes through on the way, once per layer of every step."""
    out = _FLASH_OP(
        q.transpose(0, 1)[None],
        kv[:, 0].transpose(0, 1)[None],
        kv[:, 1].transpose(0, 1)[None],
        0.0,
        True,
        False,
        scale=scale,
    )[0]
    return out[0].transpose(0, 1)


def _per_query_head(x: torch.Tensor, group: int) -> torch.Tensor:
    """(H, L, D) -> (H * group, L, D), each KV head repeated for its query heads (by
    expand: `repeat_interleave` with a count reads its output size back from the device)."""
    heads, length, dim = x.shape
    return x[:, None].expand(heads, group, length, dim).reshape(heads * group, length, dim)


def sdpa(q, kv, mask, scale):
    """q (n, Hq, D) over kv (L, 2, H, D) through scaled_dot_product_attention."""
    num_heads = q.shape[1]
    group = num_heads // kv.shape[2]
    keys = kv[:, 0].transpose(0, 1)  # (H, L, D)
    values = kv[:, 1].transpose(0, 1)
    grouped = {}
    # CUDA's memory-efficient kernel, the one that takes a mask tensor (the late layers'
    # window), does not map query heads onto KV heads: given both it falls back to the math
    # kernel, which materialises every score. The window's few keys are copied per query
    # head then. (A causal bias goes to the flash kernel, which maps them itself.)
    masked_on_cuda = q.is_cuda and mask is not None and not isinstance(mask, CausalBias)
    if group > 1 and _SDPA_GROUPS and not masked_on_cuda:
        grouped = {"enable_gqa": True}  # the kernel maps query heads onto KV heads
    elif group > 1:  # a copy of every key and value per query head (also torch < 2.5)
        keys, values = _per_query_head(keys, group), _per_query_head(values, group)
    backends = sdpa_kernel(_CUDA_BACKENDS) if q.is_cuda else contextlib.nullcontext()
    with backends:
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None],
            keys[None],
            values[None],
            attn_mask=mask,
            scale=scale,
            **grouped,
        )
    return out[0].transpose(0, 1)
