"""Configuration of the embedded engine: the model's architecture and the engine's knobs.

`ModelConfig` describes a decoder-only transformer and its hybrid layer plan: the first
`num_source_layers` layers use full attention (their KV is what hicache caches), the rest
are *late* layers with sliding-window attention over `window_tokens` tokens, whose KV lives
in a per-request window and never leaves the engine (DESIGN.md, "Sliding-window layers").
`hf_config.model_config_from_hf` makes one from a Hugging Face `config.json`.

Interleaved models (Gemma 3: five sliding-window layers for each full-attention one) cannot
put their window layers last: `windowed_layers` names source layers that attend over the
last `window_tokens` positions only. Pages hold the full layers' KV alone (`page_layer`); a
windowed layer's KV lives in the request's ring (`window_ring_layer`), and the cache keeps it
only where a hit needs it, in a sidecar at a sequence's end (engine/sidecar.py;
docs/architecture.md, "Interleaved sliding-window layers").

No torch here: the demo's argument parser imports this module.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

ROPE_SCALING_TYPES = ("linear", "llama3")
# The transformer block: "llama" (pre-norm attention and SwiGLU MLP: Llama, Qwen2, Mistral) or
# "gemma3" (Gemma 3: RMS norms scaling by 1 + weight in float32, norms before and after the
# attention and the MLP, query/key norms per head, GELU (tanh) gating, the embedding scaled by
# sqrt(hidden_size)).
BLOCKS = ("llama", "gemma3")
DEVICES_HELP = "'cpu' or 'cuda[:N]'"


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _positive(owner: str, **values: int | float) -> None:
    for name, value in values.items():
        _require(
            not isinstance(value, bool) and value > 0, f"{owner}.{name} must be > 0, got {value!r}"
        )


@dataclass(frozen=True)
class RopeScaling:
    """Rotary-embedding frequency scaling (`rope_scaling` in a HF config)."""

    kind: str  # "linear" or "llama3"
    factor: float
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position_tokens: int = 8192  # llama3 only

    def __post_init__(self) -> None:
        _require(
            self.kind in ROPE_SCALING_TYPES,
            f"RopeScaling.kind must be one of {ROPE_SCALING_TYPES}, got {self.kind!r}",
        )
        _positive("RopeScaling", factor=self.factor)
        if self.kind == "llama3":
            _require(
                self.high_freq_factor > self.low_freq_factor,
                "RopeScaling.high_freq_factor must be > low_freq_factor",
            )


@dataclass(frozen=True)
class ModelConfig:
    """A decoder-only transformer: RMSNorm, RoPE, GQA attention, gated MLP.

    num_source_layers: the leading layers whose KV hicache caches (and, with late layers,
                       their output: `num_boundary_layers`).
    window_tokens:     the sliding window W of the late layers and of `windowed_layers`: a
                       query at t sees the keys in (t - W, t].
    windowed_layers:   source layers that attend over the window only (interleaved models);
                       the others attend over every position before them.
    block:             the transformer block (`BLOCKS`).
    local_rope_theta:  the rotary base of `windowed_layers` (None: `rope_theta`; they take
                       no `rope_scaling`).
    query_pre_attn_scalar: attention scores scale by its -1/2 power (None: head_dim's).
    final_logit_softcapping: logits become cap * tanh(logits / cap) (None: unchanged).
    model_id:          names the weights in page keys: a different id never shares pages.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_source_layers: int
    window_tokens: int = 128
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    qkv_bias: bool = False
    o_bias: bool = False
    tie_word_embeddings: bool = False
    windowed_layers: tuple[int, ...] = ()
    block: str = "llama"
    local_rope_theta: float | None = None
    query_pre_attn_scalar: float | None = None
    final_logit_softcapping: float | None = None
    model_id: str = "unnamed"

    def __post_init__(self) -> None:
        _positive(
            "ModelConfig",
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_layers=self.num_layers,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            window_tokens=self.window_tokens,
            rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta,
        )
        _require(
            self.num_heads % self.num_kv_heads == 0,
            f"ModelConfig.num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
            f"({self.num_kv_heads})",
        )
        _require(self.head_dim % 2 == 0, f"ModelConfig.head_dim must be even, got {self.head_dim}")
        _require(
            1 <= self.num_source_layers <= self.num_layers,
            f"ModelConfig.num_source_layers must be in [1, num_layers={self.num_layers}] "
            f"(the cache holds the source layers' KV), got {self.num_source_layers}",
        )
        _require(bool(self.model_id), "ModelConfig.model_id must not be empty")
        _require(
            self.block in BLOCKS, f"ModelConfig.block must be one of {BLOCKS}, got {self.block!r}"
        )
        windowed = self.windowed_layers
        _require(
            list(windowed) == sorted(set(windowed))
            and all(0 <= i < self.num_source_layers for i in windowed),
            f"ModelConfig.windowed_layers must be ascending source layers in "
            f"[0, {self.num_source_layers}), got {windowed}",
        )
        _require(
            not (windowed and self.num_late_layers),
            "ModelConfig: windowed_layers (interleaved) and late window layers together are not "
            "implemented",
        )
        for name in ("local_rope_theta", "query_pre_attn_scalar", "final_logit_softcapping"):
            value = getattr(self, name)
            if value is not None:
                _positive("ModelConfig", **{name: value})

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def gemma(self) -> bool:
        return self.block == "gemma3"

    @property
    def num_late_layers(self) -> int:
        return self.num_layers - self.num_source_layers

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def num_page_layers(self) -> int:
        """Layers of a cached page: the source layers but the windowed ones (their KV is in
        the request's ring and a sidecar), then the boundary layers."""
        return self.num_source_layers - len(self.windowed_layers) + self.num_boundary_layers

    def page_layer(self, layer: int) -> int:
        """The page layer that holds source layer `layer`'s KV (a full-attention one)."""
        return layer - sum(1 for w in self.windowed_layers if w < layer)

    def window_ring_layer(self, layer: int) -> int:
        """The ring layer that holds windowed source layer `layer`'s KV."""
        return self.windowed_layers.index(layer)

    @property
    def num_boundary_layers(self) -> int:
        """Page layers that hold the boundary residual of a hybrid model: the source layers'
        output at each position (`hidden_size` values, padded to whole layers of 2 x
        `kv_size`), which a hit feeds to the late layers instead of replaying the source
        layers; 0 without late layers."""
        if not self.num_late_layers:
            return 0
        return -(-self.hidden_size // (2 * self.kv_size))

    @property
    def num_parameters(self) -> int:
        attention = self.hidden_size * (self.q_size + 2 * self.kv_size) + self.q_size * (
            self.hidden_size
        )
        mlp = 3 * self.hidden_size * self.intermediate_size
        per_layer = attention + mlp + 2 * self.hidden_size
        if self.gemma:  # the norms after attention and after the MLP, the q/k norms
            per_layer += 2 * self.hidden_size + 2 * self.head_dim
        embeddings = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + embeddings + self.hidden_size

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)


def tiny_model_config(seed: int = 0) -> ModelConfig:
    """The built-in model of `hicache demo` and the tests' default: 6 layers, 4 of them
    source layers, a 128-token window, byte-level vocabulary; random weights from `seed`."""
    return ModelConfig(
        vocab_size=258,
        hidden_size=256,
        intermediate_size=512,
        num_layers=6,
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        num_source_layers=4,
        window_tokens=128,
        model_id=f"hicache-tiny-v1-seed{seed}",
    )


def model_config_to_json(config: ModelConfig) -> str:
    """`config` as a JSON object of its fields (`model_config_from_json` reads it back)."""
    return json.dumps(dataclasses.asdict(config), indent=1)


def model_config_from_json(text: str) -> ModelConfig:
    """A ModelConfig from a JSON object of its fields (`hicache engine serve --model-config`:
    a synthetic model, random weights). Raises ValueError naming what is wrong: not JSON, an
    unknown field (never ignored: it would change the model), a value out of range."""
    try:
        fields = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"not JSON ({error.msg} at line {error.lineno})") from None
    if not isinstance(fields, dict):
        raise ValueError("expected a JSON object of ModelConfig's fields")
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ValueError(f"unknown ModelConfig field(s) {', '.join(unknown)}")
    fields = dict(fields)
    if isinstance(fields.get("rope_scaling"), dict):
        fields["rope_scaling"] = RopeScaling(**fields["rope_scaling"])
    if isinstance(fields.get("windowed_layers"), list):
        fields["windowed_layers"] = tuple(fields["windowed_layers"])
    try:
        return ModelConfig(**fields)
    except TypeError as error:  # a required field missing, a bad rope_scaling field
        raise ValueError(str(error)) from None


