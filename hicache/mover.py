"""`PageMover`: how the controller moves pages between tiers. `HiCache` owns one.

It fits runs of the index into a faster tier, makes room there (evicting, writing back
first where the policy says), submits the transfer ops (`hicache.ops`) to the executor, and
applies their completions to the index. `HiCache` decides *which* runs a request uses and
keeps the lock, the public API and the match; the mover never calls back into it. Its op
bookkeeping (submitting an op, holding its runs, applying its completion) is in
`hicache.bookkeeping` (`OpBookkeeping`, which `PageMover` inherits).

What it owns: the ops in flight, the runs a failed load left wrong, the first background
failure (until `take_error`), and how many L3-only pages the index keeps. What it works on,
given at construction and owned by `HiCache`: the radix tree, the L1 and L2 allocators, the
executor, the metrics and the measured rates. Every method is called with the cache's lock
held; the mover never takes it, and a method that waits (`make_room`, `drain`, `flush`)
waits holding it.

Bookkeeping rules:
- A copy *out of* a run (backup to L2, write to L3) records the new copy when it is
  submitted (an L2 copy) or when it is acknowledged (an L3 copy), and pins the run until
  it completes: the run can't be evicted from any tier meanwhile, while the runs above it
  stay evictable.
- A copy *into* a run records it when the bytes have arrived (a prefetch into L2, chunk by
  chunk) or, for a load into L1, at once, with the run's state (`RunState`, in `Node.meta`)
  naming the load until it completes: every match that uses the run waits on it layer by
  layer. Copies into runs lock the whole path, so the runs above stay where the new pages
  need them.
- An op names its run by the run's deepest node and its page count (`OpRun`): a match may
  split the run while the op is in flight, and the pieces are the node and its ancestors.
- Completions are applied only on the caller's thread, in `apply_completions`.

Torch-free: the simulator runs this code with its virtual-time executor.
"""

from __future__ import annotations

from typing import NamedTuple

from hicache.bookkeeping import OpBookkeeping
from hicache.config import HiCacheConfig
from hicache.errors import HiCacheError
from hicache.fetch_plan import FetchRates
from hicache.metrics import Metrics
from hicache.ops import (
    LANDED_FROM_L3,
    BackupOp,
    Executor,
    LoadOp,
    OpKind,
    PrefetchOp,
    RunState,
    RunStatus,
    TransferOp,
    WriteL3Op,
    filling_op,
    status_of,
)
from hicache.ownership import INDEX, op_owner
from radix.node import Node, Tier
from radix.tree import RadixTree
from tiers.allocator import PageAllocator


def usable_prefix(runs: list[Node]) -> list[Node]:
    """The leading runs a match may hand out: a run a failed load left wrong, and every run
    below it, are not (they are dropped as soon as nothing holds them)."""
    for index, run in enumerate(runs):
        if status_of(run) is RunStatus.LOAD_FAILED:
            return runs[:index]
    return runs


class Loaded(NamedTuple):
    """What `load_into_l1` did: the run the caller holds now (the lock moves up when not
    all of the runs fit; None when nothing is left), the load (None if none), and how many
    of its pages a prefetch had brought from L3."""

    node: Node | None
    load: LoadOp | None
    num_from_l3: int


