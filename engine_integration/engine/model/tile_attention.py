"""The batch-invariant source attention in tiles fixed by position: on the CPU nested tiles
merged by log-sum-exp (`nested_tile_attention`, and the check that the CPU's flash kernel
keeps a row's bits across calls), elsewhere one masked call per tile (`tiled_attention`).
`attention.source_attention` pads the queries and lays out the keys for them.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

TILE_BLOCKS = 8  # blocks per tile of the batch-invariant source attention
# The CPU's nested tiles, coarse to fine, in blocks (1,024, 256 and 128 positions with
# 16-row blocks): see `nested_tile_attention`.
TILE_LEVEL_BLOCKS = (64, 16, TILE_BLOCKS)
# Queries are padded to runs of this many rows at positions that are multiples of it: the
# smallest row count whose gemm gives a row its bits in any larger call (rows.py), so that a
# decode step attends with 4 rows, not a whole block.
QUERY_ROWS = 4


def tile_levels(block_rows: int) -> tuple[int, ...]:
    """The nested query tiles of the CPU's source attention, in positions, coarse to fine:
    each a multiple of the next, the finest (TILE_BLOCKS blocks) the masked one."""
    return tuple(blocks * block_rows for blocks in TILE_LEVEL_BLOCKS)


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
