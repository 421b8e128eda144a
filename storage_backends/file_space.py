"""Space accounting of a `file://` directory that several processes share.

Many engine processes (on one host, or on many hosts over NFS / 3FS) may write one cache
directory at once. Pages live in packs (`file_pack`): one file per written batch, with a hard
link per page key under `<root>/a/b/`. The processes agree on two things:

- **How many bytes are stored**: a small ledger file, `.hicache-ledger`, holds the totals:
  bytes of the packs that still have a page linked, and the number of page links. Every
  change of what is committed (linking a pack's pages in, an eviction, a delete) happens with
  the ledger locked (`flock`, plus one lock per process for its threads) and updates it in the
  same critical section, so the totals are exact and the capacity is never exceeded by
  committed packs. A link's count says when a pack's last page goes (its bytes with it).
  Temporary files being written are not counted until they are linked in.
- **What is least recently used**: each pack's mtime (shared by all its links). A write sets
  it; a read that finds it older than `touch_interval_s` sets it to now. Each process keeps an
  index of the packs it knows in mtime order (from a periodic directory scan, plus its own
  writes and reads since), and re-checks a candidate's mtime before evicting it, so a pack
  another process read recently is never taken as old. Packs written by others since the last
  scan are newer than anything scanned, so missing them from the index does not break LRU
  order. The pack is the unit of eviction: the store keeps packs small next to the capacity.

The ledger can drift only if a process dies between linking and its ledger update, or if
files are removed by hand. The periodic scan detects it: with `churn` the bytes added plus
removed while it ran, a scan total further than `churn` from the ledger's cannot be explained
by concurrent writers, and the ledger is rebuilt from a scan done under the lock.

Nothing here reads page contents: that is `file_store`'s job.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import heapq
import logging
import os
import stat
import struct
import threading
import time
from collections.abc import Iterator
from typing import NamedTuple

from . import native
from .base import PageStatus
from .file_pack import tombstone
from .objects import KEY_BYTES

logger = logging.getLogger(__name__)

LEDGER_NAME = ".hicache-ledger"
_LEDGER = struct.Struct("<8s5q")
_LEDGER_MAGIC = b"HCLEDG01"
_HEX_DIGITS = "0123456789abcdef"
_HEX = frozenset(_HEX_DIGITS)
_TEMP_MARK = ".tmp."


def page_path(root: str, key: bytes) -> str:
    """<root>/a/b/ab...: two levels of 16-way fan-out spread the page names over 256 folders,
    all made within the first few batches (a folder costs a journaled mkdir; 65,536 of them,
    as two hex digits a level would give, make every write of a young cache pay for one).
    Spelled out rather than os.path.join (a sixth of the time; a batch makes 30 to 70)."""
    name = key.hex()
    return f"{root}/{name[0]}/{name[1]}/{name}"


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

    def grow(self, nbytes: int) -> None:
        """A pack's bytes came in."""
        self.used_bytes += nbytes
        self.churn_bytes += nbytes

    def shrink(self, nbytes: int) -> None:
        """A pack's bytes went (its last page link was removed)."""
        self.used_bytes -= nbytes
        self.churn_bytes += nbytes

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
    """The shared totals file. Every method blocks; call them from worker threads.

    One ledger per directory, whatever happens to it: each time it is locked, the file held
    is checked to still be the one at its name. If the directory (or the ledger alone) was
    removed or replaced under us, the directory is made again and the ledger at its name
    opened (a fresh one is invalid, so the caller rebuilds it from a scan), so every process
    counts into the same file, never into one only it still holds.
    """

    def __init__(self, root: str) -> None:
        self.root = root
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

    def _lock_current(self) -> int:
        """flock the ledger at its name (reopened, and the directory made again, if what we
        held is no longer it); returns the locked fd. Called with the process lock held."""
        for _ in range(8):  # another process may replace it again in between: look again
            fd = self._fd
            if fd is None:
                raise OSError(f"ledger {self.path} is not open")
            fcntl.flock(fd, fcntl.LOCK_EX)
            held = os.fstat(fd)
            try:
                named = os.stat(self.path)
            except FileNotFoundError:
                named = None
            if named is not None and (named.st_ino, named.st_dev) == (held.st_ino, held.st_dev):
                return fd
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
            self._fd = None
            logger.warning(
                "%s: the cache directory or its ledger was removed or replaced while in use; "
                "made it again, and the ledger is rebuilt from what is on disk",
                self.root,
            )
            os.makedirs(self.root, exist_ok=True)
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        raise OSError(f"ledger {self.path} keeps being replaced")

    @contextlib.contextmanager
    def locked(self) -> Iterator[LedgerState]:
        """Hold the ledger; changes made to the yielded state are written back on exit."""
        with self._lock:
            fd = self._lock_current()
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


