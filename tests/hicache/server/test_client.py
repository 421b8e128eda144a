"""The grpc:// backend against daemons that go down, come back, or lie."""

from __future__ import annotations

import asyncio
import os
import time
import urllib.request

import grpc
import pytest

from storage_backends import BackendUnavailableError, encode_object, grpc_store, open_backend
from storage_backends.pieces import OutPiece, encode_get_response
from storage_backends.protocol import SERVICE
from storage_backends.rendezvous import Rendezvous
from tests.support.servers import free_port

LAYOUT = "test;layout"


def test_a_daemon_that_is_down_misses_only_its_own_keys(start_daemon):
    one, two = start_daemon("--capacity", "32MiB"), start_daemon("--capacity", "32MiB")
    url = f"grpc://{one.address},{two.address}?timeout=2s&down_for=200ms"
    ring = Rendezvous([one.address, two.address])
    keys = [os.urandom(16) for _ in range(64)]
    pages = [os.urandom(2048) for _ in keys]
    on_two = [ring.owner(k) == 1 for k in keys]
    assert 10 < sum(on_two) < 54

    async def body():
        async with open_backend(url, layout=LAYOUT) as store:
            assert await store.batch_put(keys, pages) == [True] * 64
            two.kill()
            into = [bytearray(2048) for _ in keys]
            found = await asyncio.wait_for(store.batch_get(keys, into), 60)  # never a hang
            assert found == [not t for t in on_two]
            assert all(bytes(b) == p for b, p, ok in zip(into, pages, found, strict=True) if ok)
            assert store.stats().num_errors == sum(on_two)
            first_on_two = on_two.index(True)
            assert await store.batch_exists(keys) == first_on_two
            assert await store.batch_put(keys, pages) == [not t for t in on_two]
            two.start()  # same port, empty memory: the same backend object works again
            deadline = time.monotonic() + 10
            while await store.batch_put(keys, pages) != [True] * 64:
                assert time.monotonic() < deadline, "the restarted daemon was never used again"
                await asyncio.sleep(0.1)  # past down_for and gRPC's reconnect backoff
            assert await store.batch_get(keys, into) == [True] * 64
            assert store.stats().num_reconnects == 0  # one channel per server, all along

    asyncio.run(body())


@pytest.mark.parametrize("query, tuned", [("", False), ("&tune_malloc=true", True)])
def test_first_use_sets_the_malloc_policy_only_when_asked(start_daemon, monkeypatch, query, tuned):
    daemon = start_daemon("--capacity", "8MiB")
    calls = []
    monkeypatch.setattr(grpc_store, "tune_for_large_messages", lambda: calls.append(1))

    async def body():
        async with open_backend(f"grpc://{daemon.address}?timeout=2s{query}", layout=LAYOUT) as s:
            assert await s.batch_exists([os.urandom(16)]) == 0
            assert await s.batch_exists([os.urandom(16)]) == 0

    asyncio.run(body())
    assert calls == ([1] if tuned else [])


def test_first_use_of_an_unreachable_daemon_fails_loudly():
    url = f"grpc://127.0.0.1:{free_port()}?connect_timeout=300ms"

    async def body():
        async with open_backend(url, layout=LAYOUT) as store:
            await store.batch_exists([os.urandom(16)])

    with pytest.raises(BackendUnavailableError, match="no cache-server answered"):
        asyncio.run(body())


@pytest.mark.parametrize(
    "lie, reason",
    [
        ("flipped", "checksum"),
        ("other_key", "key"),
        ("short", "truncated"),
        ("wrong_index_key", "key"),
    ],
)
def test_pages_from_a_lying_server_are_misses(lie, reason):
    """An in-process fake KVStore that answers BatchGet with damaged objects."""
    key = os.urandom(16)
    good = encode_object(key, LAYOUT, os.urandom(4096))
    other = encode_object(os.urandom(16), LAYOUT, os.urandom(4096))

    def answer() -> bytes:
        if lie == "flipped":
            blob = bytearray(good)
            blob[-5] ^= 1
            return encode_get_response([OutPiece(0, key, len(blob), 0, [bytes(blob)])])
        if lie == "other_key":
            return encode_get_response([OutPiece(0, key, len(other), 0, [other])])
        if lie == "short":
            return encode_get_response([OutPiece(0, key, len(good), 0, [good[:100]])])
        return encode_get_response([OutPiece(0, os.urandom(16), len(good), 0, [good])])

    async def body():
        async def stats(request, context):
            return b""

        async def batch_get(request, context):
            yield answer()

        server = grpc.aio.server()
        handlers = {
            "Stats": grpc.unary_unary_rpc_method_handler(stats),
            "BatchGet": grpc.unary_stream_rpc_method_handler(batch_get),
        }
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with open_backend(f"grpc://127.0.0.1:{port}", layout=LAYOUT) as store:
                into = bytearray(b"\xa5" * 4096)
                assert await store.batch_get([key], [into]) == [False]
                assert into == b"\xa5" * 4096  # untouched
                assert store.stats().num_corrupt == {reason: 1}
        finally:
            await server.stop(None)

    asyncio.run(body())


def test_metrics_endpoint_and_graceful_exit(start_daemon):
    metrics_port = free_port()
    daemon = start_daemon("--capacity", "16MiB", "--metrics-port", str(metrics_port))

    async def traffic():
        async with open_backend(f"grpc://{daemon.address}", layout=LAYOUT) as store:
            keys = [os.urandom(16) for _ in range(5)]
            await store.batch_put(keys, [b"x" * 1000] * 5)
            await store.batch_get(keys + [os.urandom(16)], [bytearray(1000)] * 6)

    asyncio.run(traffic())
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as r:
        text = r.read().decode()
    assert 'hicache_server_calls_total{code="OK",method="BatchPut"} 1.0' in text
    assert 'hicache_server_pages_total{namespace="default",outcome="hits"} 5.0' in text
    assert 'hicache_server_pages_total{namespace="default",outcome="misses"} 1.0' in text
    assert 'hicache_server_objects{namespace="default",tier="memory"} 5.0' in text
    assert "hicache_server_call_seconds_bucket" in text
    assert daemon.stop() == 0


def test_concurrent_puts_queue_for_the_daemons_stream_slots_instead_of_failing(start_daemon):
    daemon = start_daemon("--capacity", "256MiB", "--max-streams-per-client", "2")
    url = f"grpc://{daemon.address}?timeout=20s&put_streams=2"
    batches = [[os.urandom(16) for _ in range(8)] for _ in range(24)]

    async def body():
        async with open_backend(url, layout=LAYOUT) as store:
            results = await asyncio.gather(
                *(store.batch_put(keys, [os.urandom(128 << 10) for _ in keys]) for keys in batches)
            )
            assert all(all(stored) for stored in results)
            assert store.stats().num_errors == 0

    asyncio.run(body())
