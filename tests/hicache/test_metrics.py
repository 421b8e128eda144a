"""The cache's counters, as `stats()` returns them and as Prometheus scrapes them."""

import urllib.request

from prometheus_client import CollectorRegistry, generate_latest

from hicache.metrics import Histogram, PrometheusCollector, serve_prometheus
from tests.support.caches import NS, put, tokens_for
from tests.support.servers import free_port


def exercised_cache(cache_factory):
    cache = cache_factory(write_policy="write_through")
    tokens = tokens_for(1, 4)
    put(cache, tokens, seed=1)
    cache.flush()
    cache.evict("l1", 4)
    cache.release(cache.match(tokens, NS))
    return cache


def test_prometheus_text_carries_the_counters(cache_factory):
    cache = exercised_cache(cache_factory)
    registry = CollectorRegistry()
    registry.register(PrometheusCollector(cache))
    text = generate_latest(registry).decode()
    assert 'hicache_hit_pages_total{tier="l2"} 4.0' in text
    assert 'hicache_transfer_pages_total{direction="l1_to_l2"} 4.0' in text
    assert 'hicache_evicted_pages_total{tier="l1"} 4.0' in text
    assert 'hicache_pages_total{tier="l2"} 32.0' in text
    assert 'hicache_transfer_seconds_count{direction="l2_to_l1"} 1.0' in text


def test_serve_prometheus_answers_http(cache_factory):
    cache = exercised_cache(cache_factory)
    port = free_port()
    server = serve_prometheus(cache, port)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
            body = reply.read().decode()
        assert "hicache_requests_total 1.0" in body
    finally:
        server.shutdown()


def test_stats_snapshot_is_independent_of_later_counting(cache_factory):
    cache = exercised_cache(cache_factory)
    before = cache.stats()
    cache.release(cache.match(tokens_for(1, 4), NS))
    assert cache.stats().requests == before.requests + 1
    assert before.hit_rate > 0 and before.as_dict()["hit_rate"] == before.hit_rate
    assert before.gb_per_s("l1_to_l2") >= 0


def test_histogram_buckets_count_each_observation_once():
    hist = Histogram(buckets=(0.1, 1.0))
    for value in (0.05, 0.1, 0.5, 7.0):
        hist.observe(value)
    assert hist.counts == [2, 1, 1] and hist.count == 4
    assert hist.copy().counts == hist.counts
