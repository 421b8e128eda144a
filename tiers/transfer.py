"""Transfers between the device pool and the host pool, off the compute stream.

`TransferEngine` owns one dedicated CUDA copy stream. Work on it is ordered:

- every transfer first waits for the work already queued on the caller's current stream, so
  a backup reads device pages only after the forward pass that wrote them, and a load never
  overwrites a page an earlier kernel is still reading;
- transfers run in the order they were issued (one stream), so a backup issued after a load
  of the same device pages copies the loaded data.

`load_async` issues one `load_layer` per layer, in layer order, and records one CUDA event
after each: the engine calls `handle.wait_layer(i)` before layer i attends, which makes its
current stream wait for layer i only, so the copy of layer i+1 overlaps the compute of layer
i. `backup_async` issues one launch for all layers and records one event.

What the engine does not order for you: the caller keeps the pages of a transfer allocated and
unwritten (device pages of a backup, host pages of a load) until its handle is done, and waits
on a load before reading the pages it fills.

On the CPU the same API runs synchronously: every handle is done when it is returned.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from tiers import kernels
from tiers.copy_engine import MIN_CHUNK_BYTES, BatchCopier, layer_chunk_pointers, page_runs
from tiers.device_pool import DevicePool
from tiers.errors import KVTensorError
from tiers.host_pool import HostPool
from tiers.kernels import DEFAULT_COPY_CONFIG, CopyConfig, PageIds

logger = logging.getLogger(__name__)

KERNELS = ("auto", "copy_engine", "triton", "reference")
# `warm_up` times a load of this many bytes: enough that the link's rate, not its latency,
# sets the time (16 pages of a small model timed a small share of the link:
# docs/performance.md).
LINK_SAMPLE_BYTES = 16 << 20


class LoadHandle:
    """A load of all layers, issued layer by layer; one event per layer (None on the CPU)."""

    def __init__(
        self, num_layers: int, events: list | None, device=None, keep_alive: tuple = ()
    ) -> None:
        self.num_layers = num_layers
        self._events = events
        self._device = device
        self._keep_alive = keep_alive  # id tensors the copy stream still reads

    def wait_layer(self, layer: int) -> None:
        """Make the caller's current stream wait until layer `layer` is loaded (non-blocking
        for the CPU thread). On the CPU the load is already complete."""
        if isinstance(layer, bool) or not isinstance(layer, int):
            raise TypeError(f"layer must be an int, got {layer!r}")
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} out of range [0, {self.num_layers})")
        if self._events is not None:
            torch.cuda.current_stream(self._device).wait_event(self._events[layer])

    def is_done(self) -> bool:
        """True once every layer is loaded (a non-blocking poll)."""
        return self._events is None or self._events[-1].query()

    def wait(self) -> None:
        """Block the CPU thread until every layer is loaded."""
        if self._events is not None:
            self._events[-1].synchronize()


class BackupHandle:
    """A backup of a batch of pages, all layers; one event (None on the CPU)."""

    def __init__(self, event=None, keep_alive: tuple = ()) -> None:
        self._event = event
        self._keep_alive = keep_alive

    def is_done(self) -> bool:
        """True once the host pages hold the data (a non-blocking poll)."""
        return self._event is None or self._event.query()

    def wait(self) -> None:
        """Block the CPU thread until the host pages hold the data."""
        if self._event is not None:
            self._event.synchronize()


class TransferEngine:
    """Moves pages between `device_pool` and `host_pool`, which must share one layout.

    kernel: "copy_engine" (batched copies on the GPU's copy engines, `tiers.copy_engine`),
            "triton" (the copy kernels; on the CPU only under TRITON_INTERPRET=1),
            "reference" (plain torch indexing and copies), or "auto": on CUDA with a pinned
            host pool, the copy engines for (page, layer) chunks of 64 KiB and more where
            the driver has batched copies, the Triton kernels otherwise; the reference on
            the CPU.
    config: launch shape of the kernels (SM budget, warps, tile size).

    Not thread-safe: one scheduler thread issues transfers and polls handles.
    """

    def __init__(
        self,
        device_pool: DevicePool,
        host_pool: HostPool,
        *,
        kernel: str = "auto",
        config: CopyConfig = DEFAULT_COPY_CONFIG,
    ) -> None:
        if device_pool.layout != host_pool.layout:
            raise KVTensorError(
                f"pools hold different layouts: device {device_pool.layout.descriptor()}, "
                f"host {host_pool.layout.descriptor()}"
            )
        if kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
        self.device_pool = device_pool
        self.host_pool = host_pool
        self.config = config
        self.device = device_pool.device
        self.on_cuda = self.device.type == "cuda"
        if self.on_cuda and not host_pool.pinned:
            if kernel == "triton":
                raise KVTensorError("kernel='triton' on CUDA needs a pinned host pool")
            if kernel == "auto":
                logger.warning("host pool is not pinned: transfers use the plain torch path")
        self._copier = BatchCopier.load() if self.on_cuda and host_pool.pinned else None
        if kernel == "copy_engine" and self._copier is None:
            raise KVTensorError(
                "kernel='copy_engine' needs CUDA, a pinned host pool and a driver with "
                "cuMemcpyBatchAsync (CUDA 12.8+)"
            )
        self.load_kernel = self.backup_kernel = kernel
        if kernel == "auto":
            self.load_kernel = self.backup_kernel = "reference"
            if self.on_cuda and host_pool.pinned:
                # Loads of large chunks run at the link's rate on the copy engines, and leave
                # the SMs to the forward pass they overlap; backups stay on the kernels, which
                # beat the engines device-to-host (bench_copy_engine.py; docs/performance.md).
                large = device_pool.layout.bytes_per_page_per_layer >= MIN_CHUNK_BYTES
                self.backup_kernel = "triton"
                self.load_kernel = "copy_engine" if large and self._copier else "triton"
        if "triton" in (self.load_kernel, self.backup_kernel):
            if not self.on_cuda and not kernels.triton_interpreting():
                raise KVTensorError("kernel='triton' on the CPU needs TRITON_INTERPRET=1")
        self.copy_stream = torch.cuda.Stream(self.device) if self.on_cuda else None

    def load_async(self, host_page_ids: PageIds, device_page_ids: PageIds) -> LoadHandle:
        """Copy every layer of `host_page_ids[i]` into `device_page_ids[i]`: on a GPU layer
        by layer, an event each; on the CPU at once, a page at a time.

        Raises `PageIdError` (issuing nothing) for ids out of range, lists of different
        lengths, or a device page listed twice.
        """
        host_ids, dev_ids = kernels.check_page_ids(
            host_page_ids, device_page_ids, self.host_pool.num_pages, self.device_pool.num_pages
        )
        num_layers = self.device_pool.layout.num_layers
        if host_ids.numel() == 0:
            return LoadHandle(num_layers, None)
        if not self.on_cuda:
            if self.load_kernel == "reference":
                _copy_in_host_memory(self.device_pool.kv, self.host_pool.kv, dev_ids, host_ids)
            else:  # the Triton kernels, interpreted (their CPU tests)
                for layer in range(num_layers):
                    self._load_layer(layer, host_ids, dev_ids)
            return LoadHandle(num_layers, None)
        self._wait_for_caller()
        with torch.cuda.stream(self.copy_stream):
            host_ids, dev_ids = self._to_device(self.load_kernel, host_ids, dev_ids)
            runs = []
            if self.load_kernel == "copy_engine":  # the same split for every layer
                runs, host_ids, dev_ids = self._split_runs(host_ids, dev_ids)
            events = []
            keep_alive = [host_ids, dev_ids]
            for layer in range(num_layers):
                keep_alive += self._load_layer(layer, host_ids, dev_ids, runs)
                event = torch.cuda.Event()
                event.record(self.copy_stream)
                events.append(event)
        return LoadHandle(num_layers, events, self.device, keep_alive=tuple(keep_alive))

    def backup_async(self, device_page_ids: PageIds, host_page_ids: PageIds) -> BackupHandle:
        """Copy every layer of `device_page_ids[i]` into `host_page_ids[i]`, one launch.

        Raises `PageIdError` (issuing nothing) as `load_async` does, for a host page listed
        twice.
        """
        dev_ids, host_ids = kernels.check_page_ids(
            device_page_ids, host_page_ids, self.device_pool.num_pages, self.host_pool.num_pages
        )
        if dev_ids.numel() == 0:
            return BackupHandle(None)
        if not self.on_cuda:
            if self.backup_kernel == "reference":
                _copy_in_host_memory(
                    self.device_pool.kv, self.host_pool.kv, dev_ids, host_ids, backup=True
                )
            else:
                self._backup(dev_ids, host_ids)
            return BackupHandle(None)
        self._wait_for_caller()
        with torch.cuda.stream(self.copy_stream):
            dev_ids, host_ids = self._to_device(self.backup_kernel, dev_ids, host_ids)
            pointer_arrays = self._backup(dev_ids, host_ids)
            event = torch.cuda.Event()
            event.record(self.copy_stream)
        return BackupHandle(event, keep_alive=(dev_ids, host_ids, *pointer_arrays))

    def warm_up(self) -> tuple[int, float] | None:
        """Copy a few pages each way once and wait, so that what a first copy costs (the
        Triton kernels' compilation for 1, 2 and 16 pages, which it specialises for, the
        driver's first batched copy) is paid here, not by the first request that moves a
        page; then time a load of `LINK_SAMPLE_BYTES` of pages (the second of two: the
        first pays for its page count). For pools nothing holds pages in yet: their first
        pages are overwritten. Returns (bytes, seconds) of the timed load, the link's rate
        before any request has measured it; None on the CPU, where nothing is compiled,
        and where the pools hold too few bytes for a load to time more than its latency."""
        if not self.on_cuda:
            return None
        pool_pages = min(self.device_pool.num_pages, self.host_pool.num_pages)
        most = min(16, pool_pages)
        for count in sorted({1, min(2, most), most}):
            ids = list(range(count))
            self.backup_async(ids, ids).wait()
            self.load_async(ids, ids).wait()
        page_bytes = self.device_pool.layout.bytes_per_page
        count = min(pool_pages, -(-LINK_SAMPLE_BYTES // page_bytes))
        if count * page_bytes < LINK_SAMPLE_BYTES // 2:
            return None
        ids = list(range(count))
        self.load_async(ids, ids).wait()
        timer = LinkTimer(self)
        handle = self.load_async(ids, ids)
        timer.stop()
        handle.wait()
        return count * page_bytes, timer.seconds()

    def _wait_for_caller(self) -> None:
        """Order the copy stream after the work queued so far on the caller's stream.

        Read the caller's stream before entering the copy stream's context: inside it, the
        current stream is the copy stream itself and the wait would be a no-op."""
        self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))

    @property
    def kernel(self) -> str:
        """The path transfers take ("copy_engine+triton": loads on the engines, backups on
        the kernels)."""
        if self.load_kernel == self.backup_kernel:
            return self.load_kernel
        return f"{self.load_kernel}+{self.backup_kernel}"

    def _to_device(self, kernel: str, *ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Checked CPU ids -> the device, for the kernels; the other paths use the CPU
        tensors. Called on the copy stream, so the tensors belong to it."""
        if kernel != "triton":
            return ids
        return tuple(t.pin_memory().to(self.device, non_blocking=True) for t in ids)

    def _load_layer(
        self, layer: int, host_ids: torch.Tensor, dev_ids: torch.Tensor, runs=()
    ) -> list:
        """Issue one layer's load (on the copy engines: `runs` from `_split_runs`, and the
        pages left over); returns what must live until it is done."""
        host_kv, dev_kv = self.host_pool.kv, self.device_pool.kv
        if self.load_kernel == "copy_engine":
            return self._load_layer_on_engines(layer, runs, host_ids, dev_ids)
        if self.load_kernel == "triton":
            kernels.load_layer(
                host_kv, dev_kv, layer, host_ids, dev_ids, config=self.config, check_ids=False
            )
        else:
            kernels.load_layer_reference(host_kv, dev_kv, layer, host_ids, dev_ids)
        return []

    def _backup(self, dev_ids: torch.Tensor, host_ids: torch.Tensor) -> list:
        """Issue a backup of all layers; returns what must live until it is done."""
        host_kv, dev_kv = self.host_pool.kv, self.device_pool.kv
        if self.backup_kernel == "copy_engine":
            tables = [
                self._chunk_pointers(layer, dev_ids, host_ids)
                for layer in range(self.device_pool.layout.num_layers)
            ]
            device_ptrs = np.concatenate([device for device, _ in tables])
            host_ptrs = np.concatenate([host for _, host in tables])
            sizes = np.full(len(device_ptrs), self._chunk_bytes, dtype=np.uint64)
            self._copier.copy(host_ptrs, device_ptrs, sizes, self.copy_stream.cuda_stream)
            return [device_ptrs, host_ptrs, sizes]
        if self.backup_kernel == "triton":
            kernels.backup(dev_kv, host_kv, dev_ids, host_ids, config=self.config, check_ids=False)
        else:
            kernels.backup_reference(dev_kv, host_kv, dev_ids, host_ids)
        return []

    def _split_runs(self, host_ids: torch.Tensor, dev_ids: torch.Tensor):
        """(runs of consecutive pages, the host and device ids left over) for the copy
        engines: a run is one strided copy a layer (`tiers.copy_engine`: the driver's CPU
        cost is per copy)."""
        if not self._copier.has_2d:
            return [], host_ids, dev_ids
        host, dev = host_ids.numpy(), dev_ids.numpy()
        runs, rest = page_runs(host, dev)  # (in numpy: see kernels.check_page_ids on the GIL)
        return runs, torch.from_numpy(host[rest]), torch.from_numpy(dev[rest])

    def _load_layer_on_engines(self, layer: int, runs, host_ids, dev_ids) -> list:
        """A strided copy per run, one batch for the pages left over."""
        chunk = self._chunk_bytes
        stream = self.copy_stream.cuda_stream
        dev_kv, host_kv = self.device_pool.kv, self.host_pool.kv
        dev_layer = dev_kv.data_ptr() + layer * dev_kv.stride(0) * dev_kv.element_size()
        host_page_stride = host_kv.stride(0) * host_kv.element_size()
        host_layer = host_kv.data_ptr() + layer * chunk
        for host_id, dev_id, length in runs:
            self._copier.copy_2d(
                dev_layer + dev_id * chunk,
                chunk,
                host_layer + host_id * host_page_stride,
                host_page_stride,
                chunk,
                length,
                stream,
            )
        if not len(host_ids):
            return []
        device_ptrs, host_ptrs = self._chunk_pointers(layer, dev_ids, host_ids)
        sizes = np.full(len(device_ptrs), chunk, dtype=np.uint64)
        self._copier.copy(device_ptrs, host_ptrs, sizes, stream)
        return [device_ptrs, host_ptrs, sizes]

    @property
    def _chunk_bytes(self) -> int:
        return self.device_pool.layout.bytes_per_page_per_layer

    def _chunk_pointers(self, layer: int, dev_ids: torch.Tensor, host_ids: torch.Tensor):
        dev_kv, host_kv = self.device_pool.kv, self.host_pool.kv
        return layer_chunk_pointers(
            dev_kv.data_ptr(),
            dev_kv.stride(0) * dev_kv.element_size(),
            host_kv.data_ptr(),
            host_kv.stride(0) * host_kv.element_size(),
            self._chunk_bytes,
            layer,
            dev_ids.numpy(),
            host_ids.numpy(),
        )


def _copy_in_host_memory(
    device_kv: torch.Tensor,
    host_kv: torch.Tensor,
    device_ids: torch.Tensor,
    host_ids: torch.Tensor,
    *,
    backup: bool = False,
) -> None:
    """A load (host page -> device page) or a backup (the other way) of checked ids between
    two pools that are both in host memory, the CPU's L1 and L2: one strided copy a page,
    every layer at once. (The reference kernels gather and scatter a layer at a time, each
    checking the ids again: several times slower; bench_engine --models tiny on the CPU,
    docs/performance.md.)"""
    for device_page, host_page in zip(device_ids.tolist(), host_ids.tolist(), strict=True):
        if backup:
            host_kv[host_page].copy_(device_kv[:, device_page])
        else:
            device_kv[:, device_page].copy_(host_kv[host_page])


class LinkTimer:
    """Times one copy on the link: CUDA events around it on the copy stream (read once the
    copy is done), or the wall time of a synchronous copy on the CPU."""

    def __init__(self, transfer: TransferEngine) -> None:
        self._stream = transfer.copy_stream
        self._began = time.perf_counter()
        self._seconds = 0.0
        self._events = None
        if self._stream is not None:
            start, self._end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            # (after the caller's queued work, as the copy itself: time the copy, not the wait)
            self._stream.wait_stream(torch.cuda.current_stream(self._stream.device))
            start.record(self._stream)
            self._events = (start, self._end)

    def stop(self) -> None:
        """Right after the copy is issued (on the CPU: done)."""
        if self._events is None:
            self._seconds = time.perf_counter() - self._began
        else:
            self._end.record(self._stream)

    def seconds(self) -> float:
        """The copy's time; on a GPU, only once the copy is done."""
        if self._events is None:
            return self._seconds
        start, end = self._events
        end.synchronize()  # (recorded right after the copy's last event: microseconds)
        return start.elapsed_time(end) / 1e3
