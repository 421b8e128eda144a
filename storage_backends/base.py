"""StorageBackend: the batched, async L3 interface, and everything the backends share.

The public calls are implemented once, here: argument checks, framing pages into objects and
verifying them on the way back, turning faults into misses; and in its base
`connection.Connection`, the per-call deadline, connecting on first use, reconnecting on the
call after a fault, the circuit breaker and the counters and rate-limited warnings
(`stats.Tally`). A backend only implements a handful of raw primitives over framed objects (`_open`,
`_close`, `_exists`, `_fetch`, `_store`, `_delete`, `_usage`), so two backends cannot drift
apart on what a miss, a corrupt page or a timeout means.

Contracts every backend keeps (the contract suite in tests/storage_backends checks them):

- A page is returned only after its key, its layout descriptor and its checksum were checked,
  and, with a tenant secret (`secret_file`), its MAC. Anything else is a miss, counted under
  `BackendStats.num_corrupt[reason]` (a page without a valid MAC under `num_forged`), never
  data. Pages are written with the MAC of the secret.
- No call outlives `options.timeout_s` (plus the copy of pages already fetched). A fault (a
  timeout, a connection error, an I/O error) becomes misses / `False` / 0, one error or
  timeout count and a rate-limited warning; the next call reconnects.
- After `breaker_failures` faults in a row, calls fail fast (the same misses / `False` / 0,
  counted in `num_short_circuited`) for `breaker_backoff`, then one probe goes through
  (`breaker`): a hung backend costs one timeout per back-off, not one per call.
- After `batch_get` returns, the backend never writes into the caller's buffers again, and
  after `batch_put` returns it keeps no reference to the caller's pages; except pages of a
  region the caller lent (`lend`): a transfer that outlived its call may still move those,
  and `quarantined` says which, until it is over (`lent.LentRegions`).
- The first use of a backend that cannot be reached raises `BackendUnavailableError` (a wrong
  URL fails loudly); once it has worked, outages are faults as above.
- Calls may run concurrently on one event loop. A backend object belongs to one event loop;
  use `SyncBackend` from threads.
"""

from __future__ import annotations

import abc
import asyncio
import enum
import functools
import logging
import os
from collections import Counter
from collections.abc import Sequence
from typing import ClassVar, TypeVar

from .buffers import (
    Buffer,
    PageBuffers,
    PageView,
    check_keys,
    check_same_length,
    joined_page,
    page_nbytes,
    page_views,
    scatter_page,
    writable_views,
)
from .connection import FAULT, Connection, Fault
from .guard import CopyGuard
from .objects import (
    Compression,
    CorruptReason,
    FramedObject,
    MacKey,
    ObjectParts,
    frame_objects,
    join_parts,
    layout_bytes,
    load_secret,
    split_object,
)
from .options import BackendOptions
from .stats import BackendStats, Usage
from .verify import decode_object_into, decode_objects_into, verify_object

logger = logging.getLogger(__name__)

T = TypeVar("T")
_SHARE_BYTES = 1 << 20  # a batch's checksums and copies: a thread per this many bytes ...
_SHARE_THREADS = 8  # ... and at most this many
# The cores this process may run on (what thread counts are capped by, here and in backends).
CPUS = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


class PageStatus(enum.Enum):
    """Per-page outcomes of the raw primitives, besides data."""

    STORED = "stored"
    REJECTED = "rejected"  # no room: larger than the capacity, or nothing left to evict
    ERROR = "error"  # this page alone failed (an I/O error on one file, an error reply)


# A fetched object: its bytes (to be verified), a per-page error, a reason the backend found it
# corrupt without reading it all, or None when absent.
Fetched = ObjectParts | PageStatus | CorruptReason | None

# A page read into the caller's buffer: True (verified and copied), or why not, as above.
ReadInto = bool | PageStatus | CorruptReason | None


