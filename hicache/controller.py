"""`HiCache`: the one object an engine talks to.

It owns the radix index, the page accounting of L1 and L2, and the policies (write,
L2->L3, prefetch, eviction). It decides what moves where and describes each move as a
transfer op (`hicache.ops`); an executor carries the ops out. The real executor moves
bytes with the tiers' kernels and the storage backends; the simulator's advances a
virtual clock. Everything in this module is torch-free, so both run the same policy code.

How ops are recorded in the index, and what their completion changes, is
`hicache.transfers`' part (a mixin of `HiCache`).

Thread safety: every public method takes the cache's lock, except `wait_layer`, and the
lock is let go while a match waits for an L3 prefetch.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import NamedTuple

from hicache.config import HiCacheConfig
from hicache.errors import BackgroundTransferError, HiCacheError
from hicache.fetch_plan import FetchRates, FetchRatesSnapshot, RunToFetch
from hicache.metrics import HiCacheStats, Metrics
from hicache.ops import Executor, LoadOp, OpKind, PrefetchOp, TransferOp
from hicache.transfers import FAILED_LOAD, INDEX, Landed, PageMovement, op_owner
from radix.keys import Namespace, encode_tokens
from radix.node import Node, Tier
from radix.tree import MatchResult, RadixTree
from tiers.allocator import PageAllocator
from tiers.errors import PageIdError, PoolExhaustedError

# Owners of L1 / L2 page ids (besides an op in flight, `op_owner(op)`): every allocated
# page is held by exactly one of these, and the pools record which (`PageAllocator`).
REQUEST = "a request"  # allocated by alloc_device_pages, not inserted or freed yet


@dataclass(eq=False)
class Match:
    """A request's cached prefix, locked until `HiCache.release(match)`.

    `device_page_ids` hold the first `num_tokens` tokens' KV in L1. Pages that came from
    L2 or L3 may still be loading: call `HiCache.wait_layer(match, i)` before reading
    layer i. The engine must not write to these pages.
    """

    namespace: Namespace
    num_tokens: int
    num_pages: int
    num_l1_pages: int  # already in L1
    num_l2_pages: int  # loaded from L2 for this match
    num_l3_pages: int  # fetched from L3 (through L2) for this match
    _node: Node | None = field(default=None, repr=False)
    _loads: list[LoadOp] = field(default_factory=list, repr=False)
    released: bool = False

    @property
    def has_loads(self) -> bool:
        """Whether any of its pages came (or are coming) into L1 by a load: a step that
        waits for them times the load as well as its compute."""
        return bool(self._loads)

    @property
    def device_page_ids(self) -> list[int]:
        """The L1 page of each matched page, in order, read off the locked run now.

        The locked runs' pages never move, so the list stays right until `release`; it is
        computed from the index when asked (a run split since the match changes nothing).
        """
        if self.released:
            raise HiCacheError("this match was released: its pages are no longer held")
        if self._node is None:
            return []
        return [page for run in RadixTree.path(self._node) for page in run.device_page_ids]


class CachedPrefix(NamedTuple):
    """Pages of a prompt's prefix held in each tier (the fastest one that holds each)."""

    num_l1_pages: int
    num_l2_pages: int
    num_l3_pages: int


class _NoPool:
    """The L2 allocator of a cache configured without L2: it never has a page."""

    num_pages = num_free = num_used = 0

    def alloc(self, num_pages: int, owner: object = None) -> list[int]:
        raise PoolExhaustedError("L2", num_pages, 0, 0)

    def free(self, page_ids, owner: object = None) -> None:
        if list(page_ids):
            raise HiCacheError("freeing L2 pages in a cache without L2")

    def check_invariants(self) -> None:
        pass


