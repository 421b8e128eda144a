"""A shared L3 store in virtual time: which page keys it holds, and since when.

Like the `memory://` backend (`storage_backends.memory_store`), it evicts the least recently
used pages (by bytes; every page of one model has the same size, so by pages) and a read
makes a page recent; an existence check does not. Unlike it, it keeps no bytes, and a page
becomes visible only when its write completes.

Serving instances share one store but each has a clock of its own. The player hands
instances their events in timestamp order, so writes are applied lazily, in completion
order, when someone looks at a time at or after their completion; each key also keeps the
time it became visible, so an instance whose clock is a little behind still does not see a
write from its future.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True)
class L3StorePreset:
    """What one instance sees of a real L3 store, as `benchmarks/bench_backends.py` measured
    it through hicache's backend (reads: the rate and the per-request latency of `batch_get`,
    what a prefetch waits for)."""

    bandwidth_bytes_per_s: float  # verified gets of 2 MiB pages, batches of 32
    latency_s: float  # one one-page get
    measured: str  # the command, and where it ran


def _mooncake_over_tcp(
    get_gbps: float, one_page_get_us: float, flags: str, machine: str
) -> L3StorePreset:
    """A preset from `bench_backends.py --backends mooncake` on a loopback store: the 2 MiB
    row's get_gbps, and the 64 KiB row's one_page_get_us less the time that page takes at
    that rate (the simulator adds bytes / bandwidth itself)."""
    rate = get_gbps * 1e9
    return L3StorePreset(
        bandwidth_bytes_per_s=rate,
        latency_s=one_page_get_us * 1e-6 - (64 << 10) / rate,
        measured=f"python benchmarks/bench_backends.py --backends mooncake --page-sizes "
        f"65536,2097152 {flags}: Mooncake Store over tcp on loopback (a master and a "
        f"mooncake_client holding the pages), {machine}",
    )


STORE_PRESETS: dict[str, L3StorePreset] = {
    # The quiet runs of docs/performance.md's second Mooncake stop (c8200a2, load under
    # 1.5: one worker thread a batch): 2 MiB gets 1.15-1.34 GB/s, one-page gets 550-590 us
    # (the first stop, 8d86abd at load 5-7: 0.59-0.74 GB/s, 255-422 us).
    "mooncake-tcp": _mooncake_over_tcp(
        1.25, 570, "--reps 7", "a 2-core VM shared with other work (load under 1.5)"
    ),
    # Its seventh stop's third call (213744e), one batch at a time: 2 MiB gets 2.447 GB/s,
    # one-page gets 414 us.
    "mooncake-tcp-gpu-host": _mooncake_over_tcp(
        2.447, 414, "--reps 7 --no-sglang", "a 16-core H100 server"
    ),
}


@dataclass(frozen=True)
class L3Stats:
    """What the controller reads from an executor's `l3_stats()`, plus the store's counters."""

    num_pages: int
    capacity_pages: int
    pages_written: int
    pages_read: int
    num_evictions: int
    num_errors: int = 0
    num_timeouts: int = 0
    num_corrupt_total: int = 0


class SimulatedL3:
    """An LRU set of page keys with a capacity in pages."""

    def __init__(self, capacity_pages: int, name: str = "l3") -> None:
        if capacity_pages < 1:
            raise ValueError(f"SimulatedL3 capacity must be >= 1 page, got {capacity_pages}")
        self.name = name
        self.capacity_pages = capacity_pages
        self._objects: OrderedDict[bytes, float] = OrderedDict()  # key -> visible since; LRU first
        self._pending: list[tuple[float, int, list[bytes]]] = []  # (visible_s, seq, keys)
        self._seq = itertools.count()
        self.pages_written = 0
        self.pages_read = 0
        self.num_evictions = 0

    def put(self, keys: list[bytes], visible_s: float) -> None:
        """A write of `keys` that completes (and so becomes visible) at `visible_s`."""
        heapq.heappush(self._pending, (visible_s, next(self._seq), keys))
        self.pages_written += len(keys)

    def exists(self, keys: list[bytes], now_s: float) -> int:
        """How many of `keys`, from the first, are visible at `now_s`."""
        self._settle(now_s)
        objects = self._objects
        count = 0
        for key in keys:
            visible_s = objects.get(key)
            if visible_s is None or visible_s > now_s:
                break
            count += 1
        return count

    def read(self, keys: list[bytes], now_s: float, chunk_pages: int | None = None) -> int:
        """Like `exists`, and the pages read become the most recently used.

        A reader that reads in chunks of `chunk_pages` stops after the chunk holding the
        first missing page, and every page found in the chunks it read counts as read (as
        with the memory backend), not only the leading ones it can use.
        """
        count = self.exists(keys, now_s)
        end = count
        if chunk_pages is not None and count < len(keys):
            end = min(len(keys), (count // chunk_pages + 1) * chunk_pages)
        objects = self._objects
        for key in keys[:end]:
            visible_s = objects.get(key)
            if visible_s is not None and visible_s <= now_s:
                objects.move_to_end(key)
        self.pages_read += count
        return count

    def settle_all(self) -> None:
        """Apply every write issued so far (at the end of a run, before reading `stats`)."""
        self._settle(float("inf"))

    def stats(self) -> L3Stats:
        return L3Stats(
            num_pages=len(self._objects),
            capacity_pages=self.capacity_pages,
            pages_written=self.pages_written,
            pages_read=self.pages_read,
            num_evictions=self.num_evictions,
        )

    def _settle(self, now_s: float) -> None:
        pending = self._pending
        objects = self._objects
        capacity = self.capacity_pages
        while pending and pending[0][0] <= now_s:
            visible_s, _, keys = heapq.heappop(pending)
            for key in keys:
                previous = objects.pop(key, None)
                objects[key] = visible_s if previous is None else min(previous, visible_s)
            while len(objects) > capacity:
                objects.popitem(last=False)
                self.num_evictions += 1
