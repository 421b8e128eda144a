"""Transfer operations, and the executor interface that carries them out.

The controller decides *what* moves (policy) and describes each move as an op; an
`Executor` does the moving. The real executor (`hicache.executor`) drives the tiers'
kernels and streams and runs L3 I/O on a background asyncio loop; the simulator supplies
one that advances a virtual clock. Ops never hold nodes of the radix tree: the controller
keeps that bookkeeping, so an executor only sees page ids and keys.

Completion: an executor marks an op done (`op.done = True`, plus the op's result fields)
and hands it back from `poll()`, which never blocks. The controller applies completions
only from `poll()`, on its own thread.
"""

from __future__ import annotations

import abc
import enum
import itertools
from dataclasses import dataclass, field

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
    context: object = None  # the controller's bookkeeping; executors never read it


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
