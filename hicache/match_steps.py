"""`MatchSteps`: the steps of `HiCache.match` past the index lookup, which `HiCache`
(`hicache.controller`) inherits: what to look up in L3 and fetch past the match, how long
to wait for it, loading each landed read batch, and finishing the match (loading its L2
part, locking it, counting the hits). The moving itself is the `PageMover`'s
(`hicache.mover`). Every step walks up from the node the request holds (controller doc).
"""

from __future__ import annotations

import threading

from hicache.config import HiCacheConfig, PolicyConfig
from hicache.fetch_plan import FetchRates, RunToFetch
from hicache.match import Landed, Match
from hicache.metrics import Metrics
from hicache.mover import PageMover, usable_prefix
from hicache.ops import Executor, LoadOp, PrefetchOp, RunStatus, filling_op, status_of
from hicache.ownership import NoPool
from radix.keys import Namespace
from radix.node import Node, Tier
from radix.tree import MatchResult, RadixTree
from tiers.allocator import PageAllocator
from tiers.layout import KVLayout


class MatchSteps:
    """The match's steps, which `HiCache` inherits (`HiCache.match` runs `_start_prefetch`,
    `_wait_prefetch` and `_finish_match` in turn; `record_compute` calls
    `_start_waiting_probe`): what they use of `HiCache` is declared here."""

    config: HiCacheConfig
    layout: KVLayout
    page_size: int
    _executor: Executor
    _tree: RadixTree
    _host: PageAllocator | NoPool
    _lock: threading.RLock
    _metrics: Metrics
    _policy: PolicyConfig
    _rates: FetchRates
    _mover: PageMover
    _store_probe: PrefetchOp | None
    _probe_waiting: Node | None

    # ------------------------------------------------------------------ match internals

    def _finish_match(
        self,
        end: Node,
        namespace: Namespace,
        priority: int,
        landed: Landed,
        num_tokens: int,
        *,
        record: bool,
        whole: bool,
    ) -> Match:
        """Load the L2 part of the request's usable prefix (read up from `end`, the node the
        request holds) into L1, lock it, count the hits (with those `landed` loaded while
        its prefetch ran).

        The match's run is locked first, so nothing it holds can leave a tier while room
        is made; its page ids are read off the locked run afterwards (`Match`), never off
        a list of runs taken before pages moved.
        """
        usable = self._usable_runs(end)
        if not whole:  # (a whole match's L2 part is of use only all loaded)
            usable = self._worth_loading(usable, num_tokens)
        node = usable[-1] if usable else None
        num_loaded = num_from_l3 = 0
        loads: list[LoadOp] = []
        if node is not None:
            self._tree.lock(node)
            node, load, num_from_l3 = self._mover.load_into_l1(node)
            if load is not None:
                loads.append(load)
                num_loaded = load.num_pages
        path = RadixTree.path(node) if node is not None else []
        for run in path:
            op = filling_op(run)
            if isinstance(op, LoadOp) and op not in loads:
                loads.append(op)
        if node is not None and priority:
            self._tree.raise_priority(node, priority)
        num_pages = sum(run.num_pages for run in path)
        num_loaded = min(num_pages, num_loaded + landed.num_loaded)  # (a failed load cuts)
        num_from_l3 = min(num_loaded, num_from_l3 + landed.num_from_l3)
        for tier, pages in (
            ("l1", num_pages - num_loaded),
            ("l2", num_loaded - num_from_l3),
            ("l3", num_from_l3),
        ):
            if record:
                self._metrics.record_hit(tier, pages, self.page_size)
        if self._policy.write_policy == "write_through_selective" and self._host.num_pages:
            for run in path:
                if (
                    run.host_page_ids is None
                    and run.hit_count >= self._policy.write_through_threshold
                ):
                    self._mover.backup(run)
        return Match(
            namespace=namespace,
            num_tokens=num_pages * self.page_size,
            num_pages=num_pages,
            num_l1_pages=num_pages - num_loaded,
            num_l2_pages=num_loaded - num_from_l3,
            num_l3_pages=num_from_l3,
            _node=node,
            _loads=loads,
        )

    def _worth_loading(self, usable: list[Node], num_tokens: int) -> list[Node]:
        """`usable` without the L2 runs that end it when loading them into L1 would take
        longer than recomputing their tokens (`fetch_plan.FetchRates.worth_loading`). Runs
        a prefetch brought from L3 are kept (their fetch was weighed with their load)."""
        if self._policy.l2_load_policy == "always":
            return usable
        num_l2 = 0
        for run in reversed(usable):
            if run.level != Tier.L2:
                break
            if status_of(run) is not None:  # from L3, or in motion: already decided
                return usable
            num_l2 += 1
        if not num_l2:
            return usable
        num_l2_pages = sum(run.num_pages for run in usable[-num_l2:])
        num_pages = sum(run.num_pages for run in usable)
        run = RunToFetch(
            hit_tokens=(num_pages - num_l2_pages) * self.page_size,
            num_pages=num_l2_pages,
            page_size=self.page_size,
            page_bytes=self.layout.bytes_per_page,
            total_tokens=num_tokens,
            batch_pages=num_l2_pages,  # one load
        )
        return usable if self._rates.worth_loading(run) else usable[:-num_l2]

    @staticmethod
    def _usable_runs(end: Node) -> list[Node]:
        """The runs a match can use now, read up from `end`, the deepest node of the
        request's path (or, when that has left the index, its deepest ancestor still in it):
        those in L1 or L2, down to the first a failed load left wrong (`usable_prefix`)."""
        path = RadixTree.path(RadixTree.held_end(end))
        return usable_prefix([run for run in path if run.level <= Tier.L2])

    # ------------------------------------------------------------------ L3 lookup and wait

    def _start_prefetch(
        self, data: bytes, first: MatchResult, *, fetch_all: bool = False, ask_l3: bool = True
    ) -> tuple[Node, PrefetchOp | None]:
        """Look past the match `first` in L3 (unless `ask_l3` is False: the caller's own
        recent lookup of the request stands), index what L3 holds, and start fetching the L3
        part of the prefix into L2.

        Returns the deepest node of the request's path now, which the request's later steps
        walk up from, and the op to wait for (its own, or one already running for the same
        pages), or None when L3 has nothing for it.
        """
        end = first.last_node
        if not self._executor.has_l3 or not self._host.num_pages:
            return end, None
        for run in first.l3_nodes:
            if status_of(run) is RunStatus.FETCHING:
                return end, filling_op(run)  # another request is fetching these pages already
        total_pages = len(data) // 4 // self.page_size
        unmatched = total_pages - first.matched_pages
        if unmatched and not ask_l3:
            self._metrics.l3_lookups_spared += 1
            unmatched = 0
        if first.num_l3_pages + unmatched < self._policy.prefetch_min_pages:
            return end, None
        found = 0
        num_l3_pages = first.num_l3_pages + unmatched
        if unmatched and not fetch_all and not self._worth_looking(data, first, num_l3_pages):
            return end, None  # no fetch could pay, whatever L3 holds: no lookup either
        if unmatched:
            keys = self._tree.keys_after(end, data)
            began = self._executor.now()
            found = self._executor.l3_exists(keys, self.config.l3.exists_timeout_s)
            self._metrics.l3_lookups += 1
            self._rates.record_lookup(self._executor.now() - began)
            if found:
                end = self._tree.extend_l3(end, data, first.matched_pages + found).last_node
        held = first.num_l3_pages + found
        run = self._run_to_fetch(data, first, held)
        num_pages = held if fetch_all else self._pages_worth_fetching(run)
        if num_pages < self._policy.prefetch_min_pages:
            if not fetch_all:
                self._probe_store(end, run)
            return end, None
        tail = self._l3_cut(RadixTree.trailing(end, Tier.L3), num_pages)
        op = self._mover.submit_prefetch(tail) if tail is not None else None
        self._mover.trim_l3_index()
        return end, op

    def _probe_store(self, end: Node, run: RunToFetch) -> None:
        """Read the first batch of `run`, which the request recomputes, into L2 off its path,
        while the store's read rate is only a prior (`FetchRates.probe_pages`): held (locked)
        until the engine reports its next step, so that the read does not run beside the
        step recomputing the run (on the H200, beside a 4K prefill, it made it 0.7x of cold)."""
        if self._policy.l3_fetch_policy == "always" or self._probe_waiting is not None:
            return
        if self._store_probe is not None and not self._store_probe.done:
            return
        num_pages = self._rates.probe_pages(run)
        tail = self._l3_cut(RadixTree.trailing(end, Tier.L3), num_pages) if num_pages else None
        if tail is not None:
            self._tree.lock(tail)
            self._probe_waiting = tail

    def _start_waiting_probe(self) -> None:
        """After an engine step: start the probe `_probe_store` held, if its run is still
        only in L3 and nobody fetches it (the caller holds the lock)."""
        tail, self._probe_waiting = self._probe_waiting, None
        if tail is None:
            return
        self._tree.unlock(tail)
        if tail.level == Tier.L3 and status_of(tail) is None:
            self._store_probe = self._mover.submit_prefetch(tail)

    def _pages_worth_fetching(self, run: RunToFetch) -> int:
        """How many of the L3 pages of `run` to fetch: all (`always`), or the leading part
        that beats recomputing them (`measured`: `fetch_plan`)."""
        if self._policy.l3_fetch_policy == "always" or not run.num_pages:
            return run.num_pages
        return self._rates.plan(run).num_pages

    def _worth_looking(self, data: bytes, match: MatchResult, num_l3_pages: int) -> bool:
        """Whether an L3 lookup could change what the match fetches, were all of the
        `num_l3_pages` past its L1/L2 hit in L3 (`fetch_plan.FetchRates.worth_looking`)."""
        if self._policy.l3_fetch_policy == "always":
            return True
        return self._rates.worth_looking(self._run_to_fetch(data, match, num_l3_pages))

    def _run_to_fetch(self, data: bytes, match: MatchResult, num_l3_pages: int) -> RunToFetch:
        hit_pages = match.matched_pages - match.num_l3_pages
        return RunToFetch(
            hit_tokens=hit_pages * self.page_size,
            num_pages=num_l3_pages,
            page_size=self.page_size,
            page_bytes=self.layout.bytes_per_page,
            total_tokens=len(data) // 4,
            batch_pages=self.config.l3.pages_per_read(self.layout.bytes_per_page),
        )

    def _l3_cut(self, l3_nodes: list[Node], num_pages: int) -> Node | None:
        """The L3 run ending the first `num_pages` L3 pages of a path (a run split there)."""
        for node in l3_nodes:
            if node.num_pages >= num_pages:
                return self._tree.split(node, num_pages) if node.num_pages > num_pages else node
            num_pages -= node.num_pages
        return l3_nodes[-1] if l3_nodes else None

    def _wait_prefetch(self, op: PrefetchOp, end: Node, *, wait_all: bool = False) -> Landed:
        """Wait for an L3 prefetch as the policy says, the cache's lock not held, and load
        each part into L1 as soon as it lands in L2: the L2 -> L1 copy of one read batch
        overlaps the L3 read of the next (and the match's L2 pages go first, at once).

        Returns what was loaded meanwhile; its runs stay locked for the match (`Landed`).
        """
        landed = Landed()
        deadline = None if wait_all else self._prefetch_deadline(op)
        seen = -1
        while True:
            with self._lock:
                self._mover.apply_completions()
                if op.num_ready > seen:
                    seen = op.num_ready
                    self._load_landed(end, landed)
            if op.done:
                return landed
            remaining = None if deadline is None else deadline - self._executor.now()
            if remaining is not None and remaining <= 0:
                return landed
            self._executor.wait_ready(op, seen + 1, remaining)

    def _prefetch_deadline(self, op: PrefetchOp) -> float | None:
        """Until when (executor clock) a match waits for `op`; None: until it is done."""
        policy = self._policy.prefetch_policy
        if policy == "best_effort":
            return self._executor.now()
        if policy == "wait_complete":
            return None
        return op.submitted_s + self._policy.prefetch_budget_s(op.num_pages * self.page_size)

    def _load_landed(self, end: Node, landed: Landed) -> None:
        """Start loading the L2 runs that end the request's usable prefix now into L1, and
        hold the run that ends the loaded part for the match (the caller holds the lock)."""
        usable = self._usable_runs(end)
        if not usable or usable[-1].level != Tier.L2:
            return
        self._tree.lock(usable[-1])
        node, load, from_l3 = self._mover.load_into_l1(usable[-1])
        if node is not None:
            landed.held.append(node)
        if load is not None:
            landed.num_loaded += load.num_pages
            landed.num_from_l3 += from_l3
