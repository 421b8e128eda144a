"""SharedClients: one client per process and settings, shared by the backends that use it.

Some store clients are heavy: a Mooncake client starts about twenty threads and a few listening
ports of its own, and one that lends memory to the store lends it once per client. A process
that opens many backends on one store (the cache-server daemon, a backend per namespace) shares
one client among them: `acquire` makes it on first use, `release` closes it when its last user
lets go. Each user keeps its own state (its prefix, its registered buffer).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from typing import Any


class SharedClients:
    """Clients by key, counted by users. Thread-safe; `make` and `close` may block."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # held while a client is made: one per key, ever
        self._entries: dict[Hashable, list] = {}  # key -> [client, number of users]

    def acquire(self, key: Hashable, make: Callable[[], Any]) -> Any:
        """The client of `key`, made by `make()` if nobody holds one (its error propagates)."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                entry = self._entries[key] = [make(), 0]
            entry[1] += 1
            return entry[0]

    def release(self, key: Hashable, close: Callable[[Any], object]) -> None:
        """One user fewer; the last one's release closes the client with `close(client)`."""
        with self._lock:
            entry = self._entries[key]
            entry[1] -= 1
            if entry[1]:
                return
            del self._entries[key]
        close(entry[0])

    def num_clients(self) -> int:
        with self._lock:
            return len(self._entries)
