"""Eviction gives up on a victim it cannot evict, instead of taking it again forever.

Found by the simulator: under write_back, an L1 run whose only other copy below it is an
L3-only child must be written back before it leaves L1; when L2 has no room (its pages are
locked) the write-back fails and the run stays. The failed backup's lock and unlock put the
run back among the candidates, and `_make_room` took it again, forever.
"""

from __future__ import annotations

from hicache.config import PolicyConfig
from hicache.controller import HiCache
from hicache.simulate.l3 import SimulatedL3
from radix.keys import page_keys
from tests.support.caches import NS
from tests.support.virtual import virtual_cache


def make_cache(store: SimulatedL3) -> HiCache:
    policy = PolicyConfig(write_policy="write_back", prefetch_policy="wait_complete")
    return virtual_cache(store, l1_pages=16, l2_pages=4, policy=policy)[0]


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
