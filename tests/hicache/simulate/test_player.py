"""The trace player against numbers that follow from the trace and from the time model.

Where the hit rate grows with a capacity and where it need not. For one tier, LRU over a
radix tree that evicts only runs with no child in the tier is still a stack algorithm: a
prefix is touched whenever its extension is, so the least recently used run is always such
a run, and a larger tier holds a superset. Tiers below inherit that when they are fed the
same way at every size: write-through (or write-back) into L2, wait-complete prefetch, as
the sweeps here check on both traces. It does not hold in general:
- a lower tier sees only the upper tier's misses, so a larger upper tier changes the lower
  tier's recency order: with write_back and a 2,000-page L3, growing L2 from 1,600 to 2,400
  pages (first 2,000 Mooncake requests, 512-token pages) cut hits from 1,419,776 to
  1,267,200 tokens: with fewer L2 misses, fewer L3 reads refreshed L3's order, and it
  evicted pages that were needed later;
- timing feeds back into hits: `timeout` and `best_effort` prefetch use what has arrived,
  arrival depends on queueing, queueing on the hits (conversation trace, 0.5 ms budget:
  a larger L3 gave fewer hits, 2,672,640 -> 2,593,664 tokens);
- prefix routing sends a request where its prefix is, so capacity changes later routing;
  selective write-through backs up only runs hit twice, so L2's content depends on L1's.
"""

from __future__ import annotations

import numpy as np
import pytest

from hicache.config import PolicyConfig
from hicache.simulate import TracePlayer, simulate
from hicache.simulate.trace import (
    ConversationWorkload,
    Request,
    Trace,
    generate_conversations,
)

MOONCAKE_TOTAL_TOKENS = 61_194_628


def prompt(first_token: int, length: int) -> np.ndarray:
    return np.arange(first_token, first_token + length, dtype="<u4")


def trace_of(*requests: tuple[float, np.ndarray]) -> Trace:
    return Trace(
        "handmade",
        [Request(arrival_s=t, input_length=len(p), output_length=1, stream=p) for t, p in requests],
    )


@pytest.fixture(scope="module")
def conversations():
    return generate_conversations(ConversationWorkload(sessions=120, rate=8, think_s=10, seed=5))


@pytest.mark.parametrize("page_size, hit_tokens", [(512, 39_802_880), (64, 39_846_464)])
def test_unbounded_capacity_hits_every_repeated_prefix(
    mooncake, config_factory, page_size, hit_tokens
):
    every_page = MOONCAKE_TOTAL_TOKENS // page_size
    result = simulate(config_factory(page_size=page_size, l1_pages=every_page), mooncake)
    assert result.requests == 3993
    assert result.total_tokens == MOONCAKE_TOTAL_TOKENS
    assert result.hit_tokens == hit_tokens
    assert result.tiers["l1"].hit_tokens == hit_tokens


def test_zero_capacity_hits_nothing(mooncake, conversations, config_factory):
    for trace, page_size in ((mooncake.head(800), 512), (conversations, 64)):
        result = simulate(config_factory(page_size=page_size), trace)
        assert result.hit_tokens == 0
        assert result.prefill.saved_fraction == 0


SWEEPS = {  # tier -> (fixed capacities in pages, values swept)
    "l1": ({}, (0, 300, 1500, 8000)),
    "l2": ({"l1_pages": 100}, (0, 300, 1500, 8000)),
    "l3": ({"l1_pages": 100, "l2_pages": 200}, (0, 600, 3000, 16000)),
}


@pytest.mark.parametrize("tier", sorted(SWEEPS))
@pytest.mark.parametrize("write_policy", ["write_through", "write_back"])
def test_hit_rate_never_falls_as_a_capacity_grows(
    mooncake, conversations, config_factory, tier, write_policy
):
    fixed, values = SWEEPS[tier]
    for trace, page_size, scale in ((mooncake.head(800), 512, 1), (conversations, 128, 4)):
        hits = []
        for value in values:
            capacities = {k: v * scale for k, v in fixed.items()}
            capacities[f"{tier}_pages"] = value * scale
            config = config_factory(page_size=page_size, write_policy=write_policy, **capacities)
            hits.append(simulate(config, trace).hit_tokens)
        assert hits == sorted(hits), f"{trace.name}: {tier} sweep gave {hits}"
        assert hits[-1] > hits[0]


def test_a_lone_request_takes_its_prefill_time(config_factory):
    config = config_factory(page_size=16, l1_pages=100)
    result = simulate(config, trace_of((3.0, prompt(0, 1000))))
    expected = config.model.prefill_flops(0, 1000) / config.instance_flops
    assert result.ttft.p50 == pytest.approx(expected)
    assert result.queue.p50 == 0


def test_a_request_queues_behind_the_one_running(config_factory):
    config = config_factory(page_size=16, l1_pages=100)
    result = simulate(config, trace_of((0.0, prompt(0, 1000)), (0.0, prompt(5000, 1000))))
    first = config.model.prefill_flops(0, 1000) / config.instance_flops
    assert result.queue.p99 == pytest.approx(first, rel=0.02)


