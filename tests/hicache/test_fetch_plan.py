"""Load or recompute: the choice itself (`hicache.fetch_plan`), and the controller making it
on a virtual clock with given bandwidths (the simulator's executor) and a compute rate
reported as an engine would (`HiCache.record_compute`)."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache.config import HiCacheConfig, L1Config, L2Config, L3Config, PolicyConfig
from hicache.controller import HiCache
from hicache.fetch_plan import (
    PROBE_EVERY,
    ComputeFit,
    FetchRates,
    RunToFetch,
    _any_fetch_pays,
    attention_pairs,
    fit_compute,
    plan_fetch,
)
from hicache.simulate.executor import Link, Links, VirtualExecutor
from hicache.simulate.l3 import SimulatedL3
from radix.keys import Namespace, page_keys
from tiers.layout import KVLayout

MiB = 1 << 20

# 4 layers x 16 tokens x K and V x 8 heads x 128 x 4 bytes: 512 KiB a page
LAYOUT = KVLayout(
    kind="mha", num_layers=4, page_size=16, dtype="float32", num_kv_heads=8, head_dim=128
)
NS = Namespace(model_id="fetch-plan", layout=LAYOUT.descriptor())
PAGE = LAYOUT.page_size


def run_of(num_pages: int, *, hit_pages: int = 0, batch: int = 4):
    return RunToFetch(
        hit_tokens=hit_pages * PAGE,
        num_pages=num_pages,
        page_size=PAGE,
        page_bytes=LAYOUT.bytes_per_page,
        total_tokens=(hit_pages + num_pages) * PAGE + 8,
        batch_pages=batch,
    )


def test_attention_pairs_count_causal_row_position_pairs():
    assert attention_pairs(0, 1) == 1
    assert attention_pairs(0, 4) == 1 + 2 + 3 + 4
    assert attention_pairs(2, 4) == 3 + 4
    assert attention_pairs(5, 5) == 0


def test_the_compute_fit_recovers_the_cost_of_rows_and_pairs():
    truth = ComputeFit(per_step_s=0.002, per_row_s=1e-5, per_pair_s=2e-9)
    shapes = [(512, 0), (64, 4000), (2048, 2048), (1, 9000), (300, 100)]
    steps = [(rows, attention_pairs(start, start + rows)) for rows, start in shapes]
    fit = fit_compute([(r, p, truth.seconds(r, p)) for r, p in steps])
    assert fit.per_step_s == pytest.approx(truth.per_step_s, rel=1e-6)
    assert fit.per_row_s == pytest.approx(truth.per_row_s, rel=1e-6)
    assert fit.per_pair_s == pytest.approx(truth.per_pair_s, rel=1e-6)
    assert fit_compute([(1, 1, 0.1), (2, 3, 0.2)]) is None  # too few samples


def test_a_fit_never_goes_negative():
    # Seconds that fall with rows: no cost per row fits; the terms that do are kept >= 0.
    fit = fit_compute([(100, 0, 0.03), (200, 0, 0.02), (300, 0, 0.01)])
    assert fit is None or (fit.per_row_s >= 0 and fit.per_pair_s >= 0 and fit.per_step_s >= 0)


def test_a_fast_read_fetches_the_whole_run_and_a_slow_one_none():
    compute = ComputeFit(per_step_s=0.0, per_row_s=1e-4, per_pair_s=0.0)  # 10k tokens/s
    run = run_of(32)  # 16 MiB: recompute 512 tokens = 51 ms
    fast = plan_fetch(run, compute, read_bytes_per_s=10e9, latency_s=1e-4, load_bytes_per_s=20e9)
    assert fast.num_pages == 32 and fast.fetch_s < fast.recompute_s
    io = 1e-4 + 16 * MiB / 10e9 + 4 * LAYOUT.bytes_per_page / 20e9
    assert fast.fetch_s == pytest.approx(io + compute.seconds(8, attention_pairs(512, 520)))
    slow = plan_fetch(run, compute, read_bytes_per_s=1e8, latency_s=1e-4, load_bytes_per_s=20e9)
    assert slow.num_pages == 0  # 168 ms of reading against 51 ms of compute
    assert slow.fetch_s == slow.recompute_s


def test_the_choice_waits_for_measurements_and_probes_a_store_it_declined():
    rates = FetchRates(
        l3_read_prior_bytes_per_s=2e9, l2_load_prior_bytes_per_s=1e9, l3_latency_prior_s=2e-3
    )
    run = run_of(32)
    assert rates.plan(run).num_pages == 32  # nothing measured: fetch all (and measure)
    for rows in (64, 128, 256):
        rates.record_compute(rows, 0, rows * 1e-4)  # 51 ms for the run's 512 tokens
    plan = rates.plan(run)  # L3 never read yet: 8.4 ms at the prior, 2 ms first-read, ...
    assert plan.num_pages == 32 and not plan.measured  # ... 17 ms on the link: fetch all
    rates.record_read(16 * MiB, 2.0)  # 8 MB/s, but a first read: no sample (one-time costs)
    assert rates.plan(run).num_pages == 32 and rates.snapshot().num_read_samples == 0
    rates.record_read(16 * MiB, 2.0)
    assert rates.plan(run).num_pages == 0
    declined = [rates.plan(run).num_pages for _ in range(40)]
    assert declined.count(4) == 1 and set(declined) == {0, 4}  # one batch, once in a while
    assert rates.snapshot().pages_declined >= 32 * 40
    # A prior no read has confirmed is believed: 1 kB/s makes every run recomputed.
    slow_prior = FetchRates(
        l3_read_prior_bytes_per_s=1e3, l2_load_prior_bytes_per_s=1e9, l3_latency_prior_s=0.0
    )
    for rows in (64, 128, 256):
        slow_prior.record_compute(rows, 0, rows * 1e-4)
    assert slow_prior.plan(run).num_pages == 0


def test_before_any_read_a_run_no_store_could_make_worth_fetching_is_declined():
    """A model whose step costs the same whatever its rows (launch-bound: SmolLM2-135M on an
    H200, ~9.4 ms a step) saves nothing by fetching: not even a store with no latency and no
    bandwidth limit, only the L2 -> L1 link, would pay, so the run is declined unread."""
    rates = FetchRates(
        l3_read_prior_bytes_per_s=1e15, l2_load_prior_bytes_per_s=50e9, l3_latency_prior_s=0.0
    )
    for rows in (1, 64, 512, 2048):
        rates.record_compute(rows, attention_pairs(0, rows), 0.0094 + rows * 1e-8)
    run = run_of(32)  # 16 MiB: 0.34 ms on the link against 5 us of compute saved
    plan = rates.plan(run)
    assert plan.num_pages == 0 and not plan.measured
    assert plan.fetch_s == plan.recompute_s
    assert rates.snapshot().pages_declined == 32
    # The bound weighs the link: a model at 5 ms per 512 tokens declines the run over a
    # 1 GB/s link (16.8 ms) and fetches it, unread, over a 20 GB/s one (0.8 ms).
    costly = FetchRates(
        l3_read_prior_bytes_per_s=1e15, l2_load_prior_bytes_per_s=1e9, l3_latency_prior_s=0.0
    )
    for rows in (64, 128, 256):
        costly.record_compute(rows, 0, rows * 1e-5)  # 5 ms for 512 tokens; 16.8 ms of link
    assert costly.plan(run).num_pages == 0
    cheap_link = FetchRates(
        l3_read_prior_bytes_per_s=1e15, l2_load_prior_bytes_per_s=20e9, l3_latency_prior_s=0.0
    )
    for rows in (64, 128, 256):
        cheap_link.record_compute(rows, 0, rows * 1e-5)  # the same 5 ms; 0.8 ms of link
    assert cheap_link.plan(run).num_pages == 32


@pytest.fixture
def cache_with():
    made = []

    def build(read_bytes_per_s: float, **policy) -> tuple[HiCache, SimulatedL3]:
        store = SimulatedL3(capacity_pages=10_000)
        links = Links(
            device_to_host=Link("d2h", 20e9),
            host_to_device=Link("h2d", 20e9),
            host_latency_s=0.0,
            l3_write=(Link("out", 10e9),),
            l3_read=(Link("in", read_bytes_per_s),),
            l3_latency_s=1e-4,
        )
        executor = VirtualExecutor(
            num_device_pages=256,
            num_host_pages=256,
            page_bytes=LAYOUT.bytes_per_page,
            links=links,
            stores={"l3": store},
        )
        config = HiCacheConfig(
            layout=LAYOUT,
            l1=L1Config(num_pages=256),
            l2=L2Config(budget_bytes=256 * LAYOUT.bytes_per_page, reserve_bytes=0),
            l3=L3Config(url="sim://l3"),
            policy=PolicyConfig(prefetch_policy="wait_complete", **policy),
        )
        cache = HiCache(config, executor)
        made.append(cache)
        return cache, store

    yield build
    for cache in made:
        cache.close()


def prompt(seed: int, num_pages: int = 32) -> list[int]:
    return [seed * 100_000 + i for i in range(num_pages * PAGE)]


def report_engine_steps(cache: HiCache, seconds_per_row: float) -> None:
    """Cold steps as an engine reports them: a cost per row, nothing else."""
    for rows in (128, 512, 2048):
        cache.record_compute(rows, attention_pairs(0, rows), rows * seconds_per_row)


def l3_match(cache: HiCache, store: SimulatedL3, seed: int):
    tokens = prompt(seed)
    store.put(page_keys(tokens, NS, PAGE), visible_s=0.0)
    match = cache.match(tokens, NS)
    cache.release(match)
    return match


def test_the_controller_fetches_a_run_from_a_fast_store(cache_with):
    cache, store = cache_with(read_bytes_per_s=10e9)
    report_engine_steps(cache, seconds_per_row=1e-4)
    assert l3_match(cache, store, seed=1).num_l3_pages == 32  # a first read: no sample
    assert cache.fetch_rates().num_read_samples == 0
    assert l3_match(cache, store, seed=2).num_l3_pages == 32  # the read that measures L3
    rates = cache.fetch_rates()
    assert rates.l3_read_bytes_per_s == pytest.approx(10e9, rel=0.05)  # the given bandwidth
    assert rates.l3_latency_s == pytest.approx(1e-4)
    assert l3_match(cache, store, seed=3).num_l3_pages == 32
    assert cache.fetch_rates().pages_declined == 0


def test_a_store_the_prior_undersells_is_measured_off_the_request_path(cache_with):
    """A prior far below the store (1 MB/s against 10 GB/s) declines the first hits, but
    each reads its first batch into L2 in the background once the engine's next step has run,
    one at a time, so after the two reads that measure the store (the first is no sample) its
    hits are fetched."""
    cache, store = cache_with(read_bytes_per_s=10e9, l3_read_prior_bytes_per_s=1e6)
    report_engine_steps(cache, seconds_per_row=1e-4)
    executor = cache.executor
    for seed in (1, 2):
        match = l3_match(cache, store, seed=seed)
        assert match.num_l3_pages == 0  # recomputed: the request never waits for the probe
        assert cache.stats().prefetches_issued == seed - 1  # not beside the step computing it
        cache.record_compute(512, attention_pairs(0, 512), 512e-4)  # that step ran
        assert cache.stats().prefetches_issued == seed
        assert l3_match(cache, store, seed=seed + 10).num_l3_pages == 0  # a probe is running
        assert cache.stats().prefetches_issued == seed
        executor.advance_to(executor.next_done_s())
        again = cache.match(prompt(seed), NS)  # served by what the probe read
        cache.release(again)
        assert again.num_l2_pages + again.num_l3_pages == 32
    assert cache.fetch_rates().num_read_samples == 1
    assert cache.fetch_rates().l3_read_bytes_per_s == pytest.approx(10e9, rel=0.05)
    assert l3_match(cache, store, seed=3).num_l3_pages == 32
    assert l3_match(cache, store, seed=4).num_l3_pages == 32


def test_the_controller_recomputes_rather_than_read_a_slow_store(cache_with):
    cache, store = cache_with(read_bytes_per_s=50e6)  # 16 MiB: 0.34 s of reading
    # 512 tokens: 15 ms of compute; the prior (2 GB/s, 2 ms) says 11 ms: read, and measure
    report_engine_steps(cache, seconds_per_row=3e-5)
    for seed in (1, 2):  # a first read (no sample), then the one that measures L3
        assert l3_match(cache, store, seed=seed).num_l3_pages == 32
    assert cache.fetch_rates().l3_read_bytes_per_s == pytest.approx(50e6, rel=0.05)
    lookups = count_lookups(cache)
    third = l3_match(cache, store, seed=3)
    assert third.num_pages == 0 and third.num_l3_pages == 0
    assert lookups == [] and cache.fetch_rates().lookups_skipped == 1  # not worth a look
    assert cache.stats().prefetches_issued == 2  # the third run was never read


def test_always_fetches_whatever_the_rates_say(cache_with):
    cache, store = cache_with(read_bytes_per_s=50e6, l3_fetch_policy="always")
    report_engine_steps(cache, seconds_per_row=1e-5)
    l3_match(cache, store, seed=1)
    assert l3_match(cache, store, seed=2).num_l3_pages == 32


def test_fetch_policy_is_checked():
    with pytest.raises(ValueError, match="l3_fetch_policy"):
        PolicyConfig(l3_fetch_policy="sometimes")
    with pytest.raises(ValueError, match="l3_read_prior_bytes_per_s"):
        PolicyConfig(l3_read_prior_bytes_per_s=0.0)
    with pytest.raises(ValueError, match="read_batches"):
        L3Config(read_batches=-1)


def test_an_unread_store_is_not_free_a_short_run_is_recomputed_a_long_one_read():
    """Before L3 has been read, a read is weighed at the prior rate plus the prior latency
    (what a store's first read costs once): a run whose recompute costs less than that is
    recomputed, so a new cache's first hit is never slower than cold; a run worth even a
    pessimistic read is fetched (and measures the store)."""

    def rates_at(seconds_per_row: float) -> FetchRates:
        rates = FetchRates(
            l3_read_prior_bytes_per_s=2e9, l2_load_prior_bytes_per_s=20e9, l3_latency_prior_s=2e-3
        )
        for rows in (64, 128, 256):
            rates.record_compute(rows, 0, rows * seconds_per_row)
        return rates

    # 512 tokens: 5 ms to recompute; 0.8 ms on the link alone (a free store would be read),
    # 8.4 ms at the prior rate and 2 ms of first-read latency besides: recomputed.
    short = rates_at(1e-5).plan(run_of(32))
    assert short.num_pages == 0 and not short.measured
    assert short.fetch_s == short.recompute_s
    long = rates_at(1e-4).plan(run_of(32))  # 51 ms to recompute: fetched, unmeasured
    assert long.num_pages == 32 and not long.measured and long.fetch_s < long.recompute_s


def count_lookups(cache: HiCache) -> list[int]:
    """The number of keys of each L3 existence lookup the cache makes from now on."""
    calls: list[int] = []
    lookup = cache.executor.l3_exists

    def counted(keys, timeout_s):
        calls.append(len(keys))
        return lookup(keys, timeout_s)

    cache.executor.l3_exists = counted
    return calls


def test_a_run_no_fetch_could_pay_for_is_not_even_looked_up(cache_with):
    """A model whose step costs the same whatever its rows saves nothing by fetching,
    whatever L3 holds: the match skips the lookup (on the H200 a 1K-token L3 hit that
    fetched nothing cost 0.9x of cold in its lookups). Every PROBE_EVERY skipped runs one
    is looked up and probed, so a store or model that changed is seen again."""
    cache, store = cache_with(read_bytes_per_s=10e9)
    for rows in (1, 64, 512, 2048):  # launch-bound: 10 ms a step
        cache.record_compute(rows, attention_pairs(0, rows), 0.010 + rows * 1e-10)
    lookups = count_lookups(cache)
    first = l3_match(cache, store, seed=1)
    assert first.num_pages == 0 and lookups == []
    assert cache.fetch_rates().lookups_skipped == 1
    matches = [l3_match(cache, store, seed) for seed in range(2, 2 + PROBE_EVERY)]
    assert len(lookups) == 1  # the probe's
    assert cache.stats().prefetches_issued == 1
    assert sum(1 for m in matches if m.num_l3_pages) == 1
    assert cache.fetch_rates().lookups_skipped == PROBE_EVERY  # the probe's was made


def test_a_run_worth_fetching_is_looked_up_once(cache_with):
    cache, store = cache_with(read_bytes_per_s=10e9)
    report_engine_steps(cache, seconds_per_row=1e-4)  # 512 tokens: 51 ms
    lookups = count_lookups(cache)
    assert l3_match(cache, store, seed=1).num_l3_pages == 32
    assert lookups == [32] and cache.fetch_rates().lookups_skipped == 0


def test_a_match_told_not_to_ask_l3_uses_what_the_index_holds(cache_with):
    """`ask_l3=False` (the caller's recent lookup of the request stands, as at an engine's
    admission): nothing past the index is looked up, so L3 pages the index has not heard of
    are not found; those a queue-time prefetch indexed are fetched as ever."""
    cache, store = cache_with(read_bytes_per_s=10e9)
    report_engine_steps(cache, seconds_per_row=1e-4)
    lookups = count_lookups(cache)
    tokens = prompt(1)
    store.put(page_keys(tokens, NS, PAGE), visible_s=0.0)
    match = cache.match(tokens, NS, ask_l3=False)
    cache.release(match)
    assert match.num_pages == 0 and lookups == []
    cache.prefetch(tokens, NS)
    match = cache.match(tokens, NS, ask_l3=False)
    cache.release(match)
    assert match.num_l3_pages == 32 and lookups == [32]
    stats = cache.stats()
    assert (stats.l3_lookups, stats.l3_lookups_spared) == (1, 1)  # the second: none past


@settings(max_examples=300, deadline=None)
@given(
    per_step_s=st.floats(0, 0.05),
    per_row_s=st.floats(0, 1e-3),
    per_pair_s=st.floats(0, 1e-7),
    read_bytes_per_s=st.floats(1e6, 1e12),
    latency_s=st.floats(0, 0.01),
    load_bytes_per_s=st.floats(1e6, 1e12),
    hit_pages=st.integers(0, 64),
    num_pages=st.integers(1, 64),
    tail_tokens=st.integers(0, PAGE - 1),
    batch=st.integers(1, 16),
)
def test_skipping_a_lookup_never_skips_a_fetch_the_plan_would_make(
    per_step_s, per_row_s, per_pair_s, read_bytes_per_s, latency_s, load_bytes_per_s,
    hit_pages, num_pages, tail_tokens, batch,
):  # fmt: skip
    """`_any_fetch_pays` checks only n = 1 and n = N; by concavity that decides every n,
    so a run it declines (no lookup) is one whose plan, for any part of it L3 might hold,
    fetches nothing."""
    compute = ComputeFit(per_step_s, per_row_s, per_pair_s)
    rates = dict(
        read_bytes_per_s=read_bytes_per_s,
        latency_s=latency_s,
        load_bytes_per_s=load_bytes_per_s,
    )
    best = RunToFetch(
        hit_tokens=hit_pages * PAGE,
        num_pages=num_pages,
        page_size=PAGE,
        page_bytes=LAYOUT.bytes_per_page,
        total_tokens=(hit_pages + num_pages) * PAGE + tail_tokens,
        batch_pages=batch,
    )
    if _any_fetch_pays(best, compute, *rates.values()):
        return
    for held in range(1, num_pages + 1):
        shorter = dataclasses.replace(best, num_pages=held)
        # (a tie within rounding would let the plan fetch: T(n) == T(0) exactly)
        plan = plan_fetch(shorter, compute, **rates)
        assert plan.num_pages == 0 or plan.fetch_s >= plan.recompute_s * (1 - 1e-9)


def l2_only_prompt(cache: HiCache, seed: int) -> list[int]:
    """A 32-page prompt the cache holds in L2 only (inserted, backed up, evicted from L1)."""
    tokens = prompt(seed)
    cache.insert(tokens, cache.alloc_device_pages(32), NS)
    cache.flush()
    assert cache.evict("l1", 32) == 32
    return tokens


def test_an_l2_run_is_loaded_only_where_loading_beats_recomputing(cache_with):
    """SmolLM2-135M on the H200 took 0.8x of cold for a 1K-token L2 hit: its step costs the
    same whatever its rows, so loading saves nothing. A model whose tokens cost more than
    their pages' trip over the link loads them."""
    cache, _ = cache_with(read_bytes_per_s=10e9)
    for rows in (1, 64, 512, 2048):  # launch-bound: 10 ms a step
        cache.record_compute(rows, attention_pairs(0, rows), 0.010 + rows * 1e-10)
    tokens = l2_only_prompt(cache, seed=1)
    match = cache.match(tokens, NS)
    assert (match.num_pages, match.num_l2_pages) == (0, 0)  # recomputed, not loaded
    cache.release(match)
    assert cache.fetch_rates().l2_pages_declined == 32
    cache.check_invariants()

    costly, _ = cache_with(read_bytes_per_s=10e9)
    report_engine_steps(costly, seconds_per_row=1e-4)  # 512 tokens: 51 ms; the link 0.8 ms
    tokens = l2_only_prompt(costly, seed=2)
    match = costly.match(tokens, NS)
    assert (match.num_pages, match.num_l2_pages) == (32, 32)
    costly.release(match)
    assert costly.fetch_rates().l2_pages_declined == 0
    costly.check_invariants()


def test_an_l2_run_is_loaded_when_no_compute_rate_is_known_or_policy_always(cache_with):
    for policy in ({}, {"l2_load_policy": "always"}):
        cache, _ = cache_with(read_bytes_per_s=10e9, **policy)
        if policy:
            for rows in (1, 64, 512, 2048):
                cache.record_compute(rows, attention_pairs(0, rows), 0.010)
        tokens = l2_only_prompt(cache, seed=3)
        match = cache.match(tokens, NS)
        assert match.num_l2_pages == 32
        cache.release(match)
