"""What a backend reports: its usage, its counters, and its warnings, rate-limited.

Library code never logs per page: a warning of one kind is logged at most once per interval,
and the next one says how many were held back.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple

logger = logging.getLogger(__name__)


class Usage(NamedTuple):
    """What a backend knows about its own contents (None where it cannot know cheaply)."""

    num_objects: int | None
    stored_bytes: int | None
    capacity_bytes: int | None
    num_evictions: int = 0


@dataclass(frozen=True)
class BackendStats:
    """Counters since the backend was built. Frozen: a snapshot, safe to hand to metrics."""

    backend: str  # the URL, password removed
    num_objects: int | None  # objects stored (None: the backend cannot count, e.g. Redis)
    stored_bytes: int | None  # bytes stored, headers included
    capacity_bytes: int | None
    num_hits: int  # pages batch_get / batch_get_objects returned
    num_misses: int  # pages they did not (absent, corrupt, or lost to a fault)
    num_puts: int  # pages stored
    num_put_rejected: int  # pages refused: no room, or (objects API) failed verification
    num_errors: int  # faults: failed calls, and pages that failed on their own
    num_timeouts: int  # calls that hit the deadline
    num_reconnects: int
    num_evictions: int
    num_corrupt: Mapping[str, int]  # refused reads (and object puts) by CorruptReason value
    read_bytes: int  # payload bytes returned
    written_bytes: int  # object bytes stored
    num_forged: int = 0  # refused reads (and object puts) without a valid MAC for our secret
    num_abandoned: int = 0  # operations close() left unfinished after its grace (a hung backend)
    num_short_circuited: int = 0  # calls failed fast by the open circuit breaker
    num_breaker_trips: int = 0  # times repeated faults opened the breaker
    breaker_state: str = "closed"  # closed | open | probing

    @property
    def num_corrupt_total(self) -> int:
        """Every page refused on read (or object put): corrupt, by any reason, or forged."""
        return sum(self.num_corrupt.values()) + self.num_forged


class RateLimitedWarnings:
    """At most one warning per kind per interval; the next one says how many were held back."""

    def __init__(self, name: str, interval_s: float) -> None:
        self._name = name
        self._interval_s = interval_s
        self._last: dict[str, float] = {}
        self._held: Counter[str] = Counter()

    def warn(self, kind: str, message: str) -> None:
        now = time.monotonic()
        last = self._last.get(kind)
        if last is not None and now - last < self._interval_s:
            self._held[kind] += 1
            return
        held = self._held.pop(kind, 0)
        self._last[kind] = now
        suffix = f" ({held} similar warnings suppressed)" if held else ""
        logger.warning("%s: %s%s", self._name, message, suffix)
