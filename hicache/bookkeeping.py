"""`OpBookkeeping`: the op bookkeeping of `PageMover` (`hicache.mover`), which inherits it:
handing an op to the executor and holding its runs until it completes, and applying each
completion to the index (its pages, its runs' state, the rates and metrics). The mover
decides what moves and submits it; this records what moved, by the bookkeeping rules of
the mover's module doc. Torch-free, like the mover.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from hicache.config import HiCacheConfig
from hicache.fetch_plan import FetchRates
from hicache.metrics import Metrics
from hicache.ops import (
    LOAD_FAILED,
    BackupOp,
    Executor,
    LoadOp,
    OpKind,
    OpRun,
    PrefetchOp,
    TransferOp,
    WriteL3Op,
    filling_op,
)
from hicache.ownership import INDEX, QUARANTINE, NoPool, op_owner
from radix.node import Node, Tier
from radix.tree import RadixTree
from tiers.allocator import PageAllocator

logger = logging.getLogger(__name__)

_DIRECTION = {
    OpKind.BACKUP: "l1_to_l2",
    OpKind.LOAD: "l2_to_l1",
    OpKind.WRITE_L3: "l2_to_l3",
    OpKind.PREFETCH: "l3_to_l2",
}


class OpBookkeeping:
    """The op bookkeeping of `PageMover`, which inherits it: what it uses of the mover is
    declared here. The mover calls `_submit`, `_complete` and `_pieces`; `apply_completions`
    is part of its interface."""

    _config: HiCacheConfig
    _page_bytes: int
    _executor: Executor
    _tree: RadixTree
    _device: PageAllocator
    _host: PageAllocator | NoPool
    _metrics: Metrics
    _rates: FetchRates
    _inflight: dict[int, TransferOp]
    _failed_loads: list[Node]
    _quarantined: list[int]
    _error: BaseException | None
    _advance_prefetch: Callable[[PrefetchOp], None]
    _write_l3: Callable[[list[Node]], WriteL3Op | None]
    trim_l3_index: Callable[[], None]

    # ------------------------------------------------------------------ op bookkeeping

    def _submit(self, op: TransferOp, runs: list[Node]) -> bool:
        """Hand an op to the executor; once it has it, hold the op's runs until it
        completes. Returns False (holding nothing, recording nothing) if `submit` raised:
        the failure is kept for the caller's next call, and the caller undoes its part.

        Copies into runs (LOAD, PREFETCH) lock the path to the root: the runs above must
        stay for the new pages to be reachable. Copies out of runs (BACKUP, WRITE_L3) pin
        just those runs, so the pages above them stay evictable meanwhile.
        """
        op.context = OpRun(tail=runs[-1], num_pages=op.num_pages)
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

    def _let_go(self, op: TransferOp, run: OpRun) -> None:
        if op.kind in (OpKind.LOAD, OpKind.PREFETCH):
            self._tree.unlock(run.tail)
        else:
            for piece in self._pieces(run):
                self._tree.unpin(piece)

    @staticmethod
    def _pieces(run: OpRun) -> list[Node]:
        """The nodes an op's run is made of now, first to last (splits add ancestors)."""
        pieces = []
        node, remaining = run.tail, run.num_pages
        while remaining > 0:
            pieces.append(node)
            remaining -= node.num_pages
            node = node.parent
        pieces.reverse()
        return pieces

    def apply_completions(self) -> None:
        """Apply every op the executor has finished, and the progress of prefetches."""
        for op in self._executor.poll():
            if self._inflight.pop(op.op_id, None) is not None:
                self._complete(op)
        for op in list(self._inflight.values()):
            if isinstance(op, PrefetchOp):
                self._advance_prefetch(op)
        if self._failed_loads:
            self._drop_failed_loads()
        if self._quarantined:
            self._release_quarantined()

    def _complete(self, op: TransferOp) -> None:
        run = op.context
        direction = _DIRECTION[op.kind]
        moved_pages = op.num_pages
        if op.error is not None:
            self._record_failure(op, op.error)
        seconds = max(0.0, op.finished_s - op.submitted_s)
        if isinstance(op, PrefetchOp):
            moved_pages = op.num_ready
            self._advance_prefetch(op)
            self._rates.record_read(moved_pages * self._page_bytes, seconds)
        elif isinstance(op, LoadOp) and op.error is None:
            self._rates.record_load(op.num_bytes, seconds if op.busy_s is None else op.busy_s)
        self._metrics.record_transfer(
            direction, moved_pages, moved_pages * self._page_bytes, seconds
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

    def _finish_load(self, op: LoadOp, run: OpRun) -> None:
        for piece in self._pieces(run):
            if filling_op(piece) is op:
                piece.meta = None if op.error is None else LOAD_FAILED
                if op.error is not None:
                    self._failed_loads.append(piece)
        if op.error is not None:
            self._drop_failed_loads()

    def _drop_failed_loads(self) -> None:
        """Drop the L1 copy of runs a failed load left wrong, once nothing holds them
        (until then no match hands them out: `usable_prefix`). Their L2 copy is intact."""
        waiting = []
        for piece in self._failed_loads:
            if piece.device_page_ids is None:
                continue  # evicted, or gone from the tree, meanwhile
            if not self._tree.can_clear(piece, Tier.L1):
                waiting.append(piece)
                continue
            piece.meta = None
            self._device.free(self._tree.clear_device(piece), INDEX)
        self._failed_loads = waiting

    def _finish_backup(self, op: BackupOp, run: OpRun) -> None:
        pieces = self._pieces(run)
        if op.error is not None:
            # Its host pages hold garbage: the runs lose their L2 copy, locked or not.
            for piece in reversed(pieces):
                self._host.free(self._tree.invalidate(piece, Tier.L2), INDEX)
            return
        if run.chain_l3 and self._executor.has_l3 and self._config.l3.write_policy == "on_backup":
            self._write_l3(pieces)

    def _finish_write_l3(self, op: WriteL3Op, run: OpRun) -> None:
        written = 0 if op.error is not None else op.num_written
        offset = 0
        for piece in self._pieces(run):
            if offset >= written:
                break
            if offset + piece.num_pages > written:
                piece = self._tree.split(piece, written - offset)
            self._tree.set_l3(piece)
            offset += piece.num_pages
        self.trim_l3_index()

    def _finish_prefetch(self, op: PrefetchOp, run: OpRun) -> None:
        self._metrics.prefetches_completed += 1
        missing = op.num_pages - op.num_ready
        if not missing:
            return
        # Pages L3 promised but did not deliver: their host pages go back, and the index
        # stops believing L3 holds them (where nothing else holds them open).
        self._metrics.prefetch_pages_missing += missing
        self._let_go_of_unfilled(op, op.host_page_ids[op.num_ready :])
        pieces = [p for p in self._pieces(run) if filling_op(p) is op]
        for piece in reversed(pieces):
            piece.meta = None
            if not piece.children and not piece.lock_ref and piece.level == Tier.L3:
                self._tree.clear_l3(piece)

    def _let_go_of_unfilled(self, op: PrefetchOp, host_page_ids: list[int]) -> None:
        """Free the host pages a prefetch did not fill, except those a transfer that
        outlived the op's call still writes (a lent L2 pool): they are quarantined, and
        freed only once the executor says that transfer is over."""
        busy = self._executor.quarantined_host_pages(host_page_ids)
        late = [page for page, b in zip(host_page_ids, busy, strict=True) if b]
        self._host.free([page for page, b in zip(host_page_ids, busy, strict=True) if not b],
                        op_owner(op))  # fmt: skip
        if late:
            self._host.give(late, op_owner(op), QUARANTINE)
            self._quarantined.extend(late)

    def _release_quarantined(self) -> None:
        busy = self._executor.quarantined_host_pages(self._quarantined)
        over = [page for page, b in zip(self._quarantined, busy, strict=True) if not b]
        if over:
            self._host.free(over, QUARANTINE)
            self._quarantined = [p for p, b in zip(self._quarantined, busy, strict=True) if b]
