"""WorkerPool: threads a backend can walk away from when one is stuck for good."""

from __future__ import annotations

import threading
import time

import pytest

from storage_backends.workers import WorkerPool, overlapped, share


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


def test_a_caller_that_submits_on_each_result_stays_on_one_thread():
    """Work counts as finished before its waiter hears of it, so a caller that submits its
    next work as soon as it has a result finds the thread idle and starts no other (here the
    waiter's callback dawdles on the worker, as an event loop's wake-up can; a Mooncake call
    made from a different thread each time ran at half speed)."""
    pool = WorkerPool(4, thread_name_prefix="test-pool")
    threads = []
    for _ in range(5):
        go = threading.Event()

        def work(go=go) -> None:
            go.wait(5)
            threads.append(threading.current_thread().name)

        future = pool.submit(work)
        future.add_done_callback(lambda _: time.sleep(0.02))  # runs on the worker, after
        go.set()
        future.result(5)
    pool.shutdown()
    assert len(threads) == 5 and len(set(threads)) == 1


def test_calls_one_after_another_run_on_the_thread_that_went_idle_last():
    """Once work that came at once has started several threads, calls made one after
    another still run on one of them (work goes to the thread idle for the shortest time)."""
    pool = WorkerPool(3, thread_name_prefix="test-lifo")
    # Three threads, each holding one of the three at once: a thread scheduled late would
    # otherwise find the work done and go idle after the calls below began (the last to go
    # idle takes the next work, as it should, and the calls would run on two threads).
    started = threading.Barrier(3)
    together = [pool.submit(started.wait, 5) for _ in range(3)]
    assert sorted(future.result(5) for future in together) == [0, 1, 2]
    names = [pool.submit(lambda: threading.current_thread().name).result(5) for _ in range(8)]
    assert len({t.name for t in threading.enumerate() if t.name.startswith("test-lifo")}) == 3
    pool.shutdown()
    assert len(set(names)) == 1


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


@pytest.mark.parametrize("num_threads", [0, 1, 3])
def test_overlapped_moves_in_order_with_the_cpu_work_beside_it(num_threads):
    """Chunks move in order on the calling thread; each is prepared before it moves and
    finished after, whether a helper or the caller did that work (0: no pool at all)."""
    pool = WorkerPool(num_threads, thread_name_prefix="test-pool") if num_threads else None
    log: list[tuple[str, int]] = []
    lock = threading.Lock()

    def note(what: str, chunk: int) -> None:
        with lock:
            log.append((what, chunk))

    def before(chunk: int) -> int:
        note("before", chunk)
        return chunk * 10

    def move(chunk: int, prepared: int) -> int:
        assert prepared == chunk * 10
        note("move", chunk)
        return chunk + 100

    def after(chunk: int, moved: int) -> str:
        assert moved == chunk + 100
        note("after", chunk)
        return f"done {chunk}"

    out = overlapped(pool, [0, 1, 2, 3], move, before=before, after=after)
    assert out == ["done 0", "done 1", "done 2", "done 3"]
    assert [chunk for what, chunk in log if what == "move"] == [0, 1, 2, 3]
    for chunk in range(4):
        order = [what for what, c in log if c == chunk]
        assert order == ["before", "move", "after"]
    assert overlapped(pool, [5], move, before=before) == [105]
    if pool is not None:
        pool.shutdown()


def test_overlapped_waits_for_its_helpers_when_a_move_fails():
    """A move that raises: the error comes back only once no helper still runs (they touch
    memory the caller is about to give back)."""
    pool = WorkerPool(2, thread_name_prefix="test-pool")
    started, release, finished = threading.Event(), threading.Event(), threading.Event()

    def after(chunk: int, moved: int) -> int:
        started.set()
        release.wait(10)
        finished.set()
        return moved

    def move(chunk: int, _: object) -> int:
        if chunk == 1:
            assert started.wait(10)  # chunk 0's check is running on the helper
            release.set()
            raise OSError("the store went away")
        return chunk

    with pytest.raises(OSError, match="went away"):
        overlapped(pool, [0, 1, 2], move, after=after)
    assert finished.is_set()
    pool.shutdown()
