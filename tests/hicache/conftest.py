"""Fixtures for controller tests."""

from __future__ import annotations

import pytest

from hicache.controller import HiCache
from tests.support.caches import make_cache


@pytest.fixture
def cache_factory():
    made = []

    def factory(*args, **kwargs) -> HiCache:
        cache = make_cache(*args, **kwargs)
        made.append(cache)
        return cache

    yield factory
    for cache in made:
        cache.close()
