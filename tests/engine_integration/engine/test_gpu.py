"""The engine on CUDA: bf16, the dense path (SDPA over gathered pages), pinned L2 through the
Triton copy kernels, per-layer load waits. Run on the GPU machine: pytest -m gpu."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine_integration.engine.core import Engine
from engine_integration.engine.embedded import CacheSizes, build_cache, load_model
from engine_integration.engine.model.config import EngineConfig
from engine_integration.engine.sampling import SamplingParams
from tests.support.engines import SMALL, TEST_POLICY, random_prompt, run_one
from tests.support.reference_model import reference_logits

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

GPU = EngineConfig(device="cuda", page_size=16, prefill_chunk_tokens=64, max_running_requests=4)
# A model with the tiny model's proportions but wider heads, as real models have.
GPU_MODEL = SMALL.replace(hidden_size=256, intermediate_size=512, head_dim=64, vocab_size=128)
PARAMS = SamplingParams(max_new_tokens=4, return_logits=True)
POLICY = TEST_POLICY  # every tier served whatever the rates: tiers compared bitwise


def _relative_error(actual, expected):
    return float((actual.double() - expected.double()).norm() / expected.double().norm())


@pytest.fixture(scope="module")
def gpu_model():
    model, _ = load_model(None, GPU, seed=3, model_config=GPU_MODEL)
    assert model.dtype == torch.bfloat16 and model.block_rows is None
    return model


def test_bf16_engine_matches_the_float64_reference(gpu_model):
    engine = Engine(gpu_model, GPU, num_private_pages=64)
    tokens = random_prompt(1, 300, GPU_MODEL.vocab_size)
    output = run_one(engine, tokens, SamplingParams(max_new_tokens=1, return_logits=True))
    expected = reference_logits(GPU_MODEL, gpu_model.weights, tokens)[-1:]
    assert _relative_error(output.logits, expected) < 2e-2  # bf16 weights and activations


def test_hits_from_l1_l2_and_l3_compute_the_same_logits(gpu_model, tmp_path):
    """A hit from L2 or L3 runs the very computation of an L1 hit over the same bytes:
    logits bitwise equal. A load read before its layer landed would break that."""
    url = f"file://{tmp_path}/l3?capacity=256MiB"
    sizes = CacheSizes(l1_pages=128, l2_pages=256, l3_url=url, policy=POLICY)
    cache = build_cache(gpu_model, GPU, sizes)
    engine = Engine(gpu_model, GPU, cache=cache)
    tokens = random_prompt(2, 600, GPU_MODEL.vocab_size)
    run_one(engine, tokens, PARAMS)
    cache.flush()
    from_l1 = run_one(engine, tokens, PARAMS)
    assert from_l1.metrics.hit_tokens["l1"] == 592
    cache.evict("l1", 10_000)
    from_l2 = run_one(engine, tokens, PARAMS)
    assert from_l2.metrics.hit_tokens["l2"] == 592
    assert cache.stats().pages_moved["l2_to_l1"] >= 37
    cache.flush()
    cache.close()
    cache = build_cache(gpu_model, GPU, sizes)
    try:
        from_l3 = run_one(Engine(gpu_model, GPU, cache=cache), tokens, PARAMS)
    finally:
        cache.close()
    assert from_l3.metrics.hit_tokens["l3"] == 592
    for other in (from_l2, from_l3):
        assert other.token_ids == from_l1.token_ids
        assert torch.equal(other.logits, from_l1.logits)


def test_a_new_cache_starts_from_its_links_rate_and_the_models_compute(gpu_model):
    """A cache built after the model ran (warm-up) weighs its first L3 run by measured
    rates: the link's, timed when its transfer engine warmed up, and the model's steps."""
    Engine(gpu_model, GPU, num_private_pages=64).generate(
        [random_prompt(9, n, GPU_MODEL.vocab_size) for n in (40, 100, 200)], PARAMS
    )
    sizes = CacheSizes(l1_pages=1024, l2_pages=1024, policy=POLICY)  # 24 MiB of pages each
    cache = build_cache(gpu_model, GPU, sizes)
    try:
        Engine(gpu_model, GPU, cache=cache)
        rates = cache.fetch_rates()
        assert rates.num_load_samples == 1 and rates.l2_load_bytes_per_s > 1e9
        assert rates.num_compute_samples == len(gpu_model.step_costs) > 0
    finally:
        cache.close()


def test_hit_is_close_to_the_cache_off_prefill(gpu_model):
    cache = build_cache(gpu_model, GPU, CacheSizes(l1_pages=128, policy=POLICY))
    try:
        engine = Engine(gpu_model, GPU, cache=cache)
        first = random_prompt(3, 400, GPU_MODEL.vocab_size)
        run_one(engine, first, PARAMS)
        second = first[:350] + random_prompt(4, 20, GPU_MODEL.vocab_size)  # suffix < 2W - 1
        hit = run_one(engine, second, PARAMS)
    finally:
        cache.close()
    reach = 2 * (GPU_MODEL.window_tokens - 1) + 1
    assert hit.metrics.hit_tokens["l1"] == 336
    assert hit.metrics.replayed_tokens == 336 - (len(second) - reach)
    off = Engine(gpu_model, GPU, num_private_pages=64)
    cold = run_one(off, second, PARAMS)
    # bf16 matmuls over differently shaped batches round differently: close, not equal
    assert _relative_error(hit.logits[:1], cold.logits[:1]) < 1e-2


def test_batch_invariant_mode_runs_on_cuda(gpu_model):
    config = dataclasses.replace(GPU, batch_invariant=True, block_tokens=16)
    model, _ = load_model(None, config, seed=3, model_config=GPU_MODEL)
    tokens = random_prompt(5, 200, GPU_MODEL.vocab_size)
    blocked = run_one(Engine(model, config, num_private_pages=64), tokens, PARAMS)
    dense = run_one(Engine(gpu_model, GPU, num_private_pages=64), tokens, PARAMS)
    assert _relative_error(blocked.logits[:1], dense.logits[:1]) < 2e-2


def test_cuda_graphs_compute_what_the_eager_kernels_compute(gpu_model):
    """The row-wise halves of each layer replay as CUDA graphs (padded to a bucket of rows):
    the same model as the eager kernels, to bf16 rounding, with the same greedy tokens, and
    a graph is reused, not captured again, by another prompt whose steps have the same sizes."""
    from engine_integration.engine.model.forward import Model

    eager = Model(GPU_MODEL, gpu_model.weights, block_rows=None, cuda_graphs=False)
    graphed = Model(GPU_MODEL, gpu_model.weights, block_rows=None)
    params = SamplingParams(max_new_tokens=6, return_logits=True)
    outputs = {}
    for name, model in (("eager", eager), ("graphed", graphed)):
        engine = Engine(model, GPU, num_private_pages=64)
        outputs[name] = [run_one(engine, random_prompt(seed, 150 + 37 * seed,
                                 GPU_MODEL.vocab_size), params) for seed in range(3)]  # fmt: skip
    assert graphed._graphs.num_graphs > 0
    for eager_out, graphed_out in zip(outputs["eager"], outputs["graphed"], strict=True):
        assert graphed_out.token_ids == eager_out.token_ids
        assert _relative_error(graphed_out.logits, eager_out.logits) < 1e-2
    captured = graphed._graphs.num_graphs
    engine = Engine(graphed, GPU, num_private_pages=64)
    run_one(engine, random_prompt(9, 150, GPU_MODEL.vocab_size), params)  # the same steps
    assert graphed._graphs.num_graphs == captured


def test_a_late_layer_over_a_fresh_window_runs_as_one_graph(gpu_model):
    """A late layer whose ring holds nothing its rows see (a prefill's first late rows: a
    cold prompt's, a hit's replay with its new rows) replays one graph (projection, window
    attention, the rest of the layer): the logits of the eager kernels to bf16 rounding and
    the same greedy tokens, cold and on a hit, and a later prompt of the same buckets
    captures nothing."""
    from engine_integration.engine.model.forward import Model

    config = dataclasses.replace(GPU, prefill_chunk_tokens=512)
    vocab = GPU_MODEL.vocab_size
    first = random_prompt(11, 300, vocab)
    prompts = [first, first[:260] + random_prompt(12, 30, vocab)]  # cold, then a hit
    eager = Model(GPU_MODEL, gpu_model.weights, block_rows=None, cuda_graphs=False)
    graphed = Model(GPU_MODEL, gpu_model.weights, block_rows=None)
    outputs = {}
    for name, model in (("eager", eager), ("graphed", graphed)):
        cache = build_cache(model, config, CacheSizes(l1_pages=128, policy=POLICY))
        try:
            engine = Engine(model, config, cache=cache)
            outputs[name] = [run_one(engine, prompt, PARAMS) for prompt in prompts]
            if name == "graphed":
                fused = {key for key, _size in graphed._graphs._graphs if key[0] == "fresh window"}
                captured = graphed._graphs.num_graphs
                run_one(engine, random_prompt(13, 290, vocab), PARAMS)  # the cold one's buckets
                assert graphed._graphs.num_graphs == captured
        finally:
            cache.close()
    assert len(fused) == GPU_MODEL.num_late_layers  # the last one without its finish
    hit = outputs["graphed"][1].metrics
    assert hit.hit_tokens["l1"] == 256 and hit.replayed_tokens > 0
    for eager_out, graphed_out in zip(outputs["eager"], outputs["graphed"], strict=True):
        assert graphed_out.token_ids == eager_out.token_ids
        assert _relative_error(graphed_out.logits, eager_out.logits) < 1e-2


def test_a_one_request_step_runs_each_source_layer_as_one_graph(gpu_model):
    """A step of one request and few rows (a cold prompt's, a hit's, a decode step) replays
    one graph a source layer, which reads the step's position, rows, page table and pool
    layers from the device: the logits of the layer-by-layer path to bf16 rounding, the same
    greedy tokens, and a later prompt of the same buckets, over another pool, captures
    nothing."""
    from engine_integration.engine.model.forward import Model

    vocab = GPU_MODEL.vocab_size
    first = random_prompt(21, 200, vocab)
    prompts = [first, first[:160] + random_prompt(22, 30, vocab)]  # cold, then a hit
    by_layer = Model(GPU_MODEL, gpu_model.weights, block_rows=None)
    by_layer.layer_steps = False
    on_device = Model(GPU_MODEL, gpu_model.weights, block_rows=None)
    outputs = {}
    for name, model in (("by layer", by_layer), ("on device", on_device)):
        cache = build_cache(model, GPU, CacheSizes(l1_pages=128, policy=POLICY))
        try:
            engine = Engine(model, GPU, cache=cache)
            outputs[name] = [run_one(engine, prompt, PARAMS) for prompt in prompts]
        finally:
            cache.close()
    keys = {key for key, _size in on_device._graphs._graphs if key[0] == "layer on device"}
    assert len(keys) == GPU_MODEL.num_source_layers - 1
    assert outputs["on device"][1].metrics.hit_tokens["l1"] == 160
    for by_layer_out, on_device_out in zip(outputs["by layer"], outputs["on device"], strict=True):
        assert on_device_out.token_ids == by_layer_out.token_ids
        assert _relative_error(on_device_out.logits, by_layer_out.logits) < 1e-2
    captured = on_device._graphs.num_graphs
    engine = Engine(on_device, GPU, num_private_pages=64)  # another pool
    again = run_one(engine, prompts[0], PARAMS)
    assert on_device._graphs.num_graphs == captured
    assert again.token_ids == outputs["on device"][0].token_ids


def test_warm_up_captures_the_graphs_a_first_request_would(gpu_model):
    """After `warm_up` (what the demo runs at start), requests whose steps fit the warmed
    buckets capture nothing: their first call costs nothing extra."""
    from engine_integration.engine.embedded import warm_up
    from engine_integration.engine.model.forward import Model

    model = Model(GPU_MODEL, gpu_model.weights, block_rows=None)
    warm_up(model, GPU, max_rows=256)
    captured = model._graphs.num_graphs
    assert captured > 0
    engine = Engine(model, GPU, num_private_pages=64)
    for seed, length in enumerate((20, 90, 250)):
        run_one(engine, random_prompt(seed, length, GPU_MODEL.vocab_size), PARAMS)
    assert model._graphs.num_graphs == captured


def _compiled_kernels() -> int:
    """Variants of the engine's Triton kernels compiled so far in this process."""
    from engine_integration.engine.model import fused, paged_attention

    kernels = [
        fused._rms_norm_kernel,
        fused._rope_kernel,
        paged_attention._split_kernel,
        paged_attention._combine_kernel,
        paged_attention._write_kernel,
    ]
    return sum(len(entry[0]) for kernel in kernels for entry in kernel.device_caches.values())


