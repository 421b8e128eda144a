"""The daemon's own KV events: the pages its namespaces store and drop, as L3 (`STORAGE`).

An engine's index publishes what it knows of L3; the daemon publishes what L3 holds: a put
it stored is a `BlockStored` (the page keys; no tokens, which the daemon never sees), a
delete or an eviction that leaves no copy (no spill, or a spill that refused the page) is a
`BlockRemoved`. Pages evicted to the spill are still held: no event. Imported only when the
daemon is started with `--events-endpoint`.

A daemon with tokens publishes each namespace's events only to the tenants whose token may
use it: each token is a channel of the publisher (`EventPublisher`'s credentials), and a
subscriber logs in with its token (ZMQ PLAIN); one without a valid token receives nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

from hicache.events import MEDIUM_STORAGE, BlockRemoved, BlockStored, EventPublisher
from storage_backends.buffers import Buffer
from storage_backends.objects import parse_header


def channels(tokens: Sequence[tuple[str, frozenset[str] | None]]) -> tuple[dict, list]:
    """The publisher's credentials (token -> channel name) and each channel's namespaces
    (None: every one), for tokens with the namespaces each may use."""
    credentials, audiences = {}, []
    for i, (token, namespaces) in enumerate(tokens):
        credentials[token] = f"t{i}"
        audiences.append((f"t{i}", namespaces))
    return credentials, audiences


class DaemonEvents:
    """One namespace's events, to every channel that may see them ("" without tokens)."""

    def __init__(self, publisher: EventPublisher, channels: Sequence[str] = ("",)) -> None:
        self.publisher = publisher
        self.channels = tuple(channels)

    def _add(self, events: list) -> None:
        for channel in self.channels:
            self.publisher.add(events, channel)

    def stored(self, keys: Sequence[bytes], blobs: Sequence[Buffer]) -> None:
        by_size: dict[int, list[bytes]] = {}
        for key, blob in zip(keys, blobs, strict=True):
            by_size.setdefault(_page_size(blob), []).append(bytes(key))
        if by_size:
            self._add(
                [
                    BlockStored(group, None, [], size, None, MEDIUM_STORAGE, None)
                    for size, group in by_size.items()
                ]
            )

    def removed(self, keys: Sequence[bytes]) -> None:
        if keys:
            self._add([BlockRemoved([bytes(k) for k in keys], MEDIUM_STORAGE)])


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
