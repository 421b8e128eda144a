"""Rendezvous (highest-random-weight) hashing: which of several servers owns a page key.

Every client that lists the same servers picks the same owner for a key, with no coordination;
adding or removing one server of N moves only about 1/N of the keys (those it wins or owned).
A server is identified by its address as written in the URL ("host:port"), so list servers
by the same names on every client.
"""

from __future__ import annotations

from collections.abc import Sequence

import xxhash


class Rendezvous:
    """Owners of keys among `servers` (their names, e.g. "10.0.0.5:50051")."""

    def __init__(self, servers: Sequence[str]) -> None:
        if not servers:
            raise ValueError("rendezvous hashing needs at least one server")
        if len(set(servers)) != len(servers):
            raise ValueError(f"servers are listed twice: {sorted(servers)}")
        self.servers = tuple(servers)
        self._seeds = [xxhash.xxh3_64_intdigest(name.encode()) for name in self.servers]

    def owner(self, key: bytes) -> int:
        """Index of the server that owns `key`."""
        if len(self._seeds) == 1:
            return 0
        scores = [xxhash.xxh3_64_intdigest(key, seed) for seed in self._seeds]
        return max(range(len(scores)), key=scores.__getitem__)

    def split(self, keys: Sequence[bytes]) -> dict[int, list[int]]:
        """Positions of `keys` grouped by owning server (in key order within each group)."""
        groups: dict[int, list[int]] = {}
        for position, key in enumerate(keys):
            groups.setdefault(self.owner(key), []).append(position)
        return groups
