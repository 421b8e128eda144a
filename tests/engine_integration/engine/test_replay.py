"""SWA encoder replay: after a hit, the late windows and logits are those of the unsplit,
uncached prefill (bit for bit), for K stacked window layers; the replayed rows run through
the late layers only, from the boundary residual stored in the pages."""

from __future__ import annotations

import pytest
import torch

from engine_integration.engine.core import Engine
from engine_integration.engine.embedded import load_model
from engine_integration.engine.sampling import SamplingParams
from engine_integration.engine.scheduler import late_rows
from tests.support.engines import ENGINE, SMALL, cache_off, random_prompt, run_one

ONE = SamplingParams(max_new_tokens=1, return_logits=True)  # ends right after its prefill
REACH = 2 * (32 - 1) + 1  # the small model: K = 2 late layers of W = 32


def _same_window(a, b):
    assert torch.equal(a.positions, b.positions)
    assert torch.equal(a.kv, b.kv)


@pytest.mark.parametrize(
    ("length", "num_late", "window", "expected"),
    [
        (100, 1, 32, (68, 100)),  # one layer: the last W
        (100, 2, 32, (37, 100)),  # two: 2 * (W - 1) + 1 = 63
        (100, 4, 32, (0, 100)),  # four reach past the start: every row
        (10, 2, 32, (0, 10)),
    ],
)
def test_late_rows_reach_k_windows_back(length, num_late, window, expected):
    assert late_rows(length, num_late, window) == expected


def _hit_and_cold(model, engines, first, second, params=ONE):
    engine = engines(model)
    run_one(engine, first, params)
    hit = engine.add_request(second, params)
    hit_output = {o.request_id: o for o in engine.run()}[hit.request_id]
    baseline = cache_off(model)
    cold = baseline.add_request(second, params)
    cold_output = {o.request_id: o for o in baseline.run()}[cold.request_id]
    return hit, hit_output, cold, cold_output


def test_window_after_hit_equals_the_unsplit_prefills(small_model, engines):
    first = random_prompt(1, 150)
    second = first[:120] + random_prompt(2, 20)  # hit 112, late rows [140 - 63, 140)
    hit, hit_output, cold, cold_output = _hit_and_cold(small_model, engines, first, second)
    assert hit.metrics.total_hit_tokens == 112
    assert hit.metrics.replayed_tokens == 112 - (140 - REACH)
    _same_window(hit.window, cold.window)
    assert hit.window.held_positions() == list(range(108, 140))
    assert torch.equal(hit_output.logits, cold_output.logits)


def test_hit_shorter_than_the_reach_replays_every_cached_token(small_model, engines):
    first = random_prompt(5, 40)
    second = first[:20] + random_prompt(6, 10)  # hit 16 < R
    hit, hit_output, cold, cold_output = _hit_and_cold(small_model, engines, first, second)
    assert hit.metrics.total_hit_tokens == 16 and hit.metrics.replayed_tokens == 16
    _same_window(hit.window, cold.window)
    assert torch.equal(hit_output.logits, cold_output.logits)


def test_long_suffix_needs_no_replay(small_model, engines):
    """A suffix of R or more new tokens holds every row the late layers need."""
    first = random_prompt(7, 80)
    second = first[:70] + random_prompt(8, 90)  # hit 64, suffix 96 >= 63
    params = SamplingParams(max_new_tokens=4, return_logits=True)
    hit, hit_output, _cold, cold_output = _hit_and_cold(small_model, engines, first, second, params)
    assert hit.metrics.total_hit_tokens == 64 and hit.metrics.replayed_tokens == 0
    assert hit_output.token_ids == cold_output.token_ids
    assert torch.equal(hit_output.logits, cold_output.logits)


def test_a_hit_runs_only_its_uncached_rows_through_the_source_layers(small_model, engines):
    """The replayed rows go through the late layers alone: their input, the source layers'
    output, comes back from the pages' boundary layers."""
    engine = engines(small_model)
    first = random_prompt(1, 150)
    run_one(engine, first, ONE)
    second = first[:120] + random_prompt(2, 20)  # hit 112, late rows [77, 140)
    engine.add_request(second, ONE)
    [(request, rows)] = engine.scheduler.schedule()
    assert (rows.start, rows.end) == (112, 140)  # no cached row recomputed
    assert rows.late_runs == [(140 - REACH, 140)]
    engine.run()
    assert request.metrics.computed_tokens == 140 - 112
    assert request.metrics.replayed_tokens == 112 - (140 - REACH)


def test_replay_reads_its_input_from_the_pages(small_model, engines):
    """Zeroing the cached pages' boundary layer changes the replayed window: the hit did not
    recompute it (the equality tests above show the stored values are the right ones)."""
    engine = engines(small_model)
    first = random_prompt(1, 150)
    run_one(engine, first, ONE)
    match = engine.cache.match(first[:112], engine.namespace)
    boundary = engine.cache.device_pool.layer(small_model.config.num_source_layers)
    boundary[torch.tensor(match.device_page_ids)] = 0
    engine.cache.release(match)
    second = first[:120] + random_prompt(2, 20)
    hit, _hit_output, cold, _cold_output = _hit_and_cold(small_model, engines, first, second)
    assert torch.equal(hit.window.kv, cold.window.kv)  # a fresh cache: the stored values
    tampered = engine.add_request(second, ONE)
    engine.run()
    assert not torch.equal(tampered.window.kv, cold.window.kv)


def test_boundary_padded_to_whole_layers_replays_exactly(engines):
    """hidden 64 in one slot of 2 x 3 x 16 = 96 values: 32 of padding."""
    config = SMALL.replace(num_heads=6, num_kv_heads=3, model_id="test-padded-boundary")
    model, _tokenizer = load_model(None, ENGINE, seed=3, model_config=config)
    assert config.num_boundary_layers == 1
    first = random_prompt(11, 150)
    second = first[:120] + random_prompt(12, 20)
    hit, hit_output, cold, cold_output = _hit_and_cold(model, engines, first, second)
    assert hit.metrics.replayed_tokens == 112 - (140 - REACH)
    _same_window(hit.window, cold.window)
    assert torch.equal(hit_output.logits, cold_output.logits)


def test_late_window_never_reaches_the_cache(small_model, engines):
    """The tiers hold the source layers' KV and the boundary residual; the window stays
    engine-side."""
    engine: Engine = engines(small_model, l2_pages=16)
    config = small_model.config
    assert config.num_boundary_layers == 1  # hidden 64 = 2 x 2 heads x 16
    assert engine.cache.layout.num_layers == config.num_source_layers + 1
    request = engine.add_request(random_prompt(9, 50), ONE)
    engine.run()
    assert request.window.kv.shape[:2] == (small_model.config.num_late_layers, 32)
