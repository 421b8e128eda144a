"""WorkerPool: the threads a backend runs blocking calls on, which it can walk away from.

A `concurrent.futures.ThreadPoolExecutor` cannot be left behind: its threads are joined when
it shuts down and again when the interpreter exits, so one thread stuck in a system call
that never returns (an `open` on a hung NFS or FUSE mount) makes `close()` and the process
exit hang with it. Here the threads are daemon threads and `shutdown(wait=False)` returns at
once; `stopped()` says when the last one has finished, so a caller can wait for it as long as
it chooses, and `num_pending()` how much work it would abandon by not waiting longer.
"""

from __future__ import annotations

import collections
import concurrent.futures
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

T = TypeVar("T")

_WAIT = object()


class _Slot:
    """Where an idle thread waits: work is handed straight to it (None: stop)."""

    __slots__ = ("item", "wake")

    def __init__(self) -> None:
        self.item: Any = None
        self.wake = threading.Lock()
        self.wake.acquire()  # released by hand()

    def hand(self, item: Any) -> None:
        self.item = item
        self.wake.release()

    def take(self) -> Any:
        self.wake.acquire()
        item, self.item = self.item, None
        return item


class WorkerPool(concurrent.futures.Executor):
    """At most `max_workers` daemon threads, started as work arrives (an Executor, so
    `loop.run_in_executor` takes it). Queued work may be cancelled through its future.

    Work goes to the thread that went idle last (a stack, not a queue of waiting threads), so
    calls one after another run on one thread, however many the pool has started for work
    that came at once: a Mooncake call made from a different thread each time ran at less
    than half speed here (32 x 64 KiB: 2.9-4.0 ms against 1.3-1.7 from one thread).
    """

    def __init__(self, max_workers: int, thread_name_prefix: str) -> None:
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        self._max_workers = max_workers
        self._prefix = thread_name_prefix
        self._lock = threading.Lock()
        self._queued: collections.deque = collections.deque()  # work no thread has taken
        self._idle: list[_Slot] = []  # threads waiting for work, the last to go idle last
        self._num_threads = 0
        self._num_live = 0
        self._num_pending = 0  # submitted and not finished (queued or running)
        self._unfinished: set[concurrent.futures.Future] = set()
        self._shut = False
        self._stopped: concurrent.futures.Future = concurrent.futures.Future()

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any):
        future: concurrent.futures.Future = concurrent.futures.Future()
        item = (future, fn, args, kwargs)
        with self._lock:
            if self._shut:
                raise RuntimeError(f"{self._prefix}: the pool is shut down")
            self._num_pending += 1
            self._unfinished.add(future)
            if self._idle:
                self._idle.pop().hand(item)  # the thread idle for the shortest time
            else:
                self._queued.append(item)
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

    def _after(self, slot: _Slot, done: concurrent.futures.Future | None) -> Any:
        """Count `done`'s work finished, then this thread's next work: queued work, None
        (stop), or _WAIT (it is idle now, on the stack: its next work comes through `slot`)."""
        with self._lock:
            if done is not None:
                self._finished(done)
            if self._queued:
                return self._queued.popleft()
            if self._shut:
                return None
            self._idle.append(slot)
            return _WAIT

    def _work(self) -> None:
        slot = _Slot()
        done: concurrent.futures.Future | None = None
        result: Any = None
        error: BaseException | None = None
        while True:
            # Counted finished, and idle, before the waiter hears of it: a caller that submits
            # its next work as soon as it has the result hands it to this same thread.
            item = self._after(slot, done)
            if done is not None and error is not None:
                done.set_exception(error)
            elif done is not None:
                done.set_result(result)
            done, result, error = None, None, None  # (no reference cycle through a traceback)
            if item is _WAIT:
                item = slot.take()
            if item is None:
                break
            future, fn, args, kwargs = item
            if not future.set_running_or_notify_cancel():
                with self._lock:
                    self._finished(future)
                continue
            try:
                result = fn(*args, **kwargs)
            except BaseException as exc:  # handed to whoever waits on the future
                error = exc
            done = future
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
                while self._idle:
                    self._idle.pop().hand(None)
                if self._num_live == 0:
                    self._stopped.set_result(None)
        if wait:
            self._stopped.result()

    def _cancel_queued(self) -> None:
        """Cancel the work no thread has taken (none of it runs: each cancel succeeds)."""
        for future, *_ in self._queued:
            future.cancel()
            self._finished(future)
        self._queued.clear()

    def _finished(self, future: concurrent.futures.Future) -> None:
        """Count `future`'s work over: run, failed or cancelled (the caller holds the lock)."""
        self._num_pending -= 1
        self._unfinished.discard(future)


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
