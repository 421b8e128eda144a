"""StorageBackend: the batched, async L3 interface, and everything the backends share.

The public calls are implemented once, here: argument checks, framing pages into objects and
verifying them on the way back, the per-call deadline, turning faults into misses, the
counters, rate-limited warnings, connecting on first use and reconnecting on the call after a
fault. A backend only implements a handful of raw primitives over framed objects (`_open`,
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
  after `batch_put` returns it keeps no reference to the caller's pages.
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
import types
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import ClassVar, TypeVar

from .breaker import CircuitBreaker
from .errors import BackendClosedError, BackendConfigError, BackendUnavailableError
from .guard import CopyGuard
from .objects import (
    KEY_BYTES,
    Buffer,
    Compression,
    CorruptReason,
    FramedObject,
    MacKey,
    ObjectParts,
    byte_view,
    check_key,
    frame_objects,
    join_parts,
    layout_bytes,
    mac_key_from_secret,
    split_object,
)
from .options import BackendOptions
from .stats import BackendStats, RateLimitedWarnings, Usage
from .verify import decode_object_into, decode_objects_into, verify_object

logger = logging.getLogger(__name__)

T = TypeVar("T")
_timeout = getattr(asyncio, "timeout", None)  # 3.11+: a deadline without a task per call
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


class _Fault:
    """Returned by `_call` instead of a result when the call failed as a whole."""


_FAULT = _Fault()


class StorageBackend(abc.ABC):
    """An L3 store of page objects, addressed by 16-byte page keys. See the module docstring.

    `layout` is the KV layout descriptor pages are written and expected under; a backend
    opened without one (the cache-server daemon, which stores for clients of every layout)
    can only use the `*_objects` calls.
    """

    scheme: ClassVar[str]
    transient_errors: ClassVar[tuple[type[BaseException], ...]] = (OSError,)

    def __init__(self, options: BackendOptions, layout: str | None, *, name: str = "") -> None:
        self.options = options
        self.layout = layout
        self.name = name or f"{self.scheme}://"
        self._layout_bytes = layout_bytes(layout) if layout is not None else None
        self._compression = Compression.parse(options.compression)
        self._mac_key: MacKey | None = _load_secret(options.secret_file, self.name)
        self._warnings = RateLimitedWarnings(self.name, options.warn_interval_s)
        self._connect_lock = asyncio.Lock()
        self._connected = False
        self._ever_connected = False
        self._closed = False
        self._counts: Counter[str] = Counter()
        self._corrupt: Counter[str] = Counter()
        self._page_error = ""  # the latest per-page error, for the next warning
        self._breaker = CircuitBreaker(
            options.breaker_failures, options.breaker_backoff_s, options.breaker_max_backoff_s
        )

    # -- primitives a backend implements ---------------------------------------------------

    @abc.abstractmethod
    async def _open(self) -> None:
        """Connect (or create what is needed). Raise a transient error if unreachable."""

    @abc.abstractmethod
    async def _close(self) -> None:
        """Release connections and files; must not raise for an already broken connection."""

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
        and copied by the C extension on a thread per `_SHARE_BYTES`."""
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

    def _note_page_error(self, detail: str) -> None:
        """Backends record why a single page failed; the next rate-limited warning says it."""
        self._page_error = detail

    async def _reconnect(self) -> None:
        """Drop the connection state after a fault and open again."""
        await self._close()
        await self._open()

    # -- public API -----------------------------------------------------------------------

    async def connect(self) -> None:
        """Check the backend now: raises `BackendUnavailableError` if it cannot be used.

        Optional: the first call of any other method does the same.
        """
        self._check_open()
        await self._ensure_connected()

    async def batch_exists(self, keys: Sequence[bytes]) -> int:
        """How many keys, counted from the first, are present. Stops at the first miss.

        Presence only: a present object that turns out corrupt is a miss of `batch_get`.
        A fault returns 0.
        """
        keys = _check_keys(keys)
        if not keys:
            return 0
        result = await self._call("batch_exists", lambda: self._exists(keys))
        return 0 if result is _FAULT else result

    async def batch_get(self, keys: Sequence[bytes], into: Sequence[Buffer]) -> list[bool]:
        """Read pages into caller buffers (e.g. slices of the pinned L2 pool); one bool per key.

        `into[i]` must be exactly the page's size. True: `into[i]` holds the verified page.
        False: a miss (absent, corrupt, or lost to a fault); `into[i]` is then unspecified
        (usually untouched) and must not be used. The backend never writes `into` after
        returning.
        """
        keys = _check_keys(keys)
        views = _writable_views(into)
        _check_same_length("into", keys, views)
        self._require_layout("batch_get")
        if not keys:
            return []
        guard = CopyGuard()
        try:
            outcomes = await self._call("batch_get", lambda: self._fetch_into(keys, views, guard))
        finally:
            guard.close()
        if outcomes is _FAULT:
            self._counts["misses"] += len(keys)
            return [False] * len(keys)
        found = [outcome is True for outcome in outcomes]
        if all(found):  # the common case: one pass
            self._count_reads(found, sum(len(v) for v in views), Counter())
            return found
        corrupt = Counter(o.value for o in outcomes if isinstance(o, CorruptReason))
        failed = sum(1 for outcome in outcomes if outcome is PageStatus.ERROR)
        if failed:
            self._counts["errors"] += failed
            self._warn_page_errors("batch_get", failed)
        self._count_reads(
            found, sum(len(v) for v, ok in zip(views, found, strict=True) if ok), corrupt
        )
        return found

    async def batch_put(self, keys: Sequence[bytes], pages: Sequence[Buffer]) -> list[bool]:
        """Store pages under keys; one bool per key (True: stored, and readable until evicted).

        Pages may be the caller's buffers: they are framed without a copy and not referenced
        after the call returns. A page whose call timed out may still reach storage later,
        checked by its checksum like any other.
        """
        keys = _check_keys(keys)
        try:
            views = [byte_view(page) for page in pages]
        except (TypeError, ValueError):  # name the bad one (names are built only then)
            views = [byte_view(page, what=f"pages[{i}]") for i, page in enumerate(pages)]
        _check_same_length("pages", keys, views)
        self._require_layout("batch_put")
        if not keys:
            return []
        return await self._frame_and_store(keys, views)

    async def delete(self, keys: Sequence[bytes]) -> int:
        """Remove keys; returns how many were stored (0 on a fault)."""
        keys = _check_keys(keys)
        if not keys:
            return 0
        result = await self._call("delete", lambda: self._delete(keys))
        return 0 if result is _FAULT else result

    async def batch_put_objects(
        self, keys: Sequence[bytes], blobs: Sequence[Buffer], *, verify: bool = True
    ) -> list[bool]:
        """Store already-encoded objects of any layout (the cache-server daemon's put).

        With `verify` (the default) each object is checked against its key first (magic,
        version, key, lengths, checksum: `verify_object`); a bad one is refused alone, counted
        under `num_corrupt` and `num_put_rejected`.
        """
        keys = _check_keys(keys)
        _check_same_length("blobs", keys, blobs)
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
            self._count_refused(corrupt, "on put")
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
        keys = _check_keys(keys)
        if not keys:
            return []
        fetched = await self._call("batch_get_objects", lambda: self._fetch(keys, None))
        if fetched is _FAULT:
            self._counts["misses"] += len(keys)
            return [None] * len(keys)
        blobs: list[bytes | None] = []
        corrupt: Counter[str] = Counter()
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
                blobs.append(None)
            else:
                blobs.append(join_parts(item))
        hits = [blob is not None for blob in blobs]
        self._count_reads(hits, sum(len(b) for b in blobs if b is not None), corrupt)
        return blobs

    @property
    def signs_pages(self) -> bool:
        """Whether pages carry a MAC (a tenant secret is configured): their header is longer."""
        return self._mac_key is not None

    def stats(self) -> BackendStats:
        usage = self._usage()
        c = self._counts
        return BackendStats(
            backend=self.name,
            num_objects=usage.num_objects,
            stored_bytes=usage.stored_bytes,
            capacity_bytes=usage.capacity_bytes,
            num_hits=c["hits"],
            num_misses=c["misses"],
            num_puts=c["puts"],
            num_put_rejected=c["put_rejected"],
            num_errors=c["errors"],
            num_timeouts=c["timeouts"],
            num_reconnects=c["reconnects"],
            num_evictions=usage.num_evictions,
            num_corrupt=types.MappingProxyType(dict(self._corrupt)),
            num_forged=c["forged"],
            read_bytes=c["read_bytes"],
            written_bytes=c["written_bytes"],
            num_abandoned=c["abandoned"],
            num_short_circuited=c["short_circuited"],
            num_breaker_trips=self._breaker.num_trips,
            breaker_state=self._breaker.state.value,
        )

    async def close(self) -> None:
        """Release connections and files. Idempotent; later calls raise BackendClosedError.

        Returns within `close_grace` even when the backend hangs: work still under way then
        (a write to a hung mount, a reply that never comes) is abandoned, counted in
        `num_abandoned` and logged.
        """
        if self._closed:
            return
        self._closed = True
        self._connected = False
        grace = self.options.close_grace_s
        try:  # also after a fault or a failed first use: pools and clients may exist
            await asyncio.wait_for(self._close(), grace)
        except asyncio.TimeoutError:
            abandoned = max(1, self._abandon())
            self._counts["abandoned"] += abandoned
            logger.warning(
                "%s: close() gave up after %ss: %d operations still under way were abandoned "
                "(a hung backend; what they were writing is not stored)",
                self.name,
                grace,
                abandoned,
            )
        except self.transient_errors as exc:
            logger.debug("%s: error while closing: %s", self.name, exc)

    def _abandon(self) -> int:
        """`close()` ran out of grace: let go of what is stuck, without waiting; return how
        many operations are left unfinished (0 if the backend cannot tell)."""
        return 0

    async def __aenter__(self) -> StorageBackend:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, layout={self.layout!r})"

    # -- shared machinery -----------------------------------------------------------------

    async def _call(self, op: str, make: Callable[[], Awaitable[T]]) -> T | _Fault:
        """Run one primitive under the deadline, connecting first; a fault becomes _FAULT.
        While the circuit breaker is open the call is not made at all (_FAULT at once)."""
        self._check_open()
        if self._ever_connected and not self._breaker.allow():
            self._counts["short_circuited"] += 1
            return _FAULT
        outcome: bool | None = None  # the breaker's news: worked, faulted, or neither

        async def connected_then_run() -> T:
            await self._ensure_connected()
            return await make()

        try:
            if _timeout is None:  # Python 3.10
                result = await asyncio.wait_for(connected_then_run(), self.options.timeout_s)
            else:
                async with _timeout(self.options.timeout_s):  # no task per call
                    result = await connected_then_run()
            outcome = True
            return result
        except asyncio.TimeoutError:
            if not self._ever_connected:
                raise BackendUnavailableError(
                    f"{self.name}: no answer within {self.options.timeout_s}s on first use"
                ) from None
            outcome = False
            self._counts["timeouts"] += 1
            self._fault(op, f"timed out after {self.options.timeout_s}s")
        except self.transient_errors as exc:
            outcome = False
            self._counts["errors"] += 1
            self._fault(op, f"{type(exc).__name__}: {exc}")
        finally:
            self._tell_breaker(outcome)
        return _FAULT

    def _tell_breaker(self, outcome: bool | None) -> None:
        if outcome is None:
            self._breaker.released()  # cancelled, or a surprise: no news about the backend
        elif outcome:
            if self._breaker.succeeded():
                logger.info("%s: answering again; circuit breaker closed", self.name)
        elif self._breaker.failed():
            self._warnings.warn(
                "breaker",
                f"circuit breaker open: calls fail fast for {self._breaker.open_for_s}s, "
                "then one is tried",
            )

    def _fault(self, op: str, what: str) -> None:
        self._connected = False  # reconnect on the next call
        self._warnings.warn(f"fault:{op}", f"{op} failed, returning misses: {what}")

    async def _ensure_connected(self) -> None:
        if self._connected:
            return
        async with self._connect_lock:
            if self._connected or self._closed:
                return
            if not self._ever_connected:
                try:
                    await self._open()
                except self.transient_errors as exc:
                    raise BackendUnavailableError(
                        f"{self.name}: cannot be reached: {type(exc).__name__}: {exc}"
                    ) from exc
                self._ever_connected = True
            else:
                self._counts["reconnects"] += 1
                await self._reconnect()
            self._connected = True

    def _check_open(self) -> None:
        if self._closed:
            raise BackendClosedError(f"{self.name}: backend is closed")

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
        self, op: str, statuses: list[PageStatus] | _Fault, sizes: Sequence[int]
    ) -> list[bool]:
        """Count a store's outcome (`sizes[i]`, the object's bytes, is read only where the
        page was stored)."""
        if statuses is _FAULT:
            return [False] * len(sizes)
        stored = [status is PageStatus.STORED for status in statuses]
        tally = Counter(statuses)
        self._counts["puts"] += tally[PageStatus.STORED]
        self._counts["put_rejected"] += tally[PageStatus.REJECTED]
        self._counts["errors"] += tally[PageStatus.ERROR]
        self._counts["written_bytes"] += sum(
            size for size, ok in zip(sizes, stored, strict=True) if ok
        )
        if tally[PageStatus.ERROR]:
            self._warn_page_errors(op, tally[PageStatus.ERROR])
        return stored

    def _warn_page_errors(self, op: str, num_pages: int) -> None:
        detail = f" (latest: {self._page_error})" if self._page_error else ""
        self._warnings.warn(f"page_error:{op}", f"{op}: {num_pages} pages failed{detail}")

    def _count_reads(self, found: list[bool], read_bytes: int, corrupt: Counter[str]) -> None:
        hits = sum(found)
        self._counts["hits"] += hits
        self._counts["misses"] += len(found) - hits
        self._counts["read_bytes"] += read_bytes
        if corrupt:
            self._count_refused(corrupt, "on read")

    def _count_refused(self, refused: Counter[str], when: str) -> None:
        """Count objects refused by reason; forged ones (no valid MAC) on their own."""
        forged = refused.pop(CorruptReason.FORGED.value, 0)
        if forged:
            self._counts["forged"] += forged
            self._warnings.warn(
                f"forged {when}",
                f"refused {forged} pages {when} without a valid MAC for this tenant's secret "
                "(written by someone without it)",
            )
        if refused:
            self._corrupt.update(refused)
            self._warnings.warn(
                f"corrupt {when}", f"refused corrupt pages {when}: {_describe(refused)}"
            )


