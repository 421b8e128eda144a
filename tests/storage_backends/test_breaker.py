"""The circuit breaker (issue 17): a hung backend costs one timeout per back-off, not one per
call. The unit tests drive `CircuitBreaker` with a fake clock; the backend test pauses a real
redis-server (SIGSTOP: it keeps its connections and never answers, as a hung server does)."""

from __future__ import annotations

import asyncio

import pytest

from storage_backends import BackendConfigError, open_backend
from storage_backends.breaker import BreakerState, CircuitBreaker

PAGE_BYTES = 2048


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_opens_after_faults_in_a_row_then_probes_and_backs_off():
    clock = Clock()
    breaker = CircuitBreaker(3, 1.0, 4.0, clock=clock)
    assert breaker.allow()
    assert not breaker.failed() and not breaker.failed()
    breaker.succeeded()  # a success in between: the count starts again
    assert not breaker.failed() and not breaker.failed()
    assert breaker.failed() and breaker.state is BreakerState.OPEN and breaker.num_trips == 1
    assert not breaker.allow()
    clock.now += 1.0
    assert breaker.allow() and breaker.state is BreakerState.PROBING
    assert not breaker.allow()  # one probe at a time
    assert breaker.failed() and breaker.open_for_s == 2.0  # still down: twice as long
    clock.now += 1.9
    assert not breaker.allow()
    clock.now += 0.1
    assert breaker.allow()
    assert breaker.failed() and breaker.open_for_s == 4.0
    clock.now += 4.0
    assert breaker.allow()
    assert breaker.failed() and breaker.open_for_s == 4.0  # at most max_backoff
    clock.now += 4.0
    assert breaker.allow()
    assert breaker.succeeded() and breaker.state is BreakerState.CLOSED
    assert breaker.open_for_s == 1.0 and breaker.num_trips == 1


def test_a_cancelled_probe_lets_the_next_call_probe():
    clock = Clock()
    breaker = CircuitBreaker(1, 1.0, 1.0, clock=clock)
    breaker.failed()
    clock.now += 1.0
    assert breaker.allow()
    breaker.released()
    assert breaker.allow()


def test_zero_failures_never_opens():
    breaker = CircuitBreaker(0, 1.0, 1.0)
    for _ in range(100):
        breaker.failed()
    assert breaker.allow() and breaker.num_trips == 0


def test_bad_breaker_options_name_the_option():
    with pytest.raises(BackendConfigError, match="breaker_backoff"):
        open_backend("memory://?breaker_backoff=0s")
    with pytest.raises(BackendConfigError, match="breaker_failures"):
        open_backend("memory://?breaker_failures=-1")


def test_a_hung_redis_costs_one_timeout_per_back_off(start_redis, pages):
    """12 calls against a paused server: the first 2 each wait out their timeout, then the
    breaker fails the rest at once (misses, puts not acknowledged, nothing present), counted.
    Once the server answers again, the probe after the back-off closes the breaker."""
    server = start_redis()
    url = f"{server.url}?timeout=300ms&breaker_failures=2&breaker_backoff=1s&prefix=brk:"
    keys = [pages.key(i, "brk") for i in range(4)]
    data = [pages.page(k, PAGE_BYTES) for k in keys]

    async def body():
        async with open_backend(url, layout=pages.LAYOUT) as store:
            assert await store.batch_put(keys, data) == [True] * 4
            with server.paused():
                _, views = pages.pool_views(4, PAGE_BYTES)
                outcomes = []
                for _ in range(4):
                    outcomes.append(await store.batch_get(keys, views))
                    outcomes.append(await store.batch_put(keys, data))
                    outcomes.append(await store.batch_exists(keys))
                stats = store.stats()
                assert stats.num_timeouts == 2
                assert stats.num_short_circuited == 10
                assert stats.num_breaker_trips == 1 and stats.breaker_state == "open"
                assert outcomes == [[False] * 4, [False] * 4, 0] * 4
            await asyncio.sleep(1.05)
            assert await store.batch_exists(keys) == 4  # the probe: answered, closed
            assert store.stats().breaker_state == "closed"
            assert await store.batch_get(keys, views) == [True] * 4

    asyncio.run(body())
