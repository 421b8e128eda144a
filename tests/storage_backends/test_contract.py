"""The contract every storage backend keeps, run against each backend of conftest.BACKENDS.

Real stores only: memory, a temporary directory, a redis-server and a three-node Redis
Cluster on loopback.
"""

from __future__ import annotations

import array
import asyncio

import pytest

from storage_backends import (
    BackendClosedError,
    CorruptReason,
    SyncBackend,
    encode_object,
    open_backend,
)

PAGE_BYTES = 4096
# Backends whose server verifies every object it is given, so a damaged one cannot be stored
# (the cache-server daemon); tests/hicache/server damages its spill files instead.
VERIFIES_PUTS_ITSELF = {"grpc", "grpc_two_servers"}


def run(coro):
    return asyncio.run(coro)


def test_put_then_get_into_pool_slices(make_url, pages):
    keys = [pages.key(i) for i in range(16)]
    data = [pages.page(k, PAGE_BYTES) for k in keys]

    async def body():
        async with open_backend(make_url(), layout=pages.LAYOUT) as store:
            assert await store.batch_put(keys, data) == [True] * 16
            pool, views = pages.pool_views(16, PAGE_BYTES)
            assert await store.batch_get(keys, views) == [True] * 16
            assert bytes(pool) == b"".join(data)
            stats = store.stats()
            assert (stats.num_puts, stats.num_hits, stats.num_misses) == (16, 16, 0)
            assert stats.read_bytes == 16 * PAGE_BYTES
            assert stats.num_corrupt_total == 0

    run(body())


def test_exists_counts_the_prefix_and_stops_at_the_first_miss(make_url, pages):
    keys = [pages.key(i) for i in range(6)]

    async def body():
        async with open_backend(make_url(), layout=pages.LAYOUT) as store:
            assert await store.batch_exists(keys) == 0
            stored = [keys[0], keys[1], keys[3]]
            await store.batch_put(stored, [pages.page(k, 64) for k in stored])
            assert await store.batch_exists(keys) == 2  # keys[3] is present but after a gap
            assert await store.batch_exists(keys[3:4]) == 1
            assert await store.batch_exists([]) == 0

    run(body())


def test_missing_pages_are_false_and_counted(make_url, pages):
    async def body():
        async with open_backend(make_url(), layout=pages.LAYOUT) as store:
            present = pages.key(1)
            await store.batch_put([present], [pages.page(present, PAGE_BYTES)])
            pool, views = pages.pool_views(3, PAGE_BYTES)
            found = await store.batch_get([pages.key(0), present, pages.key(2)], views)
            assert found == [False, True, False]
            assert bytes(views[1]) == pages.page(present, PAGE_BYTES)
            assert store.stats().num_misses == 2
            assert store.stats().num_corrupt_total == 0  # absent is not corrupt

    run(body())


def test_a_second_put_of_a_key_replaces_or_keeps_the_page_as_declared(make_url, pages):
    """A put of a key the store holds replaces its page, or keeps it where the backend says
    so (`put_keeps_existing`: keys are content addresses); either way the key reads back."""
    key = pages.key(7)

    async def body():
        async with open_backend(make_url(), layout=pages.LAYOUT) as store:
            assert await store.batch_put([key], [b"a" * PAGE_BYTES]) == [True]
            assert await store.batch_put([key], [b"b" * PAGE_BYTES]) == [True]
            _, views = pages.pool_views(1, PAGE_BYTES)
            assert await store.batch_get([key], views) == [True]
            kept = b"a" if store.put_keeps_existing else b"b"
            assert bytes(views[0]) == kept * PAGE_BYTES

    run(body())


def test_delete_removes_and_counts(make_url, pages):
    keys = [pages.key(i) for i in range(4)]

    async def body():
        async with open_backend(make_url(), layout=pages.LAYOUT) as store:
            await store.batch_put(keys, [pages.page(k, 256) for k in keys])
            assert await store.delete(keys[:2] + [pages.key(99)]) == 2
            assert await store.batch_exists(keys) == 0
            assert await store.batch_exists(keys[2:]) == 2
            assert await store.delete([]) == 0

    run(body())


