"""Eviction: the policies, a lazy min-heap of candidates per tier, and the tree's side of it.

A policy maps a node to a sort key; the node with the smallest key is evicted first.
Keys only grow while a node sits in the heap (access times and hit counts increase), so the
heap is kept lazily: touching a node costs nothing, and a popped entry whose key has grown
is pushed back with the current key. An entry is valid only while its generation matches
the node's, so a node has at most one live entry per tier. Evicting k runs costs about
k log n; nothing walks the tree.

`EvictionMixin` is `RadixTree`'s eviction side (radix/tree.py mixes it in): the locks and
pins that keep runs in their tiers, the eviction order, which runs are candidates in which
heap, and taking victims.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable

from radix.errors import RadixError
from radix.node import Node, Tier


def lru_key(node: Node) -> tuple:
    return (node.last_access,)


def lfu_key(node: Node) -> tuple:
    return (node.hit_count, node.last_access)


def priority_key(node: Node) -> tuple:
    return (node.priority, node.last_access)


EVICTION_POLICIES: dict[str, Callable[[Node], tuple]] = {
    "lru": lru_key,
    "lfu": lfu_key,
    "priority": priority_key,
}


def eviction_key_function(name: str) -> Callable[[Node], tuple]:
    try:
        return EVICTION_POLICIES[name]
    except KeyError:
        raise ValueError(
            f"eviction policy must be one of {sorted(EVICTION_POLICIES)}, got {name!r}"
        ) from None


class CandidateHeap:
    """Eviction candidates of one tier, smallest policy key first.

    `is_candidate(node, tier)` is the tree's rule; the heap re-checks it on every pop, so an
    entry for a node that stopped being a candidate is simply dropped. The tree pushes a node
    again (`push`) whenever it may have become a candidate.
    """

    def __init__(
        self,
        tier: Tier,
        key: Callable[[Node], tuple],
        is_candidate: Callable[[Node, Tier], bool],
    ) -> None:
        self.tier = tier
        self._key = key
        self._is_candidate = is_candidate
        self._heap: list[tuple[tuple, int, int, Node]] = []
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, node: Node, *, force: bool = False) -> None:
        """Add `node` unless it already has a live entry (`force`: replace that entry)."""
        tier = self.tier
        if node.in_heap[tier] and not force:
            return
        node.heap_gen[tier] += 1
        node.in_heap[tier] = True
        heapq.heappush(self._heap, (self._key(node), next(self._seq), node.heap_gen[tier], node))

    def pop(self) -> Node | None:
        """Remove and return the best candidate, or None when there is none."""
        tier = self.tier
        heap = self._heap
        while heap:
            key, _, gen, node = heapq.heappop(heap)
            if gen != node.heap_gen[tier]:
                continue  # superseded by a newer entry for the same node
            node.in_heap[tier] = False
            if not self._is_candidate(node, tier):
                continue
            current = self._key(node)
            if current != key:
                self.push(node)
                continue
            return node
        return None

    def live_entries(self) -> set[tuple[int, int]]:
        """(id(node), generation) of every entry that is still current; for invariant checks."""
        tier = self.tier
        return {(id(node), gen) for _, _, gen, node in self._heap if gen == node.heap_gen[tier]}


# The heap slot (Node.in_heap / heap_gen, indexed by Tier, leave 0 free) of L2's spare
# copies: L2 copies of runs that L1 and L3 hold too. `take_victim(L2)` takes them only once
# L2 has no run of its own left to give, so that an L2 no larger than L1 under
# write-through (every L1 run copied to L2) still has room for backups and L3 fetches.
SPARE_L2 = 0


class EvictionMixin:
    """`RadixTree`'s locks, pins, eviction order and victims. A mixin: it works on the tree's
    heaps (`_heaps`: a `CandidateHeap` per Tier and one for `SPARE_L2`), clock and locked
    page counts, and calls its structure and residency sides (`_split`, `clear_*`)."""

    _heaps: dict[int, CandidateHeap]
    _roots: dict[bytes, Node]
    _clock: int
    _locked_pages: list[int]

    # ------------------------------------------------------------------ locks

    def lock(self, node: Node) -> None:
        """Pin `node` and its ancestors: none of their pages leaves any tier until unlocked."""
        node.direct_locks += 1
        walk = node
        while walk is not None:
            if walk.lock_ref == 0:
                self._count_locked(walk, +1)
            walk.lock_ref += 1
            walk = walk.parent

    def unlock(self, node: Node) -> None:
        if node.direct_locks <= 0:
            raise RadixError(f"unlock of {node}, which holds no lock of its own")
        node.direct_locks -= 1
        walk = node
        while walk is not None:
            walk.lock_ref -= 1
            if walk.lock_ref == 0:
                self._count_locked(walk, -1)
                self._refresh(walk)
            walk = walk.parent

    def pin(self, node: Node) -> None:
        """Keep this run (only) in every tier it is in: for a copy out of it in flight.

        Unlike `lock`, ancestors stay evictable as far as the tier rules allow. A split of
        a pinned run pins both halves; unpin each piece.
        """
        node.pins += 1

    def unpin(self, node: Node) -> None:
        if node.pins <= 0:
            raise RadixError(f"unpin of {node}, which is not pinned")
        node.pins -= 1
        if not node.pins:
            self._refresh(node)

    def _count_locked(self, node: Node, sign: int) -> None:
        pages = sign * node.num_pages
        if node.device_page_ids is not None:
            self._locked_pages[Tier.L1] += pages
        if node.host_page_ids is not None:
            self._locked_pages[Tier.L2] += pages
        if node.in_l3:
            self._locked_pages[Tier.L3] += pages

    def touch(self, node: Node) -> None:
        """Count the run as just used (eviction order), without counting a hit."""
        self._clock += 1
        node.last_access = self._clock

    def raise_priority(self, node: Node, priority: int) -> None:
        """Give `node` and its ancestors at least `priority` (a request's priority: a run
        shared by several requests keeps the highest). Keys only grow: no heap work."""
        walk = node
        while walk is not None and walk.num_pages:
            if walk.priority < priority:
                walk.priority = priority
            walk = walk.parent

    def set_priority(self, node: Node, priority: int) -> None:
        """Eviction priority for the `priority` policy: lower is evicted first."""
        lowered = priority < node.priority
        node.priority = priority
        if lowered:
            for slot, heap in self._heaps.items():
                if node.in_heap[slot]:
                    heap.push(node, force=True)

    # ------------------------------------------------------------------ eviction

    def take_victim(self, tier: Tier, max_pages: int) -> Node | None:
        """The next run to evict from `tier`, cut to at most `max_pages` pages, or None.

        Victims are the runs of `tier` with no child in that tier, in policy order; in L2,
        once none is left, L2's spare copies (`SPARE_L2`). One may be the only copy of a
        prefix that runs below depend on (`can_clear` is False): the caller writes it to a
        slower tier first, or hands it back with `requeue`.
        """
        if max_pages <= 0:
            return None
        node = self._heaps[tier].pop()
        if node is None and tier == Tier.L2:
            node = self._heaps[SPARE_L2].pop()
        if node is not None and node.num_pages > max_pages:
            self._split(node, node.num_pages - max_pages)
        return node

    def requeue(self, node: Node) -> None:
        """Hand back a victim from `take_victim` that was not evicted."""
        self._refresh(node)

    def evict(self, tier: Tier, num_pages: int) -> list[int]:
        """Free up to `num_pages` pages of L1 or L2; returns their ids in eviction order
        (deepest page of each run first).

        Never touches locked runs. A run that no tier holds afterwards leaves the index.
        Evicting 0 pages is always safe.
        """
        if tier == Tier.L3:
            raise RadixError("L3 holds no page ids; use forget_l3 to drop L3 runs from the index")
        clear = self.clear_device if tier == Tier.L1 else self.clear_host
        freed: list[int] = []
        kept: list[Node] = []
        while len(freed) < num_pages:
            node = self.take_victim(tier, num_pages - len(freed))
            if node is None:
                break
            if not self.can_clear(node, tier):
                kept.append(node)  # its only copy holds up runs below: needs a write-back
                continue
            freed.extend(reversed(clear(node)))  # deepest page first
        for node in kept:
            self.requeue(node)
        return freed

    def forget_l3(self, num_pages: int) -> int:
        """Drop up to `num_pages` L3-only pages from the index (L3 itself is untouched)."""
        forgotten = 0
        while forgotten < num_pages:
            node = self.take_victim(Tier.L3, num_pages - forgotten)
            if node is None:
                break
            forgotten += node.num_pages
            self.clear_l3(node)
        return forgotten

    def forget_all_l3(self) -> int:
        """Drop every L3 mark (the L3 backend was detached); returns the pages forgotten.

        Runs held only by L3 leave the index; they must not be locked (checked before
        anything changes). A locked run that another tier holds just loses its mark: the
        lock keeps its pages where they are used, and L3 is gone.
        """
        for node in self.nodes():
            if node.level == Tier.L3 and (node.lock_ref or node.pins):
                raise RadixError(f"{node} is held only by L3 and is locked: can't forget L3")
        forgotten = 0
        for root in self._roots.values():
            stack = [(root, False)]
            while stack:  # post-order: children before their parent
                node, expanded = stack.pop()
                if not expanded:
                    stack.append((node, True))
                    stack.extend((child, False) for child in node.children.values())
                elif node.in_l3:
                    forgotten += node.num_pages
                    self._drop_copy(node, Tier.L3, check_locks=node.level == Tier.L3)
        return forgotten

    def _is_candidate(self, node: Node, tier: Tier) -> bool:
        if node.lock_ref or node.pins or not node.num_pages or node.parent is None:
            return False
        below = node.children_at_level
        if tier == Tier.L1:
            return node.device_page_ids is not None and not below[Tier.L1]
        if tier == Tier.L2:
            return node.level == Tier.L2 and not below[Tier.L2]
        if tier == SPARE_L2:  # an L2 copy of a run L1 and L3 hold too, none in L2 below
            held = node.device_page_ids is not None and node.host_page_ids is not None
            if not held or not node.in_l3 or below[Tier.L2]:
                return False
            return not below[Tier.L1] or all(  # (only a child in L1 may hold a copy too)
                child.host_page_ids is None for child in node.children.values()
            )
        return node.level == Tier.L3 and not node.children

    def _refresh(self, node: Node) -> None:
        for tier, heap in self._heaps.items():
            if not node.in_heap[tier] and self._is_candidate(node, tier):
                heap.push(node)
