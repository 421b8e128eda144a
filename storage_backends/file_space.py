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

The ledger file itself is `file_ledger`'s. Nothing here reads page contents: that is
`file_read`'s job.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import os
import stat
import threading
import time
from collections.abc import Iterator
from typing import NamedTuple

from .base import PageStatus
from .file_index import TEMP_MARK, PackIndex, PackInfo, scan_directory
from .file_ledger import LEDGER_NAME, Ledger, LedgerState  # (LEDGER_NAME: for tools)
from .file_pack import tombstone
from .native import pageio

logger = logging.getLogger(__name__)

__all__ = ["LEDGER_NAME", "DirectorySpace", "page_path", "temp_path"]

_HEX_DIGITS = "0123456789abcdef"


def page_path(root: str, key: bytes) -> str:
    """<root>/a/b/ab...: two levels of 16-way fan-out spread the page names over 256 folders,
    all made within the first few batches (a folder costs a journaled mkdir; 65,536 of them,
    as two hex digits a level would give, make every write of a young cache pay for one).
    Spelled out rather than os.path.join (a sixth of the time; a batch makes 30 to 70)."""
    name = key.hex()
    return f"{root}/{name[0]}/{name[1]}/{name}"


def temp_path(path: str, serial: int) -> str:
    return f"{path}{TEMP_MARK}{os.getpid()}.{serial}"


class StagedPack(NamedTuple):
    """A pack written to its temporary name, not yet linked in."""

    keys: list[bytes]
    positions: list[int]  # where each key is in the caller's batch
    temp_path: str
    nbytes: int


class DirectorySpace:
    """Capacity and LRU for one directory. Every method blocks: call from worker threads."""

    def __init__(self, root: str, capacity_bytes: int, *, link_threads: int = 1) -> None:
        self.root = root
        self.capacity_bytes = capacity_bytes
        self.link_threads = link_threads  # a batch's names are linked on up to this many threads
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
        scan = scan_directory(self.root)
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
        scan = scan_directory(self.root)
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

    def _link_new_names(self, packs: list[StagedPack], paths: list[list[str]]) -> list[list[int]]:
        """Link each pack at each of its `paths` that is not taken, all in one call of the C
        extension (`link_all`, on up to `link_threads` threads, the packs' names taken in turn
        so that the threads link to different files); 0 where that made the name. The others
        (taken, folder missing, anything else; -1: not tried, without hard links) are left
        to `_link_in`, one by one."""
        errors = [[-1] * len(names) for names in paths]
        if not self.hard_links or not packs:
            return errors
        threads = max(1, min(self.link_threads, sum(map(len, paths)) // 8))
        turns = [
            (i, j)
            for j in range(max(map(len, paths)))
            for i in range(len(paths))
            if j < len(paths[i])
        ]
        codes = pageio.link_all(
            [packs[i].temp_path for i, _ in turns], [paths[i][j] for i, j in turns], threads
        )
        for (i, j), code in zip(turns, codes, strict=True):
            errors[i][j] = code
        return errors

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
    probe = os.path.join(root, f".hicache-probe{TEMP_MARK}{os.getpid()}")
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
    temp = f"{path}{TEMP_MARK}{os.getpid()}.link"  # under the ledger lock: one at a time
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
