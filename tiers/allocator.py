"""Page allocator: which page ids of one pool are free, and who owns each one in use.

Pure bookkeeping over ids 0..num_pages-1; it knows nothing about tensors or devices, so the
device pool and the host pool share it. `alloc` and `free` are O(1) per page. Errors leave
the allocator unchanged: an `alloc` that cannot be satisfied allocates nothing, a `free` with
one bad id frees nothing.

Ownership is data: every allocated page carries its owner, an opaque tag the caller chooses
(the controller uses "the index", "a request", or an op in flight). `free` and `give` name
the owner they expect and refuse a page someone else owns, so a page can never be freed or
handed on by a party that does not hold it.

Not thread-safe: the controller that owns a pool serializes calls to its allocator.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable

from tiers.errors import PageIdError, PoolExhaustedError

# Per-page state. FREED is kept apart from NEVER so that a double free and a free of an id
# that was never handed out get different messages.
_NEVER, _ALLOCATED, _FREED = 0, 1, 2


class PageAllocator:
    """Free-list allocator over page ids `0 .. num_pages - 1`.

    A fresh allocator hands out ids in ascending order; after frees, the most recently freed
    ids are reused first (they are the likeliest to be warm in caches and TLBs), each batch
    in ascending order (consecutive ids let a copy move a run of pages in one strided
    transfer: `tiers.copy_engine.page_runs`).
    """

    def __init__(self, num_pages: int, name: str = "pool") -> None:
        if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages < 1:
            raise ValueError(f"num_pages must be an int >= 1, got {num_pages!r}")
        self.name = name
        self._num_pages = num_pages
        self._free: list[int] = list(range(num_pages - 1, -1, -1))  # stack; top = lowest id
        self._state = bytearray(num_pages)  # _NEVER / _ALLOCATED / _FREED per page
        self._owner: list[object] = [None] * num_pages  # the owner of each allocated page

    @property
    def num_pages(self) -> int:
        return self._num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self._num_pages - len(self._free)

    def is_allocated(self, page_id: int) -> bool:
        return self._state[self._check_range(page_id)] == _ALLOCATED

    def owner_of(self, page_id: int) -> object:
        """The owner of an allocated page (None for a free one)."""
        return self._owner[self._check_range(page_id)]

    def alloc(self, num_pages: int, owner: object = "caller") -> list[int]:
        """Take `num_pages` free ids for `owner`; raises `PoolExhaustedError` (allocating
        none) if fewer are free. `alloc(0)` returns []."""
        if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages < 0:
            raise ValueError(f"{self.name}: alloc needs an int >= 0, got {num_pages!r}")
        if num_pages > len(self._free):
            raise PoolExhaustedError(self.name, num_pages, len(self._free), self._num_pages)
        if num_pages == 0:
            return []
        page_ids = self._free[-num_pages:]
        del self._free[-num_pages:]
        page_ids.sort()  # ascending: pages allocated together form runs a copy moves at once
        state = self._state
        owners = self._owner
        for page_id in page_ids:
            state[page_id] = _ALLOCATED
            owners[page_id] = owner
        return page_ids

    def free(self, page_ids: Iterable[int], owner: object = "caller") -> None:
        """Return `owner`'s allocated ids to the pool.

        Raises `PageIdError` (freeing none of them) when an id is out of range, was never
        allocated, is already free (double free), is owned by someone else, or appears
        twice in `page_ids`.
        """
        page_ids = self._check_owned(page_ids, owner, "free")
        for page_id in reversed(page_ids):
            self._state[page_id] = _FREED
            self._owner[page_id] = None
            self._free.append(page_id)

    def give(self, page_ids: Iterable[int], owner: object, new_owner: object) -> None:
        """Hand `owner`'s pages to `new_owner` (checked as `free` checks; all or none)."""
        for page_id in self._check_owned(page_ids, owner, "give"):
            self._owner[page_id] = new_owner

    def _check_owned(self, page_ids: Iterable[int], owner: object, action: str) -> list[int]:
        page_ids = [self._check_range(page_id) for page_id in page_ids]
        seen: set[int] = set()
        for page_id in page_ids:
            state = self._state[page_id]
            if state == _FREED:
                raise PageIdError(f"{self.name}: double {action} of page {page_id} (it is free)")
            if state == _NEVER:
                raise PageIdError(f"{self.name}: page {page_id} was never allocated")
            if self._owner[page_id] != owner:
                raise PageIdError(
                    f"{self.name}: {action} of page {page_id} by {owner}, "
                    f"but {self._owner[page_id]} owns it"
                )
            if page_id in seen:
                raise PageIdError(f"{self.name}: page {page_id} listed twice in one {action}")
            seen.add(page_id)
        return page_ids

    def owned_by(self, owner: object) -> list[int]:
        """Every page `owner` holds (a walk over the pool: for checks, not hot paths)."""
        return [page for page, held in enumerate(self._owner) if held == owner]

    def check_invariants(self) -> None:
        """Recompute every invariant from scratch; raises AssertionError naming the broken one."""
        free_ids = self._free
        if len(set(free_ids)) != len(free_ids):
            raise AssertionError(f"{self.name}: a page id is on the free list twice")
        for page_id in free_ids:
            if not 0 <= page_id < self._num_pages:
                raise AssertionError(f"{self.name}: free list holds out-of-range id {page_id}")
            if self._state[page_id] == _ALLOCATED:
                raise AssertionError(f"{self.name}: page {page_id} is free and allocated")
            if self._owner[page_id] is not None:
                raise AssertionError(f"{self.name}: free page {page_id} has an owner")
        num_allocated = sum(1 for s in self._state if s == _ALLOCATED)
        if num_allocated + len(free_ids) != self._num_pages:
            raise AssertionError(
                f"{self.name}: {num_allocated} allocated + {len(free_ids)} free "
                f"!= {self._num_pages} pages"
            )

    def _check_range(self, page_id: int) -> int:
        """The id as a plain int (numpy and torch integer scalars accepted), range-checked."""
        if isinstance(page_id, bool):
            raise PageIdError(f"{self.name}: page id must be an integer, got {page_id!r}")
        try:
            page_id = operator.index(page_id)
        except TypeError:
            raise PageIdError(f"{self.name}: page id must be an integer, got {page_id!r}") from None
        if not 0 <= page_id < self._num_pages:
            raise PageIdError(f"{self.name}: page id {page_id} out of range [0, {self._num_pages})")
        return page_id
