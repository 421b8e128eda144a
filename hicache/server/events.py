"""The daemon's own KV events: the pages its namespaces store and drop, as L3 (`STORAGE`).

An engine's index publishes what it knows of L3; the daemon publishes what L3 holds: a put
it stored is a `BlockStored` (the page keys; no tokens, which the daemon never sees), a
delete or an eviction that leaves no copy (no spill, or a spill that refused the page) is a
`BlockRemoved`. Pages evicted to the spill are still held: no event. Imported only when the
daemon is started with `--events-endpoint`.
"""

from __future__ import annotations

from collections.abc import Sequence

from hicache.events import MEDIUM_STORAGE, BlockRemoved, BlockStored, EventPublisher
from storage_backends.objects import Buffer, parse_header


class DaemonEvents:
    def __init__(self, publisher: EventPublisher) -> None:
        self.publisher = publisher

    def stored(self, keys: Sequence[bytes], blobs: Sequence[Buffer]) -> None:
        by_size: dict[int, list[bytes]] = {}
        for key, blob in zip(keys, blobs, strict=True):
            by_size.setdefault(_page_size(blob), []).append(bytes(key))
        self.publisher.add(
            BlockStored(group, None, [], size, None, MEDIUM_STORAGE, None)
            for size, group in by_size.items()
        )

    def removed(self, keys: Sequence[bytes]) -> None:
        if keys:
            self.publisher.add((BlockRemoved([bytes(k) for k in keys], MEDIUM_STORAGE),))


def _page_size(blob: Buffer) -> int:
    """Tokens per page, from the object's layout descriptor (`...;page=64;...`); 0 if the
    descriptor does not say (the object was verified already: this is not a check)."""
    header = parse_header(blob)
    layout = getattr(header, "layout", b"").decode("utf-8", errors="replace")
    for part in layout.split(";"):
        name, _, value = part.partition("=")
        if name == "page" and value.isdigit():
            return int(value)
    return 0
