"""Model presets: the architecture numbers that size KV pages, weights and prefill compute.

A `ModelSpec` is the part of a model's `config.json` the simulator needs. Everything else
follows from it by formula:

- cached KV bytes per token, over the full-attention layers only (sliding-window layers
  are rebuilt by encoder replay, never cached; DESIGN.md):
      GQA  2 x layers x kv_heads x head_dim x dtype bytes
      MLA  layers x (kv_lora_rank + rope_dim) x dtype bytes
  plus MTP layers and a draft model's KV when they are enabled (they share the budget);
- sliding-window KV: per sequence, capped at the window;
- parameters (weights memory) and active parameters (prefill FLOPs), from the layer shapes;
- prefill FLOPs: 2 x active linear parameters per token, plus attention's quadratic part.

Presets are written from the public `config.json` files; `from_hf_config` reads any such
file (nested `text_config`, `layer_types`, Gemma's sliding-window pattern, FP8 and MXFP4
quantization configs).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass
from pathlib import Path

from hicache.simulate.errors import SimulationError
from tiers.layout import DTYPE_BYTES, KVLayout

# Weight bytes per parameter by checkpoint format; MXFP4 is 4 bits plus one 8-bit scale per
# 32 values. Embeddings and non-expert layers of an MXFP4 checkpoint stay bf16.
WEIGHT_BYTES = {"bfloat16": 2.0, "float16": 2.0, "float8_e4m3fn": 1.0, "mxfp4": 4.25 / 8}
_DTYPE_ALIASES = {
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
    "fp8": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn",
    "float8": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
    "fp32": "float32",
    "float": "float32",
}


def canonical_dtype(name: str) -> str:
    """A dtype as `tiers.layout` spells it ("bf16" -> "bfloat16", "fp8" -> "float8_e4m3fn")."""
    dtype = _DTYPE_ALIASES.get(name.lower(), name.lower())
    if dtype not in DTYPE_BYTES:
        raise ValueError(
            f"unknown dtype {name!r}; use one of {sorted(DTYPE_BYTES)} or bf16, fp16, fp8"
        )
    return dtype


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer, as far as KV, weights and FLOPs go.

    `num_layers` counts every decoder layer; `num_sliding_layers` of them use
    sliding-window attention over `sliding_window` tokens. MoE models name their experts;
    the first `num_dense_layers` layers of an MoE model have a dense MLP of
    `intermediate_size`. `mtp_layers` are multi-token-prediction layers the checkpoint
    carries; `use_mtp` (and `draft`) add their KV and weights to the budget.
    """

    name: str
    attention: str  # "gqa" (MHA/GQA/MQA) or "mla"
    num_layers: int
    hidden_size: int
    num_heads: int
    vocab_size: int
    intermediate_size: int
    head_dim: int = 0  # gqa
    num_kv_heads: int = 0  # gqa
    q_lora_rank: int = 0  # mla (0: a plain query projection)
    kv_lora_rank: int = 0  # mla
    qk_nope_dim: int = 0  # mla
    qk_rope_dim: int = 0  # mla
    v_head_dim: int = 0  # mla
    num_experts: int = 0
    experts_per_token: int = 0
    num_shared_experts: int = 0
    moe_intermediate_size: int = 0
    num_dense_layers: int = 0
    tie_embeddings: bool = False
    sliding_window: int = 0
    num_sliding_layers: int = 0
    mtp_layers: int = 0
    use_mtp: bool = False
    weight_dtype: str = "bfloat16"
    kv_dtype: str = "bfloat16"
    # Layers of the same shape the embedded engine adds to every cached page of a hybrid
    # model (its boundary residual: `ModelConfig.num_boundary_layers`); 0 for the presets.
    num_boundary_layers: int = 0
    draft: ModelSpec | None = None

    def __post_init__(self) -> None:
        if self.attention not in ("gqa", "mla"):
            raise ValueError(f"ModelSpec.attention must be 'gqa' or 'mla', got {self.attention!r}")
        if self.attention == "gqa" and (self.head_dim < 1 or self.num_kv_heads < 1):
            raise ValueError(f"{self.name}: a GQA model needs head_dim and num_kv_heads >= 1")
        if self.attention == "mla" and self.kv_lora_rank < 1:
            raise ValueError(f"{self.name}: an MLA model needs kv_lora_rank >= 1")
        if not 0 <= self.num_sliding_layers < self.num_layers:
            raise ValueError(
                f"{self.name}: num_sliding_layers must be in [0, {self.num_layers}) "
                "(a prefix cache holds the full-attention layers)"
            )
        if self.num_sliding_layers and self.sliding_window < 1:
            raise ValueError(f"{self.name}: sliding layers need sliding_window >= 1")
        if self.weight_dtype not in WEIGHT_BYTES:
            raise ValueError(
                f"{self.name}: weight_dtype must be one of {sorted(WEIGHT_BYTES)}, "
                f"got {self.weight_dtype!r}"
            )
        if self.kv_dtype not in DTYPE_BYTES:
            raise ValueError(f"{self.name}: kv_dtype must be one of {sorted(DTYPE_BYTES)}")
        if self.num_boundary_layers < 0:
            raise ValueError(f"{self.name}: num_boundary_layers must be >= 0")

    def replace(self, **changes) -> ModelSpec:
        return dataclasses.replace(self, **changes)

    # -- KV -------------------------------------------------------------------------------

    @property
    def num_full_layers(self) -> int:
        return self.num_layers - self.num_sliding_layers

    @property
    def kv_bytes_per_token_per_layer(self) -> int:
        dtype_bytes = DTYPE_BYTES[self.kv_dtype]
        if self.attention == "gqa":
            return 2 * self.num_kv_heads * self.head_dim * dtype_bytes
        return (self.kv_lora_rank + self.qk_rope_dim) * dtype_bytes

    @property
    def num_cached_layers(self) -> int:
        """Layers of KV in a cached page: full-attention, boundary, and MTP when used."""
        return (
            self.num_full_layers
            + self.num_boundary_layers
            + (self.mtp_layers if self.use_mtp else 0)
        )

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of KV the cache holds per prompt token: full-attention layers (and the
        engine's boundary layers), plus MTP layers when used, plus the draft model's."""
        layers = self.num_cached_layers
        own = layers * self.kv_bytes_per_token_per_layer
        return own + (self.draft.kv_bytes_per_token if self.draft else 0)

    @property
    def sliding_kv_bytes_per_sequence(self) -> int:
        """Sliding-window KV of one sequence (capped at the window; never cached)."""
        own = self.num_sliding_layers * self.kv_bytes_per_token_per_layer * self.sliding_window
        return own + (self.draft.sliding_kv_bytes_per_sequence if self.draft else 0)

    def kv_layout(self, page_size: int) -> KVLayout:
        """The layout of one cached page, for the controller.

        The model's own layout where one exists (a GQA or MLA model without a draft).
        Otherwise (a draft model's KV rides along) an opaque one: one layer of uint8 whose
        "latent" is the per-token byte count; the simulator moves no bytes, and this gives
        the controller's ops exactly the page size in bytes.
        """
        if self.draft is None:
            layers = self.num_cached_layers
            if self.attention == "gqa":
                return KVLayout(
                    kind="mha",
                    num_layers=layers,
                    page_size=page_size,
                    dtype=self.kv_dtype,
                    num_kv_heads=self.num_kv_heads,
                    head_dim=self.head_dim,
                )
            return KVLayout(
                kind="mla",
                num_layers=layers,
                page_size=page_size,
                dtype=self.kv_dtype,
                kv_lora_rank=self.kv_lora_rank,
                rope_dim=self.qk_rope_dim,
            )
        return KVLayout(
            kind="mla",
            num_layers=1,
            page_size=page_size,
            dtype="uint8",
            kv_lora_rank=self.kv_bytes_per_token,
        )

    # -- parameters -------------------------------------------------------------------------

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size * (1 if self.tie_embeddings else 2)

    @property
    def attention_params_per_layer(self) -> int:
        h, n = self.hidden_size, self.num_heads
        if self.attention == "gqa":
            q_out = n * self.head_dim
            return h * q_out + 2 * h * self.num_kv_heads * self.head_dim + q_out * h
        qk_dim = self.qk_nope_dim + self.qk_rope_dim
        if self.q_lora_rank:
            query = h * self.q_lora_rank + self.q_lora_rank * n * qk_dim
        else:
            query = h * n * qk_dim
        kv = h * (self.kv_lora_rank + self.qk_rope_dim)
        kv += self.kv_lora_rank * n * (self.qk_nope_dim + self.v_head_dim)
        return query + kv + n * self.v_head_dim * h

    @property
    def _expert_params(self) -> int:
        return 3 * self.hidden_size * self.moe_intermediate_size  # gate, up, down

    def _mlp_params(self, layer: int, *, active: bool) -> tuple[int, int]:
        """(expert params, other MLP params) of one layer."""
        if not self.num_experts or layer < self.num_dense_layers:
            return 0, 3 * self.hidden_size * self.intermediate_size
        routed = self.experts_per_token if active else self.num_experts
        shared = self.num_shared_experts * self._expert_params
        return routed * self._expert_params, shared + self.hidden_size * self.num_experts

    def _layer_params(self, *, active: bool) -> tuple[int, int]:
        """(expert params, other params) over all decoder layers."""
        experts = other = 0
        for layer in range(self.num_layers):
            e, o = self._mlp_params(layer, active=active)
            experts += e
            other += o + self.attention_params_per_layer
        return experts, other

    @property
    def _mtp_params(self) -> tuple[int, int]:
        """One MTP layer: a decoder layer (MoE where the model is) plus its input projection."""
        if not self.mtp_layers:
            return 0, 0
        e, o = self._mlp_params(self.num_layers - 1, active=False)
        per_layer = (e, o + self.attention_params_per_layer + 2 * self.hidden_size**2)
        return per_layer[0] * self.mtp_layers, per_layer[1] * self.mtp_layers

    @functools.cached_property
    def num_params(self) -> int:
        experts, other = self._layer_params(active=False)
        return experts + other + self.embedding_params

    @functools.cached_property
    def num_active_params(self) -> int:
        experts, other = self._layer_params(active=True)
        return experts + other + self.embedding_params

    @functools.cached_property
    def weight_bytes(self) -> int:
        """Weights in HBM: experts in the checkpoint's format, other linear layers too
        unless that format is MXFP4 (then bf16), embeddings in bf16; plus MTP and draft."""
        experts, other = self._layer_params(active=False)
        if self.use_mtp:
            mtp_experts, mtp_other = self._mtp_params
            experts, other = experts + mtp_experts, other + mtp_other
        expert_bytes = WEIGHT_BYTES[self.weight_dtype]
        other_bytes = 2.0 if self.weight_dtype == "mxfp4" else expert_bytes
        total = experts * expert_bytes + other * other_bytes + self.embedding_params * 2.0
        return int(total) + (self.draft.weight_bytes if self.draft else 0)

    @property
    def compute_dtype(self) -> str:
        """The GEMM precision of prefill: fp8 for an FP8 checkpoint, else bf16."""
        return "fp8" if self.weight_dtype == "float8_e4m3fn" else "bf16"

    # -- prefill FLOPs ----------------------------------------------------------------------

    def prefill_flops(self, num_cached: int, num_tokens: int) -> float:
        """FLOPs to prefill tokens [num_cached, num_tokens) over a cached prefix.

        Linear layers: 2 x active parameters (embeddings aside) per computed token.
        Attention: each new token at position p attends to p + 1 keys (to at most the
        window in sliding layers): QK^T and AV cost 2 x heads x (d_qk + d_v) per key. A hit
        on a model with sliding layers replays the last window of cached tokens
        (DESIGN.md), which costs their linear FLOPs again.
        """
        computed = num_tokens - num_cached
        if self.num_sliding_layers and num_cached:
            computed += min(self.sliding_window, num_cached)
        linear = 2.0 * (self.num_active_params - self.embedding_params) * computed
        if self.attention == "gqa":
            per_key = 2.0 * self.num_heads * (2 * self.head_dim)
        else:
            per_key = 2.0 * self.num_heads * (self.qk_nope_dim + self.qk_rope_dim + self.v_head_dim)
        keys = self.num_full_layers * (_causal_keys(num_tokens) - _causal_keys(num_cached))
        if self.num_sliding_layers:
            window = self.sliding_window
            keys += self.num_sliding_layers * (
                _windowed_keys(num_tokens, window) - _windowed_keys(num_cached, window)
            )
        total = linear + per_key * keys
        if self.draft is not None:
            total += self.draft.prefill_flops(num_cached, num_tokens)
        return total


def _causal_keys(n: int) -> float:
    """Keys attended by queries 0..n-1 of a causal prefill: 1 + 2 + ... + n."""
    return n * (n + 1) / 2.0


def _windowed_keys(n: int, window: int) -> float:
    if n <= window:
        return n * (n + 1) / 2.0
    return window * (window + 1) / 2.0 + (n - window) * window


# ---------------------------------------------------------------------------- presets


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


# ---------------------------------------------------------------------------- config.json


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
