"""Write-through keeps an L2 copy of every L1 page. An L2 no larger than L1 then fills with
copies of runs still in L1, which were never eviction candidates: the next backups found no
room and were skipped (those pages never reached L3), and no L3 page fetched found room
either. The L2 copy of a run that L1 and L3 both hold is only a third copy: it makes room.
"""

from __future__ import annotations

from hicache.config import PolicyConfig
from hicache.simulate.l3 import SimulatedL3
from radix.keys import page_keys
from tests.support.caches import NS
from tests.support.virtual import settle, virtual_cache

L1_PAGES, L2_PAGES = 16, 8  # L2 smaller than L1: it holds the copies of two runs of four


def test_write_through_backs_up_and_writes_to_l3_every_run_when_l2_is_smaller_than_l1():
    store = SimulatedL3(capacity_pages=100)
    policy = PolicyConfig(write_policy="write_through", prefetch_policy="wait_complete")
    cache, executor = virtual_cache(store, l1_pages=L1_PAGES, l2_pages=L2_PAGES, policy=policy)
    runs = [list(range(100 * r, 100 * r + 16)) for r in range(4)]  # 4 runs of 4 pages: L1
    for tokens in runs:
        ids = cache.alloc_device_pages(4)
        cache.insert(tokens, ids, NS)
        settle(cache, executor)
        cache.check_invariants()
    assert cache.stats().writes_skipped == 0
    now = executor.now()
    assert [store.exists(page_keys(tokens, NS, 4), now) for tokens in runs] == [4] * 4
    assert cache.evict("l1", L1_PAGES) == L1_PAGES  # L3 holds them all: they leave L1
    match = cache.match(runs[0], NS)  # from L3, through L2, which has room for it
    assert match.num_l3_pages == 4
    cache.release(match)
    cache.check_invariants()


def test_an_l3_run_is_fetched_while_l2_holds_only_copies_of_a_full_l1():
    store = SimulatedL3(capacity_pages=100)
    policy = PolicyConfig(write_policy="write_through", prefetch_policy="wait_complete")
    cache, executor = virtual_cache(store, l1_pages=16, l2_pages=16, policy=policy)
    for r in range(4):  # L1 full, and L2 full of its copies (in L3 too)
        cache.insert(list(range(100 * r, 100 * r + 16)), cache.alloc_device_pages(4), NS)
        settle(cache, executor)
    other = list(range(1000, 1016))
    store.put(page_keys(other, NS, 4), visible_s=0.0)  # written by another instance
    match = cache.match(other, NS)
    assert match.num_l3_pages == 4
    cache.release(match)
    cache.check_invariants()
