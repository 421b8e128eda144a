"""KV layout: how one token's KV for one layer is shaped, and the sizes that follow from it.

`KVLayout` is the single description of the KV that the tiers hold. Pools derive their tensor
shapes from it, kernels their chunk size, and page keys and the L3 object header carry its
`descriptor()` string, so pages written under one layout can never be read under another.

This module does not import torch at module level: the torch-free parts of hicache (config,
simulator, daemon) import it. Only `KVLayout.torch_dtype` imports torch, when called.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

KINDS = ("mha", "mla")

# dtype name (as spelt in torch) -> bytes per value. A name outside this table is rejected.
DTYPE_BYTES = {
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}

# Descriptor keys per kind, in the order they are written.
_DESCRIPTOR_KEYS = {
    "mha": ("layers", "page", "kv_heads", "head_dim", "dtype"),
    "mla": ("layers", "page", "kv_lora_rank", "rope_dim", "dtype"),
}
_KEY_TO_FIELD = {
    "layers": "num_layers",
    "page": "page_size",
    "kv_heads": "num_kv_heads",
    "head_dim": "head_dim",
    "kv_lora_rank": "kv_lora_rank",
    "rope_dim": "rope_dim",
    "dtype": "dtype",
}


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"KVLayout.{name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"KVLayout.{name} must be >= {minimum}, got {value}")


@dataclass(frozen=True)
class KVLayout:
    """The KV of one model, per token and layer.

    kind:          "mha" (MHA/GQA/MQA: K and V, each `num_kv_heads x head_dim`) or
                   "mla" (one latent vector of `kv_lora_rank + rope_dim` values).
    num_layers:    layers whose KV the tiers hold (>= 1).
    page_size:     tokens per page (>= 1).
    dtype:         torch dtype name, one of `DTYPE_BYTES`.
    num_kv_heads, head_dim:   MHA only (>= 1 each); 0 for MLA.
    kv_lora_rank, rope_dim:   MLA only (kv_lora_rank >= 1, rope_dim >= 0); 0 for MHA.
    """

    kind: str
    num_layers: int
    page_size: int
    dtype: str
    num_kv_heads: int = 0
    head_dim: int = 0
    kv_lora_rank: int = 0
    rope_dim: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"KVLayout.kind must be one of {KINDS}, got {self.kind!r}")
        _check_int("num_layers", self.num_layers, 1)
        _check_int("page_size", self.page_size, 1)
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(
                f"KVLayout.dtype must be one of {sorted(DTYPE_BYTES)}, got {self.dtype!r}"
            )
        if self.kind == "mha":
            _check_int("num_kv_heads", self.num_kv_heads, 1)
            _check_int("head_dim", self.head_dim, 1)
            own, foreign = ("num_kv_heads", "head_dim"), ("kv_lora_rank", "rope_dim")
        else:
            _check_int("kv_lora_rank", self.kv_lora_rank, 1)
            _check_int("rope_dim", self.rope_dim, 0)
            own, foreign = ("kv_lora_rank", "rope_dim"), ("num_kv_heads", "head_dim")
        other = "mla" if self.kind == "mha" else "mha"
        for name in foreign:
            if getattr(self, name) != 0:
                raise ValueError(
                    f"KVLayout.{name} belongs to kind={other!r}; it must be 0 for "
                    f"kind={self.kind!r}, which uses {' and '.join(own)}"
                )

    # -- shapes and sizes ------------------------------------------------------------------

    @property
    def token_shape(self) -> tuple[int, ...]:
        """Shape of one token's KV in one layer: (2, H, D) for MHA (K, V); (1, R + r) for MLA."""
        if self.kind == "mha":
            return (2, self.num_kv_heads, self.head_dim)
        return (1, self.kv_lora_rank + self.rope_dim)

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def values_per_token_per_layer(self) -> int:
        return math.prod(self.token_shape)

    @property
    def bytes_per_token_per_layer(self) -> int:
        return self.values_per_token_per_layer * self.dtype_bytes

    @property
    def bytes_per_token(self) -> int:
        """All layers of one token."""
        return self.bytes_per_token_per_layer * self.num_layers

    @property
    def bytes_per_page_per_layer(self) -> int:
        """One (page, layer) chunk: the unit the copy kernels move."""
        return self.bytes_per_token_per_layer * self.page_size

    @property
    def bytes_per_page(self) -> int:
        """One page, all layers: one L2 page, one L3 object payload."""
        return self.bytes_per_page_per_layer * self.num_layers

    @property
    def torch_dtype(self):  # -> torch.dtype; torch is imported here, not at module level
        import torch

        return getattr(torch, self.dtype)

    # -- descriptor ------------------------------------------------------------------------

    def descriptor(self) -> str:
        """Stable string form, e.g. "mha;layers=32;page=64;kv_heads=8;head_dim=128;dtype=bfloat16".

        Two layouts are equal exactly when their descriptors are equal; the string is part of
        page keys and of the L3 object header, so its format never changes silently.
        """
        parts = [self.kind]
        for key in _DESCRIPTOR_KEYS[self.kind]:
            parts.append(f"{key}={getattr(self, _KEY_TO_FIELD[key])}")
        return ";".join(parts)

    @classmethod
    def from_descriptor(cls, descriptor: str) -> KVLayout:
        """Parse `descriptor()` output back; anything else raises ValueError naming the problem."""
        if not isinstance(descriptor, str):
            raise ValueError(f"layout descriptor must be a str, got {type(descriptor).__name__}")
        kind, *pairs = descriptor.split(";")
        if kind not in _DESCRIPTOR_KEYS:
            raise ValueError(f"layout descriptor {descriptor!r}: unknown kind {kind!r}")
        expected = _DESCRIPTOR_KEYS[kind]
        keys = [pair.partition("=")[0] for pair in pairs]
        if keys != list(expected) or any("=" not in pair for pair in pairs):
            raise ValueError(
                f"layout descriptor {descriptor!r}: expected keys {';'.join(expected)} in order"
            )
        values: dict[str, Any] = {"kind": kind}
        for pair in pairs:
            key, _, raw = pair.partition("=")
            field = _KEY_TO_FIELD[key]
            if field == "dtype":
                values[field] = raw
            elif raw.isdigit() and raw == str(int(raw)):
                values[field] = int(raw)
            else:
                raise ValueError(f"layout descriptor {descriptor!r}: {key} must be an integer")
        return cls(**values)
