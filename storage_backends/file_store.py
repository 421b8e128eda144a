"""`file:///path?capacity=100GiB`: pages in files of a directory many processes may share.

Layout: a batch of pages is written as one pack (`file_pack`: a table, then the pages'
encoded objects), and `<path>/a/b/<32 hex digits of the key>` is a hard link to the pack
that holds that page. A pack is written to a temporary name and its pages linked into place
one by one (a rename when a link is replaced), so a reader in this process or in any other
on the same local, NFS or 3FS directory sees the old page, the new page or nothing, never a
partial one. On a filesystem without hard links (found out when the directory is opened)
every pack holds one page and is renamed into place under its name.

Why packs and not one file per page: reading a page from the page cache is a memory copy of
a few microseconds, and a file per page adds an open, a stat and a close to each, plus the
Python around them. A batch read from a pack costs one open and a table read per pack, a
dictionary lookup per page, and one read per 512 KiB of neighbouring pages, so the copies
and the checksums dominate.

Who does what: `file_read.BatchRead` reads one batch (where a page is verified:
`verify.check_object`, as in every backend), `file_write.BatchWrite` writes one (where a
batch reaches the disk: `file_write.write_all`), `file_space.DirectorySpace` keeps capacity,
LRU and the ledger across processes. This module is the backend around them.

Threads: nothing here makes a system call on the event loop's thread, as any of them (an
open, a stat) can block without end on a hung mount and would stop every deadline with it.
A batch is one task on a worker (`io_threads` of them), which hands parts of a large batch,
and reads that wait for a disk, to idle workers. Several batches may run at once, reads and
writes alike: each owns its state, and nothing serializes them but the ledger's lock while a
pack is linked in. The workers are daemon threads (`workers`): `close()` waits for them only
`close_grace`, and one stuck in a hung mount is abandoned (counted), not joined forever.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

from .base import CPUS, Fetched, PageStatus, ReadInto, StorageBackend
from .buffers import PageView
from .errors import BackendConfigError
from .file_read import BatchRead, PackReader
from .file_space import DirectorySpace, page_path
from .file_write import BatchWrite, PackWriter
from .guard import CopyGuard
from .native import require_pageio
from .objects import FramedObject, header_size
from .options import BackendOptions, check_range, options_from_query, url_option
from .stats import Usage
from .workers import WorkerPool


@dataclass(frozen=True)
class FileOptions(BackendOptions):
    path: str = ""
    capacity_bytes: int = url_option("capacity", "size", 0, doc="bytes on disk, all processes")
    fsync: bool = url_option("fsync", "bool", False, doc="fsync pages and directories on put")
    io_threads: int = url_option("io_threads", "int", 4, doc="parallel file operations")
    pack_bytes: int = url_option(
        "pack_bytes", "size", 64 << 20, doc="at most this much per pack (and 1/16 of capacity)"
    )
    scan_interval_s: float = url_option(
        "scan_interval", "duration", 300.0, doc="directory rescan (LRU index, ledger check)"
    )
    touch_interval_s: float = url_option(
        "touch_interval", "duration", 1.0, doc="a read refreshes a pack's mtime older than this"
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
        check_range("pack_bytes", self.pack_bytes, low=1)
        check_range("scan_interval", self.scan_interval_s, low=0.001)
        check_range("touch_interval", self.touch_interval_s, low=0.0)


class FileBackend(StorageBackend):
    scheme = "file"
    transient_errors = (OSError,)
    takes_pieces = True  # pages in pieces: read into and written from them (the C reader/writer)

    def __init__(self, options: FileOptions, layout: str | None = None, *, name: str = "") -> None:
        require_pageio(f"{name or 'file://'}: the file backend")  # its reads and writes are C
        super().__init__(options, layout, name=name)
        self.options: FileOptions = options
        self.root = options.path
        self._space = DirectorySpace(
            options.path, options.capacity_bytes, link_threads=min(options.io_threads, CPUS)
        )
        signed = self._mac_key is not None  # its pages carry a MAC
        header_bytes = header_size(layout, signed=signed) if layout is not None else 0
        self._reader = PackReader(
            self._space,
            self._layout_bytes,
            header_bytes,
            self._mac_key,
            io_threads=options.io_threads,
            touch_interval_s=options.touch_interval_s,
            note_error=self._note_page_error,
        )
        self._writer = PackWriter(
            self._space,
            layout,
            header_bytes,
            compression=self._compression,
            mac_key=self._mac_key,
            fsync=options.fsync,
            pack_limit_bytes=max(1, min(options.pack_bytes, options.capacity_bytes // 16)),
            io_threads=options.io_threads,
            note_error=self._note_page_error,
        )
        self._io: WorkerPool | None = None
        self._scanner: WorkerPool | None = None
        self._scan: concurrent.futures.Future | None = None
        self._next_scan_at = 0.0
        self._closing: list[WorkerPool] = []

    # -- primitives -------------------------------------------------------------------------

    async def _open(self) -> None:
        if self._io is None:
            self._io = WorkerPool(self.options.io_threads, thread_name_prefix="hicache-file-io")
            self._scanner = WorkerPool(1, thread_name_prefix="hicache-file-scan")
        await self._run(self._space.open)
        if self.options.fsync:
            await self._run(self._space.make_folders_durable)
        if self._scan is None:
            self._next_scan_at = time.monotonic() + self.options.scan_interval_s
            self._scan = self._scanner.submit(self._space.initial_scan)

    async def _reconnect(self) -> None:
        """Reopen the ledger (a stale NFS handle, a remounted directory); keep the index."""
        await self._run(self._space.close)
        await self._run(self._space.open)

    async def _close(self) -> None:
        """Finish the work under way (commits in flight: never leave temporary files), then
        close the ledger. The base bounds the wait by `close_grace` (then `_abandon`)."""
        pools = [pool for pool in (self._io, self._scanner) if pool is not None]
        self._closing = pools
        self._io = self._scanner = None
        for pool in pools:
            pool.shutdown(wait=False)
        for pool in pools:
            await asyncio.wrap_future(pool.stopped())
        self._writer.close()
        closer = WorkerPool(1, thread_name_prefix="hicache-file-close")  # (a close can block)
        try:
            await asyncio.wrap_future(closer.submit(self._space.close))
        finally:
            closer.shutdown(wait=False)

    def _abandon(self) -> int:
        """Workers stuck past the grace (a call into a hung mount) are left to themselves:
        daemon threads, so the process can still exit. The ledger stays open for them."""
        return sum(pool.num_pending() for pool in self._closing)

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
        sizes = sizes if sizes is not None else [None] * len(keys)
        batch = BatchRead(self._reader, keys, self._io)
        return await self._run(lambda: batch.objects(sizes))

    async def _fetch_into(
        self, keys: list[bytes], views: list[PageView], guard: CopyGuard
    ) -> list[ReadInto]:
        """Pages into the caller's buffers (or straight into their pieces), one `BatchRead`
        on a worker."""
        self._maybe_rescan()
        batch = BatchRead(self._reader, keys, self._io)
        return await self._run(lambda: batch.into(views, guard))

    async def _store(self, keys: list[bytes], objects: list[FramedObject]) -> list[PageStatus]:
        """Objects framed already (the objects API)."""
        self._maybe_rescan()
        batch = BatchWrite(self._writer, keys, objects, framed=True)
        return await asyncio.wrap_future(batch.submit(self._io))

    async def _frame_and_store(self, keys: list[bytes], views: list[PageView]) -> list[bool]:
        """Pages (one buffer each, or their pieces): each pack is framed by the thread that
        writes it (one hand-off per pack), pieces hashed and written where they lie."""
        batch = BatchWrite(self._writer, keys, views, framed=False)

        def store() -> asyncio.Future:
            self._maybe_rescan()
            return asyncio.wrap_future(batch.submit(self._io))

        statuses = await self._call("batch_put", store)
        return self._count_stores("batch_put", statuses, batch.sizes)

    async def _delete(self, keys: list[bytes]) -> int:
        removed, failed = await self._run(lambda: self._space.remove(keys))
        if failed:
            self._counts["errors"] += len(failed)
            self._note_page_error(failed[-1])
            self._tally.warn_page_errors("delete", len(failed))
        return removed

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

    # -- helpers ------------------------------------------------------------------------------

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


def open_url(url: str, *, layout: str | None = None, name: str = "") -> FileBackend:
    """`file:///abs/path?capacity=100GiB&fsync=false&io_threads=4&timeout=5s&compression=none`."""
    require_pageio(f"{name or url}: the file backend")  # before its options: none can help
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise BackendConfigError(f"{url}: file:// takes a local path (file:///path), not a host")
    path = unquote(parts.path)
    options = options_from_query(FileOptions, parts.query, url=name or url, path=path)
    return FileBackend(options, layout, name=name or url)
