"""Redis and Redis Cluster specifics: damaged values, chunks, TTL, namespaces, faults."""

from __future__ import annotations

import asyncio
from urllib.parse import parse_qs, urlsplit

import pytest
import redis

from storage_backends import open_backend
from storage_backends.objects import header_size

PAGE_BYTES = 5000
WITHIN_S = 60  # a deadline for a call that must not hang (never a timing)


def run(coro):
    return asyncio.run(coro)


@pytest.fixture(params=["redis", "redis_cluster"])
def redis_target(request, redis_server, redis_cluster):
    """(url factory, a plain redis-py client on the same data) for one server and the cluster."""
    if request.param == "redis":
        client = redis.Redis(port=redis_server.port)
        make = request.getfixturevalue("redis_url")
    else:
        client = redis.RedisCluster(host="127.0.0.1", port=redis_cluster[0].port)
        make = request.getfixturevalue("redis_cluster_url")
    yield make, client
    client.close()


def redis_key(url: str, key: bytes, chunk: int = 0) -> bytes:
    """The Redis key of a page's value (chunk 0: header and first payload chunk) or chunk."""
    prefix = parse_qs(urlsplit(url).query)["prefix"][0]
    main = prefix.encode() + b"{" + key.hex().encode() + b"}"
    return main if chunk == 0 else main + b":%d" % chunk


def _flip(value: bytes, offset: int) -> bytes:
    out = bytearray(value)
    out[offset] ^= 0x10
    return bytes(out)


def _copy_page(client, url, src: bytes, dst: bytes) -> None:
    for chunk in range(5):
        client.set(redis_key(url, dst, chunk), client.get(redis_key(url, src, chunk)))


# Pages of 5000 bytes in 1 KiB chunks: the value holds the header and 1 KiB, then chunks 1-4.
DAMAGE = {
    "payload_byte": (lambda c, u, k, o: c.set(u(k, 2), _flip(c.get(u(k, 2)), 7)), "checksum"),
    "header_magic": (lambda c, u, k, o: c.set(u(k), _flip(c.get(u(k)), 1)), "magic"),
    "header_key": (lambda c, u, k, o: c.set(u(k), _flip(c.get(u(k)), 20)), "key"),
    "truncated": (lambda c, u, k, o: c.set(u(k, 4), c.get(u(k, 4))[:-1]), "truncated"),
    "lost_chunk": (lambda c, u, k, o: c.delete(u(k, 2)), "truncated"),
    "extended": (lambda c, u, k, o: c.append(u(k, 4), b"!"), "length"),
}


@pytest.mark.parametrize("damage", [*DAMAGE, "other_keys_page"])
def test_a_damaged_redis_value_is_a_miss_with_its_reason(redis_target, pages, damage):
    make_url, client = redis_target
    url = make_url(chunk_size="1KiB")
    keys = [pages.key(0), pages.key(1)]
    data = [pages.page(k, PAGE_BYTES) for k in keys]

    async def body():
        async with open_backend(url, layout=pages.LAYOUT) as store:
            assert await store.batch_put(keys, data) == [True, True]
            if damage == "other_keys_page":
                _copy_page(client, url, keys[1], keys[0])
                reason = "key"
            else:
                make_damage, reason = DAMAGE[damage]
                make_damage(client, lambda k, c=0: redis_key(url, k, c), keys[0], keys[1])
            pool, views = pages.pool_views(2, PAGE_BYTES)
            assert await store.batch_get(keys, views) == [False, True]
            assert bytes(views[1]) == data[1]
            assert store.stats().num_corrupt == {reason: 1}

    run(body())


def test_pages_are_chunked_and_read_whatever_chunking_wrote_them(redis_target, pages):
    make_url, client = redis_target
    url = make_url(chunk_size="1KiB")
    keys = [pages.key(i) for i in range(3)]
    data = [pages.page(k, PAGE_BYTES) for k in keys]
    query = urlsplit(url).query.replace("chunk_size=1KiB", "")

    async def body():
        async with open_backend(url, layout=pages.LAYOUT) as small_chunks:
            assert await small_chunks.batch_put(keys, data) == [True] * 3
        values = [client.get(redis_key(url, keys[0], i)) for i in range(6)]
        assert [len(v) if v else 0 for v in values] == [
            header_size(pages.LAYOUT) + 1024,
            1024,
            1024,
            1024,
            5000 - 4096,
            0,
        ]
        for chunking in ("", "&chunk_size=1KiB", "&chunk_size=3KiB"):
            reader_url = url.split("?")[0] + "?" + query + chunking
            async with open_backend(reader_url, layout=pages.LAYOUT) as reader:
                pool, views = pages.pool_views(3, PAGE_BYTES)
                assert await reader.batch_get(keys, views) == [True] * 3, chunking
                assert bytes(pool) == b"".join(data)
                assert await reader.batch_get_objects(keys[:1]) != [None]
        async with open_backend(url, layout=pages.LAYOUT) as store:
            assert await store.delete(keys) == 3
        assert [client.exists(redis_key(url, keys[0], i)) for i in range(5)] == [0] * 5

    run(body())


def test_ttl_expires_pages(redis_target, pages):
    make_url, client = redis_target
    url = make_url(ttl="30s")
    key = pages.key(0)

    async def body():
        async with open_backend(url, layout=pages.LAYOUT) as store:
            await store.batch_put([key], [bytes(100)])
        assert 0 < client.pttl(redis_key(url, key)) <= 30_000

    run(body())


