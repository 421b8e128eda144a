"""The daemon's pages: one `memory://` store per namespace, optionally over a spill.

Namespaces are isolated by construction: each has its own memory store, with its quota (or an
equal share of the capacity quotas leave) as its LRU capacity, and its own spill: a folder
`<spill_dir>/<namespace>/` holding a share of the spill capacity in the same proportion, or,
with `spill_url` (a shared store such as Mooncake Store or Redis, whose capacity is its own),
the prefix `<prefix><namespace>/` in it. A tenant can only ever evict its own pages from
memory, and no key of one can reach another's pages.

What an acknowledged put promises depends on the spill mode:

- no spill: the page is in memory until evicted; a restart loses it.
- `evict` (default): the page is in memory; evicted pages are written to the spill by a
  task the memory store owns, which no client's deadline or cancellation stops (the put
  that evicted them is answered once they are written; until then they stay readable), a
  graceful shutdown writes every page still in memory, and a read that misses in memory
  reads the spill and promotes the page. An evicted page the spill does not take (full, or
  failing) is counted (`num_spill_dropped`). After a crash (kill -9, OOM) pages that were
  only in memory are gone; everything spilled before the crash is back after a restart.
- `write-through`: the page was written to the spill (to a temporary file renamed into place;
  fsynced with `spill_fsync`) before the ack; memory is a cache in front of it. After a crash
  every acknowledged page is back (on power loss too, with fsync), unless the spill's own
  capacity evicted it.

Objects are verified (key and checksum) before they are stored, and again whenever read
from the spill; a damaged file in the spill is a miss, never data, counted in the spill's
`num_corrupt`. Reads from memory are not
checksummed again: those objects never left the process, and the client verifies each page.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence
from typing import NamedTuple
from urllib.parse import parse_qsl, urlencode

from storage_backends import BackendConfigError, StorageBackend, open_backend, verify_object
from storage_backends.buffers import Buffer
from storage_backends.file_store import FileBackend, FileOptions
from storage_backends.memory_store import MemoryBackend, MemoryOptions
from storage_backends.options import redact_url

from .config import ServerConfig


class PutOutcome(NamedTuple):
    stored: bool
    status: str  # "stored", "rejected", "corrupt", "error"
    reason: str  # why not stored ("" when stored)
    check: str = ""  # "corrupt": the check it failed (a CorruptReason value)


class NamespaceStore:
    """The pages of one namespace. All calls run on the daemon's event loop."""

    def __init__(
        self,
        name: str,
        capacity_bytes: int,
        spill: FileBackend | None,
        *,
        write_through: bool,
        timeout_s: float,
    ) -> None:
        self.name = name
        self.spill = spill
        self.write_through = write_through and spill is not None
        # In write-through mode the spill already holds every page: memory spills nothing.
        memory_spill = None if self.write_through else spill
        # The memory store's deadline covers a spill write of its evicted pages.
        options = MemoryOptions(capacity_bytes=capacity_bytes, timeout_s=2 * timeout_s + 1)
        self.memory = MemoryBackend(options, None, name=f"memory:{name}", spill=memory_spill)
        self.capacity_bytes = capacity_bytes
        self.in_flight_bytes = 0  # held by unfinished BatchPut streams (charged to the quota)
        self.num_spill_timeouts = 0  # gets and puts whose spill missed the caller's deadline
        self.events = None  # hicache.server.events.DaemonEvents, when the daemon publishes

    def publish_events(self, events) -> None:
        """Report the pages this namespace stores and drops to `events` (DaemonEvents)."""
        self.events = events
        self.memory.on_dropped = events.removed

    async def open(self) -> None:
        await self.memory.connect()
        if self.spill is not None:
            await self.spill.connect()

    async def charge(self, delta_bytes: int) -> bool:
        """Charge (or, negative, release) bytes of unfinished streamed pages to this
        namespace's memory; stored pages make room for them. False (nothing charged) when
        the streams would hold more than the namespace's capacity."""
        if delta_bytes > 0 and self.in_flight_bytes + delta_bytes > self.capacity_bytes:
            return False
        self.in_flight_bytes += delta_bytes
        self.memory.reserved_bytes = self.in_flight_bytes
        if delta_bytes > 0:
            await self.memory.make_room()
        return True

    async def exists(self, keys: Sequence[bytes]) -> int:
        count = await self.memory.batch_exists(keys)
        if count < len(keys) and self.write_through:
            count += await self.spill.batch_exists(keys[count:])
        return count

    async def get(
        self, keys: Sequence[bytes], timeout_s: float | None = None
    ) -> list[bytes | None]:
        """Verified objects (None: absent or refused). Memory first, then the spill.

        Objects in memory were verified on their way in (a put, or a read from the spill) and
        are not checksummed again: every client verifies every page it receives.

        `timeout_s`: the caller's deadline (the gRPC call's time left). A spill that has not
        answered by then (a hung mount) makes these keys misses, counted in
        `num_spill_timeouts`; the reads stuck in it finish or fail on their own, and the
        spill serves again as soon as the mount answers.
        """
        if timeout_s is None or self.spill is None:
            return await self._get(keys)
        try:
            return await asyncio.wait_for(self._get(keys), max(timeout_s, 0.0))
        except asyncio.TimeoutError:
            self.num_spill_timeouts += 1
            return [None] * len(keys)

    async def _get(self, keys: Sequence[bytes]) -> list[bytes | None]:
        blobs = await self.memory.batch_get_objects(keys, verify=False)
        if not self.write_through:
            return blobs  # the memory store reads its own spill on a miss
        missing = [i for i, blob in enumerate(blobs) if blob is None]
        if missing:
            loaded = await self.spill.batch_get_objects([keys[i] for i in missing])
            found = [(keys[i], blob) for i, blob in zip(missing, loaded, strict=True) if blob]
            for i, blob in zip(missing, loaded, strict=True):
                blobs[i] = blob
            if found:  # promote: memory caches what the spill holds
                await self.memory.batch_put_objects(
                    [k for k, _ in found], [b for _, b in found], verify=False
                )
        return blobs

    async def put(
        self, keys: Sequence[bytes], blobs: Sequence[Buffer], timeout_s: float | None = None
    ) -> list[PutOutcome]:
        """Verify each object against its key, then store the good ones (see the module doc
        for what a "stored" outcome promises).

        `timeout_s`: the caller's deadline (the gRPC call's time left). Where storing waits on
        a spill that has not answered by then (a write-through put, or the spill of what a
        put evicts, to a hung mount), those objects are answered "error", never "stored",
        counted in `num_spill_timeouts`; the spill's own writes finish or fail on their own.
        """
        outcomes: list[PutOutcome | None] = []
        good: list[int] = []
        for i, (key, blob) in enumerate(zip(keys, blobs, strict=True)):
            reason = verify_object(blob, key)
            if reason is None:
                good.append(i)
                outcomes.append(None)
            else:
                message = f"the object failed its {reason.value} check"
                outcomes.append(PutOutcome(False, "corrupt", message, reason.value))
        if good:
            good_keys = [keys[i] for i in good]
            good_blobs = [blobs[i] for i in good]
            stored = await self._store_within(good_keys, good_blobs, timeout_s)
            for i, outcome in zip(good, stored, strict=True):
                outcomes[i] = outcome
            if self.events is not None:
                kept = [i for i, outcome in zip(good, stored, strict=True) if outcome.stored]
                self.events.stored([keys[i] for i in kept], [blobs[i] for i in kept])
        return outcomes  # type: ignore[return-value]

    async def _store_within(
        self, keys: list[bytes], blobs: list[Buffer], timeout_s: float | None
    ) -> list[PutOutcome]:
        if timeout_s is None or self.spill is None:
            return await self._store(keys, blobs)
        try:
            return await asyncio.wait_for(self._store(keys, blobs), max(timeout_s, 0.0))
        except asyncio.TimeoutError:
            self.num_spill_timeouts += 1
            why = "the spill did not answer within the call's deadline"
            return [PutOutcome(False, "error", why)] * len(keys)

    async def _store(self, keys: list[bytes], blobs: list[Buffer]) -> list[PutOutcome]:
        if not self.write_through:
            stored = await self.memory.batch_put_objects(keys, blobs, verify=False)
            return [_outcome(ok, "no room: larger than this namespace's capacity") for ok in stored]
        spilled = await self.spill.batch_put_objects(keys, blobs, verify=False)
        durable = [i for i, ok in enumerate(spilled) if ok]
        if durable:
            await self.memory.batch_put_objects(
                [keys[i] for i in durable], [blobs[i] for i in durable], verify=False
            )
        return [_outcome(ok, "the spill did not take it", status="error") for ok in spilled]

    async def delete(self, keys: Sequence[bytes]) -> int:
        # Events name only pages that were held: a delete of keys never stored publishes none.
        held = [k for k in dict.fromkeys(keys) if await self.exists([k])] if self.events else []
        removed = await self.memory.delete(keys)
        if self.write_through:  # memory holds a subset of the spill
            removed = max(removed, await self.spill.delete(keys))
        if held:
            self.events.removed(held)
        return removed

    async def flush(self) -> int:
        """Write what only memory holds to the spill (graceful shutdown); how many pages."""
        if self.spill is None or self.write_through:
            return 0
        return await self.memory.flush_to_spill()

    @property
    def num_unflushed(self) -> int:
        """Pages only memory holds (a shutdown loses them unless `flush` writes them)."""
        if self.spill is None or self.write_through:
            return 0
        return self.memory.num_unspilled

    async def close(self) -> None:
        await self.memory.close()
        if self.spill is not None:
            await self.spill.close()  # idempotent: the memory store may have closed it


