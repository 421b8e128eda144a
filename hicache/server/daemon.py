"""The cache-server process: an asyncio gRPC server around the KVStore service.

`CacheServer` starts and stops one server (tests run it in-process too); `serve(config)` is
`hicache serve`: it sets the process' malloc policy for large messages
(`storage_backends.allocator`), starts one, prints the address it listens on, and on SIGTERM
or SIGINT shuts down gracefully:

1. the health service turns NOT_SERVING (balancers stop sending);
2. the gRPC server stops taking calls and lets those in flight finish (up to
   `shutdown_grace_s`; then they are cancelled);
3. every page only in memory is written to the spill (`--spill-dir`), for at most
   `flush_timeout_s`, and the stores close (at most `_CLOSE_TIMEOUT_S`);
4. the process exits 0.

Every step is bounded, so a hung spill (a dead mount: reads and writes that never return on
the spill's threads) cannot keep the process alive: what could not be written is counted and
logged, and the process exits 1 without waiting for the hung threads. A watchdog started by
the signal itself exits the same way if the steps together overrun their bounds.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import threading
import time

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from hicache.cli import say
from storage_backends.allocator import tune_for_large_messages
from storage_backends.errors import StorageError
from storage_backends.protocol import SERVICE

from .auth import TokenCheck, read_token_file
from .config import MESSAGE_SLACK_BYTES, ServerConfig
from .metrics import ServerCollector, ServerMetrics, start_metrics_server
from .service import KVStoreService
from .store import Store
from .streams import StreamLimits

logger = logging.getLogger(__name__)

_STREAM_WINDOW_BYTES = 64 << 10  # what a stream may send before its handler reads
_CLOSE_TIMEOUT_S = 5.0  # closing the stores after the flush
_WATCHDOG_SLACK_S = 15.0  # the watchdog's margin over the shutdown's own bounds


class CacheServer:
    """One daemon: its store, its gRPC server, its health and metrics endpoints."""

    def __init__(self, config: ServerConfig) -> None:
        """Raises ValueError (a bad spill directory, an unreadable token file)."""
        self.config = config
        self.auth = TokenCheck.from_config(config)
        self.store = Store(config)
        self.metrics = ServerMetrics()
        self.streams = StreamLimits(config)
        self.num_unflushed = 0  # pages the last stop() could not write to the spill
        self.closed_cleanly = True  # False: the last stop() left hung spill threads behind
        self.health = health.aio.HealthServicer()
        self.port: int | None = None
        self.metrics_port: int | None = None
        self._server: grpc.aio.Server | None = None
        self._metrics_http = None
        self.events = None  # the KV event publisher, with --events-endpoint

    async def start(self) -> int:
        """Open the stores and listen; returns the bound port. Raises OSError if it cannot."""
        config = self.config
        await self.store.open()
        if config.events_endpoint is not None:
            self._start_events()
        grpc_auth = self.auth if config.has_tokens else None  # a metrics token alone: open
        service = KVStoreService(
            self.store, config, self.metrics, self.streams, grpc_auth, time.monotonic()
        )
        self.service = service
        server = grpc.aio.server(
            options=_server_options(config), maximum_concurrent_rpcs=config.budget.num_calls
        )
        server.add_generic_rpc_handlers((service.handler(),))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        address = (
            f"[{config.host}]:{config.port}"
            if ":" in config.host
            else (f"{config.host}:{config.port}")
        )
        try:
            self.port = self._listen(server, address)
        except RuntimeError as exc:
            await self.store.close()
            raise OSError(f"cannot listen on {address}: {exc}") from None
        await server.start()
        self._server = server
        for name in ("", SERVICE):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        if config.metrics_port is not None:
            loop = asyncio.get_running_loop()
            collector = ServerCollector(self.metrics, self.store, self.streams, loop)
            self._metrics_http, self.metrics_port = start_metrics_server(
                collector, self.auth, config.host, config.metrics_port
            )
        return self.port

    def _start_events(self) -> None:
        from hicache.events import EventPublisher, EventsConfig, default_topic  # pyzmq
        from hicache.server.events import DaemonEvents, channels

        config = self.config
        tokens = [
            (t.token, None if t.namespaces is None else frozenset(t.namespaces))
            for t in config.tenants
        ]
        if config.auth_token_file is not None:
            tokens.append((read_token_file(config.auth_token_file, "--auth-token-file"), None))
        credentials, audiences = channels(tokens)
        self.events = EventPublisher(
            EventsConfig(
                config.events_endpoint,
                config.events_replay_endpoint,
                topic=config.events_topic or default_topic("hicache-serve"),
                format=config.events_format,
            ),
            credentials or None,
        )
        for name, namespace in self.store.namespaces.items():
            audience = [c for c, allowed in audiences if allowed is None or name in allowed]
            namespace.publish_events(DaemonEvents(self.events, audience if tokens else ("",)))

    def _listen(self, server: grpc.aio.Server, address: str) -> int:
        config = self.config
        if config.tls_cert_file is None:
            return server.add_insecure_port(address)
        with open(config.tls_key_file, "rb") as f:
            key = f.read()
        with open(config.tls_cert_file, "rb") as f:
            cert = f.read()
        credentials = grpc.ssl_server_credentials([(key, cert)])
        return server.add_secure_port(address, credentials)

    async def stop(self) -> int:
        """Graceful shutdown (see the module doc); returns how many pages were spilled.

        Afterwards `num_unflushed` is how many pages only memory held that could not be
        written (a hung or full spill); they are logged too."""
        await self.health.enter_graceful_shutdown()
        if self._server is not None:
            await self._server.stop(self.config.shutdown_grace_s)
        if self._metrics_http is not None:
            self._metrics_http.shutdown()
            self._metrics_http.server_close()
        spilled = 0
        try:
            spilled = await asyncio.wait_for(self.store.flush(), self.config.flush_timeout_s)
        except asyncio.TimeoutError:
            logger.error("the flush did not finish within --flush-timeout")
        self.num_unflushed = self.store.num_unflushed
        if self.num_unflushed:
            logger.error(
                "%d pages only in memory could not be written to the spill: they are lost",
                self.num_unflushed,
            )
        try:
            await asyncio.wait_for(self.store.close(), _CLOSE_TIMEOUT_S)
        except asyncio.TimeoutError:
            logger.error("the stores did not close within %ss (a hung spill?)", _CLOSE_TIMEOUT_S)
            self.closed_cleanly = False
        if self.events is not None:
            self.events.close()
        return spilled


async def serve(config: ServerConfig) -> int:
    """Run a daemon until SIGTERM or SIGINT; returns the exit status (and exits the process
    itself, without waiting for hung spill threads, when the shutdown could not finish)."""
    tune_for_large_messages()  # this process moves pages in messages of megabytes
    try:
        server = CacheServer(config)
    except ValueError as exc:
        print(f"hicache serve: error: {exc}", file=sys.stderr)
        return 2
    try:
        port = await server.start()
    except (OSError, ValueError, StorageError) as exc:
        print(f"hicache serve: error: {exc}", file=sys.stderr)
        return 1
    stop = asyncio.Event()
    _on_signals(asyncio.get_running_loop(), stop, _shutdown_bound_s(config))
    where = f"{config.host}:{port}" + (" (TLS)" if config.tls_cert_file else "")
    metrics = f", metrics on :{server.metrics_port}/metrics" if server.metrics_port else ""
    say(f"hicache serve: listening on {where}{metrics}")
    shares = f" ({config.calls_per_tenant} per tenant)" if config.num_tenants > 1 else ""
    say(f"hicache serve: {config.budget.describe()}{shares}")
    await stop.wait()
    logger.info("shutting down: finishing calls in flight, then flushing the spill")
    spilled = await server.stop()
    if server.num_unflushed:
        _exit_now(
            1,
            f"hicache serve: stopped ({spilled} pages written to the spill, "
            f"{server.num_unflushed} could not be and are lost)",
        )
    message = f"hicache serve: stopped ({spilled} pages written to the spill)"
    if not server.closed_cleanly:  # nothing lost; threads stuck in the spill stay stuck
        _exit_now(0, message + "; spill threads still hung at exit")
    say(message)
    return 0


def _server_options(config: ServerConfig) -> list[tuple[str, int]]:
    """gRPC's side of the memory budget: messages of at most --max-message-bytes, a stream
    window that grows only for the message a handler reads (no bandwidth-probing growth:
    a stream nobody reads from holds one initial window), and at most the calls one tenant
    may have in flight on one connection."""
    limit = config.max_message_bytes + MESSAGE_SLACK_BYTES
    return [
        ("grpc.max_receive_message_length", limit),
        ("grpc.max_send_message_length", limit),
        ("grpc.http2.bdp_probe", 0),
        ("grpc.http2.lookahead_bytes", _STREAM_WINDOW_BYTES),
        ("grpc.max_concurrent_streams", config.calls_per_tenant),
        ("grpc.so_reuseport", 0),  # a second daemon on this port must fail, not share
    ]


def _shutdown_bound_s(config: ServerConfig) -> float:
    return config.shutdown_grace_s + config.flush_timeout_s + _CLOSE_TIMEOUT_S + _WATCHDOG_SLACK_S


def _on_signals(loop: asyncio.AbstractEventLoop, stop: asyncio.Event, bound_s: float) -> None:
    """SIGTERM / SIGINT set `stop` and start a watchdog that ends the process if the
    shutdown takes longer than `bound_s`. A plain signal handler, not the loop's: it runs
    even while the loop's thread is stuck in a system call."""

    def on_signal(signum: int, frame: object) -> None:
        if stop.is_set():
            return
        watchdog = threading.Timer(
            bound_s,
            _exit_now,
            (1, f"hicache serve: the shutdown did not finish within {bound_s:g}s; exiting"),
        )
        watchdog.daemon = True
        watchdog.start()
        loop.call_soon_threadsafe(stop.set)

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, on_signal)


def _exit_now(status: int, message: str) -> None:
    """End the process at once (threads stuck in a hung file system would block a normal
    exit forever), after saying why."""
    print(message, file=sys.stderr, flush=True)
    logging.shutdown()
    sys.stdout.flush()
    os._exit(status)
