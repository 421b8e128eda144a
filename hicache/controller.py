"""`HiCache`: the one object an engine talks to.

It owns the radix index, the page accounting of L1 and L2, the lock, and the policies
(write, L2->L3, prefetch, eviction), and it runs the match: which runs of the index a
request uses, what to look up and fetch from L3, what to wait for (those steps, past the
index lookup, are `MatchSteps`', in `hicache.match_steps`, which `HiCache` inherits). The
moving itself is its `PageMover`'s (`hicache.mover`): fitting runs into a tier, making room,
submitting transfer ops (`hicache.ops`) and applying their completions. An executor carries
the ops out: the real one moves bytes with the tiers' kernels and the storage backends; the
simulator's advances a virtual clock. Everything here is torch-free, so both run the same
policy code.

A match holds its node: the lookup from the root runs once per request, and every later
step of it (the L3 lookup past the match, loading each landed read batch, locking what it
hands out) walks up from the deepest node of the request's path (`RadixTree.held_end`).

Thread safety: every public method takes the cache's lock, except `wait_layer`, and the
lock is let go while a match waits for an L3 prefetch.
"""

from __future__ import annotations

import threading

from hicache.config import HiCacheConfig
from hicache.errors import BackgroundTransferError, HiCacheError
from hicache.fetch_plan import FetchRates, FetchRatesSnapshot
from hicache.match import CachedPrefix, Landed, Match
from hicache.match_steps import MatchSteps
from hicache.metrics import HiCacheStats, Metrics
from hicache.mover import PageMover
from hicache.ops import Executor, PrefetchOp
from hicache.ownership import INDEX, REQUEST, NoPool, check_ownership
from radix.keys import Namespace, encode_tokens
from radix.node import Node, Tier
from radix.tree import RadixTree
from tiers.allocator import PageAllocator
from tiers.errors import PageIdError, PoolExhaustedError