def test_after_warm_up_no_request_waits_for_a_kernel_to_compile(gpu_model):
    """Triton compiles a kernel for each new set of its compile-time values (seconds each);
    after `warm_up` none is left for a request to meet: hits with 3 and 5 new rows, a long
    context (more key splits), two requests decoding together."""
    from engine_integration.engine.embedded import warm_up
    from engine_integration.engine.model.forward import Model

    model = Model(GPU_MODEL, gpu_model.weights, block_rows=None)
    warm_up(model, GPU, max_rows=256)
    compiled = _compiled_kernels()
    assert compiled > 0
    vocab = GPU_MODEL.vocab_size
    cache = build_cache(model, GPU, CacheSizes(l1_pages=128, policy=POLICY))
    try:
        engine = Engine(model, GPU, cache=cache)
        long = random_prompt(31, 1500, vocab)
        run_one(engine, long, PARAMS)
        run_one(engine, long[:1488] + random_prompt(32, 3, vocab), PARAMS)  # 3 rows
        run_one(engine, long[:1488] + random_prompt(33, 5, vocab), PARAMS)  # 5 rows
        both = [random_prompt(34, 40, vocab), random_prompt(35, 70, vocab)]
        engine.generate(both, SamplingParams(max_new_tokens=4))
    finally:
        cache.close()
    assert _compiled_kernels() == compiled


