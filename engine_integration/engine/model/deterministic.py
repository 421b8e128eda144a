"""Batch-invariant row-wise kernels of the deterministic path (`EngineConfig.deterministic`).

A row's bits here depend on that row's inputs alone: never on how many rows share the call,
where the row sits among them, or how the prompt was split into steps. torch's CUDA matmul
does not promise that: cuBLAS picks its tiles, and whether to split the reduction over K,
by the row count M, and a split-K sum adds a row's products in another order. So:

    matmul    x (M, K) @ w (N, K)^T: one program per (BLOCK_M x BLOCK_N) output tile, the
              reduction over K in BLOCK_K steps from k = 0 up, in that one program (no
              split-K), one tile configuration per dtype whatever M is (`GEMM`); rows past
              M are masked to zero and never touch a real row's sums
    silu_mul  the SwiGLU gate: silu(gate) * up, elementwise, rounded where torch rounds

The norm and RoPE kernels of `fused.py` are row-wise already (a program per row, a row's
reduction in one fixed order): the deterministic path uses them as they are. The
attention kernel is `deterministic_attention.py`.

The tile configuration is what the guarantee rests on: every call of a kernel compiles to
the same code for any M (`num_rows` is never a compile-time value), so a row meets the same
instructions in the same order in a decode step of one row and in a prefill of 8,192.
Runs on the GPU, and under TRITON_INTERPRET=1 on the CPU (the tests check the invariance
bitwise there; `tests/engine_integration/engine/test_deterministic.py`). What the path
costs against the default one: `benchmarks/bench_engine.py --deterministic`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tiers.jit import INTERPRETED, tl, triton  # triton, or a stand-in without it


@dataclass(frozen=True)
class GemmTiles:
    """One matmul tile configuration. Fixed per dtype, never chosen by M: changing it
    changes the bits (a new BLOCK_K regroups the sums), so it is part of the model's
    numerics, and a new choice is a new deterministic model, not a tuning."""

    block_m: int
    block_n: int
    block_k: int
    warps: int
    stages: int


# 16-bit inputs: tensor-core tiles, as a prefill's large M wants (a decode step's few rows
# pay for the whole BLOCK_M; its matmuls are bound by reading the weights anyway).
GEMM_16BIT = GemmTiles(block_m=128, block_n=128, block_k=64, warps=8, stages=3)
# float32: full-precision products (no TF32, as torch's default matmul), smaller tiles.
GEMM_32BIT = GemmTiles(block_m=64, block_n=64, block_k=32, warps=4, stages=2)
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_GROUP_M = 8  # row tiles launched together down a column of tiles (launch order only)


def gemm_tiles(dtype: torch.dtype) -> GemmTiles:
    return GEMM_32BIT if dtype == torch.float32 else GEMM_16BIT


def _upcast(dtype: torch.dtype) -> bool:
    """Whether a kernel's tl.dot takes float32 copies of `dtype` tiles (the interpreter's
    bfloat16 dot is wrong: `tiers.jit`); on the GPU never."""
    return INTERPRETED and dtype == torch.bfloat16


def _precision(dtype: torch.dtype) -> str:
    """tl.dot's input precision: float32 products in full (torch's default matmul uses no
    TF32), and for float32 copies of bfloat16 tiles (exact: the products fit)."""
    return "ieee" if dtype == torch.float32 or _upcast(dtype) else "tf32"


@triton.jit(do_not_specialize=["num_rows", "x_stride", "out_stride"])
def _matmul_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    num_rows,
    x_stride,
    out_stride,
    N: tl.constexpr,
    K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    ALIGN: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    # out[rows, cols] = x[rows, :] @ w[cols, :]^T (+ bias[cols]): the K loop runs from 0 up in
    # BLOCK_K steps, accumulating in float32, whatever num_rows is. Tiles are launched GROUP_M
    # row tiles at a time down each column of tiles (the weight tile stays in L2 for them):
    # which program computes a tile changes no bits, only the order tiles run in.
    tiles_m = tl.cdiv(num_rows, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    pid = tl.program_id(0)
    first_m = pid // (GROUP_M * tiles_n) * GROUP_M
    group_m = min(tiles_m - first_m, GROUP_M)
    in_group = pid % (GROUP_M * tiles_n)
    tile_m = first_m + in_group % group_m
    tile_n = in_group // group_m
    rows = tile_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    # row strides are never specialised (one compiled kernel for any call): say what the
    # caller checked, that rows start 16 bytes apart, or the loads and stores of x and out
    # go 2 bytes at a time (3-4x cuBLAS on the H200, where cp.async takes 16)
    x_rows = tl.multiple_of(rows * x_stride, ALIGN)
    out_rows = tl.multiple_of(rows * out_stride, ALIGN)
    live_rows = rows < num_rows
    live_cols = cols < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k in range(0, K, BLOCK_K):
        if K % BLOCK_K == 0:  # every K column inside: the same values, unmasked loads
            a_mask = live_rows[:, None]
            b_mask = live_cols[None, :]
        else:
            inside = (k + ks) < K
            a_mask = live_rows[:, None] & inside[None, :]
            b_mask = inside[:, None] & live_cols[None, :]
        a = tl.load(x_ptr + x_rows[:, None] + (k + ks)[None, :], mask=a_mask, other=0.0)
        b = tl.load(
            w_ptr + cols[None, :].to(tl.int64) * K + (k + ks)[:, None], mask=b_mask, other=0.0
        )
        if UPCAST:  # (the interpreter's bfloat16 dot is wrong: tiers.jit)
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + cols, mask=live_cols, other=0.0).to(tl.float32)[None, :]
    tl.store(
        out_ptr + out_rows[:, None] + cols[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=live_rows[:, None] & live_cols[None, :],
    )


def matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """`F.linear(x, weight, bias)` of x (M, K) (rows of unit stride, any row stride) by
    weight (N, K), batch-invariant: a row's result has the same bits for any M. `out`, a
    (M, N) buffer of unit column stride, receives it. -> (M, N), x's dtype."""
    if x.dtype not in _DTYPES or weight.dtype != x.dtype:
        raise ValueError(
            f"matmul takes {_DTYPES} inputs of one dtype, got {x.dtype} and {weight.dtype}"
        )
    rows, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] != k:
        raise ValueError(f"matmul of x (M, {k}) by weight {tuple(weight.shape)}: K differs")
    if x.stride(1) != 1:
        x = x.contiguous()
    weight = weight.contiguous()
    if out is None:
        out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    if not rows:
        return out
    tiles = gemm_tiles(x.dtype)
    grid = (triton.cdiv(rows, tiles.block_m) * triton.cdiv(n, tiles.block_n),)
    _matmul_kernel[grid](
        x,
        weight,
        bias if bias is not None else weight,
        out,
        rows,
        x.stride(0),
        out.stride(0),
        N=n,
        K=k,
        HAS_BIAS=bias is not None,
        BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k,
        GROUP_M=_GROUP_M,
        ALIGN=_row_alignment(x, out),
        PRECISION=_precision(x.dtype),
        UPCAST=_upcast(x.dtype),
        num_warps=tiles.warps,
        num_stages=tiles.stages,
    )
    return out


