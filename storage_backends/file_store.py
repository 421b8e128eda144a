"""`file:///path?capacity=100GiB`: one file per page in a directory many processes may share.

Layout: `<path>/ab/cd/<32 hex digits of the key>` holds one encoded object. A page is written
to `<final name>.tmp.<pid>.<n>` and renamed into place, so a reader (in this process or in any
other on the same local, NFS or 3FS directory) sees the old page, the new page or nothing,
never a partial one. Capacity and LRU across processes are `file_space`'s job.

I/O runs on a small thread pool with plain `os` calls, each worker doing a slice of the
batch: a page costs one open, one vectored write (header and caller's page, no join) or one
read, and one close, instead of a thread hop per call as with `aiofiles`.

A read never lets a late write reach the caller's buffer: once `batch_get` has returned
(on a timeout too), the engine may hand that L2 page to something else. So the kernel only
writes into the caller's buffer with RWF_NOWAIT, a read that fails rather than wait for I/O
(a page-cache hit: a memory copy), under the call's CopyGuard. Anything that may wait - the
page cache misses, or the filesystem cannot promise (NFS) - is read into the worker's own
256 KiB chunk buffer and copied on through the guard, which refuses once the call is over.
Each chunk is hashed while it is in cache; a page is True only after its checksum matched.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import errno
import itertools
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

from .base import Fetched, PageStatus, ReadInto, StorageBackend
from .errors import BackendConfigError
from .file_space import DirectorySpace, Staged, page_path, temp_path, unlink_quiet
from .guard import CopyGuard
from .objects import (
    Compression,
    CorruptReason,
    FramedObject,
    StreamingCheck,
    decode_object_into,
    header_size,
)
from .options import BackendOptions, check_range, options_from_query, url_option
from .stats import Usage

_MAX_OBJECT_BYTES = 1 << 30  # objects read without an expected size: larger is not a page
_CHUNK_BYTES = 256 << 10  # read, hash and copy a page in pieces that stay in cache
_RWF_NOWAIT = getattr(os, "RWF_NOWAIT", 0)  # Linux >= 4.14: fail rather than wait for I/O
_CACHED_GROUP_BYTES = 4 << 20  # page-cache hits: one worker per this many bytes of a batch


class _WorkerBuffers(threading.local):
    """Each I/O thread's own header and chunk buffers, reused for every page it reads."""

    def __init__(self) -> None:
        self.head = bytearray(0)
        self.chunk = bytearray(_CHUNK_BYTES)
        self.cache_hits = 0


