"""`HiCache`: the one object an engine talks to.

It owns the radix index, the page accounting of L1 and L2, and the policies (write,
L2->L3, prefetch, eviction). It decides what moves where and describes each move as a
transfer op (`hicache.ops`); an executor carries the ops out. The real executor moves
bytes with the tiers' kernels and the storage backends; the simulator's advances a
virtual clock. Everything in this module is torch-free, so both run the same policy code.

Bookkeeping rules:
- Residency is recorded when an op is *submitted* for copies out of a run (backup to L2),
  and when the bytes have *arrived* for copies into a run (prefetch into L2). A run with an
  op in flight is locked by that op until it completes, so neither side of a copy can be
  evicted or reused while it runs.
- Pages moving into L1 (a LOAD) are recorded as L1 pages at once; the run's `meta` holds
  the LOAD until it completes, and every match that uses the run waits on it per layer.
- An op names its run by the run's deepest node and its page count: a match may split the
  run while the op is in flight, and the pieces are the node and its ancestors.

Thread safety: every public method takes the cache's lock, except `wait_layer`, and the
lock is let go while a match waits for an L3 prefetch.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import NamedTuple

from hicache.config import HiCacheConfig
from hicache.errors import BackgroundTransferError, HiCacheError
from hicache.metrics import HiCacheStats, Metrics
from hicache.ops import (
    BackupOp,
    Executor,
    LoadOp,
    OpKind,
    PrefetchOp,
    TransferOp,
    WriteL3Op,
)
from radix.keys import Namespace, encode_tokens
from radix.node import Node, Tier
from radix.tree import DEFAULT_NAMESPACE, MatchResult, RadixTree
from tiers.allocator import PageAllocator
from tiers.errors import PoolExhaustedError

logger = logging.getLogger(__name__)

_LANDED_FROM_L3 = "landed from L3"  # a run's meta: in L2 by prefetch, not yet used by a match

_DIRECTION = {
    OpKind.BACKUP: "l1_to_l2",
    OpKind.LOAD: "l2_to_l1",
    OpKind.WRITE_L3: "l2_to_l3",
    OpKind.PREFETCH: "l3_to_l2",
}


@dataclass(eq=False)
class Match:
    """A request's cached prefix, locked until `HiCache.release(match)`.

    `device_page_ids` hold the first `num_tokens` tokens' KV in L1. Pages that came from
    L2 or L3 may still be loading: call `HiCache.wait_layer(match, i)` before reading
    layer i. The engine must not write to these pages.
    """

    namespace: Namespace
    num_tokens: int
    device_page_ids: list[int]
    num_l1_pages: int  # already in L1
    num_l2_pages: int  # loaded from L2 for this match
    num_l3_pages: int  # fetched from L3 (through L2) for this match
    _node: Node | None = field(default=None, repr=False)
    _loads: list[LoadOp] = field(default_factory=list, repr=False)
    released: bool = False

    @property
    def num_pages(self) -> int:
        return len(self.device_page_ids)


class CachedPrefix(NamedTuple):
    """Pages of a prompt's prefix held in each tier (the fastest one that holds each)."""

    num_l1_pages: int
    num_l2_pages: int
    num_l3_pages: int


@dataclass(eq=False)
class _Run:
    """The run an op works on: its deepest node and its page count (see module doc)."""

    tail: Node
    num_pages: int
    applied: int = 0  # prefetch: leading pages already recorded as in L2
    chain_l3: bool = True  # backup: write the run on to L3 when done (on_backup policy)


class _NoPool:
    """The L2 allocator of a cache configured without L2: it never has a page."""

    num_pages = num_free = num_used = 0

    def alloc(self, num_pages: int) -> list[int]:
        raise PoolExhaustedError("L2", num_pages, 0, 0)

    def free(self, page_ids) -> None:
        if list(page_ids):
            raise HiCacheError("freeing L2 pages in a cache without L2")

    def check_invariants(self) -> None:
        pass


