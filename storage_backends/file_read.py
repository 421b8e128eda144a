"""Reading a batch of pages from `file://` packs: `BatchRead` owns one batch's state.

A batch read, on a worker thread (never the event loop's: an open can block without end on
a hung mount):

1. `locate`: each key's pack, looked up first in the packs this batch has opened (a batch
   usually comes from a few packs written together), else opened through the key's own name;
2. the page cache's share: pages that lie next to each other in a pack, at the size this
   backend writes, form stretches of up to `_STRETCH_BYTES`; the C reader
   (`pageio.read_stretches`, one call, its own threads, no GIL) reads each with `preadv`s
   that never wait (RWF_NOWAIT), headers and pages straight into place (a page in pieces,
   an engine's page scattered over its pool, straight into its pieces), a window of
   `_WINDOW_BYTES` at a time, and checks each page, hashing each window as it lands;
3. what the page cache lacked (or the filesystem cannot promise, NFS): page by page, through
   this thread's chunk buffer, from as many workers as there are such pages (they wait on a
   disk or a server, so they overlap).

Every page, whichever step read it, is checked by the one C check (key, layout, lengths,
checksum: `check_parts` in `_pageio.c`), inside the C reader for step 2 and through
`verify.check_object` for step 3, which also names the reason; with a tenant secret the
MAC is checked after it (`verify.mac_matches`).

A read never lets a late write reach the caller's buffer: once `batch_get` has returned
(on a timeout too) the engine may hand that L2 page to something else. So the kernel writes
into the caller's buffer only with RWF_NOWAIT (a page-cache hit: a memory copy) under the
call's `CopyGuard`; a read that may wait goes into the thread's own chunk buffer and is
copied on through the guard, which refuses once the call is over.

Several batches may be read at once (each is its own `BatchRead`); what they share, the
`PackReader`, holds nothing a read changes but the RWF_NOWAIT flag (cleared once, for good,
when the filesystem refuses it).
"""

from __future__ import annotations

import errno
import os
import threading
import time
from collections.abc import Callable, Sequence

from .base import CPUS, Fetched, PageStatus, ReadInto
from .buffers import PageView, page_nbytes, page_pieces
from .file_pack import PackTable, read_table
from .file_space import DirectorySpace, page_path
from .guard import CopyGuard
from .native import pageio
from .objects import MAC_BYTES, CorruptReason, parse_header
from .verify import check_object, decode_object_into, mac_matches, reason_of
from .workers import WorkerPool, share

_MAX_OBJECT_BYTES = 1 << 30  # objects read without an expected size: larger is not a page
_CHUNK_BYTES = 256 << 10  # a read that may wait lands in this much of the thread's own buffer
_RWF_NOWAIT = getattr(os, "RWF_NOWAIT", 0)  # Linux >= 4.14: fail rather than wait for I/O
_STRETCH_BYTES = 512 << 10  # cached pages next to each other: read this much per call...
_STRETCH_PAGES = 64  # ... and at most this many pages
_STRETCH_BUFFERS = 1024  # ... of this many buffers (headers and pieces: one preadv's iovecs)
# What one of the C reader's reads takes in. It hashes each window right after the kernel
# copied it, while it is still in the core's cache: a 1.75 MiB page read whole and then
# hashed was read from memory twice, and memory is what a host's parallel reads run out of.
# 128 KiB was within 1 % of the best window on the H200 host and level with the best on a
# 2-core VM (benchmarks/bench_file_read.py; figures in docs/performance.md).
_WINDOW_BYTES = 128 << 10
# A batch's page-cache copies take a C pool thread per this much (they never take the GIL,
# and wake in microseconds).
_HELPER_BYTES = 512 << 10
_PENDING = object()  # an outcome not decided yet
_UNSUPPORTED = -2  # the filesystem has no RWF_NOWAIT


class PackReader:
    """What every batch read of one backend shares (read-only, but for `nowait`)."""

    def __init__(
        self,
        space: DirectorySpace,
        layout: bytes | None,
        header_bytes: int,
        mac_key: bytes | None,
        *,
        io_threads: int,
        touch_interval_s: float,
        note_error: Callable[[str], None],
    ) -> None:
        self.space = space
        self.root = space.root
        self.layout = layout
        self.header_bytes = header_bytes  # of the objects this backend writes (MAC included)
        self.mac_key = mac_key
        self.io_threads = io_threads
        self.touch_interval_s = touch_interval_s
        self.note_error = note_error
        self.nowait = bool(_RWF_NOWAIT)  # cleared when the filesystem refuses RWF_NOWAIT
        self._chunks = threading.local()

    def chunk(self) -> memoryview:
        """This thread's chunk buffer (reads that may wait land here, never in the caller's)."""
        chunk = getattr(self._chunks, "buffer", None)
        if chunk is None:
            chunk = self._chunks.buffer = memoryview(bytearray(_CHUNK_BYTES))
        return chunk

    def touch(self, pack: PackTable) -> None:
        """Mark a pack used: its mtime is the LRU clock every process shares."""
        now_ns = time.time_ns()
        if now_ns - pack.mtime_ns < self.touch_interval_s * 1e9:
            return
        try:
            os.utime(pack.fd)
        except OSError:
            return  # a read-only mount: the read still counts
        self.space.index.touch(pack.ino, now_ns)


