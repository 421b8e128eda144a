"""A match looks its prompt up from the root of the index once; every later step of that
request walks up from the node it holds.

Before, one L3 hit looked the prompt up from the root 6 + k times (k: read batches landing
during the wait): the match, the keys past it, indexing what L3 holds, the run to fetch,
the L2 part before the first batch, each landed batch, and the final lock. The lookups are
counted by wrapping the tree's methods that start at the root.
"""

from __future__ import annotations

import pytest

from hicache.ops import PrefetchOp
from radix.keys import page_keys
from radix.tree import RadixTree
from tests.support.hostile import (
    CALM,
    LAYOUT,
    HostileExecutor,
    HostileL3,
    hostile_cache,
    namespace,
    new_store,
    page_bytes,
    put,
    wrong_pages,
)

SIZE = LAYOUT.page_size
ROOT_LOOKUPS = ("match_prefix", "insert", "insert_l3")  # the tree's walks from the root


@pytest.fixture
def root_lookups(monkeypatch) -> list[str]:
    """Every lookup from the root the tree makes, by method name, in order."""
    calls: list[str] = []
    for name in ROOT_LOOKUPS:
        method = getattr(RadixTree, name)

        def counted(self, *args, _method=method, _name=name, **kwargs):
            calls.append(_name)
            return _method(self, *args, **kwargs)

        monkeypatch.setattr(RadixTree, name, counted)
    return calls


def land_in_batches(executor: HostileExecutor, batch_pages: int) -> list[int]:
    """Make the executor's prefetches land `batch_pages` pages per wait; returns the list
    that records how many pages each wait landed."""
    landings: list[int] = []

    def wait_ready(op: PrefetchOp, num_pages: int, timeout_s) -> bool:
        if op.done:
            return True
        before = op.num_ready
        for index in range(before, min(op.num_pages, before + batch_pages)):
            payload = executor.store.get(op.keys[index])
            if payload is None:  # L3 lost it: the read ends here
                executor.finish(op)
                break
            executor.host[op.host_page_ids[index]] = payload
            op.num_ready = index + 1
        landings.append(op.num_ready - before)
        if op.num_ready == op.num_pages:
            executor.finish(op)
        return True

    executor.wait_ready = wait_ready
    return landings


def fill_l3(store: HostileL3, tokens, ns, first_page: int) -> None:
    for key in page_keys(tokens, ns, SIZE)[first_page:]:
        store.put(key, page_bytes(key, LAYOUT.num_layers))


def test_an_l3_hit_looks_its_prompt_up_from_the_root_once(root_lookups):
    store = new_store()
    cache, executor = hostile_cache(
        l1_pages=16, l2_pages=16, store=store, faults=CALM, prefetch_policy="wait_complete"
    )
    ns = namespace()
    tokens = list(range(12 * SIZE))
    put(cache, executor, tokens[: 2 * SIZE], ns)  # pages 0-1 in L1
    fill_l3(store, tokens, ns, first_page=2)  # pages 2-11 only in L3
    landings = land_in_batches(executor, batch_pages=3)
    root_lookups.clear()
    match = cache.match(tokens, ns)
    assert (match.num_l1_pages, match.num_l2_pages, match.num_l3_pages) == (2, 0, 10)
    assert landings == [3, 3, 3, 1]  # k = 4 batches landed while the match waited
    assert root_lookups == ["match_prefix"]  # was 6 + k = 10
    assert wrong_pages(cache, executor, tokens, ns, match) == []
    cache.release(match)
    cache.check_invariants()


def test_a_prefetched_prompt_is_looked_up_once_by_each_call(root_lookups):
    store = new_store()
    cache, executor = hostile_cache(
        l1_pages=16, l2_pages=16, store=store, faults=CALM, prefetch_policy="wait_complete"
    )
    ns = namespace()
    tokens = list(range(8 * SIZE))
    fill_l3(store, tokens, ns, first_page=0)
    land_in_batches(executor, batch_pages=2)
    root_lookups.clear()
    assert cache.prefetch(tokens, ns) == 8
    assert root_lookups == ["match_prefix"]  # was 4: match, keys past it, index, fetch cut
    root_lookups.clear()
    match = cache.match(tokens, ns)  # waits on the prefetch already running
    assert match.num_l3_pages == 8
    assert root_lookups == ["match_prefix"]
    assert wrong_pages(cache, executor, tokens, ns, match) == []
    cache.release(match)
    cache.check_invariants()


def test_a_match_whose_l3_pages_left_the_index_meanwhile_walks_up_to_what_is_left():
    """The node a match holds may leave the index while it waits (L3 lost the pages the
    prefetch was cut at): it walks up to the deepest run still indexed, and hands out
    only the pages that arrived."""
    store = new_store()
    cache, executor = hostile_cache(
        l1_pages=16, l2_pages=16, store=store, faults=CALM, prefetch_policy="wait_complete"
    )
    ns = namespace()
    tokens = list(range(8 * SIZE))
    fill_l3(store, tokens, ns, first_page=0)
    for key in page_keys(tokens, ns, SIZE)[5:]:
        store.objects.pop(key)  # found by the lookup's `exists`, gone when read
    executor.l3_exists = lambda keys, timeout_s: len(keys)
    land_in_batches(executor, batch_pages=8)
    match = cache.match(tokens, ns)
    assert match.num_l3_pages == 5
    assert wrong_pages(cache, executor, tokens, ns, match) == []
    cache.release(match)
    cache.check_invariants()
