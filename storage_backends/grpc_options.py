"""The options of a `grpc://` (or `grpcs://`) backend, and how a URL becomes them: the
server list (`host:port`, `[ipv6]:port`, the default port), the query options, the bearer
token read from `token_file`. Checked here, before anything connects.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from urllib.parse import unquote, urlsplit

from .errors import BackendConfigError
from .options import BackendOptions, check_range, options_from_query, url_option
from .protocol import (
    DEFAULT_MESSAGE_BYTES,
    DEFAULT_NAMESPACE,
    DEFAULT_PORT,
    MAX_MESSAGE_BYTES,
    MIN_MESSAGE_BYTES,
    check_namespace,
)


@dataclass(frozen=True)
class GrpcOptions(BackendOptions):
    servers: tuple[str, ...] = ()  # "host:port", as listed in the URL
    tls: bool = False  # grpcs://
    token: str = field(default="", repr=False)  # read from token_file
    namespace: str = url_option("namespace", "str", DEFAULT_NAMESPACE, doc="tenant on the server")
    token_file: str = url_option("token_file", "str", "", doc="file holding the bearer token")
    ca_file: str = url_option("ca_file", "str", "", doc="grpcs: CA certificates (PEM)")
    server_name: str = url_option(
        "server_name", "str", "", doc="grpcs: the name the server certificate must carry"
    )
    max_message_bytes: int = url_option(
        "max_message", "size", DEFAULT_MESSAGE_BYTES, doc="largest gRPC message either way"
    )
    put_streams: int = url_option(
        "put_streams", "int", 4, doc="BatchPut streams in flight to one server at once"
    )
    retries: int = url_option("retries", "int", 3, doc="retries of a call refused as UNAVAILABLE")
    backoff_s: float = url_option("backoff", "duration", 0.02, doc="first retry delay; doubles")
    down_s: float = url_option("down_for", "duration", 1.0, doc="skip a failed server this long")
    connect_timeout_s: float = url_option(
        "connect_timeout", "duration", 2.0, doc="first use: how long to wait for each server"
    )
    # Off by default: the client runs inside someone else's engine process, whose malloc
    # policy is not ours to change (`hicache serve` sets it for the daemon).
    tune_malloc: bool = url_option(
        "tune_malloc", "bool", False, doc="set this process' glibc malloc policy (`allocator`)"
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.servers:
            raise BackendConfigError("grpc:// needs host:port (or several, comma-separated)")
        try:
            check_namespace(self.namespace)
        except ValueError as exc:
            raise BackendConfigError(str(exc)) from None
        check_range(
            "max_message", self.max_message_bytes, low=MIN_MESSAGE_BYTES, high=MAX_MESSAGE_BYTES
        )
        check_range("put_streams", self.put_streams, low=1, high=256)
        check_range("retries", self.retries, low=0, high=20)
        check_range("backoff", self.backoff_s, low=0.0)
        check_range("down_for", self.down_s, low=0.0)
        check_range("connect_timeout", self.connect_timeout_s, low=0.001)
        if (self.ca_file or self.server_name) and not self.tls:
            raise BackendConfigError("ca_file and server_name need grpcs:// (TLS)")


def read_file(path: str, option: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise BackendConfigError(f"{option}: cannot read {path!r}: {exc.strerror}") from None


def _parse_servers(netloc: str, url: str) -> tuple[str, ...]:
    servers = []
    for item in netloc.split(","):
        item = item.strip()
        if not item:
            raise BackendConfigError(f"{url}: empty server in the host list")
        if item.startswith("["):  # [ipv6]:port
            host, _, rest = item[1:].partition("]")
            port_text = rest[1:] if rest.startswith(":") else ""
            host = f"[{host}]"
        else:
            host, _, port_text = item.rpartition(":") if ":" in item else (item, "", "")
        try:
            port = int(port_text) if port_text else DEFAULT_PORT
        except ValueError:
            raise BackendConfigError(f"{url}: {item!r} has a bad port {port_text!r}") from None
        if not host or not 0 < port < 65536:
            raise BackendConfigError(f"{url}: {item!r} is not host:port")
        servers.append(f"{host.lower()}:{port}")
    if len(set(servers)) != len(servers):
        raise BackendConfigError(f"{url}: a server is listed twice")
    return tuple(servers)


def options_from_url(url: str, name: str = "") -> GrpcOptions:
    """The options of `grpc://host:port[,host:port...]?namespace=...&token_file=...` (or
    `grpcs://` for TLS), the token read from its file; `name` is the URL as shown."""
    parts = urlsplit(url)
    shown = name or url
    if parts.path not in ("", "/"):
        raise BackendConfigError(f"{shown}: grpc:// takes no path; use ?namespace=")
    if parts.username or parts.password:
        raise BackendConfigError(f"{shown}: grpc:// takes no user:password; use ?token_file=")
    servers = _parse_servers(unquote(parts.netloc), shown)
    options = options_from_query(
        GrpcOptions, parts.query, url=shown, servers=servers, tls=parts.scheme == "grpcs"
    )
    if options.token_file:
        token = read_file(options.token_file, "token_file").decode().strip()
        if not token:
            raise BackendConfigError(f"{shown}: token_file {options.token_file!r} is empty")
        options = dataclasses.replace(options, token=token)
    return options
