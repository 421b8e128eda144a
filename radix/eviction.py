"""Eviction order: the policies, and a lazy min-heap of candidates per tier.

A policy maps a node to a sort key; the node with the smallest key is evicted first.
Keys only grow while a node sits in the heap (access times and hit counts increase), so the
heap is kept lazily: touching a node costs nothing, and a popped entry whose key has grown
is pushed back with the current key. An entry is valid only while its generation matches
the node's, so a node has at most one live entry per tier. Evicting k runs costs about
k log n; nothing walks the tree.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable

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
