"""Transfer operations, and the executor interface that carries them out.

The controller decides *what* moves (policy) and describes each move as an op; an
`Executor` does the moving. The real executor (`hicache.executor`) drives the tiers'
kernels and streams and runs L3 I/O on a background asyncio loop; the simulator supplies
one that advances a virtual clock. An executor only sees page ids and keys: the run of the
radix tree an op works on is the controller's bookkeeping (`OpRun`, in `op.context`), and so
is the state the controller keeps on a run while ops fill it (`RunState`, in `Node.meta`).

Completion: an executor marks an op done (`op.done = True`, plus the op's result fields)
and hands it back from `poll()`, which never blocks. The controller applies completions
only from `poll()`, on its own thread.
"""

from __future__ import annotations

import abc
import enum
import itertools
from dataclasses import dataclass, field

from radix.node import Node

_op_ids = itertools.count()


class OpKind(enum.Enum):
    BACKUP = "backup"  # L1 -> L2
    LOAD = "load"  # L2 -> L1, layer by layer
    WRITE_L3 = "write_l3"  # L2 -> L3
    PREFETCH = "prefetch"  # L3 -> L2


@dataclass(eq=False)
class TransferOp:
    kind: OpKind
    num_pages: int
    num_bytes: int
    op_id: int = field(default_factory=lambda: next(_op_ids))
    submitted_s: float = 0.0
    done: bool = False
    finished_s: float = 0.0
    error: BaseException | None = None  # a failure the executor caught; the op's pages are lost
    busy_s: float | None = None  # the copy's own time on its link, where the executor timed it
    context: OpRun | None = None  # the controller's bookkeeping; executors never read it


@dataclass(eq=False)
class BackupOp(TransferOp):
    device_page_ids: list[int] = field(default_factory=list)
    host_page_ids: list[int] = field(default_factory=list)


@dataclass(eq=False)
class LoadOp(TransferOp):
    host_page_ids: list[int] = field(default_factory=list)
    device_page_ids: list[int] = field(default_factory=list)


@dataclass(eq=False)
class WriteL3Op(TransferOp):
    keys: list[bytes] = field(default_factory=list)
    host_page_ids: list[int] = field(default_factory=list)
    num_written: int = 0  # result: pages L3 acknowledged, counted from the first


@dataclass(eq=False)
class PrefetchOp(TransferOp):
    keys: list[bytes] = field(default_factory=list)
    host_page_ids: list[int] = field(default_factory=list)
    num_ready: int = 0  # progress: leading pages verified and in L2 (grows while running)


@dataclass(eq=False)
class OpRun:
    """The run of the index an op works on, named by its deepest node and its page count.

    A match may split the run while the op is in flight; the pieces are then `tail` and its
    ancestors, `num_pages` pages in all (`PageMover` walks up from `tail` to find them).
    """

    tail: Node
    num_pages: int
    num_applied: int = 0  # PREFETCH: leading pages already recorded as in L2
    chain_l3: bool = True  # BACKUP: write the run on to L3 when done (`on_backup` policy)


class RunStatus(enum.Enum):
    LOADING = "loading into L1"  # `op` is the LOAD filling its L1 copy; matches wait on it
    FETCHING = "fetching from L3"  # `op` is the PREFETCH filling its L2 copy
    LANDED = "landed from L3"  # in L2 by a prefetch; no match has loaded it yet
    LOAD_FAILED = "load failed"  # its L1 copy is wrong: no match hands it out


@dataclass(frozen=True, eq=False)
class RunState:
    """What the controller keeps on a run of the index (`Node.meta`) while ops fill it.

    None on a run means nothing is moving into it. Immutable: a split hands both halves the
    same object, and the controller replaces it (never edits it) to change a run's state.
    """

    status: RunStatus
    op: LoadOp | PrefetchOp | None = None

    @staticmethod
    def loading(op: LoadOp) -> RunState:
        return RunState(RunStatus.LOADING, op)

    @staticmethod
    def fetching(op: PrefetchOp) -> RunState:
        return RunState(RunStatus.FETCHING, op)


