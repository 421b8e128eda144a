"""The controller end to end on the CPU: real pools, the real transfer engine, real L3."""

from __future__ import annotations

import pytest
import torch

from hicache.errors import HiCacheError
from tests.support.caches import MHA, MLA, NS, put, read_pages, tokens_for
from tests.support.servers import RedisProcess, free_port
from tiers.errors import PoolExhaustedError


@pytest.fixture
def redis_url(tmp_path):
    server = RedisProcess(tmp_path / "redis", free_port()).start()
    yield server.url
    server.stop()


def wait_all_layers(cache, match):
    for layer in range(cache.layout.num_layers):
        cache.wait_layer(match, layer)


@pytest.mark.parametrize("layout", [MHA, MLA], ids=["mha", "mla"])
@pytest.mark.parametrize("backend", ["file", "redis"])
def test_kv_comes_back_bitwise_from_every_tier(cache_factory, tmp_path, request, layout, backend):
    url = (
        f"file://{tmp_path / 'l3'}?capacity=1GiB"
        if backend == "file"
        else request.getfixturevalue("redis_url")
    )
    cache = cache_factory(
        layout, l3_url=url, write_policy="write_through", prefetch_policy="wait_complete"
    )
    tokens = tokens_for(1, 5)
    written = put(cache, tokens, seed=1)
    cache.flush()  # backed up to L2, and from there written to L3
    stats = cache.stats()
    assert stats.pages_moved["l1_to_l2"] == 5 and stats.pages_moved["l2_to_l3"] == 5

    match = cache.match(tokens, NS)
    assert (match.num_l1_pages, match.num_l2_pages, match.num_l3_pages) == (5, 0, 0)
    assert torch.equal(read_pages(cache, match.device_page_ids), written)
    cache.release(match)

    assert cache.evict("l1", 100) == 5  # the L2 copy stays
    match = cache.match(tokens, NS)
    assert (match.num_l1_pages, match.num_l2_pages, match.num_l3_pages) == (0, 5, 0)
    wait_all_layers(cache, match)
    assert torch.equal(read_pages(cache, match.device_page_ids), written)
    cache.release(match)

    cache.evict("l1", 100)
    assert cache.evict("l2", 100) == 5  # now only L3 holds it
    match = cache.match(tokens, NS)
    assert (match.num_l1_pages, match.num_l2_pages, match.num_l3_pages) == (0, 0, 5)
    wait_all_layers(cache, match)
    assert torch.equal(read_pages(cache, match.device_page_ids), written)
    cache.release(match)
    stats = cache.stats()
    assert stats.hit_pages == {"l1": 5, "l2": 5, "l3": 5}
    assert stats.evicted_pages["l1"] == 10 and stats.evicted_pages["l2"] == 5
    cache.check_invariants()


def test_a_second_cache_on_the_same_directory_hits_the_first_ones_pages(cache_factory, tmp_path):
    url = f"file://{tmp_path / 'shared'}?capacity=1GiB"
    first = cache_factory(l3_url=url, write_policy="write_through")
    tokens = tokens_for(7, 6)
    written = put(first, tokens, seed=7)
    first.flush()

    second = cache_factory(l3_url=url, prefetch_policy="wait_complete")
    match = second.match(tokens + [1, 2, 3], NS)
    assert match.num_l3_pages == 6 and match.num_tokens == 24
    wait_all_layers(second, match)
    assert torch.equal(read_pages(second, match.device_page_ids), written)
    second.release(match)
    second.check_invariants()


def test_a_partial_hit_returns_the_shared_prefix_only(cache_factory):
    cache = cache_factory()
    base = tokens_for(3, 4, tail=0)
    written = put(cache, base, seed=3)
    other = base[:8] + [99999] * 12  # shares two pages
    match = cache.match(other, NS)
    assert match.num_tokens == 8 and match.num_l1_pages == 2
    assert torch.equal(read_pages(cache, match.device_page_ids), written[:, :2])
    cache.release(match)


def test_insert_frees_duplicates_and_counts(cache_factory):
    cache = cache_factory(l1_pages=8, l2_pages=0)
    tokens = tokens_for(4, 3)
    put(cache, tokens, seed=4)
    used = cache.stats().l1_pages_used
    # A second request computed the same pages into its own pages: they are freed.
    ids = cache.alloc_device_pages(3)
    assert cache.insert(tokens, ids, NS) == 0
    stats = cache.stats()
    assert stats.l1_pages_used == used and stats.duplicate_pages == 3


def test_locked_pages_are_never_evicted(cache_factory):
    cache = cache_factory(l1_pages=6, l2_pages=0)
    tokens = tokens_for(5, 4)
    written = put(cache, tokens, seed=5)
    match = cache.match(tokens, NS)
    with pytest.raises(PoolExhaustedError, match="cannot allocate 4 pages, 2 of 6 are free"):
        cache.alloc_device_pages(4)  # only 2 free and 4 locked
    assert torch.equal(read_pages(cache, match.device_page_ids), written)
    cache.release(match)
    assert len(cache.alloc_device_pages(4)) == 4  # now the cached pages can go
    with pytest.raises(HiCacheError, match="already released"):
        cache.release(match)


