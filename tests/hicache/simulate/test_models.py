"""Model presets against their formulas, and config.json files of known models against the
presets."""

from __future__ import annotations

import json

import pytest

from hicache.simulate.errors import SimulationError
from hicache.simulate.hf_config import from_hf_config
from hicache.simulate.model_presets import PRESETS, load_model

# Cached KV bytes per token, written out from each formula with the public config numbers:
# GQA 2 x full layers x kv_heads x head_dim x dtype bytes; MLA layers x (rank + rope) x bytes.
KV_BYTES_PER_TOKEN = {
    "llama-3.1-8b": 2 * 32 * 8 * 128 * 2,
    "llama-3.1-70b": 2 * 80 * 8 * 128 * 2,
    "llama-3.1-405b": 2 * 126 * 8 * 128 * 2,
    "qwen3-32b": 2 * 64 * 8 * 128 * 2,
    "qwen3-235b-a22b": 2 * 94 * 4 * 128 * 2,
    "deepseek-v3": 61 * (512 + 64) * 2,
    "deepseek-v3-bf16": 61 * (512 + 64) * 2,
    "deepseek-v3-fp8": 61 * (512 + 64) * 1,
    "gpt-oss-120b": 2 * 18 * 8 * 64 * 2,  # the 18 full-attention layers of 36
    "gemma-3-27b": 2 * 10 * 16 * 128 * 2,  # the 10 global layers of 62
}
# Sliding-window layers: per sequence, capped at the window.
SLIDING_BYTES_PER_SEQUENCE = {
    "gpt-oss-120b": 2 * 18 * 8 * 64 * 2 * 128,
    "gemma-3-27b": 2 * 52 * 16 * 128 * 2 * 1024,
}
# Published parameter counts (billions): total, active.
PARAMS = {
    "llama-3.1-8b": (8.03, 8.03),
    "llama-3.1-405b": (405.85, 405.85),
    "qwen3-32b": (32.8, 32.8),
    "qwen3-235b-a22b": (235.1, 22.2),
    "deepseek-v3": (671.0, 37.5),
    "gpt-oss-120b": (116.8, 5.7),  # active here counts embeddings
}


def test_every_preset_is_checked():
    assert set(KV_BYTES_PER_TOKEN) == set(PRESETS)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_kv_bytes_per_token_follow_the_formula(name):
    model = PRESETS[name]
    assert model.kv_bytes_per_token == KV_BYTES_PER_TOKEN[name]
    assert model.sliding_kv_bytes_per_sequence == SLIDING_BYTES_PER_SEQUENCE.get(name, 0)
    layout = model.kv_layout(page_size=64)
    assert layout.bytes_per_page == 64 * KV_BYTES_PER_TOKEN[name]


@pytest.mark.parametrize("name", sorted(PARAMS))
def test_parameter_counts_match_the_published_ones(name):
    total, active = PARAMS[name]
    model = PRESETS[name]
    assert model.num_params / 1e9 == pytest.approx(total, rel=0.01)
    assert model.num_active_params / 1e9 == pytest.approx(active, rel=0.02)


def test_weight_bytes_follow_the_checkpoint_format():
    assert PRESETS["deepseek-v3-bf16"].weight_bytes / 1e9 == pytest.approx(1342, rel=0.01)
    assert PRESETS["deepseek-v3"].weight_bytes / 1e9 == pytest.approx(673, rel=0.01)  # FP8
    assert PRESETS["gpt-oss-120b"].weight_bytes / 1e9 == pytest.approx(65, rel=0.03)  # MXFP4
    assert PRESETS["llama-3.1-70b"].weight_bytes == 2 * PRESETS["llama-3.1-70b"].num_params


def test_mtp_layers_and_a_draft_model_share_the_budget():
    base = PRESETS["deepseek-v3"]
    with_mtp = base.replace(use_mtp=True)
    assert with_mtp.kv_bytes_per_token == 62 * 576 * 2
    assert with_mtp.weight_bytes > base.weight_bytes + 10e9  # one more MoE layer, in FP8
    big, draft = PRESETS["llama-3.1-70b"], PRESETS["llama-3.1-8b"]
    speculative = big.replace(draft=draft)
    assert speculative.kv_bytes_per_token == big.kv_bytes_per_token + draft.kv_bytes_per_token
    assert speculative.weight_bytes == big.weight_bytes + draft.weight_bytes
    layout = speculative.kv_layout(page_size=16)  # no single layout: an opaque byte layout
    assert layout.bytes_per_page == 16 * speculative.kv_bytes_per_token
    assert speculative.prefill_flops(0, 100) == pytest.approx(
        big.prefill_flops(0, 100) + draft.prefill_flops(0, 100)
    )


def test_prefill_flops_are_linear_plus_causal_attention():
    model = PRESETS["llama-3.1-8b"]
    linear = 2 * (model.num_active_params - model.embedding_params)
    per_key = 2 * 32 * (128 + 128) * 32  # 2 x heads x (d_qk + d_v) x layers
    n = 1000
    assert model.prefill_flops(0, n) == pytest.approx(linear * n + per_key * n * (n + 1) / 2)
    # over a cached prefix of h tokens: n - h new tokens, each attending to all before it
    h = 600
    expected = linear * (n - h) + per_key * (n * (n + 1) - h * (h + 1)) / 2
    assert model.prefill_flops(h, n) == pytest.approx(expected)


