"""What `RouteServer` (router.py) keeps of each replica (`ReplicaState`), and how it learns
and forgets it (`ReplicaBookkeeping`, which the server inherits): reading `/hicache/info`,
subscribing to the replica's KV events, marking it dead, and the probe that connects it
again once it answers (and ages the prompts just routed). The pages a replica's events name
are kept in route_index.py; which replica a request goes to is chosen in router.py.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import aiohttp

from engine_integration.engine.sidecar_shape import SidecarShape
from engine_integration.serve.route_index import RECENT_HOLD_S, EventFeed, PageIndex, RecentPages
from hicache.events import EventSubscriber

logger = logging.getLogger(__name__)

_INFO_MAX_BYTES = 1 << 20  # a replica's /hicache/info is a few hundred bytes
_MAX_PAGE_SIZE = 1 << 20  # tokens a page (a replica saying more is not one)


@dataclass(eq=False)
class ReplicaState:
    url: str
    name: str = ""
    role: str = "both"
    page_size: int = 0
    digest: bytes = b""
    sidecar: SidecarShape | None = None  # an interleaved model's (None: no sidecars)
    started_s: float = 0.0
    alive: bool = False
    in_flight: int = 0
    num_routed: int = 0
    num_failed: int = 0
    index: PageIndex = field(default_factory=PageIndex)
    recent: RecentPages = field(default_factory=lambda: RecentPages(RECENT_HOLD_S))
    subscriber: EventSubscriber | None = None


class ReplicaBookkeeping:
    """The replica bookkeeping of `RouteServer`, which inherits it: what it uses of the
    server is declared here."""

    replicas: list[ReplicaState]
    lock: threading.Lock
    feed: EventFeed
    session: aiohttp.ClientSession | None
    digest: bytes  # the namespace digest and page size every replica must share
    page_size: int

    async def _read_info(self, replica: ReplicaState) -> dict | None:
        """A replica's /hicache/info (digest as bytes), or None while nothing answers there.
        A server that answers, but not as a replica does, is a ValueError naming it."""
        try:
            async with self.session.get(f"{replica.url}/hicache/info") as reply:
                status, body = reply.status, await reply.content.read(_INFO_MAX_BYTES)
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return None
        not_a_replica = (
            f"--replica {replica.url}: not a `hicache engine serve` replica (it answered "
            f"/hicache/info with HTTP {status}"
        )
        if status != 200:
            raise ValueError(not_a_replica + ")")
        try:
            info = json.loads(body)
            info["namespace_digest"] = bytes.fromhex(info["namespace_digest"])
            info["page_size"] = int(info["page_size"])
            if not 1 <= info["page_size"] <= _MAX_PAGE_SIZE:
                raise ValueError(f"page size {info['page_size']} is not in [1, {_MAX_PAGE_SIZE}]")
            if info.get("sidecar") is not None:
                info["sidecar"] = SidecarShape.from_info(info["sidecar"], info["page_size"])
            _ = info["name"], info["role"], info["started_s"]
        except (ValueError, TypeError, KeyError) as error:
            raise ValueError(f"{not_a_replica} and {type(error).__name__}: {error})") from None
        return info

    async def _connect(self, replica: ReplicaState) -> bool:
        """Read a replica's /hicache/info and subscribe to its events."""
        info = await self._read_info(replica)
        if info is None:
            return False
        digest, page_size = info["namespace_digest"], info["page_size"]
        if self.digest and (digest, page_size) != (self.digest, self.page_size):
            raise ValueError(
                f"replica {replica.url} serves another model or page size than the others: "
                "a router serves one model"
            )
        self.digest, self.page_size = digest, page_size
        with self.lock:
            replica.name, replica.role = info["name"], info["role"]
            replica.page_size, replica.digest = page_size, digest
            replica.sidecar = info.get("sidecar")
            replica.started_s = info["started_s"]
            replica.index.clear()
            replica.recent.clear()
        if replica.subscriber is not None:
            self.feed.remove(replica.subscriber)
            replica.subscriber = None
        if info.get("events_endpoint"):
            host = urlsplit(replica.url).hostname
            replica.subscriber = EventSubscriber(
                _reachable(info["events_endpoint"], host),
                _reachable(info["replay_endpoint"], host) if info.get("replay_endpoint") else None,
            )
            self.feed.add(replica.subscriber, replica.index)
        else:
            logger.warning(
                "replica %s publishes no KV events: prefix routing is blind to it", replica.url
            )
        replica.alive = True
        return True

    async def _probe(self) -> None:
        """Bring back replicas that answer again (their events start over)."""
        while True:
            await asyncio.sleep(1.0)
            with self.lock:
                for replica in self.replicas:
                    replica.recent.expire()
            for replica in self.replicas:
                if not replica.alive:
                    try:
                        await self._connect(replica)
                    except ValueError as error:
                        logger.error("%s", error)

    def _mark_dead(self, replica: ReplicaState, error: BaseException) -> None:
        if replica.alive:
            logger.warning("replica %s failed (%s): routing around it", replica.url, error)
        with self.lock:
            replica.alive = False
            replica.num_failed += 1
            replica.index.clear()
            replica.recent.clear()


def _reachable(endpoint: str, host: str) -> str:
    """A replica's event address as seen from here (a wildcard bind means its host)."""
    for wildcard in ("tcp://*:", "tcp://0.0.0.0:"):
        if endpoint.startswith(wildcard):
            return f"tcp://{host}:{endpoint[len(wildcard) :]}"
    return endpoint