class HiCache:
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
        self._error: BaseException | None = None
        self._metrics = Metrics()
        self._policy = config.policy
        if config.l3.url:
            executor.attach_l3(config.l3.url)

    # ------------------------------------------------------------------ engine API

    @property
    def executor(self) -> Executor:
        return self._executor

    def match(self, tokens, namespace: Namespace | None = None) -> Match:
        """The longest cached prefix of `tokens`, ready for the engine to attend over.

        L1 pages are usable at once; L2 pages are loaded into fresh L1 pages layer by layer
        (`wait_layer`); pages only in L3 are prefetched into L2 and loaded in turn, waiting
        as the prefetch policy says. L3 trouble (down, slow, corrupt pages) makes the match
        shorter; it never raises. The result is locked until `release`.
        """
        namespace = namespace or DEFAULT_NAMESPACE
        data = encode_tokens(tokens)
        with self._lock:
            self._check_background()
            self._apply_completions()
            first = self._tree.match_prefix(data, namespace)
            self._metrics.requests += 1
            self._metrics.requested_tokens += len(data) // 4 // self.page_size * self.page_size
            prefetch = self._start_prefetch(data, namespace, first)
        if prefetch is not None:
            self._wait_prefetch(prefetch)
        with self._lock:
            self._apply_completions()
            if prefetch is not None and not prefetch.done:
                self._metrics.prefetches_cut_short += 1
            return self._finish_match(data, namespace)

    def prefetch(self, tokens, namespace: Namespace | None = None) -> int:
        """Start fetching the L3 part of `tokens`' prefix into L2, without waiting.

        For a scheduler to call when a request is queued, so that by the time it runs
        (`match`) its pages have arrived. Returns the number of pages being fetched.
        """
        namespace = namespace or DEFAULT_NAMESPACE
        data = encode_tokens(tokens)
        with self._lock:
            self._check_background()
            self._apply_completions()
            first = self._tree.match_prefix(data, namespace, touch=False)
            op = self._start_prefetch(data, namespace, first)
            return op.num_pages if op is not None else 0

    def cached_prefix(self, tokens, namespace: Namespace | None = None) -> CachedPrefix:
        """How much of `tokens`' prefix each tier holds, by the index alone.

        Changes nothing a match would: no eviction order, no hit, no transfer, no lock.
        For a router choosing the instance with the longest cached prefix.
        """
        data = encode_tokens(tokens)
        with self._lock:
            found = self._tree.match_prefix(data, namespace or DEFAULT_NAMESPACE, touch=False)
            return CachedPrefix(found.num_l1_pages, found.num_l2_pages, found.num_l3_pages)

    def poll(self) -> None:
        """Apply the transfers that finished since the last call (never blocks).

        Every other call does this too; an idle owner calls it to let backups reach L3.
        """
        with self._lock:
            self._check_background()
            self._apply_completions()

    def pages_in_use(self, tier: str) -> int:
        """Pages allocated in "l1" or "l2" (cached or held by requests)."""
        pools = {"l1": self._device, "l2": self._host}
        if tier not in pools:
            raise ValueError(f"tier must be 'l1' or 'l2', got {tier!r}")
        with self._lock:
            return pools[tier].num_used

    def wait_layer(self, match: Match, layer: int) -> None:
        """Block until layer `layer` of every page `match` loads is in L1."""
        for load in match._loads:
            self._executor.wait_layer(load, layer)

    def insert(self, tokens, device_page_ids, namespace: Namespace | None = None) -> int:
        """Hand a request's full pages to the cache; returns how many pages were new.

        `device_page_ids[i]` holds page i of `tokens` (ids beyond the full pages stay the
        caller's). Pages the cache already held are freed here, so the caller never frees
        any of the full pages' ids afterwards. The write policy then schedules backups.
        """
        namespace = namespace or DEFAULT_NAMESPACE
        data = encode_tokens(tokens)
        with self._lock:
            self._check_background()
            self._apply_completions()
            result = self._tree.insert(data, device_page_ids, namespace)
            if result.duplicate_device_page_ids:
                self._device.free(result.duplicate_device_page_ids)
            self._metrics.inserted_pages += result.num_new_pages
            self._metrics.duplicate_pages += len(result.duplicate_device_page_ids)
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
            return self._device.alloc(num_pages)

    def free_device_pages(self, device_page_ids) -> None:
        """Give back L1 pages the caller allocated and did not insert."""
        with self._lock:
            self._device.free(device_page_ids)

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

    def detach_l3(self) -> None:
        """Stop using L3 (waits for in-flight transfers); the index forgets L3 copies."""
        with self._lock:
            self._drain()
            self._executor.attach_l3(None)
            self._tree.forget_all_l3()

    def close(self) -> None:
        with self._lock:
            try:
                self._drain()
            finally:
                self._executor.close()

    def check_invariants(self) -> None:
        """The index's invariants, plus: the pools account for every page the index holds."""
        with self._lock:
            self._tree.check_invariants()
            self._device.check_invariants()
            self._host.check_invariants()
            for tier, pool in ((Tier.L1, self._device), (Tier.L2, self._host)):
                if self._tree.num_pages(tier) > pool.num_used:
                    raise HiCacheError(
                        f"the index holds {self._tree.num_pages(tier)} {tier.name} pages, "
                        f"the pool has only {pool.num_used} in use"
                    )

    # ------------------------------------------------------------------ match internals

    def _finish_match(self, data: bytes, namespace: Namespace) -> Match:
        """Load the L2 part of the (now current) match into L1, lock it, count the hits."""
        current = self._tree.match_prefix(data, namespace, touch=False)
        # Where each page comes from: L1 as is; L2; or L3, for pages a prefetch landed.
        from_l3 = [run.num_pages for run in current.l2_nodes if run.meta is _LANDED_FROM_L3]
        usable = current.l1_nodes + current.l2_nodes
        if current.l2_nodes:
            loaded = self._load_into_l1(current.l2_nodes)
            usable = current.l1_nodes + loaded
        device_ids = [page for node in usable for page in node.device_page_ids]
        node = usable[-1] if usable else None
        if node is not None:
            self._tree.lock(node)
        loads = []
        for run in usable:
            if isinstance(run.meta, LoadOp) and run.meta not in loads:
                loads.append(run.meta)
        num_l1 = current.num_l1_pages
        num_l3 = min(sum(from_l3), len(device_ids) - num_l1)
        num_l2 = len(device_ids) - num_l1 - num_l3
        for tier, pages in (("l1", num_l1), ("l2", num_l2), ("l3", num_l3)):
            self._metrics.record_hit(tier, pages, self.page_size)
        if self._policy.write_policy == "write_through_selective" and self._host.num_pages:
            for run in current.l1_nodes:
                if (
                    run.host_page_ids is None
                    and run.hit_count >= self._policy.write_through_threshold
                ):
                    self._backup(run)
        return Match(
            namespace=namespace,
            num_tokens=len(device_ids) * self.page_size,
            device_page_ids=device_ids,
            num_l1_pages=num_l1,
            num_l2_pages=num_l2,
            num_l3_pages=num_l3,
            _node=node,
            _loads=loads,
        )

    def _fit_runs(self, runs: list[Node], tier: Tier) -> list[Node]:
        """Make room in `tier` for a chain of runs; return the leading runs that fit (the
        last one cut to what fits). The chain is locked meanwhile: eviction must not take it.
        """
        pool = self._device if tier == Tier.L1 else self._host
        self._tree.lock(runs[-1])
        try:
            wanted = sum(run.num_pages for run in runs)
            self._make_room(tier, wanted)
            available = min(wanted, pool.num_free)
        finally:
            self._tree.unlock(runs[-1])
        fitting: list[Node] = []
        for run in runs:
            if available <= 0:
                break
            if run.num_pages > available:
                run = self._tree.split(run, available)  # the first half: what fits
            fitting.append(run)
            available -= run.num_pages
        return fitting

    def _load_into_l1(self, l2_runs: list[Node]) -> list[Node]:
        """Give the L2 runs L1 pages and start loading them; returns the runs loaded."""
        loaded = self._fit_runs(l2_runs, Tier.L1)
        if not loaded:
            return []
        device_ids = self._device.alloc(sum(run.num_pages for run in loaded))
        host_ids = []
        offset = 0
        for run in loaded:
            self._tree.set_device(run, device_ids[offset : offset + run.num_pages])
            host_ids.extend(run.host_page_ids)
            offset += run.num_pages
        op = LoadOp(
            kind=OpKind.LOAD,
            num_pages=len(device_ids),
            num_bytes=len(device_ids) * self.layout.bytes_per_page,
            host_page_ids=host_ids,
            device_page_ids=device_ids,
        )
        for run in loaded:
            run.meta = op
        self._submit(op, loaded)
        return loaded

    # ------------------------------------------------------------------ L3 prefetch

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
            found = self._executor.l3_exists(keys, self.config.l3.exists_timeout_s)
            if found:
                self._tree.insert_l3(data, namespace, num_pages=match.matched_pages + found)
        num_pages = match.num_l3_pages + found
        if num_pages < self._policy.prefetch_min_pages:
            return None
        current = self._tree.match_prefix(data, namespace, touch=False)
        return self._submit_prefetch(current.l3_nodes)

    def _submit_prefetch(self, runs: list[Node]) -> PrefetchOp | None:
        chosen = self._fit_runs(runs, Tier.L2)
        if not chosen:
            self._metrics.writes_skipped += 1
            return None
        keys = [key for run in chosen for key in self._tree.keys(run)]
        host_ids = self._host.alloc(len(keys))
        op = PrefetchOp(
            kind=OpKind.PREFETCH,
            num_pages=len(keys),
            num_bytes=len(keys) * self.layout.bytes_per_page,
            keys=keys,
            host_page_ids=host_ids,
        )
        for run in chosen:
            run.meta = op
        self._metrics.prefetches_issued += 1
        self._submit(op, chosen)
        return op

    def _wait_prefetch(self, op: PrefetchOp) -> None:
        """Wait for an L3 prefetch as the policy says (the cache's lock is not held)."""
        policy = self._policy.prefetch_policy
        if policy == "best_effort":
            return
        if policy == "wait_complete":
            self._executor.wait(op, None)
            return
        budget = self._policy.prefetch_budget_s(op.num_pages * self.page_size)
        remaining = op.submitted_s + budget - self._executor.now()
        if remaining > 0:
            self._executor.wait(op, remaining)

    def _advance_prefetch(self, op: PrefetchOp) -> None:
        run: _Run = op.context
        ready = op.num_ready
        if ready <= run.applied:
            return
        pieces = self._pieces(run)
        offset = 0
        for piece in pieces:
            end = offset + piece.num_pages
            if end <= run.applied:
                offset = end
                continue
            if offset >= ready:
                break
            if end > ready:
                piece = self._tree.split(piece, ready - offset)
                end = ready
            self._tree.set_host(piece, op.host_page_ids[offset:end])
            self._tree.touch(piece)  # fetched for a request: not the first thing to evict
            piece.meta = _LANDED_FROM_L3
            offset = end
        run.applied = ready

    # ------------------------------------------------------------------ writes

    def _backup_path(self, node: Node) -> None:
        """Back up every run from `node` up that L2 does not hold yet (write-through)."""
        runs = []
        while node.num_pages and node.host_page_ids is None:
            runs.append(node)
            node = node.parent
        for run in reversed(runs):
            self._backup(run)

    def _backup(self, run: Node) -> BackupOp | None:
        """Copy one L1 run to L2 (allocating host pages, evicting L2 if needed)."""
        self._tree.lock(run)
        try:
            self._make_room(Tier.L2, run.num_pages)
        finally:
            self._tree.unlock(run)
        if self._host.num_free < run.num_pages:
            self._metrics.writes_skipped += 1
            return None
        host_ids = self._host.alloc(run.num_pages)
        self._tree.set_host(run, host_ids)
        op = BackupOp(
            kind=OpKind.BACKUP,
            num_pages=run.num_pages,
            num_bytes=run.num_pages * self.layout.bytes_per_page,
            device_page_ids=list(run.device_page_ids),
            host_page_ids=host_ids,
        )
        self._submit(op, [run])
        return op

    def _write_l3(self, runs: list[Node]) -> WriteL3Op | None:
        """Copy L2 runs (a contiguous chain, deepest last) to L3."""
        runs = [run for run in runs if not run.in_l3]
        if not runs or not self._executor.has_l3:
            return None
        keys = [key for run in runs for key in self._tree.keys(run)]
        op = WriteL3Op(
            kind=OpKind.WRITE_L3,
            num_pages=len(keys),
            num_bytes=len(keys) * self.layout.bytes_per_page,
            keys=keys,
            host_page_ids=[page for run in runs for page in run.host_page_ids],
        )
        self._submit(op, runs)
        return op

    # ------------------------------------------------------------------ eviction

    def _make_room(self, tier: Tier, num_pages: int) -> None:
        """Evict from `tier` until `num_pages` pages are free there, or nothing is left.

        L1: a run without an L2 copy is written back first under `write_back`. L2: a run
        without an L3 copy is written to L3 first when a backend is attached. Either way
        the write is waited for here: the room is needed now.
        """
        pool = self._device if tier == Tier.L1 else self._host
        kept: list[Node] = []
        while pool.num_free < num_pages:
            victim = self._tree.take_victim(tier, num_pages - pool.num_free)
            if victim is None and self._settle_one_write():
                continue  # a finished copy out of a run may have made it evictable
            if victim is None:
                break
            if victim in kept:
                continue  # a failed write-back's unlock made it a candidate again: it stays
            if tier == Tier.L1:
                freed = self._evict_from_l1(victim)
            else:
                freed = self._evict_from_l2(victim)
            if freed is None:
                kept.append(victim)
                continue
            pool.free(freed)
            self._metrics.evicted_pages[f"l{int(tier)}"] += len(freed)
        for victim in kept:
            self._tree.requeue(victim)

    def _evict_from_l1(self, victim: Node) -> list[int] | None:
        """Clear a victim's L1 copy, writing it back to L2 first under `write_back` or when
        runs below depend on it; None if it has to stay."""
        backed_up = victim.host_page_ids is not None
        if not backed_up and (
            self._policy.write_policy == "write_back" or not self._tree.can_clear(victim, Tier.L1)
        ):
            backed_up = self._write_back(victim)
        if not self._tree.can_clear(victim, Tier.L1):
            return None
        freed = self._tree.clear_device(victim)
        if backed_up and self.config.l3.write_policy == "on_backup":
            self._write_l3([victim])  # deferred: it pins the run, L1 copy included
        return freed

    def _evict_from_l2(self, victim: Node) -> list[int] | None:
        """Clear a victim's L2 copy, writing it to L3 first when a backend is attached."""
        if not victim.in_l3 and self._executor.has_l3:
            self._write_through_now(victim)
        if not self._tree.can_clear(victim, Tier.L2):
            return None
        return self._tree.clear_host(victim)

    def _settle_one_write(self) -> bool:
        """Wait for the oldest backup or L3 write in flight and apply it; False if none."""
        for op in self._inflight.values():
            if op.kind in (OpKind.BACKUP, OpKind.WRITE_L3):
                self._wait_and_apply(op)
                return True
        return False

    def _write_back(self, victim: Node) -> bool:
        """Back a victim up to L2 now (waiting for it); whether it worked."""
        if not self._host.num_pages:
            return False
        op = self._backup(victim)
        if op is None:
            return False
        op.context.chain_l3 = False
        self._wait_and_apply(op)
        return op.error is None

    def _write_through_now(self, victim: Node) -> None:
        op = self._write_l3([victim])
        if op is not None:
            self._wait_and_apply(op)

    def _wait_and_apply(self, op: TransferOp) -> None:
        self._executor.wait(op, None)
        self._apply_completions()
        if op.op_id in self._inflight:  # the executor has not handed it back yet
            del self._inflight[op.op_id]
            self._complete(op)

    # ------------------------------------------------------------------ op bookkeeping

    def _submit(self, op: TransferOp, runs: list[Node]) -> None:
        """Hand an op to the executor, holding its runs until it completes.

        Copies into runs (LOAD, PREFETCH) lock the path to the root: the runs above must
        stay for the new pages to be reachable. Copies out of runs (BACKUP, WRITE_L3) pin
        just those runs, so the pages above them stay evictable meanwhile.
        """
        op.context = _Run(tail=runs[-1], num_pages=op.num_pages)
        if op.kind in (OpKind.LOAD, OpKind.PREFETCH):
            self._tree.lock(runs[-1])
        else:
            for run in runs:
                self._tree.pin(run)
        op.submitted_s = self._executor.now()
        self._inflight[op.op_id] = op
        self._executor.submit(op)

    def _let_go(self, op: TransferOp, run: _Run) -> None:
        if op.kind in (OpKind.LOAD, OpKind.PREFETCH):
            self._tree.unlock(run.tail)
        else:
            for piece in self._pieces(run):
                self._tree.unpin(piece)

    def _pieces(self, run: _Run) -> list[Node]:
        """The nodes an op's run is made of now, first to last (splits add ancestors)."""
        pieces = []
        node, remaining = run.tail, run.num_pages
        while remaining > 0:
            pieces.append(node)
            remaining -= node.num_pages
            node = node.parent
        pieces.reverse()
        return pieces

    def _apply_completions(self) -> None:
        for op in self._executor.poll():
            if self._inflight.pop(op.op_id, None) is not None:
                self._complete(op)
        for op in list(self._inflight.values()):
            if isinstance(op, PrefetchOp):
                self._advance_prefetch(op)

    def _complete(self, op: TransferOp) -> None:
        run: _Run = op.context
        direction = _DIRECTION[op.kind]
        moved_pages = op.num_pages
        if op.error is not None:
            self._metrics.background_errors += 1
            if self._error is None:
                self._error = op.error
            logger.error("background %s failed: %r", op.kind.value, op.error)
        if isinstance(op, PrefetchOp):
            moved_pages = op.num_ready
            self._advance_prefetch(op)
        self._metrics.record_transfer(
            direction,
            moved_pages,
            moved_pages * self.layout.bytes_per_page,
            max(0.0, op.finished_s - op.submitted_s),
        )
        self._let_go(op, run)
        if isinstance(op, LoadOp):
            self._finish_load(op, run)
        elif isinstance(op, BackupOp):
            self._finish_backup(op, run)
        elif isinstance(op, WriteL3Op):
            self._finish_write_l3(op, run)
        else:
            self._finish_prefetch(op, run)

    def _finish_load(self, op: LoadOp, run: _Run) -> None:
        for piece in self._pieces(run):
            if piece.meta is op:
                piece.meta = None

    def _finish_backup(self, op: BackupOp, run: _Run) -> None:
        pieces = self._pieces(run)
        if op.error is not None:
            self._drop_failed_backup(pieces)
            return
        if run.chain_l3 and self._executor.has_l3 and self.config.l3.write_policy == "on_backup":
            self._write_l3(pieces)

    def _finish_write_l3(self, op: WriteL3Op, run: _Run) -> None:
        written = 0 if op.error is not None else op.num_written
        offset = 0
        for piece in self._pieces(run):
            if offset >= written:
                break
            if offset + piece.num_pages > written:
                piece = self._tree.split(piece, written - offset)
            self._tree.set_l3(piece)
            offset += piece.num_pages

    def _finish_prefetch(self, op: PrefetchOp, run: _Run) -> None:
        self._metrics.prefetches_completed += 1
        missing = op.num_pages - op.num_ready
        if not missing:
            return
        # Pages L3 promised but did not deliver: their host pages go back, and the index
        # stops believing L3 holds them (where nothing else holds them open).
        self._metrics.prefetch_pages_missing += missing
        self._host.free(op.host_page_ids[op.num_ready :])
        pieces = [p for p in self._pieces(run) if p.meta is op]
        for piece in reversed(pieces):
            piece.meta = None
            if not piece.children and not piece.lock_ref and piece.level == Tier.L3:
                self._tree.clear_l3(piece)

    def _drop_failed_backup(self, pieces: list[Node]) -> None:
        """A backup failed: its host pages hold garbage, so the runs lose their L2 copy."""
        for piece in reversed(pieces):
            if piece.lock_ref or piece.children_at_level[Tier.L2]:
                continue  # in use, or below it hangs L2 data: leave it (and the pages)
            self._host.free(self._tree.clear_host(piece))

    def _drain(self) -> None:
        """Wait for every op in flight and apply it."""
        while self._inflight:
            for op in list(self._inflight.values()):
                self._executor.wait(op, None)
            self._apply_completions()

    def _check_background(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise BackgroundTransferError(
                f"a background transfer failed (its pages were dropped): {error!r}"
            ) from error


__all__ = ["CachedPrefix", "HiCache", "Match", "PoolExhaustedError"]
