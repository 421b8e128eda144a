"""`hicache serve`: flags (defaults from `ServerConfig`) and the entry point."""

from __future__ import annotations

import argparse
import asyncio
import errno
import socket
import ssl
import sys

from storage_backends.options import parse_size

from .config import SPILL_MODES, NamespaceSpec, ServerConfig
from .tenants import merge_namespaces, read_tenants_file

_DEFAULTS = ServerConfig()


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _namespace(text: str) -> NamespaceSpec:
    """NAME or NAME=QUOTA (a size)."""
    name, sep, quota = text.partition("=")
    return NamespaceSpec(name, _size(quota) if sep else None)


# The one line `hicache --help` shows for this subcommand.
HELP = "run the cache-server daemon: an L3 that many engine instances share over gRPC"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = _DEFAULTS
    parser.add_argument("--host", default=d.host, help="listen address (default: %(default)s)")
    parser.add_argument(
        "--port", type=int, default=d.port, help="port; 0 picks a free one (default: %(default)s)"
    )
    parser.add_argument(
        "--capacity", type=_size, default=d.capacity_bytes,
        help="memory for pages, all namespaces, e.g. 64GiB (default: 4GiB)",
    )  # fmt: skip
    parser.add_argument(
        "--namespace", type=_namespace, action="append", metavar="NAME[=QUOTA]",
        help="a tenant, with an optional memory quota (repeat for several; default: one "
        "namespace 'default'). Namespaces without a quota share what quotas leave equally",
    )  # fmt: skip
    parser.add_argument(
        "--spill-dir", default=d.spill_dir,
        help="write evicted pages here and read them back on a miss; survives restarts",
    )  # fmt: skip
    parser.add_argument(
        "--spill-url", default=d.spill_url,
        help="or spill into a shared store, e.g. mooncake://10.0.0.5:50051 or "
        "redis://host:6379/0 (each namespace under a prefix of its own; the store's "
        "capacity is its own)",
    )  # fmt: skip
    parser.add_argument(
        "--spill-capacity", type=_size, default=d.spill_capacity_bytes,
        help="bytes the spill directory may hold (default: 64GiB)",
    )  # fmt: skip
    parser.add_argument(
        "--spill-mode", choices=SPILL_MODES, default=d.spill_mode,
        help="evict: pages reach the spill when evicted and at shutdown (an ack means in "
        "memory); write-through: before the put is acknowledged, so a crash loses no "
        "acknowledged page (default: %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--spill-fsync", action="store_true",
        help="fsync spilled pages (write-through acks then survive power loss too)",
    )  # fmt: skip
    parser.add_argument(
        "--tenants-file", default=d.tenants_file,
        help="tokens bound to namespaces: lines 'TOKEN NAME[=QUOTA][,NAME[=QUOTA]...]' (or "
        "'TOKEN *' for every namespace); a call for another namespace is PERMISSION_DENIED",
    )  # fmt: skip
    parser.add_argument(
        "--auth-token-file", default=d.auth_token_file,
        help="require 'authorization: Bearer <token>' metadata; the token in this file may "
        "use every namespace",
    )  # fmt: skip
    parser.add_argument(
        "--insecure-any-host", action="store_true",
        help="allow a non-loopback --host without --auth-token-file",
    )  # fmt: skip
    parser.add_argument("--tls-cert", default=d.tls_cert_file, help="PEM certificate (chain)")
    parser.add_argument("--tls-key", default=d.tls_key_file, help="PEM private key")
    parser.add_argument(
        "--max-message-bytes", type=_size, default=d.max_message_bytes,
        help="largest gRPC message either way (default: 8MiB); pages are split to fit",
    )  # fmt: skip
    parser.add_argument(
        "--metrics-port", type=int, default=d.metrics_port,
        help="serve Prometheus metrics at http://HOST:PORT/metrics",
    )  # fmt: skip
    parser.add_argument(
        "--metrics-token-file", default=d.metrics_token_file,
        help="a token that may scrape /metrics of every namespace (and nothing else); with "
        "tokens configured, a scrape needs one, and a tenant's token sees only its namespaces",
    )  # fmt: skip
    parser.add_argument(
        "--memory-limit", type=_size, default=None,
        help="memory the daemon may use in all: --capacity, the process, and the calls in "
        "flight (each up to 3 x --max-message-bytes); calls past it are refused "
        "(default: --capacity + 192MiB + (--max-streams + 16) calls; printed at start)",
    )  # fmt: skip
    parser.add_argument(
        "--max-streams", type=int, default=None,
        help="BatchPut streams at once, all clients; each tenant gets an equal share "
        "(default: 32, or what --memory-limit leaves room for)",
    )  # fmt: skip
    parser.add_argument(
        "--max-streams-per-client", type=int, default=None,
        help="BatchPut streams at once from one client connection (default: 8)",
    )  # fmt: skip
    parser.add_argument(
        "--stream-idle-timeout", type=float, default=d.stream_idle_timeout_s,
        metavar="SECONDS",
        help="drop a BatchPut stream that sends nothing this long (default: %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--shutdown-grace", type=float, default=d.shutdown_grace_s, metavar="SECONDS",
        help="on SIGTERM, how long calls in flight may finish (default: %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--flush-timeout", type=float, default=d.flush_timeout_s, metavar="SECONDS",
        help="on SIGTERM, how long writing memory to the spill may take; what is left is "
        "counted, logged and lost (default: %(default)s)",
    )  # fmt: skip
    parser.add_argument("--debug", action="store_true", help="on a mistake, print the traceback")
    parser.add_argument(
        "--events-endpoint", default=d.events_endpoint, metavar="ZMQ_ADDRESS",
        help="publish KV events (vLLM's format, medium STORAGE) for the pages stored and "
        "dropped, on this ZMQ PUB address, e.g. tcp://127.0.0.1:5557 (default: none)",
    )  # fmt: skip
    parser.add_argument(
        "--events-replay-endpoint", default=d.events_replay_endpoint, metavar="ZMQ_ADDRESS",
        help="serve replays of recent event batches to a reconnecting subscriber on this "
        "ZMQ ROUTER address (default: none)",
    )  # fmt: skip


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    """The ServerConfig the flags describe; ValueError names a bad one."""
    namespaces = tuple(args.namespace or ())
    tenants = ()
    if args.tenants_file is not None:
        tenants, listed = read_tenants_file(args.tenants_file)
        namespaces = merge_namespaces(namespaces, listed)
    extra = {"namespaces": namespaces} if namespaces else {}
    return ServerConfig(
        host=args.host,
        port=args.port,
        capacity_bytes=args.capacity,
        spill_dir=args.spill_dir,
        spill_url=args.spill_url,
        spill_capacity_bytes=args.spill_capacity,
        spill_mode=args.spill_mode,
        spill_fsync=args.spill_fsync,
        auth_token_file=args.auth_token_file,
        tenants_file=args.tenants_file,
        tenants=tenants,
        metrics_token_file=args.metrics_token_file,
        max_streams=args.max_streams,
        memory_limit_bytes=args.memory_limit,
        max_streams_per_client=args.max_streams_per_client,
        stream_idle_timeout_s=args.stream_idle_timeout,
        insecure_any_host=args.insecure_any_host,
        tls_cert_file=args.tls_cert,
        tls_key_file=args.tls_key,
        max_message_bytes=args.max_message_bytes,
        metrics_port=args.metrics_port,
        shutdown_grace_s=args.shutdown_grace,
        flush_timeout_s=args.flush_timeout,
        events_endpoint=args.events_endpoint,
        events_replay_endpoint=args.events_replay_endpoint,
        **extra,
    )


