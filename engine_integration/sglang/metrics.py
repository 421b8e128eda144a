"""The pages and GB/s of `HiCacheSGLangStorage`'s KV moves (`storage.py`), kept per call
for SGLang's storage metrics (`StorageMetrics`); hicache's own backend counters come from
the store.
"""

from __future__ import annotations

import threading


class Throughput:
    """The per-call pages and GB/s that SGLang's storage metrics histogram, since last read."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lists: dict[str, list[float]] = {
            "prefetch_pgs": [],
            "backup_pgs": [],
            "prefetch_bandwidth": [],
            "backup_bandwidth": [],
        }

    def record(self, kind: str, num_pages: int, num_bytes: int, elapsed_s: float) -> None:
        with self._lock:
            self._lists[f"{kind}_pgs"].append(num_pages)
            self._lists[f"{kind}_bandwidth"].append(num_bytes / max(elapsed_s, 1e-9) / 1e9)

    def take(self) -> dict[str, list[float]]:
        with self._lock:
            taken = {name: list(values) for name, values in self._lists.items()}
            for values in self._lists.values():
                values.clear()
        return taken
