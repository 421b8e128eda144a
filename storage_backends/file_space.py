"""Space accounting of a `file://` directory that several processes share.

Many engine processes (on one host, or on many hosts over NFS / 3FS) may write one cache
directory at once. They agree on two things:

- **How many bytes are stored**: a small ledger file, `.hicache-ledger`, holds the totals.
  Every change of what is committed (a rename into place, an eviction, a delete) happens with
  the ledger locked (`flock`, plus one lock per process for its threads) and updates it in the
  same critical section, so the totals are exact and the capacity is never exceeded by
  committed pages. Temporary files being written are not counted until they are renamed in.
- **What is least recently used**: each page file's mtime. A write sets it; a read that finds
  it older than `touch_interval_s` sets it to now. Each process keeps an index of the files
  it knows in mtime order (from a periodic directory scan, plus its own writes and reads
  since), and re-checks a candidate's mtime before evicting it, so a page another process
  read recently is never taken as old. Pages written by others since the last scan are
  newer than anything scanned, so missing them from the index does not break LRU order.

The ledger can drift only if a process dies between a rename and its ledger update, or if
files are removed by hand. The periodic scan detects it: with `churn` the bytes added plus
removed while it ran, a scan total further than `churn` from the ledger's cannot be explained
by concurrent writers, and the ledger is rebuilt from a scan done under the lock.

Nothing here reads page contents: that is `file_store`'s job.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import logging
import os
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from typing import NamedTuple

import numpy as np

from .base import PageStatus
from .objects import KEY_BYTES

logger = logging.getLogger(__name__)

LEDGER_NAME = ".hicache-ledger"
_LEDGER = struct.Struct("<8s5q")
_LEDGER_MAGIC = b"HCLEDG01"
_HEX = frozenset("0123456789abcdef")
_TEMP_MARK = ".tmp."


def page_path(root: str, key: bytes) -> str:
    """<root>/ab/cd/abcd...: two levels of 256-way fan-out keep every directory small."""
    name = key.hex()
    return os.path.join(root, name[:2], name[2:4], name)


def temp_path(path: str, serial: int) -> str:
    return f"{path}{_TEMP_MARK}{os.getpid()}.{serial}"


@dataclasses.dataclass
class LedgerState:
    valid: bool = False  # False: the ledger is new or unreadable and must be rebuilt by a scan
    used_bytes: int = 0
    num_objects: int = 0
    churn_bytes: int = 0  # bytes added plus bytes removed, ever: the drift test's yardstick
    num_changes: int = 0  # objects added plus removed, ever
    num_evictions: int = 0

    def pack(self) -> bytes:
        return _LEDGER.pack(
            _LEDGER_MAGIC,
            self.used_bytes,
            self.num_objects,
            self.churn_bytes,
            self.num_changes,
            self.num_evictions,
        )

    @classmethod
    def unpack(cls, data: bytes) -> LedgerState:
        if len(data) < _LEDGER.size:
            return cls()
        magic, *values = _LEDGER.unpack_from(data)
        if magic != _LEDGER_MAGIC or min(values) < 0:
            return cls()
        return cls(True, *values)


_PROCESS_LOCKS: dict[str, threading.Lock] = {}
_PROCESS_LOCKS_GUARD = threading.Lock()


def _process_lock(path: str) -> threading.Lock:
    """One lock per ledger per process: flock alone does not order this process's threads
    (and on NFS it is emulated by per-process POSIX locks)."""
    with _PROCESS_LOCKS_GUARD:
        return _PROCESS_LOCKS.setdefault(os.path.realpath(path), threading.Lock())


class Ledger:
    """The shared totals file. Every method blocks; call them from worker threads."""

    def __init__(self, root: str) -> None:
        self.path = os.path.join(root, LEDGER_NAME)
        self._lock = _process_lock(self.path)
        self._fd: int | None = None

    def open(self) -> None:
        with self._lock:
            if self._fd is None:
                self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    @contextlib.contextmanager
    def locked(self) -> Iterator[LedgerState]:
        """Hold the ledger; changes made to the yielded state are written back on exit."""
        with self._lock:
            fd = self._fd
            if fd is None:
                raise OSError(f"ledger {self.path} is not open")
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                state = LedgerState.unpack(os.pread(fd, _LEDGER.size, 0))
                before = dataclasses.replace(state)
                yield state
                if state != before and state.valid:
                    os.pwrite(fd, state.pack(), 0)
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)

    def read(self) -> LedgerState:
        with self.locked() as state:
            return dataclasses.replace(state)


class DirectoryScan(NamedTuple):
    keys: np.ndarray  # (N, 16) uint8, oldest mtime first
    mtimes_ns: np.ndarray  # (N,) int64, ascending
    total_bytes: int
    num_stale_temps: int  # temporary files of dead writers removed by this scan

    @property
    def num_objects(self) -> int:
        return len(self.mtimes_ns)


def scan_directory(root: str, *, stale_temp_s: float) -> DirectoryScan:
    """Every page file under root (size and mtime), and remove long-dead temporary files."""
    keys = bytearray()
    mtimes: list[int] = []
    total = 0
    stale = 0
    stale_before_ns = time.time_ns() - int(stale_temp_s * 1e9)
    for top in _hex_dirs(root):
        for sub in _hex_dirs(top.path):
            prefix = top.name + sub.name
            with os.scandir(sub.path) as entries:
                for entry in entries:
                    name = entry.name
                    try:
                        if _TEMP_MARK in name:
                            if entry.stat().st_mtime_ns < stale_before_ns:
                                os.unlink(entry.path)
                                stale += 1
                        elif len(name) == 2 * KEY_BYTES and name.startswith(prefix):
                            if not _HEX.issuperset(name):
                                continue
                            st = entry.stat()
                            keys += bytes.fromhex(name)
                            mtimes.append(st.st_mtime_ns)
                            total += st.st_size
                    except FileNotFoundError:
                        continue  # evicted or renamed by another process while we looked
    mtimes_arr = np.asarray(mtimes, dtype=np.int64)
    order = np.argsort(mtimes_arr, kind="stable")
    keys_arr = np.frombuffer(bytes(keys), dtype=np.uint8).reshape(-1, KEY_BYTES)[order]
    return DirectoryScan(keys_arr, mtimes_arr[order], total, stale)


def _hex_dirs(path: str) -> list[os.DirEntry]:
    try:
        with os.scandir(path) as entries:
            return [
                e
                for e in entries
                if len(e.name) == 2 and _HEX.issuperset(e.name) and e.is_dir(follow_symlinks=False)
            ]
    except FileNotFoundError:
        return []


class LruIndex:
    """Eviction candidates, oldest first: the last scan, then this process's own activity.

    Thread-safe: readers note touches while the committer pops candidates.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._keys = np.empty((0, KEY_BYTES), dtype=np.uint8)
        self._mtimes = np.empty(0, dtype=np.int64)
        self._next = 0
        self._recent: OrderedDict[bytes, int] = OrderedDict()  # noted since the scan, in order

    def load(self, scan: DirectoryScan, *, started_ns: int) -> None:
        """Replace the scanned part; keep what was noted after the scan started."""
        with self._lock:
            self._keys, self._mtimes, self._next = scan.keys, scan.mtimes_ns, 0
            for key in [k for k, t in self._recent.items() if t < started_ns]:
                del self._recent[key]

    def note(self, key: bytes, mtime_ns: int) -> None:
        with self._lock:
            self._recent[key] = mtime_ns
            self._recent.move_to_end(key)

    def forget(self, key: bytes) -> None:
        with self._lock:
            self._recent.pop(key, None)

    def pop_oldest(self) -> tuple[bytes, int] | None:
        with self._lock:
            scanned = self._mtimes[self._next] if self._next < len(self._mtimes) else None
            if self._recent:
                key, mtime = next(iter(self._recent.items()))
                if scanned is None or mtime <= scanned:
                    del self._recent[key]
                    return key, mtime
            if scanned is None:
                return None
            key = self._keys[self._next].tobytes()
            self._next += 1
            return key, int(scanned)

    def __len__(self) -> int:
        with self._lock:
            return len(self._mtimes) - self._next + len(self._recent)


