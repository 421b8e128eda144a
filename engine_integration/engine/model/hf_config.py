"""Hugging Face `config.json` <-> `ModelConfig`, for Llama, Qwen2, Mistral and Gemma 3.

Both generations of transformers' config are read: 5.x keeps the rotary embedding in
`rope_parameters` (`rope_theta`, `rope_type` and the scaling's own keys, possibly one dict per
layer type); 4.x has a top-level `rope_theta` and `rope_scaling`. Rope types: default, linear,
llama3.

The hybrid plan is read from, in this order: `layer_types` (a run of "full_attention" then a
run of "sliding_attention": late layers; Gemma 3's any mix: interleaved, the sliding ones
become `windowed_layers`; other architectures' interleaving is refused), Gemma 3's
`sliding_window_pattern` (every n-th layer full, when it has no `layer_types`), Qwen2's
`use_sliding_window` + `max_window_layers`, Mistral's `sliding_window` (every layer sliding:
refused unless overridden, since the cache needs at least one full-attention layer). A model
with none of these has only source layers.

Gemma 3 (`Gemma3ForCausalLM`) brings its block (`config.BLOCKS`), `query_pre_attn_scalar`,
`final_logit_softcapping` and a rotary base per layer type (`rope_parameters` by layer type,
or 4.x's `rope_theta` and `rope_local_base_freq`).

Anything that changes the math and that this engine does not implement (another activation,
partial rotary, other rope types, attention soft-capping, QK norms outside Gemma 3, MLP
biases, a config that does not say its architecture) is refused by name, never run as
something else. Torch-free.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from engine_integration.engine.model.config import ModelConfig, RopeScaling

ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM", "Gemma3ForCausalLM")
GEMMA3 = "Gemma3ForCausalLM"
ROPE_TYPES = ("default", "linear", "llama3")
ACTIVATIONS = ("silu", "swish")
GEMMA_ACTIVATIONS = ("gelu_pytorch_tanh",)
GEMMA_SLIDING_WINDOW_PATTERN = 6  # transformers' default: layers 5, 11, ... are full
_REQUIRED = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
)
# Keys that change the model's math, with the values under which they change nothing. Any
# other value is an error: the engine does not implement it.
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "partial_rotary_factor": (None, 1, 1.0),
    "mlp_bias": (None, False),
    "attn_logit_softcapping": (None,),
    "use_qk_norm": (None, False),
    "qk_layernorm": (None, False),
    "attention_chunk_size": (None,),
    "no_rope_layers": (None,),
    "use_bidirectional_attention": (None, False),
    "embedding_multiplier": (None, 1, 1.0),
    "logits_scaling": (None, 1, 1.0),
    "residual_multiplier": (None, 1, 1.0),
    "attention_multiplier": (None,),
    "query_pre_attn_scalar": (None,),  # (read for Gemma 3)
}
_LAYER_TYPES = ("full_attention", "sliding_attention")
DEFAULT_WINDOW_TOKENS = 128


class HFConfigError(ValueError):
    """A config.json this engine cannot run; the message names the field."""


def model_config_from_hf(
    hf: Mapping[str, Any],
    *,
    model_id: str,
    num_source_layers: int | None = None,
    window_tokens: int | None = None,
) -> ModelConfig:
    """A config from a Hugging Face `config.json` (LlamaForCausalLM, Qwen2ForCausalLM,
    MistralForCausalLM). The hybrid plan comes from `layer_types`, or Qwen2's
    `use_sliding_window` / `max_window_layers`, or Mistral's `sliding_window`; the two
    keyword arguments override it (and so change the model's attention pattern)."""
    fields = read_hf_config(hf, num_source_layers, window_tokens)
    return ModelConfig(model_id=model_id, **fields)


def read_hf_config(
    hf: Mapping[str, Any], num_source_layers: int | None, window_tokens: int | None
) -> dict[str, Any]:
    architectures = _check_math(hf)
    missing = [name for name in _REQUIRED if name not in hf]
    if missing:
        raise HFConfigError(f"config.json lacks {missing}")
    num_layers = int(hf["num_hidden_layers"])
    num_heads = int(hf["num_attention_heads"])
    qwen2 = "Qwen2ForCausalLM" in architectures
    gemma = GEMMA3 in architectures
    attention_bias = bool(hf.get("attention_bias", False))
    windowed: tuple[int, ...] = ()
    layer_types = _layer_types(hf, num_layers, gemma)
    if gemma and _interleaved(layer_types):
        windowed = tuple(i for i, kind in enumerate(layer_types) if kind == "sliding_attention")
        source, window = num_layers, hf.get("sliding_window")
        if not window:
            raise HFConfigError("config.json has sliding_attention layers but no sliding_window")
        if num_source_layers is not None:
            raise HFConfigError(
                "num_source_layers cannot re-plan an interleaved model (its layer_types "
                "interleave sliding_attention and full_attention layers)"
            )
    else:
        source, window = _layer_plan(hf, num_layers, qwen2)
    if num_source_layers is not None:
        source = num_source_layers
    if window_tokens is not None:
        window = window_tokens
    if source is None:
        raise HFConfigError(
            f"config.json makes every layer sliding-window (sliding_window="
            f"{hf.get('sliding_window')}); the cache needs full-attention source layers first: "
            "pass num_source_layers (for prompts within the window, full attention is the same)"
        )
    rope_theta, rope_scaling, local_theta = _rope(hf, gemma)
    scalar = hf.get("query_pre_attn_scalar") if gemma else None
    softcap = hf.get("final_logit_softcapping")
    return {
        "vocab_size": int(hf["vocab_size"]),
        "hidden_size": int(hf["hidden_size"]),
        "intermediate_size": int(hf["intermediate_size"]),
        "num_layers": num_layers,
        "num_heads": num_heads,
        "num_kv_heads": int(hf.get("num_key_value_heads") or num_heads),
        "head_dim": int(hf.get("head_dim") or int(hf["hidden_size"]) // num_heads),
        "num_source_layers": source,
        "window_tokens": window or DEFAULT_WINDOW_TOKENS,
        "rms_norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
        "rope_theta": rope_theta,
        "rope_scaling": rope_scaling,
        "qkv_bias": qwen2 or attention_bias,
        "o_bias": attention_bias and not qwen2,
        "tie_word_embeddings": bool(hf.get("tie_word_embeddings", gemma)),
        "windowed_layers": windowed,
        "block": "gemma3" if gemma else "llama",
        "local_rope_theta": local_theta if windowed else None,
        "query_pre_attn_scalar": float(scalar) if scalar is not None else None,
        "final_logit_softcapping": float(softcap) if softcap is not None else None,
    }


def _layer_types(hf: Mapping[str, Any], num_layers: int, gemma: bool) -> list[str] | None:
    """The config's `layer_types`, or Gemma 3's from its sliding-window pattern."""
    if hf.get("layer_types"):
        return list(hf["layer_types"])
    if not gemma:
        return None
    pattern = int(hf.get("sliding_window_pattern") or GEMMA_SLIDING_WINDOW_PATTERN)
    return [
        "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
        for i in range(num_layers)
    ]


def _interleaved(layer_types: list[str]) -> bool:
    """Whether some sliding_attention layer comes before a full_attention one."""
    unknown = set(layer_types) - set(_LAYER_TYPES)
    if unknown:
        raise HFConfigError(f"config.json layer_types has unknown types {sorted(unknown)}")
    first_sliding = next(
        (i for i, kind in enumerate(layer_types) if kind == "sliding_attention"), None
    )
    return first_sliding is not None and "full_attention" in layer_types[first_sliding:]


def _check_math(hf: Mapping[str, Any]) -> list[str]:
    """The config's architectures, after refusing every math key we do not implement."""
    architectures = hf.get("architectures") or []
    if not architectures:
        raise HFConfigError(
            f"config.json has no architectures; which model it is decides the math "
            f"(supported: {', '.join(ARCHITECTURES)})"
        )
    unknown = [a for a in architectures if a not in ARCHITECTURES]
    if unknown:
        raise HFConfigError(
            f"config.json architectures {unknown} are not supported; supported: {ARCHITECTURES}"
        )
    gemma = GEMMA3 in architectures
    activations = GEMMA_ACTIVATIONS if gemma else ACTIVATIONS
    for key in ("hidden_act", "hidden_activation"):
        act = hf.get(key)
        if act is not None and act not in activations:
            raise HFConfigError(
                f"config.json {key} {act!r} is not supported for {architectures[0]} "
                f"(supported: {', '.join(activations)})"
            )
    for key, neutral in _NEUTRAL.items():
        if gemma and key == "query_pre_attn_scalar":
            continue
        if key in hf and hf[key] not in neutral:
            raise HFConfigError(
                f"config.json sets {key}={hf[key]!r}, which this engine does not implement"
            )
    return list(architectures)


def _rope(hf: Mapping[str, Any], gemma: bool = False):
    """(rope_theta, RopeScaling | None, the sliding layers' rope_theta) from 5.x
    `rope_parameters` or 4.x fields. Only Gemma 3 has a rotary embedding per layer type:
    its sliding layers' base, without scaling."""
    params = hf.get("rope_parameters")
    local_theta = None
    if params and set(params) <= set(_LAYER_TYPES):  # one dict per layer type
        if gemma:
            local = dict(params.get("sliding_attention") or {})
            if (local.get("rope_type") or "default") != "default":
                raise HFConfigError(
                    f"config.json rope_parameters.sliding_attention {local} is not supported "
                    "(the sliding layers' rotary embedding takes no scaling)"
                )
            local_theta = local.get("rope_theta")
            params = params.get("full_attention") or {}
        else:
            first, *others = params.values()
            for layer_type, other in params.items():
                if other != first:
                    raise HFConfigError(
                        f"config.json rope_parameters differ by layer type ({layer_type}: "
                        f"{other} vs {first}); this engine has one rotary embedding"
                    )
            params = first
    if gemma and local_theta is None:
        local_theta = hf.get("rope_local_base_freq", 10000.0)
    legacy_theta = hf.get("rope_theta")
    if params:
        theta = params.get("rope_theta", legacy_theta)
        if legacy_theta is not None and theta != legacy_theta:
            raise HFConfigError(
                f"config.json rope_theta {legacy_theta} disagrees with rope_parameters."
                f"rope_theta {theta}"
            )
        factor = params.get("partial_rotary_factor")
        if factor not in _NEUTRAL["partial_rotary_factor"]:
            raise HFConfigError(
                f"config.json rope_parameters.partial_rotary_factor={factor!r} is not supported"
            )
        scaling = params if (params.get("rope_type") or params.get("type")) else None
        scaling = scaling or hf.get("rope_scaling")
    else:
        theta, scaling = legacy_theta, hf.get("rope_scaling")
    theta = float(theta if theta is not None else 10000.0)
    return theta, _rope_scaling(scaling), None if local_theta is None else float(local_theta)


def _layer_plan(
    hf: Mapping[str, Any], num_layers: int, qwen2: bool
) -> tuple[int | None, int | None]:
    """(num_source_layers, window) from the config; None source = every layer slides."""
    window = hf.get("sliding_window")
    layer_types = hf.get("layer_types")
    if layer_types:
        if len(layer_types) != num_layers:
            raise HFConfigError(
                f"config.json layer_types has {len(layer_types)} entries for {num_layers} layers"
            )
        source = 0
        while source < num_layers and layer_types[source] == "full_attention":
            source += 1
        rest = set(layer_types[source:])
        if rest - {"sliding_attention"}:
            raise HFConfigError(
                "config.json layer_types must be full_attention layers followed by "
                f"sliding_attention layers; got {layer_types}"
            )
        if source == 0:
            return None, window
        return source, window if source < num_layers else None
    if qwen2:
        if hf.get("use_sliding_window") and window:
            source = int(hf.get("max_window_layers", num_layers))
            source = min(max(source, 0), num_layers)
            return (source or None), window
        return num_layers, None
    if window:  # Mistral: one window for every layer
        return None, window
    return num_layers, None


def _rope_scaling(raw: Mapping[str, Any] | None):
    if not raw:
        return None
    kind = raw.get("rope_type") or raw.get("type")
    if kind is None:
        raise HFConfigError(f"config.json rope scaling {dict(raw)} names no rope_type")
    if kind == "default":
        return None
    if kind == "linear":
        return RopeScaling(kind="linear", factor=float(raw["factor"]))
    if kind == "llama3":
        return RopeScaling(
            kind="llama3",
            factor=float(raw["factor"]),
            low_freq_factor=float(raw.get("low_freq_factor", 1.0)),
            high_freq_factor=float(raw.get("high_freq_factor", 4.0)),
            original_max_position_tokens=int(raw.get("original_max_position_embeddings", 8192)),
        )
    raise HFConfigError(
        f"config.json rope_type {kind!r} is not supported (supported: {', '.join(ROPE_TYPES)})"
    )


def write_hf_config(config, architecture: str = "LlamaForCausalLM") -> dict[str, Any]:
    """The `config.json` of `config` (a ModelConfig) under `architecture`, for checkpoints
    this package writes; `read_hf_config` reads it back to the same fields."""
    if architecture not in ARCHITECTURES:
        raise HFConfigError(f"architecture must be one of {ARCHITECTURES}, got {architecture!r}")
    if (architecture == GEMMA3) != config.gemma:
        raise HFConfigError(f"{architecture} cannot express block={config.block!r}")
    if config.gemma:
        return _write_gemma3(config)
    if config.windowed_layers or config.final_logit_softcapping is not None:
        raise HFConfigError(f"{architecture} here writes no interleaved layers or soft-capping")
    qwen2 = architecture == "Qwen2ForCausalLM"
    if qwen2 != config.qkv_bias or config.o_bias:
        raise HFConfigError(
            f"{architecture} cannot express qkv_bias={config.qkv_bias}, o_bias={config.o_bias}"
        )
    out: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}.get(
            architecture, "mistral"
        ),
        **_shape_fields(config),
        "rope_parameters": _write_rope(config),
        "tie_word_embeddings": config.tie_word_embeddings,
        "hidden_act": "silu",
    }
    if config.num_late_layers:
        out["sliding_window"] = config.window_tokens
        out["layer_types"] = ["full_attention"] * config.num_source_layers + [
            "sliding_attention"
        ] * config.num_late_layers
    return out