def _row_alignment(*tensors: torch.Tensor) -> int:
    """The elements in 16 bytes when every tensor's rows start 16-byte aligned, else 1.
    Which it is changes how a tile is loaded and stored, not what is computed: a row's bits
    are the same either way."""
    elements = 16 // tensors[0].element_size()
    aligned = all(t.data_ptr() % 16 == 0 and t.stride(0) % elements == 0 for t in tensors)
    return elements if aligned else 1


@triton.jit(do_not_specialize=["num_rows", "gate_stride"])
def _silu_mul_kernel(
    gate_up_ptr,
    out_ptr,
    num_rows,
    gate_stride,
    WIDTH: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # a block of rows and columns, each element on its own: silu(gate) rounded to the dtype,
    # times up, rounded (the two torch ops' roundings)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    live = (rows < num_rows)[:, None] & (cols < WIDTH)[None, :]
    at = gate_up_ptr + rows[:, None] * gate_stride + cols[None, :]
    gate = tl.load(at, mask=live, other=0.0)
    up = tl.load(at + WIDTH, mask=live, other=0.0)
    g = gate.to(tl.float32)
    activated = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    out = (activated.to(tl.float32) * up.to(tl.float32)).to(gate.dtype)
    tl.store(out_ptr + rows[:, None] * WIDTH + cols[None, :], out, mask=live)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's activation of gate_up (rows, 2 * width), gate then up: -> silu(gate) * up
    (rows, width), each element on its own (no element's bits depend on the tensor's size)."""
    rows, double = gate_up.shape
    width = double // 2
    if gate_up.stride(1) != 1:
        gate_up = gate_up.contiguous()
    out = torch.empty((rows, width), dtype=gate_up.dtype, device=gate_up.device)
    if rows:
        block = min(256, triton.next_power_of_2(width))
        grid = (triton.cdiv(rows, _SILU_ROWS), triton.cdiv(width, block))
        _silu_mul_kernel[grid](
            gate_up,
            out,
            rows,
            gate_up.stride(0),
            WIDTH=width,
            BLOCK_R=_SILU_ROWS,
            BLOCK=block,
            num_warps=4,
        )
    return out


_SILU_ROWS = 16
