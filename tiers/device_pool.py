"""L1: the device pool, the KV pages the engine attends over.

One allocation, layer-first, so that layer i of every page is one tensor the attention kernel
of layer i indexes by page id:

    kv  (num_layers, num_pages, page_size, *token_shape)

The pool is memory only: which of its page ids are free, and who holds each, is the
allocator of whoever owns the pool (the controller's `PageAllocator`, or an engine's private
one), the only allocator over these ids. The pool does not know which tokens a page holds
(the radix tree does) nor whether a page is backed up (the controller does).
"""

from __future__ import annotations

import torch

from tiers.errors import MemoryBudgetError
from tiers.layout import KVLayout


class DevicePool:
    """`num_pages` pages of `layout` on `device` (a CUDA device, or the CPU in tests).

    The memory is uninitialized: a page holds data only after the engine or a load wrote it.
    """

    def __init__(self, layout: KVLayout, num_pages: int, device: str | torch.device = "cuda"):
        self.layout = layout
        self.device = _resolve(torch.device(device))
        self._num_pages = _check_num_pages(num_pages)
        self.kv = torch.empty(  # (L, P, S, *token_shape)
            (layout.num_layers, num_pages, layout.page_size, *layout.token_shape),
            dtype=layout.torch_dtype,
            device=self.device,
        )

    @property
    def num_pages(self) -> int:
        return self._num_pages

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    def layer(self, layer: int) -> torch.Tensor:
        """The view of one layer: (num_pages, page_size, *token_shape), indexed by page id."""
        if isinstance(layer, bool) or not isinstance(layer, int):
            raise TypeError(f"layer must be an int, got {layer!r}")
        if not 0 <= layer < self.layout.num_layers:
            raise IndexError(f"layer {layer} out of range [0, {self.layout.num_layers})")
        return self.kv[layer]

    @classmethod
    def from_free_memory(
        cls,
        layout: KVLayout,
        device: str | torch.device = "cuda",
        *,
        reserve_bytes: int = 2 << 30,
        fraction: float = 0.9,
        free_bytes: int | None = None,
    ) -> DevicePool:
        """Size the pool from the memory free on `device` now.

        pages = floor(fraction * (free_bytes - reserve_bytes) / layout.bytes_per_page).
        `reserve_bytes` is left for activations, the CUDA graph pool and other allocations
        made after the pool; `fraction` (0, 1] keeps a margin on top. On CUDA, `free_bytes`
        defaults to what the driver reports free; on the CPU it must be given (the budget).
        Raises `MemoryBudgetError` when not even one page fits.
        """
        if not 0 < fraction <= 1:
            raise ValueError(f"fraction must be in (0, 1], got {fraction}")
        if reserve_bytes < 0:
            raise ValueError(f"reserve_bytes must be >= 0, got {reserve_bytes}")
        device = _resolve(torch.device(device))
        if free_bytes is None:
            if device.type != "cuda":
                raise ValueError(f"free_bytes must be given for device {device}")
            free_bytes, _total = torch.cuda.mem_get_info(device)
        usable_bytes = int((free_bytes - reserve_bytes) * fraction)
        num_pages = usable_bytes // layout.bytes_per_page
        if num_pages < 1:
            raise MemoryBudgetError(
                f"device pool on {device}: {free_bytes} bytes free - {reserve_bytes} reserved, "
                f"x {fraction} = {max(usable_bytes, 0)} bytes, less than one page "
                f"({layout.bytes_per_page} bytes of {layout.descriptor()})"
            )
        return cls(layout, num_pages, device)


def _resolve(device: torch.device) -> torch.device:
    """'cuda' -> 'cuda:<current>', so that the pool's device names one GPU."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _check_num_pages(num_pages: int) -> int:
    if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages < 1:
        raise ValueError(f"num_pages must be an int >= 1, got {num_pages!r}")
    return num_pages
