"""KV events: every page the index gains or loses in a tier is an event, read by vLLM's own
event classes (`vllm.distributed.kv_events`), over a real ZMQ PUB socket and its replay socket.

The check is a mirror: a consumer applies the decoded events to a set of page keys per
medium, and after each step that set equals what the index holds in that tier, page by page.
"""

from __future__ import annotations

import time

import msgspec
import pytest
import zmq

pytest.importorskip("vllm", reason="vllm==0.33.0 (tests/engine_integration/requirements-vllm.txt)")

from vllm.distributed import kv_events as vllm_events  # noqa: E402

from hicache.events import (  # noqa: E402
    END_OF_REPLAY,
    MEDIUM_OF_TIER,
    EventPublisher,
    EventsConfig,
    EventSubscriber,
    TierEvents,
)
from radix.node import Tier  # noqa: E402
from tests.support.caches import NS, make_cache, put, tokens_for  # noqa: E402

VLLM_DECODER = msgspec.msgpack.Decoder(vllm_events.KVEventBatch)


class VllmMirror:
    """A consumer built on vLLM's classes: a raw SUB socket, vLLM's decoder, key sets."""

    def __init__(self, endpoint: str) -> None:
        self.socket = zmq.Context.instance().socket(zmq.SUB)
        self.socket.setsockopt(zmq.SUBSCRIBE, b"")
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(endpoint)
        self.keys: dict[str, set[bytes]] = {m: set() for m in MEDIUM_OF_TIER.values()}
        self.seqs: list[int] = []
        self.types: set[type] = set()
        self.stored: list = []  # every BlockStored, in order

    def apply(self, batch) -> None:
        for event in batch.events:
            self.types.add(type(event))
            if isinstance(event, vllm_events.BlockStored):
                assert event.block_size == 4 and len(event.token_ids) == 4 * len(event.block_hashes)
                self.stored.append(event)
                self.keys[event.medium].update(event.block_hashes)
            elif isinstance(event, vllm_events.BlockRemoved):
                assert set(event.block_hashes) <= self.keys[event.medium], "removed unknown"
                self.keys[event.medium].difference_update(event.block_hashes)
            else:
                assert isinstance(event, vllm_events.AllBlocksCleared)
                for keys in self.keys.values():
                    keys.clear()

    def drain(self, publisher: EventPublisher) -> None:
        publisher.flush()
        deadline = time.monotonic() + 5
        while (not self.seqs or self.seqs[-1] < publisher.next_seq - 1) and (
            time.monotonic() < deadline
        ):
            if self.socket.poll(100):
                _topic, seq, payload = self.socket.recv_multipart()
                self.seqs.append(int.from_bytes(seq, "big"))
                self.apply(VLLM_DECODER.decode(payload))
        assert self.seqs == list(range(publisher.next_seq)), "a batch was lost or reordered"


def index_keys(cache) -> dict[str, set[bytes]]:
    tree = cache._tree
    held: dict[str, set[bytes]] = {m: set() for m in MEDIUM_OF_TIER.values()}
    for node in tree.nodes():
        for tier, present in (
            (Tier.L1, node.device_page_ids is not None),
            (Tier.L2, node.host_page_ids is not None),
            (Tier.L3, node.in_l3),
        ):
            if present:
                held[MEDIUM_OF_TIER[tier]].update(tree.keys(node))
    return held


@pytest.fixture
def published_cache():
    made = []

    def make(**kwargs):
        cache = make_cache(**kwargs)
        publisher = EventPublisher(
            EventsConfig("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", batch_interval_s=0.005)
        )
        cache.set_residency_listener(TierEvents(publisher, cache.page_size))
        made.append((cache, publisher))
        return cache, publisher

    yield make
    for cache, publisher in made:
        cache.close()
        publisher.close()


def wait_joined(mirror: VllmMirror, publisher: EventPublisher, count: int = 1) -> None:
    """A SUB socket receives only what is sent after it has joined: wait until the
    publisher has its subscription (no fixed sleep: a loaded machine may take longer)."""
    deadline = time.monotonic() + 60
    while publisher.num_subscriptions < count:
        assert time.monotonic() < deadline, "the subscriber never joined"
        time.sleep(0.005)


def test_every_page_gained_or_lost_in_any_tier_is_an_event_vllm_decodes(published_cache):
    cache, publisher = published_cache(
        l1_pages=6, l2_pages=10, l3_url="memory://?capacity=1MiB", write_policy="write_through"
    )
    mirror = VllmMirror(publisher.endpoint)
    wait_joined(mirror, publisher)
    steps = [
        lambda: put(cache, tokens_for(1, 3), seed=1),  # L1 (+ L2 backups, then L3)
        lambda: put(cache, tokens_for(2, 3), seed=2),
        lambda: cache.flush(),
        lambda: cache.evict("l1", 6),  # L1 lost; L2 keeps them
        lambda: cache.release(cache.match(tokens_for(1, 3), NS)),  # L2 -> L1 again
        lambda: put(cache, tokens_for(3, 4), seed=3),  # L1 full: evicts
        lambda: cache.flush(),
        lambda: cache.evict("l2", 10),  # L2 lost; L3 keeps them
        lambda: cache.release(cache.match(tokens_for(2, 3), NS)),  # L3 -> L2 -> L1
        lambda: cache.detach_l3(),  # every L3 mark leaves the index
    ]
    for step in steps:
        step()
        cache.flush()
        cache.poll()
        mirror.drain(publisher)
        assert mirror.keys == index_keys(cache)
    assert {vllm_events.BlockStored, vllm_events.BlockRemoved, vllm_events.AllBlocksCleared} == (
        mirror.types
    )
    stored_somewhere = [medium for medium, keys in mirror.keys.items() if keys]
    assert "GPU" in stored_somewhere and "CPU" in stored_somewhere


