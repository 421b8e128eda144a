"""Page keys: the stable, 128-bit names of KV pages.

A page key names a page *and its whole prefix*: ``key[i] = xxh3_128(key[i-1] || page_i)``,
where ``page_i`` is the page's tokens as little-endian uint32 and ``key[-1]`` is the
namespace digest. Equal keys therefore mean an equal prefix in the same namespace, and a
different model, KV layout, tenant or extra key (a LoRA id, a cache salt) can never name
another namespace's pages. Nothing here uses Python's ``hash()``: keys are identical across
processes and machines.

This module owns the token encoding too: the radix tree stores and compares the same bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import xxhash

KEY_BYTES = 16
TOKEN_BYTES = 4  # tokens are stored as little-endian uint32
_TOKEN_DTYPE = np.dtype("<u4")
_MAX_TOKEN = 2**32 - 1
_NAMESPACE_TAG = b"hicache-namespace-v1"


@dataclass(frozen=True)
class Namespace:
    """What must be equal for two requests to share KV pages.

    `layout` is the KV layout descriptor string (dtype, layers, page size, per-token
    shape); the index treats it as opaque text.
    """

    model_id: str
    layout: str
    tenant: str = ""
    extra_key: str = ""
    digest: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("model_id", "layout", "tenant", "extra_key"):
            if not isinstance(getattr(self, name), str):
                raise TypeError(f"Namespace.{name} must be a str, got {getattr(self, name)!r}")
        if not self.model_id:
            raise ValueError("Namespace.model_id must not be empty")
        if not self.layout:
            raise ValueError("Namespace.layout must not be empty")
        object.__setattr__(self, "digest", namespace_digest(self))


def namespace_digest(namespace: Namespace) -> bytes:
    """The 16-byte seed of a namespace's key chain (length-prefixed, so fields can't blur)."""
    hasher = xxhash.xxh3_128()
    hasher.update(_NAMESPACE_TAG)
    for value in (namespace.model_id, namespace.layout, namespace.tenant, namespace.extra_key):
        raw = value.encode("utf-8")
        hasher.update(len(raw).to_bytes(4, "little"))
        hasher.update(raw)
    return hasher.digest()


def encode_tokens(tokens: Sequence[int] | np.ndarray | bytes) -> bytes:
    """Token ids as the index stores them: little-endian uint32 bytes.

    Accepts a list/tuple of ints, an integer numpy array, or bytes already in this
    encoding (returned as is). Raises ValueError for ids outside [0, 2**32).
    """
    if isinstance(tokens, bytes):
        if len(tokens) % TOKEN_BYTES:
            raise ValueError(
                f"encoded tokens must be a multiple of {TOKEN_BYTES} bytes, got {len(tokens)}"
            )
        return tokens
    array = np.asarray(tokens)
    if array.ndim != 1:
        raise ValueError(f"tokens must be one-dimensional, got shape {array.shape}")
    if array.size == 0:
        return b""
    if array.dtype != _TOKEN_DTYPE:
        if array.dtype.kind not in "iu":
            raise ValueError(f"tokens must be integers, got dtype {array.dtype}")
        low, high = int(array.min()), int(array.max())
        if low < 0 or high > _MAX_TOKEN:
            raise ValueError(f"token ids must be in [0, 2**32), got min {low} and max {high}")
        array = array.astype(_TOKEN_DTYPE)
    return array.tobytes()


def chain_keys(previous_key: bytes, data: bytes, page_size: int, num_pages: int) -> list[bytes]:
    """Keys of `num_pages` pages of encoded `data`, continuing the chain after `previous_key`."""
    page_bytes = page_size * TOKEN_BYTES
    keys = []
    key = previous_key
    hasher = xxhash.xxh3_128()
    for page in range(num_pages):
        hasher.reset()
        hasher.update(key)
        hasher.update(data[page * page_bytes : (page + 1) * page_bytes])
        key = hasher.digest()
        keys.append(key)
    return keys


def page_keys(
    tokens: Sequence[int] | np.ndarray | bytes, namespace: Namespace, page_size: int
) -> list[bytes]:
    """The keys of a request's full pages (a trailing partial page has no key)."""
    if page_size <= 0:
        raise ValueError(f"page_size must be positive, got {page_size}")
    data = encode_tokens(tokens)
    num_pages = len(data) // (page_size * TOKEN_BYTES)
    return chain_keys(namespace.digest, data, page_size, num_pages)
