"""WorkerPool: threads a backend can walk away from when one is stuck for good."""

from __future__ import annotations

import threading

import pytest

from storage_backends.workers import WorkerPool, share


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


def test_share_does_every_task_once_with_helpers_or_alone():
    """Every task done exactly once, whether helpers join or every worker is busy (then the
    caller does it all and does not wait for the queued helpers); the first error is raised
    once every task has run; a shut-down pool gives no helpers."""
    pool = WorkerPool(3, thread_name_prefix="test-share")
    done: list[int] = []
    lock = threading.Lock()

    def work(task: int) -> None:
        with lock:
            done.append(task)

    share(pool, list(range(50)), work, 3)
    assert sorted(done) == list(range(50))
    release = threading.Event()
    busy = [pool.submit(release.wait, 30) for _ in range(3)]
    done.clear()
    share(pool, list(range(20)), work, 3)  # helpers queue behind the busy workers
    assert sorted(done) == list(range(20))
    release.set()
    assert all(f.result(5) for f in busy)

    def failing(task: int) -> None:
        work(task)
        if task == 3:
            raise ValueError("task 3")

    done.clear()
    with pytest.raises(ValueError, match="task 3"):
        share(pool, list(range(8)), failing, 2)
    pool.shutdown()
    done.clear()
    share(pool, [1, 2], work, 4)
    assert sorted(done) == [1, 2]
