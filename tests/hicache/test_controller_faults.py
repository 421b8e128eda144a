"""The faults issue 16 reproduced in the controller, one regression test each.

Each drives the controller over the hostile executor of `tests.support.hostile`, where a
test decides exactly when each op finishes and what L3 acknowledges, and checks that every
page a match hands out holds its own prefix's KV.
"""

from __future__ import annotations

import pytest

from hicache.errors import BackgroundTransferError, HiCacheError
from radix.node import Tier
from tests.support.hostile import (
    CALM,
    LAYOUT,
    Faults,
    compute,
    expected_pages,
    hostile_cache,
    namespace,
    new_store,
    put,
    wrong_pages,
)

NS = namespace()
SIZE = LAYOUT.page_size


def tokens(prefix: int, num_pages: int) -> list[int]:
    return [prefix * 1000 + i for i in range(num_pages * SIZE)]


def finish_all(executor) -> None:
    executor.finish_some(executor.num_inflight)


def test_a_partial_l3_ack_while_match_makes_room_does_not_shift_its_page_ids():
    """Fault 1: making room in L1 applies a partially acknowledged L3 write, which splits
    a run the match had already listed; the ids must still be the prompt's pages in order."""
    store = new_store()
    cache, executor = hostile_cache(l1_pages=4, l2_pages=8, store=store)
    a = tokens(1, 2)  # run N: 2 pages
    m = a + tokens(2, 1)  # N's child M: 1 page
    put(cache, executor, a, NS)  # backup of N in flight
    [backup_n] = executor._inflight
    executor.finish(backup_n)
    cache.poll()  # N's backup applied: its L3 write W1 starts, and stays in flight
    [write_n] = executor._inflight
    ids = cache.alloc_device_pages(1)
    compute(executor, m, NS, ids, 2)
    holding_n = cache.match(a, NS)
    cache.insert(m, holding_n.device_page_ids + ids, NS)
    cache.release(holding_n)
    for op in list(executor._inflight):  # M's backup, then M's L3 write: done in full
        if op is not write_n:
            executor.finish(op)
    cache.poll()
    for op in list(executor._inflight):
        if op is not write_n:
            executor.finish(op)
    cache.poll()
    assert cache.evict("l1", 1) == 1  # M leaves L1 (N is pinned by W1)
    c = tokens(3, 2)
    put(cache, executor, c, NS)
    holding_c = cache.match(c, NS)  # L1 is full of pinned and locked pages
    executor.ack_pages = 1  # W1 acknowledges its first page only
    match = cache.match(m, NS)
    assert match.num_tokens == match.num_pages * SIZE
    assert wrong_pages(cache, executor, m, NS, match) == []
    cache.release(holding_c)
    new_ids = cache.alloc_device_pages(3 - match.num_pages)
    compute(executor, m, NS, new_ids, match.num_pages)
    cache.insert(m, match.device_page_ids + new_ids, NS)  # frees no page the index maps
    cache.release(match)
    executor.ack_pages = None
    finish_all(executor)
    cache.flush()
    cache.check_invariants()
    again = cache.match(m, NS)
    assert again.num_pages == 3
    assert wrong_pages(cache, executor, m, NS, again) == []
    cache.release(again)
    cache.close()


@pytest.mark.parametrize("policy", ["timeout", "best_effort"])
def test_insert_over_a_prefetch_in_flight_does_not_copy_its_pages_to_l2_twice(policy):
    """Fault 2: a second process prefetches, matches before the prefetch lands, and inserts
    the prompt; write-through must not back up the pages the prefetch is filling."""
    store = new_store()
    first, first_executor = hostile_cache(store=store)
    prompt = tokens(4, 3)
    put(first, first_executor, prompt, NS)
    first.flush()
    finish_all(first_executor)
    first.flush()
    first.close()
    assert len(store.objects) == 3

    cache, executor = hostile_cache(store=store, prefetch_policy=policy)
    assert cache.prefetch(prompt + [1], NS) == 3  # in flight
    executor.faults = Faults(finish_on_poll=0.0, progress_on_poll=0.0, wait_times_out=1.0)
    match = cache.match(prompt, NS)
    assert match.num_pages == 0
    ids = cache.alloc_device_pages(3)
    compute(executor, prompt, NS, ids, 0)
    cache.insert(prompt, ids, NS)
    cache.release(match)
    executor.faults = CALM
    finish_all(executor)  # the prefetch lands under pages now in L1
    cache.poll()
    finish_all(executor)
    cache.flush()
    cache.check_invariants()
    assert cache.evict("l1", 3) == 3
    again = cache.match(prompt, NS)
    assert again.num_pages == 3
    assert wrong_pages(cache, executor, prompt, NS, again) == []
    cache.release(again)
    cache.close()


