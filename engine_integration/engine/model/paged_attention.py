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

from tiers.jit import tl, triton  # triton, or a stand-in without it

# Steps of more queries than this a request go through the flash kernel: at 509 queries
# over 8K keys it was as fast (0.9-1.1x of this kernel's time, on the H200).
MAX_ROWS = 256


@dataclass
class Tuning:
    """Tile sizes and launch shape of the split kernel. Swept twice on the H200 (32 and 24
    settings of these five; five or six shapes of the benchmark models, 1 to 509 queries
    over 1K to 32K keys): this one had the best geometric mean of its time over gather +
    flash's both times (0.77, 0.87), 0.78-0.89 at 64 queries over 32K keys (the 1.1B model's
    hit); at SmolLM2's 64 queries over 1K keys it measured 0.61 in one sweep, 1.51 in the
    other (short calls: launch-bound, noisy)."""

    block_m: int = 128  # rows of a tile at most
    block_n: int = 64  # keys of a tile
    waves: int = 4  # programs: this many per multiprocessor
    warps: int = 4
    stages: int = 2


TUNING = Tuning()
_LOG2E = 1.4426950408889634
_KV_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit(do_not_specialize=["start", "num_rows", "capacity", "layer"])
def _split_kernel(
    q_ptr,
    kv_ptr,
    table_ptr,
    part_ptr,
    lse_ptr,
    step_ptr,
    start,
    num_rows,
    capacity,
    layer,
    scale_log2,
    NUM_HEADS: tl.constexpr,
    NUM_KV: tl.constexpr,
    GROUP: tl.constexpr,
    DIM: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    KV_UNIT: tl.constexpr,
    ON_DEVICE: tl.constexpr,
):
    if ON_DEVICE:  # the step, and where the page table and the pool layer are (`DeviceStep`)
        start = tl.load(step_ptr).to(tl.int32)
        num_rows = tl.load(step_ptr + 1).to(tl.int32)
        table_ptr += tl.load(step_ptr + 2) * 2  # (16-byte steps from the anchors: so the
        kv_ptr += tl.load(step_ptr + 3 + layer) * KV_UNIT  # compiler knows the alignment)
    end = start + num_rows
    tiles_per_split = tl.cdiv(tl.cdiv(end, BLOCK_N), tl.num_programs(1))
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
    part_rows = (split * capacity + query.to(tl.int64)) * NUM_HEADS + head
    tl.store(part_ptr + part_rows[:, None] * DIM + dim[None, :], out, mask=live[:, None])
    tl.store(lse_ptr + part_rows, lse, mask=live)


@triton.jit(do_not_specialize=["num_rows", "capacity", "num_splits"])
def _combine_kernel(
    part_ptr,
    lse_ptr,
    out_ptr,
    step_ptr,
    num_rows,
    capacity,
    num_splits,
    NUM_HEADS: tl.constexpr,
    DIM: tl.constexpr,
    SPLITS: tl.constexpr,
    ON_DEVICE: tl.constexpr,
):
    if ON_DEVICE:
        num_rows = tl.load(step_ptr + 1).to(tl.int32)
    row = tl.program_id(0).to(tl.int64)  # (query, head)
    split = tl.arange(0, SPLITS)
    dim = tl.arange(0, DIM)
    live_row = (dim * 0 + row) < num_rows * NUM_HEADS  # (as a vector: a mask's shape)
    live = (split < num_splits) & ((split * 0 + row) < num_rows * NUM_HEADS)
    split_rows = capacity * NUM_HEADS
    lse = tl.load(lse_ptr + split * split_rows + row, mask=live, other=float("-inf"))
    top = tl.max(lse, 0)  # finite for a live row: every query sees at least its own key
    top = tl.where(top == float("-inf"), 0.0, top)
    weights = tl.where(live, tl.exp2(lse - top), 0.0)
    parts = tl.load(
        part_ptr + (split[:, None] * split_rows + row) * DIM + dim[None, :],
        mask=live[:, None],
        other=0.0,
    )
    out = tl.sum(parts * weights[:, None], 0) / tl.maximum(tl.sum(weights, 0), 1e-30)
    tl.store(out_ptr + row * DIM + dim, out.to(out_ptr.dtype.element_ty), mask=live_row)


