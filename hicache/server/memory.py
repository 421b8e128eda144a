"""Memory given back when calls end: the daemon's RSS falls back after a burst.

Two things keep freed message buffers resident after the calls that held them have ended:
a refused call's traceback (its frames hold the messages it had read, in a reference cycle
only the cyclic collector frees), and glibc's arenas, which keep freed blocks of gRPC's
threads instead of returning them to the kernel. `MemoryReturn` handles both: the service
clears a refused call's frames at once (`clear_frames`), and once no call is in flight (at
most every `interval_s`) it collects cycles and asks glibc to return free memory of every
arena (`malloc_trim(0)`, on a worker thread: it walks the heaps). Where the C library is not
glibc, the trim is skipped.
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import logging
import os
import traceback

logger = logging.getLogger(__name__)


def clear_frames(exc: BaseException) -> None:
    """Drop the locals of the finished frames `exc` (and what it chains) still holds."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        traceback.clear_frames(exc.__traceback__)
        exc = exc.__context__


class MemoryReturn:
    def __init__(self, interval_s: float = 1.0) -> None:
        self.interval_s = interval_s
        self.num_trims = 0
        self._pending: asyncio.TimerHandle | None = None
        self._trim = _malloc_trim()

    def calls_ended(self, num_in_flight: int) -> None:
        """A call ended, leaving `num_in_flight`; on the event loop."""
        if num_in_flight == 0 and self._pending is None:
            loop = asyncio.get_running_loop()
            self._pending = loop.call_later(self.interval_s, self._run, loop)

    def _run(self, loop: asyncio.AbstractEventLoop) -> None:
        self._pending = None
        gc.collect()
        if self._trim is not None:
            loop.run_in_executor(None, self._trim, 0)
        self.num_trims += 1

    def close(self) -> None:
        if self._pending is not None:
            self._pending.cancel()
            self._pending = None


def _malloc_trim():
    try:
        if not os.confstr("CS_GNU_LIBC_VERSION"):
            return None
        trim = ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError, ValueError):
        return None
    trim.argtypes = (ctypes.c_size_t,)
    return trim
