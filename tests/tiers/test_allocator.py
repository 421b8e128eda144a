"""PageAllocator: allocation order, exhaustion, and frees that must leave nothing changed."""

from __future__ import annotations

import random

import numpy as np
import pytest

from tiers.allocator import PageAllocator
from tiers.errors import PageIdError, PoolExhaustedError


def test_fresh_allocator_hands_out_ascending_ids():
    allocator = PageAllocator(8)
    assert allocator.alloc(3) == [0, 1, 2]
    assert allocator.alloc(2) == [3, 4]
    assert (allocator.num_free, allocator.num_used, allocator.num_pages) == (3, 5, 8)
    allocator.check_invariants()


def test_alloc_zero_returns_nothing_and_negative_is_rejected():
    allocator = PageAllocator(2)
    assert allocator.alloc(0) == []
    with pytest.raises(ValueError, match="alloc"):
        allocator.alloc(-1)


def test_exhaustion_raises_with_numbers_and_allocates_nothing():
    allocator = PageAllocator(4, name="device pool")
    allocator.alloc(3)
    with pytest.raises(PoolExhaustedError, match="cannot allocate 2 pages, 1 of 4") as info:
        allocator.alloc(2)
    assert (info.value.requested, info.value.num_free, info.value.num_pages) == (2, 1, 4)
    assert allocator.num_free == 1
    assert allocator.alloc(1) == [3]
    with pytest.raises(PoolExhaustedError):
        allocator.alloc(1)
    allocator.check_invariants()


def test_freed_ids_are_reused():
    allocator = PageAllocator(4)
    first = allocator.alloc(4)
    allocator.free([first[1], first[3]])
    assert sorted(allocator.alloc(2)) == [first[1], first[3]]
    allocator.check_invariants()


def test_double_free_is_an_error_and_frees_nothing():
    allocator = PageAllocator(4)
    ids = allocator.alloc(3)
    allocator.free([ids[0]])
    with pytest.raises(PageIdError, match="double free of page 0"):
        allocator.free([ids[1], ids[0]])
    assert allocator.is_allocated(ids[1])  # the good id in the failed call was not freed
    assert allocator.num_free == 2
    allocator.check_invariants()


def test_free_of_never_allocated_id_is_an_error():
    allocator = PageAllocator(4)
    allocator.alloc(1)
    with pytest.raises(PageIdError, match="page 2 was never allocated"):
        allocator.free([0, 2])
    assert allocator.is_allocated(0)
    allocator.check_invariants()


@pytest.mark.parametrize("bad", [-1, 4, 100, 1.0, "1", True, None])
def test_free_rejects_ids_out_of_range_or_not_integers(bad):
    allocator = PageAllocator(4)
    allocator.alloc(4)
    with pytest.raises(PageIdError):
        allocator.free([1, bad])
    assert allocator.num_free == 0


def test_free_rejects_an_id_listed_twice():
    allocator = PageAllocator(4)
    allocator.alloc(2)
    with pytest.raises(PageIdError, match="listed twice"):
        allocator.free([1, 1])
    assert allocator.num_used == 2


def test_numpy_integer_ids_are_accepted():
    allocator = PageAllocator(4)
    ids = np.array(allocator.alloc(2), dtype=np.int64)
    allocator.free(ids)
    assert allocator.num_free == 4


def test_check_invariants_detects_corruption():
    allocator = PageAllocator(4)
    allocator.alloc(2)
    allocator._free.append(0)  # page 0 is allocated: now it is on both sides
    with pytest.raises(AssertionError):
        allocator.check_invariants()


@pytest.mark.parametrize("num_pages", [0, -1, 2.5, True])
def test_bad_num_pages_is_rejected(num_pages):
    with pytest.raises(ValueError, match="num_pages"):
        PageAllocator(num_pages)


def test_random_operations_match_a_set_model():
    rng = random.Random(0)
    allocator = PageAllocator(64)
    held: set[int] = set()
    for _ in range(2000):
        if rng.random() < 0.5:
            n = rng.randint(0, 10)
            if n > 64 - len(held):
                with pytest.raises(PoolExhaustedError):
                    allocator.alloc(n)
            else:
                ids = allocator.alloc(n)
                assert len(set(ids)) == n and not held & set(ids)
                held |= set(ids)
        elif held:
            ids = rng.sample(sorted(held), rng.randint(1, len(held)))
            allocator.free(ids)
            held -= set(ids)
        assert allocator.num_free == 64 - len(held)
        allocator.check_invariants()


def test_pages_have_owners_and_only_the_owner_frees_or_hands_them_on():
    allocator = PageAllocator(4)
    mine = allocator.alloc(2, owner="a request")
    theirs = allocator.alloc(1, owner="the index")
    assert [allocator.owner_of(page) for page in mine + theirs] == ["a request"] * 2 + ["the index"]
    with pytest.raises(PageIdError, match="the index owns it"):
        allocator.free(mine + theirs, owner="a request")  # nothing is freed
    assert allocator.num_free == 1
    allocator.give(mine[:1], "a request", "the index")
    assert sorted(allocator.owned_by("the index")) == sorted(mine[:1] + theirs)
    allocator.free(mine[1:], owner="a request")
    assert allocator.owner_of(mine[1]) is None
    allocator.check_invariants()
