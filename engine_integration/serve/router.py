"""`hicache route`: one OpenAI-compatible address in front of N `hicache engine serve`
replicas, sending each request where it costs least.

The router subscribes to every replica's KV events (and, with `--l3-events`, to the cache
daemon's) and keeps, per replica, which tiers hold each page key (`PageIndex`,
route_index.py). For a request it gets the prompt's token ids from a replica
(`/hicache/tokenize`: one tokenizer, the replicas' own), computes the page keys the
replicas' indexes use (the namespace digest comes from `/hicache/info`), reads off each
replica's cached prefix per tier, and lets `hicache.routing` choose: the same code the
simulator plans with. For an interleaved model (Gemma 2/3) the prefix counts only as deep
as a replica serves a hit: to the deepest boundary whose sidecar its index holds whole
(the shape from `/hicache/info`, engine/sidecar_shape.py). A prompt just routed counts as
cached on its replica for a few seconds (`RecentPages`), with the sidecar it stores at the
prompt's end, until the replica's own events say what it keeps.

P/D: when some replicas are `--role prefill` and others `--role decode`, a request goes to a
decode replica (chosen by the policy over the decode replicas: a conversation's earlier turns
are in its L1); if that replica cannot already find every full page of the prompt
(`needs_prefill`), a prefill replica (chosen the same way) computes the prompt into the
shared L3 first. The decode replica's response is the client's.

Every request is checked at the edge first (`openai_api.read_body` and `check_fields`:
size, UTF-8, nesting, fields): what fails is answered 400 here and never reaches a replica.
Only a replica's own failures take it out of the rotation: a refused or dropped connection,
a timeout, a 5xx answer to a request that passed the edge. A replica's 4xx (a prompt too
long for it) is the request's fault and is passed on to the client. A replica taken out has
its index forgotten, and the request is sent to the next choice (a stream that has already
sent tokens to the client cannot be moved: it ends with an error event). A probe brings a
replica back once it answers `/hicache/info` again. What the router keeps of each replica, and
how it connects, probes and drops one, is in route_replicas.py.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import sys
import threading
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

import aiohttp
from aiohttp import web

from engine_integration.engine.sidecar_shape import SidecarKeys, SidecarShape
from engine_integration.serve.openai_api import (
    CHAT,
    COMPLETIONS,
    BadRequest,
    bad_request,
    check_fields,
    error_body,
    read_body,
    serve_until_stopped,
)
from engine_integration.serve.route_index import EventFeed, PageIndex, cached_prefix
from engine_integration.serve.route_replicas import ReplicaBookkeeping, ReplicaState
from hicache.events import EventSubscriber
from hicache.routing import Candidate, Router, RoutingConfig, needs_prefill
from radix.keys import chain_keys, encode_tokens

logger = logging.getLogger(__name__)

_TIMEOUT = aiohttp.ClientTimeout(total=600, sock_connect=5)


@dataclass(frozen=True)
class RouterConfig:
    replica_urls: tuple[str, ...]
    routing: RoutingConfig = RoutingConfig()
    host: str = "127.0.0.1"
    port: int = 8000
    l3_events: str | None = None  # the cache daemon's event endpoint (shared L3)
    l3_replay: str | None = None
    l3_token_file: str | None = None  # the subscriber's token, for a daemon with tokens
    wait_s: float = 120.0  # how long to wait at start for the replicas to answer

    def __post_init__(self) -> None:
        if not self.replica_urls:
            raise ValueError("give at least one --replica URL")
        for url in self.replica_urls:
            if urlsplit(url).scheme not in ("http", "https") or not urlsplit(url).port:
                raise ValueError(f"--replica must be http://HOST:PORT, got {url!r}")


class RouteServer(ReplicaBookkeeping):
    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.router = Router(config.routing)
        self.replicas = [ReplicaState(url.rstrip("/")) for url in config.replica_urls]
        self.lock = threading.Lock()
        self.feed = EventFeed(self.lock)
        self.shared_l3: PageIndex | None = None
        self.page_size = 0
        self.digest = b""
        self.session: aiohttp.ClientSession | None = None
        self._probe_task: asyncio.Task | None = None
        self._turn = 0
        self.num_bad_requests = 0  # refused at the edge (400), never sent to a replica

    # ------------------------------------------------------------------ start and stop

    async def start(self) -> None:
        self.session = aiohttp.ClientSession(timeout=_TIMEOUT)
        deadline = time.monotonic() + self.config.wait_s
        for replica in self.replicas:
            while not await self._connect(replica):
                if time.monotonic() > deadline:
                    raise OSError(
                        f"--replica {replica.url}: nothing answered /hicache/info within "
                        f"--wait {self.config.wait_s:g} s"
                    )
                await asyncio.sleep(0.2)
        if self.config.l3_events:
            self.shared_l3 = PageIndex()
            secret = None
            if self.config.l3_token_file is not None:
                try:
                    with open(self.config.l3_token_file) as f:
                        secret = f.read().strip()
                except OSError as error:
                    raise ValueError(
                        f"--l3-events-token-file {self.config.l3_token_file}: {error.strerror}"
                    ) from None
            subscriber = EventSubscriber(
                self.config.l3_events, self.config.l3_replay, secret=secret
            )
            self.feed.add(subscriber, self.shared_l3)
        self._probe_task = asyncio.get_running_loop().create_task(self._probe())

    async def close(self) -> None:
        if self._probe_task is not None:
            self._probe_task.cancel()
        self.feed.close()
        if self.session is not None:
            await self.session.close()

    # ------------------------------------------------------------------ HTTP

    def app(self) -> web.Application:
        app = web.Application(client_max_size=16 << 20)
        app.router.add_post(COMPLETIONS, self.handle)
        app.router.add_post(CHAT, self.handle)
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/hicache/route/stats", self.stats)
        return app

    async def health(self, _request: web.Request) -> web.Response:
        alive = sum(r.alive for r in self.replicas)
        return web.json_response(
            {"status": "ok" if alive else "no replica"}, status=200 if alive else 503
        )

    async def models(self, request: web.Request) -> web.Response:
        for replica in self._alive():
            try:
                async with self.session.get(f"{replica.url}/v1/models") as reply:
                    return web.json_response(await reply.json(), status=reply.status)
            except (aiohttp.ClientError, asyncio.TimeoutError) as error:
                self._mark_dead(replica, error)
        return web.json_response(error_body("no replica is up", "server_error"), status=503)

    async def stats(self, _request: web.Request) -> web.Response:
        with self.lock:
            replicas = [
                {
                    "url": r.url,
                    "name": r.name,
                    "role": r.role,
                    "alive": r.alive,
                    "in_flight": r.in_flight,
                    "routed": r.num_routed,
                    "failed": r.num_failed,
                    "pages": r.index.num_pages(),
                    "events_seq": r.index.seq,
                }
                for r in self.replicas
            ]
            shared = len(self.shared_l3) if self.shared_l3 is not None else None
        return web.json_response(
            {
                "policy": self.config.routing.policy,
                "replicas": replicas,
                "shared_l3_pages": shared,
                "bad_requests": self.num_bad_requests,
            }
        )

    async def handle(self, request: web.Request) -> web.StreamResponse:
        try:  # a request no replica could serve never reaches one
            body = await read_body(request)
            check_fields(request.path, body)
        except BadRequest as error:
            self.num_bad_requests += 1
            return bad_request(error)
        tried: set[int] = set()
        while True:
            prompt = await self._tokenize(request.path, body)
            if isinstance(prompt, web.Response):
                return prompt
            plan = self._plan(prompt, tried)
            if plan is None:
                return web.json_response(error_body("no replica is up", "server_error"), status=503)
            decode, prefill, choice = plan
            try:
                if prefill is not None:
                    await self._prefill(prefill, body)
                return await self._forward(request, decode, body, choice)
            except _ReplicaFailed as failed:
                self._mark_dead(failed.replica, failed.error)
                tried.add(self.replicas.index(failed.replica))

    # ------------------------------------------------------------------ choosing

    def _alive(self, role: str | None = None) -> list[ReplicaState]:
        return [r for r in self.replicas if r.alive and (role is None or r.role == role)]

    async def _tokenize(self, path: str, body) -> list[int] | web.Response:
        for _ in range(len(self.replicas)):
            alive = self._alive()
            if not alive:
                break
            replica = alive[self._turn % len(alive)]
            self._turn += 1
            try:
                async with self.session.post(
                    f"{replica.url}/hicache/tokenize{path}", json=body
                ) as reply:
                    if reply.status >= 500:  # the replica's own failure
                        raise aiohttp.ClientResponseError(
                            reply.request_info, (), status=reply.status, message=reply.reason
                        )
                    if reply.status != 200:  # the request's fault: the client hears why
                        return await _passed_on(reply)
                    return (await reply.json())["prompt_token_ids"]
            except (aiohttp.ClientError, asyncio.TimeoutError, KeyError, ValueError) as error:
                self._mark_dead(replica, error)
        return web.json_response(error_body("no replica is up", "server_error"), status=503)

    def _plan(self, prompt: list[int], tried: set[int]):
        """(decode replica, prefill replica or None, the decode choice), or None."""
        num_pages = (len(prompt) - 1) // self.page_size
        keys = chain_keys(
            self.digest,
            encode_tokens(prompt[: num_pages * self.page_size]),
            self.page_size,
            num_pages,
        )
        sidecars: dict[SidecarShape, SidecarKeys] = {}  # (one model: one shape, if any)
        with self.lock:
            pd = any(r.alive and r.role == "prefill" for r in self.replicas)
            serving = "decode" if pd else "both"
            decode = self._choose(keys, serving, tried, sidecars)
            if decode is None:
                return None
            replica, choice = decode
            prefill = None
            if pd and needs_prefill(choice[1], num_pages):
                chosen = self._choose(keys, "prefill", tried, sidecars)
                if chosen is None:
                    return None
                prefill = chosen[0]
                prefill.num_routed += 1
                _routed(prefill, keys, sidecars)
            replica.num_routed += 1
            _routed(replica, keys, sidecars)
            return replica, prefill, choice

    def _choose(
        self,
        keys: list[bytes],
        role: str,
        tried: set[int],
        sidecars: dict[SidecarShape, SidecarKeys],
    ):
        candidates, cached = [], {}
        for i, replica in enumerate(self.replicas):
            if not replica.alive or replica.role != role or i in tried:
                continue
            cached[i] = cached_prefix(
                keys,
                replica.index,
                self.shared_l3,
                replica.recent,
                _sidecar_keys(sidecars, replica.sidecar, keys),
            )
            candidates.append(Candidate(i, cached[i], replica.in_flight, replica.num_routed))
        if not candidates:
            return None
        choice = self.router.choose(candidates, len(keys))
        return self.replicas[choice.index], (choice.value, cached[choice.index])

    # ------------------------------------------------------------------ forwarding

    async def _prefill(self, replica: ReplicaState, body) -> None:
        replica.in_flight += 1
        try:
            async with self.session.post(f"{replica.url}/hicache/prefill", json=body) as reply:
                if reply.status != 200:
                    raise _ReplicaFailed(replica, RuntimeError(await reply.text()))
                await reply.read()
        except (aiohttp.ClientError, asyncio.TimeoutError) as error:
            raise _ReplicaFailed(replica, error) from None
        finally:
            replica.in_flight -= 1

    async def _forward(self, request: web.Request, replica: ReplicaState, body, choice):
        value, cached = choice
        route = {
            "replica": replica.name,
            "policy": self.config.routing.policy,
            "value": value,
            "cached_pages": list(cached),
        }
        replica.in_flight += 1
        try:
            async with self.session.post(f"{replica.url}{request.path}", json=body) as reply:
                if reply.status >= 500:  # valid input (checked at the edge): its own failure
                    raise _ReplicaFailed(replica, RuntimeError(f"HTTP {reply.status}"))
                if reply.status != 200:
                    return await _passed_on(reply)
                if not body.get("stream"):
                    answer = await reply.json()
                    if isinstance(answer, dict) and "hicache" in answer:
                        answer["hicache"]["route"] = route
                    return web.json_response(answer, status=reply.status)
                return await self._relay(request, reply, route)
        except (aiohttp.ClientError, asyncio.TimeoutError) as error:
            raise _ReplicaFailed(replica, error) from None
        finally:
            replica.in_flight -= 1

    async def _relay(self, request: web.Request, reply, route: dict) -> web.StreamResponse:
        """Pass a replica's event stream through; once bytes have reached the client, a
        replica failure ends the stream with an error event instead of a retry."""
        first = await reply.content.readany()  # a failure before this is retried elsewhere
        stream = web.StreamResponse(
            status=reply.status,
            headers={
                "Content-Type": reply.headers.get("Content-Type", "text/event-stream"),
                "X-Hicache-Replica": route["replica"],
            },
        )
        await stream.prepare(request)
        await stream.write(first)
        try:
            async for data in reply.content.iter_any():
                await stream.write(data)
        except (aiohttp.ClientError, asyncio.TimeoutError) as error:
            message = error_body(f"the replica failed mid-stream: {error}", "server_error")
            await stream.write(b"data: " + json.dumps(message).encode() + b"\n\n")
        return stream


def _sidecar_keys(
    made: dict[SidecarShape, SidecarKeys], shape: SidecarShape | None, keys: list[bytes]
) -> SidecarKeys | None:
    """The prompt's sidecar keys for a replica of `shape` (None: a model without them),
    made once for every replica of that shape."""
    if shape is None:
        return None
    if shape not in made:
        made[shape] = SidecarKeys(shape, keys)
    return made[shape]


def _routed(
    replica: ReplicaState, keys: list[bytes], sidecars: dict[SidecarShape, SidecarKeys]
) -> None:
    """Count the prompt's pages as the replica's for a while (`RecentPages`), and for an
    interleaved model the sidecar it stores at the prompt's lookup end (the last of `keys`)."""
    made = _sidecar_keys(sidecars, replica.sidecar, keys)
    boundary = len(keys) * replica.page_size
    replica.recent.add(keys + made.run(boundary, 0) if made is not None and keys else keys)


