"""The simulator runs the live cache's policy code: the same trace through a live `HiCache`
(real executor: CPU tensors, the memory:// L3 backend) and through the simulator gives the
same hits, tier by tier.

Both sides have L1, L2 and L3 of the same size in pages. The live side runs requests the
way an engine does (match, allocate, insert, release; `flush` makes the background L3
writes land before the next step, as the simulator's instant links do) and trims L1 to its
capacity after each request, as the simulator's trace player does. The simulated hardware has
links and compute of unbounded speed, so every transfer ends the moment it starts, as CPU
copies do; with `wait_complete` prefetch the result does not depend on timing at all.
"""

from __future__ import annotations

import math

import pytest

from hicache.config import HiCacheConfig, L1Config, L2Config, L3Config, PolicyConfig
from hicache.controller import HiCache
from hicache.simulate import TracePlayer
from hicache.simulate.config import SimulationConfig
from hicache.simulate.hardware import HardwareSpec
from hicache.simulate.models import ModelSpec
from hicache.simulate.trace import ConversationWorkload, Trace, generate_conversations
from storage_backends.objects import header_size
from tests.support.caches import NS

PAGE_SIZE = 4
TINY = ModelSpec(
    name="tiny",
    attention="gqa",
    num_layers=2,
    hidden_size=8,
    num_heads=2,
    head_dim=4,
    num_kv_heads=1,
    vocab_size=1000,
    intermediate_size=16,
    kv_dtype="float32",
)
INSTANT = HardwareSpec(
    name="instant",
    hbm_bytes=1e12,
    host_bytes=1e12,
    host_link_bytes_per_s=math.inf,
    host_link_latency_s=0.0,
    nic_bytes_per_s=math.inf,
    bf16_flops=math.inf,
    fp8_flops=math.inf,
    gpu_hour_price=1.0,
)


@pytest.fixture(scope="module")
def trace() -> Trace:
    workload = ConversationWorkload(
        sessions=30,
        system_prompts=3,
        system_tokens=24,
        user_tokens=10,
        output_tokens=8,
        turns=3,
        think_s=20,
        rate=0.5,
        vocab=1000,
        seed=3,
    )
    return generate_conversations(workload)


def play_live(trace: Trace, l1_pages: int, l2_pages: int, l3_pages: int, policy) -> dict:
    layout = TINY.kv_layout(PAGE_SIZE)
    object_bytes = header_size(layout.descriptor()) + layout.bytes_per_page
    headroom = -(-trace.max_input_length // PAGE_SIZE)
    config = HiCacheConfig(
        layout=layout,
        l1=L1Config(device="cpu", num_pages=l1_pages + headroom),
        l2=L2Config(
            budget_bytes=l2_pages * layout.bytes_per_page, reserve_bytes=0, pin_memory=False
        ),
        l3=L3Config(url=f"memory://?capacity={l3_pages * object_bytes}" if l3_pages else None),
        policy=policy,
    )
    cache = HiCache(config)
    try:
        for request in trace.requests:
            tokens = request.token_bytes()
            match = cache.match(tokens, NS)
            new_ids = cache.alloc_device_pages(request.input_length // PAGE_SIZE - match.num_pages)
            cache.insert(tokens, match.device_page_ids + new_ids, NS)
            cache.release(match)
            cache.flush()
            over = cache.stats().l1_pages_used - l1_pages
            if over > 0:
                cache.evict("l1", over)
            cache.flush()
            cache.check_invariants()
        stats = cache.stats()
    finally:
        cache.close()
    return {"hits": stats.hit_tokens, "requests": stats.requests}


def play_simulated(trace: Trace, l1_pages: int, l2_pages: int, l3_pages: int, policy):
    page_bytes = TINY.kv_bytes_per_token * PAGE_SIZE
    config = SimulationConfig(
        model=TINY,
        hardware=INSTANT,
        page_size=PAGE_SIZE,
        gpus_per_instance=1,
        l1_bytes=l1_pages * page_bytes,
        l2_bytes=l2_pages * page_bytes,
        l3_bytes=l3_pages * page_bytes,
        l3_latency_s=0.0,
        policy=policy,
    )
    player = TracePlayer(config, trace)
    result = player.run()
    (cache,) = player.caches
    assert cache.stats().hit_tokens == {t: r.hit_tokens for t, r in result.tiers.items()}
    return {"hits": cache.stats().hit_tokens, "requests": cache.stats().requests}


@pytest.mark.parametrize(
    "l1_pages, l2_pages, l3_pages, write_policy, tiers_hit",
    [
        (12, 30, 200, "write_through", "l1 l2 l3"),  # every tier under pressure but L3
        (8, 20, 40, "write_through", "l1 l2 l3"),  # L3 evicts too
        (12, 30, 200, "write_back", "l1 l2 l3"),
        (8, 20, 40, "write_through_selective", "l1 l2"),  # backs up runs hit twice only
        (0, 40, 200, "write_through", "l2 l3"),  # no L1 cache at all
    ],
)
def test_live_cache_and_simulator_hit_the_same_tokens_per_tier(
    trace, l1_pages, l2_pages, l3_pages, write_policy, tiers_hit
):
    policy = PolicyConfig(write_policy=write_policy, prefetch_policy="wait_complete")
    live = play_live(trace, l1_pages, l2_pages, l3_pages, policy)
    simulated = play_simulated(trace, l1_pages, l2_pages, l3_pages, policy)
    assert simulated == live
    assert live["requests"] == trace.num_requests
    assert [tier for tier, hits in live["hits"].items() if hits] == tiers_hit.split()
