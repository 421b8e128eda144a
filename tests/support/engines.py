"""Small models, prompts and engines for the engine tests (CPU, float32)."""

from __future__ import annotations

import random

from engine_integration.engine.core import Engine
from engine_integration.engine.model.config import EngineConfig, ModelConfig
from engine_integration.engine.sampling import SamplingParams
from hicache.config import PolicyConfig

# 4 layers (2 source, 2 late), a 32-token window, 16-token pages, 8-row blocks.
SMALL = ModelConfig(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=128,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    num_source_layers=2,
    window_tokens=32,
    model_id="test-small",
)
ENGINE = EngineConfig(page_size=16, block_tokens=8, prefill_chunk_tokens=64, max_running_requests=4)
GREEDY = SamplingParams(max_new_tokens=6, return_logits=True)
# Write-through (so L2 holds every page), waiting for L3 prefetches, and every L2 and L3 run
# loaded whatever the rates (the load-or-recompute choice rests on timings): deterministic
# tiers. Tests of that choice pass a measured policy of their own.
TEST_POLICY = PolicyConfig(
    write_policy="write_through",
    prefetch_policy="wait_complete",
    l3_fetch_policy="always",
    l2_load_policy="always",
)


def random_prompt(seed: int, length: int, vocab: int = 96) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(length)]


def cache_off(model, config: EngineConfig = ENGINE, num_pages: int = 256) -> Engine:
    """The baseline: an engine with a private pool and no cache."""
    return Engine(model, config, num_private_pages=num_pages)


def run_one(engine: Engine, tokens, params: SamplingParams = GREEDY, **kwargs):
    """Queue one request, run the engine dry, return the request's output."""
    request = engine.add_request(tokens, params, **kwargs)
    outputs = {output.request_id: output for output in engine.run()}
    return outputs[request.request_id]


def run_through_tiers(
    model, config: EngineConfig, sizes, first, second, params, *, with_stats: bool = False
) -> dict:
    """`first` cold on a cache of `sizes` (or several warm-up prompts in turn: a dict of
    label -> tokens), then `second` as a hit from L1, from L2 (L1 evicted), and from L3 on a
    new cache over the same store: {"cold" (or the labels), "L1 hit", "L2 hit", "L3 hit"} ->
    its output; `with_stats`: and "stats", the first cache's stats after the L2 hit."""
    from engine_integration.engine.embedded import build_cache

    warm_up = first if isinstance(first, dict) else {"cold": first}
    out = {}
    cache = build_cache(model, config, sizes)
    try:
        engine = Engine(model, config, cache=cache)
        for label, tokens in warm_up.items():
            out[label] = run_one(engine, tokens, params)
        out["L1 hit"] = run_one(engine, second, params)
        cache.flush()
        cache.evict("l1", 10_000)
        out["L2 hit"] = run_one(engine, second, params)
        cache.flush()
        if with_stats:
            out["stats"] = cache.stats()
    finally:
        cache.close()
    cache = build_cache(model, config, sizes)
    try:
        out["L3 hit"] = run_one(Engine(model, config, cache=cache), second, params)
    finally:
        cache.close()
    return out
