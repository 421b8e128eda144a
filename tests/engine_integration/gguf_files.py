"""Writing small GGUF files as llama.cpp's converter does, for the GGUF tests.

`write_gguf` takes a transformers model's state dict and config (Llama or Qwen2) and writes
it under llama.cpp's tensor names, with Llama's q/k rows (weights and biases) permuted the
way the converter permutes them (its rotary embedding pairs adjacent dimensions), each 2-D
weight in `qtype`. The files carry no tokenizer (the engine then uses token ids only).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

# The loader's own table of llama.cpp tensor names: the files written here use the same
# names (the SmolLM2 GGUF test against transformers checks the table itself).
from engine_integration.engine.model.gguf_checkpoint import _GLOBAL_NAMES, _LAYER_NAMES


def permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's q/k row order: within each head, the two halves interleaved."""
    rows = weight.shape[0]
    return (
        weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def write_gguf(
    path: Path,
    state: dict[str, torch.Tensor],
    hf_config,
    *,
    arch: str = "llama",
    qtype: str = "F32",
    extra_metadata: dict | None = None,
    extra_tensors: dict[str, np.ndarray] | None = None,
) -> Path:
    import gguf
    from gguf import quants

    c = hf_config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_rope_freq_base(c.rope_parameters["rope_theta"])
    extra = dict(extra_metadata or {})
    if f"{arch}.rope.dimension_count" not in extra:
        writer.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
    writer.add_vocab_size(c.vocab_size)
    for key, value in extra.items():
        writer.add_uint32(key, value)
    kind = gguf.GGMLQuantizationType[qtype]
    for hf_name, tensor in state.items():
        if hf_name.startswith("model.layers."):
            _, _, index, rest = hf_name.split(".", 3)
            name = f"blk.{index}.{_LAYER_NAMES[rest]}"
        elif hf_name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        else:
            name = _GLOBAL_NAMES[hf_name]
        values = tensor.detach().float().numpy()
        if arch == "llama" and (".attn_q." in name or ".attn_k." in name):
            heads = c.num_attention_heads if "attn_q" in name else c.num_key_value_heads
            values = permute(values, heads)
        if values.ndim == 2 and kind != gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, quants.quantize(values, kind), raw_dtype=kind)
        else:
            writer.add_tensor(name, values)
    for name, values in (extra_tensors or {}).items():
        writer.add_tensor(name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
