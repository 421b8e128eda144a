"""`memory://?capacity=8GiB`: objects in this process, least recently used evicted by bytes.

For tests, and as the store of the cache-server daemon. Given a `spill` backend (the daemon
passes a `file://` one), objects evicted from memory are written there, read back on a miss
(and promoted again), and so survive a restart of the process.

The spill write of evicted objects belongs to this store, not to the call that evicted them:
it runs as a task of its own that no caller's cancellation or deadline stops (the call waits
for it, shielded, so a put is answered once its evictions are in the spill). Until it is done
the evicted objects stay readable here. An evicted object the spill did not take (the spill
is full, or failed) is gone: it is counted in `num_spill_dropped` and warned about.

Objects are kept as one immutable `bytes` each: a read hands that object out without a copy,
a write copies the caller's page once (the caller's buffer is never kept).
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

from .base import Fetched, PageStatus, StorageBackend
from .errors import BackendConfigError
from .objects import FramedObject
from .options import BackendOptions, check_range, options_from_query, url_option
from .stats import Usage


@dataclass(frozen=True)
class MemoryOptions(BackendOptions):
    capacity_bytes: int = url_option(
        "capacity", "size", 1 << 30, doc="bytes held, headers included"
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        check_range("capacity", self.capacity_bytes, low=1)


class MemoryBackend(StorageBackend):
    scheme = "memory"
    transient_errors = ()  # nothing here can fail; a spill backend turns its own faults into misses

    def __init__(
        self,
        options: MemoryOptions,
        layout: str | None = None,
        *,
        name: str = "",
        spill: StorageBackend | None = None,
    ) -> None:
        """`spill` (optional) receives evicted objects; it is closed with this backend."""
        super().__init__(options, layout, name=name)
        self.options: MemoryOptions = options
        self.spill = spill
        self._objects: OrderedDict[bytes, bytes] = OrderedDict()  # oldest first
        self._stored_bytes = 0
        self._num_evictions = 0
        self._in_spill: set[bytes] = set()  # resident keys whose spill copy is current
        # Evicted objects on their way to the spill, readable until the write is done.
        self._spilling: dict[bytes, tuple[bytes, asyncio.Task]] = {}
        self._spill_tasks: set[asyncio.Task] = set()
        self._spilling_bytes = 0
        self.num_spill_dropped = 0  # evicted objects the spill did not take: lost
        # Bytes the owner holds for this store elsewhere (the daemon: pages still arriving);
        # stored objects are kept to the capacity minus this.
        self.reserved_bytes = 0
        # Told the keys of objects that leave this store for good (evicted with no spill to
        # take them, or dropped by the spill); the daemon publishes them as L3 removals.
        self.on_dropped: Callable[[list[bytes]], None] | None = None

    @property
    def num_unspilled(self) -> int:
        """Objects held here that the spill does not hold (yet): what a crash would lose."""
        return sum(key not in self._in_spill for key in self._objects) + len(self._spilling)

    @property
    def spilling_bytes(self) -> int:
        """Bytes of evicted objects still being written to the spill (held beyond capacity:
        at most a quarter of it before inserts wait, plus one batch's evictions)."""
        return self._spilling_bytes

    # -- primitives -------------------------------------------------------------------------

    async def _open(self) -> None:
        if self.spill is not None:
            await self.spill.connect()

    async def _close(self) -> None:
        await self.wait_spilled()
        if self.spill is not None:
            await self.spill.close()

    async def _reconnect(self) -> None:
        """Nothing to reconnect: the spill backend reconnects on its own."""

    async def _exists(self, keys: list[bytes]) -> int:
        resident = [key in self._objects or key in self._spilling for key in keys]
        if all(resident) or self.spill is None:
            return resident.index(False) if False in resident else len(keys)
        # Keys not in memory may be in the spill: ask it about those, in order.
        spilled = await self.spill.batch_exists(
            [k for k, r in zip(keys, resident, strict=True) if not r]
        )
        count = 0
        for r in resident:
            if not r:
                if spilled == 0:
                    break
                spilled -= 1
            count += 1
        return count

    async def _fetch(self, keys: list[bytes], sizes: list[int] | None) -> list[Fetched]:
        found: list[Fetched] = []
        missing: list[int] = []
        for i, key in enumerate(keys):
            blob = self._objects.get(key)
            if blob is not None:
                self._objects.move_to_end(key)
            elif key in self._spilling:
                blob = self._spilling[key][0]  # evicted, not yet in the spill
            else:
                missing.append(i)
            found.append(blob)
        if missing and self.spill is not None:
            loaded = await self.spill.batch_get_objects([keys[i] for i in missing])
            promoted = [
                (keys[i], blob) for i, blob in zip(missing, loaded, strict=True) if blob is not None
            ]
            for i, blob in zip(missing, loaded, strict=True):
                found[i] = blob
            await self._insert(promoted, already_spilled=True)
        return found

    async def _store(self, keys: list[bytes], objects: list[FramedObject]) -> list[PageStatus]:
        statuses = []
        accepted = []
        for key, obj in zip(keys, objects, strict=True):
            if obj.nbytes > self.options.capacity_bytes:
                statuses.append(PageStatus.REJECTED)
                continue
            accepted.append((key, b"".join((obj.header, obj.payload))))
            statuses.append(PageStatus.STORED)
        await self._insert(accepted, already_spilled=False)
        return statuses

    async def _delete(self, keys: list[bytes]) -> int:
        # A spill write in flight would bring a deleted key back: let it land, then delete.
        writes = {self._spilling[key][1] for key in keys if key in self._spilling}
        if writes:
            await asyncio.wait(writes)  # cancelling this wait leaves the writes running
        removed = 0
        known_in_spill = 0
        for key in keys:
            blob = self._objects.pop(key, None)
            if blob is not None:
                self._stored_bytes -= len(blob)
                removed += 1
                known_in_spill += key in self._in_spill
                self._in_spill.discard(key)
        if self.spill is not None:
            removed += await self.spill.delete(keys) - known_in_spill
        return removed

    def _usage(self) -> Usage:
        return Usage(
            len(self._objects), self._stored_bytes, self.options.capacity_bytes, self._num_evictions
        )

    # -- spill ------------------------------------------------------------------------------

    async def flush_to_spill(self) -> int:
        """Write every resident object the spill does not hold yet (graceful shutdown).

        Returns how many the spill accepted; objects stay resident.
        """
        self._check_open()
        if self.spill is None:
            return 0
        await self.wait_spilled()
        pending = [(k, b) for k, b in self._objects.items() if k not in self._in_spill]
        if not pending:
            return 0
        keys, blobs = zip(*pending, strict=True)
        stored = await self.spill.batch_put_objects(list(keys), list(blobs), verify=False)
        self._in_spill.update(k for k, ok in zip(keys, stored, strict=True) if ok)
        return sum(stored)

    async def _insert(self, items: list[tuple[bytes, bytes]], *, already_spilled: bool) -> None:
        """Insert objects, evicting the least recently used; evicted objects go to the spill."""
        while self._spilling_bytes > self.options.capacity_bytes // 4 and self._spill_tasks:
            # The spill is behind: let it catch up before evicting more into it.
            await asyncio.wait(set(self._spill_tasks), return_when=asyncio.FIRST_COMPLETED)
        evicted: list[tuple[bytes, bytes]] = []
        for key, blob in items:
            old = self._objects.pop(key, None)
            if old is not None:
                self._stored_bytes -= len(old)
            self._evict_for(len(blob), evicted)
            self._objects[key] = blob
            self._stored_bytes += len(blob)
            if already_spilled:
                self._in_spill.add(key)
            else:
                self._in_spill.discard(key)
        if evicted and self.spill is not None:
            await asyncio.shield(self._spill_evicted(evicted))

    async def make_room(self) -> None:
        """Evict until the stored objects fit the capacity less `reserved_bytes`."""
        evicted: list[tuple[bytes, bytes]] = []
        self._evict_for(0, evicted)
        if evicted and self.spill is not None:
            await asyncio.shield(self._spill_evicted(evicted))

    def _evict_for(self, nbytes: int, evicted: list[tuple[bytes, bytes]]) -> None:
        """Evict the least recently used until `nbytes` more fit; those the spill does not
        hold yet are appended to `evicted`."""
        capacity = self.options.capacity_bytes - self.reserved_bytes
        dropped: list[bytes] = []
        while self._objects and self._stored_bytes + nbytes > capacity:
            victim, victim_blob = self._objects.popitem(last=False)
            self._stored_bytes -= len(victim_blob)
            self._num_evictions += 1
            if victim in self._in_spill:
                self._in_spill.discard(victim)
            elif self.spill is not None:
                evicted.append((victim, victim_blob))
            else:
                dropped.append(victim)
        if dropped and self.on_dropped is not None:
            self.on_dropped(dropped)

    def _spill_evicted(self, evicted: list[tuple[bytes, bytes]]) -> asyncio.Task:
        """Start writing evicted objects to the spill, as a task this store owns."""
        task = asyncio.get_running_loop().create_task(self._write_evicted(evicted))
        self._spill_tasks.add(task)
        task.add_done_callback(self._spill_tasks.discard)
        for key, blob in evicted:
            earlier = self._spilling.get(key)
            if earlier is not None:
                self._spilling_bytes -= len(earlier[0])
            self._spilling[key] = (blob, task)
            self._spilling_bytes += len(blob)
        return task

    async def _write_evicted(self, evicted: list[tuple[bytes, bytes]]) -> None:
        keys, blobs = zip(*evicted, strict=True)
        stored = [False] * len(keys)
        try:
            stored = await self.spill.batch_put_objects(list(keys), list(blobs), verify=False)
        finally:  # cancelled only when the store is torn down: what was not written is lost
            for key, blob in zip(keys, blobs, strict=True):
                if self._spilling.get(key, (None,))[0] is blob:
                    del self._spilling[key]
                    self._spilling_bytes -= len(blob)
            dropped = len(keys) - sum(stored)
            if dropped and self.on_dropped is not None:
                self.on_dropped([key for key, ok in zip(keys, stored, strict=True) if not ok])
            if dropped:
                self.num_spill_dropped += dropped
                self._warnings.warn(
                    "spill_dropped",
                    f"{dropped} evicted objects were not taken by the spill and are lost "
                    f"({self.num_spill_dropped} so far)",
                )

    async def wait_spilled(self) -> None:
        """Wait until every spill write started so far is done (cancelling the wait leaves
        them running)."""
        while self._spill_tasks:
            await asyncio.wait(set(self._spill_tasks))


def open_url(url: str, *, layout: str | None = None, name: str = "") -> MemoryBackend:
    """`memory://?capacity=8GiB&timeout=1s&compression=lz4` (no host, no path)."""
    parts = urlsplit(url)
    if parts.netloc or parts.path not in ("", "/"):
        raise BackendConfigError(f"{url}: memory:// takes no host or path, only ?options")
    options = options_from_query(MemoryOptions, parts.query, url=name or url)
    return MemoryBackend(options, layout, name=name or url)
