"""A cached hit equals, bit for bit, the uncached, unsplit prefill (DESIGN.md).

The hits come from each tier: L1; L2 after the L1 copy is evicted; L3 after a restart
(a new cache and engine over the same file:// directory). Each cache-on output is compared
with the cache-off engine on the same prompt: greedy tokens equal, logits `torch.equal`.
"""

from __future__ import annotations

import dataclasses

import torch

from engine_integration.engine.sampling import SamplingParams
from tests.support.engines import ENGINE, GREEDY, cache_off, random_prompt, run_one

LONG = SamplingParams(max_new_tokens=20, return_logits=True)


def _assert_same_as_cold(model, output, params=GREEDY):
    baseline = run_one(cache_off(model), output.prompt_token_ids, params)
    assert output.token_ids == baseline.token_ids
    assert torch.equal(output.logits, baseline.logits)


def _first_then_second(first_length=150, shared=100, extra=30):
    first = random_prompt(1, first_length)
    second = first[:shared] + random_prompt(2, extra)
    return first, second


def test_hit_from_l1_equals_cold_prefill(small_model, engines):
    engine = engines(small_model)
    first, second = _first_then_second()
    cold = run_one(engine, first)
    assert cold.metrics.total_hit_tokens == 0
    hit = run_one(engine, second)
    assert hit.metrics.hit_tokens == {"l1": 96, "l2": 0, "l3": 0}
    assert hit.metrics.replayed_tokens == 96 - (130 - 63)  # late rows: the last 2 * 31 + 1
    _assert_same_as_cold(small_model, hit)
    engine.cache.check_invariants()


def test_hit_from_l2_after_eviction_equals_cold_prefill(small_model, engines):
    engine = engines(small_model, l2_pages=64)
    first, second = _first_then_second()
    run_one(engine, first)
    engine.cache.flush()
    assert engine.cache.evict("l1", 1000) > 0
    hit = run_one(engine, second)
    assert hit.metrics.hit_tokens == {"l1": 0, "l2": 96, "l3": 0}
    _assert_same_as_cold(small_model, hit)
    engine.cache.check_invariants()


def test_hit_from_l3_after_restart_equals_cold_prefill(small_model, engines, tmp_path):
    url = f"file://{tmp_path}/l3?capacity=64MiB"
    first, second = _first_then_second()
    before = engines(small_model, l2_pages=64, l3_url=url)
    run_one(before, first)
    before.cache.flush()
    before.cache.close()
    after = engines(small_model, l2_pages=64, l3_url=url)  # a new cache: cold L1 and L2
    hit = run_one(after, second)
    assert hit.metrics.hit_tokens == {"l1": 0, "l2": 0, "l3": 96}
    _assert_same_as_cold(small_model, hit)


def test_hit_on_pages_written_by_decode_equals_cold_prefill(small_model, engines):
    """The next turn of a conversation hits pages whose KV the decode loop wrote."""
    engine = engines(small_model)
    turn1 = run_one(engine, random_prompt(3, 150), LONG)
    history = turn1.prompt_token_ids + turn1.token_ids  # 170 tokens, 169 with KV
    turn2 = run_one(engine, history + random_prompt(4, 12))
    assert turn2.metrics.hit_tokens["l1"] == 160  # ten full pages, the last two decoded
    _assert_same_as_cold(small_model, turn2)


def test_long_hit_past_the_coarse_attention_tile_equals_cold_prefill(small_model, engines):
    """A hit that ends past the attention's coarsest tile (512 positions with 8-row blocks),
    and a next turn over the pages its decode wrote."""
    engine = engines(small_model)
    first = random_prompt(21, 700)
    run_one(engine, first)
    second = run_one(engine, first[:590] + random_prompt(22, 40), LONG)
    assert second.metrics.hit_tokens["l1"] == 576
    _assert_same_as_cold(small_model, second, LONG)
    history = second.prompt_token_ids + second.token_ids
    third = run_one(engine, history + random_prompt(23, 9))
    assert third.metrics.hit_tokens["l1"] == 640  # 40 full pages, the last 10 tokens decoded
    _assert_same_as_cold(small_model, third)


def test_concurrent_requests_sharing_a_prefix(small_model, engines):
    engine = engines(small_model)
    system = random_prompt(5, 70)
    run_one(engine, system + random_prompt(6, 10))
    users = [system + random_prompt(10 + i, 20 + 9 * i) for i in range(4)]
    outputs = engine.generate(users, GREEDY)
    for output in outputs:
        assert output.metrics.hit_tokens["l1"] == 64
        _assert_same_as_cold(small_model, output)