def test_prefixes_are_separate_namespaces(redis_target, pages):
    make_url, client = redis_target
    url_a, url_b = make_url(), make_url()
    key = pages.key(0)

    async def body():
        async with open_backend(url_a, layout=pages.LAYOUT) as a:
            async with open_backend(url_b, layout=pages.LAYOUT) as b:
                await a.batch_put([key], [bytes(100)])
                assert await a.batch_exists([key]) == 1
                assert await b.batch_exists([key]) == 0
        assert client.exists(redis_key(url_a, key)) == 1

    run(body())


def test_cluster_spreads_pages_over_every_node(redis_cluster_url, redis_cluster, pages):
    keys = [pages.key(i, salt="spread") for i in range(64)]

    async def body():
        async with open_backend(redis_cluster_url(), layout=pages.LAYOUT) as store:
            assert await store.batch_put(keys, [bytes(64)] * 64) == [True] * 64
            assert await store.batch_exists(keys) == 64

    run(body())
    assert all(int(node.command("DBSIZE")) > 0 for node in redis_cluster)


def test_killed_mid_batch_then_restarted_without_rebuilding(start_redis, pages):
    server = start_redis()
    url = f"redis://127.0.0.1:{server.port}/0?timeout=2s&connect_timeout=500ms"
    keys = [pages.key(i) for i in range(32)]
    data = [pages.page(k, PAGE_BYTES) for k in keys]

    async def body():
        async with open_backend(url, layout=pages.LAYOUT) as store:
            assert await store.batch_put(keys, data) == [True] * 32
            server.command("CLIENT", "PAUSE", "10000", "ALL")  # the batch is sure to be in flight
            pool, views = pages.pool_views(32, PAGE_BYTES)
            batch = asyncio.create_task(store.batch_get(keys, views))
            await asyncio.sleep(0.3)
            assert not batch.done()
            server.kill()
            # (a generous deadline: a call that hangs fails here; none is timed)
            assert await asyncio.wait_for(batch, WITHIN_S) == [False] * 32
            assert bytes(pool) == b"\xa5" * len(pool)

            down = store.batch_put(keys[:1], data[:1])
            assert await asyncio.wait_for(down, WITHIN_S) == [False]  # down: a miss
            assert await asyncio.wait_for(store.batch_exists(keys), WITHIN_S) == 0
            assert store.stats().num_errors >= 2

            server.start()  # same port, empty (no persistence)
            assert store.stats().breaker_state == "open"  # three faults in a row
            await asyncio.sleep(store.options.breaker_backoff_s)  # then the next call probes
            assert await store.batch_put(keys, data) == [True] * 32
            assert await store.batch_get(keys, views) == [True] * 32
            assert bytes(pool) == b"".join(data)
            assert store.stats().num_reconnects >= 1

    run(body())


def test_a_slow_server_costs_one_timeout_not_a_hang(start_redis, pages):
    server = start_redis()
    url = f"redis://127.0.0.1:{server.port}/0?timeout=300ms"
    key = pages.key(0)

    async def body():
        async with open_backend(url, layout=pages.LAYOUT) as store:
            await store.batch_put([key], [bytes(PAGE_BYTES)])
            _, views = pages.pool_views(1, PAGE_BYTES)
            with server.paused():  # it never answers until it goes on
                # a stopped server answers nothing: a miss here is the call's own timeout
                got = await asyncio.wait_for(store.batch_get([key], views), WITHIN_S)
            assert got == [False]
            assert store.stats().num_timeouts == 1
            assert await store.batch_get([key], views) == [True]

    run(body())


def test_out_of_memory_is_a_rejected_put(start_redis, pages):
    server = start_redis("--maxmemory", "3mb", "--maxmemory-policy", "noeviction")
    url = f"redis://127.0.0.1:{server.port}/0"
    keys = [pages.key(i) for i in range(16)]

    async def body():
        async with open_backend(url, layout=pages.LAYOUT) as store:
            stored = []
            for key in keys:  # one at a time: Redis checks memory before each command
                stored += await store.batch_put([key], [bytes(512 << 10)])
            assert stored[0] is True and stored[-1] is False
            stats = store.stats()
            assert stats.num_put_rejected == stored.count(False)
            assert stats.num_errors == 0

    run(body())


HEADER_DAMAGE = {
    "magic": lambda c, u, k: c.set(u(k), _flip(c.get(u(k)), 1)),
    "cut to 10 bytes": lambda c, u, k: c.set(u(k), c.get(u(k))[:10]),
    "stored length": lambda c, u, k: c.setrange(u(k), 32, b"\xff" * 8),
}


@pytest.mark.parametrize("damage", sorted(HEADER_DAMAGE))
def test_a_delete_removes_every_chunk_even_when_the_header_is_damaged(redis_target, pages, damage):
    """(A page whose header lengths were damaged used to leave chunks 1-4 behind.)"""
    make_url, client = redis_target
    url = make_url(chunk_size="1KiB")
    keys = [pages.key(0), pages.key(1)]
    data = [pages.page(k, PAGE_BYTES) for k in keys]

    async def body():
        async with open_backend(url, layout=pages.LAYOUT) as store:
            assert await store.batch_put(keys, data) == [True, True]
            HEADER_DAMAGE[damage](client, lambda k, c=0: redis_key(url, k, c), keys[0])
            assert await store.delete(keys) == 2
        for key in keys:
            left = [i for i in range(6) if client.exists(redis_key(url, key, i))]
            assert left == [], f"chunks {left} of a deleted page are still there"

    run(body())
