"""A generous bound on a call that must return, for tests that check a call does not hang:
a hang fails the test after `WITHIN_S`; nothing is timed (tests never assert durations)."""

from __future__ import annotations

import concurrent.futures
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