LANDED_FROM_L3 = RunState(RunStatus.LANDED)
LOAD_FAILED = RunState(RunStatus.LOAD_FAILED)


# The controller's reads of a run's state (`Node.meta`, which the index keeps opaque).


def status_of(node: Node) -> RunStatus | None:
    state: RunState | None = node.meta  # type: ignore[assignment]
    return None if state is None else state.status


def filling_op(node: Node) -> LoadOp | PrefetchOp | None:
    """The LOAD or PREFETCH filling the run now, if any."""
    state: RunState | None = node.meta  # type: ignore[assignment]
    return None if state is None else state.op


class Executor(abc.ABC):
    """Carries out transfer ops. Small on purpose: the simulator implements it too.

    Contracts:
    - `submit` starts an op and returns at once. Ops of one kind on one link run in
      submission order; a LOAD of a page submitted after the PREFETCH that fills it sees
      its data.
    - `poll` returns the ops that finished since the last call, without blocking.
    - `wait(op, timeout_s)` blocks until the op is done or the timeout passes (None: no
      limit) and says whether it is done; it does not hand the op back (`poll` does).
    - `wait_ready(op, num_pages, timeout_s)` blocks until a PREFETCH has `num_pages` pages
      ready (or is done) or the timeout passes, and says which; by default it waits for the
      whole op (an executor that reads in chunks wakes its caller chunk by chunk).
    - `wait_layer(op, layer)` returns when layer `layer` of a LOAD is in L1 (on a GPU: the
      compute stream waits for it, the host does not).
    - A failure inside an op is recorded on it (`op.error`), never raised from a
      background thread.
    """

    @abc.abstractmethod
    def now(self) -> float:
        """Seconds on this executor's clock (wall clock, or virtual in the simulator)."""

    @abc.abstractmethod
    def submit(self, op: TransferOp) -> None: ...

    @abc.abstractmethod
    def poll(self) -> list[TransferOp]: ...

    @abc.abstractmethod
    def wait(self, op: TransferOp, timeout_s: float | None) -> bool: ...

    def wait_ready(self, op: PrefetchOp, num_pages: int, timeout_s: float | None) -> bool:
        """Block until `op.num_ready >= num_pages` or `op` is done (see the contracts)."""
        return self.wait(op, timeout_s) or op.num_ready >= num_pages

    @abc.abstractmethod
    def wait_layer(self, op: LoadOp, layer: int) -> None: ...

    @abc.abstractmethod
    def l3_exists(self, keys: list[bytes], timeout_s: float) -> int:
        """How many of `keys`, from the first, L3 holds (0 on any error or timeout)."""

    @abc.abstractmethod
    def attach_l3(self, url: str | None) -> None:
        """Open the L3 backend at `url` (None: detach). Only called with nothing in flight."""

    @property
    @abc.abstractmethod
    def has_l3(self) -> bool: ...

    @abc.abstractmethod
    def l3_stats(self):
        """The attached backend's counters (with `errors` and `corrupt`), or None."""

    def l3_capacity_pages(self) -> int | None:
        """How many pages the attached L3 can hold at most, where it says (else None)."""
        return None

    def quarantined_host_pages(self, host_page_ids: list[int]) -> list[bool]:
        """Which of these L2 pages an L3 transfer that outlived its op may still write (the
        backend writes straight into a lent L2 pool): they must not be reused until this
        says False. By default none is."""
        return [False] * len(host_page_ids)

    def link_sample(self) -> tuple[int, float] | None:
        """(bytes, seconds) of an L2 -> L1 load timed when the executor was built, where it
        timed one (else None): the link's rate before any request has measured it."""
        return None

    @property
    @abc.abstractmethod
    def num_device_pages(self) -> int:
        """Size of the L1 pool this executor moves pages in and out of."""

    @property
    @abc.abstractmethod
    def num_host_pages(self) -> int:
        """Size of the L2 pool (0: no L2)."""

    @abc.abstractmethod
    def close(self) -> None: ...
