"""The cache-server process: an asyncio gRPC server around the KVStore service.

`CacheServer` starts and stops one server (tests run it in-process too); `serve(config)` is
`hicache serve`: it sets the process' malloc policy for large messages
(`storage_backends.allocator`), starts one, prints the address it listens on, and on SIGTERM
or SIGINT shuts down gracefully:

1. the health service turns NOT_SERVING (balancers stop sending);
2. the gRPC server stops taking calls and lets those in flight finish (up to
   `shutdown_grace_s`; then they are cancelled);
3. every page only in memory is written to the spill (`--spill-dir`), and the stores close;
4. the process exits 0.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
import time

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from storage_backends.allocator import tune_for_large_messages
from storage_backends.protocol import SERVICE

from .auth import TokenCheck
from .config import ServerConfig
from .metrics import ServerCollector, ServerMetrics, start_metrics_server
from .service import KVStoreService
from .store import Store

logger = logging.getLogger(__name__)

_MESSAGE_SLACK_BYTES = 4096  # gRPC's limit counts the whole message; ours counts pages


class CacheServer:
    """One daemon: its store, its gRPC server, its health and metrics endpoints."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.store = Store(config)
        self.metrics = ServerMetrics()
        self.health = health.aio.HealthServicer()
        self.port: int | None = None
        self.metrics_port: int | None = None
        self._server: grpc.aio.Server | None = None
        self._metrics_http = None

    async def start(self) -> int:
        """Open the stores and listen; returns the bound port. Raises OSError if it cannot."""
        config = self.config
        auth = TokenCheck.from_file(config.auth_token_file) if config.auth_token_file else None
        await self.store.open()
        service = KVStoreService(self.store, config, self.metrics, auth, time.monotonic())
        limit = config.max_message_bytes + _MESSAGE_SLACK_BYTES
        server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", limit),
                ("grpc.max_send_message_length", limit),
                ("grpc.so_reuseport", 0),  # a second daemon on this port must fail, not share
            ]
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
            collector = ServerCollector(self.metrics, self.store, asyncio.get_running_loop())
            self._metrics_http, self.metrics_port = start_metrics_server(
                collector, config.host, config.metrics_port
            )
        return self.port

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
        """Graceful shutdown (see the module doc); returns how many pages were spilled."""
        await self.health.enter_graceful_shutdown()
        if self._server is not None:
            await self._server.stop(self.config.shutdown_grace_s)
        spilled = await self.store.flush()
        await self.store.close()
        if self._metrics_http is not None:
            self._metrics_http.shutdown()
            self._metrics_http.server_close()
        return spilled


async def serve(config: ServerConfig) -> int:
    """Run a daemon until SIGTERM or SIGINT; returns the exit status."""
    tune_for_large_messages()  # this process moves pages in messages of megabytes
    server = CacheServer(config)
    try:
        port = await server.start()
    except (OSError, ValueError) as exc:
        print(f"hicache serve: error: {exc}", file=sys.stderr)
        return 1
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    where = f"{config.host}:{port}" + (" (TLS)" if config.tls_cert_file else "")
    metrics = f", metrics on :{server.metrics_port}/metrics" if server.metrics_port else ""
    print(f"hicache serve: listening on {where}{metrics}", flush=True)
    await stop.wait()
    logger.info("shutting down: finishing calls in flight, then flushing the spill")
    spilled = await server.stop()
    print(f"hicache serve: stopped ({spilled} pages written to the spill)", flush=True)
    return 0
