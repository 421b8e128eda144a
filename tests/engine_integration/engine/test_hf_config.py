"""Reading Hugging Face configs: transformers 5.x and 4.x fields, and every math-changing key
the engine does not implement refused by name (never run as something else)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine_integration.engine.errors import CheckpointError
from engine_integration.engine.model.hf_config import HFConfigError, model_config_from_hf
from engine_integration.engine.model.weights import load_weights, random_weights, read_model_config
from engine_integration.engine.model.weights import save_checkpoint as save
from tests.support.engines import SMALL


def _hf(**changes):
    base = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 96,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "hidden_act": "silu",
    }
    base.update(changes)
    return {k: v for k, v in base.items() if v is not None}


def read(hf):
    return model_config_from_hf(hf, model_id="m")


def test_transformers_5_rope_parameters_are_read():
    """5.x writes the theta inside rope_parameters; reading only a top-level rope_theta
    ran SmolLM2 (theta 100,000) with 10,000."""
    config = read(_hf(rope_parameters={"rope_theta": 100000.0, "rope_type": "default"}))
    assert config.rope_theta == 100000.0 and config.rope_scaling is None
    scaled = read(
        _hf(
            rope_parameters={
                "rope_theta": 500000.0,
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            }
        )
    )
    assert scaled.rope_theta == 500000.0 and scaled.rope_scaling.kind == "llama3"
    linear = read(_hf(rope_parameters={"rope_theta": 1e4, "rope_type": "linear", "factor": 2.0}))
    assert linear.rope_scaling.kind == "linear" and linear.rope_scaling.factor == 2.0


def test_transformers_4_rope_fields_are_read():
    config = read(_hf(rope_theta=50000.0, rope_scaling={"type": "linear", "factor": 4.0}))
    assert config.rope_theta == 50000.0 and config.rope_scaling.factor == 4.0
    assert read(_hf()).rope_theta == 10000.0


@pytest.mark.parametrize("kind", ["yarn", "dynamic", "longrope", "mrope"])
def test_unsupported_rope_type_is_an_error_naming_it(kind):
    with pytest.raises(HFConfigError, match=f"rope_type {kind!r}"):
        read(_hf(rope_parameters={"rope_theta": 1e4, "rope_type": kind, "factor": 2.0}))
    with pytest.raises(HFConfigError, match=f"rope_type {kind!r}"):
        read(_hf(rope_scaling={"rope_type": kind, "factor": 2.0}))


def test_conflicting_rope_thetas_are_an_error():
    with pytest.raises(HFConfigError, match="rope_theta"):
        read(_hf(rope_theta=1e4, rope_parameters={"rope_theta": 1e5, "rope_type": "default"}))


def test_per_layer_type_rope_parameters():
    same = {"rope_theta": 1e5, "rope_type": "default"}
    config = read(_hf(rope_parameters={"full_attention": same, "sliding_attention": same}))
    assert config.rope_theta == 1e5
    other = {"rope_theta": 1e4, "rope_type": "default"}
    with pytest.raises(HFConfigError, match="sliding_attention"):
        read(_hf(rope_parameters={"full_attention": same, "sliding_attention": other}))


@pytest.mark.parametrize("act", ["gelu", "gelu_pytorch_tanh", "relu"])
def test_activation_other_than_silu_is_an_error(act):
    """gelu used to run as SiLU."""
    with pytest.raises(HFConfigError, match=f"hidden_act {act!r}"):
        read(_hf(hidden_act=act))
    with pytest.raises(HFConfigError, match="hidden_activation"):
        read(_hf(hidden_act=None, hidden_activation=act))


def test_partial_rotary_factor_is_an_error():
    with pytest.raises(HFConfigError, match="partial_rotary_factor"):
        read(_hf(partial_rotary_factor=0.5))
    with pytest.raises(HFConfigError, match="partial_rotary_factor"):
        read(
            _hf(
                rope_parameters={
                    "rope_theta": 1e4,
                    "rope_type": "default",
                    "partial_rotary_factor": 0.5,
                }
            )
        )
    assert read(_hf(partial_rotary_factor=1.0)).head_dim == 16


def test_missing_architectures_is_an_error():
    """A config without architectures used to run as Llama."""
    with pytest.raises(HFConfigError, match="architectures"):
        read(_hf(architectures=None))
    with pytest.raises(HFConfigError, match="architectures"):
        read(_hf(architectures=[]))


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("attn_logit_softcapping", 50.0),
        ("use_qk_norm", True),
        ("attention_chunk_size", 8192),
        ("no_rope_layers", [1, 1, 0, 1]),
        ("use_bidirectional_attention", True),
        ("mlp_bias", True),
    ],
)
def test_math_keys_we_do_not_implement_are_errors(key, value):
    with pytest.raises(HFConfigError, match=key):
        read(_hf(**{key: value}))


def test_extra_bias_tensors_are_an_error_naming_them(tmp_path):
    """A checkpoint with bias tensors the config does not declare used to load without
    them (an INFO line); the model would then not be the checkpoint's."""
    save(SMALL, random_weights(SMALL, seed=1), tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["model.layers.1.self_attn.q_proj.bias"] = torch.zeros(SMALL.q_size)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    config = read_model_config(tmp_path)
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.self_attn\.q_proj\.bias"):
        load_weights(config, tmp_path, dtype=torch.float32)


def test_tied_checkpoint_may_carry_its_lm_head(tmp_path):
    """transformers ties the head to the embedding and ignores a stored lm_head."""
    config = SMALL.replace(tie_word_embeddings=True)
    save(config, random_weights(config, seed=1), tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, str(tmp_path / "model.safetensors"))
    weights = load_weights(read_model_config(tmp_path), tmp_path, dtype=torch.float32)
    assert weights.lm_head is weights.embed


def test_written_config_reads_back(tmp_path):
    config = SMALL.replace(rope_theta=100000.0)
    save(config, random_weights(config, seed=1), tmp_path)
    hf = json.loads((tmp_path / "config.json").read_text())
    assert hf["rope_parameters"]["rope_theta"] == 100000.0
    assert read_model_config(tmp_path).rope_theta == 100000.0
