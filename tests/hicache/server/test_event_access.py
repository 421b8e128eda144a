"""Who receives the daemon's KV events: a tenant its own namespaces' events, nobody else
anything; events name only pages that changed; the replay buffer is bounded in bytes."""

from __future__ import annotations

import asyncio
import os
import time

import zmq

from hicache.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventPublisher,
    EventsConfig,
    EventSubscriber,
)
from storage_backends import open_backend
from tests.support.servers import free_port

LAYOUT = "mha;layers=1;page=16;kv_heads=1;head_dim=8;dtype=float32"
TOKENS = {"a": "tenant-a-token-0123456789", "b": "tenant-b-token-0123456789"}


def _keys(batches) -> tuple[set, set]:
    stored, removed = set(), set()
    for _seq, batch in batches:
        for event in batch.events:
            if isinstance(event, BlockStored):
                stored.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                removed.update(event.block_hashes)
    return stored, removed


def _drain(subscriber: EventSubscriber, seconds: float) -> list:
    got, deadline = [], time.monotonic() + seconds
    while time.monotonic() < deadline:
        got += subscriber.receive(0.05)
    return got


def test_only_a_tenants_own_subscriber_receives_its_events(start_daemon, tmp_path):
    tenants = tmp_path / "tenants"
    tenants.write_text(f"{TOKENS['a']} ns-a\n{TOKENS['b']} ns-b\n")
    tenants.chmod(0o600)
    token_a = tmp_path / "token-a"
    token_a.write_text(TOKENS["a"])
    token_a.chmod(0o600)
    pub, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    daemon = start_daemon(
        "--capacity", "16MiB", "--tenants-file", str(tenants),
        "--events-endpoint", pub, "--events-replay-endpoint", replay,
    )  # fmt: skip
    subscribers = {
        "a": EventSubscriber(pub, replay, secret=TOKENS["a"]),
        "b": EventSubscriber(pub, replay, secret=TOKENS["b"]),
        "anonymous": EventSubscriber(pub, replay),
        "wrong": EventSubscriber(pub, replay, secret="not-a-token-0123456789"),
    }
    keys = [os.urandom(16) for _ in range(4)]
    made_up = [os.urandom(16) for _ in range(200)]

    async def body():
        url = f"grpc://{daemon.address}?namespace=ns-a&token_file={token_a}"
        async with open_backend(url, layout=LAYOUT) as store:
            assert await store.batch_put(keys, [os.urandom(2048) for _ in keys]) == [True] * 4
            assert await store.delete(keys[:1] + made_up) == 1

    try:
        asyncio.run(body())
        got = {name: _drain(s, 1.0) + s.replay(2.0) for name, s in subscribers.items()}
        stored, removed = _keys(got["a"])
        assert stored == set(keys)
        assert removed == set(keys[:1]), "a delete names only the pages it removed"
        for name in ("b", "anonymous", "wrong"):
            events = [e for _, batch in got[name] for e in batch.events]
            assert all(isinstance(e, AllBlocksCleared) for e in events), (name, events)
        assert not got["anonymous"] and not got["wrong"]
    finally:
        for subscriber in subscribers.values():
            subscriber.close()
    assert daemon.alive()


def test_the_replay_buffer_is_bounded_in_bytes():
    config = EventsConfig(
        f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}",
        buffer_bytes=256 << 10,
    )  # fmt: skip
    publisher = EventPublisher(config)
    try:
        for _ in range(40):  # 40 batches of ~20 KiB each: 800 KiB asked to be kept
            publisher.add([BlockRemoved([os.urandom(16) for _ in range(1024)], "STORAGE")])
            publisher.flush()
        assert 0 < publisher.buffered_bytes() <= 256 << 10
        subscriber = EventSubscriber(config.endpoint, config.replay_endpoint)
        subscriber.last_seq = 30
        replayed = subscriber.replay(5.0)
        assert replayed and replayed[-1][0] == publisher.next_seq - 1
        subscriber.close()
    finally:
        publisher.close()


def test_a_subscriber_of_a_publisher_without_credentials_needs_none():
    config = EventsConfig(f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}")
    publisher = EventPublisher(config)
    subscriber = EventSubscriber(config.endpoint, config.replay_endpoint)
    try:
        publisher.add([BlockRemoved([b"k" * 16], "STORAGE")])
        publisher.flush()
        got = _drain(subscriber, 0.3) + subscriber.replay(2.0)
        assert _keys(got)[1] == {b"k" * 16}
    finally:
        subscriber.close()
        publisher.close()
    assert zmq.Context.instance() is not None
