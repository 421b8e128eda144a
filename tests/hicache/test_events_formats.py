"""The publisher's topic and its second encoding (SGLang 0.5.23's schema), each decoded by
the engine's own event classes."""

from __future__ import annotations

import msgspec
import pytest
import zmq

from hicache.events import (
    BlockRemoved,
    BlockStored,
    EventPublisher,
    EventsConfig,
    default_topic,
    sglang_hash,
)

KEYS = [bytes(range(i, i + 16)) for i in (0, 16, 32)]


def first_message(config: EventsConfig, events) -> tuple[bytes, bytes]:
    """(topic, payload) of the first batch a subscriber receives with `events` in it."""
    publisher = EventPublisher(config)
    context = zmq.Context.instance()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(publisher.endpoint)
    try:
        for _ in range(200):  # PUB drops what it sends before the SUB has joined: resend
            publisher.add(events)
            publisher.flush()
            if sub.poll(50):
                topic, _seq, payload = sub.recv_multipart()
                return topic, payload
        raise AssertionError("no batch reached the subscriber")
    finally:
        sub.close(linger=0)
        publisher.close()


def test_the_topic_names_the_replica_and_the_model():
    assert default_topic("Qwen/Qwen3-8B", host="pod-7") == "kv@pod-7@Qwen/Qwen3-8B"
    config = EventsConfig("tcp://127.0.0.1:0", topic=default_topic("m", host="pod-7"))
    topic, _ = first_message(config, [BlockRemoved([KEYS[0]], "CPU")])
    assert topic == b"kv@pod-7@m"


def test_the_sglang_format_decodes_with_sglangs_own_classes():
    kv_events = pytest.importorskip("sglang.srt.disaggregation.kv_events")
    events = [
        BlockStored(KEYS[1:], KEYS[0], list(range(32)), 16, None, "CPU", None),
        BlockStored(KEYS[:1], None, list(range(16)), 16, None, "STORAGE", None),
        BlockRemoved(KEYS[1:2], "GPU"),
    ]
    config = EventsConfig("tcp://127.0.0.1:0", format="sglang", topic="kv@h@m")
    _, payload = first_message(config, events)
    batch = msgspec.msgpack.Decoder(kv_events.KVEventBatch).decode(payload)
    ours = [e for e in batch.events if not isinstance(e, kv_events.AllBlocksCleared)]
    stored, stored_l3, removed = ours[:3]
    assert isinstance(stored, kv_events.BlockStored)
    assert stored.block_hashes == [sglang_hash(KEYS[1]), sglang_hash(KEYS[2])]
    assert stored.parent_block_hash == sglang_hash(KEYS[0])
    assert stored.token_ids == list(range(32)) and stored.block_size == 16
    assert stored.medium == kv_events.StorageMedium.CPU.value  # CPU_PINNED
    assert stored_l3.medium == kv_events.StorageMedium.EXTERNAL.value
    assert stored_l3.parent_block_hash is None
    assert isinstance(removed, kv_events.BlockRemoved)
    assert removed.block_hashes == [sglang_hash(KEYS[1])]
    assert removed.medium == kv_events.StorageMedium.GPU.value


def test_an_unknown_format_is_refused_by_name():
    with pytest.raises(ValueError, match="EventsConfig.format"):
        EventsConfig("tcp://127.0.0.1:0", format="dynamo")