def run(args: argparse.Namespace) -> int:
    try:
        _check_host(args.host)
        config = config_from_args(args)
        check_before_serving(config)
    except ValueError as exc:
        if args.debug:
            raise
        print(f"hicache serve: error: {exc}", file=sys.stderr)
        return 2
    from .daemon import serve  # grpc is imported only to serve, not to build the parser

    return asyncio.run(serve(config))


def _check_host(host: str) -> None:
    """A --host that does not resolve is named as such (not as 'reachable from others')."""
    try:
        socket.getaddrinfo(host.strip("[]"), None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as exc:
        reason = getattr(exc, "strerror", None) or exc
        raise ValueError(
            f"--host {host}: not an address or a name that resolves ({reason})"
        ) from None


def check_before_serving(config: ServerConfig) -> None:
    """What the flags get wrong about this machine, one line each, before the stores open:
    a port in use or an address not this machine's, a TLS certificate or key that does not
    load (gRPC would only log it and say 'failed to bind')."""
    _check_port("--port", config.host, config.port)
    if config.metrics_port is not None:
        _check_port("--metrics-port", config.host, config.metrics_port)
    if config.tls_cert_file is not None:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        try:
            context.load_cert_chain(config.tls_cert_file, config.tls_key_file)
        except (ssl.SSLError, OSError) as exc:
            raise ValueError(
                f"--tls-cert {config.tls_cert_file} / --tls-key {config.tls_key_file}: not a "
                f"PEM certificate chain and its private key ({exc.strerror or exc})"
            ) from None


def _check_port(flag: str, host: str, port: int) -> None:
    """Bind and close at once, as the server will bind (SO_REUSEADDR, not SO_REUSEPORT)."""
    if port == 0:
        return
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host.strip("[]"), port, type=socket.SOCK_STREAM
        )[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(address)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise ValueError(
                f"{flag} {port}: {host}:{port} is in use (another hicache serve? `ss -ltnp` "
                f"shows who listens; {flag} 0 picks a free port)"
            ) from None
        if exc.errno == errno.EADDRNOTAVAIL:
            raise ValueError(f"--host {host}: not an address of this machine") from None
        raise ValueError(
            f"{flag} {port}: cannot listen on {host}:{port} ({exc.strerror})"
        ) from None
