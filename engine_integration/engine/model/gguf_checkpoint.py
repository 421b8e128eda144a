"""GGUF checkpoints (llama.cpp's single-file format), read with the `gguf` package.

One file holds the hyper-parameters (metadata under `{arch}.*`), the tensors (llama.cpp names,
`blk.{i}.attn_q.weight`, ..., quantized or not) and the tokenizer (`tokenizer.*`, turned into a
`tokenizers` tokenizer by `tokenizer.py`). Architectures: `llama` (Llama, Mistral, SmolLM2,
...), `qwen2` and `gemma3` (its text model). Quantized tensors are dequantized at load by the
`gguf` package (Q4_0, Q4_1, Q8_0, F16, BF16 and F32 are tested; it knows more), then cast to
the engine's dtype: the engine computes on the dequantized weights, as transformers does.

llama.cpp's converter permutes the rows of Llama's q and k projections (its rotary
embedding pairs adjacent dimensions; Hugging Face's pairs the two halves); `_unpermute`
undoes that, so the weights are the Hugging Face model's again.

Gemma 3: the file says less than the model needs, and llama.cpp fills the rest in by rule, as
transformers does when it loads the file: every sixth layer is full attention, the others
slide over `gemma3.attention.sliding_window` positions with a rotary base of 10,000 (the
file's `rope.freq_base` is the full layers'), and scores scale by head_dim^-1/2 (except on
the 27B model, 62 layers, which scales by (hidden / heads)^-1/2: refused by name). Its
converter stores each norm's 1 + w; the loader takes the 1 off again.

Like `hf_config`, a file whose math this engine does not implement (another architecture,
partial rotary, a rope scaling other than linear, experts, a tensor the model does not
use, such as llama3's `rope_freqs`) is a `CheckpointError` naming what is wrong. GGUF has no
flag for biases: the model has q/k/v (or output) biases when the file holds them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine_integration.engine.errors import CheckpointError
from engine_integration.engine.model.config import ModelConfig, RopeScaling
from engine_integration.engine.model.weights import (
    ModelWeights,
    content_digest,
    from_hf_tensors,
    hf_tensor_shapes,
)

ARCHITECTURES = ("llama", "qwen2", "gemma3")
# llama.cpp's rules for what a Gemma 3 file does not say (see the module docstring).
GEMMA3_FULL_EVERY = 6
GEMMA3_LOCAL_ROPE_THETA = 10000.0
GEMMA3_27B_LAYERS = 62
# llama.cpp's name of each Hugging Face tensor, within one layer and outside the layers.
_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.o_proj.bias": "attn_output.bias",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
# Gemma 3's: four norms a layer (its ffn_norm is the pre-feed-forward one), and q/k norms.
_GEMMA3_LAYER_NAMES = {
    **{k: v for k, v in _LAYER_NAMES.items() if k != "post_attention_layernorm.weight"},
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
}
_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
# Metadata keys (after `{arch}.`) that would change the math, unimplemented here.
_UNSUPPORTED_KEYS = (
    "expert_count",
    "attention.sliding_window",
    "attn_logit_softcapping",
    "final_logit_softcapping",
    "rope.scaling.attn_factor",
)


@dataclass(frozen=True)
class GGUFFile:
    """An opened GGUF file: its metadata (plain Python values) and its reader."""

    path: Path
    metadata: dict[str, Any]
    reader: Any  # gguf.GGUFReader (memory-mapped)

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))


def open_gguf(path: str | Path) -> GGUFFile:
    try:
        from gguf import GGUFReader
    except ImportError:
        raise CheckpointError(
            f"{path}: reading GGUF files needs the 'gguf' package (pip install gguf)"
        ) from None
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such GGUF file")
    try:
        reader = GGUFReader(str(path))
    except (ValueError, OSError) as error:
        raise CheckpointError(f"{path}: not a readable GGUF file ({error})") from None
    metadata = {name: field.contents() for name, field in reader.fields.items()}
    return GGUFFile(path, metadata, reader)


def is_gguf(path: str | Path) -> bool:
    path = Path(path)
    if not path.is_file():
        return False
    with open(path, "rb") as handle:
        return handle.read(4) == b"GGUF"


def read_gguf_config(
    gguf: GGUFFile,
    *,
    num_source_layers: int | None = None,
    window_tokens: int | None = None,
    model_id: str | None = None,
) -> ModelConfig:
    """The `ModelConfig` of a GGUF file (every layer full attention unless the overrides
    give late window layers). `model_id` defaults to a digest of the file."""
    arch = gguf.architecture
    if arch not in ARCHITECTURES:
        raise CheckpointError(
            f"{gguf.path}: GGUF architecture {arch!r} is not supported "
            f"(supported: {', '.join(ARCHITECTURES)})"
        )
    meta = gguf.metadata

    def get(key: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise CheckpointError(f"{gguf.path}: GGUF metadata lacks {arch}.{key}")
        return value

    gemma = arch == "gemma3"
    for key in _UNSUPPORTED_KEYS:
        if gemma and key == "attention.sliding_window":
            continue
        if f"{arch}.{key}" in meta:
            raise CheckpointError(
                f"{gguf.path}: GGUF metadata sets {arch}.{key}, which this engine does not "
                "implement"
            )
    hidden, num_heads = int(get("embedding_length")), int(get("attention.head_count"))
    head_dim = int(meta.get(f"{arch}.attention.key_length", hidden // num_heads))
    rotary = int(meta.get(f"{arch}.rope.dimension_count", head_dim))
    if rotary != head_dim:
        raise CheckpointError(
            f"{gguf.path}: {arch}.rope.dimension_count is {rotary} of head_dim {head_dim} "
            "(partial rotary is not supported)"
        )
    num_layers = int(get("block_count"))
    vocab = meta.get(f"{arch}.vocab_size") or len(meta.get("tokenizer.ggml.tokens") or [])
    names = {t.name for t in gguf.reader.tensors}
    plan: dict[str, Any] = {}
    if gemma:
        plan = _gemma3_plan(gguf, num_layers, num_source_layers, window_tokens, get)
        num_source_layers, window_tokens = num_layers, plan.pop("window_tokens")
    try:
        return ModelConfig(
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(get("feed_forward_length")),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(get("attention.head_count_kv", num_heads)),
            head_dim=head_dim,
            num_source_layers=num_layers if num_source_layers is None else num_source_layers,
            window_tokens=window_tokens or 128,
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
            rope_theta=float(get("rope.freq_base", 10000.0)),
            rope_scaling=_rope_scaling(gguf, arch),
            qkv_bias="blk.0.attn_q.bias" in names,
            o_bias="blk.0.attn_output.bias" in names,
            tie_word_embeddings="output.weight" not in names,
            model_id=model_id or content_digest(gguf.path.parent, [gguf.path]),
            **plan,
        )
    except ValueError as error:
        raise CheckpointError(f"{gguf.path}: {error}") from None


def _gemma3_plan(gguf: GGUFFile, num_layers: int, num_source_layers, window_tokens, get):
    """The ModelConfig fields of a Gemma 3 file that llama.cpp's rules supply."""
    if num_source_layers is not None:
        raise CheckpointError(
            f"{gguf.path}: num_source_layers cannot re-plan Gemma 3 (its sliding-window "
            "layers are interleaved with the full-attention ones)"
        )
    if num_layers == GEMMA3_27B_LAYERS:
        raise CheckpointError(
            f"{gguf.path}: Gemma 3 27B (62 layers) scales attention by (hidden / heads)^-1/2, "
            "which the file does not say; not supported"
        )
    return {
        "window_tokens": window_tokens or int(get("attention.sliding_window")),
        "windowed_layers": tuple(i for i in range(num_layers) if (i + 1) % GEMMA3_FULL_EVERY != 0),
        "block": "gemma3",
        "local_rope_theta": GEMMA3_LOCAL_ROPE_THETA,
    }


