"""`hicache engine serve`: one embedded engine behind an OpenAI-compatible HTTP server.

    POST /v1/completions, /v1/chat/completions   (streamed with "stream": true)
    POST /hicache/prefill      the prompt's KV into the cache and through to L3 (P/D)
    POST /hicache/tokenize/v1/completions (or .../chat/completions): the prompt's token ids
    GET  /hicache/info         name, role, namespace digest, page size (and sidecar shape),
                               event sockets, load
    GET  /v1/hicache/profile   what it measured: step costs, link and L3 rates, model, device
                               (`calibration.py`; `hicache simulate --calibrate` reads it)
    GET  /health, /v1/models

The engine runs on one thread of its own (`EngineLoop`): HTTP handlers hand it requests
and read its tokens back through asyncio queues, so requests that arrive together are
batched by the engine's scheduler (continuous batching), never by the server.

Roles (`--role`): `both` serves everything. `prefill` is for a P/D deployment's prefill side:
its `/hicache/prefill` computes a prompt and returns once its pages are in L3. `decode`
matches what L3 holds, fetches all of it and waits for the whole prefetch (`l3_fetch_policy`
`always`, prefetch policy `wait_complete`), so a handed-off prompt is computed only from its
last page on. Both need `--l3-url`. `--l3-fetch always` reads L3 so on any role (the same
choice on every run, whatever the machine measures). `--no-cache` serves without hicache:
the baseline.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import queue
import socket
import threading
import time

import torch
from aiohttp import web

from engine_integration.engine.core import Engine, kv_layout_for
from engine_integration.engine.embedded import CacheSizes, build_cache, load_model, warm_up
from engine_integration.engine.errors import EngineError, RequestTooLargeError
from engine_integration.engine.model.config import EngineConfig
from engine_integration.engine.request import Request, RequestOutput
from engine_integration.engine.sampling import SamplingParams
from engine_integration.serve.calibration import replica_profile
from engine_integration.serve.openai_api import (
    CHAT,
    COMPLETIONS,
    ApiRequest,
    BadRequest,
    TextStream,
    bad_request,
    chunk,
    error_body,
    parse_request,
    read_body,
    response,
    serve_until_stopped,
)
from engine_integration.serve.replica_config import ReplicaConfig, fetch_policies
from hicache.config import PolicyConfig
from hicache.simulate.calibrate import INFO_PATH
from hicache.simulate.profile import PROFILE_PATH
from radix.keys import Namespace

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------- the engine thread


class _Job:
    __slots__ = ("request", "sink", "sent")

    def __init__(self, request: Request, sink) -> None:
        self.request = request
        self.sink = sink
        self.sent = 0


class EngineLoop:
    """The engine on a thread of its own. `submit` from anywhere; `sink(item)` is called
    from the engine's thread with ("tokens", [ids]), then ("done", RequestOutput), or
    ("error", message)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._jobs: dict[str, _Job] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hicache-engine", daemon=True)
        self._thread.start()

    @property
    def num_running(self) -> int:
        return len(self._jobs)

    def submit(self, request_id: str, prompt: list[int], params: SamplingParams, sink) -> None:
        self._inbox.put(("add", request_id, prompt, params, sink))
        self._wake.set()

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id, None, None, None))
        self._wake.set()

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        engine = self.engine
        while not self._stop.is_set():
            self._take_inbox()
            if not engine.has_work:
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            try:
                finished = engine.step()
            except Exception as error:  # the engine's state is its own: fail what is running
                logger.exception("an engine step failed")
                self._fail_all(f"the engine failed: {error}")
                continue
            for job in self._jobs.values():
                new = job.request.output[job.sent :]
                if new:
                    job.sent += len(new)
                    job.sink(("tokens", list(new)))
            for output in finished:
                self._jobs.pop(output.request_id).sink(("done", output))

    def _take_inbox(self) -> None:
        while True:
            try:
                kind, request_id, prompt, params, sink = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "abort":
                if self._jobs.pop(request_id, None) is not None:
                    self.engine.abort(request_id)
                continue
            try:
                request = self.engine.add_request(prompt, params, request_id=request_id)
            except (ValueError, RequestTooLargeError) as error:  # the request's own fault
                sink(("refused", str(error)))
                continue
            self._jobs[request_id] = _Job(request, sink)

    def _fail_all(self, message: str) -> None:
        for request_id, job in list(self._jobs.items()):
            try:
                self.engine.abort(request_id)
            except (KeyError, EngineError):
                pass  # already gone from the engine
            job.sink(("error", message))
        self._jobs.clear()


# ---------------------------------------------------------------------------- the HTTP server


