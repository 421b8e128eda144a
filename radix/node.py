"""A node of the radix index: a run of full pages and where those pages live.

Residency is uniform within a node: all of its pages are in L1 or none are, likewise for L2
and L3. A caller that needs to change part of a run splits the node first
(`RadixTree.split`). The *level* of a node is the fastest tier that holds it; levels never
decrease from a parent to its child, so the pages in L1 form a subtree that contains the
root, and the pages in L1 or L2 form another. That is what lets a match report its run as
"L1 pages, then L2 pages, then L3 pages" with no gaps.
"""

from __future__ import annotations

from enum import IntEnum


class Tier(IntEnum):
    L1 = 1  # device memory (HBM)
    L2 = 2  # pinned host memory
    L3 = 3  # shared storage


NO_TIER = 4  # the level of a node that no tier holds (only ever transient)


class Node:
    """One compressed run of pages. Owned and mutated by `RadixTree` only.

    `data` is the run's tokens in the index encoding (`radix.keys.encode_tokens`).
    `device_page_ids` / `host_page_ids` are per-page ids in the L1 / L2 pools, or None when
    the run is not in that tier. `meta` belongs to the owner of the tree (hicache keeps a
    `hicache.ops.RunState` there, the transfer filling the run); the index never reads it, and
    a split gives both halves the same object, so the owner replaces it rather than edits it.

    A node that leaves the tree (no tier holds it) keeps its `parent` link, so a handle on it
    still leads to the part of its prefix the index holds (`RadixTree.held_end`).
    """

    __slots__ = (
        "parent",
        "children",
        "data",
        "num_pages",
        "device_page_ids",
        "host_page_ids",
        "in_l3",
        "lock_ref",
        "direct_locks",
        "pins",
        "last_access",
        "hit_count",
        "priority",
        "keys",
        "children_at_level",
        "in_heap",
        "heap_gen",
        "namespace_digest",
        "meta",
    )

    def __init__(self, parent: Node | None, data: bytes, num_pages: int) -> None:
        self.parent = parent
        self.children: dict[bytes, Node] = {}
        self.data = data
        self.num_pages = num_pages
        self.device_page_ids: list[int] | None = None
        self.host_page_ids: list[int] | None = None
        self.in_l3 = False
        self.lock_ref = 0  # locks held on this node or any node below it
        self.direct_locks = 0  # locks taken on this node itself
        self.pins = 0  # pins on this run alone (its ancestors stay evictable)
        self.last_access = 0
        self.hit_count = 0
        self.priority = 0
        self.keys: list[bytes] | None = None  # page keys, computed lazily
        self.children_at_level = [0, 0, 0, 0, 0]  # indexed by child level 1..4
        self.in_heap = [False, False, False, False]  # indexed by Tier
        self.heap_gen = [0, 0, 0, 0]
        self.namespace_digest: bytes = parent.namespace_digest if parent is not None else b""
        self.meta: object | None = None  # the tree owner's, opaque here (see above)

    @property
    def level(self) -> int:
        """The fastest tier holding this run (`NO_TIER` when none does)."""
        if self.device_page_ids is not None:
            return Tier.L1
        if self.host_page_ids is not None:
            return Tier.L2
        if self.in_l3:
            return Tier.L3
        return NO_TIER

    @property
    def is_namespace_root(self) -> bool:
        return self.num_pages == 0

    def __repr__(self) -> str:
        tiers = "".join(
            name
            for name, present in (
                ("1", self.device_page_ids is not None),
                ("2", self.host_page_ids is not None),
                ("3", self.in_l3),
            )
            if present
        )
        return (
            f"Node(pages={self.num_pages}, tiers={tiers or '-'}, locks={self.lock_ref}, "
            f"children={len(self.children)})"
        )
