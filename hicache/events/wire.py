"""The wire format of KV events: vLLM's schema (msgspec structs), the media that name the
tiers, and SGLang 0.5.23's schema, which `encode_batch` converts to. publisher.py encodes
with it, subscriber.py decodes; this module opens no socket.
"""

from __future__ import annotations

import socket

import msgspec

from radix.node import Tier

MEDIUM_GPU, MEDIUM_CPU, MEDIUM_STORAGE = "GPU", "CPU", "STORAGE"
MEDIUM_OF_TIER = {Tier.L1: MEDIUM_GPU, Tier.L2: MEDIUM_CPU, Tier.L3: MEDIUM_STORAGE}
TIER_OF_MEDIUM = {medium: tier for tier, medium in MEDIUM_OF_TIER.items()}
END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)


# ---------------------------------------------------------------------------- the wire format


class BlockStored(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    # vLLM's: per block, what else its hash covers. Here the page's namespace extra key
    # (a request's cache salt or LoRA adapter), so a router tells salted pages apart.
    extra_keys: list[tuple | None] | None = None


class BlockRemoved(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    block_hashes: list[bytes]
    medium: str | None


class AllBlocksCleared(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None


_encode = msgspec.msgpack.Encoder().encode
_decoder = msgspec.msgpack.Decoder(KVEventBatch)


def decode_batch(payload: bytes) -> KVEventBatch:
    """A batch off the wire; raises msgspec.DecodeError for anything else."""
    return _decoder.decode(payload)


# ---------------------------------------------------------------------------- formats

EVENT_FORMATS = ("vllm", "sglang")


def default_topic(model: str, host: str | None = None) -> str:
    """llm-d's topic for a replica: `kv@<host>@<model>` (each replica its own)."""
    return f"kv@{host or socket.gethostname()}@{model}"


# SGLang 0.5.23's schema (sglang/srt/disaggregation/kv_events.py): the same tagged maps in
# an array-like batch, but block hashes are int64 and the media are its own names.
SGLANG_MEDIUM = {MEDIUM_GPU: "GPU", MEDIUM_CPU: "CPU_PINNED", MEDIUM_STORAGE: "EXTERNAL"}


class SglangBlockStored(msgspec.Struct, tag="BlockStored", omit_defaults=True, gc=False):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None = None
    cache_salt: str | None = None
    session_id: str | None = None
    lora_name: str | None = None


class SglangBlockRemoved(msgspec.Struct, tag="BlockRemoved", omit_defaults=True, gc=False):
    block_hashes: list[int]
    medium: str | None = None


class SglangAllBlocksCleared(msgspec.Struct, tag="AllBlocksCleared", omit_defaults=True, gc=False):
    pass


class SglangEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[SglangBlockStored | SglangBlockRemoved | SglangAllBlocksCleared]
    attn_dp_rank: int | None = None


def extra_keys_of(namespace, num_pages: int) -> list[tuple | None] | None:
    """vLLM's `extra_keys` for `num_pages` pages of `namespace`: its extra key (a cache
    salt, a LoRA adapter) for each, or None for pages without one."""
    extra_key = getattr(namespace, "extra_key", "")
    return [(extra_key,)] * num_pages if extra_key else None


def sglang_hash(key: bytes) -> int:
    """A page key as SGLang's int64 block hash: its first 8 bytes, big-endian, signed."""
    return int.from_bytes(key[:8], "big", signed=True)


def _to_sglang(event: KVEvent):
    if isinstance(event, BlockStored):
        parent = event.parent_block_hash
        return SglangBlockStored(
            [sglang_hash(key) for key in event.block_hashes],
            sglang_hash(parent) if parent is not None else None,
            event.token_ids,
            event.block_size,
            event.lora_id,
            SGLANG_MEDIUM.get(event.medium, event.medium),
            cache_salt=event.extra_keys[0][0] if event.extra_keys else None,
            lora_name=event.lora_name,
        )
    if isinstance(event, BlockRemoved):
        return SglangBlockRemoved(
            [sglang_hash(key) for key in event.block_hashes],
            SGLANG_MEDIUM.get(event.medium, event.medium),
        )
    return SglangAllBlocksCleared()


def encode_batch(batch: KVEventBatch, format: str = "vllm") -> bytes:
    """A batch in the wire format `format` names (`EVENT_FORMATS`)."""
    if format == "sglang":
        events = [_to_sglang(event) for event in batch.events]
        return _encode(SglangEventBatch(batch.ts, events, batch.data_parallel_rank))
    return _encode(batch)
