"""Bytes the cache stores per cached token for an interleaved model, against every layer's KV.

Claim (docs/architecture.md, "Interleaved sliding-window layers"): with Gemma 3 270M's layer
plan (18 layers, 15 of them on a 512-token window, 64-token pages) pages hold the 3 full
layers' KV and each sidecar the 15 window layers' KV of its last 8 pages, so a cached
sequence of L tokens with one sidecar stores (3 L + 15 min(L, 512)) / (18 L) of every
layer's KV: 1.0 at 512 tokens, 0.27 at 4K, 0.18 at 32K.

Measured, not computed: a request runs through the engine on a cache (L1 only, big enough
that nothing is evicted), and the L1 pages the index holds afterwards are counted, times
the cache's page bytes; "every layer" is the same sequence's full pages with all 18 layers.
Two requests a length: a prompt of L + 1 tokens and one new token (L tokens cached: the
lookup end and the sequence's end are one boundary, one sidecar), and a prompt of L tokens
with 64 new tokens (two sidecars: the prompt's lookup end, for a repeat of the prompt, and
the sequence's end, for the next turn, a page further: a delta of one page over the
first). The ratio does not depend on the heads' width or the dtype (both sides scale
alike), so the model is Gemma 3 270M's plan with narrow heads and hidden size, random
weights, float32 on the CPU (32K tokens take minutes on 2 cores).

    python benchmarks/bench_sidecar_bytes.py                  # 512, 4096, 32768 tokens
    python benchmarks/bench_sidecar_bytes.py --lengths 512,4096
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import device_name, emit  # noqa: E402
from benchmarks.engine_models import MODEL_GEMMA3  # noqa: E402
from engine_integration.engine.core import Engine  # noqa: E402
from engine_integration.engine.embedded import CacheSizes, build_cache, load_model  # noqa: E402
from engine_integration.engine.model.config import EngineConfig  # noqa: E402
from engine_integration.engine.sampling import SamplingParams  # noqa: E402

PAGE_SIZE = 64
# Gemma 3 270M's layer plan (bench_engine's MODEL_GEMMA3: 18 layers, every 6th full
# attention, the rest on a 512-token window), narrow so that a 32K-token request is quick.
PLAN = dataclasses.replace(
    MODEL_GEMMA3,
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_heads=1,
    head_dim=16,
    query_pre_attn_scalar=16,
    model_id="bench-sidecar-bytes-seed0",
)
GEMMA3_270M_BYTES_PER_TOKEN = 18 * 2 * 1 * 256 * 2  # every layer's K and V, bf16


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="512,4096,32768", help="cached tokens")
    return parser.parse_args()


def stored_ratio(model, engine_config: EngineConfig, prompt_tokens: int, new_tokens: int):
    """(cached tokens, pages the index holds, ratio to every layer's KV) after one request."""
    pages = -(-(prompt_tokens + new_tokens) // PAGE_SIZE) + 100
    cache = build_cache(model, engine_config, CacheSizes(l1_pages=pages))
    try:
        engine = Engine(model, engine_config, cache=cache)
        prompt = [(7 * i + 3) % PLAN.vocab_size for i in range(prompt_tokens)]
        engine.generate([prompt], SamplingParams(max_new_tokens=new_tokens))
        held_pages = cache.pages_in_use("l1")
        stored = held_pages * cache.layout.bytes_per_page
    finally:
        cache.close()
    cached = (prompt_tokens + new_tokens - 1) // PAGE_SIZE * PAGE_SIZE
    every_layer = (
        cached
        * cache.layout.bytes_per_page
        // PAGE_SIZE
        * (PLAN.num_layers // PLAN.num_page_layers)
    )
    return cached, held_pages, stored / every_layer


def main() -> None:
    args = parse_args()
    engine_config = EngineConfig(page_size=PAGE_SIZE, prefill_chunk_tokens=4096)
    model, _ = load_model(None, engine_config, model_config=PLAN)
    rows = []
    for length in [int(x) for x in args.lengths.split(",")]:
        predicted = (3 * length + 15 * min(length, 512)) / (18 * length)
        began = time.perf_counter()
        cached, pages, one = stored_ratio(model, engine_config, length + 1, 1)
        _, pages_two, two = stored_ratio(model, engine_config, length, 64)
        rows.append(
            {
                "cached_tokens": cached,
                "predicted": round(predicted, 4),
                "one_sidecar": round(one, 4),
                "two_sidecars": round(two, 4),
                "pages_one": pages,
                "pages_two": pages_two,
                "bytes_per_token_270m_bf16_one": round(one * GEMMA3_270M_BYTES_PER_TOKEN),
                "seconds": round(time.perf_counter() - began, 1),
            }
        )
        print(
            f"{cached:>6} tokens: stored / every layer {one:.3f} (one sidecar), "
            f"{two:.3f} (two, one a delta), design {predicted:.3f}; on the 270M in bf16 "
            f"{one * GEMMA3_270M_BYTES_PER_TOKEN:,.0f} of "
            f"{GEMMA3_270M_BYTES_PER_TOKEN:,} bytes a token",
            flush=True,
        )
    emit({"bench": "sidecar_bytes", "device": device_name(), "rows": rows})


if __name__ == "__main__":
    main()
