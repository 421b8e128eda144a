"""How the controller moves pages: the transfer ops it submits, and what their completion
records in the index. A mixin of `HiCache`, kept apart so that the engine-facing API and
the match path (`hicache.controller`) read on their own.

Bookkeeping rules:
- A copy *out of* a run (backup to L2, write to L3) records the new copy when it is
  submitted (an L2 copy) or when it is acknowledged (an L3 copy), and pins the run until
  it completes: the run can't be evicted from any tier meanwhile, while the runs above it
  stay evictable.
- A copy *into* a run records it when the bytes have arrived (a prefetch into L2, chunk by
  chunk) or, for a load into L1, at once, with the run's `meta` holding the load until it
  completes: every match that uses the run waits on it layer by layer. Copies into runs
  lock the whole path, so the runs above stay where the new pages need them.
- An op names its run by the run's deepest node and its page count: a match may split the
  run while the op is in flight, and the pieces are the node and its ancestors.
- Completions are applied only on the caller's thread, in `_apply_completions`.

Torch-free: the simulator runs this code with its virtual-time executor.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from hicache.ops import (
    BackupOp,
    LoadOp,
    OpKind,
    PrefetchOp,
    TransferOp,
    WriteL3Op,
)
from radix.node import Node, Tier
from radix.tree import RadixTree

logger = logging.getLogger(__name__)

LANDED_FROM_L3 = "landed from L3"  # a run's meta: in L2 by prefetch, not yet used by a match
FAILED_LOAD = "failed load"  # a run's meta: its L1 copy is wrong (its load failed)
INDEX = "the index"  # the owner of the L1 / L2 pages the index maps (as in the controller)


def op_owner(op: TransferOp) -> str:
    """The owner of pages an op holds that the index does not map yet."""
    return f"{op.kind.value} op {op.op_id}"


_DIRECTION = {
    OpKind.BACKUP: "l1_to_l2",
    OpKind.LOAD: "l2_to_l1",
    OpKind.WRITE_L3: "l2_to_l3",
    OpKind.PREFETCH: "l3_to_l2",
}


@dataclass(eq=False)
class _Run:
    """The run an op works on: its deepest node and its page count (see module doc)."""

    tail: Node
    num_pages: int
    applied: int = 0  # prefetch: leading pages already recorded as in L2
    chain_l3: bool = True  # backup: write the run on to L3 when done (on_backup policy)


@dataclass(eq=False)
class Landed:
    """What a match loaded into L1 while its prefetch was still reading: the runs it holds
    locked meanwhile (let go once the match holds its own), and the pages it loaded."""

    held: list[Node] = field(default_factory=list)
    num_loaded: int = 0
    num_from_l3: int = 0

    def let_go(self, tree: RadixTree) -> None:
        for node in self.held:
            tree.unlock(node)
        self.held.clear()


class PageMovement:
    """Loads, prefetches, backups, L3 writes and eviction for `HiCache`.

    Uses the cache's `_tree`, `_device` / `_host` allocators, `_executor`, `_inflight`,
    `_metrics`, `_rates`, `_policy`, `config`, `layout` and `_error`; the caller holds the
    cache's lock.
    """

    # ------------------------------------------------------------------ loads

    def _fit_chain(self, tail: Node, level: Tier) -> list[Node]:
        """Make room one tier above `level` for the runs at `level` that end the path to
        `tail` (locked by the caller); return the leading ones that fit, the last one cut
        to what fits. The chain is read off the path again after making room: making room
        applies finished ops, and a partial L3 write splits runs."""
        tier = Tier(level - 1)
        pool = self._device if tier == Tier.L1 else self._host
        wanted = sum(run.num_pages for run in self._trailing(tail, level))
        self._make_room(tier, wanted)
        available = min(wanted, pool.num_free)
        fitting: list[Node] = []
        for run in self._trailing(tail, level):
            if available <= 0:
                break
            if run.num_pages > available:
                run = self._tree.split(run, available)  # the first half: what fits
            fitting.append(run)
            available -= run.num_pages
        return fitting

    @staticmethod
    def _trailing(tail: Node, level: Tier) -> list[Node]:
        """The runs at `level` that end the path to `tail`, first to last."""
        runs = []
        node = tail
        while node.num_pages and node.level == level:
            runs.append(node)
            node = node.parent
        runs.reverse()
        return runs

    def _move_lock(self, old: Node, new: Node | None) -> Node | None:
        """Hold `new` (an ancestor of `old`, or None for nothing) instead of `old`."""
        if new is not old:
            if new is not None:
                self._tree.lock(new)
            self._tree.unlock(old)
        return new

    def _load_into_l1(self, tail: Node) -> tuple[Node | None, LoadOp | None, int]:
        """Load the L2 runs at the end of the locked path to `tail` into L1.

        Returns the run the match holds now (the lock moves up when not all of them fit;
        None when nothing is left), the load (None if none), and how many of its pages a
        prefetch had brought from L3.
        """
        if tail.level != Tier.L2:
            return tail, None, 0
        loaded = self._fit_chain(tail, Tier.L2)
        if not loaded:
            parent = self._trailing(tail, Tier.L2)[0].parent
            return self._move_lock(tail, parent if parent.num_pages else None), None, 0
        num_pages = sum(run.num_pages for run in loaded)
        from_l3 = sum(run.num_pages for run in loaded if run.meta is LANDED_FROM_L3)
        device_ids = self._device.alloc(num_pages, INDEX)
        op = LoadOp(
            kind=OpKind.LOAD,
            num_pages=num_pages,
            num_bytes=num_pages * self.layout.bytes_per_page,
            host_page_ids=[page for run in loaded for page in run.host_page_ids],
            device_page_ids=device_ids,
        )
        if not self._submit(op, loaded):
            self._device.free(device_ids, INDEX)
            parent = loaded[0].parent
            return self._move_lock(tail, parent if parent.num_pages else None), None, 0
        offset = 0
        for run in loaded:
            self._tree.set_device(run, device_ids[offset : offset + run.num_pages])
            run.meta = op
            offset += run.num_pages
        return self._move_lock(tail, loaded[-1]), op, from_l3

    # ------------------------------------------------------------------ L3 prefetch

    def _submit_prefetch(self, tail: Node) -> PrefetchOp | None:
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
            num_bytes=len(keys) * self.layout.bytes_per_page,
            keys=keys,
        )
        op.host_page_ids = self._host.alloc(len(keys), op_owner(op))
        if not self._submit(op, chosen):
            self._host.free(op.host_page_ids, op_owner(op))
            return None
        for run in chosen:
            run.meta = op
        self._metrics.prefetches_issued += 1
        return op

    def _wait_prefetch(self, op: PrefetchOp, data: bytes, namespace) -> Landed:
        """Wait for an L3 prefetch as the policy says, the cache's lock not held, and load
        each part into L1 as soon as it lands in L2: the L2 -> L1 copy of one read batch
        overlaps the L3 read of the next (and the match's L2 pages go first, at once).

        Returns what was loaded meanwhile; its runs stay locked for the match (`Landed`).
        """
        landed = Landed()
        deadline = self._prefetch_deadline(op)
        seen = -1
        while True:
            with self._lock:
                self._apply_completions()
                if op.num_ready > seen:
                    seen = op.num_ready
                    self._load_landed(data, namespace, landed)
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

    def _load_landed(self, data: bytes, namespace, landed: Landed) -> None:
        """Start loading the L2 runs that end the request's usable prefix now into L1, and
        hold the run that ends the loaded part for the match (the caller holds the lock)."""
        current = self._tree.match_prefix(data, namespace, touch=False)
        usable = current.l1_nodes + current.l2_nodes
        usable = usable[: self._first_failed(usable)]
        if not usable or usable[-1].level != Tier.L2:
            return
        self._tree.lock(usable[-1])
        node, load, from_l3 = self._load_into_l1(usable[-1])
        if node is not None:
            landed.held.append(node)
        if load is not None:
            landed.num_loaded += load.num_pages
            landed.num_from_l3 += from_l3

    def _advance_prefetch(self, op: PrefetchOp) -> None:
        """Record the pages of a prefetch that have landed in L2 (leading ones, verified).

        A run the engine has inserted meanwhile holds the prompt's pages in L1 and may
        have a write-through backup of its own by now: it keeps that, and the prefetch's
        copy of it goes back to the pool.
        """
        run: _Run = op.context
        ready = op.num_ready
        if ready <= run.applied:
            return
        offset = 0
        for piece in self._pieces(run):
            end = offset + piece.num_pages
            if end <= run.applied:
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
            if piece.meta is op:
                piece.meta = None
            offset = end
        run.applied = ready

    # ------------------------------------------------------------------ writes

    def _backup_path(self, node: Node) -> None:
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
                self._backup(todo[0])
        finally:
            self._tree.unlock(node)

    def _backup(self, run: Node) -> BackupOp | None:
        """Copy one L1 run to L2 (allocating host pages, evicting L2 if needed).

        A run a prefetch is filling from L3 is not backed up: that prefetch is its L2 copy.
        """
        if isinstance(run.meta, PrefetchOp) or run.meta is FAILED_LOAD:
            return None
        self._tree.lock(run)
        try:
            self._make_room(Tier.L2, run.num_pages)
        finally:
            self._tree.unlock(run)
        if self._host.num_free < run.num_pages or run.host_page_ids is not None:
            self._metrics.writes_skipped += 1
            return None
        host_ids = self._host.alloc(run.num_pages, INDEX)
        op = BackupOp(
            kind=OpKind.BACKUP,
            num_pages=run.num_pages,
            num_bytes=run.num_pages * self.layout.bytes_per_page,
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
            num_bytes=len(keys) * self.layout.bytes_per_page,
            keys=keys,
            host_page_ids=[page for run in runs for page in run.host_page_ids],
        )
        return op if self._submit(op, runs) else None

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
        if victim.meta is FAILED_LOAD:
            victim.meta = None
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

    def _submit(self, op: TransferOp, runs: list[Node]) -> bool:
        """Hand an op to the executor; once it has it, hold the op's runs until it
        completes. Returns False (holding nothing, recording nothing) if `submit` raised:
        the failure is kept for the caller's next call, and the caller undoes its part.

        Copies into runs (LOAD, PREFETCH) lock the path to the root: the runs above must
        stay for the new pages to be reachable. Copies out of runs (BACKUP, WRITE_L3) pin
        just those runs, so the pages above them stay evictable meanwhile.
        """
        op.context = _Run(tail=runs[-1], num_pages=op.num_pages)
        op.submitted_s = self._executor.now()
        try:
            self._executor.submit(op)
        except Exception as error:  # a surprise: reported on the next call, never lost
            self._record_failure(op, error)
            return False
        if op.kind in (OpKind.LOAD, OpKind.PREFETCH):
            self._tree.lock(runs[-1])
        else:
            for run in runs:
                self._tree.pin(run)
        self._inflight[op.op_id] = op
        return True

    def _record_failure(self, op: TransferOp, error: BaseException) -> None:
        self._metrics.background_errors += 1
        if self._error is None:
            self._error = error
        logger.error("%s failed: %r", op.kind.value, error)

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
        if self._failed_loads:
            self._drop_failed_loads()

    def _complete(self, op: TransferOp) -> None:
        run: _Run = op.context
        direction = _DIRECTION[op.kind]
        moved_pages = op.num_pages
        if op.error is not None:
            self._record_failure(op, op.error)
        seconds = max(0.0, op.finished_s - op.submitted_s)
        if isinstance(op, PrefetchOp):
            moved_pages = op.num_ready
            self._advance_prefetch(op)
            self._rates.record_read(moved_pages * self.layout.bytes_per_page, seconds)
        elif isinstance(op, LoadOp) and op.error is None:
            self._rates.record_load(op.num_bytes, seconds if op.busy_s is None else op.busy_s)
        self._metrics.record_transfer(
            direction, moved_pages, moved_pages * self.layout.bytes_per_page, seconds
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
                piece.meta = None if op.error is None else FAILED_LOAD
                if op.error is not None:
                    self._failed_loads.append(piece)
        if op.error is not None:
            self._drop_failed_loads()

    def _drop_failed_loads(self) -> None:
        """Drop the L1 copy of runs a failed load left wrong, once nothing holds them
        (until then no match hands them out: `_first_failed`). Their L2 copy is intact."""
        waiting = []
        for piece in self._failed_loads:
            if piece.parent is None or piece.device_page_ids is None:
                continue  # evicted or gone meanwhile
            if not self._tree.can_clear(piece, Tier.L1):
                waiting.append(piece)
                continue
            piece.meta = None
            self._device.free(self._tree.clear_device(piece), INDEX)
        self._failed_loads = waiting

    def _finish_backup(self, op: BackupOp, run: _Run) -> None:
        pieces = self._pieces(run)
        if op.error is not None:
            # Its host pages hold garbage: the runs lose their L2 copy, locked or not.
            for piece in reversed(pieces):
                self._host.free(self._tree.invalidate(piece, Tier.L2), INDEX)
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
        self._trim_l3_index()

    def _finish_prefetch(self, op: PrefetchOp, run: _Run) -> None:
        self._metrics.prefetches_completed += 1
        missing = op.num_pages - op.num_ready
        if not missing:
            return
        # Pages L3 promised but did not deliver: their host pages go back, and the index
        # stops believing L3 holds them (where nothing else holds them open).
        self._metrics.prefetch_pages_missing += missing
        self._host.free(op.host_page_ids[op.num_ready :], op_owner(op))
        pieces = [p for p in self._pieces(run) if p.meta is op]
        for piece in reversed(pieces):
            piece.meta = None
            if not piece.children and not piece.lock_ref and piece.level == Tier.L3:
                self._tree.clear_l3(piece)

    def _drain(self) -> None:
        """Wait for every op in flight and apply it."""
        while self._inflight:
            for op in list(self._inflight.values()):
                self._executor.wait(op, None)
            self._apply_completions()