class Staged(NamedTuple):
    key: bytes
    temp_path: str
    nbytes: int


class DirectorySpace:
    """Capacity and LRU for one directory. Every method blocks: call from worker threads."""

    def __init__(self, root: str, capacity_bytes: int, *, stale_temp_s: float) -> None:
        self.root = root
        self.capacity_bytes = capacity_bytes
        self.stale_temp_s = stale_temp_s
        self.ledger = Ledger(root)
        self.index = LruIndex()
        self.index_ready = threading.Event()
        self.last_state = LedgerState()  # as of this process's last look at the ledger

    def open(self) -> None:
        os.makedirs(self.root, exist_ok=True)
        if not os.access(self.root, os.R_OK | os.W_OK | os.X_OK):
            raise PermissionError(f"{self.root} is not readable and writable")
        self.ledger.open()

    def close(self) -> None:
        self.ledger.close()

    # -- scans --------------------------------------------------------------------------------

    def initial_scan(self) -> None:
        """Load the index; create the ledger from a locked scan if there is none yet."""
        try:
            with self.ledger.locked() as state:
                if not state.valid:
                    self._rebuild(state)
                    return
            self.refresh()
        finally:
            self.index_ready.set()

    def refresh(self) -> None:
        """Rescan without the lock: refresh the index, and rebuild the ledger if it drifted."""
        started_ns = time.time_ns()
        before = self.ledger.read()
        scan = scan_directory(self.root, stale_temp_s=self.stale_temp_s)
        after = self.ledger.read()
        self.index.load(scan, started_ns=started_ns)
        self.last_state = after
        drift_bytes = scan.total_bytes - before.used_bytes
        drift_objects = scan.num_objects - before.num_objects
        if abs(drift_bytes) <= after.churn_bytes - before.churn_bytes and abs(drift_objects) <= (
            after.num_changes - before.num_changes
        ):
            return
        with self.ledger.locked() as state:
            old_bytes = state.used_bytes
            self._rebuild(state)
        logger.warning(
            "%s: ledger was off by %d bytes (a writer died mid-commit, or files were removed "
            "by hand); rebuilt from a scan",
            self.root,
            state.used_bytes - old_bytes,
        )

    def _rebuild(self, state: LedgerState) -> None:
        """With the ledger locked: totals and index from a fresh scan."""
        started_ns = time.time_ns()
        scan = scan_directory(self.root, stale_temp_s=self.stale_temp_s)
        # The correction counts as churn, so other processes' drift checks do not trip on it.
        state.churn_bytes += abs(scan.total_bytes - state.used_bytes)
        state.num_changes += abs(scan.num_objects - state.num_objects)
        state.valid = True
        state.used_bytes = scan.total_bytes
        state.num_objects = scan.num_objects
        self.index.load(scan, started_ns=started_ns)
        self.last_state = dataclasses.replace(state)

    # -- changes ----------------------------------------------------------------------------

    def commit(self, staged: list[Staged | None]) -> list[PageStatus]:
        """Rename written temporary files into place, evicting LRU pages to make room.

        `None` entries are pages whose write failed (ERROR). A page that cannot fit is
        REJECTED and its temporary file removed. Pages of this batch are never evicted for
        each other.
        """
        self.index_ready.wait()
        statuses = [PageStatus.ERROR] * len(staged)
        todo = []
        for i, item in enumerate(staged):
            if item is None:
                continue
            if item.nbytes > self.capacity_bytes:
                statuses[i] = PageStatus.REJECTED
                unlink_quiet(item.temp_path)
            else:
                todo.append((i, item))
        if not todo:
            return statuses
        with self.ledger.locked() as state:
            if not state.valid:
                self._rebuild(state)
            old_sizes = [_size_or_none(page_path(self.root, item.key)) for _, item in todo]
            growth = sum(
                item.nbytes - (old or 0) for (_, item), old in zip(todo, old_sizes, strict=True)
            )
            self._make_room(state, growth, protect={item.key for _, item in todo})
            for (i, item), old in zip(todo, old_sizes, strict=True):
                statuses[i] = self._rename_in(state, item, old)
            self.last_state = dataclasses.replace(state)
        return statuses

    def _rename_in(self, state: LedgerState, item: Staged, old: int | None) -> PageStatus:
        if state.used_bytes + item.nbytes - (old or 0) > self.capacity_bytes:
            unlink_quiet(item.temp_path)
            return PageStatus.REJECTED
        try:
            os.rename(item.temp_path, page_path(self.root, item.key))
        except OSError:
            unlink_quiet(item.temp_path)
            return PageStatus.ERROR
        state.used_bytes += item.nbytes - (old or 0)
        state.churn_bytes += item.nbytes + (old or 0)
        state.num_changes += 1 if old is None else 2
        state.num_objects += 1 if old is None else 0
        self.index.note(item.key, time.time_ns())
        return PageStatus.STORED

    def _make_room(self, state: LedgerState, growth: int, *, protect: set[bytes]) -> None:
        """Evict least recently used pages until `growth` more bytes fit (or nothing is left)."""
        rebuilt = False
        budget = 2 * len(self.index) + 64  # each candidate is re-queued at most once per touch
        while state.used_bytes + growth > self.capacity_bytes and budget > 0:
            budget -= 1
            candidate = self.index.pop_oldest()
            if candidate is None:
                if rebuilt:
                    return
                self._rebuild(state)  # the index ran dry: what is really on disk?
                rebuilt = True
                budget = 2 * len(self.index) + 64
                continue
            key, seen_mtime_ns = candidate
            if key in protect:
                continue
            path = page_path(self.root, key)
            try:
                st = os.stat(path)
                if st.st_mtime_ns > seen_mtime_ns:
                    self.index.note(key, st.st_mtime_ns)  # used since we looked: not old
                    continue
                os.unlink(path)
            except FileNotFoundError:
                continue  # deleted by someone else (who updated the ledger)
            state.used_bytes -= st.st_size
            state.num_objects -= 1
            state.churn_bytes += st.st_size
            state.num_changes += 1
            state.num_evictions += 1

    def remove(self, keys: list[bytes]) -> int:
        removed = 0
        with self.ledger.locked() as state:
            if not state.valid:
                self._rebuild(state)
            for key in keys:
                path = page_path(self.root, key)
                try:
                    size = os.stat(path).st_size
                    os.unlink(path)
                except FileNotFoundError:
                    continue
                self.index.forget(key)
                state.used_bytes -= size
                state.num_objects -= 1
                state.churn_bytes += size
                state.num_changes += 1
                removed += 1
            self.last_state = dataclasses.replace(state)
        return removed


def _size_or_none(path: str) -> int | None:
    try:
        return os.stat(path).st_size
    except FileNotFoundError:
        return None


def unlink_quiet(path: str) -> None:
    """Remove a temporary file we own; already gone is fine."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
