"""Model presets: the `ModelSpec`s of well-known models, and `load_model`, which resolves
a `--model` argument to a preset or to a `config.json` path.

The numbers are copied from the models' public `config.json` files; `models.py` holds the
formulas that turn them into KV bytes, weights and FLOPs, `hf_config.py` reads any other file.
"""

from __future__ import annotations

from pathlib import Path

from hicache.simulate.errors import SimulationError
from hicache.simulate.hf_config import from_hf_config
from hicache.simulate.models import ModelSpec


def _llama(name: str, layers: int, hidden: int, heads: int, intermediate: int) -> ModelSpec:
    return ModelSpec(
        name=name,
        attention="gqa",
        num_layers=layers,
        hidden_size=hidden,
        num_heads=heads,
        head_dim=128,
        num_kv_heads=8,
        vocab_size=128256,
        intermediate_size=intermediate,
    )


_DEEPSEEK_V3 = ModelSpec(
    name="deepseek-v3",
    attention="mla",
    num_layers=61,
    hidden_size=7168,
    num_heads=128,
    vocab_size=129280,
    intermediate_size=18432,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_dim=128,
    qk_rope_dim=64,
    v_head_dim=128,
    num_experts=256,
    experts_per_token=8,
    num_shared_experts=1,
    moe_intermediate_size=2048,
    num_dense_layers=3,
    mtp_layers=1,
    weight_dtype="float8_e4m3fn",  # as released
    kv_dtype="bfloat16",  # the serving engines' default KV dtype for it
)

PRESETS: dict[str, ModelSpec] = {
    "llama-3.1-8b": _llama("llama-3.1-8b", 32, 4096, 32, 14336),
    "llama-3.1-70b": _llama("llama-3.1-70b", 80, 8192, 64, 28672),
    "llama-3.1-405b": _llama("llama-3.1-405b", 126, 16384, 128, 53248),
    "qwen3-32b": ModelSpec(
        name="qwen3-32b",
        attention="gqa",
        num_layers=64,
        hidden_size=5120,
        num_heads=64,
        head_dim=128,
        num_kv_heads=8,
        vocab_size=151936,
        intermediate_size=25600,
    ),
    "qwen3-235b-a22b": ModelSpec(
        name="qwen3-235b-a22b",
        attention="gqa",
        num_layers=94,
        hidden_size=4096,
        num_heads=64,
        head_dim=128,
        num_kv_heads=4,
        vocab_size=151936,
        intermediate_size=12288,
        num_experts=128,
        experts_per_token=8,
        moe_intermediate_size=1536,
    ),
    # DeepSeek-V3 three ways: as released (FP8 weights, bf16 KV), all bf16, and all FP8
    # (FP8 weights and an FP8 KV cache, e.g. --kv-cache-dtype fp8_e4m3).
    "deepseek-v3": _DEEPSEEK_V3,
    "deepseek-v3-bf16": _DEEPSEEK_V3.replace(name="deepseek-v3-bf16", weight_dtype="bfloat16"),
    "deepseek-v3-fp8": _DEEPSEEK_V3.replace(name="deepseek-v3-fp8", kv_dtype="float8_e4m3fn"),
    "gpt-oss-120b": ModelSpec(
        name="gpt-oss-120b",
        attention="gqa",
        num_layers=36,
        hidden_size=2880,
        num_heads=64,
        head_dim=64,
        num_kv_heads=8,
        vocab_size=201088,
        intermediate_size=2880,
        num_experts=128,
        experts_per_token=4,
        moe_intermediate_size=2880,
        sliding_window=128,
        num_sliding_layers=18,  # every other layer, from the first
        weight_dtype="mxfp4",
    ),
    "gemma-3-27b": ModelSpec(
        name="gemma-3-27b",
        attention="gqa",
        num_layers=62,
        hidden_size=5376,
        num_heads=32,
        head_dim=128,
        num_kv_heads=16,
        vocab_size=262208,
        intermediate_size=21504,
        tie_embeddings=True,
        sliding_window=1024,
        num_sliding_layers=52,  # five local layers to one global
    ),
}


def load_model(spec: str) -> ModelSpec:
    """A preset by name (case-insensitive), or a Hugging Face `config.json` path."""
    preset = PRESETS.get(spec.lower())
    if preset is not None:
        return preset
    path = Path(spec)
    if path.is_dir():
        path = path / "config.json"
    if path.suffix == ".json" or path.exists():
        return from_hf_config(path)
    raise SimulationError(
        f"unknown model {spec!r}: use a preset ({', '.join(PRESETS)}) or a config.json path"
    )
