"""What the router knows of its replicas' caches: which tiers of each publisher hold each
page key (`PageIndex`, kept by one thread reading every subscription: `EventFeed`), the
prompts it routed a moment ago (`RecentPages`), and from those the prefix of a prompt a
replica can serve (`cached_prefix`). serve/router.py routes by them.
"""

from __future__ import annotations

import logging
import threading
import time

import zmq

from engine_integration.engine.sidecar_shape import SidecarKeys
from hicache.events import (
    TIER_OF_MEDIUM,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventSubscriber,
)
from hicache.routing import CachedPrefix
from radix.node import Tier

logger = logging.getLogger(__name__)

_L1, _L2, _L3 = (1 << (tier - 1) for tier in Tier)
RECENT_HOLD_S = 5.0  # how long a routed prompt counts as cached before its events confirm it


class PageIndex:
    """Which tiers of one publisher hold each page key, from its events."""

    def __init__(self) -> None:
        self._tiers: dict[bytes, int] = {}
        self.seq = -1  # the last batch applied

    def __len__(self) -> int:
        return len(self._tiers)

    def apply(self, events) -> None:
        tiers = self._tiers
        for event in events:
            if isinstance(event, BlockStored):
                bit = 1 << (TIER_OF_MEDIUM.get(event.medium, Tier.L3) - 1)
                for key in event.block_hashes:
                    tiers[key] = tiers.get(key, 0) | bit
            elif isinstance(event, BlockRemoved):
                bit = 1 << (TIER_OF_MEDIUM.get(event.medium, Tier.L3) - 1)
                for key in event.block_hashes:
                    left = tiers.get(key, 0) & ~bit
                    if left:
                        tiers[key] = left
                    else:
                        tiers.pop(key, None)
            elif isinstance(event, AllBlocksCleared):
                tiers.clear()

    def clear(self) -> None:
        self._tiers.clear()

    def tiers(self, key: bytes) -> int:
        return self._tiers.get(key, 0)

    def num_pages(self) -> dict[str, int]:
        counts = {"l1": 0, "l2": 0, "l3": 0}
        for mask in self._tiers.values():
            for name, bit in (("l1", _L1), ("l2", _L2), ("l3", _L3)):
                counts[name] += bool(mask & bit)
        return counts


class RecentPages:
    """Pages a replica is about to hold: the prompts just sent to it, counted as in L1
    until `hold_s` has passed. Its events take a moment to arrive; a conversation's next
    turn, sent the moment the answer is in, must not miss its history meanwhile. Only the
    events say what stays: an entry that they never confirm simply expires."""

    def __init__(self, hold_s: float) -> None:
        self.hold_s = hold_s
        self._until: dict[bytes, float] = {}

    def add(self, keys: list[bytes]) -> None:
        until = time.monotonic() + self.hold_s
        for key in keys:
            self._until[key] = until

    def holds(self, key: bytes, now: float) -> bool:
        return self._until.get(key, 0.0) > now

    def expire(self) -> None:
        now = time.monotonic()
        self._until = {k: t for k, t in self._until.items() if t > now}

    def clear(self) -> None:
        self._until.clear()


def cached_prefix(
    keys: list[bytes],
    own: PageIndex,
    shared: PageIndex | None,
    recent: RecentPages | None = None,
    sidecars: SidecarKeys | None = None,
) -> CachedPrefix:
    """The leading pages of `keys` a replica can serve, each counted in the fastest tier
    holding it: its own L1/L2/L3, or the shared L3 (the daemon's events); pages `recent`
    still holds count as L1. For an interleaved model (`sidecars`: the prompt's sidecar
    keys) only as deep as the deepest boundary whose sidecar is whole, as the replica
    serves a hit (engine/sidecar_shape.py)."""
    now = time.monotonic()

    def tiers(key: bytes) -> int:
        mask = own.tiers(key) | (_L3 if shared is not None and shared.tiers(key) else 0)
        if recent is not None and recent.holds(key, now):
            mask |= _L1
        return mask

    masks = []
    for key in keys:
        mask = tiers(key)
        if not mask:
            break
        masks.append(mask)
    if sidecars is not None and masks:
        del masks[sidecars.served_pages(len(masks), lambda key: tiers(key) != 0) :]
    counts = [0, 0, 0]
    for mask in masks:
        counts[0 if mask & _L1 else 1 if mask & _L2 else 2] += 1
    return CachedPrefix(*counts)


class EventFeed:
    """One thread reading every subscription into the indexes, under `lock`."""

    def __init__(self, lock: threading.Lock) -> None:
        self.lock = lock
        self._feeds: list[tuple[EventSubscriber, PageIndex]] = []
        self._changes: list = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hicache-route-events", daemon=True)
        self._thread.start()

    def add(self, subscriber: EventSubscriber, index: PageIndex) -> None:
        with self.lock:
            self._changes.append(("add", subscriber, index))

    def remove(self, subscriber: EventSubscriber) -> None:
        with self.lock:
            self._changes.append(("remove", subscriber, None))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        for subscriber, _ in self._feeds:
            subscriber.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            with self.lock:
                changes, self._changes = self._changes, []
            for kind, subscriber, index in changes:
                if kind == "add":
                    self._feeds.append((subscriber, index))
                else:
                    self._feeds = [(s, i) for s, i in self._feeds if s is not subscriber]
                    subscriber.close()
            if not self._feeds:
                self._stop.wait(0.05)
                continue
            poller = zmq.Poller()
            for subscriber, _ in self._feeds:
                poller.register(subscriber.socket, zmq.POLLIN)
            ready = dict(poller.poll(50))
            for subscriber, index in self._feeds:
                if subscriber.socket in ready:
                    self._read(subscriber, index)

    def _read(self, subscriber: EventSubscriber, index: PageIndex) -> None:
        lost, joined = subscriber.lost, subscriber.last_seq >= 0
        batches = subscriber.receive(0)
        with self.lock:
            if subscriber.lost != lost and joined:
                logger.warning(
                    "events from %s were lost: forgetting its pages", subscriber.endpoint
                )
                index.clear()
            elif subscriber.lost != lost:  # joined late, with no replay socket to catch up
                logger.info(
                    "%s published %d batches before this router subscribed (no replay "
                    "socket): pages stored before now are unknown here",
                    subscriber.endpoint,
                    subscriber.lost,
                )
            for seq, batch in batches:
                index.apply(batch.events)
                index.seq = seq
