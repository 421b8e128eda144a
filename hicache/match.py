"""What a request holds: its `Match` (a locked run of the index, the engine's handle), and
what `HiCache.match` holds on the way to it (`Landed`). `CachedPrefix` is the router's
read-only answer. `ask_l3_again` is the schedulers' rule for a waiting request's lookup.
Torch-free, like the controller.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from hicache.errors import HiCacheError
from hicache.ops import LoadOp
from radix.keys import Namespace
from radix.node import Node
from radix.tree import RadixTree


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


def ask_l3_again(asked_s: float | None, now_s: float, ask_again_s: float) -> bool:
    """Whether a scheduler's match of a request asks L3 again (`HiCache.match`'s `ask_l3`):
    when L3 was never asked about it, or last asked `ask_again_s` or more before `now_s`
    (`L3Config.ask_again_s`). The embedded engine, the vLLM connector and the simulator's
    player keep `asked_s` per request."""
    return asked_s is None or now_s - asked_s >= ask_again_s
