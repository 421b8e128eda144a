"""Fused row-wise kernels for the dense path on CUDA: RMS norm, and RoPE of q and k with v's copy.

In a hit's step on the H200 (1.1B model, 32K tokens) the GPU ran ~800 kernels for ~4.1 ms
of busy time, and ~400 of them were the elementwise pieces of two functions: `rms_norm`
(upcast, square, mean, add, rsqrt, scale, downcast, weight: 8 kernels, twice a layer) and
`apply_rope` (5 kernels for q, 5 for k, and the copy of v into the KV rows). Each moves a
few hundred KiB and costs what a launch costs, 2-3 us, inside a CUDA graph too. Here each
of the two is one kernel, a program per row.

They compute what the torch functions compute, rounding where those round: RoPE rounds
each product and the sum or difference to the tensor's dtype as the separate torch ops do,
and gives the same bits (`apply_rope`'s formula); the norm rounds x * rsqrt(mean(x^2) + eps)
to the dtype before the weight, as `rms_norm` does, but sums the squares in another order,
so its mean can differ in the last bits of float32 (results within one step of the dtype).

On the CPU these run only under TRITON_INTERPRET=1 (the tests); the model uses them on
CUDA (`Model`). A row's result depends on that row alone (a program per row, its reduction
in one order whatever the row count), which the deterministic path
(`EngineConfig.deterministic`) relies on: it uses them as they are.
"""

from __future__ import annotations

import torch

from tiers.jit import tl, triton  # triton, or a stand-in without it


@triton.jit
def _rms_norm_kernel(
    x_ptr, w_ptr, out_ptr, x_stride, out_stride, num_cols, eps, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < num_cols
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    variance = tl.sum(x * x, axis=0) / num_cols
    normed = (x * tl.rsqrt(variance + eps)).to(out_ptr.dtype.element_ty)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    out = w.to(tl.float32) * normed.to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(
    qkv_ptr,
    cos_ptr,
    sin_ptr,
    q_ptr,
    kv_ptr,
    qkv_stride,
    cos_stride,
    NUM_Q: tl.constexpr,
    NUM_KV: tl.constexpr,
    HALF: tl.constexpr,
    HEADS: tl.constexpr,
):
    # One row: heads [0, NUM_Q) of qkv are q, then NUM_KV of k, then NUM_KV of v; q's go to
    # q (rows, NUM_Q, 2 * HALF), k's and v's, which follow each other in a row of kv (rows,
    # 2, NUM_KV, 2 * HALF) in that order, to kv.
    row = tl.program_id(0).to(tl.int64)
    dim = 2 * HALF
    heads = tl.arange(0, HEADS)[:, None]
    cols = tl.arange(0, HALF)[None, :]
    live = heads < NUM_Q + 2 * NUM_KV
    src = qkv_ptr + row * qkv_stride + heads * dim + cols
    x1 = tl.load(src, mask=live, other=0.0)
    x2 = tl.load(src + HALF, mask=live, other=0.0)
    c = tl.load(cos_ptr + row * cos_stride + cols).to(tl.float32)
    s = tl.load(sin_ptr + row * cos_stride + cols).to(tl.float32)
    dtype = x1.dtype
    a1, a2 = x1.to(tl.float32), x2.to(tl.float32)
    # first half x1 * c - x2 * s, second x2 * c + x1 * s, each product and result rounded
    r1 = ((a1 * c).to(dtype).to(tl.float32) - (a2 * s).to(dtype).to(tl.float32)).to(dtype)
    r2 = ((a2 * c).to(dtype).to(tl.float32) + (a1 * s).to(dtype).to(tl.float32)).to(dtype)
    rotate = heads < NUM_Q + NUM_KV
    r1 = tl.where(rotate, r1, x1)
    r2 = tl.where(rotate, r2, x2)
    is_q = heads < NUM_Q
    q_dst = q_ptr + row * (NUM_Q * dim) + heads * dim + cols
    kv_dst = kv_ptr + row * (2 * NUM_KV * dim) + (heads - NUM_Q) * dim + cols
    tl.store(q_dst, r1, mask=live & is_q)
    tl.store(q_dst + HALF, r2, mask=live & is_q)
    tl.store(kv_dst, r1, mask=live & ~is_q)
    tl.store(kv_dst + HALF, r2, mask=live & ~is_q)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`model.rms_norm` of x (rows, hidden), rows of unit stride, in one kernel."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rows, cols = x.shape
    if rows:
        block = triton.next_power_of_2(cols)
        _rms_norm_kernel[(rows,)](
            x, weight, out, x.stride(0), out.stride(0), cols, eps, BLOCK=block, num_warps=4
        )
    return out


def rope_qkv(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The q/k/v projection's output (rows, (Hq + 2 H) * D) rotated: -> q (rows, Hq, D), kv
    (rows, 2, H, D) with k rotated and v copied; cos and sin (rows, 1, D) or (rows, D), the
    same values in both halves of a row (`RotaryTable`)."""
    rows = qkv.shape[0]
    dim = qkv.shape[1] // (num_heads + 2 * num_kv_heads)
    cos, sin = cos.reshape(rows, dim), sin.reshape(rows, dim)
    if qkv.stride(-1) != 1:
        qkv = qkv.contiguous()
    if cos.stride(-1) != 1 or sin.stride() != cos.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    q = torch.empty((rows, num_heads, dim), dtype=qkv.dtype, device=qkv.device)
    kv = torch.empty((rows, 2, num_kv_heads, dim), dtype=qkv.dtype, device=qkv.device)
    if rows:
        heads = triton.next_power_of_2(num_heads + 2 * num_kv_heads)
        _rope_kernel[(rows,)](
            qkv,
            cos,
            sin,
            q,
            kv,
            qkv.stride(0),
            cos.stride(0),
            NUM_Q=num_heads,
            NUM_KV=num_kv_heads,
            HALF=dim // 2,
            HEADS=heads,
            num_warps=4,
            enable_fp_fusion=False,  # a product rounded, then added: never one fused op
        )
    return q, kv
