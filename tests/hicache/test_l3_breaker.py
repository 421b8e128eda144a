"""A hung L3 behind `l3_write_policy=on_evict` (issue 17): every request that needs room in
L2 writes the victims to L3 first, holding the cache's lock. Without a circuit breaker each
of them waited out the backend's whole timeout; with it the hung backend costs its first
`breaker_failures` calls, and the later writes fail at once (the pages are dropped from L2
unwritten, as with any failed L3 write) until a probe finds the backend back."""

from __future__ import annotations

from tests.support.caches import put, tokens_for
from tests.support.servers import RedisProcess, free_port


def test_a_hung_redis_costs_on_evict_two_timeouts_not_one_per_request(cache_factory, tmp_path):
    server = RedisProcess(tmp_path / "redis", free_port()).start()
    try:
        url = f"{server.url}?timeout=500ms&breaker_failures=2&breaker_backoff=30s"
        cache = cache_factory(
            l1_pages=4,
            l2_pages=8,
            l3_url=url,
            l3_write_policy="on_evict",
            write_policy="write_through",
        )
        for prefix in range(4):  # fill L1 and L2 while Redis answers
            put(cache, tokens_for(prefix, 2), seed=prefix)
        cache.flush()
        with server.paused():  # keeps its connections, never answers
            for prefix in range(4, 16):  # 12 requests, each evicting from L2
                put(cache, tokens_for(prefix, 2), seed=prefix)
            cache.flush()
            l3 = cache.executor.l3_stats()
        assert cache.stats().evicted_pages["l2"] >= 12 * 2
        assert l3.num_timeouts == 2  # not one per request
        assert l3.num_short_circuited >= 10
        assert l3.breaker_state == "open"
    finally:
        server.stop()
