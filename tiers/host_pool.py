"""L2: the host pool, a larger copy of recent pages in pinned host memory.

One allocation, page-first, so that one page of all layers is one contiguous block:

    kv  (num_pages, num_layers, page_size, *token_shape)

An L3 backend reads a stored page straight into `page_bytes(id)` and writes one out of it,
with no copy in between; the GPU copy kernels read and write `kv` in place. The memory is
allocated at its exact size and then registered with CUDA (page-locked), rather than taken
from torch's pinned caching allocator, which rounds every block up to a power of two (a
100 GiB pool would ask for 128 GiB). Where pinning is impossible (no CUDA, a locked-memory
limit) the pool falls back to ordinary memory with one warning; the transfer engine then
takes the plain torch path.

The pool does not know which tokens or keys its pages hold.
"""

from __future__ import annotations

import logging
import os
import warnings
import weakref

import torch

from tiers.errors import MemoryBudgetError, PageIdError
from tiers.layout import KVLayout

logger = logging.getLogger(__name__)


class UnpinnedHostMemoryWarning(RuntimeWarning):
    """The host pool could not be pinned and uses ordinary (pageable) memory."""


class HostPool:
    """`num_pages` pages of `layout` in host memory, pinned when `pin` and CUDA allow it.

    Keep the pool alive while transfers that use it are in flight (the transfer engine holds
    a reference); `close()` unpins the memory, after which only the CPU may use it.
    """

    def __init__(self, layout: KVLayout, num_pages: int, pin: bool = True) -> None:
        self.layout = layout
        self._num_pages = _check_num_pages(num_pages)
        self.kv = torch.empty(  # (P, L, S, *token_shape)
            (num_pages, layout.num_layers, layout.page_size, *layout.token_shape),
            dtype=layout.torch_dtype,
        )
        # One flat byte view, shared by every page_bytes() memoryview (numpy shares the memory).
        self._bytes = self.kv.view(-1).view(torch.uint8).numpy()
        self._unpin = None
        if pin:
            reason = _register(self.kv)
            if reason is None:
                self._unpin = weakref.finalize(self, _unregister, self.kv)
            else:
                warnings.warn(
                    f"host pool ({self.nbytes} bytes) is not pinned: {reason}; using ordinary "
                    "memory, so GPU transfers take the slower plain torch path",
                    UnpinnedHostMemoryWarning,
                    stacklevel=2,
                )

    @property
    def num_pages(self) -> int:
        return self._num_pages

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    @property
    def pinned(self) -> bool:
        return self._unpin is not None and self._unpin.alive

    def region(self) -> memoryview:
        """Every page's bytes as one writable view (what `page_bytes` slices): what an L3
        backend that moves pages straight into and out of L2 is lent."""
        return memoryview(self._bytes)

    def page_bytes(self, host_page_id: int) -> memoryview:
        """Writable, zero-copy view of one page, all layers: `layout.bytes_per_page` bytes.

        It aliases the pool: valid while the pool lives, and its contents are only stable while
        the caller holds the page (no backup or load into it is in flight).
        """
        if isinstance(host_page_id, bool) or not isinstance(host_page_id, int):
            raise PageIdError(f"host page id must be an int, got {host_page_id!r}")
        if not 0 <= host_page_id < self.num_pages:
            raise PageIdError(f"host page id {host_page_id} out of range [0, {self.num_pages})")
        page_bytes = self.layout.bytes_per_page
        start = host_page_id * page_bytes
        return memoryview(self._bytes[start : start + page_bytes])

    def close(self) -> None:
        """Unpin the memory now rather than when the pool is collected."""
        if self._unpin is not None:
            self._unpin()

    @classmethod
    def from_budget(
        cls,
        layout: KVLayout,
        budget_bytes: int,
        *,
        reserve_bytes: int = 4 << 30,
        pin: bool = True,
        available_bytes: int | None = None,
    ) -> HostPool:
        """As many pages as fit in `budget_bytes`, checked against the RAM available now.

        `available_bytes` defaults to MemAvailable from /proc/meminfo; the pool plus
        `reserve_bytes` (left for the process and the rest of the machine) must fit in it.
        Raises `MemoryBudgetError` naming the numbers when it does not, or when the budget
        holds less than one page.
        """
        if budget_bytes < 0 or reserve_bytes < 0:
            raise ValueError(
                f"budget_bytes and reserve_bytes must be >= 0, got {budget_bytes}, {reserve_bytes}"
            )
        num_pages = budget_bytes // layout.bytes_per_page
        if num_pages < 1:
            raise MemoryBudgetError(
                f"host pool budget of {budget_bytes} bytes is less than one page "
                f"({layout.bytes_per_page} bytes of {layout.descriptor()})"
            )
        if available_bytes is None:
            available_bytes = available_host_memory_bytes()
        pool_bytes = num_pages * layout.bytes_per_page
        if pool_bytes + reserve_bytes > available_bytes:
            raise MemoryBudgetError(
                f"host pool of {num_pages} pages ({pool_bytes / 2**30:.2f} GiB) plus a reserve "
                f"of {reserve_bytes / 2**30:.2f} GiB does not fit in the "
                f"{available_bytes / 2**30:.2f} GiB of RAM available; lower the budget"
            )
        return cls(layout, num_pages, pin=pin)


def available_host_memory_bytes() -> int:
    """RAM that can be allocated without swapping: MemAvailable, else free physical pages."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _register(kv: torch.Tensor) -> str | None:
    """Page-lock `kv` with cudaHostRegister; None on success, else the reason it failed."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    nbytes = kv.numel() * kv.element_size()
    cudart = torch.cuda.cudart()
    err = _error_code(cudart.cudaHostRegister(kv.data_ptr(), nbytes, 0))
    if err != 0:
        # The runtime also records the error as the thread's last error, which the next
        # kernel launch check would report as its own; clear it where the binding allows.
        clear = getattr(cudart, "cudaGetLastError", None)
        if clear is not None:
            clear()
        return f"cudaHostRegister failed with CUDA error {err}"
    logger.info("pinned %d bytes of host memory for the host pool", nbytes)
    return None


def _unregister(kv: torch.Tensor) -> None:
    err = _error_code(torch.cuda.cudart().cudaHostUnregister(kv.data_ptr()))
    if err != 0:
        logger.warning("cudaHostUnregister failed with CUDA error %d", err)


def _error_code(result) -> int:
    """cudaError_t as returned by torch's cudart binding (an enum, or an int) -> int."""
    return int(getattr(result, "value", result))


def _check_num_pages(num_pages: int) -> int:
    if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages < 1:
        raise ValueError(f"num_pages must be an int >= 1, got {num_pages!r}")
    return num_pages
