"""Writing a batch of pages to `file://`: `BatchWrite` owns one batch's state.

A batch is one task on a worker, start to end:

1. cut into packs (`PackWriter.cut_into_packs`): one per `_PARALLEL_BYTES`, at most one per
   core and per worker, each at most `pack_bytes`;
2. framed and written by the C writer in one call (`pageio.write_packs`, a thread per pack,
   no GIL): each pack to a temporary name of its own (`<first key's name>.tmp.<pid>.<n>`),
   its table then its objects, in calls of at most 256 KiB. Uncompressed pages are framed
   there, a page in pieces (an engine's page scattered over its pool) hashed and gathered
   by writev where its pieces lie; lz4 and a tenant's MAC are applied before
   (`objects.frame_objects`, to the page joined), and the C writer writes those objects as
   they are;
3. linked in with the ledger locked (`DirectorySpace.commit`: the pages' names made hard
   links to their pack, on several threads, room made by evicting LRU packs). A reader in
   this process or any other sees the old page, the new page or nothing, never a partial one;
4. with `fsync=true`, the packs and the folders that got their names fsynced all at once
   (`pageio.sync_all`) before the batch is answered.

The task is not cancelled once it runs: every pack is either linked in or its temporary
file removed. A power cut after step 3 and before step 4 can leave names of a pack whose
bytes never reached the disk: its pages then fail their checksums, misses like any torn
page, and the put was never acknowledged.
"""

from __future__ import annotations

import concurrent.futures
import errno
import itertools
import os
from collections.abc import Callable, Sequence

from .base import CPUS, PageStatus
from .buffers import PageView, joined_page, page_nbytes
from .file_pack import pack_table
from .file_space import DirectorySpace, StagedPack, page_path, temp_path
from .native import pageio
from .objects import Compression, FramedObject, MacKey, frame_objects, layout_bytes, plain_template
from .workers import WorkerPool

_PARALLEL_BYTES = 1 << 20  # batches of several times this are cut into packs written in parallel
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
        self.layout_bytes = layout_bytes(layout) if layout is not None else b""
        self.plain = plain_template(self.layout_bytes)  # what the C writer frames pages from
        self.header_bytes = header_bytes
        self.compression = compression
        self.mac_key = mac_key
        self.fsync = fsync
        self.pack_limit_bytes = pack_limit_bytes  # (pack_bytes, and 1/16 of the capacity)
        self.io_threads = io_threads
        self.note_error = note_error
        self.serial = itertools.count()  # temporary names of this process

    def frames_natively(self) -> bool:
        """Whether the C writer frames this backend's pages (uncompressed, no MAC)."""
        return self.compression is Compression.NONE and self.mac_key is None

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

    def sync(self, targets: list[int | str]) -> None:
        """fsync each target (an open pack, or a folder by path), all at once; OSError if one
        fails. (A batch of 32 pages names about 30 of the 256 folders; one by one each waited
        for its own journal commit and disk flush, several times as long as all at once:
        docs/performance.md.)"""
        threads = max(1, min(len(targets), _SYNC_THREADS))
        for target, error in zip(targets, pageio.sync_all(targets, threads), strict=True):
            if error:
                raise OSError(error, f"fsync failed: {os.strerror(error)}", str(target))

    def close(self) -> None:
        """Nothing to release (the C pool's threads outlive any backend)."""


class BatchWrite:
    """One batch: its keys, its pages (framed on the way) or objects framed already, its
    packs, and `sizes`, each object's bytes once framed (what the caller counts)."""

    def __init__(
        self,
        writer: PackWriter,
        keys: list[bytes],
        sources: Sequence[PageView] | Sequence[FramedObject],
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
            self.sizes = [writer.header_bytes + page_nbytes(page) for page in sources]

    def submit(self, pool: WorkerPool) -> concurrent.futures.Future:
        """Write the batch on `pool` (one task); a future of one status per key. If the
        caller gives up before the task starts, nothing is written."""
        return pool.submit(self._put)

    def _put(self) -> list[PageStatus]:
        """Frame (where the C writer does not), write, link in, make durable."""
        writer = self.writer
        objects: Sequence[FramedObject] | None = self.sources if self.framed else None
        if objects is None and not writer.frames_natively():
            objects = frame_objects(  # (lz4 and the MAC take a page as one buffer)
                self.keys,
                writer.layout,
                [joined_page(page) for page in self.sources],
                writer.compression,
                mac_key=writer.mac_key,
            )
        if objects is not None:
            self.sizes[:] = [obj.nbytes for obj in objects]
        packs = [self._stage(p, objects) for p in writer.cut_into_packs(self.sizes)]
        written = self._write([pack for pack, _ in packs], [work for _, work in packs])
        if not writer.fsync:
            return writer.space.commit(written, len(self.keys))
        unsynced: list[int] = []
        try:
            for pack in written:
                unsynced.append(os.open(pack.temp_path, os.O_RDONLY | os.O_CLOEXEC))
            statuses = writer.space.commit(written, len(self.keys))
            folders = {os.path.dirname(page_path(writer.root, k)) for p in written for k in p.keys}
            writer.sync([*unsynced, *sorted(folders)])
            return statuses
        finally:
            for fd in unsynced:
                os.close(fd)

    def _stage(
        self, positions: list[int], objects: Sequence[FramedObject] | None
    ) -> tuple[StagedPack, tuple]:
        """One pack: what the ledger will take in, and what the C writer takes, (temp,
        table, keys, pages, headers) for pages it frames, (temp, table, None, parts, None)
        for objects framed already."""
        keys = [self.keys[i] for i in positions]
        temp = temp_path(page_path(self.writer.root, keys[0]), next(self.writer.serial))
        table = pack_table(keys, [self.sizes[i] for i in positions])
        pack = StagedPack(keys, positions, temp, len(table) + sum(self.sizes[i] for i in positions))
        if objects is None:
            pages = [self.sources[i] for i in positions]
            headers = bytearray(self.writer.header_bytes * len(pages))
            return pack, (temp, table, b"".join(keys), pages, headers)
        parts = [part for i in positions for part in (objects[i].header, objects[i].payload)]
        return pack, (temp, table, None, parts, None)

    def _write(self, staged: list[StagedPack], work: list[tuple]) -> list[StagedPack]:
        """Write every pack in one call of the C writer (a directory removed under us is made
        again, and its packs written once more); the packs written, the others noted."""
        writer = self.writer
        threads = max(1, min(len(work), writer.io_threads, CPUS))
        errors = pageio.write_packs(work, writer.plain, writer.layout_bytes, threads)
        if errno.ENOENT in errors and writer.space.make_root():
            again = [i for i, error in enumerate(errors) if error == errno.ENOENT]
            retried = pageio.write_packs(
                [work[i] for i in again], writer.plain, writer.layout_bytes, threads
            )
            for i, error in zip(again, retried, strict=True):
                errors[i] = error
        written = []
        for pack, error in zip(staged, errors, strict=True):
            if error:
                writer.note_error(f"{pack.temp_path}: {os.strerror(error)}")
            else:
                written.append(pack)
        return written
