"""Reading a Hugging Face `config.json` into a `ModelSpec` (see `models.py`).

Handles a nested `text_config`, `layer_types`, Gemma's sliding-window pattern, and FP8 and
MXFP4 quantization configs; any other quantization method is an error that names it.
"""

from __future__ import annotations

import json
from pathlib import Path

from hicache.simulate.errors import SimulationError
from hicache.simulate.models import WEIGHT_BYTES, ModelSpec, canonical_dtype


def from_hf_config(path: str | Path, name: str | None = None) -> ModelSpec:
    """Read a Hugging Face `config.json` (text part of a multimodal one too)."""
    path = Path(path)
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except OSError as error:
        raise SimulationError(f"{path}: cannot read: {error.strerror or error}") from None
    except json.JSONDecodeError as error:
        raise SimulationError(
            f"{path}: not valid JSON ({error.msg}, line {error.lineno})"
        ) from None
    if not isinstance(config, dict):
        raise SimulationError(f"{path}: expected a JSON object")
    try:
        return _spec_from_config(config, name or path.parent.name or path.stem)
    except KeyError as error:
        raise SimulationError(f"{path}: missing field {error.args[0]!r}") from None
    except (TypeError, ValueError) as error:
        raise SimulationError(f"{path}: {error}") from None


def _spec_from_config(config: dict, name: str) -> ModelSpec:
    top = config
    if isinstance(config.get("text_config"), dict):
        config = {**config, **config["text_config"]}
    model_type = str(config.get("model_type", ""))
    layers = int(config["num_hidden_layers"])
    hidden = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    fields: dict = dict(
        name=name,
        num_layers=layers,
        hidden_size=hidden,
        num_heads=heads,
        vocab_size=int(config["vocab_size"]),
        intermediate_size=int(config.get("intermediate_size") or 0),
        tie_embeddings=bool(config.get("tie_word_embeddings", model_type.startswith("gemma"))),
    )
    if config.get("kv_lora_rank"):
        fields.update(
            attention="mla",
            q_lora_rank=int(config.get("q_lora_rank") or 0),
            kv_lora_rank=int(config["kv_lora_rank"]),
            qk_nope_dim=int(config["qk_nope_head_dim"]),
            qk_rope_dim=int(config["qk_rope_head_dim"]),
            v_head_dim=int(config["v_head_dim"]),
            mtp_layers=int(config.get("num_nextn_predict_layers") or 0),
        )
    else:
        fields.update(
            attention="gqa",
            head_dim=int(config.get("head_dim") or hidden // heads),
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
        )
    fields.update(_moe_fields(config))
    fields.update(_sliding_fields(config, model_type, layers))
    dtype = str(top.get("torch_dtype") or top.get("dtype") or config.get("torch_dtype") or "bf16")
    fields["kv_dtype"] = canonical_dtype(dtype)
    fields["weight_dtype"] = _weight_dtype(config.get("quantization_config"), fields["kv_dtype"])
    return ModelSpec(**fields)


def _moe_fields(config: dict) -> dict:
    experts = config.get("n_routed_experts") or config.get("num_experts")
    experts = experts or config.get("num_local_experts") or 0
    if not experts:
        return {}
    return dict(
        num_experts=int(experts),
        experts_per_token=int(
            config.get("num_experts_per_tok") or config.get("experts_per_token") or 1
        ),
        num_shared_experts=int(config.get("n_shared_experts") or 0),
        moe_intermediate_size=int(
            config.get("moe_intermediate_size") or config["intermediate_size"]
        ),
        num_dense_layers=int(config.get("first_k_dense_replace") or 0),
    )


def _sliding_fields(config: dict, model_type: str, layers: int) -> dict:
    window = int(config.get("sliding_window") or 0)
    layer_types = config.get("layer_types")
    if isinstance(layer_types, list) and layer_types:
        sliding = sum(1 for kind in layer_types if kind == "sliding_attention")
    elif model_type.startswith("gemma3") and window:
        pattern = int(
            config.get("sliding_window_pattern") or config.get("_sliding_window_pattern") or 6
        )
        sliding = layers - layers // pattern  # layer i is global when (i + 1) % pattern == 0
    elif model_type.startswith("gemma2") and window:
        sliding = (layers + 1) // 2  # even layers are local
    elif config.get("use_sliding_window") and window:
        sliding = layers - int(config.get("max_window_layers") or 0)
    else:
        sliding = 0
    return dict(num_sliding_layers=sliding, sliding_window=window if sliding else 0)


def _weight_dtype(quantization, default: str) -> str:
    if not isinstance(quantization, dict):
        return default if default in WEIGHT_BYTES else "bfloat16"
    method = str(quantization.get("quant_method", "")).lower()
    if method == "fp8":
        return "float8_e4m3fn"
    if method == "mxfp4":
        return "mxfp4"
    raise ValueError(
        f"quantization_config.quant_method {method!r} is not modelled; "
        "pass a preset, or edit the config to fp8 or mxfp4"
    )
