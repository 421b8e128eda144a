"""Model specs: the architecture numbers that size KV pages, weights and prefill compute.

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

Presets (`model_presets.py`) are written from the public `config.json` files;
`from_hf_config` (`hf_config.py`) reads any such file (nested `text_config`, `layer_types`,
Gemma's sliding-window pattern, FP8 and MXFP4 quantization configs).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

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