def _shape_fields(config) -> dict[str, Any]:
    """The config.json fields of the model's shape, the same in every architecture."""
    return {
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "rms_norm_eps": config.rms_norm_eps,
    }


def _write_gemma3(config) -> dict[str, Any]:
    """A Gemma3ForCausalLM (`gemma3_text`) config.json of `config`."""
    if config.qkv_bias or config.o_bias:
        raise HFConfigError("Gemma3ForCausalLM has no attention biases")
    windowed = set(config.windowed_layers)
    local = {"rope_theta": config.local_rope_theta or config.rope_theta, "rope_type": "default"}
    return {
        "architectures": [GEMMA3],
        "model_type": "gemma3_text",
        **_shape_fields(config),
        "hidden_activation": GEMMA_ACTIVATIONS[0],
        # (an int where it is one: transformers' Gemma3TextConfig takes no float here)
        "query_pre_attn_scalar": _int_if_whole(config.query_pre_attn_scalar or config.head_dim),
        "sliding_window": config.window_tokens,
        "layer_types": [
            "sliding_attention" if i in windowed else "full_attention"
            for i in range(config.num_layers)
        ],
        "rope_parameters": {"full_attention": _write_rope(config), "sliding_attention": local},
        "attn_logit_softcapping": None,
        "final_logit_softcapping": config.final_logit_softcapping,
        "tie_word_embeddings": config.tie_word_embeddings,
        "attention_bias": False,
    }


def _int_if_whole(value: float) -> float | int:
    return int(value) if float(value).is_integer() else value


def _write_rope(config) -> dict[str, Any]:
    rope: dict[str, Any] = {"rope_theta": config.rope_theta, "rope_type": "default"}
    scaling = config.rope_scaling
    if scaling is not None:
        rope.update(rope_type=scaling.kind, factor=scaling.factor)
        if scaling.kind == "llama3":
            rope.update(
                low_freq_factor=scaling.low_freq_factor,
                high_freq_factor=scaling.high_freq_factor,
                original_max_position_embeddings=scaling.original_max_position_tokens,
            )
    return rope
