"""Continuous batching, chunked prefill, page reservation, aborts and prefetch hints."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from engine_integration.engine.core import Engine
from engine_integration.engine.embedded import CacheSizes, build_cache
from engine_integration.engine.errors import RequestTooLargeError
from engine_integration.engine.sampling import SamplingParams
from hicache.config import PolicyConfig
from hicache.controller import HiCache
from hicache.fetch_plan import attention_pairs
from tests.support.engines import ENGINE, GREEDY, cache_off, random_prompt, run_one

# The load-or-recompute choice as a server makes it (the engines fixture loads every tier).
MEASURED = PolicyConfig(write_policy="write_through", prefetch_policy="wait_complete")


def test_continuous_batching_gives_each_request_its_solo_result(small_model):
    config = dataclasses.replace(ENGINE, max_running_requests=2, prefill_chunk_tokens=24)
    engine = cache_off(small_model, config)
    prompts = [random_prompt(30 + i, 20 + 23 * i) for i in range(5)]
    requests = [engine.add_request(p, GREEDY) for p in prompts]
    running, outputs = [], {}
    while engine.has_work:
        for output in engine.step():
            outputs[output.request_id] = output
        running.append(len(engine.scheduler.running))
    assert max(running) == 2 and len(outputs) == 5
    for request, tokens in zip(requests, prompts, strict=True):
        solo = run_one(cache_off(small_model), tokens)
        assert outputs[request.request_id].token_ids == solo.token_ids
        assert torch.equal(outputs[request.request_id].logits, solo.logits)


def test_requests_wait_for_l1_pages_and_all_finish(small_model, engines):
    engine = engines(small_model, l1_pages=20)  # each request reserves 9 pages
    prompts = [random_prompt(40 + i, 130) for i in range(4)]
    for tokens in prompts:
        engine.add_request(tokens, GREEDY)
    most = 0
    outputs = []
    while engine.has_work:
        outputs.extend(engine.step())
        most = max(most, len(engine.scheduler.running))
    assert most == 2 and len(outputs) == 4
    engine.cache.check_invariants()
    engine.cache.evict("l1", 1000)
    assert engine.cache.stats().l1_pages_used == 0  # every page came back or was cached


def test_a_request_that_can_never_fit_is_refused(small_model, engines):
    engine = engines(small_model, l1_pages=4)
    with pytest.raises(RequestTooLargeError, match="4"):
        engine.add_request(random_prompt(1, 100), GREEDY)
    assert not engine.has_work


def test_abort_gives_back_pages_and_the_match(small_model, engines):
    engine = engines(small_model, l1_pages=32)
    tokens = random_prompt(2, 100)
    run_one(engine, tokens)
    request = engine.add_request(tokens[:90] + random_prompt(3, 40), SamplingParams(8))
    engine.step()
    assert request.match is not None and request.metrics.total_hit_tokens == 80
    engine.abort(request.request_id)
    assert not engine.has_work and request.finish_reason == "abort"
    engine.cache.check_invariants()
    engine.cache.evict("l1", 1000)
    assert engine.cache.stats().l1_pages_used == 0

    private = cache_off(small_model, num_pages=32)
    other = private.add_request(tokens, SamplingParams(8))
    private.step()
    private.abort(other.request_id)
    assert private.pages.allocator.num_free == 32


def test_bad_requests_are_refused(small_model, engines):
    engine = engines(small_model)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request([1, 2, 500], GREEDY)
    for bad in ([], [[1, 2]], [1.0, 2.0], "12"):
        with pytest.raises(ValueError, match="prompt token ids|non-empty"):
            engine.add_request(bad, GREEDY)
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingParams(max_new_tokens=0)


def test_a_new_cache_weighs_its_first_l3_run_by_the_models_earlier_steps(
    small_model, engines, tmp_path
):
    """What the model's steps cost before a cache was attached (a server's warm-up, an
    engine before it) seeds that cache's load-or-recompute choice. Its first L3 run, never
    read yet, is declined, and not even looked up, where no read would beat recomputing it
    (steps that cost 10 ms whatever their rows, as a launch-bound model's do on a GPU), and
    fetched where its tokens cost more than a first read of their pages (the priors: 2 ms of
    latency, 2 GB/s) and their trip over the link."""
    url = f"file://{tmp_path}/l3?capacity=64MiB"
    tokens = random_prompt(6, 120)
    writer = engines(small_model, l2_pages=64, l3_url=url)
    expected = run_one(writer, tokens)
    writer.cache.flush()
    writer.cache.close()
    earlier = list(small_model.step_costs)

    def first_l3_hit(per_step_s: float, per_row_s: float):
        small_model.step_costs.clear()
        for rows in (1, 8, 64, 128):
            small_model.step_costs.append(
                (rows, attention_pairs(0, rows), per_step_s + rows * per_row_s)
            )
        reader = engines(small_model, l2_pages=64, l3_url=url, policy=MEASURED)
        assert reader.cache.fetch_rates().num_compute_samples == 4
        output = run_one(reader, tokens)
        assert output.token_ids == expected.token_ids
        rates = reader.cache.fetch_rates()
        unasked = rates.lookups_skipped + reader.cache.stats().l3_lookups_spared
        return output.metrics.hit_tokens["l3"], unasked, rates.pages_declined

    try:
        # 7 pages, 84 KiB: 2 ms and 51 us at the priors against 11 ns of compute: neither
        # the queue-time prefetch nor the match looks the run up (the match, as its
        # admission comes within `L3Config.ask_again_s`, does not even weigh it)
        assert first_l3_hit(0.010, 1e-10) == (0, 2, 0)
        assert first_l3_hit(0.001, 1e-4) == (112, 0, 0)  # ... against 11 ms
    finally:
        small_model.step_costs.clear()
        small_model.step_costs.extend(earlier)


def test_best_effort_uses_what_the_queue_time_prefetch_brought(small_model, engines, tmp_path):
    url = f"file://{tmp_path}/l3?capacity=64MiB"
    tokens = random_prompt(4, 120)
    writer = engines(small_model, l2_pages=64, l3_url=url)
    run_one(writer, tokens)
    writer.cache.flush()
    writer.cache.close()
    policy = PolicyConfig(  # the whole run fetched, whatever the rates (they rest on timings)
        write_policy="write_through", prefetch_policy="best_effort", l3_fetch_policy="always"
    )
    reader = engines(small_model, l2_pages=64, l3_url=url, policy=policy)
    request = reader.add_request(tokens + [1, 2, 3], GREEDY)  # queued: prefetch starts
    deadline = time.monotonic() + 10
    while reader.cache.stats().prefetches_completed < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    reader.run()
    assert request.metrics.hit_tokens["l3"] == 112


@pytest.mark.parametrize("ask_again_s", [0.0, 60.0])
def test_a_request_waiting_for_l1_pages_asks_l3_once(small_model, tmp_path, ask_again_s):
    """Six requests, two at a time fit L1: each is looked up in L3 when it is queued, and
    again at its admission and at every step it waits for room, unless its last lookup
    stands (`L3Config.ask_again_s`, here longer than the test, so that no timing counts)."""
    policy = PolicyConfig(write_policy="write_through", l3_fetch_policy="always")
    sizes = CacheSizes(20, 40, f"file://{tmp_path}/l3?capacity=64MiB", policy)
    built = build_cache(small_model, ENGINE, sizes)
    built.close()
    l3 = dataclasses.replace(built.config.l3, ask_again_s=ask_again_s)
    cache = HiCache(dataclasses.replace(built.config, l3=l3))
    try:
        engine = Engine(small_model, ENGINE, cache=cache)
        prompts = [random_prompt(60 + i, 130) for i in range(6)]
        for tokens in prompts:
            engine.add_request(tokens, GREEDY)
        outputs = engine.run()
        stats = cache.stats()
    finally:
        cache.close()
    if ask_again_s:
        assert stats.l3_lookups == 6 and stats.l3_lookups_spared > 6
    else:  # each admission asked again: six of them, and the steps spent waiting for room
        assert stats.l3_lookups > 12 and stats.l3_lookups_spared == 0
    by_prompt = {tuple(o.prompt_token_ids): o.token_ids for o in outputs}
    for tokens in prompts:
        assert by_prompt[tuple(tokens)] == run_one(cache_off(small_model), tokens).token_ids