class StorageBackend(Connection):
    """An L3 store of page objects, addressed by 16-byte page keys. See the module docstring.

    `layout` is the KV layout descriptor pages are written and expected under; a backend
    opened without one (the cache-server daemon, which stores for clients of every layout)
    can only use the `*_objects` calls.
    """

    scheme: ClassVar[str]
    # Whether `_fetch_into` and `_frame_and_store` take a page in pieces (a list of views) as
    # it is: read straight into its pieces, hashed and written from them. Where not, the base
    # reads such a page through a buffer of its own, copied into the pieces once verified,
    # and joins the pieces of a page to store (one copy each way).
    takes_pieces: ClassVar[bool] = False
    # Whether a put keeps an object the store already holds under its key instead of
    # replacing it (cheaper where the store offers it: keys are content addresses, so the
    # object under a key normally holds that very page). Such a backend removes an object
    # that fails its check on read (`num_dropped`), so that the next put refills the key.
    put_keeps_existing: ClassVar[bool] = False

    def __init__(self, options: BackendOptions, layout: str | None, *, name: str = "") -> None:
        super().__init__(options, name or f"{self.scheme}://")
        self.layout = layout
        self._layout_bytes = layout_bytes(layout) if layout is not None else None
        self._compression = Compression.parse(options.compression)
        self._mac_key: MacKey | None = load_secret(options.secret_file, self.name)

    # -- primitives a backend implements ---------------------------------------------------

    @abc.abstractmethod
    async def _exists(self, keys: list[bytes]) -> int:
        """How many of `keys`, counted from the first, are stored (stop at the first absent)."""

    @abc.abstractmethod
    async def _fetch(self, keys: list[bytes], sizes: list[int] | None) -> list[Fetched]:
        """The stored objects of `keys`, as they are: the caller verifies them.

        `sizes` are the payload sizes the caller expects (reads into buffers); None when the
        caller keeps the returned bytes (the objects API).
        """

    @abc.abstractmethod
    async def _store(self, keys: list[bytes], objects: list[FramedObject]) -> list[PageStatus]:
        """Store framed objects; the payload parts may be the caller's buffers (copy them)."""

    @abc.abstractmethod
    async def _delete(self, keys: list[bytes]) -> int:
        """Remove `keys`; return how many were stored."""

    async def _fetch_into(
        self, keys: list[bytes], views: list[memoryview], guard: CopyGuard
    ) -> list[ReadInto]:
        """Read pages into the caller's buffers, verified. By default: `_fetch`, then decode
        here on the event loop. A backend that copies from worker threads overrides this and
        copies only through `guard` (after the call returns it refuses)."""
        fetched = await self._fetch(keys, [len(view) for view in views])
        return self._decode_all(keys, views, fetched)  # on the event loop: no guard needed

    def _decode_all(
        self, keys: list[bytes], views: list[memoryview], fetched: list[Fetched]
    ) -> list[ReadInto]:
        """Verify a batch and copy it into `views`: `verify.decode_objects_into`, checked
        and copied on a thread per `_SHARE_BYTES` (with the C extension; else on this one)."""
        outcomes: list[ReadInto] = list(fetched)  # misses, errors and reasons stay as they are
        found = [i for i, item in enumerate(fetched) if not _settled(item)]
        if not found:
            return outcomes
        reasons = decode_objects_into(
            [fetched[i] for i in found],
            [keys[i] for i in found],
            self._layout_bytes,
            [views[i] for i in found],
            threads=_share(sum(len(views[i]) for i in found)),
            mac_key=self._mac_key,
        )
        for i, reason in zip(found, reasons, strict=True):
            outcomes[i] = True if reason is None else reason
        return outcomes

    def _decode_into(self, key: bytes, view: memoryview, item: Fetched) -> ReadInto:
        if _settled(item):
            return item
        reason = decode_object_into(item, key, self._layout_bytes, view, mac_key=self._mac_key)
        return True if reason is None else reason

    def _usage(self) -> Usage:
        return Usage(None, None, None)

    # -- lending the caller's pool --------------------------------------------------------

    def lend(self, region: Buffer) -> bool:
        """Lend `region`, the caller's page pool (the pinned L2 pool), for transfers straight
        into and out of its pages; False where this backend has no use for it (nothing
        changes then). A caller that lends keeps the rule of `quarantined`."""
        return False

    def quarantined(self, pages: Sequence[Buffer]) -> list[bool]:
        """Which of `pages` a transfer that outlived its call (it timed out) still moves.
        Such a page is still the backend's: the caller must not write it or hand it out
        until this says False. Only pages of a lent region are ever quarantined."""
        return [False] * len(pages)

    # -- public API -----------------------------------------------------------------------

    async def batch_exists(self, keys: Sequence[bytes]) -> int:
        """How many keys, counted from the first, are present. Stops at the first miss.

        Presence only: a present object that turns out corrupt is a miss of `batch_get`.
        A fault returns 0.
        """
        keys = check_keys(keys)
        if not keys:
            return 0
        result = await self._call("batch_exists", lambda: self._exists(keys))
        return 0 if result is FAULT else result

    async def batch_get(self, keys: Sequence[bytes], into: Sequence[PageBuffers]) -> list[bool]:
        """Read pages into caller buffers (e.g. slices of the pinned L2 pool); one bool per key.

        `into[i]` must be exactly the page's size: one buffer, or a list of buffers, its
        pieces in order (a page scattered over an engine's pool). True: `into[i]` holds the
        verified page. False: a miss (absent, corrupt, or lost to a fault); `into[i]` is then
        unspecified (bytes may have landed before the check failed) and must not be used. The
        backend never writes `into` after returning.
        """
        keys = check_keys(keys)
        views = writable_views(into)
        check_same_length("into", keys, views)
        self._require_layout("batch_get")
        if not keys:
            return []
        targets = views if self.takes_pieces else _flat_targets(views)
        guard = CopyGuard()
        try:
            outcomes = await self._call(
                "batch_get", lambda: self._fetch_into(keys, targets, guard)
            )  # fmt: skip
        finally:
            guard.close()
        if outcomes is FAULT:
            self._counts["misses"] += len(keys)
            return [False] * len(keys)
        found = [outcome is True for outcome in outcomes]
        if targets is not views:  # pages in pieces, read through buffers of our own
            for view, target, ok in zip(views, targets, found, strict=True):
                if ok and view is not target:
                    scatter_page(target, view)
        if all(found):  # the common case: one pass
            self._tally.count_reads(found, sum(map(page_nbytes, views)), Counter())
            return found
        corrupt = Counter(o.value for o in outcomes if isinstance(o, CorruptReason))
        if corrupt:
            await self._drop_refused(keys, outcomes)
        failed = sum(1 for outcome in outcomes if outcome is PageStatus.ERROR)
        if failed:
            self._counts["errors"] += failed
            self._tally.warn_page_errors("batch_get", failed)
        self._tally.count_reads(
            found, sum(page_nbytes(v) for v, ok in zip(views, found, strict=True) if ok), corrupt
        )
        return found

    async def batch_put(self, keys: Sequence[bytes], pages: Sequence[PageBuffers]) -> list[bool]:
        """Store pages under keys; one bool per key (True: stored, and readable until evicted).

        A page is one buffer, or a list of buffers, its pieces in order (stored as one
        object, the same as the page joined). Pages may be the caller's buffers: they are
        framed without a copy and not referenced after the call returns. A page whose call
        timed out may still reach storage later, checked by its checksum like any other.
        """
        keys = check_keys(keys)
        views = page_views(pages)
        check_same_length("pages", keys, views)
        self._require_layout("batch_put")
        if not keys:
            return []
        if not self.takes_pieces and not all(isinstance(v, memoryview) for v in views):
            views = [joined_page(view) for view in views]
        return await self._frame_and_store(keys, views)

    async def delete(self, keys: Sequence[bytes]) -> int:
        """Remove keys; returns how many were stored (0 on a fault)."""
        keys = check_keys(keys)
        if not keys:
            return 0
        result = await self._call("delete", lambda: self._delete(keys))
        return 0 if result is FAULT else result

    async def batch_put_objects(
        self, keys: Sequence[bytes], blobs: Sequence[Buffer], *, verify: bool = True
    ) -> list[bool]:
        """Store already-encoded objects of any layout (the cache-server daemon's put).

        With `verify` (the default) each object is checked against its key first (magic,
        version, key, lengths, checksum: `verify_object`); a bad one is refused alone, counted
        under `num_corrupt` and `num_put_rejected`.
        """
        keys = check_keys(keys)
        check_same_length("blobs", keys, blobs)
        framed: list[FramedObject | None] = []
        corrupt: Counter[str] = Counter()
        for key, blob in zip(keys, blobs, strict=True):
            reason = verify_object(blob, key, mac_key=self._mac_key) if verify else None
            split = split_object(blob) if reason is None else reason
            if isinstance(split, CorruptReason):
                corrupt[split.value] += 1
                framed.append(None)
            else:
                framed.append(split)
        if corrupt:
            self._counts["put_rejected"] += sum(corrupt.values())
            self._tally.count_refused(corrupt, "on put")
        good = [i for i, obj in enumerate(framed) if obj is not None]
        stored = [False] * len(keys)
        if good:
            results = await self._store_counted(
                "batch_put_objects", [keys[i] for i in good], [framed[i] for i in good]
            )
            for i, ok in zip(good, results, strict=True):
                stored[i] = ok
        return stored

    async def batch_get_objects(
        self, keys: Sequence[bytes], *, verify: bool = True
    ) -> list[bytes | None]:
        """Encoded objects of any layout, verified against their keys (not their layout).

        `verify=False` skips the check, for a store that holds only objects verified on
        their way in and kept in this process since (the daemon's memory store: what it reads
        back from its spill is still verified, by the spill's own read).
        """
        keys = check_keys(keys)
        if not keys:
            return []
        fetched = await self._call("batch_get_objects", lambda: self._fetch(keys, None))
        if fetched is FAULT:
            self._counts["misses"] += len(keys)
            return [None] * len(keys)
        blobs: list[bytes | None] = []
        corrupt: Counter[str] = Counter()
        refused: list[CorruptReason | None] = [None] * len(keys)
        for key, item in zip(keys, fetched, strict=True):
            if item is None or isinstance(item, PageStatus):
                if item is PageStatus.ERROR:
                    self._counts["errors"] += 1
                blobs.append(None)
                continue
            if isinstance(item, CorruptReason):
                reason = item
            else:
                reason = verify_object(item, key, mac_key=self._mac_key) if verify else None
            if reason is not None:
                corrupt[reason.value] += 1
                refused[len(blobs)] = reason
                blobs.append(None)
            else:
                blobs.append(join_parts(item))
        hits = [blob is not None for blob in blobs]
        self._tally.count_reads(hits, sum(len(b) for b in blobs if b is not None), corrupt)
        if corrupt:
            await self._drop_refused(keys, refused)
        return blobs

    async def _drop_refused(self, keys: list[bytes], outcomes: Sequence[object]) -> None:
        """Where puts keep what the store holds (`put_keeps_existing`), remove the objects a
        read refused, so that the next put of those keys stores them afresh; counted under
        `num_dropped`. An object of a format version this reader does not know is left alone
        (a newer writer's, intact for its readers)."""
        if not self.put_keeps_existing:
            return
        refused = [
            key
            for key, outcome in zip(keys, outcomes, strict=True)
            if isinstance(outcome, CorruptReason) and outcome is not CorruptReason.VERSION
        ]
        if refused:
            dropped = await self._call("drop_refused", lambda: self._delete(refused))
            if dropped is not FAULT:
                self._counts["dropped"] += dropped

    @property
    def signs_pages(self) -> bool:
        """Whether pages carry a MAC (a tenant secret is configured): their header is longer."""
        return self._mac_key is not None

    def stats(self) -> BackendStats:
        return self._tally.snapshot(self.name, self._usage(), self._breaker)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, layout={self.layout!r})"

    # -- shared machinery -----------------------------------------------------------------

    def _require_layout(self, op: str) -> bytes:
        if self._layout_bytes is None:
            raise ValueError(
                f"{self.name}: {op} needs the backend opened with a layout descriptor "
                "(open_backend(url, layout=...)); without one only the *_objects calls work"
            )
        return self._layout_bytes

    async def _frame_all(
        self, keys: list[bytes], views: list[memoryview], layout: str
    ) -> list[FramedObject]:
        if self._compression is Compression.NONE and self._mac_key is None:
            threads = _share(sum(map(len, views)))  # checksums on a thread per _SHARE_BYTES
            return frame_objects(keys, layout, views, threads=threads)
        loop = asyncio.get_running_loop()  # lz4 and SHA-256 release the GIL: off the loop
        frame = functools.partial(
            frame_objects, compression=self._compression, mac_key=self._mac_key
        )
        return await loop.run_in_executor(None, frame, keys, layout, views)

    async def _frame_and_store(self, keys: list[bytes], views: list[memoryview]) -> list[bool]:
        """`batch_put`'s work once the arguments are checked: frame, store, count. (The file
        backend overrides it to frame each pack on the thread that writes it.)"""
        framed = await self._frame_all(keys, views, self.layout)
        return await self._store_counted("batch_put", keys, framed)

    async def _store_counted(
        self, op: str, keys: list[bytes], objects: list[FramedObject]
    ) -> list[bool]:
        statuses = await self._call(op, lambda: self._store(keys, objects))
        return self._count_stores(op, statuses, [obj.nbytes for obj in objects])

    def _count_stores(
        self, op: str, statuses: list[PageStatus] | Fault, sizes: Sequence[int]
    ) -> list[bool]:
        """Count a store's outcome (`sizes[i]`, the object's bytes, is read only where the
        page was stored)."""
        if statuses is FAULT:
            return [False] * len(sizes)
        num_stored = statuses.count(PageStatus.STORED)
        self._counts["puts"] += num_stored
        if num_stored == len(statuses):  # the common case: every page stored
            self._counts["written_bytes"] += sum(sizes)
            return [True] * num_stored
        stored = [status is PageStatus.STORED for status in statuses]
        self._counts["put_rejected"] += statuses.count(PageStatus.REJECTED)
        self._counts["written_bytes"] += sum(
            size for size, ok in zip(sizes, stored, strict=True) if ok
        )
        num_errors = statuses.count(PageStatus.ERROR)
        self._counts["errors"] += num_errors
        if num_errors:
            self._tally.warn_page_errors(op, num_errors)
        return stored


def _flat_targets(views: list[PageView]) -> list[PageView]:
    """Where a backend reads a page only into one buffer: `views` as they are, or (some page
    in pieces) a copy of the list with a buffer of its own for each such page."""
    if all(isinstance(view, memoryview) for view in views):
        return views
    return [
        view if isinstance(view, memoryview) else memoryview(bytearray(page_nbytes(view)))
        for view in views
    ]


def _settled(item: Fetched) -> bool:
    """Whether a fetched item is an outcome already (a miss, an error, a reason), not bytes."""
    return item is None or isinstance(item, (PageStatus, CorruptReason))


def _share(nbytes: int) -> int:
    """Threads that share the checksums (and copies) of `nbytes` of pages: one per
    `_SHARE_BYTES`, at most `_SHARE_THREADS` (past that, memory bandwidth is the limit)."""
    return max(1, min(nbytes // _SHARE_BYTES, _SHARE_THREADS, CPUS))