def _rope_scaling(gguf: GGUFFile, arch: str) -> RopeScaling | None:
    kind = gguf.metadata.get(f"{arch}.rope.scaling.type", "none")
    factor = float(gguf.metadata.get(f"{arch}.rope.scaling.factor", 1.0))
    if kind == "none" or (kind == "linear" and factor == 1.0):
        return None
    if kind == "linear":
        return RopeScaling(kind="linear", factor=factor)
    raise CheckpointError(
        f"{gguf.path}: GGUF {arch}.rope.scaling.type {kind!r} is not supported (none, linear)"
    )


def load_gguf_weights(
    gguf: GGUFFile, config: ModelConfig, *, dtype: torch.dtype, device="cpu"
) -> ModelWeights:
    """Every tensor `config` needs, dequantized, checked by name and shape first."""
    from gguf import quants

    wanted = _gguf_names(config)  # gguf name -> (hf name, shape)
    tensors = {t.name: t for t in gguf.reader.tensors}
    problems = [f"missing tensor {name}" for name in wanted if name not in tensors]
    problems += [
        f"tensor {name} has shape {_shape(tensors[name])}, expected {list(shape)}"
        for name, (_, shape) in wanted.items()
        if name in tensors and _shape(tensors[name]) != list(shape)
    ]
    problems += [
        f"unexpected tensor {name} (this engine's model would not be the file's)"
        for name in sorted(set(tensors) - set(wanted))
    ]
    if problems:
        raise CheckpointError(f"{gguf.path}: " + "; ".join(problems))
    out = {}
    for name, (hf_name, shape) in wanted.items():
        tensor = tensors[name]
        try:
            values = quants.dequantize(tensor.data, tensor.tensor_type)
        except NotImplementedError:
            raise CheckpointError(
                f"{gguf.path}: tensor {name} is {tensor.tensor_type.name}, which the gguf "
                "package cannot dequantize"
            ) from None
        values = torch.from_numpy(np.array(values, dtype=np.float32)).view(shape)  # a copy
        if gguf.architecture == "llama" and (".q_proj." in hf_name or ".k_proj." in hf_name):
            heads = config.num_heads if "q_proj" in hf_name else config.num_kv_heads
            values = _unpermute(values, heads)
        if config.gemma and hf_name.endswith("norm.weight"):
            values = values - 1.0  # the converter stored 1 + w
        out[hf_name] = values.to(device=device, dtype=dtype)
    return from_hf_tensors(config, out)


def _gguf_names(config: ModelConfig) -> dict[str, tuple[str, tuple[int, ...]]]:
    out = {}
    layer_names = _GEMMA3_LAYER_NAMES if config.gemma else _LAYER_NAMES
    for hf_name, shape in hf_tensor_shapes(config).items():
        if hf_name.startswith("model.layers."):
            _, _, index, rest = hf_name.split(".", 3)
            out[f"blk.{index}.{layer_names[rest]}"] = (hf_name, shape)
        else:
            out[_GLOBAL_NAMES[hf_name]] = (hf_name, shape)
    return out


def _shape(tensor) -> list[int]:
    return [int(n) for n in reversed(tensor.shape.tolist())]  # GGUF lists the innermost first


def _unpermute(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (weights and biases alike): within each head,
    rows (D/2, 2) back to (2, D/2)."""
    half = weight.shape[0] // num_heads // 2
    rest = weight.shape[1:]
    return weight.view(num_heads, half, 2, *rest).transpose(1, 2).reshape(weight.shape)
