"""Fair shares of a limited number of slots (calls in flight, BatchPut streams) among tenants.

Each of `num_tenants` tenants is guaranteed `share = total // num_tenants` slots (at least 1).
A tenant past its share may borrow an idle slot only while every other tenant could still
take the rest of its own share: so a tenant at its limit never causes another's refusal, and
a lone busy tenant still uses capacity the others leave idle. (With more tenants than slots
the guarantee cannot hold; each then gets 1 slot, first come first served.)
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable


class FairShares:
    def __init__(self, total: int, num_tenants: int) -> None:
        if total < 1 or num_tenants < 1:
            raise ValueError(f"FairShares needs total >= 1 and num_tenants >= 1, got {total}")
        self.total = total
        self.num_tenants = num_tenants
        self.share = max(total // num_tenants, 1)
        self.in_use: Counter[Hashable] = Counter()
        self.num_in_use = 0

    def may_take(self, tenant: Hashable) -> bool:
        """Whether `tenant` may take one more slot now."""
        held = self.in_use[tenant]
        if self.num_in_use >= self.total:
            return False
        if held < self.share:
            return True
        # Borrowing: leave every other (known or not yet seen) tenant the rest of its share.
        others_seen = [t for t in self.in_use if t != tenant]
        unseen = max(self.num_tenants - 1 - len(others_seen), 0)
        reserve = unseen * self.share + sum(
            max(self.share - self.in_use[t], 0) for t in others_seen
        )
        return self.num_in_use + 1 + reserve <= self.total

    def take(self, tenant: Hashable) -> None:
        self.in_use[tenant] += 1
        self.num_in_use += 1

    def give_back(self, tenant: Hashable) -> None:
        self.in_use[tenant] -= 1
        self.num_in_use -= 1
        if not self.in_use[tenant]:
            del self.in_use[tenant]
