"""The virtual-time executor: `hicache.ops.Executor` on a clock the trace player sets.

The controller (`hicache.HiCache`) runs unchanged on top of it: it decides what moves,
this executor decides when each move finishes. An op takes

    max(now, the link's busy-until) + bytes / bandwidth + latency

on the link it uses: the host link (PCIe or NVLink-C2C, one `Link` per direction) for
L1 <-> L2, the instance's NIC (per direction) and, when instances share one L3, the store's
aggregate bandwidth for L2 <-> L3. Links are FIFO: ops of one kind finish in submission
order. An L3 prefetch reads in chunks like the real executor, so its `num_ready` grows as
its pages arrive and the `timeout` and `best_effort` policies see partial progress; an
existence check costs one L3 round trip of the caller's time; `wait_layer` is free (the
player models the per-layer overlap of loads and compute itself).

Time only moves forward: `advance_to` (the player) and `wait` (the controller) move it.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from hicache.ops import (
    BackupOp,
    Executor,
    LoadOp,
    OpKind,
    PrefetchOp,
    TransferOp,
    WriteL3Op,
)
from hicache.simulate.errors import SimulationError
from hicache.simulate.l3 import SimulatedL3

URL_SCHEME = "sim://"


class Link:
    """A FIFO pipe of fixed bandwidth. Counts what went through it."""

    __slots__ = ("name", "bytes_per_s", "busy_until_s", "bytes_moved", "busy_s")

    def __init__(self, name: str, bytes_per_s: float) -> None:
        if not bytes_per_s > 0:
            raise ValueError(f"link {name}: bandwidth must be > 0, got {bytes_per_s}")
        self.name = name
        self.bytes_per_s = bytes_per_s
        self.busy_until_s = 0.0
        self.bytes_moved = 0
        self.busy_s = 0.0


def reserve(links: Sequence[Link], now_s: float, num_bytes: int) -> tuple[float, float]:
    """Send `num_bytes` through `links` in series, starting when all are free.

    Returns (start, end): the slowest link sets the end; each link is busy for its share.
    """
    start = now_s
    for link in links:
        start = max(start, link.busy_until_s)
    end = start
    for link in links:
        seconds = num_bytes / link.bytes_per_s
        link.busy_until_s = start + seconds
        link.bytes_moved += num_bytes
        link.busy_s += seconds
        end = max(end, start + seconds)
    return start, end


@dataclass(frozen=True)
class Links:
    """The links one instance's ops use, and their per-op latencies."""

    device_to_host: Link
    host_to_device: Link
    host_latency_s: float
    l3_write: tuple[Link, ...] = ()  # the NIC out, then the shared store's write side
    l3_read: tuple[Link, ...] = ()  # the NIC in, then the shared store's read side
    l3_latency_s: float = 0.0


