"""Fixtures for the engine tests: small models (shared) and engines with fresh caches."""

from __future__ import annotations

import pytest
import torch

from engine_integration.engine.core import Engine
from engine_integration.engine.embedded import CacheSizes, build_cache, load_model
from tests.support.engines import ENGINE, SMALL, TEST_POLICY


@pytest.fixture(autouse=True)
def one_torch_thread():
    """The models here are tiny: one thread is the fastest, and steady on a busy machine.
    (Batch invariance holds at any fixed thread count; test_model checks two.)"""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def small_model():
    model, _tokenizer = load_model(None, ENGINE, seed=1, model_config=SMALL)
    return model


@pytest.fixture(scope="session")
def source_only_model():
    config = SMALL.replace(num_source_layers=SMALL.num_layers, model_id="test-source-only")
    model, _tokenizer = load_model(None, ENGINE, seed=2, model_config=config)
    return model


@pytest.fixture
def engines():
    """make(model, ...) -> an Engine over a fresh cache; the caches are closed afterwards."""
    caches = []

    def make(
        model,
        *,
        l1_pages=64,
        l2_pages=0,
        l3_url=None,
        config=ENGINE,
        policy=TEST_POLICY,
    ) -> Engine:
        cache = build_cache(model, config, CacheSizes(l1_pages, l2_pages, l3_url, policy))
        caches.append(cache)
        return Engine(model, config, cache=cache)

    yield make
    for cache in caches:
        cache.close()