class PageMover(OpBookkeeping):
    """Fits runs into tiers, makes room, submits ops, applies completions (module doc).

    The interface `HiCache` calls, always holding its lock:
    - `load_into_l1(tail)`: the caller holds `tail` locked; the lock comes back moved to
      the run ending what it can use now (`Loaded`), never released for it.
    - `submit_prefetch(tail)`: fetch the L3-only runs ending the path to `tail` into L2;
      the op holds the path until it completes.
    - `backup(run)` / `backup_path(node)`: copy L1 runs to L2 (write policies).
    - `make_room(tier, num_pages)`: evict, waiting for the write-backs it starts.
    - `apply_completions()`: apply what the executor finished; never blocks.
    - `drain()`, `flush(timeout_s)`: wait for every op / every write in flight.
    - `take_error()`, `owners_in_flight()`, `trim_l3_index()`, `max_l3_pages`.
    All but `take_error` and `owners_in_flight` may split runs and drop or move the pages
    of runs nobody holds locked: a caller reads page ids off a locked node afterwards,
    never off a list of runs taken before. The mover never calls back into `HiCache`.
    """

    def __init__(
        self,
        config: HiCacheConfig,
        executor: Executor,
        tree: RadixTree,
        device: PageAllocator,
        host,  # a PageAllocator, or the controller's stand-in for "no L2"
        metrics: Metrics,
        rates: FetchRates,
    ) -> None:
        self._config = config
        self._policy = config.policy
        self._page_bytes = config.layout.bytes_per_page
        self._executor = executor
        self._tree = tree
        self._device = device
        self._host = host
        self._metrics = metrics
        self._rates = rates
        self._inflight: dict[int, TransferOp] = {}
        self._failed_loads: list[Node] = []  # runs whose L1 copy a failed load left wrong
        self._quarantined: list[int] = []  # L2 pages a timed-out L3 transfer may still write
        self._error: BaseException | None = None
        self.max_l3_pages = 0  # L3-only pages the index keeps (0: no L3 attached)

    # ------------------------------------------------------------------ state

    def take_error(self) -> BaseException | None:
        """The first background failure since the last call (then forgotten), or None."""
        error, self._error = self._error, None
        return error

    def owners_in_flight(self) -> set[str]:
        """The page owners (`op_owner`) of the ops in flight, for the ownership check."""
        return {op_owner(op) for op in self._inflight.values()}

    # ------------------------------------------------------------------ loads

    def _fit_chain(self, tail: Node, level: Tier) -> list[Node]:
        """Make room one tier above `level` for the runs at `level` that end the path to
        `tail` (locked by the caller); return the leading ones that fit, the last one cut
        to what fits. The chain is read off the path again after making room: making room
        applies finished ops, and a partial L3 write splits runs."""
        tier = Tier(level - 1)
        pool = self._device if tier == Tier.L1 else self._host
        wanted = sum(run.num_pages for run in RadixTree.trailing(tail, level))
        self.make_room(tier, wanted)
        available = min(wanted, pool.num_free)
        fitting: list[Node] = []
        for run in RadixTree.trailing(tail, level):
            if available <= 0:
                break
            if run.num_pages > available:
                run = self._tree.split(run, available)  # the first half: what fits
            fitting.append(run)
            available -= run.num_pages
        return fitting

    def _move_lock(self, old: Node, new: Node | None) -> Node | None:
        """Hold `new` (an ancestor of `old`, or None for nothing) instead of `old`."""
        if new is not old:
            if new is not None:
                self._tree.lock(new)
            self._tree.unlock(old)
        return new

    def load_into_l1(self, tail: Node) -> Loaded:
        """Load the L2 runs at the end of the path to `tail`, which the caller holds locked,
        into L1 (as many as fit), and move the caller's lock to the run ending the part it
        can use now (`Loaded`)."""
        if tail.level != Tier.L2:
            return Loaded(tail, None, 0)
        loaded = self._fit_chain(tail, Tier.L2)
        if not loaded:
            parent = RadixTree.trailing(tail, Tier.L2)[0].parent
            return Loaded(self._move_lock(tail, parent if parent.num_pages else None), None, 0)
        num_pages = sum(run.num_pages for run in loaded)
        from_l3 = sum(run.num_pages for run in loaded if status_of(run) is RunStatus.LANDED)
        device_ids = self._device.alloc(num_pages, INDEX)
        op = LoadOp(
            kind=OpKind.LOAD,
            num_pages=num_pages,
            num_bytes=num_pages * self._page_bytes,
            host_page_ids=[page for run in loaded for page in run.host_page_ids],
            device_page_ids=device_ids,
        )
        if not self._submit(op, loaded):
            self._device.free(device_ids, INDEX)
            parent = loaded[0].parent
            return Loaded(self._move_lock(tail, parent if parent.num_pages else None), None, 0)
        offset = 0
        state = RunState.loading(op)
        for run in loaded:
            self._tree.set_device(run, device_ids[offset : offset + run.num_pages])
            run.meta = state
            offset += run.num_pages
        return Loaded(self._move_lock(tail, loaded[-1]), op, from_l3)

    # ------------------------------------------------------------------ L3 prefetch

    def submit_prefetch(self, tail: Node) -> PrefetchOp | None:
        """Fetch the L3-only runs that end the path to `tail` into L2 (as many as fit)."""
        self._tree.lock(tail)
        try:
            chosen = self._fit_chain(tail, Tier.L3)
        finally:
            self._tree.unlock(tail)
        if not chosen:
            self._metrics.writes_skipped += 1
            return None
        keys = [key for run in chosen for key in self._tree.keys(run)]
        op = PrefetchOp(
            kind=OpKind.PREFETCH,
            num_pages=len(keys),
            num_bytes=len(keys) * self._page_bytes,
            keys=keys,
        )
        op.host_page_ids = self._host.alloc(len(keys), op_owner(op))
        if not self._submit(op, chosen):
            self._host.free(op.host_page_ids, op_owner(op))
            return None
        state = RunState.fetching(op)
        for run in chosen:
            run.meta = state
        self._metrics.prefetches_issued += 1
        return op

    def _advance_prefetch(self, op: PrefetchOp) -> None:
        """Record the pages of a prefetch that have landed in L2 (leading ones, verified).

        A run the engine has inserted meanwhile holds the prompt's pages in L1 and may
        have a write-through backup of its own by now: it keeps that, and the prefetch's
        copy of it goes back to the pool.
        """
        run = op.context
        ready = op.num_ready
        if ready <= run.num_applied:
            return
        offset = 0
        for piece in self._pieces(run):
            end = offset + piece.num_pages
            if end <= run.num_applied:
                offset = end
                continue
            if offset >= ready:
                break
            if end > ready:
                piece = self._tree.split(piece, ready - offset)
                end = ready
            landed = op.host_page_ids[offset:end]
            if piece.host_page_ids is None:
                self._host.give(landed, op_owner(op), INDEX)
                self._tree.set_host(piece, landed)
                self._tree.touch(piece)  # fetched for a request: not the first thing to evict
                if piece.level == Tier.L2:
                    piece.meta = LANDED_FROM_L3
            else:
                self._host.free(landed, op_owner(op))
            if filling_op(piece) is op:
                piece.meta = None
            offset = end
        run.num_applied = ready

    # ------------------------------------------------------------------ writes

    def backup_path(self, node: Node) -> None:
        """Back up every run on the path to `node` that L2 does not hold yet
        (write-through), top first. The path is locked meanwhile and read again after
        each backup, which may make room in L2."""
        self._tree.lock(node)
        try:
            tried: set[int] = set()
            while True:
                todo = [
                    run
                    for run in RadixTree.path(node)
                    if run.host_page_ids is None and id(run) not in tried
                ]
                if not todo:
                    return
                tried.add(id(todo[0]))
                self.backup(todo[0])
        finally:
            self._tree.unlock(node)

    def backup(self, run: Node) -> BackupOp | None:
        """Copy one L1 run to L2 (allocating host pages, evicting L2 if needed).

        A run a prefetch is filling from L3 is not backed up: that prefetch is its L2 copy.
        """
        if status_of(run) in (RunStatus.FETCHING, RunStatus.LOAD_FAILED):
            return None
        self._tree.lock(run)
        try:
            self.make_room(Tier.L2, run.num_pages)
        finally:
            self._tree.unlock(run)
        if self._host.num_free < run.num_pages or run.host_page_ids is not None:
            self._metrics.writes_skipped += 1
            return None
        host_ids = self._host.alloc(run.num_pages, INDEX)
        op = BackupOp(
            kind=OpKind.BACKUP,
            num_pages=run.num_pages,
            num_bytes=run.num_pages * self._page_bytes,
            device_page_ids=list(run.device_page_ids),
            host_page_ids=host_ids,
        )
        if not self._submit(op, [run]):
            self._host.free(host_ids, INDEX)
            return None
        self._tree.set_host(run, host_ids)
        return op

    def _write_l3(self, runs: list[Node]) -> WriteL3Op | None:
        """Copy L2 runs (a contiguous chain, deepest last) to L3: those not there yet, an
        op per contiguous stretch of them (an op names one chain). Returns the last op."""
        if not self._executor.has_l3:
            return None
        op = None
        stretch: list[Node] = []
        for run in [*runs, None]:
            if run is not None and not run.in_l3:
                stretch.append(run)
                continue
            if stretch:
                op = self._write_stretch(stretch) or op
                stretch = []
        return op

    def _write_stretch(self, runs: list[Node]) -> WriteL3Op | None:
        keys = [key for run in runs for key in self._tree.keys(run)]
        op = WriteL3Op(
            kind=OpKind.WRITE_L3,
            num_pages=len(keys),
            num_bytes=len(keys) * self._page_bytes,
            keys=keys,
            host_page_ids=[page for run in runs for page in run.host_page_ids],
        )
        return op if self._submit(op, runs) else None

    def trim_l3_index(self) -> None:
        """Forget the least recently used L3-only pages past `max_l3_pages` (a lookup past
        a match finds them again if L3 still has them)."""
        excess = self._tree.num_pages_at_level(Tier.L3) - self.max_l3_pages
        if excess > 0 and self.max_l3_pages:
            self._tree.forget_l3(excess)

    # ------------------------------------------------------------------ eviction

    def make_room(self, tier: Tier, num_pages: int) -> None:
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
            pool.free(freed, INDEX)
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
        if status_of(victim) is RunStatus.LOAD_FAILED:
            victim.meta = None
        freed = self._tree.clear_device(victim)
        if backed_up and self._config.l3.write_policy == "on_backup":
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
        op = self.backup(victim)
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
        self.apply_completions()
        if op.op_id in self._inflight:  # the executor has not handed it back yet
            del self._inflight[op.op_id]
            self._complete(op)

    # ------------------------------------------------------------------ waiting

    def drain(self) -> None:
        """Wait for every op in flight and apply it."""
        while self._inflight:
            for op in list(self._inflight.values()):
                self._executor.wait(op, None)
            self.apply_completions()

    def flush(self, timeout_s: float | None) -> None:
        """Wait until every backup and L3 write submitted so far has finished."""
        while True:
            self.apply_completions()
            writes = [
                op for op in self._inflight.values() if op.kind in (OpKind.BACKUP, OpKind.WRITE_L3)
            ]
            if not writes:
                return
            for op in writes:
                if not self._executor.wait(op, timeout_s):
                    raise HiCacheError(f"flush: a {op.kind.value} op is still running")