@dataclass
class _Prefetch:
    """When the chunks of a prefetch arrive."""

    start_s: float
    present: int  # leading pages L3 holds
    chunk_pages: int
    latency_s: float
    page_seconds: float  # transfer time of one page on the slowest link

    def ready_at(self, now_s: float) -> int:
        """Leading pages in L2 at `now_s` (whole chunks, as the real executor reports)."""
        ready = 0
        chunk = self.chunk_pages
        for index in range(max(1, math.ceil(self.present / chunk))):
            through = min(self.present, (index + 1) * chunk)
            if self.start_s + (index + 1) * self.latency_s + through * self.page_seconds > now_s:
                break
            ready = through
        return ready

    def done_s(self, num_pages: int) -> float:
        """When the read ends: after the chunk holding the first missing page, if any."""
        chunk = self.chunk_pages
        chunks = math.ceil(num_pages / chunk)
        if self.present < num_pages:
            chunks = min(chunks, self.present // chunk + 1)
        return self.start_s + chunks * self.latency_s + self.present * self.page_seconds


class VirtualExecutor(Executor):
    """Carries out the controller's ops in virtual time (see the module docstring)."""

    device_pool = None  # no tensors: nothing is attended over

    def __init__(
        self,
        *,
        num_device_pages: int,
        num_host_pages: int,
        page_bytes: int,
        links: Links,
        stores: Mapping[str, SimulatedL3] | None = None,
        prefetch_chunk_pages: int = 32,
        acknowledge: Callable[[int], int] | None = None,
    ) -> None:
        self._num_device_pages = num_device_pages
        self._num_host_pages = num_host_pages
        self._page_bytes = page_bytes
        self._links = links
        self._stores = dict(stores or {})
        self._chunk_pages = prefetch_chunk_pages
        # How many leading pages of an L3 write of n pages the store acknowledges (and
        # keeps); the rest are lost, as with a full disk or a daemon down. Default: all.
        self._acknowledge = acknowledge
        self._store: SimulatedL3 | None = None
        self._now = 0.0
        self._inflight: list[tuple[float, int, TransferOp]] = []  # (done_s, seq, op) heap
        self._done_s: dict[int, float] = {}
        self._prefetches: dict[int, tuple[PrefetchOp, _Prefetch]] = {}
        self._last_done: dict[OpKind, float] = dict.fromkeys(OpKind, 0.0)
        self._seq = itertools.count()
        self.loads_done_s = 0.0  # when every LOAD submitted so far is in L1

    # ------------------------------------------------------------------ the clock

    def now(self) -> float:
        return self._now

    def next_done_s(self) -> float | None:
        """When the next op in flight ends (None: nothing in flight)."""
        return self._inflight[0][0] if self._inflight else None

    def advance_to(self, t_s: float) -> None:
        """Move the clock to `t_s` (never backwards)."""
        if t_s > self._now:
            self._now = t_s

    # ------------------------------------------------------------------ Executor

    @property
    def num_device_pages(self) -> int:
        return self._num_device_pages

    @property
    def num_host_pages(self) -> int:
        return self._num_host_pages

    @property
    def has_l3(self) -> bool:
        return self._store is not None

    def submit(self, op: TransferOp) -> None:
        now = self._now
        links = self._links
        if isinstance(op, (BackupOp, LoadOp)):
            link = links.device_to_host if isinstance(op, BackupOp) else links.host_to_device
            _, end = reserve((link,), now, op.num_bytes)
            done = end + links.host_latency_s
        elif isinstance(op, WriteL3Op):
            _, end = reserve(links.l3_write, now, op.num_bytes)
            done = end + links.l3_latency_s
            op.num_written = len(op.keys)
            if self._acknowledge is not None:
                op.num_written = max(0, min(op.num_written, self._acknowledge(len(op.keys))))
        elif isinstance(op, PrefetchOp):
            done = self._submit_prefetch(op, now)
        else:
            raise SimulationError(f"unknown op {op!r}")
        done = max(done, self._last_done[op.kind])  # FIFO per kind and link
        self._last_done[op.kind] = done
        if isinstance(op, WriteL3Op):
            self._store.put(op.keys[: op.num_written], done)
        elif isinstance(op, LoadOp):
            self.loads_done_s = max(self.loads_done_s, done)
        self._done_s[op.op_id] = done
        heapq.heappush(self._inflight, (done, next(self._seq), op))

    def _submit_prefetch(self, op: PrefetchOp, now: float) -> float:
        links = self._links
        present = self._store.read(op.keys, now, self._chunk_pages)
        start, _ = reserve(links.l3_read, now, present * self._page_bytes)
        slowest = min(link.bytes_per_s for link in links.l3_read)
        plan = _Prefetch(
            start_s=start,
            present=present,
            chunk_pages=self._chunk_pages,
            latency_s=links.l3_latency_s,
            page_seconds=self._page_bytes / slowest,
        )
        self._prefetches[op.op_id] = (op, plan)
        return plan.done_s(op.num_pages)

    def poll(self) -> list[TransferOp]:
        finished = []
        inflight = self._inflight
        now = self._now
        while inflight and inflight[0][0] <= now:
            done, _, op = heapq.heappop(inflight)
            prefetch = self._prefetches.pop(op.op_id, None)
            if prefetch is not None:
                op.num_ready = prefetch[1].present
            op.finished_s = done
            op.done = True
            del self._done_s[op.op_id]
            finished.append(op)
        for op, plan in self._prefetches.values():
            op.num_ready = max(op.num_ready, plan.ready_at(now))
        return finished

    def wait(self, op: TransferOp, timeout_s: float | None) -> bool:
        if op.done:
            return True
        done = self._done_s.get(op.op_id)
        if done is None:
            return op.done
        if timeout_s is None or done <= self._now + timeout_s:
            self.advance_to(done)
            return True
        self.advance_to(self._now + timeout_s)
        return False

    def wait_layer(self, op: LoadOp, layer: int) -> None:
        """Free: the player overlaps loads with compute layer by layer in its time model."""

    def link_sample(self) -> tuple[int, float] | None:
        """One page's L2 -> L1 load on the modelled link, as the real executor times one
        when it is built (with an L2): the controller's load rate before any load."""
        if not self._num_host_pages:
            return None
        link = self._links.host_to_device
        return self._page_bytes, self._page_bytes / link.bytes_per_s + self._links.host_latency_s

    def l3_exists(self, keys: list[bytes], timeout_s: float) -> int:
        if self._store is None or not keys:
            return 0
        self._now += self._links.l3_latency_s  # one round trip, on the caller's time
        return self._store.exists(keys, self._now)

    def attach_l3(self, url: str | None) -> None:
        if url is None:
            self._store = None
            return
        if not url.startswith(URL_SCHEME):
            raise SimulationError(f"the simulator's L3 URLs are {URL_SCHEME}NAME, got {url!r}")
        name = url[len(URL_SCHEME) :]
        if name not in self._stores:
            raise SimulationError(f"no simulated L3 named {name!r} (known: {sorted(self._stores)})")
        if not self._links.l3_read or not self._links.l3_write:
            raise SimulationError("an L3 needs links: give the instance an L3 bandwidth")
        self._store = self._stores[name]

    def l3_stats(self):
        return self._store.stats() if self._store is not None else None

    def l3_capacity_pages(self) -> int | None:
        return self._store.capacity_pages if self._store is not None else None

    def close(self) -> None:
        self._store = None