def scan_directory(root: str, *, stale_temp_s: float) -> DirectoryScan:
    """Every page link under root, grouped into packs; remove long-dead temporary files."""
    packs: dict[int, list] = {}  # ino -> [size, mtime, keys]
    links = 0
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


class StagedPack(NamedTuple):
    """A pack written to its temporary name, not yet linked in."""

    keys: list[bytes]
    positions: list[int]  # where each key is in the caller's batch
    temp_path: str
    nbytes: int


class DirectorySpace:
    """Capacity and LRU for one directory. Every method blocks: call from worker threads."""

    def __init__(
        self, root: str, capacity_bytes: int, *, stale_temp_s: float, link_threads: int = 1
    ) -> None:
        self.root = root
        self.capacity_bytes = capacity_bytes
        self.stale_temp_s = stale_temp_s
        self.link_threads = link_threads  # a pack's names are linked on up to this many threads
        self.ledger = Ledger(root)
        self.index = PackIndex()
        self.index_ready = threading.Event()
        self.last_state = LedgerState()  # as of this process's last look at the ledger
        self.hard_links = True  # False: the filesystem has none, every pack holds one page

    def open(self) -> None:
        os.makedirs(self.root, exist_ok=True)
        if not os.access(self.root, os.R_OK | os.W_OK | os.X_OK):
            raise PermissionError(f"{self.root} is not readable and writable")
        self.ledger.open()
        self.hard_links = _can_hard_link(self.root)
        if not self.hard_links:
            logger.warning(
                "%s: the filesystem has no hard links; storing one page per file (slower)",
                self.root,
            )

    def close(self) -> None:
        self.ledger.close()

    def make_folders_durable(self) -> None:
        """Make all 256 page folders now and fsync the folders above them (for `fsync=true`):
        a durable put fsyncs the folders its names went into, not the ones above, so a folder
        made on the way by a put would not survive a power cut with the names in it."""
        for a in _HEX_DIGITS:
            for b in _HEX_DIGITS:
                os.makedirs(f"{self.root}/{a}/{b}", exist_ok=True)
        for folder in [os.path.dirname(self.root), self.root]:
            fsync_folder(folder)
        for a in _HEX_DIGITS:
            fsync_folder(f"{self.root}/{a}")

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

    def commit(self, staged: list[StagedPack], num_keys: int) -> list[PageStatus]:
        """Link written packs' pages in, evicting LRU packs to make room; one status per key
        of the caller's batch (keys in no staged pack: ERROR, their write failed).

        A pack that cannot fit is REJECTED and its temporary file removed. Room is made for
        the whole batch before any of it is linked, so a batch never evicts its own packs.
        """
        self.index_ready.wait()
        statuses = [PageStatus.ERROR] * num_keys
        todo = []
        for pack in staged:
            if pack.nbytes > self.capacity_bytes:
                _set(statuses, pack.positions, PageStatus.REJECTED)
                unlink_quiet(pack.temp_path)
            else:
                todo.append(pack)
        if not todo:
            return statuses
        try:
            with self.ledger.locked() as state:
                if not state.valid:
                    self._rebuild(state)
                self._make_room(state, sum(pack.nbytes for pack in todo))
                room = self.capacity_bytes - state.used_bytes
                fitting = []
                for pack in todo:
                    if pack.nbytes > room:
                        _set(statuses, pack.positions, PageStatus.REJECTED)
                    elif self.hard_links or len(pack.keys) == 1:
                        fitting.append(pack)  # (without hard links a pack has but one name)
                        room -= pack.nbytes
                paths = [[page_path(self.root, key) for key in pack.keys] for pack in fitting]
                errors = self._link_new_names(fitting, paths)
                for pack, pack_paths, pack_errors in zip(fitting, paths, errors, strict=True):
                    self._link_in(state, pack, pack_paths, pack_errors, statuses)
                    # Still under the lock: another process that replaces or evicts one of
                    # its pages reads the pack's link count, which must be the pages' alone.
                    unlink_quiet(pack.temp_path)
                self.last_state = dataclasses.replace(state)
        finally:
            for pack in todo:
                unlink_quiet(pack.temp_path)  # (a commit that failed half-way)
        return statuses

    def _link_in(
        self,
        state: LedgerState,
        pack: StagedPack,
        paths: list[str],
        errors: list[int],
        statuses: list[PageStatus],
    ) -> None:
        """With the ledger locked: make each of `paths` a name of the pack (where `errors`
        says 0, `_link_new_names` did already), replacing older pages; count them in."""
        try:
            st = os.stat(pack.temp_path)
        except OSError:
            return  # ERROR for all
        linked: list[bytes] = []
        names = zip(pack.keys, pack.positions, paths, errors, strict=True)
        for key, position, path, error in names:
            try:
                if not self.hard_links:  # a pack of one page, renamed into place
                    old = _lstat_or_none(path)
                    os.rename(pack.temp_path, path)
                elif error == 0:
                    old = None  # linked already
                else:
                    old = _link_new(pack.temp_path, path)  # one system call for a new page
                if old is not None and old.st_ino == st.st_ino:
                    statuses[position] = PageStatus.STORED  # the key twice in one batch
                    continue
                if old is not None and self.hard_links:
                    with _clearing(path, key, old):  # its old pack's other names must not find it
                        _replace(pack.temp_path, path)
            except OSError:
                continue
            linked.append(key)
            statuses[position] = PageStatus.STORED
            state.num_changes += 1
            if old is None:
                state.num_objects += 1
            elif old.st_nlink == 1:  # that was the last page of its pack: the pack is gone
                state.shrink(old.st_size)
        if linked:
            state.grow(st.st_size)
            self.index.add(PackInfo(st.st_ino, st.st_size, st.st_mtime_ns, tuple(linked)))

    def _link_new_names(self, packs: list[StagedPack], paths: list[list[str]]) -> list[list[int]]:
        """Link each pack at each of its `paths` that is not taken, all in one go (the C
        extension, on up to `link_threads` threads, the packs' names taken in turn so that the
        threads link to different files); 0 where that made the name. The others (taken,
        folder missing, anything else; -1: not tried) are left to `_link_new`, one by one."""
        errors = [[-1] * len(names) for names in paths]
        threads = min(self.link_threads, sum(map(len, paths)) // 8)
        if native.pageio is None or not self.hard_links or threads < 2:
            return errors
        turns = [
            (i, j)
            for j in range(max(map(len, paths)))
            for i in range(len(paths))
            if j < len(paths[i])
        ]
        codes = native.pageio.link_all(
            [packs[i].temp_path for i, _ in turns], [paths[i][j] for i, j in turns], threads
        )
        for (i, j), code in zip(turns, codes, strict=True):
            errors[i][j] = code
        return errors

    def _make_room(self, state: LedgerState, growth: int) -> None:
        """Evict least recently used packs until `growth` more bytes fit (or none is left)."""
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
            self._evict(state, candidate)

    def _evict(self, state: LedgerState, pack: PackInfo) -> None:
        """Remove every link to `pack`, unless it was used since the index saw it."""
        live = []
        for key in pack.keys:
            path = page_path(self.root, key)
            st = _lstat_or_none(path)
            if st is not None and st.st_ino == pack.ino:
                live.append((path, st))
        if not live:
            return  # evicted or replaced by someone else (who updated the ledger)
        newest = max(st.st_mtime_ns for _, st in live)
        if newest > pack.mtime_ns:
            self.index.add(pack._replace(mtime_ns=newest))  # used since we looked: not old
            return
        removed = 0
        for path, _ in live:
            try:
                os.unlink(path)
            except FileNotFoundError:
                continue
            removed += 1
        last = live[-1][1]
        state.num_objects -= removed
        state.num_changes += removed
        state.num_evictions += removed
        if removed == len(live) and last.st_nlink == len(live):  # no other link: freed
            state.shrink(last.st_size)

    def remove(self, keys: list[bytes]) -> tuple[int, list[str]]:
        """Remove the keys' names: (how many were stored, what failed, one line each). A
        name that fails (not a file of ours, no permission) fails alone."""
        removed = 0
        failed: list[str] = []
        with self.ledger.locked() as state:
            if not state.valid:
                self._rebuild(state)
            for key in keys:
                path = page_path(self.root, key)
                try:
                    st = os.lstat(path)
                    if not stat.S_ISREG(st.st_mode):
                        failed.append(f"{path}: not a page file (mode {stat.filemode(st.st_mode)})")
                        continue
                    with _clearing(path, key, st):  # the pack's other names must not find it
                        os.unlink(path)
                except FileNotFoundError:
                    continue
                except OSError as exc:
                    failed.append(f"{path}: {exc}")
                    continue
                state.num_objects -= 1
                state.num_changes += 1
                if st.st_nlink == 1:  # the pack's last page
                    state.shrink(st.st_size)
                removed += 1
            self.last_state = dataclasses.replace(state)
        return removed, failed

    def make_root(self) -> bool:
        """Make the directory again if it was removed (True if it had to be)."""
        if os.path.isdir(self.root):
            return False
        os.makedirs(self.root, exist_ok=True)
        logger.warning("%s: the cache directory was removed while in use; made it again", self.root)
        return True


def _set(statuses: list[PageStatus], positions: list[int], status: PageStatus) -> None:
    for position in positions:
        statuses[position] = status


def _can_hard_link(root: str) -> bool:
    """Whether the filesystem under root makes hard links (some FUSE mounts do not)."""
    probe = os.path.join(root, f".hicache-probe{_TEMP_MARK}{os.getpid()}")
    unlink_quiet(probe)
    unlink_quiet(probe + ".link")
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644))
        os.link(probe, probe + ".link")
    except OSError as exc:
        if exc.errno in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS, errno.EXDEV):
            return False
        raise
    finally:
        unlink_quiet(probe + ".link")
        unlink_quiet(probe)
    return True