def test_attention_never_runs_on_cudnn_or_the_math_fallback(gpu_model):
    """cuDNN's SDPA builds an execution plan for each new pair of lengths on its first call
    (50-1,100 ms on the H200) and every request brings new lengths: the engine's attention,
    the late layers' masked window included, runs on the other backends, and never on the
    math fallback (which materialises the scores: a masked call with GQA falls there)."""
    from torch.profiler import ProfilerActivity, profile

    engine = Engine(gpu_model, GPU, num_private_pages=64)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for seed, length in enumerate((37, 150)):
            run_one(engine, random_prompt(seed, length, GPU_MODEL.vocab_size), PARAMS)
    names = {event.key for event in prof.key_averages()}
    assert any("attention" in name for name in names)
    assert not any("cudnn_attention" in name for name in names), sorted(names)
    assert not any("attention_math" in name for name in names), sorted(names)


def test_a_hit_step_never_waits_for_the_device(gpu_model):
    """The CPU queues a whole step (a hit with replay from the boundary residual, the window
    layers' masked attention, the head) without one synchronisation, so it runs ahead of the
    GPU instead of waiting for each kernel (`repeat_interleave` with a count, a pageable
    copy or an `.item()` would each stop it)."""
    cache = build_cache(gpu_model, GPU, CacheSizes(l1_pages=128, policy=POLICY))
    try:
        engine = Engine(gpu_model, GPU, cache=cache)
        first = random_prompt(5, 400, GPU_MODEL.vocab_size)
        run_one(engine, first, PARAMS)
        run_one(engine, first[:380] + random_prompt(6, 20, GPU_MODEL.vocab_size), PARAMS)
        engine.add_request(first[:350] + random_prompt(7, 20, GPU_MODEL.vocab_size), PARAMS)
        plan = engine.scheduler.schedule()
        assert plan[0][1].late_runs[0][0] < plan[0][1].start  # replayed rows
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            logits = engine.model.forward([rows for _, rows in plan], engine.pages.layer)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert torch.isfinite(logits).all()
        for request, _rows in plan:
            engine.scheduler.abort(request)
    finally:
        cache.close()


@pytest.mark.parametrize(("rows", "keys"), [(64, 1000), (300, 300)])
def test_source_attention_calls_flash_as_sdpa_would(rows, keys):
    """The dense source attention calls torch's flash kernel directly (no Python checks on
    every layer of every step): the very result SDPA gives with a lower-right causal bias."""
    from torch.nn.attention.bias import causal_lower_right

    from engine_integration.engine.model.attention import _flash_lower_right, _flash_takes, sdpa

    generator = torch.Generator(device="cuda").manual_seed(rows)
    q = torch.randn(rows, 32, 64, device="cuda", generator=generator).bfloat16()
    kv = torch.randn(keys, 2, 8, 64, device="cuda", generator=generator).bfloat16()
    assert _flash_takes(q, kv)
    direct = _flash_lower_right(q, kv, 0.125)
    assert torch.equal(direct, sdpa(q, kv, causal_lower_right(rows, keys), 0.125))
