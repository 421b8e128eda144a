"""KV events: what a cache stores and drops, per tier, in vLLM's wire format.

Routers that read vLLM's KV events (llm-d's KV-cache manager, Dynamo's router, SGLang's
gateway) read hicache the same way:

- a message is three ZMQ frames on a PUB socket: `topic`, an 8-byte big-endian sequence
  number, and a msgpack `KVEventBatch` (`[ts, [event, ...]]`, an array);
- an event is a msgpack map tagged by `"type"`: `BlockStored` (page keys as `block_hashes`,
  the key of the page before them as `parent_block_hash`, their `token_ids`, `block_size` =
  page size, `medium`), `BlockRemoved` (`block_hashes`, `medium`) or `AllBlocksCleared`;
- `medium` names the tier: "GPU" for L1, "CPU" for L2, "STORAGE" for L3. A page in several
  tiers is stored once per tier and removed per tier;
- a subscriber that missed messages asks the replay socket (ROUTER) for every batch from a
  sequence number on (`[b"", seq]` from a DEALER); the publisher answers with the batches it
  still keeps, as the PUB socket sent them, then an end marker of sequence -1.

`TierEvents` is the index's listener (`radix.residency.ResidencyListener`): every run that
gains or loses a tier becomes one event, queued; the publisher sends what is queued as one
batch every `batch_interval_s` (or sooner, at `max_batch_events`), so a busy cache does not
publish per page. The first batch of a publisher begins with `AllBlocksCleared`: whatever a
subscriber knew of an earlier process at that address is gone.

This package knows sockets and encodings; it does not know the controller (the controller is
given a listener) or the daemon (which publishes its own L3 events through `EventPublisher`).

    wire.py        the wire format: vLLM's schema, the media, SGLang's schema and the encoding
    publisher.py   EventsConfig, EventPublisher, and TierEvents (the index's listener)
    subscriber.py  EventSubscriber: a publisher's batches in order, gaps filled by replay
"""

from hicache.events.publisher import EventPublisher, EventsConfig, TierEvents
from hicache.events.subscriber import EventSubscriber
from hicache.events.wire import (
    END_OF_REPLAY,
    EVENT_FORMATS,
    MEDIUM_OF_TIER,
    MEDIUM_STORAGE,
    TIER_OF_MEDIUM,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_batch,
    default_topic,
    encode_batch,
    extra_keys_of,
    sglang_hash,
)

__all__ = [
    "EVENT_FORMATS",
    "default_topic",
    "encode_batch",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EventPublisher",
    "EventSubscriber",
    "EventsConfig",
    "KVEventBatch",
    "TierEvents",
    "decode_batch",
    # also imported by other code from here (the wire format's, in wire.py)
    "END_OF_REPLAY",
    "MEDIUM_OF_TIER",
    "MEDIUM_STORAGE",
    "TIER_OF_MEDIUM",
    "extra_keys_of",
    "sglang_hash",
]
