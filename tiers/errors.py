"""The exceptions of `tiers`.

A full pool is expected in normal operation, but `alloc` cannot return a partial answer, so it
raises `PoolExhaustedError` carrying the numbers the caller needs to evict and retry. Bad input
(an id out of range, a double free, tensors that do not match the layout) raises an error that
is also a `ValueError`, and nothing is changed.
"""

from __future__ import annotations


class TiersError(Exception):
    """Base class of every error raised by `tiers`."""


class PoolExhaustedError(TiersError):
    """`alloc(n)` asked for more pages than are free; nothing was allocated."""

    def __init__(self, pool: str, requested: int, num_free: int, num_pages: int) -> None:
        self.pool = pool
        self.requested = requested
        self.num_free = num_free
        self.num_pages = num_pages
        super().__init__(
            f"{pool}: cannot allocate {requested} pages, {num_free} of {num_pages} are free"
        )


class PageIdError(TiersError, ValueError):
    """A page id that is out of range, not allocated, freed twice or listed twice."""


class KVTensorError(TiersError, ValueError):
    """KV tensors whose dtype, shape, strides or device do not fit the operation."""


class MemoryBudgetError(TiersError):
    """A pool does not fit the memory that is there (device memory or host RAM)."""
