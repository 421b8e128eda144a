"""Writing a batch of pages to `file://`: `BatchWrite` owns one batch's state.

A batch is cut into packs (`cut_into_packs`); each pack is one task on a worker, start to
end: its pages framed (`objects.frame_objects`), the pack written to a temporary name of its
own (`<first key's name>.tmp.<pid>.<n>`) in calls of at most `_WRITE_BYTES`, then linked in
with the ledger locked (`DirectorySpace.commit`: its pages' names made hard links to it,
room made by evicting LRU packs). A reader in this process or any other sees the old page,
the new page or nothing, never a partial one. With `fsync=true` a pack is fsynced before it
is linked, and the folders that got its names after, all at once, before the batch is
answered.

The batch's statuses come when its last pack is in. The tasks are not cancelled when the
caller stops waiting: every pack is either linked in or its temporary file removed. Each
pack makes its own room, so a batch larger than the free room may evict its own first
packs, as the next batch would.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import os
import threading
from collections.abc import Callable, Sequence

from .base import CPUS, PageStatus
from .file_pack import pack_table
from .file_read import _past
from .file_space import DirectorySpace, StagedPack, fsync_folder, page_path, temp_path, unlink_quiet
from .objects import Compression, FramedObject, MacKey, frame_objects
from .workers import WorkerPool, share

_IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024
_WRITE_BYTES = 256 << 10  # at most this much per write call (see write_all)
_PARALLEL_BYTES = 2 << 20  # batches of several times this are cut into packs written in parallel
_SYNC_THREADS = 32  # fsyncs at once (a 32-page batch: up to 32 folders): they wait on the disk


class PackWriter:
    """What every batch write of one backend shares."""

    def __init__(
        self,
        space: DirectorySpace,
        layout: str | None,
        header_bytes: int,
        *,
        compression: Compression,
        mac_key: MacKey | None,
        fsync: bool,
        pack_limit_bytes: int,
        io_threads: int,
        note_error: Callable[[str], None],
    ) -> None:
        self.space = space
        self.root = space.root
        self.layout = layout
        self.header_bytes = header_bytes
        self.compression = compression
        self.mac_key = mac_key
        self.fsync = fsync
        self.pack_limit_bytes = pack_limit_bytes  # (pack_bytes, and 1/16 of the capacity)
        self.io_threads = io_threads
        self.note_error = note_error
        self.serial = itertools.count()  # temporary names of this process
        # fsyncs wait on the disk, not on a core: many at once (one round a batch)
        self.sync_pool = WorkerPool(_SYNC_THREADS, "hicache-file-sync") if fsync else None

    def cut_into_packs(self, sizes: Sequence[int]) -> list[list[int]]:
        """The batch (its objects' `sizes`) cut into packs: lists of positions.

        A pack holds at most `pack_limit_bytes` (eviction frees a pack at a time, so a pack
        stays small next to what the directory holds). A batch of several `_PARALLEL_BYTES`
        is also cut into up to `io_threads` packs (one per core at most) of about equal size,
        written on as many threads; a smaller one stays one pack, which is what reads want
        (one open for the whole batch).
        """
        limit = self.pack_limit_bytes if self.space.hard_links else 1  # (else: a page a pack)
        total = sum(sizes)
        ways = max(1, min(self.io_threads, CPUS, total // _PARALLEL_BYTES))
        limit = min(limit, max(1, -(-total // ways)))
        packs: list[list[int]] = []
        pack: list[int] = []
        size = 0
        for position, nbytes in enumerate(sizes):
            if pack and size + nbytes > limit:
                packs.append(pack)
                pack, size = [], 0
            pack.append(position)
            size += nbytes
        packs.append(pack)
        return packs

    def sync(self, targets: list[str]) -> None:
        """fsync each folder, all at once; OSError if one fails. (A batch of 32 pages names
        about 30 of the 256 folders; one by one each waited for its own journal commit and
        disk flush: 4.6-5.0 ms a batch on a virtual disk, against about 1 ms at once.)"""
        share(self.sync_pool, targets, fsync_folder, min(len(targets), _SYNC_THREADS))

    def close(self) -> None:
        if self.sync_pool is not None:
            self.sync_pool.shutdown(wait=False)


class BatchWrite:
    """One batch: its keys, its pages (framed on the way) or objects framed already, its
    packs, and `sizes`, each object's bytes once framed (what the caller counts)."""

    def __init__(
        self,
        writer: PackWriter,
        keys: list[bytes],
        sources: Sequence[memoryview] | Sequence[FramedObject],
        *,
        framed: bool,
    ) -> None:
        self.writer = writer
        self.keys = keys
        self.sources = sources
        self.framed = framed
        if framed:
            self.sizes = [obj.nbytes for obj in sources]
        else:  # an upper bound until framed: lz4 is kept only where it is smaller
            self.sizes = [writer.header_bytes + len(page) for page in sources]

    def submit(self, pool: WorkerPool) -> concurrent.futures.Future:
        """Write the packs on `pool` (one task each); a future of one status per key."""
        packs = self.writer.cut_into_packs(self.sizes)
        if len(packs) == 1:  # one task: if the caller gives up before it starts, nothing
            return pool.submit(self._put_pack, packs[0])
        done: concurrent.futures.Future = concurrent.futures.Future()
        done.set_running_or_notify_cancel()  # the caller may stop waiting, not stop the work
        tasks = [pool.submit(self._put_pack, pack) for pack in packs]
        remaining = [len(tasks)]
        lock = threading.Lock()

        def finished(_: concurrent.futures.Future) -> None:
            with lock:
                remaining[0] -= 1
                if remaining[0]:
                    return
            statuses = [PageStatus.ERROR] * len(self.keys)
            for pack, task in zip(packs, tasks, strict=True):
                if task.exception() is not None:
                    done.set_exception(task.exception())
                    return
                for i in pack:
                    statuses[i] = task.result()[i]
            done.set_result(statuses)

        for task in tasks:
            task.add_done_callback(finished)
        return done

    def _put_pack(self, positions: list[int]) -> list[PageStatus]:
        """One pack, start to end on this thread: framed, written, linked in. Statuses for
        the whole batch (ERROR outside `positions`)."""
        keys = [self.keys[i] for i in positions]
        if self.framed:
            objects = [self.sources[i] for i in positions]
        else:
            writer = self.writer
            objects = frame_objects(
                keys,
                writer.layout,
                [self.sources[i] for i in positions],
                writer.compression,
                mac_key=writer.mac_key,
            )
            for i, obj in zip(positions, objects, strict=True):
                self.sizes[i] = obj.nbytes
        staged = self._write(positions, keys, objects)
        return self._commit([staged] if staged is not None else [])

    def _write(
        self, positions: list[int], keys: list[bytes], objects: list[FramedObject]
    ) -> StagedPack | None:
        """Write one pack to its temporary name; None if that failed (noted)."""
        writer = self.writer
        table = pack_table(keys, [obj.nbytes for obj in objects])
        parts: list = [table]
        for obj in objects:
            parts += (obj.header, obj.payload)
        tmp = temp_path(page_path(writer.root, keys[0]), next(writer.serial))
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
        try:
            try:
                fd = os.open(tmp, flags, 0o644)
            except FileNotFoundError:
                os.makedirs(os.path.dirname(tmp), exist_ok=True)
                fd = os.open(tmp, flags, 0o644)
            try:
                write_all(fd, parts)
                if writer.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as exc:
            writer.note_error(f"{tmp}: {exc}")
            unlink_quiet(tmp)
            return None
        nbytes = len(table) + sum(obj.nbytes for obj in objects)
        return StagedPack(keys, positions, tmp, nbytes)

    def _commit(self, staged: list[StagedPack]) -> list[PageStatus]:
        """Link the packs in; with `fsync`, the folders that got names are made durable
        before the batch is answered."""
        writer = self.writer
        statuses = writer.space.commit(staged, len(self.keys))
        if writer.fsync:
            folders = {os.path.dirname(page_path(writer.root, k)) for p in staged for k in p.keys}
            writer.sync(sorted(folders))
        return statuses


def write_all(fd: int, buffers: list) -> None:
    """Write the buffers in order, at most `_WRITE_BYTES` per system call.

    Bounded calls, not one writev of the whole pack: a single 2 MiB write into a new file ran
    at a tenth of the speed of the same bytes in 256 KiB calls (measured: 0.3 against 3.3
    GB/s into the page cache of an ext4 directory on a 6.18 kernel; larger page-cache folios
    for larger writes are the likely cause).
    """
    pending = [memoryview(b).cast("B") for b in buffers if len(b)]
    while pending:
        batch, size = [], 0
        while pending and size < _WRITE_BYTES and len(batch) < _IOV_MAX:
            view = pending[0]
            take = view[: _WRITE_BYTES - size]
            batch.append(take)
            size += len(take)
            if len(take) == len(view):
                pending.pop(0)
            else:
                pending[0] = view[len(take) :]
        written = os.writev(fd, batch)
        if written < size:  # stopped short (a signal, a full disk): the rest goes again
            pending[:0] = _past(batch, written)
