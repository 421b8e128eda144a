"""What every side of a bench_backends.py case shares: the pages it moves (`Workload`) and the
layout label they are framed under (a figure is rounded by `benchmarks.common.sig`). The ceilings
(backend_ceilings.py), the servers and the latency probe (backend_servers.py) and the runner
(bench_backends.py) build on it; it imports none of them."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import numpy as np
import xxhash

LAYOUT = "mha;layers=32;page=64;kv_heads=8;head_dim=128;dtype=bfloat16"  # an opaque label here

Timed = Callable[[], Awaitable[None]]


class Workload:
    """Batches of random pages, and one reusable "L2 pool" to read into.

    Every repetition writes new keys (`start_rep`), as fresh traffic would: rewriting the same
    keys would measure the filesystem replacing files instead of storing pages.

    With `streams` > 1 the batches are moved by that many callers at once (`streams_of`),
    each putting from and reading into pages of its own (`sources`, `intos`), as concurrent
    requests' loads do.
    """

    def __init__(
        self, page_bytes: int, batch_pages: int, total_bytes: int, seed: int, streams: int = 1
    ) -> None:
        rng = np.random.default_rng(seed)
        self.page_bytes = page_bytes
        self.seed = seed
        self.streams = streams
        self.num_batches = max(streams, total_bytes // (page_bytes * batch_pages))
        self.pages = [rng.bytes(page_bytes) for _ in range(batch_pages)]
        self.pool = bytearray(page_bytes * batch_pages * streams)
        self.intos = self._stream_pages(self.pool)
        self.into = self.intos[0]
        # The same pages as one "L2 pool" of their own, for a backend that takes a lent pool
        # (and the raw Mooncake client, which puts from registered memory): a copy for each
        # stream, as concurrent requests put pages of their own.
        self.source = bytearray(b"".join(self.pages) * streams)
        self.sources = self._stream_pages(self.source)
        self.rep = 0
        self.all_batches: list[list[bytes]] = []
        # Untimed, after each repetition: sides that drop the repetition's pages (a store
        # whose holder would otherwise fault in fresh memory for every repetition's puts).
        self.forgetters: list[Callable[[list[list[bytes]]], Awaitable[None]]] = []
        self.start_rep(0)

    def start_rep(self, rep: int) -> None:
        self.rep = rep
        self.batches = [
            [
                xxhash.xxh3_128_digest(f"{self.seed}:{self.page_bytes}:{rep}:{b}:{i}".encode())
                for i in range(len(self.pages))
            ]
            for b in range(self.num_batches)
        ]
        self.all_batches += self.batches

    def _stream_pages(self, buffer: bytearray) -> list[list[memoryview]]:
        """`buffer`'s pages, a batch's worth for each stream in turn."""
        view, size, per = memoryview(buffer), self.page_bytes, len(self.pages)
        return [
            [view[(j * per + i) * size : (j * per + i + 1) * size] for i in range(per)]
            for j in range(self.streams)
        ]

    def streams_of(self, batches: list[list[bytes]]) -> list[list[list[bytes]]]:
        """`batches` dealt out to the `streams` callers in turn."""
        return [batches[j :: self.streams] for j in range(self.streams)]

    @property
    def total_bytes(self) -> int:
        return self.num_batches * len(self.pages) * self.page_bytes
