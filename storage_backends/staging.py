"""StagingArena: one block of memory that a transfer engine has registered, lent out in regions.

A store whose client moves bytes only between its own registered memory and the store (Mooncake's
`batch_put_from` / `batch_get_into`) needs the pages to sit in such memory while they move. The
arena is that memory, allocated once and registered once; a call reserves a region for its
round of pages, the worker thread that runs the transfer gives it back when the transfer is over
(also when the call that asked for it has timed out and gone: a region is never reused while a
transfer may still write it).

`reserve` waits (on the event loop) until a region of the size asked for is free; the caller
bounds the wait with its own deadline. `release` may be called from any thread.
"""

from __future__ import annotations

import asyncio
import mmap
import threading

import numpy as np

ALIGN_BYTES = 64  # each object starts on a cache line


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN_BYTES) * ALIGN_BYTES


class StagingArena:
    """`nbytes` of anonymous memory (page-aligned), lent out as regions by first fit."""

    def __init__(self, nbytes: int) -> None:
        if nbytes < ALIGN_BYTES:
            raise ValueError(f"a staging arena needs at least {ALIGN_BYTES} bytes, got {nbytes}")
        self.nbytes = nbytes
        self._map = mmap.mmap(-1, nbytes)
        self.array = np.frombuffer(self._map, dtype=np.uint8)  # (nbytes,)
        self.view = memoryview(self._map)
        self.address = self.array.ctypes.data
        self._lock = threading.Lock()
        self._taken: dict[int, int] = {}  # start -> end of each region lent out
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []

    def try_reserve(self, nbytes: int) -> int | None:
        """The start of a free region of `nbytes`, now taken; None if there is none."""
        if nbytes > self.nbytes:
            raise ValueError(f"a region of {nbytes} bytes cannot fit an arena of {self.nbytes}")
        with self._lock:
            start = 0
            for begin, end in sorted(self._taken.items()):
                if begin - start >= nbytes:
                    break
                start = end
            if self.nbytes - start < nbytes:
                return None
            self._taken[start] = start + nbytes
            return start

    async def reserve(self, nbytes: int) -> int:
        """A region of `nbytes`, once one is free (the caller's deadline bounds the wait)."""
        while True:
            start = self.try_reserve(nbytes)
            if start is not None:
                return start
            freed = asyncio.Event()
            with self._lock:
                self._waiters.append((asyncio.get_running_loop(), freed))
            start = self.try_reserve(nbytes)  # a release between the two looks
            if start is not None:
                return start
            await freed.wait()

    def release(self, start: int) -> None:
        """Give a region back (any thread) and wake whoever waits for room."""
        with self._lock:
            del self._taken[start]
            waiters, self._waiters = self._waiters, []
        for loop, event in waiters:
            if not loop.is_closed():
                loop.call_soon_threadsafe(event.set)

    def num_taken(self) -> int:
        with self._lock:
            return len(self._taken)