def _load_secret(path: str, name: str) -> MacKey | None:
    """The MAC key of the secret in `path` (read once, when the backend is built); None for
    no secret. The file holds the secret alone (surrounding whitespace is ignored)."""
    if not path:
        return None
    try:
        with open(path, "rb") as f:
            secret = f.read(1 << 16).strip()
    except OSError as exc:
        raise BackendConfigError(f"{name}: secret_file {path!r}: {exc.strerror}") from None
    try:
        return mac_key_from_secret(secret)
    except ValueError as exc:
        raise BackendConfigError(f"{name}: secret_file {path!r}: {exc}") from None


def _settled(item: Fetched) -> bool:
    """Whether a fetched item is an outcome already (a miss, an error, a reason), not bytes."""
    return item is None or isinstance(item, (PageStatus, CorruptReason))


def _share(nbytes: int) -> int:
    """Threads that share the checksums (and copies) of `nbytes` of pages: one per
    `_SHARE_BYTES`, at most `_SHARE_THREADS` (past that, memory bandwidth is the limit)."""
    return max(1, min(nbytes // _SHARE_BYTES, _SHARE_THREADS, CPUS))


def _check_keys(keys: Sequence[bytes]) -> list[bytes]:
    keys = list(keys)
    if all(type(key) is bytes and len(key) == KEY_BYTES for key in keys):
        return keys  # the common case, without building a message per key
    for i, key in enumerate(keys):
        check_key(key, what=f"keys[{i}]")
    return keys


def _writable_views(buffers: Sequence[Buffer]) -> list[memoryview]:
    """Flat writable byte views of the caller's buffers; a bad one is named by its position
    (the names are built only then: this runs for every read)."""
    try:
        return [byte_view(buf, writable=True) for buf in buffers]
    except ValueError:
        return [byte_view(buf, writable=True, what=f"into[{i}]") for i, buf in enumerate(buffers)]


def _check_same_length(name: str, keys: list[bytes], values: Sequence[object]) -> None:
    if len(values) != len(keys):
        raise ValueError(f"{name} has {len(values)} entries for {len(keys)} keys")


def _describe(corrupt: Mapping[str, int]) -> str:
    return ", ".join(f"{count} {reason}" for reason, count in sorted(corrupt.items()))