def _outcome(ok: bool, reason: str, *, status: str = "rejected") -> PutOutcome:
    return PutOutcome(True, "stored", "") if ok else PutOutcome(False, status, reason)


class Store:
    """Every namespace of the daemon, by name."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.namespaces: dict[str, NamespaceStore] = {}
        capacities = config.namespace_capacities()
        for name, capacity in capacities.items():
            spill = None
            if config.spill_url is not None:
                spill = _shared_spill(config, name)
            elif config.spill_dir is not None:
                share = config.spill_capacity_bytes * capacity // config.capacity_bytes
                spill = _spill_backend(config, name, max(share, 1))
            self.namespaces[name] = NamespaceStore(
                name,
                capacity,
                spill,
                write_through=config.spill_mode == "write-through",
                timeout_s=config.spill_timeout_s,
            )

    @property
    def spill_mode(self) -> str:
        if self.config.spill_dir is None and self.config.spill_url is None:
            return "none"
        return self.config.spill_mode

    async def open(self) -> None:
        for namespace in self.namespaces.values():
            await namespace.open()

    async def flush(self) -> int:
        return sum([await namespace.flush() for namespace in self.namespaces.values()])

    @property
    def num_unflushed(self) -> int:
        return sum(namespace.num_unflushed for namespace in self.namespaces.values())

    async def close(self) -> None:
        for namespace in self.namespaces.values():
            await namespace.close()

    def backends(self, name: str) -> list[StorageBackend]:
        """The stores behind a namespace (memory, then the spill), for stats."""
        namespace = self.namespaces[name]
        return [namespace.memory] + ([namespace.spill] if namespace.spill else [])


def _shared_spill(config: ServerConfig, name: str) -> StorageBackend:
    """The spill of namespace `name` in the store `spill_url` names: its prefix (the URL's,
    else "hicache:") followed by `<name>/`; the URL's timeout, else `spill_timeout_s`."""
    base, _, query = config.spill_url.partition("?")
    pairs = parse_qsl(query, keep_blank_values=True)
    given = dict(pairs)
    if len(given) != len(pairs):
        raise ValueError(f"--spill-url: an option is given twice in {redact_url(config.spill_url)}")
    given["prefix"] = f"{given.get('prefix', 'hicache:')}{name}/"
    given.setdefault("timeout", f"{config.spill_timeout_s}s")
    try:
        return open_backend(f"{base}?{urlencode(given)}", layout=None)
    except BackendConfigError as exc:
        raise ValueError(f"--spill-url: {exc}") from None


def _spill_backend(config: ServerConfig, name: str, capacity_bytes: int) -> FileBackend:
    path = os.path.join(config.spill_dir, name)
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"--spill-dir: cannot make {path}: {exc.strerror}") from None
    options = FileOptions(
        path=path,
        capacity_bytes=capacity_bytes,
        fsync=config.spill_fsync,
        timeout_s=config.spill_timeout_s,
    )
    return FileBackend(options, None, name=f"file://{path}")
