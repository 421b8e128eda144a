"""tiers: the memory of L1 (device) and L2 (pinned host), and the kernels that move pages.

Knows page ids and tensors; never tokens or page keys.

    layout.py       KVLayout: the shape of one token's KV per layer, and the sizes derived
    allocator.py    PageAllocator: free page ids of one pool, and each used one's owner
                    (the one allocator over a pool's ids: the pools are memory only)
    device_pool.py  DevicePool: L1, layer-first (num_layers, num_pages, page_size, ...)
    host_pool.py    HostPool: L2, page-first and pinned (num_pages, num_layers, page_size, ...)
    kernels.py      Triton copy kernels (backup, load_layer) and their torch references
    transfer.py     TransferEngine: copy stream, per-layer load events, backup events

This package module and `layout`, `allocator` and `errors` do not import torch (the
simulator and the daemon use them); the pools, kernels and transfers do.
"""

from tiers.allocator import PageAllocator
from tiers.errors import (
    KVTensorError,
    MemoryBudgetError,
    PageIdError,
    PoolExhaustedError,
    TiersError,
)
from tiers.layout import KVLayout

__all__ = [
    "KVLayout",
    "KVTensorError",
    "MemoryBudgetError",
    "PageAllocator",
    "PageIdError",
    "PoolExhaustedError",
    "TiersError",
]
