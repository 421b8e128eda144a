"""memory:// specifics: LRU by bytes, and the spill the cache-server daemon uses."""

from __future__ import annotations

import asyncio

from storage_backends import encode_object, open_backend
from storage_backends.memory_store import MemoryBackend, MemoryOptions
from storage_backends.objects import header_size

PAGE_BYTES = 1000


def run(coro):
    return asyncio.run(coro)


def object_bytes(pages) -> int:
    return header_size(pages.LAYOUT) + PAGE_BYTES


def test_lru_by_bytes(pages):
    keys = [pages.key(i) for i in range(5)]
    capacity = 3 * object_bytes(pages)

    async def body():
        async with open_backend(f"memory://?capacity={capacity}", layout=pages.LAYOUT) as store:
            await store.batch_put(keys[:3], [pages.page(k, PAGE_BYTES) for k in keys[:3]])
            _, views = pages.pool_views(1, PAGE_BYTES)
            assert await store.batch_get(keys[:1], views) == [True]  # keys[0] becomes recent
            await store.batch_put(keys[3:4], [pages.page(keys[3], PAGE_BYTES)])
            present = [await store.batch_exists([k]) for k in keys[:4]]
            assert present == [1, 0, 1, 1]
            stats = store.stats()
            assert (stats.num_objects, stats.stored_bytes) == (3, capacity)
            assert stats.num_evictions == 1

    run(body())


def test_a_page_larger_than_memory_is_rejected(pages):
    async def body():
        async with open_backend("memory://?capacity=100", layout=pages.LAYOUT) as store:
            assert await store.batch_put([pages.key(0)], [bytes(PAGE_BYTES)]) == [False]
            assert store.stats().num_put_rejected == 1
            assert store.stats().num_objects == 0

    run(body())


def test_the_store_never_keeps_the_callers_buffer(pages):
    key = pages.key(0)
    page = bytearray(pages.page(key, PAGE_BYTES))

    async def body():
        async with open_backend("memory://", layout=pages.LAYOUT) as store:
            await store.batch_put([key], [page])
            page[:] = bytes(PAGE_BYTES)  # the caller reuses its L2 page
            _, views = pages.pool_views(1, PAGE_BYTES)
            assert await store.batch_get([key], views) == [True]
            assert bytes(views[0]) == pages.page(key, PAGE_BYTES)

    run(body())


def _spilling(tmp_path, pages, num_resident: int) -> MemoryBackend:
    spill = open_backend(f"file://{tmp_path / 'spill'}?capacity=1MiB")
    options = MemoryOptions(capacity_bytes=num_resident * object_bytes(pages))
    return MemoryBackend(options, None, spill=spill)


def test_evicted_objects_spill_and_come_back(tmp_path, pages):
    keys = [pages.key(i) for i in range(6)]
    blobs = [encode_object(k, pages.LAYOUT, pages.page(k, PAGE_BYTES)) for k in keys]

    async def body():
        async with _spilling(tmp_path, pages, num_resident=2) as store:
            assert await store.batch_put_objects(keys, blobs) == [True] * 6
            assert store.stats().num_objects == 2
            assert store.spill.stats().num_puts == 4  # the four evicted went to the spill
            assert await store.batch_exists(keys) == 6  # resident or spilled, in order
            assert await store.batch_get_objects(keys[:3]) == blobs[:3]  # read back, promoted
            assert await store.delete(keys[5:]) == 1
            assert await store.batch_exists(keys) == 5
            assert await store.flush_to_spill() == 0  # the resident ones came from it
            fresh_key = pages.key(99)
            fresh = encode_object(fresh_key, pages.LAYOUT, bytes(PAGE_BYTES))
            await store.batch_put_objects([fresh_key], [fresh])
            assert await store.flush_to_spill() == 1  # graceful shutdown: only memory had it

        async with _spilling(tmp_path, pages, num_resident=2) as restarted:
            assert await restarted.batch_get_objects(keys) == blobs[:5] + [None]
            assert await restarted.batch_get_objects([fresh_key]) == [fresh]

    run(body())


def test_exists_in_order_across_memory_and_spill(tmp_path, pages):
    keys = [pages.key(i) for i in range(4)]
    blobs = [encode_object(k, pages.LAYOUT, bytes(PAGE_BYTES)) for k in keys]

    async def body():
        async with _spilling(tmp_path, pages, num_resident=1) as store:
            await store.batch_put_objects(keys[:2], blobs[:2])  # keys[0] spilled, [1] resident
            await store.spill.delete(keys[:1])
            assert await store.batch_exists(keys[1:2]) == 1
            assert await store.batch_exists(keys[:2]) == 0  # keys[0] is gone everywhere
            await store.batch_put_objects(keys[3:4], blobs[3:4])  # keys[1] spilled
            assert await store.batch_exists([keys[1], keys[3], keys[2]]) == 2

    run(body())


def test_reads_skip_the_checksum_only_when_asked(pages):
    """verify=False (the daemon's memory reads) hands out what was stored; the default
    checks it and refuses a damaged object."""
    key = pages.key(0)
    blob = bytearray(encode_object(key, pages.LAYOUT, pages.page(key, PAGE_BYTES)))
    blob[-1] ^= 0xFF  # one payload bit flipped: its checksum no longer matches

    async def body():
        async with open_backend("memory://") as store:
            assert await store.batch_put_objects([key], [bytes(blob)], verify=False) == [True]
            assert await store.batch_get_objects([key]) == [None]
            assert store.stats().num_corrupt == {"checksum": 1}
            assert await store.batch_get_objects([key], verify=False) == [bytes(blob)]
            assert store.stats().num_corrupt == {"checksum": 1}

    run(body())
