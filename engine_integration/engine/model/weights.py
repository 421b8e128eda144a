"""Model weights: random from a seed, or a Hugging Face style safetensors checkpoint.

`ModelWeights` holds the tensors the model math uses, with the attention's q/k/v and the
MLP's gate/up projections fused (one matmul each). On disk, checkpoints use the Llama /
Qwen2 / Mistral / Gemma 3 tensor names (`model.layers.{i}.self_attn.q_proj.weight`, ...), in
one or several `*.safetensors` files beside a `config.json`. A Gemma 3 norm stores w and
scales by 1 + w in float32: `ModelWeights` holds the float32 1 + w (`rms_norm` takes it).
Loading checks every expected tensor before reading any, and a bad directory raises one
`CheckpointError` listing each missing and each mis-shaped tensor.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import xxhash

from engine_integration.engine.errors import CheckpointError
from engine_integration.engine.model.config import ModelConfig
from engine_integration.engine.model.hf_config import (
    HFConfigError,
    model_config_from_hf,
    write_hf_config,
)

logger = logging.getLogger(__name__)

_HASH_CHUNK_BYTES = 16 << 20


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # (hidden,)
    qkv: torch.Tensor  # (q_size + 2 * kv_size, hidden)
    qkv_bias: torch.Tensor | None  # (q_size + 2 * kv_size,)
    o: torch.Tensor  # (hidden, q_size)
    o_bias: torch.Tensor | None  # (hidden,)
    post_norm: torch.Tensor  # (hidden,)
    gate_up: torch.Tensor  # (2 * intermediate, hidden)
    down: torch.Tensor  # (hidden, intermediate)
    # Gemma 3 only (None otherwise): `post_norm` is its pre-feed-forward norm, and these
    q_norm: torch.Tensor | None = None  # (head_dim,): each query head, before RoPE
    k_norm: torch.Tensor | None = None  # (head_dim,): each key head, before RoPE
    attn_out_norm: torch.Tensor | None = None  # (hidden,): the attention's output
    mlp_out_norm: torch.Tensor | None = None  # (hidden,): the MLP's output


@dataclass
class ModelWeights:
    embed: torch.Tensor  # (vocab, hidden)
    layers: list[LayerWeights]
    final_norm: torch.Tensor  # (hidden,)
    lm_head: torch.Tensor  # (vocab, hidden); the embedding itself when tied

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.device


# ---------------------------------------------------------------------- names and shapes


def hf_tensor_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of `config` must hold, by its Hugging Face name."""
    c = config
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (c.vocab_size, c.hidden_size)
    }
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (c.hidden_size,)
        shapes[p + "post_attention_layernorm.weight"] = (c.hidden_size,)
        if c.gemma:
            shapes[p + "pre_feedforward_layernorm.weight"] = (c.hidden_size,)
            shapes[p + "post_feedforward_layernorm.weight"] = (c.hidden_size,)
            shapes[p + "self_attn.q_norm.weight"] = (c.head_dim,)
            shapes[p + "self_attn.k_norm.weight"] = (c.head_dim,)
        for name, rows in (("q", c.q_size), ("k", c.kv_size), ("v", c.kv_size)):
            shapes[f"{p}self_attn.{name}_proj.weight"] = (rows, c.hidden_size)
            if c.qkv_bias:
                shapes[f"{p}self_attn.{name}_proj.bias"] = (rows,)
        shapes[p + "self_attn.o_proj.weight"] = (c.hidden_size, c.q_size)
        if c.o_bias:
            shapes[p + "self_attn.o_proj.bias"] = (c.hidden_size,)
        shapes[p + "mlp.gate_proj.weight"] = (c.intermediate_size, c.hidden_size)
        shapes[p + "mlp.up_proj.weight"] = (c.intermediate_size, c.hidden_size)
        shapes[p + "mlp.down_proj.weight"] = (c.hidden_size, c.intermediate_size)
    shapes["model.norm.weight"] = (c.hidden_size,)
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, c.hidden_size)
    return shapes