def test_an_l2_hit_loads_layer_by_layer_under_the_prefill(config_factory):
    config = config_factory(page_size=16, l1_pages=0, l2_pages=1000)
    length = 16 * 200
    player = TracePlayer(config, trace_of((0.0, prompt(0, length)), (10.0, prompt(0, length))))
    assert player.run().tiers["l2"].hit_tokens == length
    host = config.hardware.host_link_bytes_per_s * config.gpus_per_instance
    load_s = length * config.model.kv_bytes_per_token / host + config.hardware.host_link_latency_s
    prefill_s = config.model.prefill_flops(length - 1, length) / config.instance_flops
    stats = player.request_stats
    ttft = stats.end_s[1] - stats.arrival_s[1]
    assert ttft == pytest.approx(max(prefill_s, load_s + prefill_s / config.model.num_layers))
    assert ttft > prefill_s  # here the load, not the one token's compute, sets the pace


def test_instances_share_one_l3_and_not_their_own(config_factory):
    requests = trace_of((0.0, prompt(0, 4096)), (10.0, prompt(0, 4096)))
    shared = config_factory(page_size=64, l1_pages=64, l2_pages=64, l3_pages=1000, num_instances=2)
    result = simulate(shared, requests)  # round-robin: the repeat goes to the other instance
    assert result.tiers["l3"].hit_tokens == 4096
    assert result.tiers["l1"].hit_tokens == result.tiers["l2"].hit_tokens == 0
    local = simulate(shared.replace(l3_shared=False), requests)
    assert local.hit_tokens == 0


def test_prefix_routing_sends_a_repeat_where_its_prefix_lives(config_factory):
    x, y = prompt(0, 4096), prompt(10**6, 4096)
    requests = trace_of((0.0, x), (0.0, y), (10.0, y))
    config = config_factory(page_size=64, l1_pages=1000, num_instances=2)
    round_robin = TracePlayer(config, requests)
    assert round_robin.run().hit_tokens == 0  # y, then y again on the other instance
    by_prefix = TracePlayer(config.replace(routing="prefix"), requests)
    result = by_prefix.run()
    assert result.tiers["l1"].hit_tokens == 4096
    # routing's look at the indexes is not a request and not a hit
    assert sum(cache.stats().requests for cache in by_prefix.caches) == 3
    assert sum(cache.stats().total_hit_tokens for cache in by_prefix.caches) == 4096


def test_hits_and_bytes_are_the_controllers_own_counts(conversations, config_factory):
    config = config_factory(
        page_size=64,
        l1_pages=800,
        l2_pages=2400,
        l3_pages=10000,
        num_instances=2,
        routing="prefix",
        policy=PolicyConfig(write_policy="write_through"),
    )
    player = TracePlayer(config, conversations)
    result = player.run()
    stats = [cache.stats() for cache in player.caches]
    for tier in ("l1", "l2", "l3"):
        assert result.tiers[tier].hit_tokens == sum(s.hit_tokens[tier] for s in stats)
    assert result.tiers["l3"].hit_tokens > 0
    assert sum(s.requests for s in stats) == conversations.num_requests
    assert result.bytes_moved["l2_to_l3"] == sum(s.bytes_moved["l2_to_l3"] for s in stats) > 0
    for cache in player.caches:
        cache.check_invariants()


def test_best_effort_prefetch_serves_from_l3_only_what_a_hint_brought_in_time(config_factory):
    b, c, x1, x2, w, y1, y2, y3 = (prompt(i * 10**6, 8192) for i in range(8))  # 128 pages
    trace = trace_of(  # round-robin over two instances: even requests to 0, odd to 1
        (0.0, b),
        (0.0, y1),
        (1.0, c),
        (1.0, y2),  # instance 0 puts b and c in the shared L3
        (100.0, x1),
        (100.0, x2),
        (100.0, w),
        (100.0, b),  # instance 1: queued behind x2, so its hint fetches b from L3 meanwhile
        (200.0, y3),
        (200.0, c),  # instance 1 again, idle: nothing fetched c ahead of time
    )
    base = config_factory(
        page_size=64, l1_pages=2000, l2_pages=2000, l3_pages=2000, num_instances=2
    )
    waiting = simulate(base, trace)
    assert waiting.tiers["l3"].hit_tokens == 2 * 8192
    best_effort = simulate(base.replace(policy=PolicyConfig(prefetch_policy="best_effort")), trace)
    assert best_effort.tiers["l3"].hit_tokens == 8192
    assert best_effort.prefetches["issued"] == 2