def test_events_are_batched_not_one_message_per_page(published_cache):
    cache, publisher = published_cache(l1_pages=64, l2_pages=0)
    mirror = VllmMirror(publisher.endpoint)
    wait_joined(mirror, publisher)
    for prefix in range(20):
        put(cache, tokens_for(prefix, 3), seed=prefix)  # 60 pages, 20 runs
    mirror.drain(publisher)
    assert len(mirror.keys["GPU"]) == 60
    assert publisher.num_events == 21  # AllBlocksCleared, then one event per run
    assert len(mirror.seqs) < 10  # queued within one interval: a few batches, not 60


def test_a_reconnecting_subscriber_replays_what_it_missed(published_cache):
    cache, publisher = published_cache(l1_pages=32, l2_pages=0)
    subscriber = EventSubscriber(publisher.endpoint, publisher.replay_endpoint)
    try:
        wait_joined(None, publisher)
        put(cache, tokens_for(1, 2), seed=1)
        publisher.flush()
        seen = _receive_until(subscriber, publisher.next_seq - 1)
        stored = {key for _, batch in seen for e in batch.events for key in _hashes(e)}
        subscriber.socket.close(linger=0)  # the subscriber goes away ...
        put(cache, tokens_for(2, 2), seed=2)
        put(cache, tokens_for(3, 2), seed=3)
        cache.evict("l1", 2)
        publisher.flush()
        # ... and comes back: a new SUB socket, and the replay of everything after its last
        subscriber.socket = zmq.Context.instance().socket(zmq.SUB)
        subscriber.socket.setsockopt(zmq.SUBSCRIBE, b"")
        subscriber.socket.connect(publisher.endpoint)
        missed = subscriber.replay()
        assert [seq for seq, _ in missed] == list(range(seen[-1][0] + 1, publisher.next_seq))
        assert subscriber.lost == 0
        for _, batch in missed:
            for event in batch.events:
                if event.__class__.__name__ == "BlockStored":
                    stored.update(event.block_hashes)
                else:
                    stored.difference_update(event.block_hashes)
        assert stored == index_keys(cache)["GPU"]
    finally:
        subscriber.close()


def test_the_replay_socket_speaks_vllms_protocol(published_cache):
    """A DEALER asks from a sequence number; the batches come back as the PUB socket sent
    them (vLLM's decoder reads them), then the end marker."""
    cache, publisher = published_cache(l1_pages=32, l2_pages=0)
    put(cache, tokens_for(1, 2), seed=1)
    put(cache, tokens_for(2, 2), seed=2)
    publisher.flush()
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(publisher.replay_endpoint)
    try:
        dealer.send_multipart((b"", (0).to_bytes(8, "big")))
        seqs, events = [], []
        while True:
            assert dealer.poll(5000)
            _, _topic, seq, payload = dealer.recv_multipart()
            if seq == END_OF_REPLAY:
                break
            seqs.append(int.from_bytes(seq, "big"))
            events.extend(VLLM_DECODER.decode(payload).events)
        assert seqs == list(range(publisher.next_seq))
        assert isinstance(events[0], vllm_events.AllBlocksCleared)
        stored = [e for e in events if isinstance(e, vllm_events.BlockStored)]
        assert sum(len(e.block_hashes) for e in stored) == 4
        assert all(e.medium == "GPU" for e in stored)
        # a run's parent_block_hash chains to the page before it (None at the top)
        assert all(e.parent_block_hash is None for e in stored)
    finally:
        dealer.close(linger=0)


def test_a_split_run_chains_parent_hashes(published_cache):
    cache, publisher = published_cache(l1_pages=32, l2_pages=0)
    mirror = VllmMirror(publisher.endpoint)
    wait_joined(mirror, publisher)
    base = tokens_for(1, 2, tail=0)
    put(cache, base + [7] * 4 + [1], seed=1)  # 3 pages
    cache.evict("l1", 1)  # the last page leaves L1: a removal of its key alone
    put(cache, base + [9] * 4 + [1], seed=2)  # a sibling of it, below page 2
    mirror.drain(publisher)
    assert mirror.keys == index_keys(cache)
    base_keys = cache._tree.keys(cache._tree.match_prefix(base, NS, touch=False).last_node)
    first, sibling = mirror.stored
    assert first.parent_block_hash is None and first.block_hashes[:2] == base_keys
    assert first.token_ids[:8] == base
    assert sibling.parent_block_hash == base_keys[-1]  # chained below page 2 of the split run
    assert sibling.token_ids == [9] * 4 and len(sibling.block_hashes) == 1


def _hashes(event) -> list[bytes]:
    return getattr(event, "block_hashes", [])


def _receive_until(subscriber: EventSubscriber, last_seq: int):
    got = []
    deadline = time.monotonic() + 5
    while (not got or got[-1][0] < last_seq) and time.monotonic() < deadline:
        got.extend(subscriber.receive(0.1))
    assert got and got[-1][0] == last_seq
    return got