class Replica:
    def __init__(self, config: ReplicaConfig) -> None:
        self.config = config
        engine_config = EngineConfig(
            device=config.device,
            page_size=config.page_size,
            max_running_requests=config.max_running_requests,
            dtype=config.dtype,
            deterministic=config.deterministic,
        )
        self.engine_config = engine_config
        self.model, self.tokenizer = load_model(
            config.model_path, engine_config, seed=config.seed, model_config=config.model_config
        )
        # What first calls cost (CUDA graphs, kernel choices) is paid before the first
        # request, and the step costs it measures seed the cache's load-or-recompute choice.
        warm_up(self.model, engine_config)
        self.cache = None
        if config.cache:
            # Write-through, so that a page reaches L2 (and L3) as soon as it is inserted; how
            # a run L3 holds is read: `fetch_policies` (a decode replica fetches all of it).
            policy = PolicyConfig(
                write_policy="write_through", **fetch_policies(config.role, config.l3_fetch)
            )
            sizes = CacheSizes(config.l1_pages, config.l2_pages, config.l3_url, policy)
            self.cache = build_cache(self.model, engine_config, sizes)
            self.engine = Engine(self.model, engine_config, cache=self.cache)
        else:
            self.engine = Engine(self.model, engine_config, num_private_pages=config.l1_pages)
        self.publisher = None
        if config.events_endpoint:
            from hicache.events import EventPublisher, EventsConfig, TierEvents, default_topic

            topic = config.events_topic or default_topic(self.model.config.model_id)
            self.publisher = EventPublisher(
                EventsConfig(
                    config.events_endpoint,
                    config.events_replay_endpoint,
                    topic=topic,
                    format=config.events_format,
                )
            )
            self.cache.set_residency_listener(TierEvents(self.publisher, config.page_size))
        # What the cache keys pages by; a replica without one names its model and layout
        # the same way, so a router serves it beside the others.
        self.namespace = self.engine.namespace or Namespace(
            model_id=self.model.config.model_id,
            layout=kv_layout_for(self.model, config.page_size).descriptor(),
        )
        self.loop = EngineLoop(self.engine)
        self.model_name = self.model.config.model_id
        self.name = config.name or f"replica-{os.getpid()}"
        self.started_s = time.time()

    def close(self) -> None:
        self.loop.close()
        if self.cache is not None:
            self.cache.set_residency_listener(None)
        if self.publisher is not None:
            self.publisher.close()
        if self.cache is not None:
            self.cache.close()

    def app(self) -> web.Application:
        app = web.Application(client_max_size=16 << 20)
        app.router.add_post(COMPLETIONS, self.completions)
        app.router.add_post(CHAT, self.completions)
        app.router.add_post("/hicache/prefill", self.prefill)
        app.router.add_post("/hicache/tokenize/{endpoint:v1/.+}", self.tokenize)
        app.router.add_get(INFO_PATH, self.info)
        app.router.add_get(PROFILE_PATH, self.profile)
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        return app

    # ------------------------------------------------------------------ handlers

    async def health(self, _request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def models(self, _request: web.Request) -> web.Response:
        return web.json_response(
            {"object": "list", "data": [{"id": self.model_name, "object": "model"}]}
        )

    async def info(self, _request: web.Request) -> web.Response:
        events_seq = None  # the last batch of events published, once all queued are sent
        if self.publisher is not None:
            await asyncio.to_thread(self.publisher.flush)
            events_seq = self.publisher.next_seq - 1
        return web.json_response(
            {
                "name": self.name,
                "role": self.config.role,
                "model": self.model_name,
                "namespace_digest": self.namespace.digest.hex(),
                "page_size": self.config.page_size,
                "sidecar": self._sidecar_info(),
                "vocab_size": self.tokenizer.vocab_size,  # what a prompt's ids may be
                "cache": self.cache is not None,
                "l1_pages": self.config.l1_pages,  # what a prompt and its answer may take
                "l2_pages": self.config.l2_pages if self.cache is not None else 0,
                "l3": self.cache is not None and self.config.l3_url is not None,
                "device": self.config.device,
                "dtype": str(self.model.dtype).removeprefix("torch."),
                "events_endpoint": self.publisher.endpoint if self.publisher else None,
                "replay_endpoint": self.publisher.replay_endpoint if self.publisher else None,
                "events_seq": events_seq,
                "running": self.loop.num_running,
                "started_s": self.started_s,
                "pid": os.getpid(),
            }
        )

    def _sidecar_info(self) -> dict[str, int] | None:
        """An interleaved model's sidecar shape, for a router to count only the prefix a hit
        is served (engine/sidecar_shape.py); None for other models."""
        shape = self.engine.pages.shape
        return None if shape is None else shape.to_info()

    async def profile(self, _request: web.Request) -> web.Response:
        document = replica_profile(self.model, self.engine_config, self.cache)
        return web.json_response({**document, "source": self.name})

    async def tokenize(self, request: web.Request) -> web.Response:
        api = await self._parse(request, "/" + request.match_info["endpoint"])
        if isinstance(api, web.Response):
            return api
        return web.json_response({"prompt_token_ids": api.prompt_ids})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        api = await self._parse(request, request.path)
        if isinstance(api, web.Response):
            return api
        if api.stream:
            return await self._stream(request, api)
        items = self._start(api, self._params(api))
        ids: list[int] = []
        while True:
            kind, value = await items.get()
            if kind == "tokens":
                ids.extend(value)
            elif kind == "refused":
                return bad_request(BadRequest(value))
            elif kind == "error":
                return web.json_response(error_body(value, "server_error"), status=500)
            else:
                text = TextStream(self.tokenizer).add(ids, final=True)
                return web.json_response(
                    response(api, text, value.finish_reason, self._extra(value))
                )

    async def prefill(self, request: web.Request) -> web.Response:
        """Compute the prompt (one token generated, then dropped), insert its pages and
        wait until they are in L3: a decode replica can then match all of them."""
        body = await self._json(request)
        if isinstance(body, web.Response):
            return body
        path = CHAT if isinstance(body, dict) and "messages" in body else COMPLETIONS
        api = await self._parse(request, path, body)
        if isinstance(api, web.Response):
            return api
        items = self._start(api, SamplingParams(max_new_tokens=1))
        while True:
            kind, value = await items.get()
            if kind == "refused":
                return bad_request(BadRequest(value))
            if kind == "error":
                return web.json_response(error_body(value, "server_error"), status=500)
            if kind == "done":
                break
        if self.cache is not None:
            await asyncio.to_thread(self.cache.flush, 60.0)
        metrics = value.metrics
        return web.json_response(
            {
                "prompt_tokens": metrics.prompt_tokens,
                "computed_tokens": metrics.computed_tokens,
                "hit_tokens": metrics.hit_tokens,
                "num_pages": metrics.prompt_tokens // self.config.page_size,
                "replica": self.name,
            }
        )

    # ------------------------------------------------------------------ helpers

    async def _json(self, request: web.Request):
        try:
            return await read_body(request)
        except BadRequest as error:
            return bad_request(error)

    async def _parse(self, request: web.Request, path: str, body=None):
        if body is None:
            body = await self._json(request)
            if isinstance(body, web.Response):
                return body
        try:
            return parse_request(path, body, self.tokenizer, self.model_name)
        except BadRequest as error:
            return bad_request(error)

    def _params(self, api: ApiRequest) -> SamplingParams:
        s = api.sampling
        eos = self.tokenizer.eos_id
        return SamplingParams(
            max_new_tokens=s.max_new_tokens,
            temperature=s.temperature,
            top_k=s.top_k,
            top_p=s.top_p,
            seed=s.seed,
            stop_token_ids=() if s.ignore_eos or eos is None else (eos,),
        )

    def _start(self, api: ApiRequest, params: SamplingParams) -> asyncio.Queue:
        loop = asyncio.get_running_loop()
        items: asyncio.Queue = asyncio.Queue()
        self.loop.submit(
            api.request_id,
            api.prompt_ids,
            params,
            lambda item: loop.call_soon_threadsafe(items.put_nowait, item),
        )
        return items

    def _extra(self, output: RequestOutput) -> dict:
        metrics = output.metrics
        return {
            "usage": {
                "prompt_tokens": metrics.prompt_tokens,
                "completion_tokens": len(output.token_ids),
                "total_tokens": metrics.prompt_tokens + len(output.token_ids),
            },
            "hicache": {
                "token_ids": list(output.token_ids),
                "hit_tokens": dict(metrics.hit_tokens),
                "computed_tokens": metrics.computed_tokens,
                "replayed_tokens": metrics.replayed_tokens,
                "ttft_s": metrics.ttft_s,
                "replica": self.name,
            },
        }

    async def _stream(self, request: web.Request, api: ApiRequest) -> web.StreamResponse:
        items = self._start(api, self._params(api))
        try:
            first = await items.get()
        except asyncio.CancelledError:
            self.loop.abort(api.request_id)
            raise
        if first[0] == "refused":  # before any byte of the stream: a plain 400
            return bad_request(BadRequest(first[1]))
        stream = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        text = TextStream(self.tokenizer)
        try:
            await stream.prepare(request)
            while True:
                kind, value = first if first is not None else await items.get()
                first = None
                if kind == "tokens":
                    piece = text.add(value)
                    extra = {"hicache": {"token_ids": value}}
                    await _send(stream, chunk(api, piece, None, extra))
                elif kind == "error":
                    await _send(stream, error_body(value, "server_error"))
                    break
                else:
                    tail = text.add([], final=True)
                    await _send(stream, chunk(api, tail, value.finish_reason, self._extra(value)))
                    break
            await stream.write(b"data: [DONE]\n\n")
        except (ConnectionResetError, asyncio.CancelledError):
            self.loop.abort(api.request_id)  # the client went away: stop computing for it
            raise
        return stream


async def _send(stream: web.StreamResponse, body: dict) -> None:
    await stream.write(b"data: " + json.dumps(body).encode() + b"\n\n")


async def serve(config: ReplicaConfig, sock: socket.socket) -> int:
    """Serve `config`'s replica on `sock` (bound by the command before the model loads)."""
    if config.threads:
        torch.set_num_threads(config.threads)
    replica = Replica(config)
    events = f", events on {replica.publisher.endpoint}" if replica.publisher else ""

    async def close() -> None:
        replica.close()

    return await serve_until_stopped(
        replica.app(),
        sock,
        "hicache engine serve",
        lambda port: (
            f"hicache engine serve: {replica.name} ({config.role}, "
            f"{replica.model_name}) listening on http://{config.host}:{port}{events}"
        ),
        close,
    )