def test_a_timeout_prefetch_is_cut_short_on_a_slow_l3(config_factory):
    p, q = prompt(0, 16384), prompt(10**6, 16384)  # 256 pages each, 4.5 MB a page
    trace = trace_of((0.0, p), (10.0, q), (100.0, p))  # q pushes p out of L2, to L3 only
    slow = config_factory(
        page_size=64,
        l1_pages=1,
        l2_pages=260,
        l3_pages=1000,
        l3_bandwidth_bytes_per_s=1e9,
        policy=PolicyConfig(
            prefetch_policy="timeout",
            prefetch_timeout_base_s=0.2,
            prefetch_timeout_per_1k_tokens_s=0.0,
        ),
    )
    player = TracePlayer(slow, trace)
    result = player.run()
    assert result.prefetches["cut_short"] == 1
    # in 0.2 s at 1 GB/s, one chunk of 32 pages arrived; the match uses it and goes on
    assert result.tiers["l3"].hit_tokens == 32 * 64
    stats = player.request_stats
    waited = stats.matched_s[2] - stats.began_s[2]  # the index knew p is in L3: no lookup
    assert waited == pytest.approx(0.2)


def test_a_capacity_beyond_the_trace_behaves_as_one_that_holds_it_all(
    conversations, config_factory
):
    page_size = 16
    every_page = sum(r.input_length // page_size for r in conversations.requests)
    holds_all = simulate(config_factory(page_size=page_size, l1_pages=every_page), conversations)
    huge = config_factory(page_size=page_size).replace(l1_bytes=1e18, l2_bytes=1e18)
    assert huge.l1_pages > 10**8  # as pools, these would not fit in memory
    result = simulate(huge, conversations)
    assert result.hit_tokens == holds_all.hit_tokens > 0
    assert result.tiers["l1"].capacity_bytes == 1e18  # costs are for what was asked


def test_a_shared_l3s_aggregate_bandwidth_slows_its_reads(config_factory):
    trace = trace_of((0.0, prompt(0, 4096)), (100.0, prompt(0, 4096)))
    shared = config_factory(page_size=64, l1_pages=64, l2_pages=64, l3_pages=1000, num_instances=2)
    waits = []
    for aggregate in (None, 1e9):
        player = TracePlayer(shared.replace(l3_aggregate_bytes_per_s=aggregate), trace)
        assert player.run().tiers["l3"].hit_tokens == 4096
        stats = player.request_stats
        waits.append(stats.matched_s[1] - stats.began_s[1])
    num_bytes = 4096 * shared.model.kv_bytes_per_token
    chunks = 64 // shared.prefetch_chunk_pages
    lookup_and_chunks = (1 + chunks) * shared.l3_latency_s
    assert waits[0] == pytest.approx(lookup_and_chunks + num_bytes / shared.l3_instance_bytes_per_s)
    assert waits[1] == pytest.approx(lookup_and_chunks + num_bytes / 1e9)


def test_l3_that_keeps_part_of_each_write_costs_hits_and_breaks_nothing(
    conversations, config_factory
):
    """The simulator walks the controller's partial-acknowledgement path (a full disk, a
    daemon down): L3 keeps only the first pages of each write, and the index knows it."""
    config = config_factory(
        page_size=64,
        l1_pages=400,
        l2_pages=800,
        l3_pages=10000,
        policy=PolicyConfig(write_policy="write_through", prefetch_policy="wait_complete"),
    )
    trace = conversations.head(600)
    whole = TracePlayer(config, trace).run()
    halves = TracePlayer(config, trace, acknowledge=lambda n: n // 2)
    result = halves.run()
    assert 0 < result.tiers["l3"].hit_tokens < whole.tiers["l3"].hit_tokens
    # L3 hits, not L1 ones. (Not the same L1 hits either: L2's room counts the spare L2
    # copies of pages that L1 and L3 both hold, which depend on what L3 kept.)
    assert result.tiers["l1"].hit_tokens >= whole.tiers["l1"].hit_tokens
    for cache in halves.caches:
        stats = cache.stats()
        assert stats.prefetch_pages_missing == 0  # the index never believed in a lost page
        cache.check_invariants()


def test_a_queued_request_asks_l3_again_only_once_its_lookup_is_old(config_factory):
    """As the engine's admission: the queue-time lookup stands for the match unless the
    request waited `L3Config.ask_again_s` (0.5 s) or more behind the one running."""
    config = config_factory(page_size=64, l1_pages=4000, l2_pages=4000, l3_pages=4000)
    for first_tokens, lookups in ((1024, 2), (128 * 1024, 3)):
        trace = trace_of((0.0, prompt(0, first_tokens)), (0.0, prompt(10**6, 1024)))
        player = TracePlayer(config, trace)
        player.run()
        times = player.request_stats
        waited_s = times.began_s[1] - times.arrival_s[1]  # 0.012 s, then 8.3 s
        assert (waited_s < 0.5) == (lookups == 2), waited_s
        stats = player.caches[0].stats()
        assert (stats.l3_lookups, stats.l3_lookups_spared) == (lookups, 3 - lookups)