class BatchRead:
    """One batch: its keys, the caller's buffers (pages) or sizes (objects), the packs it
    opened, one outcome per key. Use once, on a worker: `into()` or `objects()`."""

    def __init__(self, reader: PackReader, keys: Sequence[bytes], pool: WorkerPool) -> None:
        self.reader = reader
        self.keys = keys
        self.pool = pool  # helpers for a large batch, or for reads that wait
        self.outcomes: list = [_PENDING] * len(keys)
        self.packs: list[PackTable | None] = [None] * len(keys)  # where each key is
        self._opened: list[PackTable] = []

    # -- the two reads --------------------------------------------------------------------

    def into(self, views: Sequence[PageView], guard: CopyGuard) -> list[ReadInto]:
        """Pages into the caller's `views` (exactly each page's size; a page in pieces is
        read straight into them), under `guard`."""
        self.views, self.guard = views, guard
        self.pieces = [page_pieces(view) for view in views]
        self.sizes = [page_nbytes(view) for view in views]
        heads = bytearray(self.reader.header_bytes * len(views))
        size = self.reader.header_bytes
        self.heads = [memoryview(heads)[i * size : (i + 1) * size] for i in range(len(views))]
        try:
            self._locate()
            if self.reader.nowait:
                self._read_cached()
            left = [i for i, outcome in enumerate(self.outcomes) if outcome is _PENDING]
            share(self.pool, left, self._read_page, min(len(left), self.reader.io_threads))
        finally:
            self._close()
        return self.outcomes

    def objects(self, sizes: Sequence[int | None]) -> list[Fetched]:
        """Whole objects as bytes (at most header + size bytes each, where a size is given)."""
        self.sizes = sizes
        try:
            self._locate()
            found = [i for i, outcome in enumerate(self.outcomes) if outcome is _PENDING]
            share(self.pool, found, self._read_object, min(len(found), self.reader.io_threads))
        finally:
            self._close()
        return self.outcomes

    # -- finding the packs ----------------------------------------------------------------

    def _locate(self) -> None:
        """Each key's pack: one this batch opened that holds it, else the one its name links
        to. Absent keys are None; a pack that fails to open ERROR; a damaged table its
        reason."""
        for i, key in enumerate(self.keys):
            for table in self._opened:
                if key in table.entries:
                    self.packs[i] = table
                    break
            else:
                table = self._open_pack(key)
                if isinstance(table, PackTable):
                    self._opened.append(table)
                    self.packs[i] = table
                else:
                    self.outcomes[i] = table

    def _open_pack(self, key: bytes) -> PackTable | PageStatus | CorruptReason | None:
        """The pack `key`'s name links to, its table read. A pack whose table lacks the key
        was replaced under us (the page written again and its old entry cleared between our
        open and our read of the table): the name is opened once more. A table still without
        it is damage, for the reader to report."""
        path = page_path(self.reader.root, key)
        table = self._open_table(path)
        if isinstance(table, PackTable) and key not in table.entries:
            os.close(table.fd)
            table = self._open_table(path)
        return table

    def _open_table(self, path: str) -> PackTable | PageStatus | CorruptReason | None:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        except OSError as exc:
            self.reader.note_error(f"{path}: {exc}")
            return PageStatus.ERROR
        try:
            table = read_table(fd, os.fstat(fd), path)
        except OSError as exc:
            self.reader.note_error(f"{path}: {exc}")
            table = PageStatus.ERROR
        if not isinstance(table, PackTable):
            os.close(fd)
        return table

    def _close(self) -> None:
        """Mark the packs that served a page used, and close them all."""
        for table in self._opened:
            if table.served:
                self.reader.touch(table)
            os.close(table.fd)

    # -- step 2: the page cache's share, by stretches -------------------------------------

    def _read_cached(self) -> None:
        """Read and check the stretches that the page cache holds whole: one call of the C
        reader (`read_stretches`), on this thread and its pool threads, one per
        `_HELPER_BYTES` of the batch. Leaves the rest `_PENDING`."""
        total = sum(self.sizes)
        threads = max(1, min(total // _HELPER_BYTES, self.reader.io_threads, CPUS))
        stretch_bytes = _STRETCH_BYTES
        if threads > 1:  # about four stretches per thread, so that they finish together
            stretch_bytes = min(_STRETCH_BYTES, max(128 << 10, total // (4 * threads)))
        runs = self._stretches(stretch_bytes)
        if not runs:
            return
        work = []
        for first, end in runs:
            table = self.packs[first]
            buffers = [part for j in range(first, end) for part in (self.heads[j], self.views[j])]
            work.append((table.fd, table.entries[self.keys[first]][0], buffers, first))
        codes = bytearray(len(self.keys))
        if not self.guard.enter():  # the call is over: nothing may land in its buffers
            for first, end in runs:
                _fill(self.outcomes, range(first, end), None)
            return
        try:
            got = pageio.read_stretches(
                work,
                b"".join(self.keys),
                self.reader.layout,
                codes,
                min(threads, len(runs)),
                _WINDOW_BYTES,
            )
        finally:
            self.guard.leave()
        for (first, end), read in zip(runs, got, strict=True):
            self._settle_stretch(first, end, read, codes)

    def _settle_stretch(self, first: int, end: int, read: int, codes: bytearray) -> None:
        """The outcomes of one stretch the C reader read (`read` bytes; -1: an error, -2: no
        RWF_NOWAIT here) and checked (`codes`). A page it did not read whole (code 0: the
        page cache lacked it, or an error, which the page by page read reports) is left
        `_PENDING`, to be read page by page."""
        table = self.packs[first]
        if read == _UNSUPPORTED:
            self.reader.nowait = False  # e.g. NFS: every read through the chunk buffer
        for j in range(first, end):
            if not codes[j]:
                continue
            reason = reason_of(codes[j])
            if reason is None and self.reader.mac_key is not None:
                reason = self._forged(j)
            self.outcomes[j] = True if reason is None else reason
            table.served = table.served or reason is None

    def _stretches(self, stretch_bytes: int) -> list[tuple[int, int]]:
        """The batch cut into (first, end) runs of positions whose objects lie back to back
        in one pack, each of the size this backend writes."""
        size = self.reader.header_bytes
        runs: list[tuple[int, int]] = []
        num = len(self.keys)
        i = 0
        while i < num:
            table = self.packs[i]
            entry = table.entries.get(self.keys[i]) if table is not None else None
            if entry is None or entry[1] != size + self.sizes[i]:
                i += 1  # not found, lz4 or damaged: page by page
                continue
            end, stop = i + 1, entry[0] + entry[1]
            limit = min(num, i + _STRETCH_PAGES)
            buffers = 1 + len(self.pieces[i])  # the C reader's iovecs: a header, the pieces
            while end < limit and stop - entry[0] < stretch_bytes and self.packs[end] is table:
                following = table.entries.get(self.keys[end])
                buffers += 1 + len(self.pieces[end])
                if following != (stop, size + self.sizes[end]) or buffers > _STRETCH_BUFFERS:
                    break
                stop += following[1]
                end += 1
            if stop <= table.file_bytes:  # (else a damaged table: page by page)
                runs.append((i, end))
            i = end
        return runs

    # -- step 3: page by page -------------------------------------------------------------

    def _read_page(self, i: int) -> None:
        """One page the stretches left: read into place (what the page cache holds directly,
        the rest through the chunk buffer), then checked."""
        table, key, size = self.packs[i], self.keys[i], self.sizes[i]
        # (room for a MAC: a reader without a secret reads objects that carry one)
        entry = table.find(key, self.reader.header_bytes + MAC_BYTES + size)
        if isinstance(entry, CorruptReason):
            self.outcomes[i] = entry
            return
        offset, length = entry
        try:
            if length != self.reader.header_bytes + size:
                self.outcomes[i] = self._read_aside(table, offset, length, i)
                return
            buffers = [self.heads[i], *self.pieces[i]]
            got = 0
            while got < length:
                got_now = self._read_some(table.fd, _past(buffers, got), offset + got)
                if not got_now:  # None: the call is over; 0: the file shrank under us
                    self.outcomes[i] = None if got_now is None else CorruptReason.TRUNCATED
                    return
                got += got_now
        except OSError as exc:
            self.reader.note_error(f"{table.path}: {exc}")
            self.outcomes[i] = PageStatus.ERROR
            return
        self._settle(i, table)

    def _read_some(self, fd: int, buffers: list[memoryview], offset: int) -> int | None:
        """Read at `offset` into `buffers`: straight in what the page cache holds, else up to
        a chunk through this thread's buffer (a read that may wait), copied on through the
        guard. Bytes read; None when the call is over."""
        direct = self._nowait_into(fd, buffers, offset)
        if direct != 0:
            return direct
        chunk = self.reader.chunk()
        want = min(len(chunk), sum(len(b) for b in buffers))
        got = _read_waiting(fd, chunk[:want], offset)
        done = 0
        for buffer in buffers:
            if done >= got:
                break
            take = min(len(buffer), got - done)
            if not self.guard.copy(buffer, 0, chunk[done : done + take]):
                return None
            done += take
        return got

    def _nowait_into(self, fd: int, buffers: list[memoryview], offset: int) -> int | None:
        """Bytes the page cache had for `buffers` at `offset`, read under the guard with a
        read that never waits: 0 if none was cached (or the filesystem cannot promise that),
        None if the call is over."""
        if not self.reader.nowait:
            return None if self.guard.closed else 0
        if not self.guard.enter():
            return None
        try:
            return os.preadv(fd, buffers, offset, _RWF_NOWAIT)
        except BlockingIOError:
            return 0
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                raise
            self.reader.nowait = False  # e.g. NFS: every read through the chunk buffer
            return 0
        finally:
            self.guard.leave()

    def _read_aside(self, table: PackTable, offset: int, length: int, i: int) -> ReadInto:
        """An object not of the size this backend writes (lz4; one without a MAC under a
        secret; one with a MAC without): read whole (`length` is bounded by the table
        lookup), checked and decoded aside, then copied in."""
        blob = _pread_bytes(table.fd, length, offset)
        raw = memoryview(bytearray(self.sizes[i]))
        reader = self.reader
        reason = decode_object_into(blob, self.keys[i], reader.layout, raw, mac_key=reader.mac_key)
        if reason is not None:
            return reason
        done = 0
        for piece in self.pieces[i]:
            if not self.guard.copy(piece, 0, raw[done : done + len(piece)]):
                return None
            done += len(piece)
        table.served = True
        return True

    def _forged(self, i: int) -> CorruptReason | None:
        """FORGED where page `i`, checked already by the C reader, lacks this tenant's MAC."""
        head = self.heads[i]
        header = parse_header(head)
        if isinstance(header, CorruptReason):
            return header  # (not after a passed check)
        if mac_matches(self.reader.mac_key, header, head, self.pieces[i]):
            return None
        return CorruptReason.FORGED

    def _settle(self, i: int, table: PackTable) -> None:
        """Check page `i`, read into place whole: True, or why not."""
        reader = self.reader
        checked = check_object(
            [self.heads[i], *self.pieces[i]],
            self.keys[i],
            reader.layout,
            raw_bytes=self.sizes[i],
            mac_key=reader.mac_key,
        )
        if isinstance(checked, CorruptReason):
            self.outcomes[i] = checked
        else:
            self.outcomes[i] = True
            table.served = True

    # -- objects ----------------------------------------------------------------------------

    def _read_object(self, i: int) -> None:
        table, key, size = self.packs[i], self.keys[i], self.sizes[i]
        limit = _MAX_OBJECT_BYTES if size is None else self.reader.header_bytes + size
        entry = table.find(key, limit)  # (longer: not this page, don't read it)
        if isinstance(entry, CorruptReason):
            self.outcomes[i] = entry
            return
        try:
            self.outcomes[i] = _pread_bytes(table.fd, entry[1], entry[0])
        except OSError as exc:
            self.reader.note_error(f"{table.path}: {exc}")
            self.outcomes[i] = PageStatus.ERROR
            return
        table.served = True


def _fill(outcomes: list, positions: Sequence[int], outcome: object) -> None:
    for i in positions:
        if outcomes[i] is _PENDING:
            outcomes[i] = outcome


def _read_waiting(fd: int, buffer: memoryview, offset: int) -> int:
    """A read that may wait for a disk or a server (into a buffer of our own, never the
    caller's)."""
    return os.preadv(fd, [buffer], offset)


def _pread_bytes(fd: int, nbytes: int, offset: int) -> bytes:
    chunks = []
    got = 0
    while got < nbytes:
        chunk = os.pread(fd, nbytes - got, offset + got)
        if not chunk:
            break
        chunks.append(chunk)
        got += len(chunk)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def _past(buffers: list[memoryview], skip: int) -> list[memoryview]:
    """Views of what `buffers` hold after their first `skip` bytes."""
    rest = []
    for view in buffers:
        if skip >= len(view):
            skip -= len(view)
            continue
        rest.append(view[skip:])
        skip = 0
    return rest
