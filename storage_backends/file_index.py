"""What a `file://` directory holds, as this process knows it: a scan of the packs on disk
(`scan_directory`), and the eviction candidates oldest first (`PackIndex`).

A pack's mtime is the LRU clock every process shares (a write sets it, a read refreshes it);
the index is this process's view of those clocks, from the last scan plus its own writes
and reads since. `file_space` evicts from it.
"""

from __future__ import annotations

import heapq
import os
import threading
import time
from typing import NamedTuple

from .buffers import KEY_BYTES

_HEX = frozenset("0123456789abcdef")
# A temporary file this old is a dead writer's (a pack is written and linked in within a
# batch's time: seconds even on a slow mount); a scan removes it.
STALE_TEMP_S = 600.0
TEMP_MARK = ".tmp."  # in the name of a pack being written (file_space.temp_path)


class PackInfo(NamedTuple):
    """One pack as seen on disk: its inode, size, mtime, and the page keys linked to it."""

    ino: int
    nbytes: int
    mtime_ns: int
    keys: tuple[bytes, ...]


class DirectoryScan(NamedTuple):
    packs: list[PackInfo]  # oldest mtime first
    total_bytes: int  # bytes of the packs (each counted once, however many links it has)
    num_objects: int  # page links
    num_stale_temps: int  # temporary files of dead writers removed by this scan


def scan_directory(root: str) -> DirectoryScan:
    """Every page link under root, grouped into packs; remove long-dead temporary files."""
    packs: dict[int, list] = {}  # ino -> [size, mtime, keys]
    links = 0
    stale = 0
    stale_before_ns = time.time_ns() - int(STALE_TEMP_S * 1e9)
    for top in _hex_dirs(root):
        for sub in _hex_dirs(top.path):
            prefix = top.name + sub.name
            with os.scandir(sub.path) as entries:
                for entry in entries:
                    name = entry.name
                    try:
                        if TEMP_MARK in name:
                            if entry.stat().st_mtime_ns < stale_before_ns:
                                os.unlink(entry.path)
                                stale += 1
                        elif len(name) == 2 * KEY_BYTES and name.startswith(prefix):
                            if not _HEX.issuperset(name):
                                continue
                            st = entry.stat(follow_symlinks=False)
                            found = packs.setdefault(st.st_ino, [st.st_size, st.st_mtime_ns, []])
                            found[2].append(bytes.fromhex(name))
                            links += 1
                    except FileNotFoundError:
                        continue  # evicted or renamed by another process while we looked
    infos = [PackInfo(ino, size, mtime, tuple(keys)) for ino, (size, mtime, keys) in packs.items()]
    infos.sort(key=lambda info: info.mtime_ns)
    return DirectoryScan(infos, sum(info.nbytes for info in infos), links, stale)


def _hex_dirs(path: str) -> list[os.DirEntry]:
    try:
        with os.scandir(path) as entries:
            return [
                e
                for e in entries
                if len(e.name) == 1 and _HEX.issuperset(e.name) and e.is_dir(follow_symlinks=False)
            ]
    except FileNotFoundError:
        return []


class PackIndex:
    """Eviction candidates, oldest first: the last scan, then this process's own activity.

    A lazy min-heap of (mtime, inode) over the packs this process knows: noting a pack again
    pushes a newer entry and leaves the old one to be skipped. Thread-safe: readers note
    touches while the committer pops candidates.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._packs: dict[int, PackInfo] = {}
        self._noted_ns: dict[int, int] = {}  # when this process last noted each pack
        self._heap: list[tuple[int, int]] = []

    def load(self, scan: DirectoryScan, *, started_ns: int) -> None:
        """Replace what was scanned before; keep packs noted after this scan started."""
        with self._lock:
            recent = {ino: self._packs[ino] for ino, t in self._noted_ns.items() if t >= started_ns}
            self._packs = {info.ino: info for info in scan.packs}
            self._packs.update(recent)
            self._noted_ns = {ino: self._noted_ns[ino] for ino in recent}
            self._heap = [(info.mtime_ns, info.ino) for info in self._packs.values()]
            heapq.heapify(self._heap)

    def add(self, info: PackInfo) -> None:
        with self._lock:
            self._packs[info.ino] = info
            self._noted_ns[info.ino] = time.time_ns()
            heapq.heappush(self._heap, (info.mtime_ns, info.ino))

    def touch(self, ino: int, mtime_ns: int) -> None:
        """A pack was used at `mtime_ns` (unknown packs wait for the next scan)."""
        with self._lock:
            info = self._packs.get(ino)
            if info is None or info.mtime_ns >= mtime_ns:
                return
            self._packs[ino] = info._replace(mtime_ns=mtime_ns)
            self._noted_ns[ino] = time.time_ns()
            heapq.heappush(self._heap, (mtime_ns, ino))

    def pop_oldest(self) -> PackInfo | None:
        with self._lock:
            while self._heap:
                mtime, ino = heapq.heappop(self._heap)
                info = self._packs.get(ino)
                if info is not None and info.mtime_ns == mtime:
                    del self._packs[ino]
                    self._noted_ns.pop(ino, None)
                    return info
            return None

    def __len__(self) -> int:
        with self._lock:
            return len(self._packs)
