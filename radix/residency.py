"""Residency: which tiers hold a run, and the page counts per tier and per level that follow.

`ResidencyMixin` is `RadixTree`'s residency side (radix/tree.py mixes it in): recording and
forgetting a run's copy in L1, L2 or L3 under the tier rules, and telling the tree's
`ResidencyListener` of each change as it happens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from radix.errors import RadixError
from radix.keys import Namespace
from radix.node import NO_TIER, Node, Tier


class ResidencyListener(Protocol):
    """Told of every change of a run's residency in one tier, as it happens (under the
    tree owner's serialisation). `keys` are the run's page keys; `parent_key` is the key of
    the page before the run (None at the top of a namespace); `data` the run's tokens in
    the index encoding; `namespace` the run's. A run that is split keeps its pages where
    they are: no call."""

    def pages_stored(
        self,
        tier: Tier,
        keys: list[bytes],
        parent_key: bytes | None,
        data: bytes,
        namespace: Namespace,
    ) -> None: ...

    def pages_removed(self, tier: Tier, keys: list[bytes], namespace: Namespace) -> None: ...


class ResidencyMixin:
    """`RadixTree`'s record of where each run lives. A mixin: it works on the tree's counts
    (`_pages`, `_locked_pages`, `_level_pages`) and calls the tree's `keys`, `_detach`
    (structure) and `_refresh` (eviction)."""

    _page_bytes: int
    _namespaces: dict[bytes, Namespace]
    _pages: list[int]
    _locked_pages: list[int]
    _level_pages: list[int]
    listener: ResidencyListener | None

    # ------------------------------------------------------------------ residency

    def set_device(self, node: Node, device_page_ids: Sequence[int]) -> None:
        """Record that L1 holds the run under these device page ids."""
        self._add_copy(node, Tier.L1, list(device_page_ids))

    def clear_device(self, node: Node) -> list[int]:
        """Forget the run's L1 copy; returns its device page ids (the caller frees them)."""
        return self._drop_copy(node, Tier.L1)

    def set_host(self, node: Node, host_page_ids: Sequence[int]) -> None:
        """Record that L2 holds the run under these host page ids."""
        self._add_copy(node, Tier.L2, list(host_page_ids))

    def clear_host(self, node: Node) -> list[int]:
        """Forget the run's L2 copy; returns its host page ids (the caller frees them)."""
        return self._drop_copy(node, Tier.L2)

    def set_l3(self, node: Node) -> None:
        """Record that L3 holds the run (setting it twice is harmless)."""
        if not node.in_l3:
            self._add_copy(node, Tier.L3, True)

    def clear_l3(self, node: Node) -> None:
        """Forget that L3 holds the run (L3 evicted it, or returned a corrupt page)."""
        if node.in_l3:
            self._drop_copy(node, Tier.L3)

    def _add_copy(self, node: Node, tier: Tier, value: list[int] | bool) -> None:
        self._check_live(node)
        if value is not True:
            self._check_ids(node, value, tier)
        if self._holds(node, tier):
            raise RadixError(f"{node} is already in {tier.name}")
        parent = node.parent
        if parent.num_pages and parent.level > min(node.level, tier):
            raise RadixError(
                f"{node}: its parent run is not in {tier.name} or a faster tier "
                "(each tier must hold whole prefixes)"
            )
        self._set_residency(node, tier, value)

    def invalidate(self, node: Node, tier: Tier) -> list[int] | bool:
        """Forget a copy that holds wrong bytes (a copy into it failed), even while the run
        is locked or pinned: locks keep pages in the tiers they are used from, and nobody
        may use these. The tier rules still hold (a run below can't be left in a faster
        tier). Returns the copy's page ids, as `clear_device` / `clear_host` do."""
        return self._drop_copy(node, tier, check_locks=False)

    def _drop_copy(self, node: Node, tier: Tier, check_locks: bool = True) -> list[int] | bool:
        if not self._holds(node, tier):
            raise RadixError(f"{node} is not in {tier.name}")
        problem = self._lowering_problem(node, tier, check_locks)
        if problem is not None:
            raise RadixError(problem)
        held = node.device_page_ids if tier == Tier.L1 else node.host_page_ids
        self._set_residency(node, tier, False if tier == Tier.L3 else None)
        return held

    def _check_live(self, node: Node) -> None:
        if not node.num_pages:
            raise RadixError("a namespace root holds no pages")
        parent = node.parent
        if parent is None or parent.children.get(node.data[: self._page_bytes]) is not node:
            raise RadixError(f"{node} is no longer in the tree")

    @staticmethod
    def _check_ids(node: Node, ids: list[int], tier: Tier) -> None:
        if len(ids) != node.num_pages:
            raise RadixError(f"{len(ids)} {tier.name} page ids for a run of {node.num_pages} pages")

    def can_clear(self, node: Node, tier: Tier) -> bool:
        """Whether `tier` can leave the run now (see `_lowering_problem`)."""
        return self._lowering_problem(node, tier) is None

    def _lowering_problem(self, node: Node, tier: Tier, check_locks: bool = True) -> str | None:
        """Why `tier` cannot leave the run: it is held, or a child would end up in a
        faster tier than the run (or below a run no tier holds)."""
        if check_locks and (node.lock_ref or node.pins):
            return f"{node} is locked; its pages can't leave tier {tier.name}"
        holds = [
            node.device_page_ids is not None and tier != Tier.L1,
            node.host_page_ids is not None and tier != Tier.L2,
            node.in_l3 and tier != Tier.L3,
        ]
        new_level = holds.index(True) + 1 if True in holds else NO_TIER
        faster_children = sum(node.children_at_level[1:new_level])
        if faster_children:
            return (
                f"{node}: {faster_children} child runs are in faster tiers than it would be"
                f" without tier {tier.name}; evict those first"
            )
        return None

    def _set_residency(self, node: Node, tier: Tier, value: list[int] | bool | None) -> None:
        old_level = node.level
        was_held = self._holds(node, tier)
        if self.listener is not None:
            self._tell_listener(node, tier, was_held, value is not None and value is not False)
        self._assign(node, tier, value)
        delta = node.num_pages * (int(self._holds(node, tier)) - int(was_held))
        self._pages[tier] += delta
        if node.lock_ref:
            self._locked_pages[tier] += delta
        new_level = node.level
        parent = node.parent
        if new_level != old_level:
            parent.children_at_level[old_level] -= 1
            parent.children_at_level[new_level] += 1
            self._level_pages[old_level] -= node.num_pages
            self._level_pages[new_level] += node.num_pages
        if new_level == NO_TIER:
            self._detach(node)
        else:
            self._refresh(node)
        self._refresh(parent)

    def _tell_listener(self, node: Node, tier: Tier, was_held: bool, will_hold: bool) -> None:
        """Before the change (a run that leaves every tier is detached right after)."""
        if was_held == will_hold:
            return
        keys = self.keys(node)
        namespace = self._namespaces[node.namespace_digest]
        if will_hold:
            parent = node.parent
            parent_key = self._last_key(parent) if parent.num_pages else None
            self.listener.pages_stored(tier, list(keys), parent_key, node.data, namespace)
        else:
            self.listener.pages_removed(tier, list(keys), namespace)

    @staticmethod
    def _assign(node: Node, tier: Tier, value: list[int] | bool | None) -> None:
        if tier == Tier.L1:
            node.device_page_ids = value
        elif tier == Tier.L2:
            node.host_page_ids = value
        else:
            node.in_l3 = value

    @staticmethod
    def _holds(node: Node, tier: Tier) -> bool:
        if tier == Tier.L1:
            return node.device_page_ids is not None
        if tier == Tier.L2:
            return node.host_page_ids is not None
        return node.in_l3