def _link_new(source: str, path: str) -> os.stat_result | None:
    """Make `path` a link to `source` if there is no such name (None); otherwise link nothing
    and return the existing name's lstat."""
    try:
        return _try_link(source, path)
    except FileNotFoundError:
        os.makedirs(os.path.dirname(path), exist_ok=True)  # the first page in this folder
        return _try_link(source, path)


def _try_link(source: str, path: str) -> os.stat_result | None:
    try:
        os.link(source, path)
        return None
    except FileExistsError:
        return os.lstat(path)


def _replace(source: str, path: str) -> None:
    """Make the existing name `path` a link to `source`, atomically."""
    temp = f"{path}{_TEMP_MARK}{os.getpid()}.link"  # under the ledger lock: one at a time
    unlink_quiet(temp)
    os.link(source, temp)
    try:
        os.rename(temp, path)
    except OSError:
        unlink_quiet(temp)
        raise


@contextlib.contextmanager
def _clearing(path: str, key: bytes, st: os.stat_result | None) -> Iterator[None]:
    """Around unlinking or replacing `path`, a name of `key` in a pack with other pages: clear
    the key's entry in that pack's table afterwards, so that no read through another name
    finds the page (a reader that opens the name in between retries it and misses)."""
    if st is None or st.st_nlink < 2:
        yield  # no other names: the pack goes with this one
        return
    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    try:
        yield
        tombstone(fd, key)
    finally:
        os.close(fd)


def _lstat_or_none(path: str) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except FileNotFoundError:
        return None


def fsync_folder(path: str) -> None:
    """Make a folder's entries durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def unlink_quiet(path: str) -> None:
    """Remove a temporary file we own; already gone (or never made: its folder is not one)
    is fine."""
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        os.unlink(path)
