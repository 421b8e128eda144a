"""The ledger of a `file://` directory: the totals every process sharing it agrees on.

`.hicache-ledger` holds the bytes of the packs that still have a page linked, the number of
page links, and counters of change. Every change of what is committed happens with it locked
(`flock`, plus one lock per process for its threads: flock alone does not order a process's
own threads) and updates it in the same critical section (`Ledger.locked`). `file_space`
decides what changes; this module only keeps the file.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import logging
import os
import struct
import threading
from collections.abc import Iterator

logger = logging.getLogger(__name__)

LEDGER_NAME = ".hicache-ledger"
_LEDGER = struct.Struct("<8s5q")
_LEDGER_MAGIC = b"HCLEDG01"


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
