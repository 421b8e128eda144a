"""CircuitBreaker: a backend that keeps failing is not asked again until it has had a rest.

Without one, a hung L3 (a Redis that accepts connections and never answers, a mount that
never returns) costs every call the whole backend timeout, and a cache that writes to L3 on
eviction pays it on every allocation. After `failures` calls in a row ended in a fault (a
timeout or a connection error), the breaker opens: calls fail at once (misses, puts not
acknowledged, nothing present) for `backoff_s`. Then one call goes through as a probe; if it
works the breaker closes, if it fails it opens again for twice as long (at most
`max_backoff_s`). Concurrent calls while the probe is out fail fast too.

Pure bookkeeping on the caller's event loop: no threads, no locks, no I/O.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable


class BreakerState(str, enum.Enum):
    CLOSED = "closed"  # calls go through
    OPEN = "open"  # calls fail fast until the back-off ends
    PROBING = "probing"  # one call is out to see whether the backend is back


class CircuitBreaker:
    def __init__(
        self,
        failures: int,
        backoff_s: float,
        max_backoff_s: float,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`failures` faults in a row open the breaker (0: never)."""
        self.failures = failures
        self.backoff_s = backoff_s
        self.max_backoff_s = max(max_backoff_s, backoff_s)
        self._clock = clock
        self.state = BreakerState.CLOSED
        self.num_trips = 0  # times it opened after faults in a row (failed probes not counted)
        self._in_a_row = 0
        self._open_for_s = backoff_s
        self._open_until = 0.0

    def allow(self) -> bool:
        """Whether a call may go through now (True for the one probe once the back-off ends:
        the caller then reports its outcome with `succeeded` or `failed`)."""
        if self.state is BreakerState.CLOSED:
            return True
        if self.state is BreakerState.OPEN and self._clock() >= self._open_until:
            self.state = BreakerState.PROBING
            return True
        return False

    def succeeded(self) -> bool:
        """A call worked; True if that closed an open breaker (the backend is back)."""
        reopened = self.state is not BreakerState.CLOSED
        self.state = BreakerState.CLOSED
        self._in_a_row = 0
        self._open_for_s = self.backoff_s
        return reopened

    def failed(self) -> bool:
        """A call ended in a fault; True if that opened the breaker."""
        if self.state is BreakerState.PROBING:  # still down: rest longer
            self._open_for_s = min(2 * self._open_for_s, self.max_backoff_s)
            self._open(count=False)
            return True
        self._in_a_row += 1
        if self.failures and self.state is BreakerState.CLOSED and self._in_a_row >= self.failures:
            self._open(count=True)
            return True
        return False

    def released(self) -> None:
        """The probe ended without an outcome (its caller was cancelled): probe again."""
        if self.state is BreakerState.PROBING:
            self.state = BreakerState.OPEN
            self._open_until = self._clock()

    def _open(self, *, count: bool) -> None:
        self.state = BreakerState.OPEN
        self._open_until = self._clock() + self._open_for_s
        self.num_trips += count

    @property
    def open_for_s(self) -> float:
        """How long the breaker stays open the next (or this) time."""
        return self._open_for_s
