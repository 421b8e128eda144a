"""Random sequences of index operations against a naive reference model.

The reference keeps one record per page, keyed by the page's whole token prefix, and
knows nothing about runs, splits or heaps. After every step the tree's invariants are
recomputed and its page counts compared with the reference's.
"""

from dataclasses import dataclass, field

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from radix.keys import Namespace
from radix.node import Tier
from radix.tree import RadixTree

NS = Namespace(model_id="test-model", layout="test-layout")

PAGE_SIZE = 2
tokens_strategy = st.lists(st.integers(0, 2), min_size=0, max_size=12)


@dataclass
class PageState:
    device_id: int | None = None
    host_id: int | None = None
    in_l3: bool = False
    locks: int = 0  # locks and pins: either keeps the page in its tiers

    @property
    def level(self) -> int:
        if self.device_id is not None:
            return 1
        if self.host_id is not None:
            return 2
        return 3 if self.in_l3 else 4


@dataclass
class Reference:
    pages: dict[tuple, PageState] = field(default_factory=dict)

    def prefixes(self, tokens):
        full = len(tokens) // PAGE_SIZE
        return [tuple(tokens[: (i + 1) * PAGE_SIZE]) for i in range(full)]

    def matched(self, tokens):
        out = []
        for prefix in self.prefixes(tokens):
            if prefix not in self.pages:
                break
            out.append(prefix)
        return out

    def children(self, prefix):
        return [
            p
            for p in self.pages
            if len(p) == len(prefix) + PAGE_SIZE and p[: len(prefix)] == prefix
        ]

    def l1_evictable(self, prefix) -> bool:
        page = self.pages[prefix]
        if page.device_id is None or page.locks:
            return False
        kids = [self.pages[c] for c in self.children(prefix)]
        if any(k.level == 1 for k in kids):
            return False
        if page.host_id is not None:
            return True
        if page.in_l3:
            return not any(k.level == 2 for k in kids)
        return not kids

    def l2_evictable(self, prefix) -> bool:
        page = self.pages[prefix]
        if page.level != 2 or page.locks:
            return False
        kids = [self.pages[c] for c in self.children(prefix)]
        if any(k.level <= 2 for k in kids):
            return False
        return page.in_l3 or not kids

    def l2_spare(self, prefix) -> bool:
        """An L2 copy of a page L1 and L3 hold too, below which no page is in L2: evicted once
        no page of L2's own is."""
        page = self.pages[prefix]
        if page.level != 1 or page.host_id is None or not page.in_l3 or page.locks:
            return False
        return not any(self.pages[c].host_id is not None for c in self.children(prefix))

    def drop_if_empty(self, prefix):
        if self.pages[prefix].level == 4:
            del self.pages[prefix]


class TreeMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.tree = RadixTree(page_size=PAGE_SIZE)
        self.ref = Reference()
        self.next_id = 0
        self.locked: list[tuple] = []  # (node, page prefixes under that lock)
        self.pinned: list[tuple] = []  # (deepest node, pages, page prefixes): one run, pinned

    def fresh_ids(self, count):
        ids = list(range(self.next_id, self.next_id + count))
        self.next_id += count
        return ids

    def page_of(self, device_or_host: str, page_id: int):
        for prefix, page in self.ref.pages.items():
            if getattr(page, device_or_host) == page_id:
                return prefix
        raise AssertionError(f"{device_or_host} {page_id} is not held by any page")

    @rule(tokens=tokens_strategy)
    def insert(self, tokens):
        prefixes = self.ref.prefixes(tokens)
        ids = self.fresh_ids(len(prefixes))
        result = self.tree.insert(tokens, ids, NS)
        present = len(self.ref.matched(tokens))
        assert result.num_present_pages == present
        assert result.num_new_pages == len(prefixes) - present
        expected_duplicates = []
        for prefix, page_id in zip(prefixes, ids, strict=True):
            page = self.ref.pages.setdefault(prefix, PageState())
            if page.device_id is None:
                page.device_id = page_id
            elif page.device_id != page_id:
                expected_duplicates.append(page_id)
        assert result.duplicate_device_page_ids == expected_duplicates

    @rule(tokens=tokens_strategy, lock=st.booleans())
    def match(self, tokens, lock):
        match = self.tree.match_prefix(tokens, NS)
        matched = self.ref.matched(tokens)
        assert match.matched_pages == len(matched)
        levels = [self.ref.pages[p].level for p in matched]
        assert levels == sorted(levels), "tiers must come L1, then L2, then L3"
        assert match.device_page_ids == [
            self.ref.pages[p].device_id for p in matched if self.ref.pages[p].level == 1
        ]
        assert match.host_page_ids == [
            self.ref.pages[p].host_id for p in matched if self.ref.pages[p].level == 2
        ]
        assert match.num_l3_pages == levels.count(3)
        if lock and matched:
            self.tree.lock(match.last_node)
            for prefix in matched:
                self.ref.pages[prefix].locks += 1
            self.locked.append((match.last_node, matched))

    @precondition(lambda self: self.locked)
    @rule(data=st.data())
    def unlock(self, data):
        node, prefixes = self.locked.pop(data.draw(st.integers(0, len(self.locked) - 1)))
        self.tree.unlock(node)
        for prefix in prefixes:
            self.ref.pages[prefix].locks -= 1

    @rule(tokens=tokens_strategy)
    def pin_last_run(self, tokens):
        match = self.tree.match_prefix(tokens, NS)
        if not match.matched_pages:
            return
        node = match.last_node
        self.tree.pin(node)
        prefixes = self.ref.matched(tokens)[-node.num_pages :]
        for prefix in prefixes:
            self.ref.pages[prefix].locks += 1
        self.pinned.append((node, node.num_pages, prefixes))

    @precondition(lambda self: self.pinned)
    @rule(data=st.data())
    def unpin_run(self, data):
        node, num_pages, prefixes = self.pinned.pop(data.draw(st.integers(0, len(self.pinned) - 1)))
        remaining = num_pages
        while remaining > 0:  # the run may have been split: unpin every piece
            self.tree.unpin(node)
            remaining -= node.num_pages
            node = node.parent
        for prefix in prefixes:
            self.ref.pages[prefix].locks -= 1

    @rule(tokens=tokens_strategy, to_l3=st.booleans())
    def backup(self, tokens, to_l3):
        """Give the first L1 run of a match without an L2 copy one (and maybe an L3 copy)."""
        match = self.tree.match_prefix(tokens, NS)
        start = 0
        for node in match.l1_nodes:
            if node.host_page_ids is None:
                ids = self.fresh_ids(node.num_pages)
                self.tree.set_host(node, ids)
                prefixes = self.ref.matched(tokens)[start : start + node.num_pages]
                for prefix, host_id in zip(prefixes, ids, strict=True):
                    self.ref.pages[prefix].host_id = host_id
                    if to_l3:
                        self.ref.pages[prefix].in_l3 = True
                if to_l3:
                    self.tree.set_l3(node)
                return
            start += node.num_pages

    @rule(tokens=tokens_strategy)
    def insert_l3(self, tokens):
        self.tree.insert_l3(tokens, NS)
        for prefix in self.ref.prefixes(tokens):
            self.ref.pages.setdefault(prefix, PageState(in_l3=True))

    @rule(num_pages=st.integers(0, 8))
    def evict_l1(self, num_pages):
        freed = self.tree.evict(Tier.L1, num_pages)
        assert len(freed) <= num_pages
        for device_id in freed:
            prefix = self.page_of("device_id", device_id)
            assert self.ref.l1_evictable(prefix), f"evicted a page that must stay: {prefix}"
            self.ref.pages[prefix].device_id = None
            self.ref.drop_if_empty(prefix)
        if len(freed) < num_pages:
            left = [p for p in self.ref.pages if self.ref.l1_evictable(p)]
            assert not left, f"evict stopped early; still evictable: {left}"

    @rule(num_pages=st.integers(0, 8))
    def evict_l2(self, num_pages):
        freed = self.tree.evict(Tier.L2, num_pages)
        assert len(freed) <= num_pages
        for host_id in freed:
            prefix = self.page_of("host_id", host_id)
            if not self.ref.l2_evictable(prefix):
                assert self.ref.l2_spare(prefix), f"evicted a page that must stay: {prefix}"
                own = [p for p in self.ref.pages if self.ref.l2_evictable(p)]
                assert not own, f"evicted a spare copy before L2's own pages {own}"
            self.ref.pages[prefix].host_id = None
            self.ref.drop_if_empty(prefix)
        if len(freed) < num_pages:
            left = [p for p in self.ref.pages if self.ref.l2_evictable(p) or self.ref.l2_spare(p)]
            assert not left, f"evict stopped early; still evictable: {left}"

    @rule(num_pages=st.integers(0, 8))
    def forget_l3(self, num_pages):
        before = {p for p, s in self.ref.pages.items() if s.level == 3}
        forgotten = self.tree.forget_l3(num_pages)
        assert forgotten <= num_pages
        gone = {
            p
            for p in before
            if not self.tree.match_prefix(list(p), NS).matched_pages * PAGE_SIZE >= len(p)
        }
        assert len(gone) == forgotten
        for prefix in gone:
            assert self.ref.pages[prefix].locks == 0
            del self.ref.pages[prefix]

    @invariant()
    def consistent(self):
        self.tree.check_invariants()
        for tier, attr in ((Tier.L1, "device_id"), (Tier.L2, "host_id")):
            held = sum(getattr(p, attr) is not None for p in self.ref.pages.values())
            assert self.tree.num_pages(tier) == held
        assert self.tree.num_pages(Tier.L3) == sum(p.in_l3 for p in self.ref.pages.values())


TreeMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
test_tree_against_reference = TreeMachine.TestCase


class LfuTreeMachine(TreeMachine):
    def __init__(self):
        super().__init__()
        self.tree = RadixTree(page_size=PAGE_SIZE, eviction_policy="lfu")


LfuTreeMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
test_lfu_tree_against_reference = LfuTreeMachine.TestCase