def test_submit_raising_leaks_no_lock_and_close_returns():
    """Fault 3: an op whose submit raises is undone: no lock, no page, nothing in flight."""
    cache, executor = hostile_cache(write_policy="write_through")
    executor.faults = Faults(submit_raises=1.0, finish_on_poll=0.0, progress_on_poll=0.0)
    put(cache, executor, tokens(5, 2), NS)  # its backup's submit raises
    executor.faults = CALM
    with pytest.raises(BackgroundTransferError):
        cache.poll()  # the failure is reported, once
    cache.check_invariants()
    assert cache.pages_in_use("l2") == 0
    assert cache.evict("l1", 2) == 2  # nothing holds the run
    cache.close()  # returns: nothing is left in flight


def test_detach_l3_while_a_match_is_held_forgets_l3_and_detaches():
    """Fault 4: detach_l3 with a match held neither raises part way nor keeps L3 marks."""
    store = new_store()
    cache, executor = hostile_cache(store=store)
    prompt = tokens(6, 2)
    put(cache, executor, prompt, NS)
    finish_all(executor)
    cache.poll()
    finish_all(executor)
    cache.flush()
    held = cache.match(prompt, NS)
    cache.detach_l3()
    assert not executor.has_l3
    assert cache._tree.num_pages(Tier.L3) == 0
    cache.check_invariants()
    cache.release(held)
    cache.close()


def test_the_index_forgets_l3_pages_beyond_what_l3_can_hold():
    """Fault 5: L3-only pages in the index are bounded; the index does not grow forever."""
    store = new_store()
    cache, executor = hostile_cache(
        l1_pages=4, l2_pages=4, store=store, l3={"max_indexed_pages": 6}
    )
    for prefix in range(12):
        put(cache, executor, tokens(10 + prefix, 2), NS)
        finish_all(executor)
        cache.flush()
        finish_all(executor)
        cache.flush()
        store.objects.clear()  # L3 evicts everything it had
        assert cache._tree.num_pages_at_level(Tier.L3) <= 6  # L3-only pages
    cache.check_invariants()
    cache.close()


def test_priority_eviction_keeps_high_priority_pages_over_recent_ones():
    """Fault 6: a request's priority reaches the index; `priority` is not LRU in disguise."""
    cache, executor = hostile_cache(l2_pages=0, eviction_policy="priority")
    important = tokens(20, 2)
    ids = cache.alloc_device_pages(2)
    compute(executor, important, NS, ids, 0)
    cache.insert(important, ids, NS, priority=10)
    routine = tokens(21, 2)
    ids = cache.alloc_device_pages(2)
    compute(executor, routine, NS, ids, 0)
    cache.insert(routine, ids, NS, priority=0)
    assert cache.evict("l1", 2) == 2
    assert cache.cached_prefix(important, NS).num_l1_pages == 2
    assert cache.cached_prefix(routine, NS).num_l1_pages == 0
    cache.close()


def test_the_namespace_is_required():
    """Fault 7: no default namespace: forgetting it is an error, not a shared namespace."""
    cache, executor = hostile_cache()
    prompt = tokens(30, 1)
    for call in (cache.match, cache.prefetch, cache.cached_prefix):
        with pytest.raises(TypeError):
            call(prompt)
    with pytest.raises(TypeError):
        cache.insert(prompt, [0])
    cache.close()


def test_free_refuses_a_page_the_index_maps():
    """Ownership is exact: a request can't free (or insert as new) a page the index holds."""
    cache, executor = hostile_cache()
    prompt = tokens(40, 2)
    put(cache, executor, prompt, NS)
    match = cache.match(prompt, NS)
    with pytest.raises(HiCacheError):
        cache.free_device_pages(match.device_page_ids)
    other = tokens(41, 2)
    with pytest.raises(HiCacheError):
        cache.insert(other, match.device_page_ids, NS)  # someone else's pages
    cache.release(match)
    cache.check_invariants()
    assert expected_pages(prompt, NS)  # the helper itself works
    cache.close()
