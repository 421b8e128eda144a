"""The models the engine benchmarks run (bench_engine.py, and bench_serving.py,
bench_deterministic_gemm.py and bench_sidecar_bytes.py, which run the same ones): random
weights of real models' shapes, and the tiny models the CPU runs."""

from __future__ import annotations

from engine_integration.engine.model.config import ModelConfig, tiny_model_config

MODEL_1B = ModelConfig(
    vocab_size=32000,
    hidden_size=2048,
    intermediate_size=8192,
    num_layers=16,
    num_heads=32,
    num_kv_heads=8,
    head_dim=64,
    num_source_layers=12,
    window_tokens=128,
    rope_theta=500000.0,
    model_id="bench-1b-seed0",
)
MODEL_8B = ModelConfig(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    num_source_layers=32,
    rope_theta=500000.0,
    model_id="bench-llama8b-shape-seed0",
)
MODEL_GEMMA3 = ModelConfig(
    vocab_size=262144,
    hidden_size=640,
    intermediate_size=2048,
    num_layers=18,
    num_heads=4,
    num_kv_heads=1,
    head_dim=256,
    num_source_layers=18,
    window_tokens=512,
    windowed_layers=tuple(i for i in range(18) if i % 6 != 5),
    block="gemma3",
    rope_theta=1_000_000.0,
    local_rope_theta=10_000.0,
    query_pre_attn_scalar=256,
    tie_word_embeddings=True,
    model_id="bench-gemma3-270m-shape-seed0",
)
TINY = tiny_model_config(0)
MODELS = {
    "1b": MODEL_1B,
    "8b": MODEL_8B,
    "gemma3": MODEL_GEMMA3,
    "tiny": TINY,
    "tiny-full": TINY.replace(num_source_layers=TINY.num_layers, model_id="tiny-full-seed0"),
}
