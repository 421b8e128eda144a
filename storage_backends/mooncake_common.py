"""What the Mooncake backend's two paths share: the client's error codes that mean something
here, the fault that fails a call as a whole, the rounds a batch moves through the staging
arena in, and how many threads frame or check a round's pages.

The backend (mooncake_store.py) stages pages through its arena (mooncake_staged.py); its
straight path (mooncake_direct.py) moves a lent pool's pages with only their headers in the
arena.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from .base import CPUS
from .staging import aligned

# Mooncake's error codes (mooncake-store types.h) that mean something here.
NOT_FOUND = -704  # OBJECT_NOT_FOUND
EXISTS = -705  # OBJECT_ALREADY_EXISTS: a put of a key the store holds (the client says 0)
NOT_READY = -703  # REPLICA_IS_NOT_READY: here, another client's put of the key is under way
NO_ROOM = -200  # NO_AVAILABLE_HANDLE: nothing left to allocate or evict
TOO_SMALL = -600  # INVALID_PARAMS: here, the object is larger than the buffer it was read into
RPC_FAIL = -900  # the master did not answer
TRANSFER_FAIL = -800  # TRANSFER_FAIL: here also an object larger than the buffers read into

# Framing or checking a round (`num_threads`): a thread per THREAD_BYTES, at most MAX_THREADS.
# On two cores a second thread only competes with the transfer's (a 2 MiB batch framed took
# 0.08 ms on one, 0.10 on two); on the H200 host's 16 cores 2 MiB framed and copied took 218
# us on one, 108 on two and 75 on four (checked and copied: 194, 123, 80).
THREAD_BYTES = 4 << 20 if CPUS <= 2 else 512 << 10
MAX_THREADS = 4


class MooncakeFault(ConnectionError):
    """A call failed as a whole (the master unreachable); the base counts it as a fault."""


class Round:
    """Pages of one batch that move together through one region of the arena."""

    def __init__(self, items: list[int], slots: list[int]) -> None:
        self.items = items  # positions in the batch
        self.slots = slots  # bytes reserved for each, aligned
        self.offsets = list(itertools.accumulate(slots[:-1], initial=0))
        self.nbytes = self.offsets[-1] + slots[-1] if slots else 0


def slot_sizes(sizes: list[int]) -> list[int]:
    """The bytes of the arena each object of `sizes` takes (each starts on a cache line)."""
    return [aligned(size) for size in sizes]


def num_threads(nbytes: int) -> int:
    """Threads that frame or check `nbytes` of pages: one per `THREAD_BYTES`."""
    return max(1, min(nbytes // THREAD_BYTES, MAX_THREADS, CPUS))


def raise_if_all_failed(codes: Sequence[int], op: str) -> None:
    if codes and all(code == RPC_FAIL for code in codes):
        raise MooncakeFault(f"{op}: the master did not answer")
