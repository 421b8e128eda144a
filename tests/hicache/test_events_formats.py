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
    KVEventBatch,
    TierEvents,
    default_topic,
    encode_batch,
    sglang_hash,
)
from radix.keys import Namespace
from tests.support.caches import NS, fill_pages, make_cache, tokens_for

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


class Recorder:
    """A publisher that keeps what it is given."""

    def __init__(self):
        self.events = []

    def add(self, events):
        self.events.extend(events)


def test_salted_pages_carry_their_extra_key_in_both_formats():
    vllm_events = pytest.importorskip("vllm.distributed.kv_events")
    kv_events = pytest.importorskip("sglang.srt.disaggregation.kv_events")
    cache = make_cache()
    recorder = Recorder()
    cache.set_residency_listener(TierEvents(recorder, cache.page_size))
    salted = Namespace(NS.model_id, NS.layout, extra_key="salt=tenant-1")
    tokens = tokens_for(1, 2)
    for namespace in (NS, salted):
        ids = cache.alloc_device_pages(2)
        fill_pages(cache, ids, 1)
        cache.insert(tokens, ids, namespace)
    cache.close()
    stored = [e for e in recorder.events if isinstance(e, BlockStored) and e.medium == "GPU"]
    plain, salt = stored  # L1 first, for each namespace
    assert plain.extra_keys is None and salt.extra_keys == [("salt=tenant-1",)] * 2
    assert plain.block_hashes != salt.block_hashes  # the same tokens, told apart

    batch = KVEventBatch(ts=0.0, events=[salt])
    decoded = msgspec.msgpack.Decoder(vllm_events.KVEventBatch).decode(encode_batch(batch))
    assert list(decoded.events[0].extra_keys) == [("salt=tenant-1",)] * 2
    payload = encode_batch(batch, "sglang")
    decoded = msgspec.msgpack.Decoder(kv_events.KVEventBatch).decode(payload)
    assert decoded.events[0].cache_salt == "salt=tenant-1"


def test_the_daemon_and_the_replica_take_a_topic_and_refuse_an_unknown_format():
    from engine_integration.serve.replica_config import ReplicaConfig
    from hicache.server.config import ServerConfig

    daemon = ServerConfig(events_endpoint="tcp://127.0.0.1:5557", events_topic="kv@h@m")
    assert daemon.events_topic == "kv@h@m"
    with pytest.raises(ValueError, match="--events-format"):
        ServerConfig(events_endpoint="tcp://127.0.0.1:5557", events_format="dynamo")
    with pytest.raises(ValueError, match="--events-format"):
        ReplicaConfig(events_endpoint="tcp://127.0.0.1:5557", events_format="dynamo")