def from_hf_tensors(config: ModelConfig, tensors: dict[str, torch.Tensor]) -> ModelWeights:
    """Fuse HF-named tensors (already checked) into `ModelWeights`; a Gemma 3 norm's w
    becomes the float32 1 + w it scales by."""
    if config.gemma:
        tensors = {
            name: (1.0 + t.float()) if name.endswith("norm.weight") else t
            for name, t in tensors.items()
        }
    layers = []
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        attn = p + "self_attn."
        gemma = {}
        if config.gemma:
            gemma = {
                "q_norm": tensors[attn + "q_norm.weight"],
                "k_norm": tensors[attn + "k_norm.weight"],
                "attn_out_norm": tensors[p + "post_attention_layernorm.weight"],
                "mlp_out_norm": tensors[p + "post_feedforward_layernorm.weight"],
            }
        pre_mlp = "pre_feedforward_layernorm" if config.gemma else "post_attention_layernorm"
        qkv = torch.cat([tensors[f"{attn}{n}_proj.weight"] for n in "qkv"])
        bias = (
            torch.cat([tensors[f"{attn}{n}_proj.bias"] for n in "qkv"]) if config.qkv_bias else None
        )
        layers.append(
            LayerWeights(
                input_norm=tensors[p + "input_layernorm.weight"],
                qkv=qkv,
                qkv_bias=bias,
                o=tensors[attn + "o_proj.weight"],
                o_bias=tensors[attn + "o_proj.bias"] if config.o_bias else None,
                post_norm=tensors[f"{p}{pre_mlp}.weight"],
                gate_up=torch.cat(
                    [tensors[p + "mlp.gate_proj.weight"], tensors[p + "mlp.up_proj.weight"]]
                ),
                down=tensors[p + "mlp.down_proj.weight"],
                **gemma,
            )
        )
    embed = tensors["model.embed_tokens.weight"]
    lm_head = embed if config.tie_word_embeddings else tensors["lm_head.weight"]
    return ModelWeights(embed, layers, tensors["model.norm.weight"], lm_head)


def to_hf_tensors(config: ModelConfig, weights: ModelWeights) -> dict[str, torch.Tensor]:
    """The inverse of `from_hf_tensors`: split the fused tensors back under HF names (a
    Gemma 3 norm's w back from 1 + w, in the weights' dtype)."""
    out = {"model.embed_tokens.weight": weights.embed, "model.norm.weight": weights.final_norm}
    if not config.tie_word_embeddings:
        out["lm_head.weight"] = weights.lm_head
    split = [config.q_size, config.kv_size, config.kv_size]
    for i, layer in enumerate(weights.layers):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = layer.input_norm
        if config.gemma:
            out[p + "pre_feedforward_layernorm.weight"] = layer.post_norm
            out[p + "post_attention_layernorm.weight"] = layer.attn_out_norm
            out[p + "post_feedforward_layernorm.weight"] = layer.mlp_out_norm
            out[p + "self_attn.q_norm.weight"] = layer.q_norm
            out[p + "self_attn.k_norm.weight"] = layer.k_norm
        else:
            out[p + "post_attention_layernorm.weight"] = layer.post_norm
        for name, part in zip("qkv", layer.qkv.split(split), strict=True):
            out[f"{p}self_attn.{name}_proj.weight"] = part
        if layer.qkv_bias is not None:
            for name, part in zip("qkv", layer.qkv_bias.split(split), strict=True):
                out[f"{p}self_attn.{name}_proj.bias"] = part
        out[p + "self_attn.o_proj.weight"] = layer.o
        if layer.o_bias is not None:
            out[p + "self_attn.o_proj.bias"] = layer.o_bias
        gate, up = layer.gate_up.chunk(2)
        out[p + "mlp.gate_proj.weight"] = gate
        out[p + "mlp.up_proj.weight"] = up
        out[p + "mlp.down_proj.weight"] = layer.down
    if config.gemma:
        out = {
            name: (t - 1.0).to(weights.dtype) if name.endswith("norm.weight") else t
            for name, t in out.items()
        }
    return {name: tensor.contiguous() for name, tensor in out.items()}


# ---------------------------------------------------------------------- random weights


def random_weights(
    config: ModelConfig, seed: int = 0, *, dtype: torch.dtype = torch.float32, device="cpu"
) -> ModelWeights:
    """Weights drawn from a generator seeded with `seed` on `device` (the same seed gives
    the same weights on the same kind of device). Projections ~ N(0, 1/fan_in), norms
    ~ 1 + N(0, 0.1^2): nothing is uniform, so a mistake in loading or fusing shows."""
    generator = torch.Generator(device=device).manual_seed(seed)

    def normal(*shape: int, std: float, mean: float = 0.0) -> torch.Tensor:
        tensor = torch.empty(shape, dtype=torch.float32, device=device)
        tensor.normal_(mean, std, generator=generator)
        return tensor.to(dtype)

    tensors = {}
    for name, shape in hf_tensor_shapes(config).items():
        if name.endswith("norm.weight"):  # (Gemma 3 stores w, scaling by 1 + w)
            tensors[name] = normal(*shape, mean=0.0 if config.gemma else 1.0, std=0.1)
        elif name.endswith(".bias"):
            tensors[name] = normal(*shape, std=0.02)
        elif name == "model.embed_tokens.weight":
            tensors[name] = normal(*shape, std=1.0)
        else:
            tensors[name] = normal(*shape, std=shape[-1] ** -0.5)
    return from_hf_tensors(config, tensors)


