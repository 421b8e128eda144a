"""`RadixTree.check_invariants`: every invariant of the index, recomputed from scratch.

Slow (it walks everything and rehashes cached keys); meant for tests, which call it after
every mutation, and for debugging.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from radix.errors import InvariantError
from radix.keys import chain_keys
from radix.node import NO_TIER, Node, Tier

if TYPE_CHECKING:
    from radix.tree import RadixTree


def check_tree(tree: RadixTree) -> None:
    pages = [0, 0, 0, 0]
    locked = [0, 0, 0, 0]
    levels = [0, 0, 0, 0, 0]
    live = {tier: heap.live_entries() for tier, heap in tree._heaps.items()}
    seen_ids: dict[Tier, set[int]] = {Tier.L1: set(), Tier.L2: set()}
    num_nodes = 0
    for digest, root in tree._roots.items():
        _expect(root.namespace_digest == digest, f"root filed under the wrong digest: {root}")
        _expect(root.parent is None and root.num_pages == 0, f"malformed root {root}")
        for node in _walk(root):
            if node is not root:
                num_nodes += 1
                _check_node(tree, node, live, seen_ids)
                levels[node.level] += node.num_pages
                for tier in Tier:
                    if tree._holds(node, tier):
                        pages[tier] += node.num_pages
                        if node.lock_ref:
                            locked[tier] += node.num_pages
            _check_children(tree, node)
    _expect(num_nodes == tree.num_nodes, f"num_nodes is {tree.num_nodes}, counted {num_nodes}")
    _expect(
        levels == tree._level_pages,
        f"pages per level are {tree._level_pages}, counted {levels}",
    )
    for tier in Tier:
        _expect(
            pages[tier] == tree._pages[tier],
            f"{tier.name} page count is {tree._pages[tier]}, counted {pages[tier]}",
        )
        _expect(
            locked[tier] == tree._locked_pages[tier],
            f"{tier.name} locked page count is {tree._locked_pages[tier]}, counted {locked[tier]}",
        )


def _walk(root: Node):
    stack = [root]
    while stack:
        node = stack.pop()
        yield node
        stack.extend(node.children.values())


def _expect(condition: bool, message: str) -> None:
    if not condition:
        raise InvariantError(message)


def _check_children(tree: RadixTree, node: Node) -> None:
    page_bytes = tree._page_bytes
    levels = [0, 0, 0, 0, 0]
    locks = node.direct_locks
    for first_page, child in node.children.items():
        _expect(child.parent is node, f"{child} does not point back to its parent")
        _expect(first_page == child.data[:page_bytes], f"{child} filed under the wrong page")
        _expect(child.namespace_digest == node.namespace_digest, f"{child} crossed namespaces")
        levels[child.level] += 1
        locks += child.lock_ref
        if node.num_pages:
            _expect(
                child.level >= node.level,
                f"{child} (level {child.level}) sits below {node} (level {node.level})",
            )
    _expect(
        levels == node.children_at_level,
        f"{node}: child levels are {levels}, recorded {node.children_at_level}",
    )
    _expect(node.lock_ref == locks, f"{node}: lock_ref {node.lock_ref}, recomputed {locks}")
    _expect(node.direct_locks >= 0, f"{node}: negative direct lock count")
    _expect(node.pins >= 0, f"{node}: negative pin count")


def _check_node(tree: RadixTree, node: Node, live: dict, seen_ids: dict) -> None:
    _expect(node.num_pages > 0, f"{node} holds no pages")
    _expect(
        len(node.data) == node.num_pages * tree._page_bytes,
        f"{node}: {len(node.data)} bytes of tokens for {node.num_pages} pages",
    )
    _expect(node.level != NO_TIER, f"{node} is held by no tier but still indexed")
    for tier, ids in ((Tier.L1, node.device_page_ids), (Tier.L2, node.host_page_ids)):
        if ids is None:
            continue
        _expect(len(ids) == node.num_pages, f"{node}: {len(ids)} {tier.name} ids")
        clash = seen_ids[tier].intersection(ids)
        _expect(not clash, f"{tier.name} page ids {sorted(clash)[:5]} are held twice")
        seen_ids[tier].update(ids)
    for slot in tree._heaps:
        if tree._is_candidate(node, slot):
            _expect(
                node.in_heap[slot] and (id(node), node.heap_gen[slot]) in live[slot],
                f"{node} is an eviction candidate (heap {slot}) missing from its heap",
            )
    if node.keys is not None:
        previous = tree._last_key(node.parent)
        expected = chain_keys(previous, node.data, tree.page_size, node.num_pages)
        _expect(node.keys == expected, f"{node}: cached page keys are stale")