async def _passed_on(reply: aiohttp.ClientResponse) -> web.Response:
    """A replica's refusal of the request (4xx), as the client's answer: its JSON error, or
    one made of its text."""
    try:
        answer = await reply.json()
    except (aiohttp.ContentTypeError, ValueError):
        text = (await reply.text(errors="replace")).strip().splitlines()
        answer = error_body(text[0] if text else f"HTTP {reply.status}")
    return web.json_response(answer, status=reply.status)


class _ReplicaFailed(Exception):
    def __init__(self, replica: ReplicaState, error: BaseException) -> None:
        super().__init__(str(error))
        self.replica = replica
        self.error = error


async def serve(config: RouterConfig, sock: socket.socket) -> int:
    """Route on `sock` (bound by the command before the replicas are awaited). A replica
    that is not one, or that does not answer within `wait_s`, is a mistake: exit 2."""
    server = RouteServer(config)
    try:
        await server.start()
    except (OSError, ValueError) as error:
        print(f"hicache route: error: {error}", file=sys.stderr, flush=True)
        await server.close()
        return 2
    return await serve_until_stopped(
        server.app(),
        sock,
        "hicache route",
        lambda port: (
            f"hicache route: {config.routing.policy} over {len(server.replicas)} "
            f"replicas, listening on http://{config.host}:{port}"
        ),
        server.close,
    )
