"""A test double for a slow L3: the real file backend, with reads that sleep first.

`slowfile:///path?delay=0.2&capacity=...` behaves exactly like `file:///path?...` except
that every read batch (`_fetch`, `_fetch_into`) and every lookup (`_exists`) first waits
`delay` seconds on the event loop, as a slow network store would. Tests use it to show what
the prefetch policies do when L3 is slow.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit

from storage_backends.file_store import FileBackend, FileOptions
from storage_backends.options import options_from_query
from storage_backends.registry import register_backend


class SlowFileBackend(FileBackend):
    scheme = "slowfile"

    def __init__(self, options: FileOptions, layout, *, name: str, delay_s: float) -> None:
        super().__init__(options, layout, name=name)
        self.delay_s = delay_s

    async def _fetch(self, keys, sizes):
        await asyncio.sleep(self.delay_s)
        return await super()._fetch(keys, sizes)

    async def _fetch_into(self, keys, views, guard):
        await asyncio.sleep(self.delay_s)
        return await super()._fetch_into(keys, views, guard)

    async def _exists(self, keys):
        await asyncio.sleep(self.delay_s / 4)
        return await super()._exists(keys)


def open_slow_file(url: str, *, layout=None, name: str = "") -> SlowFileBackend:
    parts = urlsplit(url)
    query = dict(parse_qsl(parts.query))
    delay_s = float(query.pop("delay", "0"))
    options = options_from_query(
        FileOptions, urlencode(query), url=name or url, path=unquote(parts.path)
    )
    return SlowFileBackend(options, layout, name=name or url, delay_s=delay_s)


register_backend("slowfile", open_slow_file, replace=True)


def slow_file_url(directory: Path, delay_s: float, timeout: str = "5s") -> str:
    return f"slowfile://{directory}?capacity=1GiB&delay={delay_s}&timeout={timeout}"