def test_source_only_model_hit_equals_unsplit_cold_prefill(source_only_model, engines):
    """No late layers, so nothing depends on the boundary: a hit equals a plain cold
    prefill. Bitwise here (batch-invariant); within float tolerance on the dense path."""
    first, second = _first_then_second()
    engine = engines(source_only_model)
    run_one(engine, first)
    hit = run_one(engine, second)
    assert hit.metrics.total_hit_tokens == 96 and hit.metrics.replayed_tokens == 0
    cold = run_one(cache_off(source_only_model), second)
    assert hit.token_ids == cold.token_ids
    assert torch.equal(hit.logits, cold.logits)


def test_source_only_dense_path_hit_is_close_to_cold(engines):
    from engine_integration.engine.embedded import load_model
    from tests.support.engines import SMALL

    config = dataclasses.replace(ENGINE, batch_invariant=False)
    model, _ = load_model(None, config, seed=2, model_config=SMALL.replace(num_source_layers=4))
    first, second = _first_then_second()
    engine = engines(model, config=config)
    run_one(engine, first)
    hit = run_one(engine, second)
    assert hit.metrics.total_hit_tokens == 96
    cold = run_one(cache_off(model, config), second)
    assert hit.token_ids == cold.token_ids
    torch.testing.assert_close(hit.logits, cold.logits, rtol=1e-4, atol=1e-4)


def test_a_late_layer_over_a_fresh_window_runs_whole_with_the_same_bits(engines, monkeypatch):
    """Dense batches run a late layer whose ring holds nothing its rows see (a prefill's
    first late rows: a cold prompt's, a hit's replay with its new rows) as one call, on CUDA
    one graph (`Model._fresh_window_layer`): here on the CPU, cold and on a hit, logits
    bit for bit those of the layer-by-layer path, and each late layer took it."""
    from engine_integration.engine.embedded import load_model
    from engine_integration.engine.model.forward import Model
    from tests.support.engines import SMALL

    config = dataclasses.replace(ENGINE, batch_invariant=False, prefill_chunk_tokens=512)
    model, _ = load_model(None, config, seed=2, model_config=SMALL)
    first, second = _first_then_second()
    whole = Model._fresh_window_layer
    ran = []

    def spy(self, weights, x, layout, rope, finish):
        ran.append(finish)
        return whole(self, weights, x, layout, rope, finish)

    def run():
        engine = engines(model, config=config)
        return run_one(engine, first), run_one(engine, second)

    monkeypatch.setattr(Model, "_fresh_window_layer", spy)
    fused = run()
    assert fused[1].metrics.total_hit_tokens == 96 and fused[1].metrics.replayed_tokens > 0
    assert ran == [True, False] * 2  # both late layers, cold then the hit (the last unfinished)
    monkeypatch.setattr(Model, "_fresh_window", lambda self, runs, layer: False)
    layered = run()
    for whole_out, layer_out in zip(fused, layered, strict=True):
        assert whole_out.token_ids == layer_out.token_ids
        assert torch.equal(whole_out.logits, layer_out.logits)


def test_the_cuda_warm_up_reaches_every_graph_a_request_would(monkeypatch):
    """What `warm_up` runs on CUDA (`warm_up_lengths`), traced here on the CPU's dense path:
    every (part, layer, row bucket) that requests of other lengths reach (each a CUDA graph
    there: a layer's row-wise halves, a late layer run whole) was reached by the warm-up
    prompts, late rows that cross a chunk boundary included: a first request captures
    nothing."""
    from engine_integration.engine.embedded import load_model, warm_up_lengths
    from engine_integration.engine.model.forward import Model
    from engine_integration.engine.model.graphs import bucket
    from tests.support.engines import SMALL

    config = dataclasses.replace(ENGINE, batch_invariant=False, prefill_chunk_tokens=64)
    model, _ = load_model(None, config, seed=2, model_config=SMALL)
    reached: set = set()
    for part in ("_project", "_finish_layer", "_fresh_window_layer"):
        original = getattr(Model, part)

        def spy(self, weights, x, *args, _part=part, _original=original):
            reached.add((_part, id(weights), bucket(x.shape[0])))
            return _original(self, weights, x, *args)

        monkeypatch.setattr(Model, part, spy)

    def run(lengths, max_new_tokens):
        engine = cache_off(model, config)
        for seed, length in enumerate(lengths):
            params = SamplingParams(max_new_tokens=max_new_tokens)
            run_one(engine, random_prompt(seed, length), params)

    run(warm_up_lengths(model.config, config, max_rows=256), 2)
    warmed = set(reached)
    reached.clear()
    run([20, 90, 250, 131, 70], 4)
    assert reached and reached <= warmed, sorted(reached - warmed)
