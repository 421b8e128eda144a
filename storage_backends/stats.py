"""What a backend reports: its usage, its counters, and its warnings, rate-limited.

Library code never logs per page: a warning of one kind is logged at most once per interval,
and the next one says how many were held back.
"""

from __future__ import annotations

import logging
import time
import types
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
    num_dropped: int = 0  # refused objects removed on read (a store whose put keeps what it has)
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


class Tally:
    """A backend's counters and warnings: what its calls count, and how they say so.

    `counts` holds the plain counters by name (those of `BackendStats`), `corrupt` the pages
    refused by `CorruptReason` value; `page_error` is the latest error of a single page,
    which the next rate-limited warning quotes.
    """

    def __init__(self, name: str, warn_interval_s: float) -> None:
        self.counts: Counter[str] = Counter()
        self.corrupt: Counter[str] = Counter()
        self.warnings = RateLimitedWarnings(name, warn_interval_s)
        self.page_error = ""

    def warn_page_errors(self, op: str, num_pages: int) -> None:
        detail = f" (latest: {self.page_error})" if self.page_error else ""
        self.warnings.warn(f"page_error:{op}", f"{op}: {num_pages} pages failed{detail}")

    def count_reads(self, found: list[bool], read_bytes: int, corrupt: Counter[str]) -> None:
        hits = sum(found)
        self.counts["hits"] += hits
        self.counts["misses"] += len(found) - hits
        self.counts["read_bytes"] += read_bytes
        if corrupt:
            self.count_refused(corrupt, "on read")

    def count_refused(self, refused: Counter[str], when: str) -> None:
        """Count objects refused by reason; forged ones (no valid MAC) on their own."""
        forged = refused.pop("forged", 0)  # (CorruptReason.FORGED)
        if forged:
            self.counts["forged"] += forged
            self.warnings.warn(
                f"forged {when}",
                f"refused {forged} pages {when} without a valid MAC for this tenant's secret "
                "(written by someone without it)",
            )
        if refused:
            self.corrupt.update(refused)
            described = ", ".join(f"{n} {reason}" for reason, n in sorted(refused.items()))
            self.warnings.warn(f"corrupt {when}", f"refused corrupt pages {when}: {described}")

    def snapshot(self, name: str, usage: Usage, breaker) -> BackendStats:
        """The counters as `BackendStats`, with the backend's `usage` and its `breaker`'s."""
        c = self.counts
        return BackendStats(
            backend=name,
            num_objects=usage.num_objects,
            stored_bytes=usage.stored_bytes,
            capacity_bytes=usage.capacity_bytes,
            num_hits=c["hits"],
            num_misses=c["misses"],
            num_puts=c["puts"],
            num_put_rejected=c["put_rejected"],
            num_errors=c["errors"],
            num_timeouts=c["timeouts"],
            num_reconnects=c["reconnects"],
            num_evictions=usage.num_evictions,
            num_corrupt=types.MappingProxyType(dict(self.corrupt)),
            num_forged=c["forged"],
            read_bytes=c["read_bytes"],
            written_bytes=c["written_bytes"],
            num_abandoned=c["abandoned"],
            num_dropped=c["dropped"],
            num_short_circuited=c["short_circuited"],
            num_breaker_trips=breaker.num_trips,
            breaker_state=breaker.state.value,
        )
