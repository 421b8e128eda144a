"""FairShares: a tenant at its limit never takes another's share; idle capacity is lent."""

from __future__ import annotations

import random

import pytest

from hicache.server.shares import FairShares


def test_a_tenant_at_its_share_leaves_the_others_theirs():
    shares = FairShares(total=8, num_tenants=2)  # 4 each
    while shares.may_take("a"):
        shares.take("a")
    assert shares.in_use["a"] == 4  # b is idle: its 4 stay free
    for _ in range(4):
        assert shares.may_take("b")
        shares.take("b")
    assert not shares.may_take("b") and not shares.may_take("a")
    shares.give_back("a")
    assert shares.may_take("a")


def test_a_lone_tenant_borrows_what_no_share_needs():
    shares = FairShares(total=9, num_tenants=2)  # 4 each, 1 spare
    while shares.may_take("a"):
        shares.take("a")
    assert shares.in_use["a"] == 5


def test_borrowing_stops_where_the_others_reserve_begins():
    shares = FairShares(total=10, num_tenants=3)  # 3 each, 1 left over
    for _ in range(4):
        assert shares.may_take("a")
        shares.take("a")
    assert not shares.may_take("a")  # 4 + 3 + 3 = 10: b and c keep theirs


@pytest.mark.parametrize("seed", range(20))
def test_no_tenant_below_its_share_is_ever_refused(seed):
    rng = random.Random(seed)
    shares = FairShares(total=rng.randint(2, 16), num_tenants=rng.randint(1, 4))
    tenants = [f"t{i}" for i in range(shares.num_tenants)]
    for _ in range(500):
        tenant = rng.choice(tenants)
        if shares.in_use[tenant] and rng.random() < 0.4:
            shares.give_back(tenant)
        elif shares.may_take(tenant):
            shares.take(tenant)
        else:
            assert shares.in_use[tenant] >= shares.share, "refused below its share"
        assert shares.num_in_use == sum(shares.in_use.values()) <= shares.total
