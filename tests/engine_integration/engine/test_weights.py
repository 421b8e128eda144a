"""Checkpoints (config.json + safetensors, HF names), config reading, tokenizers."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine_integration.engine.embedded import load_model
from engine_integration.engine.errors import CheckpointError
from engine_integration.engine.model.hf_config import HFConfigError, model_config_from_hf
from engine_integration.engine.model.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer
from engine_integration.engine.model.weights import (
    hf_tensor_shapes,
    load_weights,
    random_weights,
    read_model_config,
    save_checkpoint,
    to_hf_tensors,
)
from tests.support.engines import ENGINE, GREEDY, SMALL, cache_off, random_prompt, run_one


def _same_weights(a, b):
    for name, tensor in to_hf_tensors(SMALL, a).items():
        assert torch.equal(tensor, to_hf_tensors(SMALL, b)[name]), name


@pytest.mark.parametrize(
    ("architecture", "changes"),
    [
        ("LlamaForCausalLM", {}),
        ("Qwen2ForCausalLM", {"qkv_bias": True}),
        ("MistralForCausalLM", {"tie_word_embeddings": True}),
    ],
)
def test_checkpoint_round_trip_gives_the_same_model(tmp_path, architecture, changes):
    config = SMALL.replace(**changes)
    weights = random_weights(config, seed=3)
    save_checkpoint(config, weights, tmp_path, architecture=architecture)
    loaded_config = read_model_config(tmp_path)
    assert loaded_config.replace(model_id=config.model_id) == config
    assert loaded_config.model_id.startswith(tmp_path.name + "@")
    loaded = load_weights(loaded_config, tmp_path, dtype=torch.float32)
    if config.tie_word_embeddings:
        assert "lm_head.weight" not in load_file(tmp_path / "model.safetensors")
        assert loaded.lm_head is loaded.embed
    original_model, _ = load_model(None, ENGINE, seed=3, model_config=config)
    loaded_model, tokenizer = load_model(tmp_path, ENGINE)
    assert isinstance(tokenizer, ByteTokenizer)
    tokens = random_prompt(1, 60)
    expected = run_one(cache_off(original_model), tokens, GREEDY)
    actual = run_one(cache_off(loaded_model), tokens, GREEDY)
    assert torch.equal(actual.logits, expected.logits)


def test_sharded_checkpoint_loads(tmp_path):
    weights = random_weights(SMALL, seed=4)
    save_checkpoint(SMALL, weights, tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    names = sorted(tensors)
    (tmp_path / "model.safetensors").unlink()
    save_file({n: tensors[n] for n in names[::2]}, tmp_path / "model-00001-of-00002.safetensors")
    save_file({n: tensors[n] for n in names[1::2]}, tmp_path / "model-00002-of-00002.safetensors")
    config = read_model_config(tmp_path)
    _same_weights(load_weights(config, tmp_path, dtype=torch.float32), weights)


def test_missing_and_misshaped_tensors_are_each_named(tmp_path):
    save_checkpoint(SMALL, random_weights(SMALL, seed=5), tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    del tensors["lm_head.weight"]
    tensors["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(16, 64)
    save_file(tensors, tmp_path / "model.safetensors")
    config = read_model_config(tmp_path)
    with pytest.raises(CheckpointError) as raised:
        load_weights(config, tmp_path, dtype=torch.float32)
    message = str(raised.value)
    assert "missing tensor model.layers.1.mlp.up_proj.weight [128, 64]" in message
    assert "missing tensor lm_head.weight [96, 64]" in message
    assert "model.layers.0.self_attn.k_proj.weight has shape [16, 64], expected [32, 64]" in message


def test_directory_problems_are_named(tmp_path):
    with pytest.raises(CheckpointError, match="no config.json"):
        read_model_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        read_model_config(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors"):
        read_model_config(tmp_path)


def test_model_id_follows_the_weights(tmp_path):
    save_checkpoint(SMALL, random_weights(SMALL, seed=6), tmp_path / "a")
    save_checkpoint(SMALL, random_weights(SMALL, seed=7), tmp_path / "b")
    save_checkpoint(SMALL, random_weights(SMALL, seed=6), tmp_path / "c")
    ids = [read_model_config(tmp_path / d).model_id.split("@")[1] for d in "abc"]
    assert ids[0] != ids[1] and ids[0] == ids[2]


def _hf(**fields):
    base = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 96,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    }
    return {**base, **fields}


def test_hybrid_plans_from_hf_configs():
    def read(hf, **kwargs):
        return model_config_from_hf(hf, model_id="m", **kwargs)

    llama = read(_hf())
    assert llama.num_source_layers == 4 and llama.head_dim == 16 and not llama.qkv_bias
    qwen = read(
        _hf(
            architectures=["Qwen2ForCausalLM"],
            use_sliding_window=True,
            sliding_window=64,
            max_window_layers=3,
        )
    )
    assert (qwen.num_source_layers, qwen.window_tokens, qwen.qkv_bias) == (3, 64, True)
    types = ["full_attention"] * 2 + ["sliding_attention"] * 2
    assert read(_hf(layer_types=types, sliding_window=32)).num_source_layers == 2
    with pytest.raises(HFConfigError, match="num_source_layers"):
        read(_hf(architectures=["MistralForCausalLM"], sliding_window=4096))
    mistral = read(
        _hf(architectures=["MistralForCausalLM"], sliding_window=4096), num_source_layers=4
    )
    assert mistral.num_late_layers == 0
    with pytest.raises(HFConfigError, match="followed by"):
        read(_hf(layer_types=["sliding_attention", "full_attention"] * 2))
    with pytest.raises(HFConfigError, match="yarn"):
        read(_hf(rope_scaling={"rope_type": "yarn", "factor": 4.0}))
    with pytest.raises(HFConfigError, match="GPT2LMHeadModel"):
        read(_hf(architectures=["GPT2LMHeadModel"]))
    scaled = read(_hf(rope_scaling={"rope_type": "llama3", "factor": 8.0}))
    assert scaled.rope_scaling.kind == "llama3"


def test_expected_shapes_cover_every_fused_tensor():
    shapes = hf_tensor_shapes(SMALL.replace(qkv_bias=True))
    assert shapes["model.layers.3.self_attn.v_proj.bias"] == (32,)
    assert shapes["model.layers.0.mlp.down_proj.weight"] == (64, 128)
    assert len(shapes) == 3 + 4 * 12


def test_byte_tokenizer_round_trips_text():
    tokenizer = ByteTokenizer()
    text = "naïve café — 東京"
    assert tokenizer.decode(tokenizer.encode(text)) == text
    assert max(tokenizer.encode(text)) < 256 and tokenizer.eos_id == 257


def test_tokenizer_json_is_used_when_present(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "hello": 1, "world": 2, "cache": 3}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": [3, 0]}))
    loaded = load_tokenizer(tmp_path)
    assert isinstance(loaded, HFTokenizer)
    assert loaded.encode("hello cache world") == [1, 3, 2]
    assert loaded.eos_id == 3 and loaded.vocab_size == 4
    assert isinstance(load_tokenizer(None), ByteTokenizer)
