"""Each write, L2->L3 and prefetch policy, shown by what it does."""

from __future__ import annotations

import pytest

from tests.support.caches import NS, put, tokens_for
from tests.support.deadline import wait_until, within_deadline
from tests.support.slow_backend import gate, slow_file_url


def l2_used(cache) -> int:
    return cache.stats().l2_pages_used


def test_write_through_backs_up_on_insert(cache_factory, tmp_path):
    cache = cache_factory(write_policy="write_through", l3_url=f"file://{tmp_path}?capacity=1GiB")
    put(cache, tokens_for(1, 4), seed=1)
    cache.flush()
    stats = cache.stats()
    assert stats.l2_pages_used == 4
    assert stats.pages_moved["l2_to_l3"] == 4  # on_backup: L2 pages go on to L3


def test_write_through_selective_waits_for_hits(cache_factory):
    cache = cache_factory(write_policy="write_through_selective", write_through_threshold=2)
    tokens = tokens_for(2, 3)
    put(cache, tokens, seed=2)
    cache.flush()
    assert l2_used(cache) == 0
    cache.release(cache.match(tokens, NS))  # one hit: below the threshold
    cache.flush()
    assert l2_used(cache) == 0
    cache.release(cache.match(tokens, NS))  # the second hit backs the run up
    cache.flush()
    assert l2_used(cache) == 3


def test_write_back_copies_only_on_eviction(cache_factory):
    cache = cache_factory(write_policy="write_back")
    tokens = tokens_for(3, 3)
    put(cache, tokens, seed=3)
    cache.flush()
    assert l2_used(cache) == 0
    assert cache.evict("l1", 3) == 3
    assert l2_used(cache) == 3
    match = cache.match(tokens, NS)
    assert match.num_l2_pages == 3
    cache.release(match)


def test_without_write_back_an_evicted_page_is_gone(cache_factory):
    cache = cache_factory(write_policy="write_through_selective", write_through_threshold=5)
    tokens = tokens_for(4, 3)
    put(cache, tokens, seed=4)
    cache.evict("l1", 3)
    assert cache.match(tokens, NS).num_tokens == 0


def test_l3_on_evict_writes_only_when_l2_evicts(cache_factory, tmp_path):
    cache = cache_factory(
        write_policy="write_through",
        l3_url=f"file://{tmp_path}?capacity=1GiB",
        l3_write_policy="on_evict",
        prefetch_policy="wait_complete",
    )
    tokens = tokens_for(5, 4)
    put(cache, tokens, seed=5)
    cache.flush()
    assert cache.stats().pages_moved["l2_to_l3"] == 0
    cache.evict("l1", 4)
    cache.evict("l2", 4)
    assert cache.stats().pages_moved["l2_to_l3"] == 4
    match = cache.match(tokens, NS)
    assert match.num_l3_pages == 4
    cache.release(match)


def seed_l3(cache_factory, url: str, tokens: list[int]) -> None:
    writer = cache_factory(l1_pages=64, l2_pages=64, write_policy="write_through", l3_url=url)
    put(writer, tokens, seed=9)
    writer.flush()


@pytest.fixture
def slow_l3(cache_factory, tmp_path):
    """40 pages in a file:// L3 whose reads take 0.2 s per chunk of 8 pages."""
    directory = tmp_path / "l3"
    tokens = tokens_for(6, 40)
    seed_l3(cache_factory, f"file://{directory}?capacity=1GiB", tokens)
    return slow_file_url(directory, delay_s=0.2), tokens


def reader(cache_factory, url, **policy):
    return cache_factory(l1_pages=64, l2_pages=64, l3_url=url, l3_prefetch_chunk_pages=8, **policy)


def test_wait_complete_waits_for_every_page(cache_factory, slow_l3):
    url, tokens = slow_l3
    cache = reader(cache_factory, url, prefetch_policy="wait_complete")
    match = cache.match(tokens, NS)
    assert match.num_l3_pages == 40
    assert cache.stats().prefetches_cut_short == 0


def test_timeout_returns_what_arrived_within_the_budget(cache_factory, gated_l3):
    url, tokens, chunks = gated_l3
    cache = reader(
        cache_factory,
        url,
        prefetch_policy="timeout",
        prefetch_timeout_base_s=1.0,
        prefetch_timeout_per_1k_tokens_s=0.0,
    )
    # (the budget itself is held to on the simulator's virtual clock:
    # tests/hicache/simulate/test_player.py::test_a_timeout_prefetch_is_cut_short_on_a_slow_l3)
    chunks.release(1)  # one chunk of the five reads within the budget, the rest are held
    match = within_deadline(cache.match, tokens, NS)
    assert match.num_l3_pages == 8
    assert cache.stats().prefetches_cut_short == 1
    cache.release(match)
    cache.flush()
    chunks.release(4)  # the prefetch carries on in the background...
    wait_until(
        lambda: cache.stats().prefetches_completed == cache.stats().prefetches_issued,
        "the cut-short prefetch to finish",
    )
    again = cache.match(tokens, NS)
    assert again.num_tokens == 160  # ...so the next request finds everything
    assert again.num_l1_pages == match.num_pages  # what the first request loaded
    assert again.num_l3_pages == 40 - match.num_pages  # landed later, first used now


def landed_in_l2(cache, tokens) -> int:
    cache.poll()  # apply what has finished
    return cache.cached_prefix(tokens, NS).num_l2_pages


@pytest.fixture
def gated_l3(cache_factory, tmp_path, request):
    """40 pages in a file:// L3 whose read batches (chunks of 8 pages) wait at a gate."""
    directory = tmp_path / "l3"
    tokens = tokens_for(6, 40)
    seed_l3(cache_factory, f"file://{directory}?capacity=1GiB", tokens)
    name = request.node.nodeid
    yield f"slowfile://{directory}?capacity=1GiB&gate={name}&timeout=60s", tokens, gate(name)
    gate(name).release(100)  # whatever still waits reads, so the cache closes


def test_best_effort_uses_what_a_queued_prefetch_fetched(cache_factory, gated_l3):
    url, tokens, chunks = gated_l3
    cache = reader(cache_factory, url, prefetch_policy="best_effort")
    assert cache.prefetch(tokens, NS) == 40  # the scheduler's hint, when the request queues
    chunks.release(2)  # the request waits in the queue; two chunks land meanwhile
    wait_until(lambda: landed_in_l2(cache, tokens) >= 16, "two chunks landing")
    match = cache.match(tokens, NS)
    assert match.num_l3_pages == 16  # what had landed; it did not wait for the rest
    cache.release(match)


def test_best_effort_without_a_hint_does_not_wait(cache_factory, gated_l3):
    url, tokens, _ = gated_l3
    cache = reader(cache_factory, url, prefetch_policy="best_effort")
    match = within_deadline(cache.match, tokens, NS)
    assert match.num_l3_pages == 0  # nothing had arrived (every read held): it did not wait


def test_short_l3_runs_are_not_worth_a_lookup(cache_factory, tmp_path):
    url = f"file://{tmp_path}?capacity=1GiB"
    tokens = tokens_for(7, 2)
    seed_l3(cache_factory, url, tokens)
    cache = cache_factory(l3_url=url, prefetch_policy="wait_complete", prefetch_min_pages=3)
    assert cache.match(tokens, NS).num_tokens == 0
    other = cache_factory(l3_url=url, prefetch_policy="wait_complete", prefetch_min_pages=2)
    assert other.match(tokens, NS).num_l3_pages == 2
