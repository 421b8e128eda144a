"""Causal attention of a few queries straight over a request's KV pages (CUDA's dense path).

A hit's step computes a few dozen rows over a long prefix: 64 queries over 32K keys, on the
1.1B model. Through torch's flash kernel that needs the prefix gathered from its pages into
one tensor first (an index_select of 64 MiB a layer, 36 us on the H200), and the kernel
then reads the keys once per query head: for 32 query heads over 8 KV heads, four times
(77 us a layer). Here the keys are read from the pool through the page table, and the query
heads of a KV head are rows of one tile, so a program reads each key once for all of them:

    split   program (query block, key split, KV head): the block's query heads and
            positions as rows (position, then head of the group), over the key tiles of
            its split below the block's last position (each key's page looked up in the
            table), online softmax (base 2); writes the split's normalised output and
            log-sum-exp
    combine program (query, head): the splits merged by their log-sum-exp

Keys past `end` (stale slots of the last page) and above a query's position are masked, and
stale slots are read as zeros (a masked key adds exactly nothing; stale bytes may be any
float, NaN included). Splits are as many as give each multiprocessor `Tuning.waves`
programs. Measured on the H200 (`Tuning`): 64 queries over 32K keys in 0.78 of the time of
gather + flash; the kernel is still bound by its loads' latency (~0.7 TB/s), not by HBM.

Runs on the GPU, and under TRITON_INTERPRET=1 on the CPU (the tests).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

# Steps of more queries than this a request go through the flash kernel: at 509 queries
# over 8K keys it was as fast (0.9-1.1x of this kernel's time, on the H200).
MAX_ROWS = 256


@dataclass
class Tuning:
    """Tile sizes and launch shape of the split kernel. Swept on the H200 (2 x 2 x 2 x 2 x 2
    settings; six shapes of the benchmark models, 1 to 509 queries over 1K to 32K keys): this
    one took 0.77 of gather + flash's time in geometric mean, 0.78 at 64 queries over 32K
    keys (the 1.1B model's hit), 0.59-0.87 elsewhere."""

    block_m: int = 128  # rows of a tile at most
    block_n: int = 64  # keys of a tile
    waves: int = 4  # programs: this many per multiprocessor
    warps: int = 4
    stages: int = 2


TUNING = Tuning()
_LOG2E = 1.4426950408889634


@triton.jit(do_not_specialize=["start", "end", "num_rows", "tiles_per_split"])
def _split_kernel(
    q_ptr,
    kv_ptr,
    table_ptr,
    part_ptr,
    lse_ptr,
    start,
    end,
    num_rows,
    tiles_per_split,
    scale_log2,
    NUM_HEADS: tl.constexpr,
    NUM_KV: tl.constexpr,
    GROUP: tl.constexpr,
    DIM: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    block = tl.program_id(0)
    split = tl.program_id(1)
    kv_head = tl.program_id(2)
    block_q: tl.constexpr = BLOCK_M // GROUP  # positions a block holds
    rows = tl.arange(0, BLOCK_M)
    query = block * block_q + rows // GROUP  # (BLOCK_M,) the row's query, of the step's
    head = kv_head * GROUP + rows % GROUP
    live = (rows < block_q * GROUP) & (query < num_rows)
    position = start + query
    dim = tl.arange(0, DIM)
    q_rows = (query.to(tl.int64) * NUM_HEADS + head) * DIM
    q = tl.load(q_ptr + q_rows[:, None] + dim[None, :], mask=live[:, None], other=0.0)

    # the split's key tiles (BLOCK_N keys, whole pages or parts of one) that hold a key at
    # or below the block's last position
    last = tl.minimum(block * block_q + block_q, num_rows) - 1 + start
    first_tile = split * tiles_per_split
    stop_tile = tl.minimum(first_tile + tiles_per_split, last // BLOCK_N + 1)
    key = tl.arange(0, BLOCK_N)
    slot_stride: tl.constexpr = 2 * NUM_KV * DIM
    top = tl.full([BLOCK_M], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DIM], tl.float32)
    for tile in range(first_tile, stop_tile):
        key_position = tile * BLOCK_N + key
        written = key_position < end  # (slots past `end` hold stale bytes)
        page_id = tl.load(table_ptr + key_position // PAGE, mask=written, other=0).to(tl.int64)
        slot = page_id * (PAGE * slot_stride) + (key_position % PAGE) * slot_stride
        base = kv_ptr + slot + kv_head * DIM  # (BLOCK_N,) where each key's K starts
        k = tl.load(base[None, :] + dim[:, None], mask=written[None, :], other=0.0)
        v = tl.load(base[:, None] + NUM_KV * DIM + dim[None, :], mask=written[:, None], other=0.0)
        scores = tl.dot(q, k) * scale_log2  # (BLOCK_M, BLOCK_N), base-2 logits
        seen = written[None, :] & (key_position[None, :] <= position[:, None])
        scores = tl.where(seen, scores, float("-inf"))
        new_top = tl.maximum(top, tl.max(scores, 1))
        shift = tl.where(new_top == float("-inf"), 0.0, new_top)  # a row that sees none yet
        weights = tl.exp2(scores - shift[:, None])
        rescale = tl.exp2(top - shift)
        total = total * rescale + tl.sum(weights, 1)
        acc = acc * rescale[:, None] + tl.dot(weights.to(v.dtype), v)
        top = new_top

    # the split's output (zeros where it saw no key) and log-sum-exp (-inf there)
    seen_any = total > 0
    out = acc / tl.where(seen_any, total, 1.0)[:, None]
    lse = tl.where(seen_any, top + tl.log2(tl.where(seen_any, total, 1.0)), float("-inf"))
    part_rows = (split * num_rows + query.to(tl.int64)) * NUM_HEADS + head
    tl.store(part_ptr + part_rows[:, None] * DIM + dim[None, :], out, mask=live[:, None])
    tl.store(lse_ptr + part_rows, lse, mask=live)


@triton.jit(do_not_specialize=["num_splits", "split_rows"])
def _combine_kernel(
    part_ptr, lse_ptr, out_ptr, num_splits, split_rows, DIM: tl.constexpr, SPLITS: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)  # (query, head)
    split = tl.arange(0, SPLITS)
    live = split < num_splits
    dim = tl.arange(0, DIM)
    lse = tl.load(lse_ptr + split * split_rows + row, mask=live, other=float("-inf"))
    top = tl.max(lse, 0)  # finite: every query sees at least its own key
    weights = tl.where(live, tl.exp2(lse - top), 0.0)
    parts = tl.load(
        part_ptr + (split[:, None] * split_rows + row) * DIM + dim[None, :],
        mask=live[:, None],
        other=0.0,
    )
    out = tl.sum(parts * weights[:, None], 0) / tl.sum(weights, 0)
    tl.store(out_ptr + row * DIM + dim, out.to(out_ptr.dtype.element_ty))


def takes(q: torch.Tensor, kv_layer: torch.Tensor) -> bool:
    """Whether `paged_attention` runs queries q (n, Hq, D) over pool layer kv_layer (pages,
    page_size, 2, H, D): few enough rows, a power-of-two D of at least 16 (a tile's), query
    heads in whole groups, a contiguous pool."""
    dim = kv_layer.shape[-1]
    return (
        q.shape[0] <= MAX_ROWS
        and dim >= 16
        and dim & (dim - 1) == 0
        and kv_layer.is_contiguous()
        and q.shape[1] % kv_layer.shape[3] == 0
    )


def paged_attention(
    q: torch.Tensor,
    start: int,
    kv_layer: torch.Tensor,
    page_table: torch.Tensor,
    *,
    scale: float,
) -> torch.Tensor:
    """Causal attention of queries q (n, Hq, D) at positions [start, start + n) over the
    keys [0, start + n) that `page_table` (the request's page ids, on the device) holds in
    pool layer kv_layer (pages, page_size, 2, H, D), the step's own K/V written there
    already. -> (n, Hq, D), q's dtype."""
    num_rows, num_heads, dim = q.shape
    page_size, num_kv = kv_layer.shape[1], kv_layer.shape[3]
    group = num_heads // num_kv
    end = start + num_rows
    q = q.contiguous()
    tuning = TUNING
    # rows of a tile: the step's (query, head) pairs of one KV head, 16 to BLOCK_M of them
    block_m = max(
        16,
        min(tuning.block_m, triton.next_power_of_2(num_rows * group)),
        triton.next_power_of_2(group),
    )
    block_n = min(tuning.block_n, max(16, triton.next_power_of_2(end)))
    num_blocks = -(-num_rows // (block_m // group))
    num_tiles = -(-end // block_n)
    wanted = -(-tuning.waves * _processors(q.device) // (num_kv * num_blocks))
    tiles_per_split = -(-num_tiles // max(1, min(wanted, num_tiles)))
    num_splits = -(-num_tiles // tiles_per_split)
    part = torch.empty((num_splits, num_rows, num_heads, dim), dtype=torch.float32, device=q.device)
    lse = torch.empty((num_splits, num_rows, num_heads), dtype=torch.float32, device=q.device)
    _split_kernel[(num_blocks, num_splits, num_kv)](
        q,
        kv_layer,
        page_table,
        part,
        lse,
        start,
        end,
        num_rows,
        tiles_per_split,
        scale * _LOG2E,
        NUM_HEADS=num_heads,
        NUM_KV=num_kv,
        GROUP=group,
        DIM=dim,
        PAGE=page_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        num_warps=tuning.warps,
        num_stages=tuning.stages,
    )
    out = torch.empty_like(q)
    _combine_kernel[(num_rows * num_heads,)](
        part,
        lse,
        out,
        num_splits,
        num_rows * num_heads,
        DIM=dim,
        SPLITS=triton.next_power_of_2(num_splits),
        num_warps=1,
    )
    return out


@functools.cache
def _processors_of(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: a few splits, as a GPU would have
    return torch.cuda.get_device_properties(device).multi_processor_count


def _processors(device: torch.device) -> int:
    return _processors_of(
        torch.device(device.type, device.index or 0) if device.type == "cuda" else device
    )