# ---------------------------------------------------------------------- checkpoints


def save_checkpoint(
    config: ModelConfig,
    weights: ModelWeights,
    model_dir: str | Path,
    *,
    architecture: str = "LlamaForCausalLM",
) -> Path:
    """Write `config.json` and `model.safetensors` (HF names) into `model_dir`."""
    from safetensors.torch import save_file

    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    hf = write_hf_config(config, architecture)
    hf["torch_dtype"] = str(weights.dtype).removeprefix("torch.")
    (model_dir / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    tensors = {k: v.detach().cpu() for k, v in to_hf_tensors(config, weights).items()}
    save_file(tensors, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    return model_dir


def read_model_config(
    model_dir: str | Path,
    *,
    num_source_layers: int | None = None,
    window_tokens: int | None = None,
    model_id: str | None = None,
) -> ModelConfig:
    """The `ModelConfig` of a checkpoint directory. `model_id` defaults to a digest of
    config.json and every safetensors file's bytes, so different weights never share pages."""
    model_dir = Path(model_dir)
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"{model_dir}: no config.json")
    try:
        hf = json.loads(config_path.read_text())
    except json.JSONDecodeError as error:
        raise CheckpointError(f"{config_path}: not valid JSON ({error})") from None
    files = _safetensors_files(model_dir)
    try:
        return model_config_from_hf(
            hf,
            model_id=model_id or content_digest(model_dir, [config_path, *files]),
            num_source_layers=num_source_layers,
            window_tokens=window_tokens,
        )
    except (HFConfigError, ValueError) as error:
        raise CheckpointError(f"{config_path}: {error}") from None


def load_weights(
    config: ModelConfig, model_dir: str | Path, *, dtype: torch.dtype, device="cpu"
) -> ModelWeights:
    """Read the checkpoint in `model_dir`, checking every tensor `config` needs first."""
    from safetensors import safe_open

    model_dir = Path(model_dir)
    expected = hf_tensor_shapes(config)
    found: dict[str, tuple[Path, tuple[int, ...]]] = {}
    for path in _safetensors_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as handle:
            for name in handle.keys():
                found[name] = (path, tuple(handle.get_slice(name).get_shape()))
    problems = [
        f"missing tensor {name} {list(shape)}"
        for name, shape in expected.items()
        if name not in found
    ]
    problems += [
        f"tensor {name} has shape {list(found[name][1])}, expected {list(shape)} "
        f"(in {found[name][0].name})"
        for name, shape in expected.items()
        if name in found and found[name][1] != shape
    ]
    problems += [
        f"unexpected tensor {name} (the config does not declare it: this engine's model would "
        "not be the checkpoint's)"
        for name in sorted(set(found) - set(expected))
        if not _harmless_extra(config, name)
    ]
    if problems:
        raise CheckpointError(f"{model_dir}: " + "; ".join(problems))
    tensors = {}
    for path, names in _by_file(expected, found):
        with safe_open(str(path), framework="pt", device="cpu") as handle:
            for name in names:
                tensors[name] = handle.get_tensor(name).to(device=device, dtype=dtype)
    return from_hf_tensors(config, tensors)


def _harmless_extra(config: ModelConfig, name: str) -> bool:
    """Tensors a checkpoint may hold that change nothing: rotary tables (computed from the
    config) and, when the head is tied to the embedding, a stored head (transformers too
    ties it and ignores the stored one)."""
    if name.endswith("rotary_emb.inv_freq"):
        return True
    return config.tie_word_embeddings and name == "lm_head.weight"


def _safetensors_files(model_dir: Path) -> list[Path]:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{model_dir}: no *.safetensors files")
    return files


def _by_file(expected, found) -> Iterator[tuple[Path, list[str]]]:
    groups: dict[Path, list[str]] = {}
    for name in expected:
        groups.setdefault(found[name][0], []).append(name)
    yield from groups.items()


def content_digest(model_dir: Path, paths: list[Path]) -> str:
    """`<dir name>@<xxh3 of the files>`: a model id that changes with the weights."""
    hasher = xxhash.xxh3_128()
    for path in paths:
        hasher.update(path.name.encode() + b"\0")
        with open(path, "rb") as handle:
            while chunk := handle.read(_HASH_CHUNK_BYTES):
                hasher.update(chunk)
    return f"{model_dir.name}@{hasher.hexdigest()}"
