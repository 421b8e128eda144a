"""The Mooncake backend's straight path (mooncake_store.py): pages of a pool the caller lent
(`lend`: the engine lends its L2 pool), of at least `direct` bytes, move between it and the
store without a copy.

One multi-buffer transfer a page moves its header to or from a slot of the staging arena
and its payload to or from the caller's page, framed (checksum read from the page) or
checked (`verify.check_object` over the two parts) where the page lies. On a machine of more
than two cores a round moves in chunks of 8 MiB or more, the next chunk framed, or the last
checked, while one moves (`workers.overlapped`). The pages a transfer moves are marked in
`lent.LentRegions` while it runs: one that outlives its call leaves them quarantined
(`quarantined`) until it is over. An object of another size (damaged, signed, lz4) moves
nothing and is read again staged (`AGAIN`).

Why a threshold: a second transfer a page costs about 34 us on TCP here, twice the raw read
of a 64 KiB page, and nothing measurable at 512 KiB and 2 MiB, where the staging copy costs
15-25 % of the transfer (docs/performance.md).
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from .base import CPUS, PageStatus
from .buffers import Buffer, byte_view
from .guard import CopyGuard
from .lent import LentRegions, address_of
from .mooncake_common import (
    RPC_FAIL,
    TOO_SMALL,
    TRANSFER_FAIL,
    Round,
    num_threads,
    raise_if_all_failed,
    slot_sizes,
)
from .objects import Compression, CorruptReason, frame_objects, header_size
from .staging import StagingArena
from .verify import check_object
from .workers import WorkerPool, overlapped, share

# A direct round moves in chunks of this many bytes, up to this many (a transfer costs about
# 0.1 ms of its own here: chunks of 8 MiB and more cost nothing measurable), so that the
# framing or check of one runs beside the transfer of another. That needs a core beside the
# transfer's (which takes about one, and the holder's part of another): on two cores, one
# transfer a round measured 5-7 % faster at 32 x 2 MiB than four chunks overlapped.
_CHUNK_BYTES = 8 << 20
_MAX_CHUNKS = 4 if CPUS > 2 else 1
AGAIN = object()  # a direct read that found an object of another size: read it staged


class DirectPath:
    """The straight path of `MooncakeBackend`, which it inherits: what it uses of the
    backend is declared here (the rest: `_in_pool`, `_register_lent`, `_rounds`, `_names`,
    `_addresses`, `_statuses`, `_note_page_error`)."""

    _client: Any
    _config: Any  # the client's ReplicateConfig
    _arena: StagingArena | None
    _pool: WorkerPool | None
    _lent: LentRegions
    _direct_bytes: int
    _layout_bytes: bytes | None
    _mac_key: Any
    layout: str | None
    _in_pool: Callable[[Callable[[], Any]], Awaitable[Any]]

    def lend(self, region: Buffer) -> bool:
        """Pages of `region` of at least `direct` bytes move straight between it and the store
        (their headers through the arena); registered with the client before the next call
        (a region the client refuses is not lent after all: its pages go through the arena)."""
        if not self._direct_bytes:
            return False
        self._lent.add(region)
        return True

    def quarantined(self, pages: Sequence[Buffer]) -> list[bool]:
        views = [byte_view(page, what="page") for page in pages]
        return [self._lent.busy(address_of(view), len(view)) for view in views]

    async def _direct_now(self, views: list[memoryview]) -> list[int] | None:
        """The address of each page, where every page of the batch can move directly (large
        enough, in a lent region, registered first if it was lent since); else None."""
        if not self._direct_bytes or any(len(view) < self._direct_bytes for view in views):
            return None
        if self._lent.unregistered():
            await self._in_pool(self._register_lent)
        addresses = [address_of(view) for view in views]
        for address, view in zip(addresses, views, strict=True):
            if not self._lent.inside(address, len(view)):
                return None
        return addresses

    async def _put_direct(
        self,
        keys: list[bytes],
        views: list[memoryview],
        addresses: list[int],
        head: int,
        guard: CopyGuard,
    ) -> list[PageStatus]:
        """Pages framed where they are (the checksum read from the caller's page), each
        header put from the arena and its payload straight from the page, one transfer per
        chunk, the next chunk framed while one moves (`overlapped`); a page the store holds
        already is kept as it is. The pages are marked in `_lent` while the transfers read
        them: one that outlives the call leaves them quarantined."""
        work = functools.partial(self._put_round, keys, views, addresses, head, guard)
        return await self._rounds(slot_sizes([head] * len(keys)), work, PageStatus.REJECTED)

    def _put_round(
        self,
        keys: list[bytes],
        views: list[memoryview],
        addresses: list[int],
        head: int,
        guard: CopyGuard,
        one: Round,
        start: int,
    ) -> list[PageStatus]:
        """One round of `_put_direct` (a worker thread)."""
        items, heads = one.items, self._addresses(one, start)
        token = self._lent.mark([(addresses[i], addresses[i] + len(views[i])) for i in items])
        if token is None:  # a page handed in while a transfer still moves it
            self._note_page_error("batch_put: a page still under an earlier transfer")
            return [PageStatus.ERROR] * len(items)

        def frame(js: list[int]) -> None:
            framed = frame_objects(
                [keys[items[j]] for j in js],
                self.layout,
                [views[items[j]] for j in js],
                threads=num_threads(sum(len(views[items[j]]) for j in js)),
                mac_key=self._mac_key,
            )
            for obj, j in zip(framed, js, strict=True):
                at = start + one.offsets[j]
                self._arena.view[at : at + head] = obj.header

        def move(js: list[int], _: Any) -> list[PageStatus]:
            if guard.closed:
                return [PageStatus.ERROR] * len(js)  # the call is over: nothing more is sent
            codes = self._client.batch_put_from_multi_buffers(
                self._names([keys[items[j]] for j in js]),
                [[heads[j], addresses[items[j]]] for j in js],
                [[head, len(views[items[j]])] for j in js],
                self._config,
            )
            return self._statuses(codes, "batch_put_from_multi_buffers")

        try:
            chunks = _chunks([len(views[i]) for i in items])
            moved = overlapped(self._pool, chunks, move, before=frame)
        finally:
            self._lent.unmark(token)
        return [status for chunk in moved for status in chunk]

    async def _fetch_direct(
        self, keys: list[bytes], views: list[memoryview], addresses: list[int], guard: CopyGuard
    ) -> list[Any]:
        """Each object's header into the arena and its payload straight into the caller's
        page, in one transfer per chunk of the round; then the check, in place, of each chunk
        while the next one moves (`overlapped`). The pages are marked in `_lent` while the
        transfers run: one that outlives the call leaves them quarantined."""
        head = header_size(self.layout, signed=self._mac_key is not None)

        def work(one: Round, start: int) -> list[Any]:
            items, heads = one.items, self._addresses(one, start)
            token = self._lent.mark([(addresses[i], addresses[i] + len(views[i])) for i in items])
            if token is None:  # a page handed in again while a transfer still moves it
                self._note_page_error("batch_get: a page still under an earlier transfer")
                return [PageStatus.ERROR] * len(items)

            def move(js: list[int], _: Any) -> list[int] | None:
                if guard.closed:
                    return None  # the call is over: nothing more is moved
                return self._client.batch_get_into_multi_buffers(
                    self._names([keys[items[j]] for j in js]),
                    [[heads[j], addresses[items[j]]] for j in js],
                    [[head, len(views[items[j]])] for j in js],
                )

            def check(js: list[int], codes: list[int] | None) -> list[Any]:
                if codes is None:
                    return [None] * len(js)
                return self._check_in_place(codes, js, one, start, head, keys, views)

            try:
                chunks = _chunks([len(views[i]) for i in items])
                checked = overlapped(self._pool, chunks, move, after=check)
            finally:
                self._lent.unmark(token)
            return [outcome for chunk in checked for outcome in chunk]

        return await self._rounds(slot_sizes([head] * len(keys)), work, CorruptReason.LENGTH)

    def _check_in_place(
        self,
        codes: list[int],
        js: list[int],
        one: Round,
        start: int,
        head: int,
        keys: list[bytes],
        views: list[memoryview],
    ) -> list[Any]:
        """What each direct read of round positions `js` found: True (checked where it
        landed), a reason, a miss, an error, or `AGAIN` (an object of another size: nothing
        was moved)."""
        raise_if_all_failed(codes, "batch_get_into_multi_buffers")
        outcomes: list[Any] = [None] * len(codes)
        landed = []
        for k, (code, j) in enumerate(zip(codes, js, strict=True)):
            if code == head + len(views[one.items[j]]):
                landed.append(k)
            elif code in (TOO_SMALL, TRANSFER_FAIL):
                outcomes[k] = AGAIN
            elif code == RPC_FAIL:
                self._note_page_error("batch_get_into_multi_buffers: the master did not answer")
                outcomes[k] = PageStatus.ERROR

        def check(k: int) -> None:
            i, at = one.items[js[k]], start + one.offsets[js[k]]
            parts = [self._arena.view[at : at + head], views[i]]
            checked = check_object(
                parts, keys[i], self._layout_bytes, raw_bytes=len(views[i]), mac_key=self._mac_key
            )
            if isinstance(checked, CorruptReason):
                outcomes[k] = checked
            elif checked[0].compression is not Compression.NONE:
                outcomes[k] = AGAIN  # (lz4 of a page's size: decoded staged)
            else:
                outcomes[k] = True

        nbytes = sum(len(views[one.items[js[k]]]) for k in landed)
        share(self._pool, landed, check, num_threads(nbytes))
        return outcomes


def _chunks(sizes: list[int]) -> list[list[int]]:
    """Positions 0..len(sizes)-1 in consecutive chunks of about `_CHUNK_BYTES` (at most
    `_MAX_CHUNKS`): each moves in a transfer of its own while the CPU work of its neighbours
    (framing, checking) runs beside it. A batch under two chunks' worth is one chunk."""
    num = max(1, min(_MAX_CHUNKS, sum(sizes) // _CHUNK_BYTES, len(sizes)))
    return [list(range(k * len(sizes) // num, (k + 1) * len(sizes) // num)) for k in range(num)]
