"""The routing policies `hicache route` and `hicache simulate` share (hicache.routing)."""

from __future__ import annotations

import pytest

from hicache.controller import CachedPrefix
from hicache.routing import Candidate, Router, RoutingConfig, TierWeights, needs_prefill

NONE = CachedPrefix(0, 0, 0)


def choose(policy: str, *candidates: Candidate, balance: float = 2.0) -> int:
    return Router(RoutingConfig(policy, balance)).choose(list(candidates)).index


def test_round_robin_takes_turns_and_least_load_takes_the_least_loaded():
    router = Router(RoutingConfig("round_robin"))
    three = [Candidate(i, CachedPrefix(9, 0, 0) if i == 2 else NONE, 0.0) for i in range(3)]
    assert [router.choose(three).index for _ in range(4)] == [0, 1, 2, 0]
    assert choose("least_load", Candidate(0, CachedPrefix(9, 0, 0), 3), Candidate(1, NONE, 1)) == 1
    # a tie in load goes to the one given fewer requests so far
    assert choose("least_load", Candidate(0, NONE, 0, 5), Candidate(1, NONE, 0, 2)) == 1


def test_prefix_weighs_pages_by_tier_within_the_load_balance():
    l1_short, l3_long = CachedPrefix(4, 0, 0), CachedPrefix(0, 0, 7)
    assert choose("prefix", Candidate(0, l1_short, 0), Candidate(1, l3_long, 0)) == 0  # 4 > 3.5
    assert choose("prefix", Candidate(0, l1_short, 0), Candidate(1, CachedPrefix(0, 0, 9), 0)) == 1
    holder = Candidate(0, CachedPrefix(50, 0, 0), 3)
    assert choose("prefix", holder, Candidate(1, NONE, 1)) == 0  # within 2 of the least
    assert choose("prefix", holder, Candidate(1, NONE, 0)) == 1  # too busy: the balance wins
    assert choose("prefix", holder, Candidate(1, NONE, 0), balance=3) == 0
    # nothing cached anywhere: the least loaded, then the one given fewer requests
    assert choose("prefix", Candidate(0, NONE, 1, 0), Candidate(1, NONE, 0, 9)) == 1
    assert choose("prefix", Candidate(0, NONE, 0, 4), Candidate(1, NONE, 0, 3)) == 1


def test_bad_routing_settings_are_errors_that_name_them():
    with pytest.raises(ValueError, match="policy"):
        RoutingConfig("longest")
    with pytest.raises(ValueError, match="balance"):
        RoutingConfig("prefix", -1)
    with pytest.raises(ValueError, match="l3 <= l2 <= l1"):
        TierWeights(1.0, 0.5, 0.8)


def test_needs_prefill_unless_the_decode_side_holds_every_full_page():
    assert needs_prefill(CachedPrefix(2, 1, 0), 4)
    assert not needs_prefill(CachedPrefix(2, 1, 1), 4)


def test_a_prefix_worth_less_than_min_share_of_the_prompt_does_not_decide():
    router = Router(RoutingConfig("prefix", balance=2, min_share=0.5))
    holder = Candidate(0, CachedPrefix(2, 0, 0), 1)  # a template's first pages, nothing more
    idle = Candidate(1, NONE, 0)
    assert router.choose([holder, idle], num_pages=10).index == 1
    assert router.choose([holder, idle], num_pages=3).index == 0  # 2 of 3 pages: it decides
    assert router.choose([holder, idle]).index == 0  # no prompt length: no minimum