class HiCache(MatchSteps):
    """Tiered KV cache controller: the public API, the lock, the match (module doc)."""

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
            else NoPool()
        )
        self._lock = threading.RLock()
        self._metrics = Metrics()
        self._policy = config.policy
        self._rates = FetchRates(
            l3_read_prior_bytes_per_s=config.policy.l3_read_prior_bytes_per_s,
            l2_load_prior_bytes_per_s=config.policy.l2_load_prior_bytes_per_s,
            l3_latency_prior_s=config.policy.l3_latency_prior_s,
        )
        self._store_probe: PrefetchOp | None = None  # a read measuring L3 (`_probe_store`)
        self._probe_waiting: Node | None = None  # its run, until the engine's next step
        link = executor.link_sample()
        if link is not None:
            self._rates.record_load(*link)
        self._mover = PageMover(
            config, executor, self._tree, self._device, self._host, self._metrics, self._rates
        )
        if config.l3.url:
            executor.attach_l3(config.l3.url)
            self._mover.max_l3_pages = self._l3_index_limit()

    # ------------------------------------------------------------------ engine API

    @property
    def executor(self) -> Executor:
        return self._executor

    def match(
        self,
        tokens,
        namespace: Namespace,
        *,
        priority: int = 0,
        record: bool = True,
        whole: bool = False,
        ask_l3: bool = True,
    ) -> Match:
        """The longest cached prefix of `tokens`, ready for the engine to attend over.

        L1 pages are usable at once; L2 pages are loaded into fresh L1 pages layer by layer
        (`wait_layer`); pages only in L3 are prefetched into L2, as much of the run as beats
        recomputing it (`PolicyConfig.l3_fetch_policy`), each read batch loaded on into L1
        as soon as it lands, waiting as the prefetch policy says. L3 trouble (down, slow,
        corrupt pages) makes the match shorter; it never raises. The result is locked until
        `release`. `priority` is the request's (the `priority` eviction policy keeps
        high-priority runs longest). `record=False`: not a request of its own (an engine's
        look at a sidecar, engine/sidecar.py), so not counted in the request and hit stats.
        `whole`: only all of it is of use (a sidecar), so its L2 part is loaded and the L3
        part found is fetched whole, not as much as beats recomputing them, and waited for
        (`wait_complete`). `ask_l3=False`: the pages past the index are not looked up in L3
        (the caller asked about this request a moment ago, with `prefetch` or an earlier
        match, and L3's answer stands: what it held is indexed); L3 pages the index knows
        are fetched as ever.
        """
        data = _request_tokens(tokens, namespace)
        with self._lock:
            self._check_background()
            self._mover.apply_completions()
            first = self._tree.match_prefix(data, namespace)
            if record:
                self._metrics.requests += 1
                num_tokens = len(data) // 4 // self.page_size * self.page_size
                self._metrics.requested_tokens += num_tokens
            end, prefetch = self._start_prefetch(data, first, fetch_all=whole, ask_l3=ask_l3)
        landed = Landed()
        if prefetch is not None:
            landed = self._wait_prefetch(prefetch, end, wait_all=whole)
        with self._lock:
            try:
                self._mover.apply_completions()
                if prefetch is not None and not prefetch.done:
                    self._metrics.prefetches_cut_short += 1
                return self._finish_match(
                    end, namespace, priority, landed, len(data) // 4, record=record, whole=whole
                )
            finally:
                landed.let_go(self._tree)

    def shorten(self, match: Match, num_tokens: int) -> Match | None:
        """The first `num_tokens` (whole pages, fewer than `match` holds) of a held match as
        a match of its own, locked; `match` is released. None for 0 tokens. For an engine
        that finds part of the KV a hit needs missing past a shorter boundary (an
        interleaved model's sidecar, engine/sidecar.py): the hit stats count the shorter
        match, and the tokens cut in `shortened_tokens`."""
        num_pages = num_tokens // self.page_size
        if num_tokens % self.page_size or not 0 <= num_pages < match.num_pages:
            raise ValueError(
                f"shorten: {num_tokens} tokens is not whole pages below the match's "
                f"{match.num_tokens}"
            )
        with self._lock:
            if match.released:
                raise HiCacheError("shorten: this match was already released")
            node = self._node_at(match._node, num_pages) if num_pages else None
            if node is not None:
                self._tree.lock(node)
            self.release(match)
            counts = {}
            left = num_pages
            for tier, pages in (
                ("l1", match.num_l1_pages),
                ("l2", match.num_l2_pages),
                ("l3", match.num_l3_pages),
            ):
                counts[tier] = min(pages, left)
                left -= counts[tier]
                self._metrics.record_hit(tier, counts[tier] - pages, self.page_size)
            self._metrics.shortened_tokens += match.num_tokens - num_tokens
            if node is None:
                return None
            return Match(
                namespace=match.namespace,
                num_tokens=num_tokens,
                num_pages=num_pages,
                num_l1_pages=counts["l1"],
                num_l2_pages=counts["l2"],
                num_l3_pages=counts["l3"],
                _node=node,
                _loads=list(match._loads),
            )

    def _node_at(self, end: Node, num_pages: int) -> Node:
        """The run ending `num_pages` pages into the path of `end` (split there)."""
        depth = 0
        for run in RadixTree.path(end):
            if depth + run.num_pages == num_pages:
                return run
            if depth + run.num_pages > num_pages:
                return self._tree.split(run, num_pages - depth)
            depth += run.num_pages
        raise HiCacheError(f"the match holds fewer than {num_pages} pages")

    def branch_depths(self, tokens, namespace: Namespace, first_pages) -> list[int]:
        """Where, along the indexed prefix of `tokens`, a run whose first page is one of
        `first_pages` (each page_size token ids) branches off, in pages from the start,
        ascending, by the index alone (any tier; L3 copies the index has not heard of are
        not found). Changes nothing a match would. For an engine's sidecars
        (engine/sidecar.py)."""
        data = _request_tokens(tokens, namespace)
        pages = {encode_tokens(page) for page in first_pages}
        if any(len(page) != 4 * self.page_size for page in pages):
            raise ValueError(f"first_pages must be pages of {self.page_size} token ids")
        with self._lock:
            found = self._tree.match_prefix(data, namespace, touch=False)
            depths, depth = [], 0
            for run in RadixTree.path(found.last_node):
                depth += run.num_pages
                if not pages.isdisjoint(run.children):
                    depths.append(depth)
            return depths

    def held_device_pages(self, tokens, namespace: Namespace) -> list[int]:
        """The L1 page ids the index maps for the leading pages of `tokens` now, as far as
        they are in L1: what an `insert` that extends a cached prefix passes for it. Valid
        until the next call that can evict (under the caller's own single thread)."""
        data = _request_tokens(tokens, namespace)
        with self._lock:
            return self._tree.match_prefix(data, namespace, touch=False).device_page_ids

    def prefetch(self, tokens, namespace: Namespace) -> int:
        """Start fetching the L3 part of `tokens`' prefix into L2, without waiting.

        For a scheduler to call when a request is queued, so that by the time it runs
        (`match`) its pages have arrived. Returns the number of pages being fetched.
        """
        data = _request_tokens(tokens, namespace)
        with self._lock:
            self._check_background()
            self._mover.apply_completions()
            first = self._tree.match_prefix(data, namespace, touch=False)
            _, op = self._start_prefetch(data, first)
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
        """From now on, tell `listener` (a `radix.residency.ResidencyListener`, such as
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
            self._mover.apply_completions()

    def record_compute(self, num_rows: int, num_pairs: int, seconds: float) -> None:
        """The engine reports one step it ran without waiting for a load: `num_rows` rows
        through the model, `num_pairs` (row, attended position) pairs of attention
        (`fetch_plan.attention_pairs`), `seconds` of wall time. The compute rate the
        load-or-recompute choice weighs L3 reads against is fitted to these."""
        with self._lock:
            self._rates.record_compute(num_rows, num_pairs, seconds)
            self._start_waiting_probe()

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
            self._mover.apply_completions()
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
                self._mover.backup_path(result.last_node)
            return result.num_new_pages

    def release(self, match: Match) -> None:
        """Unlock a match's pages; they become evictable again."""
        with self._lock:
            if match.released:
                raise HiCacheError("this match was already released")
            match.released = True
            if match._node is not None:
                self._tree.unlock(match._node)
            self._mover.apply_completions()

    def alloc_device_pages(self, num_pages: int) -> list[int]:
        """L1 pages for a request's new KV, evicting cached pages as needed.

        Raises PoolExhaustedError when not enough pages can be freed (all are locked).
        """
        with self._lock:
            self._check_background()
            self._mover.apply_completions()
            self._mover.make_room(Tier.L1, num_pages)
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
            self._mover.apply_completions()
            before = pool.num_free
            self._mover.make_room(level, pool.num_free + num_pages)
            return pool.num_free - before

    @property
    def device_pool(self):
        """The L1 pool's tensors (`tiers.DevicePool`), for the engine's attention."""
        return self._executor.device_pool

    def flush(self, timeout_s: float | None = None) -> None:
        """Wait until every backup and L3 write submitted so far has finished."""
        with self._lock:
            self._mover.flush(timeout_s)

    def stats(self) -> HiCacheStats:
        with self._lock:
            self._mover.apply_completions()
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
            self._mover.drain()
            self._executor.attach_l3(url)
            self._mover.max_l3_pages = self._l3_index_limit()

    def detach_l3(self) -> None:
        """Stop using L3 (waits for in-flight transfers); the index forgets L3 copies.

        Matches may be held meanwhile: the pages they use stay where they are.
        """
        with self._lock:
            self._mover.drain()
            self._tree.forget_all_l3()
            self._executor.attach_l3(None)
            self._mover.max_l3_pages = 0

    def close(self) -> None:
        with self._lock:
            try:
                self._mover.drain()
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
            check_ownership(self._tree, self._device, self._host, self._mover.owners_in_flight())

    # ------------------------------------------------------------------ internals

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

    def _l3_index_limit(self) -> int:
        """L3-only pages the index may keep: the configured number, else as many pages as
        the backend says it can hold, else a million. Past it the index forgets the least
        recently used (a lookup past a match finds them again if L3 still has them)."""
        if self.config.l3.max_indexed_pages:
            return self.config.l3.max_indexed_pages
        capacity = self._executor.l3_capacity_pages()
        return capacity if capacity else 1 << 20

    def _check_background(self) -> None:
        error = self._mover.take_error()
        if error is not None:
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


__all__ = ["CachedPrefix", "HiCache", "Match", "PoolExhaustedError"]