def test_sliding_layers_cap_attention_and_replay_their_window_on_a_hit():
    model = PRESETS["gpt-oss-120b"]
    linear = 2 * (model.num_active_params - model.embedding_params)
    per_key = 2 * 64 * (64 + 64)
    n = 1000
    full = 18 * n * (n + 1) / 2
    windowed = 18 * (128 * 129 / 2 + (n - 128) * 128)
    assert model.prefill_flops(0, n) == pytest.approx(linear * n + per_key * (full + windowed))
    # a hit of 512 tokens recomputes the last 128 cached ones (the window's replay)
    assert model.prefill_flops(512, n) > linear * (n - 512 + 128)
    assert model.prefill_flops(512, n) < linear * (n - 512 + 129) + per_key * (full + windowed)


def write_config(tmp_path, config, name="config.json"):
    path = tmp_path / name
    path.write_text(json.dumps(config))
    return path


# The fields of the public config.json files that matter here (other fields omitted).
CONFIGS = {
    "llama-3.1-8b": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_attention_heads": 32,
        "num_hidden_layers": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    },
    "deepseek-v3": {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "kv_lora_rank": 512,
        "moe_intermediate_size": 2048,
        "n_routed_experts": 256,
        "n_shared_experts": 1,
        "num_attention_heads": 128,
        "num_experts_per_tok": 8,
        "num_hidden_layers": 61,
        "num_key_value_heads": 128,
        "num_nextn_predict_layers": 1,
        "q_lora_rank": 1536,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "first_k_dense_replace": 3,
        "vocab_size": 129280,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "quantization_config": {
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "quant_method": "fp8",
            "weight_block_size": [128, 128],
        },
    },
    "qwen3-235b-a22b": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "head_dim": 128,
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "moe_intermediate_size": 1536,
        "num_attention_heads": 64,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "num_hidden_layers": 94,
        "num_key_value_heads": 4,
        "vocab_size": 151936,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": 94,
    },
    "gpt-oss-120b": {
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        "head_dim": 64,
        "hidden_size": 2880,
        "intermediate_size": 2880,
        "num_attention_heads": 64,
        "num_hidden_layers": 36,
        "num_key_value_heads": 8,
        "num_local_experts": 128,
        "experts_per_token": 4,
        "num_experts_per_tok": 4,
        "sliding_window": 128,
        "layer_types": ["sliding_attention", "full_attention"] * 18,
        "vocab_size": 201088,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "quantization_config": {
            "quant_method": "mxfp4",
            "modules_to_not_convert": ["model.layers.*.self_attn"],
        },
    },
    "gemma-3-27b": {  # the multimodal checkpoint: the text model's numbers are nested
        "architectures": ["Gemma3ForConditionalGeneration"],
        "model_type": "gemma3",
        "torch_dtype": "bfloat16",
        "text_config": {
            "model_type": "gemma3_text",
            "head_dim": 128,
            "hidden_size": 5376,
            "intermediate_size": 21504,
            "num_attention_heads": 32,
            "num_hidden_layers": 62,
            "num_key_value_heads": 16,
            "sliding_window": 1024,
            "vocab_size": 262208,
        },
        "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 1152},
    },
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_a_config_json_gives_the_presets_numbers(tmp_path, name):
    model = from_hf_config(write_config(tmp_path, CONFIGS[name]))
    preset = PRESETS[name]
    assert model.kv_bytes_per_token == preset.kv_bytes_per_token == KV_BYTES_PER_TOKEN[name]
    assert model.sliding_kv_bytes_per_sequence == preset.sliding_kv_bytes_per_sequence
    assert model.num_params == preset.num_params
    assert model.num_active_params == preset.num_active_params
    assert model.weight_bytes == preset.weight_bytes
    assert model.prefill_flops(100, 5000) == pytest.approx(preset.prefill_flops(100, 5000))


def test_gemma_layer_types_and_the_old_pattern_field_agree(tmp_path):
    text = dict(CONFIGS["gemma-3-27b"]["text_config"])
    text["layer_types"] = [
        "full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(62)
    ]
    with_types = from_hf_config(write_config(tmp_path, text, "types.json"))
    assert with_types.num_sliding_layers == 52
    assert with_types.kv_bytes_per_token == KV_BYTES_PER_TOKEN["gemma-3-27b"]


def test_load_model_takes_presets_paths_and_directories(tmp_path):
    assert load_model("DeepSeek-V3") is PRESETS["deepseek-v3"]
    directory = tmp_path / "llama"
    directory.mkdir()
    write_config(directory, CONFIGS["llama-3.1-8b"])
    assert load_model(str(directory)).kv_bytes_per_token == KV_BYTES_PER_TOKEN["llama-3.1-8b"]
    with pytest.raises(SimulationError, match="unknown model 'gpt-5'"):
        load_model("gpt-5")


@pytest.mark.parametrize(
    "config, message",
    [
        ({"num_hidden_layers": 2}, "missing field 'hidden_size'"),
        (
            {**CONFIGS["llama-3.1-8b"], "quantization_config": {"quant_method": "awq"}},
            "'awq' is not modelled",
        ),
        ({**CONFIGS["llama-3.1-8b"], "torch_dtype": "int3"}, "unknown dtype 'int3'"),
    ],
)
def test_bad_configs_say_what_is_wrong(tmp_path, config, message):
    with pytest.raises(SimulationError, match=message):
        from_hf_config(write_config(tmp_path, config))
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(SimulationError, match="not valid JSON"):
        from_hf_config(tmp_path / "broken.json")
