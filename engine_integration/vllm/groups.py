"""vLLM's KV cache groups, as the connector caches them.

vLLM's hybrid KV cache manager splits a model's attention layers into groups, each with its
own block table and spec (`kv_cache_config.kv_cache_groups`). The connector keeps one
`HiCache` per group, under a namespace of the group (`#kv<i>` after the model id when there
are several), and stores in it what that group's layers read on a hit:

    full     FullAttentionSpec        every page of the prefix (K and V of each KV head)
    mla      MLAAttentionSpec         every page of the prefix (one latent per token)
    sliding  SlidingWindowSpec(W)     only the pages of the window before a boundary

A query at position `end` in a sliding-window layer reads positions [end - W + 1, end), so a
hit of `end` tokens needs only those. The window's pages, [start, end) with `start` the page
boundary at or below end - W + 1, are stored as an entry of their own: its tokens are the
window's tokens, and its namespace carries a digest of every token before `start`, so an
entry is found only by a prefix equal to the one that stored it. A hit is served only at a
boundary where every group has what it reads (`ModelLookup` in lookup.py); the windows
exist at the boundaries where a prompt or an answer was saved, so a hit elsewhere
shortens to nothing for a model with sliding-window groups.

Any other spec (Mamba state, chunked-local attention, sliding-window MLA, cross-attention,
quantized or packed pages) is refused at construction with an error naming it.

No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import xxhash

KINDS = {"FullAttentionSpec": "full", "MLAAttentionSpec": "mla", "SlidingWindowSpec": "sliding"}


class Extent(NamedTuple):
    """What a group keeps of tokens [0, end): the entry's tokens, from token `origin`, under
    the request's extra key plus `extra_key_suffix`."""

    token_ids: list[int]
    origin: int
    extra_key: str


@dataclass(frozen=True)
class KVGroup:
    index: int
    kind: str  # full | mla | sliding
    spec: Any  # vLLM's KVCacheSpec of the group
    layer_names: tuple[str, ...]
    window_tokens: int = 0  # sliding: the tokens one query attends, itself included

    def extent(self, token_ids, extra_key: str, page_size: int, end: int) -> Extent:
        """The entry a hit of `end` tokens (a whole number of pages) needs from this group."""
        if self.kind != "sliding":
            return Extent(list(token_ids[:end]), 0, extra_key)
        start = window_start(end, self.window_tokens, page_size)
        digest = xxhash.xxh3_128_hexdigest(np.asarray(token_ids[:start], dtype="<u4").tobytes())
        suffix = f"window{self.window_tokens}-after{start}:{digest}"
        key = f"{extra_key};{suffix}" if extra_key else suffix
        return Extent(list(token_ids[start:end]), start, key)

    def first_read(self, end: int) -> int:
        """The first position a query at `end` reads in this group's layers."""
        return max(0, end - self.window_tokens + 1) if self.kind == "sliding" else 0


def window_start(end: int, window_tokens: int, page_size: int) -> int:
    """The page boundary at or below end - (W - 1)."""
    return max(0, (end - window_tokens + 1) // page_size * page_size)


def kv_groups(kv_cache_config) -> list[KVGroup]:
    """The model's KV groups, or an error naming what the connector cannot cache."""
    groups = []
    for index, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        name = type(spec).__name__
        kind = KINDS.get(name)
        if kind is None:
            problems = [f"spec {name} (supported: {', '.join(KINDS)})"]
        else:
            problems = _spec_problems(spec, kind)
        if problems:
            raise ValueError(
                f"HiCacheConnector cannot cache KV group {index} ({len(group.layer_names)} "
                f"layers): " + "; ".join(problems)
            )
        window = spec.sliding_window if kind == "sliding" else 0
        groups.append(KVGroup(index, kind, spec, tuple(group.layer_names), window))
    if not any(group.kind != "sliding" for group in groups):
        raise ValueError(
            "HiCacheConnector needs a full-attention or MLA KV group: a model of sliding-"
            "window layers only is not supported"
        )
    block_sizes = {group.spec.block_size for group in groups}
    if len(block_sizes) > 1:
        raise ValueError(
            f"HiCacheConnector: KV groups of different block sizes {sorted(block_sizes)}"
        )
    return groups


def _spec_problems(spec, kind: str) -> list[str]:
    problems = []
    if kind == "mla":
        if spec.num_kv_heads != 1:
            problems.append(f"MLA with num_kv_heads={spec.num_kv_heads}")
        for name in ("topk_buffer_width", "model_version", "alignment"):
            if getattr(spec, name, None) is not None:
                problems.append(f"MLA {name}={getattr(spec, name)!r} (DeepSeek V3.2/V4 pages)")
    elif getattr(spec, "head_size_v", spec.head_size) != spec.head_size:
        problems.append(f"head_size_v {spec.head_size_v} != head_size {spec.head_size}")
    if kind == "full" and getattr(spec, "attention_chunk_size", None):
        problems.append(f"attention_chunk_size={spec.attention_chunk_size}")
    if getattr(spec, "extra_retained_tokens", 0):
        problems.append(f"extra_retained_tokens={spec.extra_retained_tokens} (multi-token MTP)")
    for name in ("num_head_slots", "state_content_bytes", "page_size_padded"):
        if getattr(spec, name, None) is not None:
            problems.append(f"{name}={getattr(spec, name)!r} (packed or padded pages)")
    if getattr(spec, "tokens_per_state", 1) != 1:
        problems.append(f"tokens_per_state={spec.tokens_per_state!r}")
    mode = getattr(spec, "kv_quant_mode", None)
    if mode is not None and getattr(mode, "name", str(mode)) != "NONE":
        problems.append(
            f"kv_quant_mode={getattr(mode, 'name', mode)} (scaled KV: its scales live outside "
            "the blocks, and a page without them would be read at the wrong scale)"
        )
    if getattr(spec, "cache_dtype_str", None) not in (None, "auto"):
        problems.append(f"cache_dtype_str={spec.cache_dtype_str!r}")
    return problems