class HiCache(PageMovement):
    """Tiered KV cache controller. See the module docstring for the bookkeeping rules."""

    def __init__(self, config: HiCacheConfig, executor: Executor | None = None) -> None:
        self.config = config
        self.layout = config.layout
        self.page_size = config.layout.page_size
        if executor is None:
            from hicache.executor import RealExecutor  # torch enters here, and only here

            executor = RealExecutor(config)
        self._executor = executor
        self._tree = RadixTree(self.page_size, config.policy.eviction_policy)
        self._device = PageAllocator(executor.num_device_pages, name="L1")
        self._host = (
            PageAllocator(executor.num_host_pages, name="L2")
            if executor.num_host_pages
            else _NoPool()
        )
        self._lock = threading.RLock()
        self._inflight: dict[int, TransferOp] = {}
        self._failed_loads: list[Node] = []  # runs whose L1 copy a failed load left wrong
        self._error: BaseException | None = None
        self._metrics = Metrics()
        self._policy = config.policy
        self._max_l3_pages = 0  # L3-only pages the index keeps (set when L3 is attached)
        self._rates = FetchRates(
            l3_read_prior_bytes_per_s=config.policy.l3_read_prior_bytes_per_s,
            l2_load_prior_bytes_per_s=config.policy.l2_load_prior_bytes_per_s,
        )
        link = executor.link_sample()
        if link is not None:
            self._rates.record_load(*link)
        if config.l3.url:
            executor.attach_l3(config.l3.url)
            self._max_l3_pages = self._l3_index_limit()

    # ------------------------------------------------------------------ engine API

    @property
    def executor(self) -> Executor:
        return self._executor

    def match(self, tokens, namespace: Namespace, *, priority: int = 0) -> Match:
        """The longest cached prefix of `tokens`, ready for the engine to attend over.

        L1 pages are usable at once; L2 pages are loaded into fresh L1 pages layer by layer
        (`wait_layer`); pages only in L3 are prefetched into L2, as much of the run as beats
        recomputing it (`PolicyConfig.l3_fetch_policy`), each read batch loaded on into L1
        as soon as it lands, waiting as the prefetch policy says. L3 trouble (down, slow,
        corrupt pages) makes the match shorter; it never raises. The result is locked until
        `release`. `priority` is the request's (the `priority` eviction policy keeps
        high-priority runs longest).
        """
        data = _request_tokens(tokens, namespace)
        with self._lock:
            self._check_background()
            self._apply_completions()
            first = self._tree.match_prefix(data, namespace)
            self._metrics.requests += 1
            self._metrics.requested_tokens += len(data) // 4 // self.page_size * self.page_size
            prefetch = self._start_prefetch(data, namespace, first)
        landed = Landed()
        if prefetch is not None:
            landed = self._wait_prefetch(prefetch, data, namespace)
        with self._lock:
            try:
                self._apply_completions()
                if prefetch is not None and not prefetch.done:
                    self._metrics.prefetches_cut_short += 1
                return self._finish_match(data, namespace, priority, landed)
            finally:
                landed.let_go(self._tree)

    def prefetch(self, tokens, namespace: Namespace) -> int:
        """Start fetching the L3 part of `tokens`' prefix into L2, without waiting.

        For a scheduler to call when a request is queued, so that by the time it runs
        (`match`) its pages have arrived. Returns the number of pages being fetched.
        """
        data = _request_tokens(tokens, namespace)
        with self._lock:
            self._check_background()
            self._apply_completions()
            first = self._tree.match_prefix(data, namespace, touch=False)
            op = self._start_prefetch(data, namespace, first)
            return op.num_pages if op is not None else 0

    def cached_prefix(self, tokens, namespace: Namespace) -> CachedPrefix:
        """How much of `tokens`' prefix each tier holds, by the index alone.

        Changes nothing a match would: no eviction order, no hit, no transfer, no lock.
        For a router choosing the instance with the longest cached prefix.
        """
        data = _request_tokens(tokens, namespace)
        with self._lock:
            found = self._tree.match_prefix(data, namespace, touch=False)
            return CachedPrefix(found.num_l1_pages, found.num_l2_pages, found.num_l3_pages)

    def set_residency_listener(self, listener) -> None:
        """From now on, tell `listener` (a `radix.tree.ResidencyListener`, such as
        `hicache.events.TierEvents`) of every page the index gains or loses, per tier.
        None stops it. Called under the cache's lock: the listener must not block."""
        with self._lock:
            self._tree.listener = listener

    def poll(self) -> None:
        """Apply the transfers that finished since the last call (never blocks).

        Every other call does this too; an idle owner calls it to let backups reach L3.
        """
        with self._lock:
            self._check_background()
            self._apply_completions()

    def record_compute(self, num_rows: int, num_pairs: int, seconds: float) -> None:
        """The engine reports one step it ran without waiting for a load: `num_rows` rows
        through the model, `num_pairs` (row, attended position) pairs of attention
        (`fetch_plan.attention_pairs`), `seconds` of wall time. The compute rate the
        load-or-recompute choice weighs L3 reads against is fitted to these."""
        with self._lock:
            self._rates.record_compute(num_rows, num_pairs, seconds)

    def fetch_rates(self) -> FetchRatesSnapshot:
        """The rates this cache measured for its load-or-recompute choice."""
        with self._lock:
            return self._rates.snapshot()

    def pages_in_use(self, tier: str) -> int:
        """Pages allocated in "l1" or "l2" (cached or held by requests)."""
        pools = {"l1": self._device, "l2": self._host}
        if tier not in pools:
            raise ValueError(f"tier must be 'l1' or 'l2', got {tier!r}")
        with self._lock:
            return pools[tier].num_used

    def wait_layer(self, match: Match, layer: int) -> None:
        """Block until layer `layer` of every page `match` loads is in L1.

        Raises BackgroundTransferError if a load of this match failed: its pages hold
        wrong KV, and the request must not use them (release the match and recompute).
        """
        for load in match._loads:
            self._executor.wait_layer(load, layer)
            if load.error is not None:
                raise BackgroundTransferError(
                    f"loading this match's pages into L1 failed: {load.error!r}"
                ) from load.error

    def insert(self, tokens, device_page_ids, namespace: Namespace, *, priority: int = 0) -> int:
        """Hand a request's full pages to the cache; returns how many pages were new.

        `device_page_ids[i]` holds page i of `tokens`: the match's own ids for its prefix,
        then pages from `alloc_device_pages` (ids beyond the full pages stay the caller's).
        Pages the cache already held are freed here, so the caller never frees any of the
        full pages' ids afterwards. The write policy then schedules backups.
        """
        data = _request_tokens(tokens, namespace)
        num_pages = len(data) // 4 // self.page_size
        ids = list(device_page_ids[:num_pages])
        with self._lock:
            self._check_background()
            self._apply_completions()
            self._check_insert_ids(data, namespace, ids)
            result = self._tree.insert(data, ids, namespace)
            duplicates = set(result.duplicate_device_page_ids)
            if duplicates:
                self._device.free(result.duplicate_device_page_ids, REQUEST)
            adopted = [page for page in ids if page not in duplicates]
            self._device.give(
                [page for page in adopted if self._device.owner_of(page) == REQUEST],
                REQUEST,
                INDEX,
            )
            if priority:
                self._tree.raise_priority(result.last_node, priority)
            self._metrics.inserted_pages += result.num_new_pages
            self._metrics.duplicate_pages += len(duplicates)
            if self._policy.write_policy == "write_through" and self._host.num_pages:
                self._backup_path(result.last_node)
            return result.num_new_pages

    def release(self, match: Match) -> None:
        """Unlock a match's pages; they become evictable again."""
        with self._lock:
            if match.released:
                raise HiCacheError("this match was already released")
            match.released = True
            if match._node is not None:
                self._tree.unlock(match._node)
            self._apply_completions()

    def alloc_device_pages(self, num_pages: int) -> list[int]:
        """L1 pages for a request's new KV, evicting cached pages as needed.

        Raises PoolExhaustedError when not enough pages can be freed (all are locked).
        """
        with self._lock:
            self._check_background()
            self._apply_completions()
            self._make_room(Tier.L1, num_pages)
            return self._device.alloc(num_pages, REQUEST)

    def free_device_pages(self, device_page_ids) -> None:
        """Give back L1 pages the caller allocated and did not insert."""
        with self._lock:
            try:
                self._device.free(device_page_ids, REQUEST)
            except PageIdError as error:
                raise HiCacheError(f"free_device_pages: {error}") from None

    def evict(self, tier: str, num_pages: int) -> int:
        """Free up to `num_pages` unlocked pages of "l1" or "l2" now (with the same
        write-back cascade as eviction on demand); returns how many were freed."""
        tiers = {"l1": (Tier.L1, self._device), "l2": (Tier.L2, self._host)}
        if tier not in tiers:
            raise ValueError(f"tier must be 'l1' or 'l2', got {tier!r}")
        level, pool = tiers[tier]
        with self._lock:
            self._check_background()
            self._apply_completions()
            before = pool.num_free
            self._make_room(level, pool.num_free + num_pages)
            return pool.num_free - before

    @property
    def device_pool(self):
        """The L1 pool's tensors (`tiers.DevicePool`), for the engine's attention."""
        return self._executor.device_pool

    def flush(self, timeout_s: float | None = None) -> None:
        """Wait until every backup and L3 write submitted so far has finished."""
        with self._lock:
            while True:
                self._apply_completions()
                writes = [
                    op
                    for op in self._inflight.values()
                    if op.kind in (OpKind.BACKUP, OpKind.WRITE_L3)
                ]
                if not writes:
                    return
                for op in writes:
                    if not self._executor.wait(op, timeout_s):
                        raise HiCacheError(f"flush: a {op.kind.value} op is still running")

    def stats(self) -> HiCacheStats:
        with self._lock:
            self._apply_completions()
            l3 = self._executor.l3_stats()
            return self._metrics.snapshot(
                l3_errors=l3.num_errors + l3.num_timeouts if l3 else 0,
                l3_corrupt_pages=l3.num_corrupt_total if l3 else 0,
                l1_pages_used=self._device.num_used,
                l1_pages_total=self._device.num_pages,
                l2_pages_used=self._host.num_used,
                l2_pages_total=self._host.num_pages,
                index_nodes=self._tree.num_nodes,
            )

    def attach_l3(self, url: str) -> None:
        """Start using the L3 backend at `url` (waits for in-flight transfers first)."""
        if not self._host.num_pages:
            raise HiCacheError("an L3 backend needs an L2 pool: pages reach L3 through L2")
        with self._lock:
            self._drain()
            self._executor.attach_l3(url)
            self._max_l3_pages = self._l3_index_limit()

    def detach_l3(self) -> None:
        """Stop using L3 (waits for in-flight transfers); the index forgets L3 copies.

        Matches may be held meanwhile: the pages they use stay where they are.
        """
        with self._lock:
            self._drain()
            self._tree.forget_all_l3()
            self._executor.attach_l3(None)
            self._max_l3_pages = 0

    def close(self) -> None:
        with self._lock:
            try:
                self._drain()
            finally:
                self._executor.close()

    def check_invariants(self) -> None:
        """The index's invariants, and exact ownership: every L1 and L2 page the index
        maps is owned by the index and every page the index owns is mapped by exactly one
        run; every page an op owns belongs to an op in flight."""
        with self._lock:
            self._tree.check_invariants()
            self._device.check_invariants()
            self._host.check_invariants()
            mapped: dict[Tier, list[int]] = {Tier.L1: [], Tier.L2: []}
            for node in self._tree.nodes():
                if node.device_page_ids is not None:
                    mapped[Tier.L1].extend(node.device_page_ids)
                if node.host_page_ids is not None:
                    mapped[Tier.L2].extend(node.host_page_ids)
            ops = {op_owner(op) for op in self._inflight.values()}
            for tier, pool in ((Tier.L1, self._device), (Tier.L2, self._host)):
                _check_ownership(tier, pool, mapped[tier], ops)

    # ------------------------------------------------------------------ match internals

    def _finish_match(
        self, data: bytes, namespace: Namespace, priority: int, landed: Landed
    ) -> Match:
        """Load the L2 part of the (now current) match into L1, lock it, count the hits
        (with those `landed` loaded while its prefetch ran).

        The match's run is locked first, so nothing it holds can leave a tier while room
        is made; its page ids are read off the locked run afterwards (`Match`), never off
        a list of runs taken before pages moved.
        """
        current = self._tree.match_prefix(data, namespace, touch=False)
        usable = current.l1_nodes + current.l2_nodes
        usable = usable[: self._first_failed(usable)]
        node = usable[-1] if usable else None
        num_loaded = num_from_l3 = 0
        loads: list[LoadOp] = []
        if node is not None:
            self._tree.lock(node)
            node, load, num_from_l3 = self._load_into_l1(node)
            if load is not None:
                loads.append(load)
                num_loaded = load.num_pages
        path = RadixTree.path(node) if node is not None else []
        for run in path:
            if isinstance(run.meta, LoadOp) and run.meta not in loads:
                loads.append(run.meta)
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
            self._metrics.record_hit(tier, pages, self.page_size)
        if self._policy.write_policy == "write_through_selective" and self._host.num_pages:
            for run in path:
                if (
                    run.host_page_ids is None
                    and run.hit_count >= self._policy.write_through_threshold
                ):
                    self._backup(run)
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

    def _first_failed(self, runs: list[Node]) -> int:
        """How many leading runs are usable: a run a failed load left wrong, and every run
        below it, are not (they are dropped as soon as nothing holds them)."""
        for index, run in enumerate(runs):
            if run.meta is FAILED_LOAD:
                return index
        return len(runs)

    def _check_insert_ids(self, data: bytes, namespace: Namespace, ids: list[int]) -> None:
        """Validate before anything changes: each id is the caller's own (from
        alloc_device_pages), or the page the index already maps at that very position."""
        held = self._tree.match_prefix(data, namespace, touch=False).device_page_ids
        if len(set(ids)) != len(ids):
            raise HiCacheError("insert: a device page id is listed twice")
        for position, page in enumerate(ids):
            if position < len(held) and page == held[position]:
                continue
            try:
                owner = self._device.owner_of(page)
            except PageIdError as error:
                raise HiCacheError(f"insert: page {position} of the prompt: {error}") from None
            if owner != REQUEST:
                raise HiCacheError(
                    f"insert: device page {page} (page {position} of the prompt) is not the "
                    f"caller's to insert: {owner or 'nobody'} holds it"
                )

    # ------------------------------------------------------------------ L3 lookup

    def _start_prefetch(
        self, data: bytes, namespace: Namespace, match: MatchResult
    ) -> PrefetchOp | None:
        """Look past the match in L3 and start fetching the L3 part of the prefix into L2.

        Returns the op this request should wait for (its own, or one already running for
        the same pages), or None when L3 has nothing for it.
        """
        if not self._executor.has_l3 or not self._host.num_pages:
            return None
        for run in match.l3_nodes:
            if isinstance(run.meta, PrefetchOp):
                return run.meta  # another request is fetching these pages already
        total_pages = len(data) // 4 // self.page_size
        unmatched = total_pages - match.matched_pages
        if match.num_l3_pages + unmatched < self._policy.prefetch_min_pages:
            return None
        found = 0
        if unmatched:
            keys = self._tree.match_prefix(
                data, namespace, remainder_keys=True, touch=False
            ).remainder_keys
            began = self._executor.now()
            found = self._executor.l3_exists(keys, self.config.l3.exists_timeout_s)
            self._rates.record_lookup(self._executor.now() - began)
            if found:
                self._tree.insert_l3(data, namespace, num_pages=match.matched_pages + found)
        num_pages = self._pages_worth_fetching(data, match, match.num_l3_pages + found)
        if num_pages < self._policy.prefetch_min_pages:
            return None
        current = self._tree.match_prefix(data, namespace, touch=False)
        tail = self._l3_cut(current.l3_nodes, num_pages)
        op = self._submit_prefetch(tail) if tail is not None else None
        self._trim_l3_index()
        return op

    def _pages_worth_fetching(self, data: bytes, match: MatchResult, num_l3_pages: int) -> int:
        """How many of the L3 pages past the L1/L2 hit to fetch: all (`always`), or the
        leading part that beats recomputing them (`measured`: `fetch_plan`)."""
        if self._policy.l3_fetch_policy == "always" or not num_l3_pages:
            return num_l3_pages
        hit_pages = match.matched_pages - match.num_l3_pages
        run = RunToFetch(
            hit_tokens=hit_pages * self.page_size,
            num_pages=num_l3_pages,
            page_size=self.page_size,
            page_bytes=self.layout.bytes_per_page,
            total_tokens=len(data) // 4,
            batch_pages=self.config.l3.pages_per_read(self.layout.bytes_per_page),
        )
        return self._rates.plan(run).num_pages

    def _l3_cut(self, l3_nodes: list[Node], num_pages: int) -> Node | None:
        """The L3 run ending the first `num_pages` L3 pages of a path (a run split there)."""
        for node in l3_nodes:
            if node.num_pages >= num_pages:
                return self._tree.split(node, num_pages) if node.num_pages > num_pages else node
            num_pages -= node.num_pages
        return l3_nodes[-1] if l3_nodes else None

    def _l3_index_limit(self) -> int:
        """L3-only pages the index may keep: the configured number, else as many pages as
        the backend says it can hold, else a million. Past it the index forgets the least
        recently used (a lookup past a match finds them again if L3 still has them)."""
        if self.config.l3.max_indexed_pages:
            return self.config.l3.max_indexed_pages
        capacity = self._executor.l3_capacity_pages()
        return capacity if capacity else 1 << 20

    def _trim_l3_index(self) -> None:
        excess = self._tree.num_pages_at_level(Tier.L3) - self._max_l3_pages
        if excess > 0 and self._max_l3_pages:
            self._tree.forget_l3(excess)

    def _check_background(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise BackgroundTransferError(
                f"a background transfer failed (its pages were dropped): {error!r}"
            ) from error


def _request_tokens(tokens, namespace) -> bytes:
    """A request's tokens in the index encoding, once its namespace has been checked."""
    if not isinstance(namespace, Namespace):
        raise TypeError(
            f"namespace must be a radix.keys.Namespace (model, layout, tenant), got {namespace!r}"
        )
    return encode_tokens(tokens)


def _check_ownership(tier: Tier, pool, mapped: list[int], ops: set[str]) -> None:
    """Page by page: the index maps exactly the pages the index owns; ops own only while
    in flight; everything else is a request's or free."""
    if isinstance(pool, _NoPool):
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
        if owner not in (None, INDEX, REQUEST) and owner not in ops:
            raise HiCacheError(f"{tier.name} page {page} is owned by {owner}, not in flight")


__all__ = ["CachedPrefix", "HiCache", "Match", "PoolExhaustedError"]
