"""memory:// over a spill that is slow or refuses (a hostile fake): the spill write of evicted
objects belongs to the store, not to the call that evicted them."""

from __future__ import annotations

import asyncio
import contextlib

from storage_backends import encode_object
from storage_backends.base import PageStatus
from storage_backends.memory_store import MemoryBackend, MemoryOptions

LAYOUT = "test;spill"


class GatedSpill(MemoryBackend):
    """A spill whose writes wait for `gate` (a hung disk until it is set); `refuse`: the
    writes that get through are refused (a full spill)."""

    def __init__(self, *, refuse: bool = False) -> None:
        super().__init__(MemoryOptions(capacity_bytes=1 << 30, timeout_s=60), None)
        self.gate = asyncio.Event()
        self.refuse = refuse

    async def _store(self, keys, objects):
        await self.gate.wait()
        if self.refuse:
            return [PageStatus.REJECTED] * len(keys)
        return await super()._store(keys, objects)


def _objects(name: str, count: int, nbytes: int = 1000) -> tuple[list[bytes], list[bytes]]:
    keys = [name.encode().ljust(15, b".") + bytes([i]) for i in range(count)]
    return keys, [encode_object(k, LAYOUT, bytes([i]) * nbytes) for i, k in enumerate(keys)]


def _store_over(spill: GatedSpill, capacity_objects: int) -> MemoryBackend:
    _, (blob,) = _objects("size", 1)
    options = MemoryOptions(capacity_bytes=capacity_objects * len(blob), timeout_s=60)
    return MemoryBackend(options, None, spill=spill)


def test_a_cancelled_put_does_not_cancel_the_spill_write_of_what_it_evicted():
    async def body():
        spill = GatedSpill()
        store = _store_over(spill, 2)
        old_keys, old = _objects("old", 2)
        assert await store.batch_put_objects(old_keys, old) == [True, True]
        new_keys, new = _objects("new", 2)
        put = asyncio.ensure_future(store.batch_put_objects(new_keys, new))
        await asyncio.sleep(0.05)  # evicted both old objects; their write waits on the gate
        put.cancel()  # the caller's deadline
        with contextlib.suppress(asyncio.CancelledError):
            await put
        # Still readable while on their way to the spill, and counted as present.
        assert await store.batch_get_objects(old_keys, verify=False) == old
        assert await store.batch_exists(old_keys) == 2
        spill.gate.set()
        await store.wait_spilled()
        assert await spill.batch_get_objects(old_keys) == old
        assert store.num_spill_dropped == 0 and store.spilling_bytes == 0
        await store.close()

    asyncio.run(body())


def test_a_delete_waits_for_the_spill_write_so_nothing_comes_back():
    async def body():
        spill = GatedSpill()
        store = _store_over(spill, 1)
        keys, blobs = _objects("del", 2)
        await store.batch_put_objects(keys[:1], blobs[:1])
        put = asyncio.ensure_future(store.batch_put_objects(keys[1:], blobs[1:]))
        await asyncio.sleep(0.05)
        delete = asyncio.ensure_future(store.delete(keys[:1]))
        await asyncio.sleep(0.05)
        assert not delete.done()  # it waits for the write that would bring keys[0] back
        spill.gate.set()
        assert await delete == 1
        await put
        assert await store.batch_exists(keys[:1]) == 0
        assert await spill.batch_exists(keys[:1]) == 0
        await store.close()

    asyncio.run(body())


def test_evicted_objects_a_full_spill_refuses_are_counted():
    async def body():
        spill = GatedSpill(refuse=True)
        spill.gate.set()
        store = _store_over(spill, 2)
        keys, blobs = _objects("full", 5)
        assert await store.batch_put_objects(keys, blobs) == [True] * 5
        assert store.num_spill_dropped == 3
        assert await store.batch_exists(keys[:3]) == 0  # gone, and said so
        await store.close()

    asyncio.run(body())


def test_reserved_bytes_make_stored_objects_give_way():
    async def body():
        spill = GatedSpill()
        spill.gate.set()
        store = _store_over(spill, 4)
        keys, blobs = _objects("room", 4)
        await store.batch_put_objects(keys, blobs)
        store.reserved_bytes = 2 * len(blobs[0])  # e.g. pages still arriving for the owner
        await store.make_room()
        assert store.stats().num_objects == 2 and store.stats().num_evictions == 2
        assert await spill.batch_get_objects(keys[:2]) == blobs[:2]  # evicted, not lost
        await store.close()

    asyncio.run(body())


def test_inserts_wait_while_the_spill_is_far_behind():
    async def body():
        spill = GatedSpill()
        store = _store_over(spill, 8)
        keys, blobs = _objects("behind", 16)
        await store.batch_put_objects(keys[:8], blobs[:8])
        first = asyncio.ensure_future(store.batch_put_objects(keys[8:11], blobs[8:11]))
        await asyncio.sleep(0.05)  # 3 evicted, waiting on the gate: past a quarter of memory
        first.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await first
        assert store.spilling_bytes == 3 * len(blobs[0])
        second = asyncio.ensure_future(store.batch_put_objects(keys[11:], blobs[11:]))
        await asyncio.sleep(0.05)
        assert store.spilling_bytes == 3 * len(blobs[0])  # it waits rather than evict more
        spill.gate.set()
        assert await second == [True] * 5
        await store.wait_spilled()
        assert store.spilling_bytes == 0 and store.num_spill_dropped == 0
        assert await spill.batch_exists(keys[:8]) == 8
        await store.close()

    asyncio.run(body())