@triton.jit(do_not_specialize=["layer"])
def _write_kernel(
    kv_ptr,
    pool_ptr,
    table_ptr,
    step_ptr,
    layer,
    ROW: tl.constexpr,
    BLOCK: tl.constexpr,
    PAGE: tl.constexpr,
    KV_UNIT: tl.constexpr,
):
    # row r of the step's K/V (2, H, D) into its slot of pool layer `layer`, if r is one of
    # the step's rows (`DeviceStep`)
    row = tl.program_id(0)
    element = tl.arange(0, BLOCK)
    start = tl.load(step_ptr)
    num_rows = tl.load(step_ptr + 1)
    live = (element * 0 + row) < num_rows  # (as a vector: a mask's shape)
    table_ptr += tl.load(step_ptr + 2) * 2  # (from the anchors, as in the split kernel)
    pool_ptr += tl.load(step_ptr + 3 + layer) * KV_UNIT
    position = start + tl.minimum(row, num_rows - 1)  # (a row past them: a slot in the table)
    page = tl.load(table_ptr + position // PAGE).to(tl.int64)
    mask = (element < ROW) & live
    values = tl.load(kv_ptr + row.to(tl.int64) * ROW + element, mask=mask)
    tl.store(pool_ptr + (page * PAGE + position % PAGE) * ROW + element, values, mask=mask)


def takes(num_rows: int, num_heads: int, kv_layer: torch.Tensor) -> bool:
    """Whether `paged_attention` runs `num_rows` queries of `num_heads` heads over pool
    layer kv_layer (pages, page_size, 2, H, D): few enough rows, a power-of-two D of at
    least 16 (a tile's), query heads in whole groups, a contiguous pool."""
    dim = kv_layer.shape[-1]
    return (
        num_rows <= MAX_ROWS
        and dim >= 16
        and dim & (dim - 1) == 0
        and kv_layer.is_contiguous()
        and num_heads % kv_layer.shape[3] == 0
        and kv_layer.dtype in _KV_DTYPES
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
    end = start + q.shape[0]
    num_tiles = -(-end // TUNING.block_n)
    return _attend(q, kv_layer, page_table, None, start, q.shape[0], num_tiles, scale=scale)


class DeviceStep:
    """One request's step where the kernels read it from the device, so that a CUDA graph
    captured once serves every step of its row bucket, over any pool: `scalars` holds the
    first position, the number of rows, and where the request's page table and each pool
    layer are, in 16-byte steps from two anchors of this object's (a graph's kernels take
    the anchors as their pointers: the compiler keeps their alignment, and with it
    vectorised loads, which an address read from memory would lose: 140 scalar loads in
    the split kernel's PTX against 24). `set` before each step (one copy, no wait)."""

    def __init__(self, num_layers: int, dtype: torch.dtype, device) -> None:
        self.scalars = torch.zeros(3 + num_layers, dtype=torch.long, device=device)
        self.kv_anchor = torch.zeros(16, dtype=dtype, device=device)
        self.table_anchor = torch.zeros(2, dtype=torch.long, device=device)
        self._held: tuple = ()

    def set(self, start: int, num_rows: int, page_table: torch.Tensor, layers) -> None:
        """`page_table`: the request's page ids (long, on the device); `layers`: the pool
        layers (pages, page_size, 2, H, D) the kernels name by index."""
        values = [start, num_rows, _steps(page_table, self.table_anchor)]
        values += [_steps(layer, self.kv_anchor) for layer in layers]
        host = torch.tensor(values, dtype=torch.long)
        if self.scalars.is_cuda:  # (pinned: the copy does not wait for the device)
            host = host.pin_memory()
        self.scalars.copy_(host, non_blocking=True)
        self._held = (page_table, *layers)  # alive while the step's kernels may read them


def _steps(tensor: torch.Tensor, anchor: torch.Tensor) -> int:
    """Where `tensor` starts, in 16-byte steps from `anchor`."""
    offset = tensor.data_ptr() - anchor.data_ptr()
    if offset % 16 or tensor.dtype != anchor.dtype:
        raise ValueError(
            f"a {tensor.dtype} tensor {offset} bytes from the anchor: not 16-byte steps"
        )
    return offset // 16


def paged_attention_on_device(
    q: torch.Tensor, kv_layer: torch.Tensor, layer: int, step: DeviceStep, *, scale: float
) -> torch.Tensor:
    """`paged_attention` of the first rows of q (capacity, Hq, D) over pool layer `layer`,
    the step's position, rows, page table and layer read from `step` on the device (kv_layer:
    a layer of the same shape, for its shape only); rows past the step's are left undefined.
    Launches that a graph can capture once for any step of at most `capacity` rows."""
    return _attend(q, kv_layer, None, step, 0, q.shape[0], None, layer=layer, scale=scale)


def write_step_kv(kv: torch.Tensor, kv_layer: torch.Tensor, layer: int, step: DeviceStep) -> None:
    """The step's rows of kv (capacity, 2, H, D) into their slots of pool layer `layer` (of
    kv_layer's shape), by the page table `step` names: rows past the step's write nothing."""
    row = kv[0].numel()
    _write_kernel[(kv.shape[0],)](
        kv.contiguous(),
        step.kv_anchor,
        step.table_anchor,
        step.scalars,
        layer,
        ROW=row,
        BLOCK=triton.next_power_of_2(row),
        PAGE=kv_layer.shape[1],
        KV_UNIT=16 // kv_layer.element_size(),
        num_warps=4,
    )


def _attend(q, kv_layer, table, step, start, num_rows, num_tiles, *, scale: float, layer: int = 0):
    """Launch the split and combine kernels for `num_rows` queries from `start` (or, with
    `step`, as many as it says, `num_rows` the capacity), over `num_tiles` key tiles at most
    (None: unknown until the device reads the step)."""
    capacity, num_heads, dim = q.shape
    page_size, num_kv = kv_layer.shape[1], kv_layer.shape[3]
    group = num_heads // num_kv
    q = q.contiguous()
    tuning = TUNING
    # Rows of a tile: the step's (query, head) pairs of one KV head; a decode step's few in
    # a small tile, the rest in full ones. Two sizes only, and the merge's split count
    # padded to one size (`_max_splits`): every compiled variant of the kernels is one that
    # a warm-up's requests reach, so no later request waits for Triton to compile one.
    small = max(16, triton.next_power_of_2(group))
    block_m = small if capacity * group <= small else max(tuning.block_m, small)
    num_blocks = -(-capacity // (block_m // group))
    num_splits = -(-tuning.waves * _processors(q.device) // (num_kv * num_blocks))
    if num_tiles is not None:  # no more splits than tiles
        num_splits = max(1, min(num_splits, num_tiles))
        num_splits = -(-num_tiles // -(-num_tiles // num_splits))
    part = torch.empty((num_splits, capacity, num_heads, dim), dtype=torch.float32, device=q.device)
    lse = torch.empty((num_splits, capacity, num_heads), dtype=torch.float32, device=q.device)
    on_device = step is not None
    scalars = step.scalars if on_device else table
    _split_kernel[(num_blocks, num_splits, num_kv)](
        q,
        step.kv_anchor if on_device else kv_layer,
        step.table_anchor if on_device else table,
        part,
        lse,
        scalars,
        start,
        num_rows,
        capacity,
        layer,
        scale * _LOG2E,
        NUM_HEADS=num_heads,
        NUM_KV=num_kv,
        GROUP=group,
        DIM=dim,
        PAGE=page_size,
        BLOCK_M=block_m,
        BLOCK_N=tuning.block_n,
        KV_UNIT=16 // kv_layer.element_size(),
        ON_DEVICE=on_device,
        num_warps=tuning.warps,
        num_stages=tuning.stages,
    )
    out = torch.empty_like(q)
    _combine_kernel[(capacity * num_heads,)](
        part,
        lse,
        out,
        scalars,
        num_rows,
        capacity,
        num_splits,
        NUM_HEADS=num_heads,
        DIM=dim,
        SPLITS=_max_splits(q.device, num_kv),
        ON_DEVICE=on_device,
        num_warps=1,
    )
    return out


def _max_splits(device: torch.device, num_kv: int) -> int:
    """The most splits a call makes here (one query block), as a power of two."""
    return triton.next_power_of_2(-(-TUNING.waves * _processors(device) // num_kv))


@functools.cache
def _processors_of(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: a few splits, as a GPU would have
    return torch.cuda.get_device_properties(device).multi_processor_count


def _processors(device: torch.device) -> int:
    return _processors_of(
        torch.device(device.type, device.index or 0) if device.type == "cuda" else device
    )
