"""WorkerPool: threads a backend can walk away from when one is stuck for good."""

from __future__ import annotations

import threading

import pytest

from storage_backends.workers import WorkerPool


def test_runs_work_and_hands_back_results_and_errors():
    pool = WorkerPool(2, thread_name_prefix="test-pool")
    assert pool.submit(sum, [1, 2, 3]).result(5) == 6
    with pytest.raises(ZeroDivisionError):
        pool.submit(lambda: 1 / 0).result(5)
    pool.shutdown()
    assert pool.stopped().done() and pool.num_pending() == 0
    with pytest.raises(RuntimeError, match="shut down"):
        pool.submit(sum, [])


def test_a_stuck_worker_is_left_behind_and_queued_work_can_be_cancelled():
    release = threading.Event()
    pool = WorkerPool(1, thread_name_prefix="test-pool")
    stuck = pool.submit(release.wait)
    queued = pool.submit(sum, [1])
    assert queued.cancel()  # not started: its one thread is stuck
    pool.shutdown(wait=False)  # returns at once
    assert not pool.stopped().done()
    assert pool.num_pending() == 1  # the stuck one (the cancelled one is settled)
    thread = [t for t in threading.enumerate() if t.name.startswith("test-pool")]
    assert thread and all(t.daemon for t in thread)  # the interpreter will not wait for it
    release.set()
    assert stuck.result(5) is True
    pool.stopped().result(5)
    assert pool.num_pending() == 0
