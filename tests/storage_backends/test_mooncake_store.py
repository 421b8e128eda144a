"""Mooncake Store specifics: objects damaged in the store, rounds through the staging arena,
eviction, and the faults of a distributed store (the master killed and restarted, the process
holding the pages killed, a hung holder), against a real `mooncake_master` and `mooncake_client`.

Waits are bounded polls on what the store reports, never sleeps for time.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest

from storage_backends import (
    BackendConfigError,
    BackendUnavailableError,
    encode_object,
    open_backend,
)
from tests.support.servers import MooncakeHolder, MooncakeMaster, free_port

PAGE_BYTES = 4096


def run(coro):
    return asyncio.run(coro)


def wait_until(check: Callable[[], object], what: str, timeout_s: float = 60.0) -> object:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


async def wait_until_async(check, what: str, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = await check()
        if value:
            return value
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
def own_store(tmp_path: Path) -> Iterator[tuple[MooncakeMaster, Callable[..., MooncakeHolder]]]:
    """A master of this test alone, and a way to start holders on it (to kill or pause)."""
    master = MooncakeMaster(tmp_path / "mooncake").start()
    holders: list[MooncakeHolder] = []

    def start_holder(segment_bytes: int = 64 << 20) -> MooncakeHolder:
        holder = MooncakeHolder(master, segment_bytes, name=f"holder{len(holders)}")
        holders.append(holder)
        return holder.start()

    yield master, start_holder
    for holder in holders:
        holder.stop()
    master.stop()


def object_name(url: str, key: bytes) -> str:
    return parse_qs(urlsplit(url).query)["prefix"][0] + key.hex()


@pytest.fixture
def raw_client(mooncake_store: MooncakeMaster):
    """A plain Mooncake client on the shared store: it reads and writes objects by name."""
    from mooncake.store import MooncakeDistributedStore

    client = MooncakeDistributedStore()
    assert (
        client.setup("127.0.0.1", "P2PHANDSHAKE", 0, 1 << 20, "tcp", "", mooncake_store.address)
        == 0
    )
    yield client
    client.close()


# -- damage in the store ---------------------------------------------------------------------


def _flip(blob: bytes, offset: int) -> bytes:
    out = bytearray(blob)
    out[offset] ^= 0x08
    return bytes(out)


DAMAGE = {
    "payload_byte": (lambda blob: _flip(blob, len(blob) - 1), "checksum"),
    "magic": (lambda blob: _flip(blob, 0), "magic"),
    "key_byte": (lambda blob: _flip(blob, 20), "key"),
    "truncated": (lambda blob: blob[: len(blob) // 2], "truncated"),
    "much_longer": (lambda blob: blob + bytes(4096), "length"),  # past the read's buffer
}


@pytest.mark.parametrize("lent", [False, True], ids=["staged", "direct"])
@pytest.mark.parametrize("damage", list(DAMAGE))
def test_an_object_damaged_in_the_store_is_a_miss(mooncake_url, raw_client, pages, damage, lent):
    """The stored object is read back by a plain client, damaged, and written over itself;
    read through the arena, or straight into a lent pool (then checked where it landed).
    The read removes it (a put keeps what the store holds): the next put stores the page
    again and it reads back whole."""
    url = mooncake_url(direct="4KiB")
    key = pages.key(1, damage)
    payload = pages.page(key, PAGE_BYTES)
    make_damage, reason = DAMAGE[damage]

    async def body():
        async with open_backend(url, layout=pages.LAYOUT) as store:
            assert await store.batch_put([key], [payload]) == [True]
            name = object_name(url, key)
            blob = raw_client.get(name)
            assert blob == encode_object(key, pages.LAYOUT, payload)  # the format, as stored
            assert raw_client.upsert(name, make_damage(blob)) == 0
            pool, views = pages.pool_views(1, PAGE_BYTES)
            assert store.lend(pool) is True
            if not lent:  # a page of another region than the lent one: staged
                pool, views = pages.pool_views(1, PAGE_BYTES)
            assert await store.batch_get([key], views) == [False]
            assert store.stats().num_corrupt == {reason: 1}
            if not lent or damage in ("truncated", "much_longer"):
                assert bytes(pool) == b"\xa5" * len(pool)  # checked before it was copied
            assert store.stats().num_dropped == 1
            assert raw_client.is_exist(name) == 0
            assert await store.batch_put([key], [payload]) == [True]
            assert await store.batch_get([key], views) == [True]
            assert bytes(views[0]) == payload
            assert raw_client.get(name) == blob
            stats = store.stats()
            assert (stats.num_corrupt, stats.num_dropped, stats.num_errors) == ({reason: 1}, 1, 0)

    run(body())


def test_the_objects_api_removes_a_damaged_object_it_refuses(mooncake_url, raw_client, pages):
    """`batch_get_objects` (the daemon's read) refuses a damaged object and removes it, so a
    later put of its key stores it afresh."""
    url = mooncake_url()
    key = pages.key(1, "objects-damaged")
    payload = pages.page(key, PAGE_BYTES)

    async def body():
        async with open_backend(url, layout=pages.LAYOUT) as store:
            assert await store.batch_put([key], [payload]) == [True]
            name = object_name(url, key)
            blob = raw_client.get(name)
            assert raw_client.upsert(name, _flip(blob, len(blob) - 1)) == 0
            assert await store.batch_put([key], [payload]) == [True]  # kept: still damaged
            assert await store.batch_get_objects([key]) == [None]
            assert store.stats().num_corrupt == {"checksum": 1}
            assert store.stats().num_dropped == 1
            assert raw_client.is_exist(name) == 0
            assert await store.batch_put_objects([key], [blob]) == [True]
            assert await store.batch_get_objects([key]) == [blob]

    run(body())


class _CountingClient:
    """A Mooncake client that counts the calls made through it."""

    def __init__(self, client) -> None:
        self.client = client
        self.calls: dict[str, int] = {}

    def __getattr__(self, name: str):
        self.calls[name] = self.calls.get(name, 0) + 1
        return getattr(self.client, name)


def test_the_objects_api_asks_the_master_once_for_a_batch_s_sizes(mooncake_url, pages):
    """`batch_get_objects` learns every object's size from one query of the master, not a
    round trip per key; absent keys among them are misses."""
    url = mooncake_url()
    keys = [pages.key(i, "sizes") for i in range(6)]
    data = [pages.page(k, 512 * (i + 1)) for i, k in enumerate(keys)]

    async def body():
        async with open_backend(url, layout=pages.LAYOUT) as store:
            for key, page in zip(keys[:4], data[:4], strict=True):  # pages of 4 sizes
                assert await store.batch_put([key], [page]) == [True]
            store._client = counting = _CountingClient(store._client)
            blobs = await store.batch_get_objects(keys)
            stored = zip(keys[:4], data[:4], strict=True)
            assert blobs[:4] == [encode_object(k, pages.LAYOUT, d) for k, d in stored]
            assert blobs[4:] == [None, None]
            assert counting.calls.get("get_size", 0) == 0
            assert counting.calls["batch_get_replica_desc"] == 1
            assert await store.batch_get_objects(keys[4:]) == [None, None]  # none described
            assert counting.calls.get("get_size", 0) == 1
            assert store.stats().num_errors == 0

    run(body())


def test_an_object_of_an_unknown_format_version_is_left_in_place(mooncake_url, raw_client, pages):
    """A newer writer's object (a format version this reader does not know) is a miss here,
    but intact for its own readers: it is not removed."""
    url = mooncake_url()
    key = pages.key(1, "newer")
    payload = pages.page(key, PAGE_BYTES)

    async def body():
        async with open_backend(url, layout=pages.LAYOUT) as store:
            name = object_name(url, key)
            newer = bytearray(encode_object(key, pages.LAYOUT, payload))
            newer[4] = 9  # the format version (after the 4-byte magic)
            assert raw_client.put(name, bytes(newer)) == 0
            _, views = pages.pool_views(1, PAGE_BYTES)
            assert await store.batch_get([key], views) == [False]
            assert store.stats().num_corrupt == {"version": 1}
            assert store.stats().num_dropped == 0
            assert raw_client.get(name) == bytes(newer)

    run(body())


def test_batches_larger_than_the_buffer_move_in_rounds(mooncake_url, pages):
    """A 1 MiB arena moves 512 KiB rounds: 40 pages of 64 KiB take several, all in order."""
    page_bytes = 64 << 10
    keys = [pages.key(i, "rounds") for i in range(40)]
    data = [pages.page(k, page_bytes) for k in keys]

    async def body():
        async with open_backend(mooncake_url(buffer="1MiB"), layout=pages.LAYOUT) as store:
            assert await store.batch_put(keys, data) == [True] * 40
            pool, views = pages.pool_views(40, page_bytes)
            assert await store.batch_get(keys, views) == [True] * 40
            assert bytes(pool) == b"".join(data)
            assert await store.batch_get_objects(keys[:3]) == [
                encode_object(k, pages.LAYOUT, d) for k, d in zip(keys[:3], data[:3], strict=True)
            ]
            # A page larger than a round cannot be staged: refused, not an error.
            assert await store.batch_put([pages.key(99)], [bytes(600 << 10)]) == [False]
            assert store.stats().num_put_rejected == 1
            assert store.stats().num_errors == 0

    run(body())


# -- capacity --------------------------------------------------------------------------------


def test_a_full_store_rejects_puts_and_evicted_pages_are_misses(own_store, pages):
    master, start_holder = own_store
    start_holder(16 << 20)
    page_bytes = 256 << 10
    keys = [pages.key(i, "full") for i in range(160)]  # 40 MiB into 16
    url = f"mooncake://{master.address}?prefix=full:&buffer=16MiB"

    async def body():
        async with open_backend(url, layout=pages.LAYOUT) as store:
            stored = []
            for start in range(0, len(keys), 16):
                batch = keys[start : start + 16]
                stored += await store.batch_put(batch, [pages.page(k, page_bytes) for k in batch])
            stats = store.stats()  # (rejected while the store's eviction catches up)
            assert stats.num_puts == sum(stored)
            assert stats.num_put_rejected == len(keys) - stats.num_puts
            pool, views = pages.pool_views(len(keys), page_bytes)
            found = await store.batch_get(keys, views)
            for i, hit in enumerate(found):
                if hit:
                    assert bytes(views[i]) == pages.page(keys[i], page_bytes)
            assert 0 < sum(found) < len(keys)  # what is gone is a miss ...
            assert store.stats().num_errors == 0  # ... never an error
            assert store.stats().num_corrupt_total == 0

    run(body())


# -- faults ----------------------------------------------------------------------------------


def test_master_killed_then_restarted(own_store, pages):
    """While the master is down calls are faults (misses, False, 0) that return at once; once
    it is back the same backend stores again (the pages it held are gone: misses)."""
    master, start_holder = own_store
    start_holder()
    keys = [pages.key(i, "restart") for i in range(4)]
    data = [pages.page(k, PAGE_BYTES) for k in keys]
    url = f"mooncake://{master.address}?prefix=r:&buffer=4MiB&timeout=5s&breaker_failures=0"

    async def body():
        async with open_backend(url, layout=pages.LAYOUT) as store:
            assert await store.batch_put(keys, data) == [True] * 4
            master.kill()
            pool, views = pages.pool_views(4, PAGE_BYTES)
            assert await store.batch_get(keys, views) == [False] * 4
            assert await store.batch_exists(keys) == 0
            assert await store.batch_put(keys, data) == [False] * 4
            assert await store.batch_get_objects(keys) == [None] * 4
            assert store.stats().num_errors + store.stats().num_timeouts >= 4  # faults
            master.start()  # the same ports

            async def stored_again():
                return await store.batch_put(keys[:1], data[:1]) == [True]

            await wait_until_async(stored_again, "a put after the master restarted")
            assert await store.batch_exists(keys) == 1
            assert await store.batch_get(keys, views) == [True, False, False, False]
            assert bytes(views[0]) == data[0]

    run(body())


def test_the_process_holding_the_pages_is_killed(own_store, pages):
    """Pages on a segment whose process died are misses, never errors; a new holder takes
    the next puts."""
    master, start_holder = own_store
    holder = start_holder()
    keys = [pages.key(i, "holder") for i in range(8)]
    data = [pages.page(k, PAGE_BYTES) for k in keys]
    url = f"mooncake://{master.address}?prefix=h:&buffer=4MiB&timeout=5s"

    async def body():
        async with open_backend(url, layout=pages.LAYOUT) as store:
            assert await store.batch_put(keys, data) == [True] * 8
            holder.kill()
            pool, views = pages.pool_views(8, PAGE_BYTES)
            assert await store.batch_get(keys, views) == [False] * 8
            assert bytes(pool) == b"\xa5" * len(pool)  # nothing written
            master.wait_capacity(0, at_most=0)  # the master dropped the dead segment

            async def forgotten():
                return await store.batch_exists(keys) == 0

            await wait_until_async(forgotten, "the master forgetting the dead segment's pages")
            start_holder()
            assert await store.batch_put(keys, data) == [True] * 8
            assert await store.batch_get(keys, views) == [True] * 8
            assert b"".join(bytes(v) for v in views) == b"".join(data)
            stats = store.stats()
            assert stats.num_errors == 0 and stats.num_corrupt_total == 0
            assert stats.num_misses == 8

    run(body())


def test_a_hung_holder_costs_one_timeout_and_no_late_write(own_store, pages):
    """A holder paused mid-read: the call returns misses at its deadline, and when the
    transfer finally completes it lands in the staging arena, never in the caller's pool."""
    master, start_holder = own_store
    holder = start_holder()
    keys = [pages.key(i, "hung") for i in range(4)]
    data = [pages.page(k, PAGE_BYTES) for k in keys]
    url = f"mooncake://{master.address}?prefix=g:&buffer=4MiB"

    async def body():
        async with open_backend(url + "&timeout=30s", layout=pages.LAYOUT) as writer:
            assert await writer.batch_put(keys, data) == [True] * 4
        async with open_backend(url + "&timeout=1s", layout=pages.LAYOUT) as store:
            await store.connect()  # (set up before the pause: only the read is timed)
            with holder.paused():
                pool, views = pages.pool_views(4, PAGE_BYTES)
                started = time.monotonic()
                assert await store.batch_get(keys, views) == [False] * 4
                assert time.monotonic() - started < 30  # the deadline, with room for load
                assert store.stats().num_timeouts == 1
            arena = store._arena
            await wait_until_async(
                lambda: asyncio.sleep(0, arena.num_taken() == 0), "the late transfer ending"
            )
            assert bytes(pool) == b"\xa5" * len(pool)

            async def answering():
                return await store.batch_get(keys, views) == [True] * 4

            await wait_until_async(answering, "reads after the holder resumed")
            assert b"".join(bytes(v) for v in views) == b"".join(data)

    run(body())


@pytest.fixture(params=[1, 4], ids=["one_chunk", "four_chunks"])
def chunks(request, monkeypatch):
    """Direct rounds in one transfer, or in four chunks (a page's worth each) whose
    framing and checks overlap the transfers of their neighbours."""
    from storage_backends import mooncake_direct

    if request.param > 1:
        monkeypatch.setattr(mooncake_direct, "_CHUNK_BYTES", PAGE_BYTES)
        monkeypatch.setattr(mooncake_direct, "_MAX_CHUNKS", 4)  # (one on a two-core machine)
    return request.param


def test_puts_from_a_lent_pool_store_the_format_and_keep_what_is_there(
    mooncake_url, raw_client, pages, chunks
):
    """Pages of a lent pool go to the store straight from the pool (headers from the arena):
    the stored objects are the shared format; an object the store holds already under a
    key is kept, as every put of this backend keeps it (a damaged one goes when a read
    refuses it: test_an_object_damaged_in_the_store_is_a_miss)."""
    url = mooncake_url(direct="4KiB")
    keys = [pages.key(i, "lent-put") for i in range(4)]
    data = [pages.page(k, PAGE_BYTES) for k in keys]

    async def body():
        async with open_backend(url, layout=pages.LAYOUT) as store:
            pool = bytearray(b"".join(data))
            views = [memoryview(pool)[i * PAGE_BYTES : (i + 1) * PAGE_BYTES] for i in range(4)]
            assert store.lend(pool) is True
            damaged = encode_object(keys[0], pages.LAYOUT, bytes(PAGE_BYTES))
            assert raw_client.upsert(object_name(url, keys[0]), damaged) == 0
            direct = store._put_direct
            calls = []

            async def counted(*args):
                calls.append(len(args[0]))
                return await direct(*args)

            store._put_direct = counted
            assert await store.batch_put(keys, views) == [True] * 4
            assert calls == [4]
            assert raw_client.get(object_name(url, keys[0])) == damaged
            for key, page in zip(keys[1:], data[1:], strict=True):
                blob = raw_client.get(object_name(url, key))
                assert blob == encode_object(key, pages.LAYOUT, page)
            assert store.quarantined(views) == [False] * 4
            assert store.stats().num_puts == 4
            assert store.stats().num_errors == 0

    run(body())


def test_reads_into_a_lent_pool_land_in_place_and_check_out(
    mooncake_url, raw_client, pages, chunks
):
    """Pages of a lent pool come straight from the store (no arena copy), checked in place
    (a foreign object among them is a counted miss, the others land); a page outside the
    pool goes through the arena, with the same bytes."""
    url = mooncake_url(direct="4KiB")
    keys = [pages.key(i, "lent") for i in range(6)]
    data = [pages.page(k, PAGE_BYTES) for k in keys]

    async def body():
        async with open_backend(url, layout=pages.LAYOUT) as store:
            assert await store.batch_put(keys, data) == [True] * 6
            pool, views = pages.pool_views(6, PAGE_BYTES)
            assert store.lend(pool) is True
            direct = store._fetch_direct
            calls = []

            async def counted(*args):
                calls.append(len(args[0]))
                return await direct(*args)

            store._fetch_direct = counted
            assert await store.batch_get(keys, views) == [True] * 6
            assert bytes(pool) == b"".join(data)
            assert calls == [6]
            assert store.quarantined(views) == [False] * 6
            # Another page's object under keys[3]: the same size, so it lands, and is refused.
            foreign = raw_client.get(object_name(url, keys[2]))
            assert raw_client.upsert(object_name(url, keys[3]), foreign) == 0
            pool[:] = b"\xa5" * len(pool)
            assert await store.batch_get(keys, views) == [True] * 3 + [False] + [True] * 2
            assert store.stats().num_corrupt == {"key": 1}
            assert [bytes(views[i]) == data[i] for i in range(6)] == [True] * 3 + [False] + [
                True
            ] * 2
            other, other_views = pages.pool_views(2, PAGE_BYTES)  # not lent: staged
            assert await store.batch_get(keys[:2], other_views) == [True] * 2
            assert bytes(other) == b"".join(data[:2])
            assert calls == [6, 6]
            assert store.stats().num_errors == 0
        async with open_backend(mooncake_url(direct="0"), layout=pages.LAYOUT) as store:
            assert store.lend(bytearray(PAGE_BYTES)) is False  # direct off: no use for it

    run(body())


class _SlowRegistration:
    """The backend's client, with each registration of a buffer taking 0.2 s longer."""

    def __init__(self, client) -> None:
        self._client = client
        self.registered: list[int] = []

    def __getattr__(self, name: str):
        return getattr(self._client, name)

    def register_buffer(self, address: int, nbytes: int) -> int:
        time.sleep(0.2)
        self.registered.append(address)
        return self._client.register_buffer(address, nbytes)


def test_calls_at_once_after_a_lending_register_each_region_once(mooncake_url, pages):
    """Calls that come at once while lent pools are not yet registered register each pool
    once: a second registration of one the client has (refused by the client) had dropped it
    from the lent regions while it stayed registered, and the next call failed on it."""
    url = mooncake_url(direct="4KiB")
    keys = [[pages.key(i, f"at-once-{j}") for i in range(4)] for j in range(3)]

    async def body():
        async with open_backend(url, layout=pages.LAYOUT) as store:
            await store.connect()  # (a region lent before is registered as the client sets up)
            client = store._client = _SlowRegistration(store._client)
            pools = [pages.pool_views(4, PAGE_BYTES) for _ in keys]
            for (pool, _), batch in zip(pools, keys, strict=True):
                pool[:] = b"".join(pages.page(key, PAGE_BYTES) for key in batch)
                assert store.lend(pool) is True
            puts = (store.batch_put(b, views) for b, (_, views) in zip(keys, pools, strict=True))
            assert await asyncio.gather(*puts) == [[True] * 4] * 3
            assert len(set(client.registered)) == len(client.registered) == 3  # once each
            reads = [pages.pool_views(4, PAGE_BYTES) for _ in keys]
            for pool, _ in reads:
                assert store.lend(pool) is True
            gets = (store.batch_get(b, views) for b, (_, views) in zip(keys, reads, strict=True))
            assert await asyncio.gather(*gets) == [[True] * 4] * 3
            assert [bytes(pool) for pool, _ in reads] == [bytes(pool) for pool, _ in pools]
            assert len(set(client.registered)) == len(client.registered) == 6
            assert store.stats().num_errors == 0

    run(body())


def test_a_transfer_past_its_deadline_keeps_its_lent_pages_quarantined(own_store, pages):
    """A holder paused mid-read into a lent pool: the call returns misses at its deadline,
    but its pages stay quarantined while the transfer runs; a page handed in again then is
    refused, and no page the caller got back as not quarantined is ever written."""
    master, start_holder = own_store
    holder = start_holder()
    keys = [pages.key(i, "quarantine") for i in range(4)]
    data = [pages.page(k, PAGE_BYTES) for k in keys]
    url = f"mooncake://{master.address}?prefix=q:&buffer=4MiB&direct=4KiB"

    async def body():
        async with open_backend(url + "&timeout=30s", layout=pages.LAYOUT) as writer:
            assert await writer.batch_put(keys, data) == [True] * 4
        async with open_backend(url + "&timeout=1s", layout=pages.LAYOUT) as store:
            pool, views = pages.pool_views(4, PAGE_BYTES)
            assert store.lend(pool) is True
            assert await store.batch_exists(keys) == 4  # (set up before the pause)
            with holder.paused():
                assert await store.batch_get(keys, views) == [False] * 4
                assert store.stats().num_timeouts == 1
                free = [not q for q in store.quarantined(views)]
                assert free == [False] * 4  # the transfer still runs: none is the caller's
                again = await store.batch_get(keys, views)  # the caller breaking the rule
                assert again == [False] * 4
                assert store.stats().num_errors == 4
            await wait_until_async(
                lambda: asyncio.sleep(0, store._pool.num_pending() == 0), "the transfer ending"
            )
            assert store.quarantined(views) == [False] * 4
            for view, was_free in zip(views, free, strict=True):
                if was_free:
                    assert bytes(view) == b"\xa5" * PAGE_BYTES

            async def answering():
                return await store.batch_get(keys, views) == [True] * 4

            await wait_until_async(answering, "reads after the holder resumed")
            assert b"".join(bytes(v) for v in views) == b"".join(data)

    run(body())


def test_a_put_past_its_deadline_keeps_its_lent_pages_quarantined(own_store, pages):
    """A holder paused while a lent pool's pages are put: the call fails at its deadline,
    the pages it still reads stay quarantined until the transfer is over."""
    master, start_holder = own_store
    holder = start_holder()
    keys = [pages.key(i, "put-quarantine") for i in range(4)]
    url = f"mooncake://{master.address}?prefix=p:&buffer=4MiB&direct=4KiB&timeout=1s"

    async def body():
        async with open_backend(url, layout=pages.LAYOUT) as store:
            pool = bytearray(b"".join(pages.page(k, PAGE_BYTES) for k in keys))
            views = [memoryview(pool)[i * PAGE_BYTES : (i + 1) * PAGE_BYTES] for i in range(4)]
            assert store.lend(pool) is True
            assert await store.batch_exists(keys) == 0  # (set up before the pause)
            with holder.paused():
                assert await store.batch_put(keys, views) == [False] * 4
                assert store.stats().num_timeouts == 1
                assert store.quarantined(views) == [True] * 4
            await wait_until_async(
                lambda: asyncio.sleep(0, store._pool.num_pending() == 0), "the transfer ending"
            )
            assert store.quarantined(views) == [False] * 4

    run(body())


# -- configuration ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "url, message",
    [
        ("mooncake://", "the master's host is missing"),
        ("mooncake://h:x", "bad port"),
        ("mooncake://h:1/path", "has no path"),
        ("mooncake://h:1?protocol=udp", "protocol must be tcp or rdma"),
        ("mooncake://h:1?device=mlx5_0", "device names RDMA devices"),
        ("mooncake://h:1?segment=4G", "segment: '4G' is not a size"),
        ("mooncake://h:1?segment=1MiB", "segment must be 0 or at least 16MiB"),
        ("mooncake://h:1?buffer=1KiB", "buffer must be in"),
        ("mooncake://h:1?replicas=0", "replicas must be in"),
        ("mooncake://h:1?lease=10s", "lease is the master's: .* --default_kv_lease_ttl"),
        ("mooncake://h:1?leases=1", "unknown option 'leases'"),
    ],
)
def test_bad_urls_name_what_is_wrong(url, message):
    with pytest.raises(BackendConfigError, match=message):
        open_backend(url)


