"""The process' glibc malloc policy, set for streams of large gRPC messages.

gRPC Python moves every message through fresh, message-sized heap buffers: a received one is
gathered into a growing `bytearray`, then copied into a new `bytes`; a sent one is copied
into a new core buffer. Under glibc's default policy, freeing them leaves a free block at the
top of the heap that is returned to the kernel at once (brk, madvise), and the next message
faults the same pages back in, zeroed by the kernel: on a stream of 4 MiB messages, more
than a fault per page received and a large share of a client's CPU (measured on loopback
with a BatchGet client; figures in docs/performance.md).

`tune_for_large_messages` sets the two thresholds that govern this, once per process:

- M_MMAP_THRESHOLD = 32 MiB: allocations below it come from the heap, not from a fresh
  mmap each time (32 MiB is the ceiling of glibc's own dynamic threshold);
- M_TRIM_THRESHOLD = 64 MiB: a free block at the top of the heap is kept until it exceeds
  this (twice the mmap threshold, the ratio glibc's dynamic policy keeps).

That is the state glibc's own policy reaches after freeing one 32 MiB block; setting it
explicitly only makes it certain (and fixes it, where glibc would keep adapting). The cost is
up to 64 MiB of freed memory a heap may keep instead of returning it. Process-wide: it
changes nothing where the C library is not glibc (a preloaded jemalloc or tcmalloc does not
use these settings), and nothing in a process whose environment already chose a malloc
policy (MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_, MALLOC_TOP_PAD_, or glibc.malloc
tunables in GLIBC_TUNABLES).
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading

logger = logging.getLogger(__name__)

MMAP_THRESHOLD_BYTES = 32 << 20
TRIM_THRESHOLD_BYTES = 64 << 20
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's <malloc.h>
_CHOSEN_BY_ENVIRONMENT = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")

_lock = threading.Lock()
_outcome: bool | None = None  # None: not tried yet in this process


def tune_for_large_messages() -> bool:
    """Set the policy of the module docstring (once per process); True when it is in force.

    False, and nothing changed, where it does not apply: not glibc, or a policy already chosen
    through the environment.
    """
    global _outcome
    with _lock:
        if _outcome is None:
            _outcome = _apply()
        return _outcome


def _apply() -> bool:
    chosen = [name for name in _CHOSEN_BY_ENVIRONMENT if name in os.environ]
    if "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""):
        chosen.append("GLIBC_TUNABLES")
    if chosen:
        logger.debug("malloc policy left as set by %s", ", ".join(chosen))
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the C library this process runs on
        gnu_libc = bool(os.confstr("CS_GNU_LIBC_VERSION"))
    except (AttributeError, OSError, ValueError):
        return False
    if not gnu_libc:
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    applied = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(
        mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    )
    logger.debug(
        "malloc policy for large messages: mmap threshold %d MiB, trim threshold %d MiB%s",
        MMAP_THRESHOLD_BYTES >> 20,
        TRIM_THRESHOLD_BYTES >> 20,
        "" if applied else " (refused)",
    )
    return applied