@dataclass(frozen=True)
class EngineConfig:
    """The engine's scheduling and numerics.

    page_size:            tokens per KV page (the cache's page size).
    max_running_requests: requests decoding or prefilling at once (continuous batching).
    prefill_chunk_tokens: prompt tokens one step may process, over all requests (chunked
                          prefill); decode tokens ride along in the same step.
    batch_invariant:      compute every row in fixed-shape blocks of `block_tokens` rows, so
                          a token's result never depends on what else is in the batch
                          (bitwise-equal hits on the CPU). None: on for the CPU, off on CUDA.
    block_tokens:         rows per block in batch-invariant mode; must divide page_size.
    dtype:                None: float32 on the CPU, bfloat16 on CUDA.
    deterministic:        the deterministic path (CUDA): batch-invariant Triton kernels for
                          every matmul, norm and attention (`model/deterministic*.py`), so a
                          position's logits depend only on the tokens up to it, bit for bit:
                          never on a hit boundary, the chunking or the batch. Off by default;
                          on the CPU only under Triton's interpreter (tests): the CPU's own
                          path is `batch_invariant`. Not with batch_invariant=True.
    """

    device: str = "cpu"
    page_size: int = 64
    max_running_requests: int = 8
    prefill_chunk_tokens: int = 2048
    batch_invariant: bool | None = None
    block_tokens: int = 16
    dtype: str | None = None
    deterministic: bool = False

    def __post_init__(self) -> None:
        _require(
            self.device == "cpu" or self.device.startswith("cuda"),
            f"EngineConfig.device must be {DEVICES_HELP}, got {self.device!r}",
        )
        _positive(
            "EngineConfig",
            page_size=self.page_size,
            max_running_requests=self.max_running_requests,
            prefill_chunk_tokens=self.prefill_chunk_tokens,
            block_tokens=self.block_tokens,
        )
        _require(
            self.page_size % self.block_tokens == 0,
            f"EngineConfig.block_tokens ({self.block_tokens}) must divide page_size "
            f"({self.page_size})",
        )
        _require(
            self.dtype in (None, "float32", "bfloat16", "float16"),
            f"EngineConfig.dtype must be None, 'float32', 'bfloat16' or 'float16', "
            f"got {self.dtype!r}",
        )

        _require(
            not (self.deterministic and self.batch_invariant),
            "EngineConfig.deterministic and batch_invariant=True are two paths: pick one "
            "(deterministic runs dense batches through its own batch-invariant kernels)",
        )

    @property
    def on_cuda(self) -> bool:
        return self.device.startswith("cuda")

    @property
    def invariant(self) -> bool:
        if self.deterministic:  # dense batches: its kernels are batch-invariant themselves
            return False
        return (not self.on_cuda) if self.batch_invariant is None else self.batch_invariant

    @property
    def dtype_name(self) -> str:
        return self.dtype or ("bfloat16" if self.on_cuda else "float32")
