"""The Mooncake backend's staged path (mooncake_store.py), which it inherits: everything that
moves through its staging arena. Pages that do not move straight (mooncake_direct.py) are
copied into the arena and framed there, or read into it, checked and copied out; the objects
API the cache-server daemon uses (`_store`, `_fetch`) copies whole framed objects in and out.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from .base import Fetched, PageStatus, ReadInto
from .guard import CopyGuard
from .mooncake_common import (
    NOT_FOUND,
    RPC_FAIL,
    TOO_SMALL,
    Round,
    num_threads,
    raise_if_all_failed,
    slot_sizes,
)
from .objects import (
    MAC_BYTES,
    MAX_PAYLOAD_BYTES,
    Compression,
    CorruptReason,
    FramedObject,
    frame_objects,
    frame_objects_into,
    header_size,
)
from .staging import StagingArena
from .verify import decode_objects_into

_SLACK_BYTES = MAC_BYTES + 64  # room past the expected object: a signed or longer one still fits


class StagedPath:
    """The staged path of `MooncakeBackend`, which it inherits, and the objects API over the
    same arena: what it uses of the backend is declared here (the rest: `_rounds`, `_names`,
    `_addresses`, `_statuses`, `_note_page_error`)."""

    _client: Any
    _arena: StagingArena | None
    _config: Any
    _complete: Any
    _compression: Compression
    _layout_bytes: bytes | None
    _mac_key: Any
    layout: str | None
    _in_pool: Callable[[Callable[[], Any]], Awaitable[Any]]

    def _put_pages(
        self,
        one: Round,
        start: int,
        keys: list[bytes],
        views: list[memoryview],
        head: int,
        guard: CopyGuard,
    ) -> list[PageStatus]:
        """One staged round of `batch_put` (a worker thread): the pages copied into the
        arena, framed there, and put. Plain pages (no lz4, no MAC) are copied and framed in
        one pass (`frame_objects_into`); the others are copied, then framed as the codec and
        the MAC need."""
        pages = [views[i] for i in one.items]
        with guard.writing() as allowed:  # (reading the caller's pages, here)
            if not allowed:
                return [PageStatus.ERROR] * len(keys)  # the call is over: nothing is sent
            if self._compression is Compression.NONE and self._mac_key is None:
                region = self._arena.view[start : start + one.nbytes]
                threads = num_threads(sum(map(len, pages)))
                frame_objects_into(keys, self.layout, pages, region, one.offsets, threads=threads)
                payloads = None
            else:
                payloads = self._copy_in(one, start, pages, head)
        if payloads is None:
            sizes = [head + len(page) for page in pages]
        else:
            sizes = self._frame_in_arena(one, start, keys, payloads, head)
        return self._put_from(keys, self._addresses(one, start), sizes)

    def _copy_in(
        self, one: Round, start: int, pages: list[memoryview], head: int
    ) -> list[memoryview]:
        """Each page copied to its slot of the round's region, past its header's room."""
        arena, payloads = self._arena, []
        for page, offset in zip(pages, one.offsets, strict=True):
            at = start + offset + head
            np.copyto(arena.array[at : at + len(page)], np.frombuffer(page, np.uint8))
            payloads.append(arena.view[at : at + len(page)])
        return payloads

    def _frame_in_arena(
        self, one: Round, start: int, keys: list[bytes], payloads: list[memoryview], head: int
    ) -> list[int]:
        """Frame pages copied into the arena (lz4, a MAC) and write each header (and an lz4
        block kept) in front of its slot; each object's size."""
        framed = frame_objects(
            keys,
            self.layout,
            payloads,
            self._compression,
            threads=num_threads(sum(map(len, payloads))),
            mac_key=self._mac_key,
        )
        sizes, view = [], self._arena.view
        for obj, payload, offset in zip(framed, payloads, one.offsets, strict=True):
            at = start + offset
            view[at : at + head] = obj.header
            if obj.payload is not payload:  # lz4 kept: the smaller block replaces the page
                view[at + head : at + head + len(obj.payload)] = obj.payload
            sizes.append(head + len(obj.payload))
        return sizes

    async def _store(self, keys: list[bytes], objects: list[FramedObject]) -> list[PageStatus]:
        """The objects API's put: already-framed objects of any layout, copied in and put."""

        def work(one: Round, start: int) -> list[PageStatus]:
            arena, sizes = self._arena, []
            for i, offset in zip(one.items, one.offsets, strict=True):
                at, obj = start + offset, objects[i]
                arena.view[at : at + len(obj.header)] = obj.header
                arena.view[at + len(obj.header) : at + obj.nbytes] = obj.payload
                sizes.append(obj.nbytes)
            return self._put_from([keys[i] for i in one.items], self._addresses(one, start), sizes)

        return await self._rounds(
            slot_sizes([obj.nbytes for obj in objects]), work, PageStatus.REJECTED
        )

    def _put_from(
        self, keys: list[bytes], addresses: list[int], sizes: list[int]
    ) -> list[PageStatus]:
        """Put objects from the arena; one the store holds already is kept (its key is in
        the store: stored)."""
        codes = self._client.batch_put_from(self._names(keys), addresses, sizes, self._config)
        return self._statuses(codes, "batch_put_from")

    async def _fetch_staged(
        self, keys: list[bytes], views: list[memoryview], guard: CopyGuard
    ) -> list[ReadInto]:
        """Read each round into the arena, then check and copy it into the caller's buffers
        (while the call runs: `guard`)."""
        head = header_size(self.layout)
        slots = slot_sizes([head + len(view) + _SLACK_BYTES for view in views])

        def work(one: Round, start: int) -> list[ReadInto]:
            names = self._names([keys[i] for i in one.items])
            codes = self._client.batch_get_into(names, self._addresses(one, start), one.slots)
            fetched = self._in_arena(codes, one, start, "batch_get_into")
            found = [j for j, item in enumerate(fetched) if isinstance(item, memoryview)]
            objs = [fetched[j] for j in found]
            with guard.writing() as allowed:
                if not allowed:
                    return [None] * len(names)  # the call is over: nothing is written
                reasons = decode_objects_into(
                    objs,
                    [keys[one.items[j]] for j in found],
                    self._layout_bytes,
                    [views[one.items[j]] for j in found],
                    threads=num_threads(sum(map(len, objs))),
                    mac_key=self._mac_key,
                )
            if len(objs) == len(fetched) and reasons.count(None) == len(reasons):
                return [True] * len(reasons)  # the common case: every page read and checked
            outcomes: list[ReadInto] = list(fetched)
            for j, reason in zip(found, reasons, strict=True):
                outcomes[j] = True if reason is None else reason
            return outcomes

        return await self._rounds(slots, work, CorruptReason.LENGTH)

    async def _fetch(self, keys: list[bytes], sizes: list[int] | None) -> list[Fetched]:
        """The objects API's get: sizes from the master (one query for the batch), then a
        read into the arena and a copy out (the caller keeps the bytes)."""
        names = self._names(keys)
        lengths = await self._in_pool(lambda: self._object_sizes(names))
        fetched: list[Fetched] = [None] * len(keys)
        present = [i for i, n in enumerate(lengths) if n >= 0]
        for i in present:  # a length from outside: bounded before anything is sized by it
            if lengths[i] > MAX_PAYLOAD_BYTES + (1 << 17):
                fetched[i] = CorruptReason.LENGTH

        wanted = [i for i in present if fetched[i] is None]

        def work(one: Round, start: int) -> list[Fetched]:
            batch = [names[wanted[j]] for j in one.items]
            codes = self._client.batch_get_into(batch, self._addresses(one, start), one.slots)
            got = self._in_arena(codes, one, start, "batch_get_into")
            return [bytes(item) if isinstance(item, memoryview) else item for item in got]

        got = await self._rounds(
            slot_sizes([lengths[i] for i in wanted]), work, CorruptReason.LENGTH
        )
        for i, item in zip(wanted, got, strict=True):
            fetched[i] = item
        return fetched

    def _object_sizes(self, names: list[str]) -> list[int]:
        """Each object's size in bytes, or a negative code (absent: `NOT_FOUND`), from one
        query of the master for the batch (a worker thread). A key described by no complete
        memory replica (on disk only, or still being written) is asked for alone; a batch
        the master describes none of is told apart from an unreachable master by one key."""
        described = self._client.batch_get_replica_desc(names)
        lengths = []
        for name in names:
            replicas = described.get(name, ())
            length = NOT_FOUND
            for replica in replicas:
                if replica.is_memory_replica() and replica.status == self._complete:
                    length = replica.get_memory_descriptor().buffer_descriptor.size
                    break
            else:
                if replicas:
                    length = self._client.get_size(name)
            lengths.append(length)
        if names and not described:
            raise_if_all_failed([self._client.get_size(names[0])], "batch_get_replica_desc")
        return lengths

    def _in_arena(self, codes: list[int], one: Round, start: int, op: str) -> list[Any]:
        """What a read into the arena found, per page: its object (a view of the arena),
        None (absent or vanished), LENGTH (larger than its buffer) or an error."""
        raise_if_all_failed(codes, op)
        found: list[Any] = []
        arena = self._arena.view
        for code, offset, slot in zip(codes, one.offsets, one.slots, strict=True):
            at = start + offset
            if 0 <= code <= slot:
                found.append(arena[at : at + code])
            elif code == TOO_SMALL:
                found.append(CorruptReason.LENGTH)
            elif code == RPC_FAIL:
                self._note_page_error(f"{op}: the master did not answer")
                found.append(PageStatus.ERROR)
            else:  # absent, evicted, or its segment gone: a miss
                found.append(None)
        return found
