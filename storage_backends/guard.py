"""CopyGuard: worker threads write a call's buffers only while that call is running.

A backend that reads pages on worker threads (the file backend) must never write an L2 page
after `batch_get` has returned: by then the engine may have handed that page to something
else, and a late write would put wrong bytes in front of the model. The base gives every
`batch_get` call a guard and closes it as the call returns, on a timeout too.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import numpy as np


class CopyGuard:
    """Lets worker threads write one call's buffers only while that call is running.

    Writes happen inside `writing()`: memory copies, and reads that cannot wait for I/O
    (a page-cache hit) - work that always ends within microseconds. The base closes the guard
    as the call returns (even on a timeout), waiting only for such writes under way; a worker
    that is still reading afterwards finds it closed and writes nothing. Never hold it across
    anything that can block (a read that may wait for a disk or a server).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open = True
        self._active = 0
        self._idle: threading.Event | None = None  # made by close() when it has to wait

    @property
    def closed(self) -> bool:
        """The call is over (a hint for skipping work; writes still go through `enter()`)."""
        return not self._open

    def enter(self) -> bool:
        """Start a write: True if the buffers may be written until `leave()`; False if the
        call is over (then don't write, and don't call `leave()`)."""
        with self._lock:
            if self._open:
                self._active += 1
            return self._open

    def leave(self) -> None:
        with self._lock:
            self._active -= 1
            if not self._active and self._idle is not None:
                self._idle.set()

    @contextlib.contextmanager
    def writing(self) -> Iterator[bool]:
        """True: the buffers may be written until the block ends. False: the call is over."""
        entered = self.enter()
        try:
            yield entered
        finally:
            if entered:
                self.leave()

    def copy(self, into: memoryview, offset: int, piece: memoryview) -> bool:
        """into[offset : offset + len(piece)] = piece, unless the call is over (False)."""
        if offset < 0 or offset + len(piece) > len(into):
            raise ValueError(f"copy of {len(piece)} bytes at {offset} overruns {len(into)}")
        with self.writing() as allowed:
            if allowed and piece:  # numpy copies without the GIL: workers copy in parallel
                target = np.frombuffer(into, dtype=np.uint8)[offset : offset + len(piece)]
                np.copyto(target, np.frombuffer(piece, dtype=np.uint8))
            return allowed

    def close(self) -> None:
        """End the call: no write starts after this returns, and none is still under way."""
        with self._lock:
            self._open = False
            if not self._active:
                return
            self._idle = threading.Event()
        self._idle.wait()
