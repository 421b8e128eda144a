"""Attention of the deterministic path: a query's bits depend on its position and the keys
it sees, never on how many queries share the call, where a hit boundary fell, or how far
the keys go past it.

The keys are cut at fixed positions: tiles of BLOCK_N keys starting at multiples of
BLOCK_N, and partitions of PART_TILES tiles starting at multiples of PART_TILES * BLOCK_N,
counted from position 0 whatever the call. For each query:

    partition   online softmax (base 2) over the partition's tiles, in key order, from a
                fresh state -> the partition's normalised output and log-sum-exp
    merge       the partitions, in key order, folded into a running (max, weight, output)

A key a query does not see (past its position, outside its window, not written, or not
held by the late window's ring) gets a score of -inf: weight exactly 0, and a tile or a
partition with no key the query sees leaves every running value exactly as it was. So the
tiles and partitions a call visits beyond those a query needs change nothing, and a
query computes the same sums in the same order in a cold prefill of 8,192 rows, in a hit's
step of three, and in a decode step of one.

Two launches compute the very same arithmetic:

    in place  program (query block, KV head): the block's partitions one after another,
              merged in registers (many query blocks: a prefill)
    split     program (query block, partition, KV head) writes its partition's output and
              log-sum-exp; a second kernel merges them per (query, head) in key order
              (few query blocks over many keys: a decode step, a short hit)

Floating-point contraction is off in both (`enable_fp_fusion=False`): a multiply then an
add rounds twice in either, so the merge in registers and the merge from memory agree bit
for bit. Query heads of one KV head are rows of one tile (position, then head of the group),
as in `paged_attention.py`. One tile configuration per head shape (`tiles_for`), never
chosen by the query count.

Keys come from the L1 pool through a request's page table (source layers), or from a
contiguous (L, 2, H, D) buffer of the late window with a flag per key (late layers).
Runs on the GPU, and under TRITON_INTERPRET=1 on the CPU (the tests).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from tiers.jit import INTERPRETED, tl, triton  # triton, or a stand-in without it

_LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class AttentionTiles:
    """The attention's fixed cuts and launch shape. block_n and part_tiles place the cuts
    (part of the numerics, like a matmul's BLOCK_K); block_m and warps the tile of rows."""

    block_m: int = 128  # rows (position x query head of a group) of a tile
    block_n: int = 64  # keys of a tile
    part_tiles: int = 16  # tiles of a partition (1,024 keys)
    warps: int = 4
    stages: int = 2
    waves: int = 2  # split when fewer than this many programs per multiprocessor


def tiles_for(head_dim: int) -> AttentionTiles:
    """The configuration of a head size: wider heads take twice the warps (a 128 x 128
    float32 accumulator)."""
    return AttentionTiles(warps=4 if head_dim <= 64 else 8)


@triton.jit
def _merge(top, total, acc, part_out, part_lse):
    # fold a partition (its normalised output (M, DIM) and log-sum-exp (M,), -inf where it
    # saw no key) into the running maximum and weight sum (M,) and weighted output (M, DIM)
    new_top = tl.maximum(top, part_lse)
    shift = tl.where(new_top == float("-inf"), 0.0, new_top)
    old_weight = tl.exp2(top - shift)
    part_weight = tl.exp2(part_lse - shift)
    total = total * old_weight + part_weight
    acc = acc * old_weight[:, None] + part_out * part_weight[:, None]
    return new_top, total, acc


@triton.jit
def _partition(
    q, kv_ptr, table_ptr, valid_ptr, part, first_tile, stop_tile, position, key_first,
    key_end, window, scale_log2, kv_head,
    NUM_KV: tl.constexpr, DIM: tl.constexpr, PAGE: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, PART_TILES: tl.constexpr, PAGED: tl.constexpr,
    HAS_VALID: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    # online softmax over partition `part`'s tiles within [first_tile, stop_tile) -> its
    # normalised output (BLOCK_M, DIM) and log-sum-exp (BLOCK_M,) (0 and -inf: no key seen)
    dim = tl.arange(0, DIM)
    key = tl.arange(0, BLOCK_N)
    slot_stride: tl.constexpr = 2 * NUM_KV * DIM
    top = tl.full([BLOCK_M], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DIM], tl.float32)
    lo = tl.maximum(part * PART_TILES, first_tile)
    hi = tl.minimum(part * PART_TILES + PART_TILES, stop_tile)
    for tile in range(lo, hi):
        key_position = tile * BLOCK_N + key
        exists = (key_position >= key_first) & (key_position < key_end)
        offset = tl.where(exists, key_position - key_first, 0)
        if HAS_VALID:
            exists = exists & (tl.load(valid_ptr + offset, mask=exists, other=0) != 0)
        if PAGED:
            page = tl.load(table_ptr + offset // PAGE, mask=exists, other=0).to(tl.int64)
            slot = page * PAGE + offset % PAGE
        else:
            slot = offset.to(tl.int64)
        base = kv_ptr + slot * slot_stride + kv_head * DIM  # (BLOCK_N,) each key's K
        k = tl.load(base[None, :] + dim[:, None], mask=exists[None, :], other=0.0)
        v = tl.load(base[:, None] + NUM_KV * DIM + dim[None, :], mask=exists[:, None], other=0.0)
        if UPCAST:
            k, v = k.to(tl.float32), v.to(tl.float32)
        seen = exists[None, :] & (key_position[None, :] <= position[:, None])
        in_window = (window == 0) | (key_position[None, :] > position[:, None] - window)
        seen = seen & in_window
        scores = tl.dot(q, k, input_precision=PRECISION) * scale_log2
        scores = tl.where(seen, scores, float("-inf"))
        new_top = tl.maximum(top, tl.max(scores, 1))
        shift = tl.where(new_top == float("-inf"), 0.0, new_top)
        weights = tl.exp2(scores - shift[:, None])
        rescale = tl.exp2(top - shift)
        total = total * rescale + tl.sum(weights, 1)
        acc = acc * rescale[:, None] + tl.dot(weights.to(v.dtype), v, input_precision=PRECISION)
        top = new_top
    seen_any = total > 0
    out = acc / tl.where(seen_any, total, 1.0)[:, None]
    lse = tl.where(seen_any, top + tl.log2(tl.where(seen_any, total, 1.0)), float("-inf"))
    return out, lse


@triton.jit(
    do_not_specialize=["start", "num_rows", "key_first", "key_end", "window", "row_stride", "layer"]
)
def _attention_kernel(
    q_ptr, kv_ptr, table_ptr, valid_ptr, out_ptr, part_ptr, lse_ptr, step_ptr,
    start, num_rows, key_first, key_end, window, row_stride, layer, scale_log2,
    NUM_HEADS: tl.constexpr, NUM_KV: tl.constexpr, GROUP: tl.constexpr, DIM: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PART_TILES: tl.constexpr, PAGED: tl.constexpr, HAS_VALID: tl.constexpr,
    SPLIT: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    ON_DEVICE: tl.constexpr, KV_UNIT: tl.constexpr,
):  # fmt: skip
    if ON_DEVICE:  # the step, the page table and the pool layer from the device (`DeviceStep`)
        start = tl.load(step_ptr).to(tl.int32)
        num_rows = tl.load(step_ptr + 1).to(tl.int32)
        key_end = start + num_rows
        table_ptr += tl.load(step_ptr + 2) * 2  # (16-byte steps from the anchors)
        kv_ptr += tl.load(step_ptr + 3 + layer) * KV_UNIT
    block = tl.program_id(0)
    kv_head = tl.program_id(2)
    block_q: tl.constexpr = BLOCK_M // GROUP  # positions a block holds
    rows = tl.arange(0, BLOCK_M)
    query = block * block_q + rows // GROUP  # (BLOCK_M,) the row's query, of the call's
    head = kv_head * GROUP + rows % GROUP
    live = (rows < block_q * GROUP) & (query < num_rows)
    position = start + query
    dim = tl.arange(0, DIM)
    q_rows = (query.to(tl.int64) * NUM_HEADS + head) * DIM
    q = tl.load(q_ptr + q_rows[:, None] + dim[None, :], mask=live[:, None], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    # the tiles that hold a key some row of the block may see
    first_position = start + block * block_q
    last_position = start + tl.minimum(block * block_q + block_q, num_rows) - 1
    lowest = tl.where(window > 0, tl.maximum(key_first, first_position - window + 1), key_first)
    first_tile = lowest // BLOCK_N
    stop_tile = (tl.minimum(key_end, last_position + 1) + BLOCK_N - 1) // BLOCK_N
    first_part = first_tile // PART_TILES
    if SPLIT:  # this program's partition: the call's first (`key_first`'s) + program_id(1)
        part = key_first // (BLOCK_N * PART_TILES) + tl.program_id(1)
        out, lse = _partition(
            q, kv_ptr, table_ptr, valid_ptr, part, first_tile, stop_tile, position,
            key_first, key_end, window, scale_log2, kv_head, NUM_KV, DIM, PAGE, BLOCK_M,
            BLOCK_N, PART_TILES, PAGED, HAS_VALID, PRECISION, UPCAST,
        )  # fmt: skip
        slot_rows = (tl.program_id(1) * row_stride + query.to(tl.int64)) * NUM_HEADS + head
        # every row of the launch's capacity (a device step's rows past its own compute over
        # the keys too), so the merge kernel never reads an unwritten partial
        held = (rows < block_q * GROUP) & (query < row_stride)
        tl.store(part_ptr + slot_rows[:, None] * DIM + dim[None, :], out, mask=held[:, None])
        tl.store(lse_ptr + slot_rows, lse, mask=held)
    else:
        top = tl.full([BLOCK_M], float("-inf"), tl.float32)
        total = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, DIM], tl.float32)
        for part in range(first_part, (stop_tile + PART_TILES - 1) // PART_TILES):
            part_out, part_lse = _partition(
                q, kv_ptr, table_ptr, valid_ptr, part, first_tile, stop_tile, position,
                key_first, key_end, window, scale_log2, kv_head, NUM_KV, DIM, PAGE, BLOCK_M,
                BLOCK_N, PART_TILES, PAGED, HAS_VALID, PRECISION, UPCAST,
            )  # fmt: skip
            top, total, acc = _merge(top, total, acc, part_out, part_lse)
        out = acc / tl.where(total > 0, total, 1.0)[:, None]
        out_rows = query.to(tl.int64) * NUM_HEADS + head
        tl.store(
            out_ptr + out_rows[:, None] * DIM + dim[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=live[:, None],
        )


@triton.jit(do_not_specialize=["row_stride", "num_slots"])
def _combine_kernel(
    part_ptr, lse_ptr, out_ptr, row_stride, num_slots, NUM_HEADS: tl.constexpr, DIM: tl.constexpr
):
    # one (query, head): the partitions' outputs merged in key order, as in place
    row = tl.program_id(0).to(tl.int64)
    dim = tl.arange(0, DIM)
    top = tl.full([1], float("-inf"), tl.float32)
    total = tl.zeros([1], tl.float32)
    acc = tl.zeros([1, DIM], tl.float32)
    slot_rows = row_stride * NUM_HEADS
    for slot in range(0, num_slots):
        part_lse = tl.load(lse_ptr + slot * slot_rows + row + tl.zeros([1], tl.int64))
        part_out = tl.load(part_ptr + (slot * slot_rows + row) * DIM + dim[None, :])
        top, total, acc = _merge(top, total, acc, part_out, part_lse)
    out = acc / tl.where(total > 0, total, 1.0)[:, None]
    tl.store(out_ptr + row * DIM + dim[None, :], out.to(out_ptr.dtype.element_ty))


def paged_attention(
    q: torch.Tensor,
    start: int,
    kv_layer: torch.Tensor,
    page_table: torch.Tensor,
    *,
    scale: float,
    split: bool | None = None,
) -> torch.Tensor:
    """Causal attention of queries q (n, Hq, D) at positions [start, start + n) over the
    keys [0, start + n) that `page_table` (the request's page ids, long, on the device) holds
    in pool layer kv_layer (pages, page_size, 2, H, D), the step's own K/V written there
    already. `split`: force one launch or the other (None: by the call's shape; the bits
    are the same). -> (n, Hq, D), q's dtype."""
    end = start + q.shape[0]
    return _attend(
        q, kv_layer, page_table, None, start, 0, end, 0, scale=scale, page=kv_layer.shape[1],
        split=split,
    )  # fmt: skip


def paged_attention_on_device(
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    layer: int,
    step,
    *,
    scale: float,
    num_slots: int,
) -> torch.Tensor:
    """`paged_attention` of the first rows of q (capacity, Hq, D) over pool layer `layer`,
    the step's position, rows, page table and layer read from `step` (a
    `paged_attention.DeviceStep`) on the device; kv_layer: a layer of the same shape, for its
    shape only. `num_slots`: the partitions the launch covers, at least those of the step's
    keys (the caller picks it by the request's length; a graph captures one count). The
    bits of `paged_attention`'s rows; rows past the step's are left undefined."""
    return _attend(
        q, kv_layer, None, None, 0, 0, 0, 0, scale=scale, page=kv_layer.shape[1],
        split=num_slots > 1, step=step, layer=layer, num_slots=num_slots,
    )  # fmt: skip


def slots_for(end: int, head_dim: int) -> int:
    """The partition count a device step's launch covers for keys [0, end): the power of
    two at or above the count they need (`paged_attention_on_device`)."""
    tiles = tiles_for(head_dim)
    return triton.next_power_of_2(max(1, -(-end // (tiles.block_n * tiles.part_tiles))))


def window_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    start: int,
    window,
    layer: int,
    *,
    scale: float,
    split: bool | None = None,
) -> torch.Tensor:
    """Sliding-window attention of queries q (n, Hq, D) at positions [start, start + n),
    whose own new K/V is kv (n, 2, H, D), over late layer `layer` of `window` (a
    `LateWindow`): a query at t sees the keys in (t - W, t] that the ring holds or the step
    brings. Writes the new K/V into the ring. -> (n, Hq, D)."""
    n = q.shape[0]
    end = start + n
    width = window.window_tokens
    block_n = tiles_for(q.shape[2]).block_n
    key_first = max(0, start - width + 1) // block_n * block_n  # a tile's first key
    keys, valid = window.read(layer, key_first, end)  # (end - key_first, 2, H, D)
    keys[start - key_first :] = kv
    valid[start - key_first :] = True
    out = _attend(
        q, keys, None, valid.to(torch.int8), start, key_first, end, width, scale=scale,
        page=1, split=split,
    )  # fmt: skip
    window.write(layer, start, kv)
    return out


def _attend(
    q, kv, table, valid, start, key_first, key_end, width, *, scale, page, split,
    step=None, layer=0, num_slots=None,
):  # fmt: skip
    """Launch the attention of q (n, Hq, D) at positions [start, start + n) over the keys
    [key_first, key_end) in kv: the pool through `table` (page size `page`), or a
    contiguous (L, 2, H, D) buffer (table None) whose key i is position key_first + i,
    flagged by `valid` (int8, or None: all held); `width` > 0: a sliding window. With
    `step`, the pool layer `layer` and its table are the step's, read on the device (kv: a
    layer of its shape), over `num_slots` partitions."""
    num_rows, num_heads, dim = q.shape
    num_kv = kv.shape[-2]
    group = num_heads // num_kv
    if num_heads % num_kv or dim < 16 or dim & (dim - 1):
        raise ValueError(
            f"deterministic attention takes query heads in whole groups and a power-of-two "
            f"head size >= 16; got {num_heads} heads over {num_kv}, size {dim}"
        )
    tiles = tiles_for(dim)
    if group > tiles.block_m:
        raise ValueError(
            f"deterministic attention takes at most {tiles.block_m} query heads a KV head"
        )
    on_device = step is not None
    if not kv.is_contiguous():  # (a copy of a whole pool layer a call would cost too much)
        raise ValueError("deterministic attention reads a contiguous pool layer or key buffer")
    q = q.contiguous()
    out = torch.empty_like(q)
    if not num_rows:
        return out
    num_blocks = -(-num_rows // (tiles.block_m // group))
    part_keys = tiles.block_n * tiles.part_tiles
    if not on_device:
        num_slots = -(-key_end // part_keys) - key_first // part_keys
    if split is None:
        split = num_slots > 1 and num_blocks * num_kv < tiles.waves * _processors(q.device)
    slots = num_slots if split else 1
    part = lse = out  # (unused in place)
    if split:
        part = torch.empty((slots, num_rows, num_heads, dim), dtype=torch.float32, device=q.device)
        lse = torch.empty((slots, num_rows, num_heads), dtype=torch.float32, device=q.device)
    upcast = INTERPRETED and q.dtype == torch.bfloat16
    precision = "ieee" if q.dtype == torch.float32 or upcast else "tf32"
    kv_unit = 16 // kv.element_size()  # (a DeviceStep's offsets are in 16-byte steps)
    if on_device:  # the kernel finds the layer and the table from the anchors
        kv, table = step.kv_anchor, step.table_anchor
    _attention_kernel[(num_blocks, slots, num_kv)](
        q, kv, table if table is not None else kv, valid if valid is not None else kv, out,
        part, lse, step.scalars if on_device else kv, start, num_rows, key_first, key_end,
        width, num_rows, layer, scale * _LOG2E,
        NUM_HEADS=num_heads, NUM_KV=num_kv, GROUP=group, DIM=dim, PAGE=page,
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, PART_TILES=tiles.part_tiles,
        PAGED=table is not None, HAS_VALID=valid is not None, SPLIT=split,
        PRECISION=precision, UPCAST=upcast, ON_DEVICE=on_device,
        KV_UNIT=kv_unit, num_warps=tiles.warps, num_stages=tiles.stages,
        enable_fp_fusion=False,
    )  # fmt: skip
    if split:
        _combine_kernel[(num_rows * num_heads,)](
            part, lse, out, num_rows, slots, NUM_HEADS=num_heads, DIM=dim, num_warps=1,
            enable_fp_fusion=False,
        )  # fmt: skip
    return out


@functools.cache
def _processors_of(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: a few, as a GPU would have many
    return torch.cuda.get_device_properties(device).multi_processor_count


def _processors(device: torch.device) -> int:
    if device.type == "cuda":
        device = torch.device("cuda", device.index or 0)
    return _processors_of(device)
