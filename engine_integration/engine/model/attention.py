"""Attention over paged source KV (hicache's L1 pages) and over a late layer's window.

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
tile's end in one masked call (`tiled_attention`). Otherwise one call per request goes
through torch's scaled_dot_product_attention (flash or memory-efficient kernels on CUDA).

Late layers, in batch-invariant mode, block by block over the window: for queries in block
k, keys at positions [k * B - W, k * B + B), read from the ring plus the block's own new
keys; a query at t sees the keys in (t - W, t] that exist.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.backends.cuda import SDPAParams
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import CausalBias, causal_lower_right

from engine_integration.engine.model.window import LateWindow

logger = logging.getLogger(__name__)

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


TILE_BLOCKS = 8  # blocks per tile of the batch-invariant source attention
# The CPU's nested tiles, coarse to fine, in blocks (1,024, 256 and 128 positions with
# 16-row blocks): see `nested_tile_attention`.
TILE_LEVEL_BLOCKS = (64, 16, TILE_BLOCKS)
# Queries are padded to runs of this many rows at positions that are multiples of it: the
# smallest row count whose gemm gives a row its bits in any larger call (rows.py), so that a
# decode step attends with 4 rows, not a whole block.
QUERY_ROWS = 4


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
        return _sdpa(q, kv, causal_lower_right(n, end), scale)
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


def tile_levels(block_rows: int) -> tuple[int, ...]:
    """The nested query tiles of the CPU's source attention, in positions, coarse to fine:
    each a multiple of the next, the finest (TILE_BLOCKS blocks) the masked one."""
    return tuple(blocks * block_rows for blocks in TILE_LEVEL_BLOCKS)


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


def nested_tile_attention(
    q: torch.Tensor,
    first: int,
    keys: torch.Tensor,
    values: torch.Tensor,
    scale: float,
    *,
    tiles: tuple[int, ...],
) -> torch.Tensor:
    """Causal attention on the CPU of q (m, Hq, D) at positions [first, first + m), `first`
    and m multiples of QUERY_ROWS, over keys and values (H, L, D) per KV head, L whole
    tiles of `tiles[-1]`; `tiles` are nested tile sizes, coarse to fine, each a multiple of
    the next (and of QUERY_ROWS).

    A query at position p splits its keys [0, p] at the tile boundaries around it: for each
    tile size S (its parent P, the next coarser, or none), the keys from the start of p's
    P-tile to the start of its S-tile, which every query of that S-tile sees (no mask);
    then the keys of its own finest tile under the causal mask (each over a whole tile:
    keys past what is written are zeros, masked, and add exactly zero). The queries that
    share a part are one flash call (tiles whose parts have the same shape are one batched
    call, `_batches`), and the parts are merged by their log-sum-exp in a fixed order (the
    own tile first, then coarse to fine). So every call a query takes part in has a key
    range fixed by its position, whether it is part of a cold prefill, of a replay after a
    hit or a decode step; the other queries of a call only change the gemms' row counts,
    which leaves a row's bits alone (rows.py; `test_rows.py` checks this here, at the flash
    kernel's query splits too). Coarse tiles let most keys be seen by calls of many rows,
    where the kernel's query blocks are large, and few calls keep the threads from waiting
    on each other: SmolLM2's 4,096 positions took 300-350 ms a layer on one core of a
    loaded 2-core box, against 380-455 ms in 128-position tiles alone and 305-345 ms for
    transformers' one causal call (2 threads: 229 ms, against 365 and 211 ms).

    The query heads of a KV head are stacked as rows (position, then head: a position range
    is a row range), so the keys are never repeated per query head and a call has `group`
    times the rows. -> (m, Hq, D)."""
    m, num_heads, dim = q.shape
    num_kv_heads = keys.shape[0]
    group = num_heads // num_kv_heads
    end = first + m
    # (1, H, m * group, D): row r is position first + r // group, query head of its group r % group
    rows_q = q.view(m, num_kv_heads, group, dim).transpose(0, 1).reshape(1, num_kv_heads, -1, dim)
    keys, values = keys[None].contiguous(), values[None].contiguous()

    def attend(batch: _TileBatch, bias=None):
        rows = batch.row_view(rows_q, first, group)
        return _FLASH(
            rows, batch.key_view(keys), batch.key_view(values), attn_mask=bias, scale=scale
        )

    own = tiles[-1]
    out, top = torch.empty_like(rows_q), rows_q.new_empty(rows_q.shape[:3])
    for batch in _batches(first, end, own, lambda number: (number * own, own)):
        offset = batch.first - batch.first // own * own  # of the tile's queries in the tile
        bias = _causal_bias(offset, offset + batch.rows, 0, own, q.dtype, q.device, group)
        part, part_lse = attend(batch, bias)
        batch.row_view(out, first, group).copy_(part)
        batch.row_view(top, first, group).copy_(part_lse)
    total = None  # sum of the parts' weights relative to `top`, per row: None while 1
    parent = None
    for size in tiles:
        for batch in _batches(first, end, size, _keys_before(size, parent)):
            part, part_lse = attend(batch)
            if total is None:
                total = torch.ones_like(top)
            views = (batch.row_view(t, first, group) for t in (out, top, total))
            _merge(*views, part, part_lse)
        parent = size
    if total is not None:
        out.div_(total[..., None])
    return out[0].view(num_kv_heads, m, group, dim).transpose(0, 1).reshape(m, num_heads, dim)


_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


@functools.cache
def _tiles_row_invariant(num_heads, num_kv_heads, head_dim, tiles, dtype, threads) -> bool:
    generator = torch.Generator().manual_seed(num_heads * 131 + head_dim)
    length = tiles[0] + tiles[-2] if len(tiles) > 1 else 2 * tiles[0]
    q = torch.randn(length, num_heads, head_dim, generator=generator).to(dtype)
    keys = torch.randn(num_kv_heads, length, head_dim, generator=generator).to(dtype)
    values = torch.randn(num_kv_heads, length, head_dim, generator=generator).to(dtype)
    scale = head_dim**-0.5
    full = nested_tile_attention(q, 0, keys, values, scale, tiles=tiles)
    for start, end in ((length - 4, length), (tiles[0], length), (4, length - 8)):
        k, v = keys.clone(), values.clone()
        k[:, end:] = 0
        v[:, end:] = 0
        part = nested_tile_attention(q[start:end], start, k, v, scale, tiles=tiles)
        if not torch.equal(part, full[start:end]):
            return False
    return True


def check_tile_invariance(
    num_heads: int, num_kv_heads: int, head_dim: int, block_rows: int, dtype: torch.dtype
) -> bool:
    """Whether the CPU's nested tile attention gives a query the same bits whichever rows
    share its calls (the flash kernel cuts a call's queries into blocks by the call's row
    count), at the model's head shapes and the current thread count; once per shape. When
    it does not, hits equal cold prefills only to rounding: said once, loudly."""
    tiles = tile_levels(block_rows)
    threads = torch.get_num_threads()
    if _tiles_row_invariant(num_heads, num_kv_heads, head_dim, tiles, dtype, threads):
        return True
    logger.warning(
        "this CPU's attention kernel gives a query different bits in calls of different "
        "row counts (%d heads of %d, %d threads): cache hits will equal cold prefills only "
        "to rounding, not bit for bit",
        num_heads,
        head_dim,
        threads,
    )
    return False


@dataclass(frozen=True)
class _TileBatch:
    """`count` tiles of queries, `step` positions apart, each the `rows` positions from
    `first` (for the first tile), over `key_length` keys from `key_start` (`key_step`
    apart)."""

    first: int
    rows: int
    count: int
    step: int
    key_start: int
    key_length: int
    key_step: int

    def row_view(self, x: torch.Tensor, first: int, group: int) -> torch.Tensor:
        """The batch's rows of x (1, H, m * group, ...) (positions from `first`), as
        (count, H, rows * group, ...): a strided view, no copy."""
        row = x.stride(2)
        return torch.as_strided(
            x,
            (self.count, x.shape[1], self.rows * group, *x.shape[3:]),
            (self.step * group * row, x.stride(1), *x.stride()[2:]),
            x.storage_offset() + (self.first - first) * group * row,
        )

    def key_view(self, keys: torch.Tensor) -> torch.Tensor:
        """The batch's keys of keys (1, H, L, D), contiguous, as (count, H, key_length, D):
        a strided view, no copy."""
        dim = keys.shape[3]
        return torch.as_strided(
            keys,
            (self.count, keys.shape[1], self.key_length, dim),
            (self.key_step * dim, keys.stride(1), dim, 1),
            self.key_start * dim,
        )


def _keys_before(size: int, parent: int | None):
    """The keys every query of tile `number` (of `size` positions) sees from the start of
    its parent tile (from 0 for the coarsest): (start, length)."""

    def keys(number: int) -> tuple[int, int]:
        start = 0 if parent is None else number * size // parent * parent
        return start, number * size - start

    return keys


def _batches(first: int, end: int, size: int, keys_of) -> list[_TileBatch]:
    """The tiles of `size` positions that hold queries in [first, end), with their keys
    `keys_of(number)` = (start, length), empty ones left out: whole tiles with the same
    key count, evenly spaced, as one batch; a partial tile (the first or last) alone."""
    whole: dict[int, list[tuple[int, int]]] = {}
    batches = []
    for number in range(first // size, (end - 1) // size + 1):
        key_start, key_length = keys_of(number)
        if key_length == 0:
            continue
        lo, hi = max(first, number * size), min(end, (number + 1) * size)
        if hi - lo < size:
            batches.append(_TileBatch(lo, hi - lo, 1, size, key_start, key_length, 0))
        else:
            whole.setdefault(key_length, []).append((number, key_start))
    for key_length, members in whole.items():
        batches.extend(_evenly_spaced(members, size, key_length))
    return batches


def _evenly_spaced(members, size, key_length) -> list[_TileBatch]:
    """Whole tiles (number, key start) with `key_length` keys as batches of evenly spaced
    tiles and keys."""
    if len(members) == 1:
        ((number, key_start),) = members
        return [_TileBatch(number * size, size, 1, size, key_start, key_length, 0)]
    (number, key_start), (second, second_start) = members[0], members[1]
    tile_step, key_step = second - number, second_start - key_start
    spaced = all(
        later - number == i * tile_step and later_start - key_start == i * key_step
        for i, (later, later_start) in enumerate(members)
    )
    if not spaced:
        return [b for member in members for b in _evenly_spaced([member], size, key_length)]
    return [
        _TileBatch(number * size, size, len(members), tile_step * size, key_start, key_length,
                   key_step)
    ]  # fmt: skip


def _merge(out, top, total, part, part_lse) -> None:
    """Fold one more part (its output, normalised, and log-sum-exp) into the running
    output `out`, whose weights sum to `total` relative to the running maximum `top`; all
    three updated in place. Only exactly rounded operations and `exp`, whose bits do not
    depend on the tensor's length (`test_rows.py`)."""
    new_top = torch.maximum(top, part_lse)
    old_weight, part_weight = torch.exp(top - new_top), torch.exp(part_lse - new_top)
    out.mul_(old_weight[..., None]).add_(part * part_weight[..., None])
    total.mul_(old_weight).add_(part_weight)
    top.copy_(new_top)