def test_a_master_that_does_not_answer_fails_loudly_and_fast(pages):
    url = f"mooncake://127.0.0.1:{free_port()}?timeout=10s"

    async def body():
        store = open_backend(url, layout=pages.LAYOUT)
        started = time.monotonic()
        with pytest.raises(BackendUnavailableError, match="cannot be reached"):
            await store.batch_exists([pages.key(0)])
        assert time.monotonic() - started < 5  # refused at once, not the client's retries
        await store.close()

    run(body())


def test_the_client_is_imported_only_for_a_mooncake_url(monkeypatch):
    import subprocess

    code = (
        "import sys, storage_backends; "
        "storage_backends.open_backend('memory://'); "
        "assert 'mooncake' not in sys.modules, 'imported'; "
        "storage_backends.open_backend('mooncake://127.0.0.1:1'); "
        "assert 'mooncake.store' in sys.modules and 'torch' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[2])
    monkeypatch.setitem(sys.modules, "mooncake", None)  # as if not installed
    with pytest.raises(BackendConfigError, match="pip install mooncake-transfer-engine") as info:
        open_backend("mooncake://127.0.0.1:1")
    assert "\n" not in str(info.value)


def test_with_two_replicas_a_page_outlives_one_holder(own_store, pages):
    """replicas=2 puts each page on both holders' segments; with one holder killed the pages
    are still read (a transfer from the dead one fails over, or the master dropped it)."""
    master, start_holder = own_store
    first = start_holder(32 << 20)
    start_holder(32 << 20)
    keys = [pages.key(i, "replicas") for i in range(6)]
    data = [pages.page(k, PAGE_BYTES) for k in keys]
    url = f"mooncake://{master.address}?prefix=rep:&buffer=4MiB&replicas=2&timeout=10s"

    async def body():
        async with open_backend(url, layout=pages.LAYOUT) as store:
            assert await store.batch_put(keys, data) == [True] * 6
            described = store._client.batch_get_replica_desc(["rep:" + k.hex() for k in keys])
            assert [len(described["rep:" + k.hex()]) for k in keys] == [2] * 6
            first.kill()
            master.wait_capacity(32 << 20, at_most=32 << 20)  # the dead segment is dropped
            pool, views = pages.pool_views(6, PAGE_BYTES)
            assert await store.batch_get(keys, views) == [True] * 6
            assert b"".join(bytes(v) for v in views) == b"".join(data)

    run(body())


def test_backends_on_one_store_share_one_client_and_keep_their_prefixes(mooncake_url, pages):
    """A process' backends on one store share one Mooncake client (its threads, ports and
    segment), each with its own prefix and buffer; the last one closed closes it."""
    from storage_backends.mooncake_store import _CLIENTS

    key = pages.key(1, "shared")
    before = _CLIENTS.num_clients()

    async def body():
        first = open_backend(mooncake_url(), layout=pages.LAYOUT)
        second = open_backend(mooncake_url(), layout=pages.LAYOUT)
        async with first, second:
            assert await first.batch_put([key], [b"1" * PAGE_BYTES]) == [True]
            assert await second.batch_exists([key]) == 0  # another prefix
            assert await second.batch_put([key], [b"2" * PAGE_BYTES]) == [True]
            assert first._client is second._client
            assert _CLIENTS.num_clients() == before + 1
            pool, views = pages.pool_views(2, PAGE_BYTES)
            assert await first.batch_get([key], views[:1]) == [True]
            assert await second.batch_get([key], views[1:]) == [True]
            assert bytes(pool) == b"1" * PAGE_BYTES + b"2" * PAGE_BYTES
            await first.close()
            assert _CLIENTS.num_clients() == before + 1  # still used by the second
            assert await second.batch_get([key], views[1:]) == [True]
        assert _CLIENTS.num_clients() == before

    run(body())
