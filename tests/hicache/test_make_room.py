"""Eviction gives up on a victim it cannot evict, instead of taking it again forever.

Found by the simulator: under write_back, an L1 run whose only other copy below it is an
L3-only child must be written back before it leaves L1; when L2 has no room (its pages are
locked) the write-back fails and the run stays. The failed backup's lock and unlock put the
run back among the candidates, and `_make_room` took it again, forever.
"""

from __future__ import annotations

from hicache.config import HiCacheConfig, L1Config, L2Config, L3Config, PolicyConfig
from hicache.controller import HiCache
from hicache.simulate.executor import Link, Links, VirtualExecutor
from hicache.simulate.l3 import SimulatedL3
from radix.keys import page_keys
from tests.support.caches import NS
from tiers.layout import KVLayout

LAYOUT = KVLayout(
    kind="mha", num_layers=1, page_size=4, dtype="float32", num_kv_heads=1, head_dim=2
)


def make_cache(store: SimulatedL3) -> HiCache:
    links = Links(
        device_to_host=Link("d2h", 1e9),
        host_to_device=Link("h2d", 1e9),
        host_latency_s=0.0,
        l3_write=(Link("out", 1e9),),
        l3_read=(Link("in", 1e9),),
        l3_latency_s=0.0,
    )
    executor = VirtualExecutor(
        num_device_pages=16,
        num_host_pages=4,
        page_bytes=LAYOUT.bytes_per_page,
        links=links,
        stores={"l3": store},
    )
    config = HiCacheConfig(
        layout=LAYOUT,
        l1=L1Config(num_pages=16),
        l2=L2Config(budget_bytes=4 * LAYOUT.bytes_per_page, reserve_bytes=0, pin_memory=False),
        l3=L3Config(url="sim://l3"),
        policy=PolicyConfig(write_policy="write_back", prefetch_policy="wait_complete"),
    )
    return HiCache(config, executor)


def put(cache: HiCache, tokens: list[int]) -> None:
    ids = cache.alloc_device_pages(len(tokens) // 4)
    cache.insert(tokens, ids, NS)


def test_a_run_that_cannot_be_written_back_stays_and_eviction_returns():
    store = SimulatedL3(capacity_pages=100)
    cache = make_cache(store)
    locked = list(range(1000, 1016))  # 4 pages that will fill L2, locked by a match
    put(cache, locked)
    assert cache.evict("l1", 4) == 4  # written back: L2 is full
    holding = cache.match(locked, NS)  # loaded into L1; its L2 pages stay locked
    prompt = list(range(32))  # 8 pages; L3 holds all of them, L1 will hold the first 4
    store.put(page_keys(prompt, NS, 4), visible_s=0.0)
    put(cache, prompt[:16])
    match = cache.match(prompt, NS)  # finds pages 4..7 in L3; no L2 room to fetch them
    assert match.num_pages == 4
    cache.release(match)
    # The first 4 pages are the only copy above an L3-only run, and L2 has no room for
    # their write-back: they stay, and evict says it freed nothing.
    assert cache.evict("l1", 4) == 0
    cache.check_invariants()
    cache.release(holding)
    assert cache.evict("l1", 8) == 8  # with L2 free again, both runs go
    cache.check_invariants()
