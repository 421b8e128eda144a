"""`LoopThread`: an asyncio event loop in a daemon thread of its own.

The one way in this project for a caller that is not async (an engine's thread, the
controller) to run backend coroutines: every coroutine of a backend runs on the one loop
its connections were made on, whatever thread asks.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class LoopThread:
    """An event loop running in a daemon thread named `name`."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, coroutine: Coroutine[Any, Any, T], timeout_s: float | None = None) -> T:
        """Run `coroutine` on the loop and wait for its result (at most `timeout_s`: then
        `concurrent.futures.TimeoutError`, and the coroutine is cancelled)."""
        if threading.current_thread() is self._thread:
            coroutine.close()
            raise RuntimeError("a LoopThread was called from its own loop: await instead")
        future = asyncio.run_coroutine_threadsafe(coroutine, self.loop)
        try:
            return future.result(timeout_s)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise

    def spawn(self, coroutine: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Start `coroutine` on the loop without waiting for it."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the loop and join its thread; the loop is closed if the thread ended."""
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=timeout_s)
        if not self._thread.is_alive():
            self.loop.close()
