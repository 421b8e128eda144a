"""SWA encoder replay: the late window a hit rebuilds is the one a cold prefill builds."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine_integration.engine import Engine
from engine_integration.request import RequestState
from engine_integration.sampling import SamplingParams
from engine_integration.scheduler import plan_late_runs
from tests.support.engines import ENGINE, cache_off, random_prompt, run_one

ONE = SamplingParams(max_new_tokens=1)  # the request ends right after its prefill


def _same_window(a, b):
    assert torch.equal(a.positions, b.positions)
    assert torch.equal(a.kv, b.kv)


@pytest.mark.parametrize(
    ("length", "boundary", "window", "expected"),
    [
        (100, 0, 32, [(68, 100)]),  # cold: the last W prompt tokens
        (10, 0, 32, [(0, 10)]),  # shorter than W: all of it
        (100, 80, 32, [(48, 100)]),  # short suffix: replay joins the suffix
        (100, 48, 32, [(16, 48), (68, 100)]),  # the suffix sees part of the replay
        (100, 37, 32, [(68, 100)]),  # suffix >= 2W - 1: the replay is invisible, skipped
        (100, 16, 32, [(68, 100)]),
        (40, 16, 32, [(0, 40)]),  # a hit shorter than W replays what exists
    ],
)
def test_plan_late_runs(length, boundary, window, expected):
    assert plan_late_runs(length, boundary, window) == expected


def test_window_after_hit_equals_split_prefill_window(small_model, engines):
    engine = engines(small_model)
    first = random_prompt(1, 150)
    run_one(engine, first, ONE)
    second = first[:120] + random_prompt(2, 20)  # hit 112: replay [80, 112), suffix [112, 140)
    hit = engine.add_request(second, ONE)
    engine.run()
    assert hit.metrics.total_hit_tokens == 112 and hit.metrics.replayed_tokens == 32
    baseline = cache_off(small_model)
    split = baseline.add_request(second, ONE, split_at=112)
    baseline.run()
    _same_window(hit.window, split.window)
    assert hit.window.held_positions() == list(range(108, 140))


def test_replay_rebuilds_the_window_of_a_prefill_ending_at_the_hit(small_model, engines):
    """Stop right after the replay rows: the window equals that of a cold prompt that
    ends at H, which is what the cold path had when it crossed the boundary."""
    config = dataclasses.replace(ENGINE, prefill_chunk_tokens=32)  # step 1 = the replay
    engine = engines(small_model, config=config)
    first = random_prompt(3, 150)
    run_one(engine, first, ONE)
    hit = engine.add_request(first[:120] + random_prompt(4, 20), ONE)
    engine.step()
    assert hit.state == RequestState.PREFILL and hit.cursor == 112
    cold = cache_off(small_model)
    prefix = cold.add_request(first[:112], ONE)
    cold.run()
    _same_window(hit.window, prefix.window)
    engine.run()


def test_hit_shorter_than_the_window_replays_what_exists(small_model, engines):
    engine = engines(small_model)
    first = random_prompt(5, 40)
    run_one(engine, first, ONE)
    second = first[:20] + random_prompt(6, 10)  # hit 16 < W = 32
    hit = engine.add_request(second, ONE)
    engine.run()
    assert hit.metrics.total_hit_tokens == 16
    assert hit.metrics.replayed_tokens == 16  # [0, 16): all the cached tokens there are
    baseline = cache_off(small_model)
    split = baseline.add_request(second, ONE, split_at=16)
    baseline.run()
    _same_window(hit.window, split.window)


def test_long_suffix_skips_the_replay_and_equals_a_plain_cold_prefill(small_model, engines):
    """Past 2W - 1 new tokens the suffix cannot see the replayed window: no replay, and
    the hit equals the cold, unsplit prefill bit for bit."""
    engine = engines(small_model)
    first = random_prompt(7, 80)
    run_one(engine, first)
    second = first[:70] + random_prompt(8, 90)  # hit 64, suffix 96 >= 63
    params = SamplingParams(max_new_tokens=4, return_logits=True)
    hit = run_one(engine, second, params)
    assert hit.metrics.total_hit_tokens == 64 and hit.metrics.replayed_tokens == 0
    cold = run_one(cache_off(small_model), second, params)
    assert hit.token_ids == cold.token_ids
    assert torch.equal(hit.logits, cold.logits)


def test_late_window_never_reaches_the_cache(small_model, engines):
    """Only the source layers' KV is in the tiers' layout; the window stays engine-side."""
    engine: Engine = engines(small_model, l2_pages=16)
    assert engine.cache.layout.num_layers == small_model.config.num_source_layers
    request = engine.add_request(random_prompt(9, 50), ONE)
    engine.run()
    assert request.window.kv.shape[:2] == (small_model.config.num_late_layers, 32)
