"""SyncBackend: the same calls, blocking, for callers that are not async (engine threads).

It owns an event loop running in a daemon thread and runs every call of the wrapped backend
there, so a backend's connections stay on one loop whatever thread calls. Calls block for at
most the backend's own timeout (plus copying pages already fetched).
"""

from __future__ import annotations

from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

from .base import StorageBackend
from .buffers import Buffer, PageBuffers
from .errors import BackendClosedError
from .loop_thread import LoopThread
from .registry import open_backend
from .stats import BackendStats

T = TypeVar("T")


class SyncBackend:
    def __init__(self, backend: StorageBackend) -> None:
        """Wrap a backend that no event loop has used yet; it now belongs to this wrapper."""
        self.backend = backend
        self._io = LoopThread(f"hicache-l3-{backend.scheme}")
        self._closed = False

    @classmethod
    def open(cls, url: str, *, layout: str | None = None) -> SyncBackend:
        """`SyncBackend(open_backend(url, layout=layout))`."""
        return cls(open_backend(url, layout=layout))

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        if self._closed:
            coro.close()
            raise BackendClosedError(f"{self.backend.name}: SyncBackend is closed")
        return self._io.run(coro)

    def connect(self) -> None:
        self._run(self.backend.connect())

    def batch_exists(self, keys: Sequence[bytes]) -> int:
        return self._run(self.backend.batch_exists(keys))

    def batch_get(self, keys: Sequence[bytes], into: Sequence[PageBuffers]) -> list[bool]:
        return self._run(self.backend.batch_get(keys, into))

    def batch_put(self, keys: Sequence[bytes], pages: Sequence[PageBuffers]) -> list[bool]:
        return self._run(self.backend.batch_put(keys, pages))

    def delete(self, keys: Sequence[bytes]) -> int:
        return self._run(self.backend.delete(keys))

    def batch_put_objects(
        self, keys: Sequence[bytes], blobs: Sequence[Buffer], *, verify: bool = True
    ) -> list[bool]:
        return self._run(self.backend.batch_put_objects(keys, blobs, verify=verify))

    def batch_get_objects(
        self, keys: Sequence[bytes], *, verify: bool = True
    ) -> list[bytes | None]:
        return self._run(self.backend.batch_get_objects(keys, verify=verify))

    def stats(self) -> BackendStats:
        return self.backend.stats()

    def close(self) -> None:
        """Close the backend and stop the loop thread. Idempotent."""
        if self._closed:
            return
        try:
            self._run(self.backend.close())
        finally:
            self._closed = True
            self._io.stop(timeout_s=None)

    def __enter__(self) -> SyncBackend:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"SyncBackend({self.backend!r})"
