"""A test double for a slow L3: the real file backend, with reads that sleep first.

`slowfile:///path?delay=0.2&capacity=...` behaves exactly like `file:///path?...` except
that every read batch (`_fetch`, `_fetch_into`) and every lookup (`_exists`) first waits
`delay` seconds on the event loop, as a slow network store would. Tests use it to show what
the prefetch policies do when L3 is slow.

`slowfile:///path?gate=NAME` holds every read batch until the test lets it through:
`gate(NAME).release(n)` lets n batches read, so what has landed when the test looks is
decided by the test, not by how fast a loaded machine runs.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit

from storage_backends.file_store import FileBackend, FileOptions
from storage_backends.options import options_from_query
from storage_backends.registry import register_backend

_GATES: dict[str, threading.Semaphore] = {}


def gate(name: str) -> threading.Semaphore:
    """The gate `slowfile://...?gate=NAME` reads wait at: `release(n)` lets n batches read."""
    return _GATES.setdefault(name, threading.Semaphore(0))


class SlowFileBackend(FileBackend):
    scheme = "slowfile"

    def __init__(
        self, options: FileOptions, layout, *, name: str, delay_s: float, gate_name: str = ""
    ) -> None:
        super().__init__(options, layout, name=name)
        self.delay_s = delay_s
        self.gate = gate(gate_name) if gate_name else None

    async def _before_read(self) -> None:
        await asyncio.sleep(self.delay_s)
        while self.gate is not None and not self.gate.acquire(blocking=False):
            await asyncio.sleep(0.002)  # (cancellable: a read the call gave up on stops here)

    async def _fetch(self, keys, sizes):
        await self._before_read()
        return await super()._fetch(keys, sizes)

    async def _fetch_into(self, keys, views, guard):
        await self._before_read()
        return await super()._fetch_into(keys, views, guard)

    async def _exists(self, keys):
        await asyncio.sleep(self.delay_s / 4)
        return await super()._exists(keys)


def open_slow_file(url: str, *, layout=None, name: str = "") -> SlowFileBackend:
    parts = urlsplit(url)
    query = dict(parse_qsl(parts.query))
    delay_s = float(query.pop("delay", "0"))
    gate_name = query.pop("gate", "")
    options = options_from_query(
        FileOptions, urlencode(query), url=name or url, path=unquote(parts.path)
    )
    return SlowFileBackend(options, layout, name=name or url, delay_s=delay_s, gate_name=gate_name)


register_backend("slowfile", open_slow_file, replace=True)


def slow_file_url(directory: Path, delay_s: float, timeout: str = "5s") -> str:
    return f"slowfile://{directory}?capacity=1GiB&delay={delay_s}&timeout={timeout}"
