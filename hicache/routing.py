"""Where a request should run: the scoring that `hicache route` and the simulator share.

A candidate (a replica, or a simulated instance) is described by what it holds of the
request's prefix, per tier (`CachedPrefix`: pages whose fastest copy is in L1, L2, L3), by
its load (in whatever unit its owner measures: requests in flight for the router, seconds of
queued prefill for the simulator) and by how many requests it has been given so far.

Policies:

- `round_robin`: the next candidate in turn; the cache plays no part.
- `least_load`: the least loaded; ties go to the one given fewest requests.
- `prefix` (default): the candidates whose load is within `balance` of the least loaded are
  eligible; of those, the one whose cached prefix is worth most wins, a page counting by
  the tier it sits in (`TierWeights`: a page in L1 is ready, one in L2 must be copied over
  PCIe, one in L3 read from storage first); ties go to the less loaded, then to the one
  given fewer requests. A prefix worth no more than `min_share` of the prompt's pages is not
  worth leaving the least loaded for: then the choice is `least_load`'s. `balance` and
  `min_share` are what keep a hot prefix (a system prompt every user shares, a chat
  template's first lines) from drawing all traffic to one replica.

So the simulator's plan and the live router make the same choice from the same facts. The
P/D handoff decision (`needs_prefill`) is here for the same reason.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from hicache.controller import CachedPrefix  # torch-free: the executor is imported lazily

POLICIES = ("round_robin", "least_load", "prefix")


NOTHING_CACHED = CachedPrefix(0, 0, 0)


@dataclass(frozen=True)
class TierWeights:
    """What one cached page is worth in each tier, relative to a page in L1 (1.0): the
    share of its prefill a hit there saves once the copy into L1 is paid."""

    l1: float = 1.0
    l2: float = 0.8
    l3: float = 0.5

    def __post_init__(self) -> None:
        if not 0 <= self.l3 <= self.l2 <= self.l1:
            raise ValueError(
                f"TierWeights must satisfy 0 <= l3 <= l2 <= l1, got l1={self.l1} l2={self.l2} "
                f"l3={self.l3}"
            )

    def value(self, cached: CachedPrefix) -> float:
        """The cached prefix's worth, in L1-page equivalents."""
        return (
            cached.num_l1_pages * self.l1
            + cached.num_l2_pages * self.l2
            + cached.num_l3_pages * self.l3
        )


@dataclass(frozen=True)
class RoutingConfig:
    """policy:  one of POLICIES.
    balance: `prefix` only: how much more load than the least loaded candidate a candidate
             may carry and still win on its cached prefix (the load's own unit).
    min_share: `prefix` only: the least worth, as a share of the prompt's pages, for which a
             cached prefix decides (below it, the least loaded wins).
    weights: per-tier worth of a cached page."""

    policy: str = "prefix"
    balance: float = 2.0
    min_share: float = 0.5
    weights: TierWeights = TierWeights()

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"routing policy must be one of {POLICIES}, got {self.policy!r}")
        if self.balance < 0:
            raise ValueError(f"routing balance must be >= 0, got {self.balance}")
        if not 0 <= self.min_share <= 1:
            raise ValueError(f"routing min_share must be in [0, 1], got {self.min_share}")


class Candidate(NamedTuple):
    index: int  # the caller's own number for it
    cached: CachedPrefix
    load: float
    num_routed: int = 0  # requests given to it so far


class Choice(NamedTuple):
    index: int
    value: float  # the winner's cached prefix worth (0 for the cache-blind policies)


class Router:
    """The policy, with the one piece of state it needs (the round-robin turn)."""

    def __init__(self, config: RoutingConfig) -> None:
        self.config = config
        self._turn = 0

    def choose(self, candidates: Sequence[Candidate], num_pages: int | None = None) -> Choice:
        """`num_pages`: the prompt's full pages (for `min_share`; None: no minimum)."""
        if not candidates:
            raise ValueError("no candidate to route to")
        policy = self.config.policy
        if policy == "round_robin":
            chosen = candidates[self._turn % len(candidates)]
            self._turn += 1
            return Choice(chosen.index, 0.0)
        least = min(candidates, key=lambda c: (c.load, c.num_routed, c.index))
        if policy == "least_load":
            return Choice(least.index, 0.0)
        weights = self.config.weights
        limit = min(c.load for c in candidates) + self.config.balance
        best, best_key = None, None
        for candidate in candidates:
            if candidate.load > limit:
                continue
            value = weights.value(candidate.cached)
            key = (value, -candidate.load, -candidate.num_routed, -candidate.index)
            if best_key is None or key > best_key:
                best, best_key = candidate, key
        value = best_key[0]
        if num_pages and value <= self.config.min_share * num_pages * weights.l1:
            return Choice(least.index, weights.value(least.cached))
        return Choice(best.index, value)


def needs_prefill(cached_on_decode: CachedPrefix, num_prompt_pages: int) -> bool:
    """P/D: whether a prompt must go through a prefill replica first, or the decode
    replica already holds (or can fetch) every full page of it."""
    held = cached_on_decode.num_l1_pages + cached_on_decode.num_l2_pages
    return held + cached_on_decode.num_l3_pages < num_prompt_pages


__all__ = [
    "NOTHING_CACHED",
    "POLICIES",
    "CachedPrefix",
    "Candidate",
    "Choice",
    "Router",
    "RoutingConfig",
    "TierWeights",
    "needs_prefill",
]