def tiled_attention(
    q: torch.Tensor,
    first: int,
    keys: torch.Tensor,
    values: torch.Tensor,
    scale: float,
    *,
    tile: int,
) -> torch.Tensor:
    """Causal attention of q (m, Hq, D) at positions [first, first + m), `first` and m
    multiples of QUERY_ROWS (and `tile` one of them), over keys and values (Hq, L, D), L
    whole tiles of `tile`, off the CPU (the CPU takes `nested_tile_attention`).

    The queries of tile i (positions [i * tile, (i + 1) * tile)) attend over exactly the
    keys [0, (i + 1) * tile), the keys past each query masked, in one call of torch's
    scaled_dot_product_attention: a query's arithmetic depends on its position alone, not
    on which of its tile's rows share the call, how the prompt was split or how many keys
    exist past it (zeros, masked: they add exactly zero). -> (m, Hq, D)."""
    end = first + q.shape[0]
    heads_first = q.transpose(0, 1).contiguous()[None]  # (1, Hq, m, D): tiles are views
    parts = [
        _tile_masked(heads_first, keys, values, first, end, number, tile, scale)
        for number in range(first // tile, (end - 1) // tile + 1)
    ]
    return torch.cat(parts, dim=2)[0].transpose(0, 1)


def _tile_masked(heads_first, keys, values, first, end, number, tile, scale):
    """Tile `number`'s queries over keys [0, (number + 1) * tile) in one masked call."""
    lo, hi = max(first, number * tile), min(end, (number + 1) * tile)
    length = (number + 1) * tile
    return F.scaled_dot_product_attention(
        heads_first[:, :, lo - first : hi - first],
        keys[None, :, :length],
        values[None, :, :length],
        attn_mask=_causal_bias(lo, hi, 0, length, heads_first.dtype, heads_first.device),
        scale=scale,
    )


@functools.lru_cache(maxsize=64)
def _causal_bias(lo, hi, key_start, key_end, dtype, device, repeat=1) -> torch.Tensor:
    """The additive mask (hi - lo, key_end - key_start) of queries at positions [lo, hi) over
    keys [key_start, key_end): 0 where a key is seen, -inf past the query; each query's row
    `repeat` times (query heads stacked as rows). Cached: every layer of a step asks for
    the same ones."""
    positions = torch.arange(lo, hi, device=device).repeat_interleave(repeat)[:, None]
    hidden = torch.arange(key_start, key_end, device=device)[None, :] > positions
    return torch.zeros(hidden.shape, dtype=dtype, device=device).masked_fill_(hidden, float("-inf"))


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
        out = _sdpa(q, keys, mask, scale)
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
    return _sdpa(q, kv, _sliding_bias_of(q.shape[0], width, q.dtype, q.device), scale)


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


def _sdpa(q, kv, mask, scale):
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
