"""Connection: the calls of a backend under a deadline, with connecting on first use,
reconnecting after a fault, a circuit breaker, and a close that gives up after a grace.

`StorageBackend` is one (`base`): what a call to a store means when the store fails is
decided here once. A call (`_call`) is made under `options.timeout_s`; a fault (a timeout, a
transient error) becomes `FAULT`, one count and a rate-limited warning, and the next call
reconnects; after `breaker_failures` faults in a row calls fail fast for the back-off, then
one probe goes through. The first use of a store that cannot be reached raises
`BackendUnavailableError`.
"""

from __future__ import annotations

import abc
import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import ClassVar, TypeVar

from .breaker import CircuitBreaker
from .errors import BackendClosedError, BackendUnavailableError
from .options import BackendOptions
from .stats import Tally

logger = logging.getLogger(__name__)

T = TypeVar("T")
_timeout = getattr(asyncio, "timeout", None)  # 3.11+: a deadline without a task per call


class Fault:
    """Returned by `_call` instead of a result when the call failed as a whole."""


FAULT = Fault()


class Connection(abc.ABC):
    """A store's calls under the deadline, the breaker and reconnects; its counters and
    warnings (`_tally`). Subclasses implement `_open` and `_close`."""

    transient_errors: ClassVar[tuple[type[BaseException], ...]] = (OSError,)

    def __init__(self, options: BackendOptions, name: str) -> None:
        self.options = options
        self.name = name
        self._tally = Tally(self.name, options.warn_interval_s)  # counters and warnings
        self._counts = self._tally.counts
        self._warnings = self._tally.warnings
        self._connect_lock = asyncio.Lock()
        self._connected = False
        self._ever_connected = False
        self._closed = False
        self._breaker = CircuitBreaker(
            options.breaker_failures, options.breaker_backoff_s, options.breaker_max_backoff_s
        )

    @abc.abstractmethod
    async def _open(self) -> None:
        """Connect (or create what is needed). Raise a transient error if unreachable."""

    @abc.abstractmethod
    async def _close(self) -> None:
        """Release connections and files; must not raise for an already broken connection."""

    async def _reconnect(self) -> None:
        """Drop the connection state after a fault and open again."""
        await self._close()
        await self._open()

    def _note_page_error(self, detail: str) -> None:
        """Backends record why a single page failed; the next rate-limited warning says it."""
        self._tally.page_error = detail

    async def connect(self) -> None:
        """Check the backend now: raises `BackendUnavailableError` if it cannot be used.

        Optional: the first call of any other method does the same.
        """
        self._check_open()
        await self._ensure_connected()

    async def close(self) -> None:
        """Release connections and files. Idempotent; later calls raise BackendClosedError.

        Returns within `close_grace` even when the backend hangs: work still under way then
        (a write to a hung mount, a reply that never comes) is abandoned, counted in
        `num_abandoned` and logged.
        """
        if self._closed:
            return
        self._closed = True
        self._connected = False
        grace = self.options.close_grace_s
        try:  # also after a fault or a failed first use: pools and clients may exist
            await asyncio.wait_for(self._close(), grace)
        except asyncio.TimeoutError:
            abandoned = max(1, self._abandon())
            self._counts["abandoned"] += abandoned
            logger.warning(
                "%s: close() gave up after %ss: %d operations still under way were abandoned "
                "(a hung backend; what they were writing is not stored)",
                self.name,
                grace,
                abandoned,
            )
        except self.transient_errors as exc:
            logger.debug("%s: error while closing: %s", self.name, exc)

    def _abandon(self) -> int:
        """`close()` ran out of grace: let go of what is stuck, without waiting; return how
        many operations are left unfinished (0 if the backend cannot tell)."""
        return 0

    async def __aenter__(self) -> Connection:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def _call(self, op: str, make: Callable[[], Awaitable[T]]) -> T | Fault:
        """Run one primitive under the deadline, connecting first; a fault becomes FAULT.
        While the circuit breaker is open the call is not made at all (FAULT at once)."""
        self._check_open()
        if self._ever_connected and not self._breaker.allow():
            self._counts["short_circuited"] += 1
            return FAULT
        outcome: bool | None = None  # the breaker's news: worked, faulted, or neither

        async def connected_then_run() -> T:
            await self._ensure_connected()
            return await make()

        try:
            if _timeout is None:  # Python 3.10
                result = await asyncio.wait_for(connected_then_run(), self.options.timeout_s)
            else:
                async with _timeout(self.options.timeout_s):  # no task per call
                    result = await connected_then_run()
            outcome = True
            return result
        except asyncio.TimeoutError:
            if not self._ever_connected:
                raise BackendUnavailableError(
                    f"{self.name}: no answer within {self.options.timeout_s}s on first use"
                ) from None
            outcome = False
            self._counts["timeouts"] += 1
            self._fault(op, f"timed out after {self.options.timeout_s}s")
        except self.transient_errors as exc:
            outcome = False
            self._counts["errors"] += 1
            self._fault(op, f"{type(exc).__name__}: {exc}")
        finally:
            self._tell_breaker(outcome)
        return FAULT

    def _tell_breaker(self, outcome: bool | None) -> None:
        if outcome is None:
            self._breaker.released()  # cancelled, or a surprise: no news about the backend
        elif outcome:
            if self._breaker.succeeded():
                logger.info("%s: answering again; circuit breaker closed", self.name)
        elif self._breaker.failed():
            self._warnings.warn(
                "breaker",
                f"circuit breaker open: calls fail fast for {self._breaker.open_for_s}s, "
                "then one is tried",
            )

    def _fault(self, op: str, what: str) -> None:
        self._connected = False  # reconnect on the next call
        self._warnings.warn(f"fault:{op}", f"{op} failed, returning misses: {what}")

    async def _ensure_connected(self) -> None:
        if self._connected:
            return
        async with self._connect_lock:
            if self._connected or self._closed:
                return
            if not self._ever_connected:
                try:
                    await self._open()
                except self.transient_errors as exc:
                    raise BackendUnavailableError(
                        f"{self.name}: cannot be reached: {type(exc).__name__}: {exc}"
                    ) from exc
                self._ever_connected = True
            else:
                self._counts["reconnects"] += 1
                await self._reconnect()
            self._connected = True

    def _check_open(self) -> None:
        if self._closed:
            raise BackendClosedError(f"{self.name}: backend is closed")
