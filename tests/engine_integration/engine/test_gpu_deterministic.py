"""The deterministic path on CUDA (issue 41): a prefix hit never changes a logit's bits.

For the built-in hybrid model and a Llama-shaped one, in bfloat16 and float32: the logits
of every step (prefill and decode) of a prompt served with the cache off, alone and in one
prefill chunk, are the reference; the same prompt must give them bit for bit chunked, batched
with other requests, and as a hit from L1, L2 and L3 at several page boundaries, alone and
batched. Then the kernels at their real tile sizes, and CUDA graphs against eager launches.
Run on the GPU machine: pytest -m gpu (benchmarks/gpu_check_engine.sh)."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from engine_integration.engine.core import Engine
from engine_integration.engine.embedded import CacheSizes, build_cache, load_model, warm_up
from engine_integration.engine.model import deterministic, deterministic_attention
from engine_integration.engine.model.config import EngineConfig, ModelConfig, tiny_model_config
from engine_integration.engine.model.forward import Model
from engine_integration.engine.sampling import SamplingParams
from tests.support.engines import TEST_POLICY, random_prompt, run_one, run_through_tiers
from tests.support.reference_model import reference_logits

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

HYBRID = tiny_model_config(0)  # the built-in model: 4 source layers, 2 on a 128-token window
LLAMA = ModelConfig(
    vocab_size=512,
    hidden_size=512,
    intermediate_size=1024,
    num_layers=4,
    num_heads=8,
    num_kv_heads=2,
    head_dim=64,
    num_source_layers=4,
    rope_theta=500000.0,
    model_id="test-llama-shape",
)
MODELS = {"hybrid": HYBRID, "llama": LLAMA}
UNCHUNKED = EngineConfig(
    device="cuda",
    page_size=16,
    prefill_chunk_tokens=4096,
    max_running_requests=4,
    deterministic=True,
)
CHUNKED = dataclasses.replace(UNCHUNKED, prefill_chunk_tokens=64)
PARAMS = SamplingParams(max_new_tokens=4, return_logits=True)
POLICY = TEST_POLICY  # every tier served whatever the rates: tiers compared bitwise
BOUNDARIES = (64, 256, 432)  # page-aligned prefixes a hit covers
FIRST_TOKENS = 600


@pytest.fixture(scope="module", params=[(m, d) for m in MODELS for d in ("bfloat16", "float32")],
                ids=lambda p: f"{p[0]}-{p[1]}")  # fmt: skip
def case(request):
    """(model, its engine config, unchunked) for one model and dtype."""
    name, dtype = request.param
    config = dataclasses.replace(UNCHUNKED, dtype=dtype)
    model, _ = load_model(None, config, seed=7, model_config=MODELS[name])
    assert model.deterministic and model.dtype == getattr(torch, dtype)
    return model, config


def _prompts(model):
    vocab = model.config.vocab_size
    first = random_prompt(1, FIRST_TOKENS, vocab)
    return first, {b: first[:b] + random_prompt(100 + b, 40, vocab) for b in BOUNDARIES}


def _others(model):
    vocab = model.config.vocab_size
    return [random_prompt(50, 300, vocab), random_prompt(51, 90, vocab)]


def _unchunked(config: EngineConfig) -> EngineConfig:
    return dataclasses.replace(config, prefill_chunk_tokens=UNCHUNKED.prefill_chunk_tokens)


def _chunked(config: EngineConfig, chunked: bool) -> EngineConfig:
    if not chunked:
        return config
    return dataclasses.replace(config, prefill_chunk_tokens=CHUNKED.prefill_chunk_tokens)


def _cold(model, config, prompt):
    """The reference: the cache off, the prompt alone."""
    return run_one(Engine(model, config, num_private_pages=256), prompt, PARAMS)


def _assert_same(output, reference, what):
    assert output.token_ids == reference.token_ids, what
    assert output.logits.shape == reference.logits.shape, what
    diff = (output.logits - reference.logits).abs().max().item()
    assert torch.equal(output.logits, reference.logits), f"{what}: logits differ by up to {diff}"


def test_the_deterministic_model_matches_the_float64_reference(case):
    """The same model as the checkpoint's plain float64 forward pass, to the dtype's
    rounding: bitwise equal to itself is not enough."""
    model, config = case
    tokens = random_prompt(3, 300, model.config.vocab_size)
    output = run_one(Engine(model, config, num_private_pages=64), tokens, PARAMS)
    expected = reference_logits(model.config, model.weights, tokens)[-1:].double()
    actual = output.logits[:1].double()
    error = float((actual - expected).norm() / expected.norm())
    assert error < (2e-2 if model.dtype == torch.bfloat16 else 1e-4), error


@pytest.mark.parametrize("chunked", [False, True], ids=["unchunked", "chunked"])
def test_the_cache_off_prompt_has_the_same_bits_chunked_and_batched(case, chunked):
    model, config = case
    config = _chunked(config, chunked)
    _, seconds = _prompts(model)
    prompt = seconds[BOUNDARIES[-1]]
    reference = _cold(model, _unchunked(config), prompt)
    _assert_same(_cold(model, config, prompt), reference, "alone")
    engine = Engine(model, config, num_private_pages=512)
    batched = engine.generate([_others(model)[0], prompt, _others(model)[1]], PARAMS)
    _assert_same(batched[1], reference, "batched")


@pytest.mark.parametrize("chunked", [False, True], ids=["unchunked", "chunked"])
def test_hits_from_every_tier_and_boundary_give_the_cache_off_bits(case, chunked, tmp_path):
    """Hits from L1 at three boundaries, then from L2 and L3 (each with the late window's
    replay on the hybrid model): the cache-off logits of the unchunked prompt alone, every
    step."""
    model, config = case
    config = _chunked(config, chunked)
    first, seconds = _prompts(model)
    for boundary, second in seconds.items():
        reference = _cold(model, _unchunked(config), second)
        url = f"file://{tmp_path}/l3-{boundary}?capacity=256MiB"
        sizes = CacheSizes(l1_pages=256, l2_pages=256, l3_url=url, policy=POLICY)
        outputs = run_through_tiers(model, config, sizes, first, second, PARAMS)
        # L1: the first prompt's pages; L2 and L3: the second's own too (the L1 hit's insert)
        assert outputs["L1 hit"].metrics.hit_tokens["l1"] == boundary
        full_pages = (len(second) - 1) // config.page_size * config.page_size
        assert outputs["L2 hit"].metrics.hit_tokens["l2"] == full_pages
        assert outputs["L3 hit"].metrics.hit_tokens["l3"] == full_pages
        for tier in ("L1 hit", "L2 hit", "L3 hit"):
            _assert_same(outputs[tier], reference, f"{tier} at {boundary}")


@pytest.mark.parametrize("chunked", [False, True], ids=["unchunked", "chunked"])
def test_hits_batched_with_other_requests_give_the_cache_off_bits(case, chunked):
    """Hits at every boundary, all in one batch with two cold requests (their rows in the
    same steps, their decode steps together)."""
    model, config = case
    config = _chunked(config, chunked)
    first, seconds = _prompts(model)
    references = {b: _cold(model, _unchunked(config), p) for b, p in seconds.items()}
    cache = build_cache(model, config, CacheSizes(l1_pages=512, policy=POLICY))
    try:
        engine = Engine(model, config, cache=cache)
        run_one(engine, first, PARAMS)
        pairs = itertools.zip_longest(seconds.values(), _others(model))  # hits, cold between
        outputs = engine.generate([p for pair in pairs for p in pair if p is not None], PARAMS)
    finally:
        cache.close()
    by_prompt = {tuple(o.prompt_token_ids): o for o in outputs}
    for boundary, second in seconds.items():
        output = by_prompt[tuple(second)]
        assert output.metrics.total_hit_tokens == boundary
        _assert_same(output, references[boundary], f"batched hit at {boundary}")


def test_cuda_graphs_give_the_eager_kernels_bits(case):
    """The row-wise halves replay as CUDA graphs padded to a row bucket: the same bits as
    eager launches of the real rows, and graphs were captured and reused."""
    model, config = case
    eager = Model(model.config, model.weights, block_rows=None, cuda_graphs=False,
                  deterministic=True)  # fmt: skip
    _, seconds = _prompts(model)
    prompt = seconds[BOUNDARIES[1]]
    graphed = _cold(model, config, prompt)
    assert model.num_graphs > 0
    _assert_same(_cold(eager, config, prompt), graphed, "eager")


def test_warm_up_runs_the_deterministic_path(case):
    model, config = case
    warm_up(model, config, max_rows=256)
    assert model.num_graphs > 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_matmul_gives_a_row_its_bits_at_any_row_count(dtype):
    generator = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(2048, 1024, device="cuda", generator=generator).to(dtype)
    weight = torch.randn(3000, 1024, device="cuda", generator=generator).to(dtype) / 32
    full = deterministic.matmul(x, weight)
    want = torch.nn.functional.linear(x.double(), weight.double())
    tolerance = {torch.bfloat16: 2e-2, torch.float16: 3e-3}.get(dtype, 1e-4)
    assert ((full.double() - want).abs() / want.abs().clamp_min(1)).max() < tolerance
    for start, count in ((0, 1), (5, 3), (100, 7), (64, 64), (1, 129), (1000, 1000)):
        rows = slice(start, start + count)
        assert torch.equal(deterministic.matmul(x[rows], weight), full[rows]), (start, count)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(("num_heads", "num_kv", "dim"), [(32, 8, 64), (32, 8, 128)])
def test_attention_gives_a_query_its_bits_whatever_the_call(dtype, num_heads, num_kv, dim):
    """At the real cuts (64-key tiles, 1,024-key partitions) over 3,000 keys: queries in
    calls of 1 (a decode step: split), 3, 64 and 300 rows equal one call's rows, split or
    merged in place."""
    length, page = 3000, 64
    generator = torch.Generator(device="cuda").manual_seed(dim)
    num_pages = -(-length // page)
    pool = torch.randn(num_pages + 4, page, 2, num_kv, dim, device="cuda", generator=generator)
    pool = pool.to(dtype)
    table = torch.randperm(num_pages + 4, device="cuda", generator=generator)[:num_pages]
    q = torch.randn(length, num_heads, dim, device="cuda", generator=generator).to(dtype)
    attend = deterministic_attention.paged_attention
    full = attend(q, 0, pool, table, scale=dim**-0.5, split=False)
    for start, count in ((2999, 1), (1023, 1), (1024, 3), (2000, 64), (2700, 300), (0, 300)):
        end = start + count
        for split in (False, True):
            part = attend(q[start:end], start, pool, table, scale=dim**-0.5, split=split)
            assert torch.equal(part, full[start:end]), (start, count, split)