@dataclass(frozen=True)
class FileOptions(BackendOptions):
    path: str = ""
    capacity_bytes: int = url_option("capacity", "size", 0, doc="bytes on disk, all processes")
    fsync: bool = url_option("fsync", "bool", False, doc="fsync pages and directories on put")
    io_threads: int = url_option("io_threads", "int", 4, doc="parallel file operations")
    scan_interval_s: float = url_option(
        "scan_interval", "duration", 300.0, doc="directory rescan (LRU index, ledger check)"
    )
    touch_interval_s: float = url_option(
        "touch_interval", "duration", 1.0, doc="a read refreshes a page's mtime older than this"
    )
    stale_temp_s: float = url_option(
        "stale_temp", "duration", 600.0, doc="temporary files older than this are removed"
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.path or not os.path.isabs(self.path):
            raise BackendConfigError(f"file:// needs an absolute path, got {self.path!r}")
        if self.capacity_bytes <= 0:
            raise BackendConfigError(
                "file:// needs ?capacity=<size>, e.g. file:///data/kv?capacity=100GiB"
            )
        check_range("io_threads", self.io_threads, low=1, high=256)
        check_range("scan_interval", self.scan_interval_s, low=0.001)
        check_range("touch_interval", self.touch_interval_s, low=0.0)
        check_range("stale_temp", self.stale_temp_s, low=1.0)


class FileBackend(StorageBackend):
    scheme = "file"
    transient_errors = (OSError,)

    def __init__(self, options: FileOptions, layout: str | None = None, *, name: str = "") -> None:
        super().__init__(options, layout, name=name)
        self.options: FileOptions = options
        self.root = options.path
        self._space = DirectorySpace(
            options.path, options.capacity_bytes, stale_temp_s=options.stale_temp_s
        )
        self._header_bytes = header_size(layout) if layout is not None else 0
        self._buffers = _WorkerBuffers()
        self._nowait = bool(_RWF_NOWAIT)
        self._cache_hit_ratio = 1.0  # recent share of reads the page cache served
        self._serial = itertools.count()
        self._io: concurrent.futures.ThreadPoolExecutor | None = None
        self._scanner: concurrent.futures.ThreadPoolExecutor | None = None
        self._scan: concurrent.futures.Future | None = None
        self._next_scan_at = 0.0

    # -- primitives -------------------------------------------------------------------------

    async def _open(self) -> None:
        if self._io is None:
            self._io = concurrent.futures.ThreadPoolExecutor(
                self.options.io_threads, thread_name_prefix="hicache-file-io"
            )
            self._scanner = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="hicache-file-scan"
            )
        await self._run(self._space.open)
        if self._scan is None:
            self._next_scan_at = time.monotonic() + self.options.scan_interval_s
            self._scan = self._scanner.submit(self._space.initial_scan)

    async def _reconnect(self) -> None:
        """Reopen the ledger (a stale NFS handle, a remounted directory); keep the index."""
        await self._run(self._space.close)
        await self._run(self._space.open)

    async def _close(self) -> None:
        io, scanner = self._io, self._scanner
        self._io = self._scanner = None
        loop = asyncio.get_running_loop()
        for pool in (io, scanner):
            if pool is not None:  # finish in-flight commits: never leave temporary files
                await loop.run_in_executor(None, pool.shutdown, True)
        self._space.close()

    async def _exists(self, keys: list[bytes]) -> int:
        def count() -> int:
            for i, key in enumerate(keys):
                if not os.path.exists(page_path(self.root, key)):
                    return i
            return len(keys)

        return await self._run(count)

    async def _fetch(self, keys: list[bytes], sizes: list[int] | None) -> list[Fetched]:
        """Whole objects as bytes (the objects API; pages go through `_fetch_into`)."""
        self._maybe_rescan()
        items = list(zip(keys, sizes if sizes is not None else [None] * len(keys), strict=True))
        loop = asyncio.get_running_loop()
        parts = await asyncio.gather(
            *(loop.run_in_executor(self._io, self._read_group, g) for g in self._split(items))
        )
        return [fetched for group in parts for fetched in group]

    async def _store(self, keys: list[bytes], objects: list[FramedObject]) -> list[PageStatus]:
        self._maybe_rescan()
        done = self._submit_store(list(zip(keys, objects, strict=True)))
        return await asyncio.wrap_future(done)

    async def _delete(self, keys: list[bytes]) -> int:
        return await self._run(lambda: self._space.remove(keys))

    async def _fetch_into(
        self, keys: list[bytes], views: list[memoryview], guard: CopyGuard
    ) -> list[ReadInto]:
        self._maybe_rescan()
        items = list(zip(keys, views, strict=True))
        loop = asyncio.get_running_loop()
        parts = await asyncio.gather(
            *(
                loop.run_in_executor(self._io, self._read_group_into, group, guard)
                for group in self._split(items, self._read_groups(views))
            )
        )
        self._note_cache_hits(sum(hits for hits, _ in parts), len(keys))
        return [outcome for _, group in parts for outcome in group]

    def _usage(self) -> Usage:
        state = self._space.last_state
        return Usage(
            state.num_objects, state.used_bytes, self.options.capacity_bytes, state.num_evictions
        )

    # -- public extras ------------------------------------------------------------------------

    async def rescan(self) -> None:
        """Rescan the directory now: refresh the LRU index, fix the ledger if it drifted,
        remove temporary files of dead writers. Runs by itself every `scan_interval`."""
        self._check_open()
        await self._ensure_connected()
        await asyncio.wrap_future(self._scanner.submit(self._space.refresh))

    # -- workers ------------------------------------------------------------------------------

    def _read_group(self, items: list[tuple[bytes, int | None]]) -> list[Fetched]:
        return [self._read_page(key, size) for key, size in items]

    def _open_page(self, key: bytes) -> tuple[int, str] | PageStatus | None:
        """(fd, path) of a stored page; None if absent; ERROR (noted) if it can't be opened."""
        path = page_path(self.root, key)
        try:
            return os.open(path, os.O_RDONLY | os.O_CLOEXEC), path
        except FileNotFoundError:
            return None
        except OSError as exc:
            self._note_page_error(f"{path}: {exc}")
            return PageStatus.ERROR

    def _read_page(self, key: bytes, size: int | None) -> Fetched:
        opened = self._open_page(key)
        if not isinstance(opened, tuple):
            return opened
        fd, path = opened
        try:
            st = os.fstat(fd)
            limit = _MAX_OBJECT_BYTES if size is None else self._header_bytes + size
            if st.st_size > limit:
                fetched: Fetched = CorruptReason.LENGTH  # not this page: don't read it
            else:
                fetched = _read_bytes(fd, st.st_size)
        except OSError as exc:
            self._note_page_error(f"{path}: {exc}")
            return PageStatus.ERROR
        finally:
            os.close(fd)
        self._touch(key, path, st.st_mtime_ns)
        return fetched

    def _read_group_into(
        self, items: list[tuple[bytes, memoryview]], guard: CopyGuard
    ) -> tuple[int, list[ReadInto]]:
        """(how many pages the page cache served whole, the outcomes)."""
        self._buffers.cache_hits = 0
        outcomes = [self._read_page_into(key, view, guard) for key, view in items]
        return self._buffers.cache_hits, outcomes

    def _read_page_into(self, key: bytes, view: memoryview, guard: CopyGuard) -> ReadInto:
        opened = self._open_page(key)
        if not isinstance(opened, tuple):
            return opened
        fd, path = opened
        try:
            st = os.fstat(fd)
            outcome = self._stream_into(fd, st.st_size, key, view, guard)
        except OSError as exc:
            self._note_page_error(f"{path}: {exc}")
            return PageStatus.ERROR
        finally:
            os.close(fd)
        if outcome is True:
            self._touch(key, path, st.st_mtime_ns)
        return outcome

    def _stream_into(
        self, fd: int, object_bytes: int, key: bytes, view: memoryview, guard: CopyGuard
    ) -> ReadInto:
        """Header first (refuse early), then the payload, hashed piece by piece.

        Where the page cache holds the page, the kernel copies it straight into the caller's
        buffer (a read that cannot wait, done under the guard). Otherwise each chunk is read
        into this thread's chunk buffer (a read that may wait, never into the caller's
        buffer) and copied on through the guard while it is in cache.
        """
        if len(self._buffers.head) != self._header_bytes:
            self._buffers.head = bytearray(self._header_bytes)
        head, chunk = memoryview(self._buffers.head), memoryview(self._buffers.chunk)
        first = [head, view[: len(chunk)]]  # a small page in one syscall, hashed while hot
        got = self._read_nowait(fd, first, 0, guard)
        if got is None:
            return None
        if got == min(object_bytes, len(head) + len(first[1])):
            self._buffers.cache_hits += 1  # (counts pages whose first chunk was cached)
        if got < len(head):  # not cached: the header and the first chunk the slow way
            got = _preadv_all(fd, [head, chunk], object_bytes)
            in_chunk = max(0, got - len(head))
        else:
            in_chunk = 0
        check = StreamingCheck.start(
            head[: min(got, len(head))],
            key,
            self._layout_bytes,
            object_bytes=object_bytes,
            raw_bytes=len(view),
        )
        if isinstance(check, CorruptReason):
            return check
        if check.header.compression is not Compression.NONE:
            return self._decompress_into(fd, object_bytes, key, view, guard)
        stored, start = check.header.stored_bytes, len(head)
        if in_chunk:
            offset = min(in_chunk, stored)
            check.update(chunk[:offset])
            if not guard.copy(view, 0, chunk[:offset]):
                return None
        else:
            offset = min(got - len(head), stored)
            check.update(view[:offset])  # just written by the kernel: still in cache
        while offset < stored:
            want = min(len(chunk), stored - offset)
            direct = self._read_nowait(fd, [view[offset : offset + want]], start + offset, guard)
            if direct is None:
                return None  # the call is over: its buffers are not ours any more
            if direct:
                check.update(view[offset : offset + direct])
                offset += direct
                continue
            got = os.preadv(fd, [chunk[:want]], start + offset)
            if got == 0:
                break  # shrank under us: finish() says truncated
            check.update(chunk[:got])
            if not guard.copy(view, offset, chunk[:got]):
                return None
            offset += got
        reason = check.finish()
        return True if reason is None else reason

    def _read_nowait(
        self, fd: int, buffers: list[memoryview], offset: int, guard: CopyGuard
    ) -> int | None:
        """Read what the page cache holds straight into `buffers` (the caller's), without ever
        waiting for I/O; 0 when nothing is cached (or the filesystem cannot promise that),
        None when the call is over."""
        if not self._nowait:
            return 0
        with guard.writing() as allowed:
            if not allowed:
                return None
            try:
                return os.preadv(fd, buffers, offset, _RWF_NOWAIT)
            except BlockingIOError:
                return 0
            except OSError as exc:
                if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                    raise
                self._nowait = False  # e.g. NFS: always read through the chunk buffer
                return 0

    def _decompress_into(
        self, fd: int, object_bytes: int, key: bytes, view: memoryview, guard: CopyGuard
    ) -> ReadInto:
        blob = _read_bytes(fd, object_bytes)
        raw = bytearray(len(view))
        reason = decode_object_into(blob, key, self._layout_bytes, raw)
        if reason is not None:
            return reason
        return True if guard.copy(view, 0, memoryview(raw)) else None

    def _touch(self, key: bytes, path: str, mtime_ns: int) -> None:
        """Mark a page used: its mtime is the LRU clock every process shares."""
        now_ns = time.time_ns()
        if now_ns - mtime_ns < self.options.touch_interval_s * 1e9:
            return
        try:
            os.utime(path)
        except OSError:
            return  # evicted since the read, or a read-only mount: the read still counts
        self._space.index.note(key, now_ns)

    def _write_group(self, items: list[tuple[bytes, FramedObject]]) -> list[Staged | None]:
        return [self._write_page(key, obj) for key, obj in items]

    def _write_page(self, key: bytes, obj: FramedObject) -> Staged | None:
        final = page_path(self.root, key)
        tmp = temp_path(final, next(self._serial))
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
        try:
            try:
                fd = os.open(tmp, flags, 0o644)
            except FileNotFoundError:
                os.makedirs(os.path.dirname(final), exist_ok=True)
                fd = os.open(tmp, flags, 0o644)
            try:
                _write_all(fd, [obj.header, obj.payload])
                if self.options.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as exc:
            self._note_page_error(f"{tmp}: {exc}")
            unlink_quiet(tmp)
            return None
        return Staged(key, tmp, obj.nbytes)

    def _commit(self, staged: list[Staged | None]) -> list[PageStatus]:
        statuses = self._space.commit(staged)
        if self.options.fsync:
            dirs = {os.path.dirname(s.temp_path) for s in staged if s is not None}
            for directory in sorted(dirs):
                _fsync_dir(directory)
        return statuses

    def _submit_store(self, items: list[tuple[bytes, FramedObject]]) -> concurrent.futures.Future:
        """Write groups in parallel, then commit them all under one ledger lock.

        Chained with callbacks, not awaited: a store whose caller timed out still commits or
        removes its temporary files, so none are left behind.
        """
        done: concurrent.futures.Future = concurrent.futures.Future()
        done.set_running_or_notify_cancel()  # the caller may stop waiting, not stop the work
        writes = [self._io.submit(self._write_group, g) for g in self._split(items)]
        remaining = [len(writes)]
        lock = threading.Lock()

        def written(_: concurrent.futures.Future) -> None:
            with lock:
                remaining[0] -= 1
                if remaining[0]:
                    return
            try:
                staged = [s for w in writes for s in w.result()]
                commit = self._io.submit(self._commit, staged)
            except BaseException as exc:  # noqa: BLE001 - handed to the awaiting caller
                done.set_exception(exc)
                return
            commit.add_done_callback(lambda f: _copy_outcome(f, done))

        for write in writes:
            write.add_done_callback(written)
        return done

    # -- helpers ------------------------------------------------------------------------------

    def _split(self, items: list, num_groups: int | None = None) -> list[list]:
        """Contiguous slices, one per worker, so results come back in order."""
        if not items:
            return []
        num = min(num_groups or self.options.io_threads, len(items))
        step = -(-len(items) // num)
        return [items[i : i + step] for i in range(0, len(items), step)]

    def _read_groups(self, views: list[memoryview]) -> int:
        """How many workers a batch of reads gets.

        Reads that wait for a device or a server overlap: all `io_threads`. Page-cache hits are
        memory copies with some Python around each: more threads only fight over the GIL, so
        they get one worker per `_CACHED_GROUP_BYTES`. Which kind the next batch will be is
        guessed from the last ones.
        """
        if self._cache_hit_ratio < 0.9:
            return self.options.io_threads
        num_bytes = sum(len(view) for view in views)
        return max(1, min(self.options.io_threads, num_bytes // _CACHED_GROUP_BYTES))

    def _note_cache_hits(self, num_hits: int, num_reads: int) -> None:
        if num_reads:
            self._cache_hit_ratio = 0.8 * self._cache_hit_ratio + 0.2 * num_hits / num_reads

    async def _run(self, fn: Callable[[], object]):
        return await asyncio.get_running_loop().run_in_executor(self._io, fn)

    def _maybe_rescan(self) -> None:
        now = time.monotonic()
        if now < self._next_scan_at or (self._scan is not None and not self._scan.done()):
            return
        if self._scan is not None and self._scan.exception() is not None:
            exc = self._scan.exception()
            self._warnings.warn("scan", f"directory scan failed: {type(exc).__name__}: {exc}")
        self._next_scan_at = now + self.options.scan_interval_s
        self._scan = self._scanner.submit(self._space.refresh)


def _preadv_all(fd: int, buffers: list[memoryview], limit: int) -> int:
    """Fill `buffers` from offset 0 (up to `limit` bytes: the file's size); bytes read."""
    want = min(limit, sum(len(b) for b in buffers))
    got = 0
    while got < want:
        views, skip = [], got
        for buf in buffers:
            if skip >= len(buf):
                skip -= len(buf)
                continue
            views.append(buf[skip:])
            skip = 0
        n = os.preadv(fd, views, got)
        if n == 0:
            break
        got += n
    return got


def _read_bytes(fd: int, nbytes: int) -> bytes:
    chunks = []
    got = 0
    while got < nbytes:
        chunk = os.read(fd, nbytes - got)
        if not chunk:
            break
        chunks.append(chunk)
        got += len(chunk)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def _write_all(fd: int, buffers: list) -> None:
    """writev until every byte is written (a write may stop short, e.g. on a signal)."""
    views = [memoryview(b) for b in buffers if len(b)]
    while views:
        written = os.writev(fd, views)
        while views and written >= len(views[0]):
            written -= len(views[0])
            views.pop(0)
        if views and written:
            views[0] = views[0][written:]


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _copy_outcome(source: concurrent.futures.Future, target: concurrent.futures.Future) -> None:
    exc = source.exception()
    if exc is not None:
        target.set_exception(exc)
    else:
        target.set_result(source.result())


def open_url(url: str, *, layout: str | None = None, name: str = "") -> FileBackend:
    """`file:///abs/path?capacity=100GiB&fsync=false&io_threads=4&timeout=5s&compression=none`."""
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise BackendConfigError(f"{url}: file:// takes a local path (file:///path), not a host")
    path = unquote(parts.path)
    options = options_from_query(FileOptions, parts.query, url=name or url, path=path)
    return FileBackend(options, layout, name=name or url)
