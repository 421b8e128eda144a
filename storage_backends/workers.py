"""WorkerPool: the threads a backend runs blocking calls on, which it can walk away from.

A `concurrent.futures.ThreadPoolExecutor` cannot be left behind: its threads are joined when
it shuts down and again when the interpreter exits, so one thread stuck in a system call
that never returns (an `open` on a hung NFS or FUSE mount) makes `close()` and the process
exit hang with it. Here the threads are daemon threads and `shutdown(wait=False)` returns at
once; `stopped()` says when the last one has finished, so a caller can wait for it as long as
it chooses, and `num_pending()` how much work it would abandon by not waiting longer.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

T = TypeVar("T")


class WorkerPool(concurrent.futures.Executor):
    """At most `max_workers` daemon threads, started as work arrives (an Executor, so
    `loop.run_in_executor` takes it). Queued work may be cancelled through its future."""

    def __init__(self, max_workers: int, thread_name_prefix: str) -> None:
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        self._max_workers = max_workers
        self._prefix = thread_name_prefix
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._num_threads = 0
        self._num_live = 0
        self._num_pending = 0  # submitted and not taken off the queue and finished
        self._unfinished: set[concurrent.futures.Future] = set()
        self._shut = False
        self._stopped: concurrent.futures.Future = concurrent.futures.Future()

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any):
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._shut:
                raise RuntimeError(f"{self._prefix}: the pool is shut down")
            self._num_pending += 1
            self._unfinished.add(future)
            self._queue.put((future, fn, args, kwargs))
            if self._num_pending > self._num_threads < self._max_workers:
                self._start_thread()  # more work than threads: one more, up to the limit
        return future

    def _start_thread(self) -> None:
        self._num_threads += 1
        self._num_live += 1
        thread = threading.Thread(
            target=self._work, name=f"{self._prefix}_{self._num_threads}", daemon=True
        )
        thread.start()

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                break
            future, fn, args, kwargs = item
            result = error = None
            running = future.set_running_or_notify_cancel()
            if running:
                try:
                    result = fn(*args, **kwargs)
                except BaseException as exc:  # handed to whoever waits on the future
                    error = exc
            # Counted as finished before the waiter hears of it: a caller that submits its
            # next work as soon as it has the result finds this thread idle, and does not
            # start another (sequential calls stay on one thread: a Mooncake call made from
            # a different thread each time ran at half speed).
            with self._lock:
                self._num_pending -= 1
                self._unfinished.discard(future)
            if running and error is not None:
                future.set_exception(error)
                error = None  # (no reference cycle through the traceback)
            elif running:
                future.set_result(result)
        with self._lock:
            self._num_live -= 1
            last = self._num_live == 0
        if last:
            self._stopped.set_result(None)

    def num_pending(self) -> int:
        """Work submitted and not finished: queued, or running (perhaps stuck); cancelled
        work is not counted."""
        with self._lock:
            return sum(1 for future in self._unfinished if not future.done())

    def stopped(self) -> concurrent.futures.Future:
        """Done once the pool is shut down and every thread has finished its work."""
        return self._stopped

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Let the threads finish what is queued and stop; `wait` blocks until they have
        (which is forever if one is stuck: prefer waiting on `stopped()` with a bound)."""
        with self._lock:
            if not self._shut:
                self._shut = True
                if cancel_futures:
                    self._cancel_queued()
                for _ in range(self._num_live):
                    self._queue.put(None)
                if self._num_live == 0:
                    self._stopped.set_result(None)
        if wait:
            self._stopped.result()

    def _cancel_queued(self) -> None:
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if item is not None and item[0].cancel():
                self._num_pending -= 1
                self._unfinished.discard(item[0])


_DONE = object()


def share(
    pool: WorkerPool | None, tasks: Sequence[T], work: Callable[[T], None], threads: int
) -> None:
    """`work(task)` for every task, on this thread and up to `threads - 1` helpers from
    `pool`; returns once every task is done (the first exception raised, once all are).

    Each thread claims the next task in turn. A helper that has not started by the time this
    thread runs out of tasks is cancelled, and one that starts late finds nothing to do, so a
    busy pool never holds the work up (this thread then does it all), and a worker of `pool`
    may call this itself without waiting on a queue its own work is behind.
    """
    if not tasks:
        return
    pending = iter(tasks)
    lock = threading.Lock()

    def claim_all() -> None:
        while True:
            with lock:
                task = next(pending, _DONE)
            if task is _DONE:
                return
            work(task)

    helpers: list[concurrent.futures.Future] = []
    for _ in range(min(threads, len(tasks)) - 1 if pool is not None else 0):
        try:
            helpers.append(pool.submit(claim_all))
        except RuntimeError:  # shut down (the backend is closing): no helpers
            break
    try:
        claim_all()
    finally:
        errors = [
            helper.exception() for helper in helpers if not helper.cancel()
        ]  # (a started helper finishes the task it claimed, then finds none left)
    for error in errors:
        if error is not None:
            raise error


def overlapped(
    pool: WorkerPool | None,
    chunks: Sequence[T],
    move: Callable[[T, Any], Any],
    *,
    before: Callable[[T], Any] | None = None,
    after: Callable[[T, Any], Any] | None = None,
) -> list[Any]:
    """`move(chunk, before(chunk))` for each chunk in order on this thread, with the CPU work
    around it overlapped: `before` of the next chunk and `after(chunk, moved)` of the one
    just moved run on a helper from `pool` while this thread moves the next. Returns, per
    chunk, what `after` made of it (or what `move` returned, without `after`).

    A helper that has not started when its result is needed is cancelled and its work done
    here (a busy pool never holds this up; a worker of `pool` may call this). Every helper
    has finished when this returns or raises: none still touches the chunks' memory.
    """
    futures: list[concurrent.futures.Future] = []

    def ahead(fn: Callable[..., Any], *args: Any) -> tuple:
        try:
            future = pool.submit(fn, *args) if pool is not None else None
        except RuntimeError:  # shut down: done here when needed
            future = None
        if future is not None:
            futures.append(future)
        return future, fn, args

    def result(pending: tuple) -> Any:
        future, fn, args = pending
        if future is None or future.cancel():
            return fn(*args)
        return future.result()

    try:
        prepared = before(chunks[0]) if before is not None and chunks else None
        done: list[Any] = []
        for k, chunk in enumerate(chunks):
            last = k + 1 == len(chunks)
            following = ahead(before, chunks[k + 1]) if before is not None and not last else None
            moved = move(chunk, prepared)
            if after is None:
                done.append((None, lambda value: value, (moved,)))
            elif last:
                done.append((None, after, (chunk, moved)))
            else:
                done.append(ahead(after, chunk, moved))
            if following is not None:
                prepared = result(following)
        return [result(pending) for pending in done]
    finally:
        for future in futures:
            if not future.cancel():
                concurrent.futures.wait([future])
