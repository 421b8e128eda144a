"""The fused norm and RoPE kernels against the torch functions they replace on CUDA.

On the CPU the kernels run under TRITON_INTERPRET=1 (tests/conftest.py), in float32 and
float16: the interpreter rounds float32 to bfloat16 by truncation, not to nearest as the
GPU does, so bfloat16 is checked on CUDA (the `gpu` test at the end)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine_integration.engine.embedded import load_model
from engine_integration.engine.model import fused
from engine_integration.engine.model.norm_rope import RotaryTable, apply_rope, rms_norm
from engine_integration.engine.sampling import SamplingParams
from tests.support.engines import ENGINE, SMALL, cache_off, random_prompt, run_one


def _rope_case(rows, num_heads, num_kv_heads, dim, dtype, device="cpu", seed=0):
    generator = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(rows, (num_heads + 2 * num_kv_heads) * dim, generator=generator) * 4).to(
        dtype
    )
    config = SMALL.replace(head_dim=dim, rope_theta=10000.0)
    positions = torch.randint(0, 40000, (rows,), generator=generator)
    cos, sin = RotaryTable(config, device, dtype).lookup(positions.to(device), 40000)
    return qkv.to(device), cos, sin


def _torch_rope(qkv, cos, sin, num_heads, num_kv_heads):
    rows, dim = qkv.shape[0], qkv.shape[1] // (num_heads + 2 * num_kv_heads)
    q, k, v = qkv.split([num_heads * dim, num_kv_heads * dim, num_kv_heads * dim], dim=-1)
    rotated = torch.empty(rows, num_heads, dim, dtype=qkv.dtype, device=qkv.device)
    kv = torch.empty(rows, 2, num_kv_heads, dim, dtype=qkv.dtype, device=qkv.device)
    apply_rope(q.reshape(rows, num_heads, dim), cos, sin, out=rotated)
    apply_rope(k.reshape(rows, num_kv_heads, dim), cos, sin, out=kv[:, 0])
    kv[:, 1] = v.reshape(rows, num_kv_heads, dim)
    return rotated, kv


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "dim"), [(4, 2, 16), (6, 2, 32), (3, 3, 8)])
def test_fused_rope_gives_apply_ropes_bits(dtype, num_heads, num_kv_heads, dim):
    """q and k rotated, v copied, every bit as the torch ops (head counts that fill no power
    of two included: the kernel's masked heads write nothing)."""
    qkv, cos, sin = _rope_case(13, num_heads, num_kv_heads, dim, dtype)
    q, kv = fused.rope_qkv(qkv, cos, sin, num_heads, num_kv_heads)
    want_q, want_kv = _torch_rope(qkv, cos, sin, num_heads, num_kv_heads)
    assert q.shape == want_q.shape and kv.shape == want_kv.shape
    assert torch.equal(q, want_q) and torch.equal(kv, want_kv)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("cols", [64, 96])
def test_fused_rms_norm_is_the_torch_norm_to_the_last_bit_of_its_mean(dtype, cols):
    generator = torch.Generator().manual_seed(cols)
    wide = (torch.randn(9, 2 * cols, generator=generator) * 3).to(dtype)
    x = wide[:, :cols]  # rows apart by more than their width, as a slice of a larger tensor
    weight = torch.randn(cols, generator=generator).to(dtype)
    out = fused.rms_norm(x, weight, 1e-5)
    want = rms_norm(x, weight, 1e-5)
    # the squares are summed in another order: the mean may differ in float32's last bits,
    # which moves a result by at most one step of the dtype
    step = torch.finfo(dtype).eps * want.abs().float().clamp_min(torch.finfo(dtype).tiny)
    assert ((out.float() - want.float()).abs() <= step * 2).all()
    if dtype != torch.float32:  # rounded to the dtype, most results are the same bits
        assert (out == want).float().mean() > 0.95


def test_fused_kernels_in_the_dense_path_are_the_same_model(monkeypatch):
    """The dense path (CUDA's, on the CPU here) with the fused kernels: the tokens and, to
    float32 rounding, the logits of the torch ops."""
    calls = []
    for name in ("rope_qkv", "rms_norm"):
        kernel = getattr(fused, name)
        monkeypatch.setattr(fused, name, lambda *a, k=kernel, n=name: calls.append(n) or k(*a))
    config = dataclasses.replace(ENGINE, batch_invariant=False)
    model, _ = load_model(None, config, seed=2, model_config=SMALL)
    assert model.block_rows is None and not model.fused_kernels  # CUDA only by default
    tokens = random_prompt(6, 40)
    params = SamplingParams(max_new_tokens=3, return_logits=True)
    plain = run_one(cache_off(model, config), tokens, params)
    model.fused_kernels = True
    fused_run = run_one(cache_off(model, config), tokens, params)
    # every layer's projection and both its norms, at each of the 3 steps; the final norm
    assert calls.count("rope_qkv") >= 3 * SMALL.num_layers
    assert calls.count("rms_norm") >= 3 * (2 * SMALL.num_layers + 1)
    assert fused_run.token_ids == plain.token_ids
    torch.testing.assert_close(fused_run.logits, plain.logits, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_fused_kernels_on_cuda_in_bfloat16():
    """On the GPU, bf16 at the 1.1B model's head shapes: RoPE bit for bit; the norm within
    one bf16 step, almost always the same bits."""
    qkv, cos, sin = _rope_case(509, 32, 8, 64, torch.bfloat16, device="cuda")
    q, kv = fused.rope_qkv(qkv, cos, sin, 32, 8)
    want_q, want_kv = _torch_rope(qkv, cos, sin, 32, 8)
    assert torch.equal(q, want_q) and torch.equal(kv, want_kv)
    generator = torch.Generator().manual_seed(5)
    x = (torch.randn(509, 2048, generator=generator) * 3).to(torch.bfloat16).cuda()
    weight = torch.randn(2048, generator=generator).to(torch.bfloat16).cuda()
    out, want = fused.rms_norm(x, weight, 1e-5), rms_norm(x, weight, 1e-5)
    step = torch.finfo(torch.bfloat16).eps * want.abs().float()
    assert ((out.float() - want.float()).abs() <= step * 2).all()
    assert (out == want).float().mean() > 0.99
