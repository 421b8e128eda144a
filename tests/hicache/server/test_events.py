"""The daemon's own L3 events: what its namespaces store and drop, read by vLLM's classes."""

from __future__ import annotations

import asyncio
import os
import time

import msgspec
import pytest
import zmq

pytest.importorskip("vllm", reason="vllm==0.33.0 (tests/engine_integration/requirements-vllm.txt)")

from vllm.distributed import kv_events as vllm_events  # noqa: E402

from storage_backends import open_backend  # noqa: E402
from tests.support.servers import free_port  # noqa: E402

LAYOUT = "mha;layers=1;page=16;kv_heads=1;head_dim=8;dtype=float32"
DECODER = msgspec.msgpack.Decoder(vllm_events.KVEventBatch)


class Receiver:
    """The daemon's batches, every one of them in order, decoded by vLLM's classes: from the
    SUB socket, and whatever it missed (it joins a moment after connecting, and a busy
    machine makes that moment longer) from the replay socket, so no test waits for a join."""

    def __init__(self, endpoint: str, replay_endpoint: str) -> None:
        self.replay_endpoint = replay_endpoint
        self.socket = zmq.Context.instance().socket(zmq.SUB)
        self.socket.setsockopt(zmq.SUBSCRIBE, b"")
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(endpoint)
        self.next_seq = 0

    def _take(self, seq_bytes: bytes, payload: bytes, events: list) -> None:
        seq = int.from_bytes(seq_bytes, "big")
        if seq == self.next_seq:
            events.extend(DECODER.decode(payload).events)
            self.next_seq += 1

    def _replay(self, events: list) -> None:
        dealer = zmq.Context.instance().socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.replay_endpoint)
        try:
            dealer.send_multipart((b"", self.next_seq.to_bytes(8, "big")))
            while dealer.poll(10_000):
                _, _topic, seq_bytes, payload = dealer.recv_multipart()
                if seq_bytes == (-1).to_bytes(8, "big", signed=True):
                    return
                self._take(seq_bytes, payload, events)
        finally:
            dealer.close(linger=0)

    def until(self, done, timeout_s: float = 30.0) -> list:
        events: list = []
        deadline = time.monotonic() + timeout_s
        while not done(events):
            assert time.monotonic() < deadline, f"no such events; got {events}"
            if self.socket.poll(100):
                _topic, seq_bytes, payload = self.socket.recv_multipart()
                if int.from_bytes(seq_bytes, "big") > self.next_seq:
                    self._replay(events)  # the batches before this one first
                self._take(seq_bytes, payload, events)
            else:
                self._replay(events)
        return events

    def close(self) -> None:
        self.socket.close(linger=0)


def test_the_daemon_publishes_what_l3_stores_and_drops(start_daemon):
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    replay = f"tcp://127.0.0.1:{free_port()}"
    daemon = start_daemon(
        "--capacity", "64KiB", "--events-endpoint", endpoint, "--events-replay-endpoint", replay,
    )  # fmt: skip
    receiver = Receiver(endpoint, replay)
    keys = [os.urandom(16) for _ in range(8)]
    more = [os.urandom(16) for _ in range(40)]  # 48 pages of 2 KiB: past 64 KiB, evicting

    async def body():
        async with open_backend(f"grpc://{daemon.address}", layout=LAYOUT) as store:
            assert await store.batch_put(keys, [os.urandom(2048) for _ in keys]) == [True] * 8
            stored = receiver.until(
                lambda got: any(isinstance(e, vllm_events.BlockStored) for e in got)
            )
            event = next(e for e in stored if isinstance(e, vllm_events.BlockStored))
            assert event.medium == "STORAGE" and event.block_size == 16
            assert set(event.block_hashes) == set(keys)
            assert await store.delete(keys[:2]) == 2
            removed = receiver.until(
                lambda got: any(isinstance(e, vllm_events.BlockRemoved) for e in got)
            )
            gone = {
                k
                for e in removed
                if isinstance(e, vllm_events.BlockRemoved)
                for k in e.block_hashes
            }
            assert gone == set(keys[:2])
            await store.batch_put(more, [os.urandom(2048) for _ in more])
            # no spill: the evicted pages leave L3, and the daemon says which
            evicted: set[bytes] = set()

            def all_evicted(got) -> bool:
                evicted.update(
                    k
                    for e in got
                    if isinstance(e, vllm_events.BlockRemoved)
                    for k in e.block_hashes
                )
                return set(keys[2:]) <= evicted

            receiver.until(all_evicted)
            assert await store.batch_exists(keys[2:3]) == 0

    try:
        asyncio.run(body())
    finally:
        receiver.close()
