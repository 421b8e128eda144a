"""The radix index: which KV pages exist, per namespace, and which tiers hold them.

`RadixTree` maps token prefixes to runs of full pages. It knows page ids (L1 device ids,
L2 host ids) and whether L3 holds a run, and it chooses what to evict; it never touches
memory, storage or torch. The controller (`hicache`) owns one tree and drives it.

Walking a request costs one dict lookup per node and one bytes comparison per run, not a
Python step per page or per token. Page keys are computed only when asked for (L3 lookups
and writes) and then kept on the node.

Contracts:
- Only full pages are indexed; a trailing partial page is ignored.
- Node objects returned by the tree stay valid while locked: `lock(node)` pins the node and
  every ancestor in every tier, and a split never replaces the deeper half of a run, so a
  locked node keeps its identity and its pages.
- A node is a handle on its prefix: a split keeps it as the deeper half, and a node that
  leaves the tree keeps its parent link, so walking up from it (`held_end`, `path`) finds
  the part of the prefix the index holds now, without a lookup from the root.
- Eviction takes a tier's leaf-most runs in policy order (`take_victim`); in L2, once none
  of its own is left, its spare copies: those of runs L1 and L3 hold too (`SPARE_L2`).
- The tree is not thread-safe; its owner serialises calls.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from radix.errors import RadixError
from radix.eviction import SPARE_L2, CandidateHeap, EvictionMixin, eviction_key_function
from radix.keys import TOKEN_BYTES, Namespace, chain_keys, encode_tokens
from radix.node import NO_TIER, Node, Tier
from radix.residency import ResidencyListener, ResidencyMixin

Tokens = Sequence[int] | np.ndarray | bytes


class MatchResult(NamedTuple):
    """The cached prefix of a request, split by the fastest tier holding each run.

    The runs come in order: `l1_nodes` (pages usable now), then `l2_nodes` (only in host
    memory), then `l3_nodes` (known to be in L3 only). Page ids are safe to use only while
    `last_node` is locked.
    """

    matched_pages: int
    matched_tokens: int
    device_page_ids: list[int]
    l1_nodes: list[Node]
    l2_nodes: list[Node]
    l3_nodes: list[Node]
    last_node: Node
    remainder_keys: list[bytes] | None  # keys of the unmatched full pages, when asked for

    @property
    def num_l1_pages(self) -> int:
        return len(self.device_page_ids)

    @property
    def num_l2_pages(self) -> int:
        return sum(node.num_pages for node in self.l2_nodes)

    @property
    def num_l3_pages(self) -> int:
        return sum(node.num_pages for node in self.l3_nodes)

    @property
    def host_page_ids(self) -> list[int]:
        return [page for node in self.l2_nodes for page in node.host_page_ids]


class InsertResult(NamedTuple):
    """What `insert` did. The caller frees `duplicate_device_page_ids`: its own pages for
    runs that L1 already held under other ids."""

    num_present_pages: int  # leading pages the tree already indexed (in any tier)
    num_new_pages: int
    duplicate_device_page_ids: list[int]
    last_node: Node


class RadixTree(ResidencyMixin, EvictionMixin):
    """A compressed radix tree over full pages, with per-tier residency (`ResidencyMixin`,
    radix/residency.py) and eviction (`EvictionMixin`, radix/eviction.py)."""

    def __init__(self, page_size: int = 64, eviction_policy: str = "lru") -> None:
        if not isinstance(page_size, int) or page_size <= 0:
            raise ValueError(f"page_size must be a positive int, got {page_size!r}")
        self.page_size = page_size
        self.eviction_policy = eviction_policy
        self._page_bytes = page_size * TOKEN_BYTES
        self._roots: dict[bytes, Node] = {}
        self._namespaces: dict[bytes, Namespace] = {}  # digest -> namespace, for listeners
        self._clock = 0
        self._num_nodes = 0
        self._pages = [0, 0, 0, 0]  # pages held per Tier
        self._locked_pages = [0, 0, 0, 0]  # of those, pages in locked nodes
        self._level_pages = [0, 0, 0, 0, 0]  # pages per level (the fastest tier holding them)
        key = eviction_key_function(eviction_policy)
        self._heaps = {
            slot: CandidateHeap(slot, key, self._is_candidate) for slot in (*Tier, SPARE_L2)
        }
        self.listener: ResidencyListener | None = None  # told of every residency change

    # ------------------------------------------------------------------ queries

    def num_pages(self, tier: Tier) -> int:
        """Pages of `tier` the index holds."""
        return self._pages[tier]

    def num_pages_at_level(self, level: Tier) -> int:
        """Pages whose fastest tier is `level` (for L3: the pages only L3 holds)."""
        return self._level_pages[level]

    def nodes(self):
        """Every run in the index, every namespace (a walk: for checks, not hot paths)."""
        for root in self._roots.values():
            stack = list(root.children.values())
            while stack:
                node = stack.pop()
                yield node
                stack.extend(node.children.values())

    @staticmethod
    def held_end(node: Node) -> Node:
        """`node` while it is in the tree, else its deepest ancestor still in it (a node that
        leaves the tree keeps its parent link; splits since change nothing)."""
        while node.num_pages and node.level == NO_TIER:
            node = node.parent
        return node

    @staticmethod
    def trailing(node: Node, level: Tier) -> list[Node]:
        """The runs at `level` that end the path to `node`, first to last."""
        runs = []
        while node.num_pages and node.level == level:
            runs.append(node)
            node = node.parent
        runs.reverse()
        return runs

    @staticmethod
    def path(node: Node) -> list[Node]:
        """The runs from the top of `node`'s namespace down to `node` (no root)."""
        runs = []
        while node is not None and node.num_pages:
            runs.append(node)
            node = node.parent
        runs.reverse()
        return runs

    def num_evictable_pages(self, tier: Tier) -> int:
        """Pages of `tier` in unlocked nodes (an upper bound on what `evict` can free)."""
        return self._pages[tier] - self._locked_pages[tier]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    def root(self, namespace: Namespace) -> Node:
        """The empty run at the top of a namespace (created on first use)."""
        if not isinstance(namespace, Namespace):
            raise TypeError(f"namespace must be a radix.keys.Namespace, got {namespace!r}")
        digest = namespace.digest
        root = self._roots.get(digest)
        if root is None:
            root = Node(None, b"", 0)
            root.namespace_digest = digest
            self._roots[digest] = root
            self._namespaces[digest] = namespace
        return root

    def match_prefix(
        self,
        tokens: Tokens,
        namespace: Namespace,
        *,
        remainder_keys: bool = False,
        touch: bool = True,
    ) -> MatchResult:
        """The longest indexed prefix of `tokens`, in whole pages.

        A match that ends inside a run splits it, so `last_node` covers exactly the match.
        Matched runs count as accessed (eviction order) and hit (LFU, selective writes),
        unless `touch` is False (a second look at the same request).
        With `remainder_keys`, the keys of the unmatched full pages are computed too.
        """
        data = encode_tokens(tokens)
        page_bytes = self._page_bytes
        limit = len(data) - len(data) % page_bytes
        node = self.root(namespace)
        path: list[Node] = []
        offset = 0
        while offset < limit:
            child = node.children.get(data[offset : offset + page_bytes])
            if child is None:
                break
            end = offset + len(child.data)
            if end <= limit and data.startswith(child.data, offset):
                path.append(child)
                node, offset = child, end
                continue
            common = self._common_pages(child.data, data, offset, limit)
            node = self._split(child, common)
            path.append(node)
            offset += common * page_bytes
            break
        if touch:
            self._clock += 1
            for matched in path:
                matched.last_access = self._clock
                matched.hit_count += 1
        keys = None
        if remainder_keys:
            previous = self._last_key(node)
            keys = chain_keys(
                previous, data[offset:limit], self.page_size, (limit - offset) // page_bytes
            )
        return self._match_result(path, node, offset // page_bytes, keys)

    def _match_result(
        self, path: list[Node], last: Node, matched_pages: int, keys: list[bytes] | None
    ) -> MatchResult:
        device_ids: list[int] = []
        runs: tuple[list[Node], list[Node], list[Node]] = ([], [], [])
        for node in path:
            level = node.level
            runs[level - 1].append(node)
            if level == Tier.L1:
                device_ids.extend(node.device_page_ids)
        return MatchResult(
            matched_pages=matched_pages,
            matched_tokens=matched_pages * self.page_size,
            device_page_ids=device_ids,
            l1_nodes=runs[0],
            l2_nodes=runs[1],
            l3_nodes=runs[2],
            last_node=last,
            remainder_keys=keys,
        )

    def keys_after(self, node: Node, tokens: Tokens) -> list[bytes]:
        """The keys of the full pages of `tokens` past `node`, a node on their path (a match's
        `last_node`): read on from `node`, not looked up from the root."""
        data = encode_tokens(tokens)
        offset = self._offset_of(node, data)
        limit = len(data) - len(data) % self._page_bytes
        return chain_keys(
            self._last_key(node),
            data[offset:limit],
            self.page_size,
            (limit - offset) // self._page_bytes,
        )

    def _offset_of(self, node: Node, data: bytes) -> int:
        """Where `node`'s run ends in `data` (bytes), checking that the run is that part of
        `data`: a node is only ever read on from along its own prefix."""
        offset = 0
        walk = node
        while walk.num_pages:
            offset += len(walk.data)
            walk = walk.parent
        if offset > len(data) or not data.startswith(node.data, offset - len(node.data)):
            raise RadixError(f"{node} does not end a prefix of these tokens")
        return offset

    def keys(self, node: Node) -> list[bytes]:
        """The page keys of a run (computed once, then kept on the node)."""
        pending = []
        walk = node
        while walk.num_pages and walk.keys is None:
            pending.append(walk)
            walk = walk.parent
        for todo in reversed(pending):
            todo.keys = chain_keys(
                self._last_key(todo.parent), todo.data, self.page_size, todo.num_pages
            )
        return node.keys if node.num_pages else []

    def _last_key(self, node: Node) -> bytes:
        if node.num_pages == 0:
            return node.namespace_digest
        return self.keys(node)[-1]

    def _common_pages(self, run: bytes, data: bytes, offset: int, limit: int) -> int:
        """Leading whole pages of `run` equal to `data[offset:limit]`."""
        count = min(len(run), limit - offset) // TOKEN_BYTES
        ours = np.frombuffer(run, dtype=np.uint32, count=count)
        theirs = np.frombuffer(data, dtype=np.uint32, count=count, offset=offset)
        differ = np.flatnonzero(ours != theirs)
        equal_tokens = int(differ[0]) if differ.size else count
        return equal_tokens // self.page_size

    # ------------------------------------------------------------------ insert

    def insert(
        self, tokens: Tokens, device_page_ids: Sequence[int], namespace: Namespace
    ) -> InsertResult:
        """Index a request's full pages, held in L1 under `device_page_ids` (one per page).

        Runs already indexed but not in L1 adopt the caller's pages; runs already in L1
        keep theirs, and the caller's ids for them come back as duplicates to free.
        """
        data = encode_tokens(tokens)
        num_pages = len(data) // self._page_bytes
        if len(device_page_ids) < num_pages:
            raise RadixError(
                f"insert needs one device page id per full page: {num_pages} pages, "
                f"{len(device_page_ids)} ids"
            )
        return self._insert(data, num_pages, namespace, Tier.L1, list(device_page_ids))

    def insert_l3(
        self, tokens: Tokens, namespace: Namespace, *, num_pages: int | None = None
    ) -> InsertResult:
        """Index the first `num_pages` full pages of `tokens` (default: all) as held by L3.

        For pages an L3 lookup found beyond the matched prefix; runs already indexed are
        left as they are.
        """
        data = encode_tokens(tokens)
        available = len(data) // self._page_bytes
        if num_pages is None:
            num_pages = available
        if not 0 <= num_pages <= available:
            raise RadixError(f"num_pages must be in [0, {available}], got {num_pages}")
        return self._insert(data, num_pages, namespace, Tier.L3, None)

    def extend_l3(self, node: Node, tokens: Tokens, num_pages: int) -> InsertResult:
        """`insert_l3` of the first `num_pages` full pages of `tokens`, read on from `node`, a
        node on their path (a match's `last_node`) instead of from the root. The runs above
        `node` count as accessed, as an insert from the root counts them."""
        data = encode_tokens(tokens)
        available = len(data) // self._page_bytes
        if not 0 <= num_pages <= available:
            raise RadixError(f"num_pages must be in [0, {available}], got {num_pages}")
        offset = self._offset_of(node, data)
        if offset > num_pages * self._page_bytes:
            raise RadixError(f"{node} ends past the first {num_pages} pages of these tokens")
        self._clock += 1
        walk = node
        while walk.num_pages:
            walk.last_access = self._clock
            walk = walk.parent
        return self._insert_below(node, offset, data, num_pages, Tier.L3, None)

    def _insert(
        self,
        data: bytes,
        num_pages: int,
        namespace: Namespace,
        tier: Tier,
        ids: list[int] | None,
    ) -> InsertResult:
        self._clock += 1
        return self._insert_below(self.root(namespace), 0, data, num_pages, tier, ids)

    def _insert_below(
        self,
        node: Node,
        offset: int,
        data: bytes,
        num_pages: int,
        tier: Tier,
        ids: list[int] | None,
    ) -> InsertResult:
        """Index `data`'s first `num_pages` pages from `node`, which ends at byte `offset`."""
        page_bytes = self._page_bytes
        limit = num_pages * page_bytes
        duplicates: list[int] = []
        while offset < limit:
            child = node.children.get(data[offset : offset + page_bytes])
            if child is None:
                break
            end = offset + len(child.data)
            if end > limit or not data.startswith(child.data, offset):
                child = self._split(child, self._common_pages(child.data, data, offset, limit))
                end = offset + len(child.data)
            if tier == Tier.L1:
                first = offset // page_bytes
                self._adopt_device(child, ids[first : first + child.num_pages], duplicates)
            child.last_access = self._clock
            node, offset = child, end
        present = offset // page_bytes
        if offset < limit:
            node = self._new_node(
                node, data[offset:limit], tier, ids[present:num_pages] if ids else None
            )
            node.last_access = self._clock
        return InsertResult(present, num_pages - present, duplicates, node)

    def _adopt_device(self, node: Node, ids: list[int], duplicates: list[int]) -> None:
        if node.device_page_ids is None:
            self.set_device(node, ids)
        elif ids != node.device_page_ids:
            duplicates.extend(
                mine for mine, held in zip(ids, node.device_page_ids, strict=True) if mine != held
            )

    def _new_node(self, parent: Node, data: bytes, tier: Tier, ids: list[int] | None) -> Node:
        node = Node(parent, data, len(data) // self._page_bytes)
        self._assign(node, tier, True if tier == Tier.L3 else ids)
        parent.children[data[: self._page_bytes]] = node
        parent.children_at_level[tier] += 1
        self._pages[tier] += node.num_pages
        self._level_pages[tier] += node.num_pages
        self._num_nodes += 1
        self._refresh(node)
        self._refresh(parent)
        if self.listener is not None:
            self._tell_listener(node, tier, False, True)
        return node

    # ------------------------------------------------------------------ structure

    def split(self, node: Node, num_pages: int) -> Node:
        """Cut a run after its first `num_pages` pages; returns the new first half.

        `node` keeps its identity (and its locks) as the second half.
        """
        if not 0 < num_pages < node.num_pages:
            raise RadixError(f"split point must be in (0, {node.num_pages}), got {num_pages}")
        return self._split(node, num_pages)

    def _split(self, node: Node, num_pages: int) -> Node:
        cut = num_pages * self._page_bytes
        parent = node.parent
        head = Node(parent, node.data[:cut], num_pages)
        head.last_access = node.last_access
        head.hit_count = node.hit_count
        head.priority = node.priority
        head.lock_ref = node.lock_ref
        head.pins = node.pins
        head.meta = node.meta
        head.in_l3 = node.in_l3
        if node.device_page_ids is not None:
            head.device_page_ids = node.device_page_ids[:num_pages]
            node.device_page_ids = node.device_page_ids[num_pages:]
        if node.host_page_ids is not None:
            head.host_page_ids = node.host_page_ids[:num_pages]
            node.host_page_ids = node.host_page_ids[num_pages:]
        if node.keys is not None:
            head.keys = node.keys[:num_pages]
            node.keys = node.keys[num_pages:]
        node.data = node.data[cut:]
        node.num_pages -= num_pages
        node.parent = head
        head.children[node.data[: self._page_bytes]] = node
        head.children_at_level[node.level] = 1
        parent.children[head.data[: self._page_bytes]] = head
        self._num_nodes += 1
        self._refresh(head)  # (L2's spare copy of the first half, if it is one)
        return head

    def _detach(self, node: Node) -> None:
        parent = node.parent
        del parent.children[node.data[: self._page_bytes]]
        parent.children_at_level[NO_TIER] -= 1
        self._level_pages[NO_TIER] -= node.num_pages
        self._num_nodes -= 1  # `node.parent` stays: a handle on it still leads up (`held_end`)

    # ------------------------------------------------------------------ checks

    def check_invariants(self) -> None:
        """Recompute every invariant from scratch; raise InvariantError naming the first broken."""
        from radix.invariants import check_tree

        check_tree(self)
