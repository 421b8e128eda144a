"""Attention over a request's pages (the CUDA path's, `paged_attention`) against a plain
reference: every key gathered, a causal softmax in float64.

On the CPU the kernels run under TRITON_INTERPRET=1 (tests/conftest.py), at small sizes."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine_integration.engine.embedded import load_model
from engine_integration.engine.model import paged_attention as paged
from engine_integration.engine.model.paged_attention import (
    DeviceStep,
    paged_attention,
    paged_attention_on_device,
    takes,
    write_step_kv,
)
from engine_integration.engine.sampling import SamplingParams
from tests.support.engines import ENGINE, SMALL, cache_off, random_prompt, run_one


def _pool_and_request(num_keys, num_kv, dim, page_size, dtype, device="cpu", seed=0):
    """A pool layer of stale garbage (NaN included) and a request's pages in shuffled order,
    its keys [0, num_keys) written."""
    generator = torch.Generator().manual_seed(seed)
    num_pages = -(-num_keys // page_size)
    pool_pages = num_pages + 5
    pool = torch.randn(pool_pages, page_size, 2, num_kv, dim, generator=generator).to(dtype)
    pool[pool_pages - 1] = float("nan")  # a page no request of these owns
    table = torch.randperm(pool_pages - 1, generator=generator)[:num_pages]
    # the last page's stale slots past the keys: NaN, as memory may hold
    tail = num_keys - (num_pages - 1) * page_size
    pool[table[-1], tail:] = float("nan")
    return pool.to(device), table.to(device)


def _reference(q, start, pool, table, scale):
    num_rows, num_heads, dim = q.shape
    end = start + num_rows
    page_size, num_kv = pool.shape[1], pool.shape[3]
    slots = (table[:, None] * page_size + torch.arange(page_size, device=table.device)).view(-1)
    kv = pool.view(-1, 2, num_kv, dim)[slots[:end]].double()
    keys = kv[:, 0].repeat_interleave(num_heads // num_kv, dim=1)  # (end, Hq, D)
    values = kv[:, 1].repeat_interleave(num_heads // num_kv, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), keys) * scale
    positions = torch.arange(start, end, device=q.device)[:, None]
    hidden = torch.arange(end, device=q.device)[None, :] > positions
    scores = scores.masked_fill(hidden, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)


@pytest.mark.parametrize(
    ("num_rows", "start", "num_heads", "num_kv", "page_size"),
    [
        (1, 0, 4, 2, 16),  # the first token
        (1, 150, 4, 2, 16),  # a decode step
        (5, 37, 4, 2, 16),  # a few rows from mid-page
        (40, 96, 6, 2, 16),  # several query blocks; a group of 3 (not a power of two)
        (24, 300, 2, 2, 32),  # no grouping; many splits
        (9, 60, 4, 2, 5),  # pages of 5 tokens: a tile of keys spans several
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_paged_attention_is_causal_attention_over_the_pages(
    num_rows, start, num_heads, num_kv, page_size, dtype
):
    dim = 16
    pool, table = _pool_and_request(start + num_rows, num_kv, dim, page_size, dtype)
    generator = torch.Generator().manual_seed(num_rows + start)
    q = torch.randn(num_rows, num_heads, dim, generator=generator).to(dtype)
    assert takes(num_rows, num_heads, pool)
    out = paged_attention(q, start, pool, table, scale=dim**-0.5)
    assert out.shape == q.shape and out.dtype == dtype
    want = _reference(q, start, pool, table, dim**-0.5)
    tolerance = 2e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out.double(), want, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize(("num_rows", "start"), [(1, 70), (11, 37), (16, 0)])
def test_a_step_read_from_the_device_attends_and_writes_only_its_rows(num_rows, start):
    """A graph's launches (capacity 16 rows, the step's position and rows on the device):
    its first rows attend as `paged_attention` would, and only the step's own K/V rows
    reach the pool, each into its slot; every other slot keeps its bytes."""
    num_heads, num_kv, dim, page_size, capacity = 4, 2, 16, 16, 16
    pool, table = _pool_and_request(start + capacity, num_kv, dim, page_size, torch.float32)
    generator = torch.Generator().manual_seed(start)
    kv = torch.randn(capacity, 2, num_kv, dim, generator=generator)
    q = torch.randn(capacity, num_heads, dim, generator=generator)
    other = torch.full_like(pool, 3.0)  # layer 0 of the step; `pool` is its layer 1
    step = DeviceStep(2, pool.dtype, "cpu")
    step.set(start, num_rows, table, [other, pool])
    before = pool.clone()
    write_step_kv(kv, pool, 1, step)
    assert torch.equal(other, torch.full_like(pool, 3.0))
    slots = (table[:, None] * page_size + torch.arange(page_size)).view(-1)
    flat, flat_before = pool.view(-1, 2, num_kv, dim), before.view(-1, 2, num_kv, dim)
    mine = slots[start : start + num_rows]
    assert torch.equal(flat[mine], kv[:num_rows])
    others = torch.ones(flat.shape[0], dtype=torch.bool)
    others[mine] = False
    assert torch.equal(flat[others].nan_to_num(7.0), flat_before[others].nan_to_num(7.0))
    out = paged_attention_on_device(q, other, 1, step, scale=dim**-0.5)
    want = paged_attention(q[:num_rows], start, pool, table, scale=dim**-0.5)
    torch.testing.assert_close(out[:num_rows], want, rtol=1e-6, atol=1e-6)
    want = _reference(q[:num_rows], start, pool, table, dim**-0.5)
    torch.testing.assert_close(out[:num_rows].double(), want, rtol=2e-5, atol=2e-5)


def test_paged_attention_takes_only_what_it_can_tile():
    assert takes(4, 4, torch.zeros(3, 16, 2, 2, 16)) and takes(4, 4, torch.zeros(3, 5, 2, 2, 16))
    assert not takes(4, 4, torch.zeros(3, 16, 2, 3, 16))  # query heads in no whole groups
    assert not takes(4, 4, torch.zeros(3, 16, 2, 2, 24))  # a head dim of no power of two
    assert not takes(600, 4, torch.zeros(3, 16, 2, 2, 16))  # too many rows


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(("num_rows", "start"), [(1, 4095), (64, 32704), (509, 2000)])
@pytest.mark.parametrize(("num_heads", "num_kv", "dim"), [(32, 8, 64), (32, 8, 128), (9, 3, 64)])
def test_paged_attention_on_cuda(num_rows, start, num_heads, num_kv, dim):
    """bf16 at the benchmark models' shapes (and SmolLM2's group of 3), 64-token pages."""
    pool, table = _pool_and_request(start + num_rows, num_kv, dim, 64, torch.bfloat16, "cuda")
    q = torch.randn(num_rows, num_heads, dim, device="cuda", dtype=torch.bfloat16)
    out = paged_attention(q, start, pool, table, scale=dim**-0.5)
    want = _reference(q, start, pool, table, dim**-0.5)
    torch.testing.assert_close(out.double(), want, rtol=2e-2, atol=2e-2)


def test_the_dense_path_over_the_pages_is_the_same_model(monkeypatch):
    """The dense path (CUDA's, on the CPU here) attending over the pages: a cold prompt's
    chunks and then decode steps, the same tokens and, to float32 rounding, the logits of
    attention over gathered keys."""
    config = dataclasses.replace(ENGINE, batch_invariant=False, prefill_chunk_tokens=48)
    model, _ = load_model(None, config, seed=2, model_config=SMALL)
    assert model.block_rows is None and not model.attend_pages  # CUDA only by default
    calls = []
    kernel = paged.paged_attention
    monkeypatch.setattr(
        paged, "paged_attention", lambda *a, **k: calls.append(1) or kernel(*a, **k)
    )
    prompt = random_prompt(7, 100)
    params = SamplingParams(max_new_tokens=3, return_logits=True)
    engine = cache_off(model, config)
    plain = run_one(engine, prompt, params)
    model.attend_pages = True
    over_pages = run_one(engine, prompt, params)
    # every source layer of the 3 prefill chunks and 2 decode steps (a chunk of 48 rows fits)
    assert len(calls) == SMALL.num_source_layers * 5
    assert over_pages.token_ids == plain.token_ids
    torch.testing.assert_close(over_pages.logits, plain.logits, rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # the Triton interpreter over every layer: 166 s on a loaded 2-core machine
def test_source_layers_read_from_the_device_step_are_the_same_model(monkeypatch):
    """A one-request step run layer by layer as CUDA graphs would (`Model.layer_steps`,
    each layer reading the step from the device: on the CPU here, without graphs): a cold
    prompt's chunks (the later ones over the pages of the earlier: as a hit's step) and
    decode steps, the tokens and, to float32 rounding, the logits of the layer-by-layer
    path."""
    num_source_layers = 3
    config = dataclasses.replace(ENGINE, batch_invariant=False, prefill_chunk_tokens=48)
    model_config = SMALL.replace(
        num_layers=num_source_layers + 2,
        num_source_layers=num_source_layers,
        model_id=f"test-small-{num_source_layers}",
    )
    model, _ = load_model(None, config, seed=2, model_config=model_config)
    model.attend_pages = True
    assert not model.layer_steps  # CUDA only by default
    steps = []
    method = type(model)._source_layers_on_device
    monkeypatch.setattr(
        type(model),
        "_source_layers_on_device",
        lambda self, *a: steps.append(a[5].num_rows) or method(self, *a),
    )
    prompt = random_prompt(8, 100)
    params = SamplingParams(max_new_tokens=3, return_logits=True)
    engine = cache_off(model, config)
    plain = run_one(engine, prompt, params)
    model.layer_steps = True
    on_device = run_one(engine, prompt, params)
    assert steps == [48, 48, 4, 1, 1]  # every step: the chunks and the decode steps
    assert on_device.token_ids == plain.token_ids
    torch.testing.assert_close(on_device.logits, plain.logits, rtol=1e-5, atol=1e-5)