def test_detach_and_attach_l3_at_runtime(cache_factory, tmp_path):
    url = f"file://{tmp_path / 'l3'}?capacity=1GiB"
    cache = cache_factory(write_policy="write_through", prefetch_policy="wait_complete")
    tokens = tokens_for(8, 3)
    cache.attach_l3(url)
    written = put(cache, tokens, seed=8)
    cache.flush()
    cache.detach_l3()
    cache.evict("l1", 100)
    cache.evict("l2", 100)
    assert cache.match(tokens, NS).num_tokens == 0  # no L3: nothing
    cache.attach_l3(url)
    match = cache.match(tokens, NS)
    assert match.num_l3_pages == 3
    wait_all_layers(cache, match)
    assert torch.equal(read_pages(cache, match.device_page_ids), written)
    cache.release(match)
    cache.check_invariants()


def test_l3_without_l2_is_refused():
    from hicache.config import HiCacheConfig, L3Config

    with pytest.raises(ValueError, match="needs an L2 pool"):
        HiCacheConfig(layout=MHA, l3=L3Config(url="memory://"))


def test_cached_prefix_reports_tiers_without_touching_anything(cache_factory):
    cache = cache_factory(write_policy="write_through")
    tokens = tokens_for(9, 4)
    put(cache, tokens, seed=9)
    cache.flush()
    cache.evict("l1", 2)  # the last two pages now only in L2
    before = cache.stats()
    assert cache.cached_prefix(tokens, NS) == (2, 2, 0)
    after = cache.stats()
    assert after.requests == before.requests and after.hit_pages == before.hit_pages
    assert cache.pages_in_use("l1") == 2 and cache.pages_in_use("l2") == 4
    cache.poll()  # nothing in flight: a no-op
    with pytest.raises(ValueError, match="tier must be"):
        cache.pages_in_use("l3")


def test_shorten_keeps_the_leading_pages_locked_and_counts_the_cut(cache_factory):
    cache = cache_factory(l1_pages=8, l2_pages=0)
    tokens = tokens_for(6, 5)
    written = put(cache, tokens, seed=6)
    match = cache.match(tokens, NS)
    assert match.num_pages == 5
    short = cache.shorten(match, 8)
    assert match.released and short.num_tokens == 8 and short.num_l1_pages == 2
    assert torch.equal(read_pages(cache, short.device_page_ids), written[:, :2])
    stats = cache.stats()
    assert stats.hit_tokens["l1"] == 8 and stats.shortened_tokens == 12
    # Only the two pages are locked now: the other three can be evicted, those two not.
    assert cache.evict("l1", 8) == 3
    assert torch.equal(read_pages(cache, short.device_page_ids), written[:, :2])
    with pytest.raises(ValueError, match="whole pages below"):
        cache.shorten(short, 6)
    assert cache.shorten(short, 0) is None and short.released
    cache.check_invariants()


def test_branch_depths_and_held_pages_read_the_index_alone(cache_factory):
    cache = cache_factory(l1_pages=16, l2_pages=0)
    tokens = tokens_for(7, 4)
    put(cache, tokens, seed=7)
    tag = [4_000_000_000] * 4
    for depth in (1, 3):  # runs of a tag page below pages 1 and 3
        held = cache.held_device_pages(tokens[: depth * 4], NS)
        assert len(held) == depth
        ids = cache.alloc_device_pages(1)
        cache.insert(tokens[: depth * 4] + tag, held + ids, NS)
    assert cache.branch_depths(tokens, NS, [tag]) == [1, 3]
    assert cache.branch_depths(tokens[:8], NS, [[5] * 4, tag]) == [1]
    assert cache.branch_depths(tokens, NS, [[5] * 4]) == []
    before = cache.stats()
    look = cache.match(tokens[:12] + tag, NS, record=False)
    assert look.num_pages == 4
    cache.release(look)
    after = cache.stats()
    assert (after.requests, after.hit_tokens) == (before.requests, before.hit_tokens)
    cache.check_invariants()


def test_a_whole_match_fetches_all_it_finds_in_l3_and_waits(cache_factory, tmp_path):
    """`whole=True` (an engine's sidecar: of use only all together): the L3 part is
    fetched whole and waited for, whatever the prefetch and fetch policies say."""
    url = f"file://{tmp_path / 'l3'}?capacity=1GiB"
    tokens = tokens_for(8, 4)
    writer = cache_factory(write_policy="write_through", l3_url=url)
    written = put(writer, tokens, seed=8)
    writer.flush()
    reader = cache_factory(l3_url=url, prefetch_policy="best_effort")
    match = reader.match(tokens, NS, whole=True, record=False)
    assert match.num_pages == 4 and match.num_l3_pages == 4
    wait_all_layers(reader, match)
    assert torch.equal(read_pages(reader, match.device_page_ids), written)
    reader.release(match)
    assert reader.stats().requests == 0
