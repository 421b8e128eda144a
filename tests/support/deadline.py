"""Generous bounds for tests: on a call that must return (`within_deadline`) and on a state
that must come (`wait_until`); a hang fails the test after `WITHIN_S`, and nothing is timed
(tests never assert durations, nor sleep for a time and hope)."""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

WITHIN_S = 60.0


def within_deadline(fn: Callable[..., T], *args: object, timeout_s: float = WITHIN_S) -> T:
    """`fn(*args)` on a helper thread; its result, or TimeoutError once `timeout_s` passed."""
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="deadline")
    try:
        return pool.submit(fn, *args).result(timeout=timeout_s)
    finally:
        pool.shutdown(wait=False)  # (a hung call is left behind: the test has failed)


def wait_until(predicate: Callable[[], object], what: str, timeout_s: float = WITHIN_S) -> None:
    """Poll `predicate` until it holds; AssertionError naming `what` once `timeout_s` passed."""
    end = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError(f"still waiting after {timeout_s:.0f} s for {what}")
        time.sleep(0.005)
