"""LentRegions: memory a caller lends a backend (its L2 pool), and the pages in it that a
transfer is moving right now.

A store whose client moves bytes between registered memory and the store (Mooncake) can move
a page straight into or out of the caller's pool, instead of through its staging arena and a
copy, once the caller lends the pool (`StorageBackend.lend`). Lending changes one rule for
those pages: a transfer that outlives its call (the call timed out) still writes (or reads)
them after the call has returned. Such a page is *quarantined*: `busy(view)` is True until
the transfer is over, and the caller must not hand the page out again before (the controller
keeps it out of its free list; `StorageBackend.quarantined`).

Every direct transfer marks the spans it moves here before it starts (`mark`) and unmarks
them when the client returns (`unmark`), so a quarantine is exactly "a transfer still moves
these bytes": it is data, not an estimate of how long a transfer may take. A mark that
overlaps a span already marked is refused: a page handed in again while it is quarantined is
never read into a second time.
"""

from __future__ import annotations

import itertools
import threading

import numpy as np

from .buffers import Buffer, byte_view

Span = tuple[int, int]  # [start, end) addresses


def address_of(view: memoryview) -> int:
    """The address of a contiguous byte view's first byte."""
    return np.frombuffer(view, dtype=np.uint8).ctypes.data if len(view) else 0


class LentRegions:
    """The regions lent to one backend and the spans under a transfer. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._regions: dict[int, tuple[int, memoryview]] = {}  # start -> (end, the region)
        self._registered: set[int] = set()  # starts the client has registered
        self._busy: dict[int, list[Span]] = {}  # token -> spans a transfer moves
        self._tokens = itertools.count(1)

    def add(self, region: Buffer) -> Span:
        """Lend `region` (kept referenced, so it lives as long as the lending); its span."""
        view = byte_view(region, what="the lent region")
        if not len(view):
            raise ValueError("the lent region is empty")
        start = address_of(view)
        end = start + len(view)
        with self._lock:
            for begin, (finish, _) in self._regions.items():
                if begin < end and start < finish and (begin, finish) != (start, end):
                    raise ValueError("the lent region overlaps one lent before")
            self._regions.setdefault(start, (end, view))
        return start, end

    def unregistered(self) -> list[Span]:
        """Regions the client has not registered yet."""
        with self._lock:
            return [(s, e) for s, (e, _) in self._regions.items() if s not in self._registered]

    def registered(self, start: int, ok: bool) -> None:
        """The client registered the region at `start` (ok), or refused it: then it is no
        longer lent (its pages go through the arena)."""
        with self._lock:
            if ok:
                self._registered.add(start)
            else:
                self._regions.pop(start, None)

    def forget_registrations(self) -> list[int]:
        """The starts of the regions the client had registered, now unregistered (the client
        is let go; a new one registers them again)."""
        with self._lock:
            starts, self._registered = sorted(self._registered), set()
            return starts

    def inside(self, address: int, nbytes: int) -> bool:
        """Whether [address, address + nbytes) lies in one registered lent region."""
        with self._lock:
            for start in self._registered:
                if start <= address and address + nbytes <= self._regions[start][0]:
                    return True
        return False

    def mark(self, spans: list[Span]) -> int | None:
        """Mark `spans` as moved by a transfer: a token for `unmark`, or None (nothing
        marked) when one of them overlaps a span still under a transfer."""
        with self._lock:
            for marked in self._busy.values():
                for begin, end in marked:
                    if any(begin < e and s < end for s, e in spans):
                        return None
            token = next(self._tokens)
            self._busy[token] = list(spans)
            return token

    def unmark(self, token: int) -> None:
        with self._lock:
            del self._busy[token]

    def busy(self, address: int, nbytes: int) -> bool:
        """Whether a transfer still moves any byte of [address, address + nbytes)."""
        end = address + nbytes
        with self._lock:
            return any(s < end and address < e for spans in self._busy.values() for s, e in spans)

    def num_busy(self) -> int:
        """Spans under a transfer now (tests, stats)."""
        with self._lock:
            return sum(len(spans) for spans in self._busy.values())
