"""The real executor: moves pages with the tiers' kernels and the L3 storage backend.

L1 <-> L2 ops run on the tiers' `TransferEngine` (a dedicated copy stream and CUDA events on
a GPU; synchronous on the CPU). L2 <-> L3 ops run as coroutines on an asyncio loop in a
background thread of this executor's own, reading from and writing into the pinned host
pool's pages directly (`HostPool.page_bytes`), so no page is copied on its way to storage.

A prefetch is read in batches of `L3Config.pages_per_read` pages, up to `read_batches` of
them in flight at once (the backends take concurrent calls), so that a long run is read on
as many threads as the backend and the cores give; its `num_ready` grows over the leading
batches that have arrived whole, and `wait_ready` lets the controller load each one on into
L1 while the next are still being read.

The only module of `hicache` that imports torch (through `tiers`).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import os
import threading
import time

from hicache.config import HiCacheConfig
from hicache.ops import (
    BackupOp,
    Executor,
    LoadOp,
    PrefetchOp,
    TransferOp,
    WriteL3Op,
)
from storage_backends.errors import StorageError
from storage_backends.loop_thread import LoopThread
from storage_backends.objects import header_size
from storage_backends.options import with_option
from storage_backends.registry import open_backend
from tiers.device_pool import DevicePool
from tiers.host_pool import HostPool
from tiers.transfer import LinkTimer, TransferEngine

logger = logging.getLogger(__name__)

_MAX_READ_BATCHES = 4  # read batches in flight by default: one per core, at most this many


class RealExecutor(Executor):
    """Pools sized from `config`, a transfer engine between them, and an optional L3."""

    def __init__(self, config: HiCacheConfig) -> None:
        layout = config.layout
        self._layout = layout
        self._read_pages = config.l3.pages_per_read(layout.bytes_per_page)
        self._read_batches = config.l3.read_batches or min(_MAX_READ_BATCHES, _cpus())
        self._progress = threading.Condition()  # notified when a prefetch's num_ready grows
        self._l3_secret_file = config.l3.secret_file
        if config.l1.num_pages:
            self.device_pool = DevicePool(layout, config.l1.num_pages, config.l1.device)
        else:
            self.device_pool = DevicePool.from_free_memory(
                layout,
                config.l1.device,
                reserve_bytes=config.l1.reserve_bytes,
                fraction=config.l1.memory_fraction,
            )
        self.host_pool: HostPool | None = None
        self.transfer: TransferEngine | None = None
        self._link_sample: tuple[int, float] | None = None
        if config.l2.budget_bytes:
            self.host_pool = HostPool.from_budget(
                layout,
                config.l2.budget_bytes,
                reserve_bytes=config.l2.reserve_bytes,
                pin=config.l2.pin_memory,
            )
            self.transfer = TransferEngine(self.device_pool, self.host_pool)
            self._link_sample = self.transfer.warm_up()  # (no page is in use yet)
        # (op, handle, the load's link timer), in submit order
        self._gpu_ops: list[tuple[TransferOp, object, LinkTimer | None]] = []
        self._done: collections.deque[TransferOp] = collections.deque()
        self._events: dict[int, threading.Event] = {}
        self._backend = None
        self._lent_to: list = []  # backends L2 was lent to (they say which pages they move)
        self._io: LoopThread | None = None

    # ------------------------------------------------------------------ Executor

    @property
    def num_device_pages(self) -> int:
        return self.device_pool.num_pages

    @property
    def num_host_pages(self) -> int:
        return self.host_pool.num_pages if self.host_pool is not None else 0

    @property
    def has_l3(self) -> bool:
        return self._backend is not None

    def now(self) -> float:
        return time.monotonic()

    def submit(self, op: TransferOp) -> None:
        if isinstance(op, LoadOp):
            timer = LinkTimer(self.transfer)
            handle = self.transfer.load_async(op.host_page_ids, op.device_page_ids)
            timer.stop()
            self._gpu_ops.append((op, handle, timer))
        elif isinstance(op, BackupOp):
            handle = self.transfer.backup_async(op.device_page_ids, op.host_page_ids)
            self._gpu_ops.append((op, handle, None))
        else:
            if self._backend is None:
                raise RuntimeError(f"{op.kind.value} submitted with no L3 backend attached")
            self._events[op.op_id] = threading.Event()
            runner = self._write if isinstance(op, WriteL3Op) else self._prefetch
            self._io.spawn(self._run_io(op, runner))

    def poll(self) -> list[TransferOp]:
        finished = []
        still_running = []
        for op, handle, timer in self._gpu_ops:
            if handle.is_done():
                if timer is not None:
                    op.busy_s = timer.seconds()
                self._finish(op)
                finished.append(op)
            else:
                still_running.append((op, handle, timer))
        self._gpu_ops = still_running
        while self._done:
            finished.append(self._done.popleft())
        return finished

    def wait(self, op: TransferOp, timeout_s: float | None) -> bool:
        if op.done:
            return True
        event = self._events.get(op.op_id)
        if event is not None:
            return event.wait(timeout_s)
        for gpu_op, handle, _timer in self._gpu_ops:
            if gpu_op is op:
                handle.wait()  # a GPU copy: bounded by the link, no timeout needed
                return True
        return op.done

    def wait_ready(self, op: PrefetchOp, num_pages: int, timeout_s: float | None) -> bool:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._progress:
            while not op.done and op.num_ready < num_pages:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    break
                self._progress.wait(remaining)
            return op.done or op.num_ready >= num_pages

    def wait_layer(self, op: LoadOp, layer: int) -> None:
        for gpu_op, handle, _timer in self._gpu_ops:
            if gpu_op is op:
                handle.wait_layer(layer)
                return
        # Not in the list: it finished and was polled, so every layer is in L1.

    def link_sample(self) -> tuple[int, float] | None:
        return self._link_sample

    def l3_exists(self, keys: list[bytes], timeout_s: float) -> int:
        if self._backend is None or not keys:
            return 0
        try:
            return self._io.run(self._backend.batch_exists(keys), timeout_s)
        except (concurrent.futures.TimeoutError, StorageError) as error:
            logger.warning("L3 lookup of %d keys failed: %r", len(keys), error)
            return 0

    def l3_stats(self):
        return self._backend.stats() if self._backend is not None else None

    def l3_capacity_pages(self) -> int | None:
        stats = self.l3_stats()
        if stats is None or not stats.capacity_bytes:
            return None
        descriptor = self._layout.descriptor()
        signed = self._backend.signs_pages
        object_bytes = header_size(descriptor, signed=signed) + self._layout.bytes_per_page
        return max(1, stats.capacity_bytes // object_bytes)

    def attach_l3(self, url: str | None) -> None:
        if self._backend is not None:
            self._io.run(self._backend.close())
            self._backend = None
        if self._lent_to:  # a closed backend is asked only while its transfers still run
            region = [self.host_pool.region()]
            self._lent_to = [b for b in self._lent_to if b.quarantined(region) == [True]]
        if url is None:
            return
        if self.host_pool is None:
            raise ValueError("an L3 backend needs an L2 pool: pages reach L3 through L2")
        if self._io is None:
            self._io = LoopThread("hicache-l3-io")
        backend = self._io.run(self._open(url))
        self._backend = backend

    def close(self) -> None:
        self.attach_l3(None)
        if self._io is not None:
            self._io.stop()
            self._io = None
        for _op, handle, _timer in self._gpu_ops:
            handle.wait()
        self._gpu_ops.clear()
        if self.host_pool is not None:
            self.host_pool.close()

    # ------------------------------------------------------------------ L3 I/O

    async def _open(self, url: str):
        if self._l3_secret_file:  # the config's tenant secret, as the URL option it is
            url = with_option(url, "secret_file", self._l3_secret_file)
        backend = open_backend(url, layout=self._layout.descriptor())
        await backend.connect()  # a wrong URL fails here, loudly, not later as misses
        if backend.lend(self.host_pool.region()):  # pages move straight into and out of L2
            self._lent_to.append(backend)
        return backend

    def quarantined_host_pages(self, host_page_ids: list[int]) -> list[bool]:
        """Pages of L2 a backend it was lent to still moves (a transfer past its deadline);
        a backend detached since still counts, until its transfers are over."""
        busy = [False] * len(host_page_ids)
        if not self._lent_to or self.host_pool is None:
            return busy
        pages = [self.host_pool.page_bytes(page) for page in host_page_ids]
        for backend in self._lent_to:
            busy = [b or q for b, q in zip(busy, backend.quarantined(pages), strict=True)]
        return busy

    async def _run_io(self, op: TransferOp, runner) -> None:
        try:
            await runner(op)
        except Exception as error:  # kept on the op; the controller raises it to its caller
            op.error = error
        self._finish(op)
        self._done.append(op)
        self._events.pop(op.op_id).set()
        with self._progress:
            self._progress.notify_all()

    async def _write(self, op: WriteL3Op) -> None:
        pages = [self.host_pool.page_bytes(page) for page in op.host_page_ids]
        stored = await self._backend.batch_put(op.keys, pages)
        op.num_written = _leading_true(stored)

    async def _prefetch(self, op: PrefetchOp) -> None:
        """Read the op's pages in batches, up to `_read_batches` at once, in order.

        `op.num_ready` counts the leading pages that arrived (verified) and grows as batches
        finish. A batch that comes back short ends the prefetch: the batches after it that
        have not started are skipped, and those running are waited for (a backend may
        write into their pages until its call returns; the op owns them until it is done).
        """
        spans = [
            (start, min(start + self._read_pages, op.num_pages))
            for start in range(0, op.num_pages, self._read_pages)
        ]
        arrived: list[int | None] = [None] * len(spans)  # pages each batch got (None: not yet)
        gate = asyncio.Semaphore(self._read_batches)
        short = False

        async def read(index: int, start: int, end: int) -> None:
            nonlocal short
            async with gate:
                if short:
                    arrived[index] = 0
                    return
                into = [self.host_pool.page_bytes(page) for page in op.host_page_ids[start:end]]
                found = await self._backend.batch_get(op.keys[start:end], into)
            arrived[index] = _leading_true(found)
            short = short or arrived[index] < end - start
            self._advance(op, spans, arrived)

        outcomes = await asyncio.gather(
            *(read(i, start, end) for i, (start, end) in enumerate(spans)),
            return_exceptions=True,  # every batch returns before the op is done
        )
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome

    def _advance(self, op: PrefetchOp, spans, arrived) -> None:
        """Set `num_ready` to the leading pages of batches that arrived (after the bytes:
        readers see whole pages), and wake whoever waits for them."""
        ready = 0
        for (start, end), got in zip(spans, arrived, strict=True):
            if got is None:
                break
            ready = start + got
            if got < end - start:
                break
        if ready > op.num_ready:
            op.num_ready = ready
            with self._progress:
                self._progress.notify_all()

    def _finish(self, op: TransferOp) -> None:
        op.finished_s = self.now()
        op.done = True


def _cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _leading_true(flags: list[bool]) -> int:
    count = 0
    for flag in flags:
        if not flag:
            break
        count += 1
    return count
