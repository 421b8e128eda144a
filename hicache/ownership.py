"""Who owns an L1 or L2 page.

Every allocated page id has exactly one owner, which its pool records
(`tiers.allocator.PageAllocator`): the index (a run maps it), a request (allocated by
`HiCache.alloc_device_pages`, not inserted or freed yet), or an op in flight (`op_owner`: a
prefetch's pages until they land), or a late transfer (`QUARANTINE`: pages an L3 read that
outlived its call may still write, until the executor says it is over). `free` and `give`
name the owner they expect, so a page can only leave the party that holds it.
`check_ownership` recomputes all of it page by page, for `HiCache.check_invariants`.
Torch-free.
"""

from __future__ import annotations

from hicache.errors import HiCacheError
from hicache.ops import TransferOp
from radix.node import Tier
from radix.tree import RadixTree
from tiers.errors import PoolExhaustedError

INDEX = "the index"  # the pages the index maps
REQUEST = "a request"  # allocated by alloc_device_pages, not inserted or freed yet
QUARANTINE = "a late transfer"  # L2 pages an L3 transfer that outlived its call still writes


def op_owner(op: TransferOp) -> str:
    """The owner of pages an op holds that the index does not map yet."""
    return f"{op.kind.value} op {op.op_id}"


class NoPool:
    """The L2 allocator of a cache configured without L2: it never has a page."""

    num_pages = num_free = num_used = 0

    def alloc(self, num_pages: int, owner: object = None) -> list[int]:
        raise PoolExhaustedError("L2", num_pages, 0, 0)

    def free(self, page_ids, owner: object = None) -> None:
        if list(page_ids):
            raise HiCacheError("freeing L2 pages in a cache without L2")

    def check_invariants(self) -> None:
        pass


def check_ownership(tree: RadixTree, device, host, ops: set[str]) -> None:
    """Every L1 and L2 page the index maps is owned by the index, and every page the index
    owns is mapped by exactly one run; a page an op owns belongs to an op in flight (`ops`:
    their `op_owner`s); everything else is a request's or free."""
    mapped: dict[Tier, list[int]] = {Tier.L1: [], Tier.L2: []}
    for node in tree.nodes():
        if node.device_page_ids is not None:
            mapped[Tier.L1].extend(node.device_page_ids)
        if node.host_page_ids is not None:
            mapped[Tier.L2].extend(node.host_page_ids)
    for tier, pool in ((Tier.L1, device), (Tier.L2, host)):
        _check_pool(tier, pool, mapped[tier], ops)


def _check_pool(tier: Tier, pool, mapped: list[int], ops: set[str]) -> None:
    if isinstance(pool, NoPool):
        if mapped:
            raise HiCacheError(f"the index maps {len(mapped)} {tier.name} pages, and no L2")
        return
    owned = set(pool.owned_by(INDEX))
    for page in mapped:
        if pool.owner_of(page) != INDEX:
            raise HiCacheError(
                f"{tier.name} page {page} is mapped by the index but owned by "
                f"{pool.owner_of(page) or 'nobody (free)'}"
            )
    unmapped = owned.difference(mapped)
    if unmapped:
        raise HiCacheError(
            f"{tier.name} pages {sorted(unmapped)[:5]} are owned by the index, which maps none"
        )
    for page in range(pool.num_pages):
        owner = pool.owner_of(page)
        if owner not in (None, INDEX, REQUEST, QUARANTINE) and owner not in ops:
            raise HiCacheError(f"{tier.name} page {page} is owned by {owner}, not in flight")