def test_empty_batches(make_url, pages):
    async def body():
        async with open_backend(make_url(), layout=pages.LAYOUT) as store:
            assert await store.batch_put([], []) == []
            assert await store.batch_get([], []) == []
            assert await store.batch_get_objects([]) == []
            assert await store.batch_put_objects([], []) == []

    run(body())


def test_bad_arguments_raise_and_name_the_problem(make_url, pages):
    async def body():
        async with open_backend(make_url(), layout=pages.LAYOUT) as store:
            with pytest.raises(ValueError, match=r"keys\[1\] must be 16 bytes"):
                await store.batch_put([pages.key(0), b"short"], [b"x", b"y"])
            with pytest.raises(ValueError, match="2 entries for 1 keys"):
                await store.batch_put([pages.key(0)], [b"x", b"y"])
            with pytest.raises(ValueError, match=r"into\[0\] must be writable"):
                await store.batch_get([pages.key(0)], [b"read-only"])
            with pytest.raises(ValueError, match="16 bytes, got str"):
                await store.batch_exists(["0" * 16])

    run(body())


def test_a_buffer_of_the_wrong_size_is_a_length_miss(make_url, pages):
    key = pages.key(3)

    async def body():
        async with open_backend(make_url(), layout=pages.LAYOUT) as store:
            await store.batch_put([key], [pages.page(key, PAGE_BYTES)])
            _, views = pages.pool_views(1, PAGE_BYTES // 2)
            assert await store.batch_get([key], views) == [False]
            assert store.stats().num_corrupt == {"length": 1}

    run(body())


def test_a_page_of_another_layout_is_a_miss(make_url, pages):
    key = pages.key(4)
    foreign = encode_object(key, pages.OTHER_LAYOUT, pages.page(key, PAGE_BYTES))

    async def body():
        async with open_backend(make_url(), layout=pages.LAYOUT) as store:
            assert await store.batch_put_objects([key], [foreign]) == [True]
            pool, views = pages.pool_views(1, PAGE_BYTES)
            assert await store.batch_get([key], views) == [False]
            assert store.stats().num_corrupt == {"layout": 1}

    run(body())


def _flip(blob: bytes, offset: int) -> bytes:
    out = bytearray(blob)
    out[offset] ^= 0x40
    return bytes(out)


# How a stored object is damaged, and the reason a read must give. Stored through
# batch_put_objects(verify=False), so every backend's own read path must catch it.
DAMAGE = {
    "payload_byte": (lambda blob, other: _flip(blob, len(blob) - 100), CorruptReason.CHECKSUM),
    "layout_byte": (lambda blob, other: _flip(blob, 60), CorruptReason.LAYOUT),
    "checksum_byte": (lambda blob, other: _flip(blob, 50), CorruptReason.CHECKSUM),
    "truncated": (lambda blob, other: blob[:-10], CorruptReason.TRUNCATED),
    "extended": (lambda blob, other: blob + b"\0", CorruptReason.LENGTH),
    "other_key": (lambda blob, other: other, CorruptReason.KEY),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_object_is_a_miss_counted_by_reason(make_url, pages, damage, request):
    key, neighbour = pages.key(5), pages.key(6)
    payload = pages.page(key, PAGE_BYTES)
    blob = encode_object(key, pages.LAYOUT, payload)
    neighbours_blob = encode_object(neighbour, pages.LAYOUT, payload)
    make_damage, reason = DAMAGE[damage]
    checks_puts = request.node.callspec.params["make_url"] in VERIFIES_PUTS_ITSELF

    async def body():
        async with open_backend(make_url(), layout=pages.LAYOUT) as store:
            bad = make_damage(blob, neighbours_blob)
            stored = await store.batch_put_objects([key], [bad], verify=False)
            pool, views = pages.pool_views(1, PAGE_BYTES)
            assert await store.batch_get([key], views) == [False]
            if checks_puts:  # refused on arrival, so never stored: a plain miss on read
                assert stored == [False]
                assert store.stats().num_put_rejected == 1
            else:
                assert stored == [True]
                assert store.stats().num_corrupt == {reason.value: 1}
            assert store.stats().num_misses == 1
            assert await store.batch_get_objects([key]) == [None]
            # A good write heals the key.
            assert await store.batch_put([key], [payload]) == [True]
            assert await store.batch_get([key], views) == [True]
            assert bytes(pool) == payload

    run(body())


def _pieces(buffer: bytearray, sizes: list[int], gap: int = 40) -> list[memoryview]:
    """Views of `buffer` of `sizes` bytes, `gap` bytes apart: a page scattered over a pool
    (one piece per layer), whose gaps are other pages' bytes."""
    view, out, at = memoryview(buffer), [], gap
    for size in sizes:
        out.append(view[at : at + size])
        at += size + gap
    return out


PIECE_SIZES = [1000, 7, 1024, 0, 2065]  # 4096 bytes: uneven, and one piece empty


def test_a_page_in_pieces_is_the_page_joined(make_url, pages):
    """A page given as its pieces is stored as the one object of the page joined, and read
    back into pieces (or whole) bitwise; the gaps between pieces are never written."""
    keys = [pages.key(i) for i in range(3)]
    data = [pages.page(k, PAGE_BYTES) for k in keys]

    async def body():
        async with open_backend(make_url(), layout=pages.LAYOUT) as store:
            source = bytearray(b"\xee" * 3 * (PAGE_BYTES + 6 * 40))
            width = PAGE_BYTES + 6 * 40
            scattered = [
                _pieces(memoryview(source)[i * width : (i + 1) * width], PIECE_SIZES)
                for i in range(3)
            ]
            for piece_list, page in zip(scattered, data, strict=True):
                _fill(piece_list, page)
            assert await store.batch_put(keys, scattered) == [True] * 3
            assert await store.batch_get_objects(keys[:1]) == [
                encode_object(keys[0], pages.LAYOUT, data[0])
            ]
            before = store.stats().read_bytes
            target = bytearray(b"\x11" * len(source))
            into = [
                _pieces(memoryview(target)[i * width : (i + 1) * width], PIECE_SIZES)
                for i in range(3)
            ]
            assert await store.batch_get(keys, into) == [True] * 3
            assert [b"".join(piece_list) for piece_list in into] == data
            gaps = bytes(b for i, b in enumerate(target) if _in_gap(i % width))
            assert set(gaps) == {0x11}  # only the pieces were written
            assert store.stats().read_bytes - before == 3 * PAGE_BYTES

    run(body())


def test_a_damaged_object_read_into_pieces_is_a_counted_miss(make_url, pages, request):
    """The pieces of a page whose object fails its check are not to be trusted: False, the
    reason counted; its neighbour in the same batch lands whole."""
    if request.node.callspec.params["make_url"] in VERIFIES_PUTS_ITSELF:
        pytest.skip("the daemon refuses a damaged object on its way in")
    key, neighbour = pages.key(5), pages.key(6)
    payload = pages.page(key, PAGE_BYTES)
    bad = _flip(encode_object(key, pages.LAYOUT, payload), 56 + len(pages.LAYOUT) + 2000)

    async def body():
        async with open_backend(make_url(), layout=pages.LAYOUT) as store:
            assert await store.batch_put_objects([key], [bad], verify=False) == [True]
            assert await store.batch_put([neighbour], [payload]) == [True]
            target = bytearray(2 * (PAGE_BYTES + 6 * 40))
            into = [_pieces(memoryview(target)[: len(target) // 2], PIECE_SIZES),
                    _pieces(memoryview(target)[len(target) // 2 :], PIECE_SIZES)]  # fmt: skip
            assert await store.batch_get([key, neighbour], into) == [False, True]
            assert b"".join(into[1]) == payload
            stats = store.stats()
            assert stats.num_corrupt == {CorruptReason.CHECKSUM.value: 1}
            assert (stats.num_hits, stats.num_misses) == (1, 1)

    run(body())


def _fill(pieces: list[memoryview], page: bytes) -> None:
    at = 0
    for piece in pieces:
        piece[:] = page[at : at + len(piece)]
        at += len(piece)


def _in_gap(offset: int, gap: int = 40) -> bool:
    at = 0
    for size in PIECE_SIZES:
        if offset < at + gap:
            return True
        at += gap + size
        if offset < at:
            return False
    return True


def test_put_objects_verifies_and_refuses_only_the_bad_one(make_url, pages):
    keys = [pages.key(i) for i in range(3)]
    blobs = [encode_object(k, pages.LAYOUT, pages.page(k, 512)) for k in keys]
    blobs[1] = _flip(blobs[1], len(blobs[1]) - 1)

    async def body():
        async with open_backend(make_url(), layout=None) as store:
            assert await store.batch_put_objects(keys, blobs) == [True, False, True]
            stats = store.stats()
            assert stats.num_corrupt == {"checksum": 1}
            assert stats.num_put_rejected == 1
            assert await store.batch_get_objects(keys) == [blobs[0], None, blobs[2]]

    run(body())


def test_objects_of_any_layout_round_trip_without_a_layout(make_url, pages):
    keys = [pages.key(i) for i in range(4)]
    layouts = [pages.LAYOUT, pages.OTHER_LAYOUT, "opaque", ""]
    blobs = [
        encode_object(k, layout, pages.page(k, 1000))
        for k, layout in zip(keys, layouts, strict=True)
    ]

    async def body():
        async with open_backend(make_url(), layout=None) as store:
            assert await store.batch_put_objects(keys, blobs) == [True] * 4
            assert await store.batch_get_objects(keys) == blobs
            with pytest.raises(ValueError, match="needs the backend opened with a layout"):
                await store.batch_get(keys[:1], [bytearray(1000)])

    run(body())


def test_lz4_is_kept_only_when_it_saves_space(make_url, pages):
    compressible = bytes(range(64)) * (PAGE_BYTES // 64)
    noise = pages.page(pages.key(0), PAGE_BYTES)
    keys = [pages.key(10), pages.key(11)]

    async def body():
        async with open_backend(make_url(compression="lz4"), layout=pages.LAYOUT) as store:
            assert await store.batch_put(keys, [compressible, noise]) == [True, True]
            pool, views = pages.pool_views(2, PAGE_BYTES)
            assert await store.batch_get(keys, views) == [True, True]
            assert bytes(pool) == compressible + noise
            small, large = await store.batch_get_objects(keys)
            assert len(small) < PAGE_BYTES // 4
            assert len(large) > PAGE_BYTES

    run(body())


def test_concurrent_calls_on_one_backend(make_url, pages):
    async def body():
        async with open_backend(make_url(), layout=pages.LAYOUT) as store:

            async def worker(w: int) -> bytes:
                keys = [pages.key(i, salt=f"w{w}") for i in range(8)]
                await store.batch_put(keys, [pages.page(k, 1024) for k in keys])
                pool, views = pages.pool_views(8, 1024)
                assert await store.batch_get(keys, views) == [True] * 8
                return bytes(pool) == b"".join(pages.page(k, 1024) for k in keys)

            assert all(await asyncio.gather(*(worker(w) for w in range(8))))
            assert store.stats().num_hits == 64

    run(body())


def test_buffers_of_any_item_format(make_url, pages):
    key = pages.key(12)
    page = array.array("H", range(PAGE_BYTES // 2))  # 2-byte items

    async def body():
        async with open_backend(make_url(), layout=pages.LAYOUT) as store:
            assert await store.batch_put([key], [page]) == [True]
            into = array.array("H", bytes(PAGE_BYTES))
            assert await store.batch_get([key], [into]) == [True]
            assert into == page

    run(body())


def test_sync_backend_blocks_on_the_same_calls(make_url, pages):
    keys = [pages.key(i) for i in range(4)]
    data = [pages.page(k, 777) for k in keys]
    with SyncBackend.open(make_url(), layout=pages.LAYOUT) as store:
        store.connect()
        assert store.batch_put(keys, data) == [True] * 4
        assert store.batch_exists(keys) == 4
        pool, views = pages.pool_views(4, 777)
        assert store.batch_get(keys, views) == [True] * 4
        assert bytes(pool) == b"".join(data)
        assert store.delete(keys[:1]) == 1
        assert store.stats().num_hits == 4
    with pytest.raises(BackendClosedError, match="closed"):
        store.batch_exists(keys)


def test_a_closed_backend_refuses_calls(make_url, pages):
    async def body():
        store = open_backend(make_url(), layout=pages.LAYOUT)
        await store.batch_put([pages.key(0)], [b"x" * 10])
        await store.close()
        await store.close()  # idempotent
        with pytest.raises(BackendClosedError, match="closed"):
            await store.batch_exists([pages.key(0)])

    run(body())
