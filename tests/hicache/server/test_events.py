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


def receive_events(socket: zmq.Socket, until, timeout_s: float = 10.0) -> list:
    events = []
    deadline = time.monotonic() + timeout_s
    while not until(events):
        assert time.monotonic() < deadline, f"no such events; got {events}"
        if socket.poll(100):
            _topic, _seq, payload = socket.recv_multipart()
            events.extend(DECODER.decode(payload).events)
    return events


def test_the_daemon_publishes_what_l3_stores_and_drops(start_daemon):
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    daemon = start_daemon(
        "--capacity", "64KiB", "--events-endpoint", endpoint,
        "--events-replay-endpoint", f"tcp://127.0.0.1:{free_port()}",
    )  # fmt: skip
    socket = zmq.Context.instance().socket(zmq.SUB)
    socket.setsockopt(zmq.SUBSCRIBE, b"")
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(endpoint)
    time.sleep(0.3)  # the SUB socket joins
    keys = [os.urandom(16) for _ in range(8)]
    more = [os.urandom(16) for _ in range(40)]  # 48 pages of 2 KiB: past 64 KiB, evicting

    async def body():
        async with open_backend(f"grpc://{daemon.address}", layout=LAYOUT) as store:
            assert await store.batch_put(keys, [os.urandom(2048) for _ in keys]) == [True] * 8
            stored = receive_events(
                socket, lambda got: any(isinstance(e, vllm_events.BlockStored) for e in got)
            )
            event = next(e for e in stored if isinstance(e, vllm_events.BlockStored))
            assert event.medium == "STORAGE" and event.block_size == 16
            assert set(event.block_hashes) == set(keys)
            assert await store.delete(keys[:2]) == 2
            removed = receive_events(
                socket, lambda got: any(isinstance(e, vllm_events.BlockRemoved) for e in got)
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

            receive_events(socket, all_evicted)
            assert await store.batch_exists(keys[2:3]) == 0

    try:
        asyncio.run(body())
    finally:
        socket.close(linger=0)
