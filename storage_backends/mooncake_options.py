"""Options of `mooncake://MASTER_HOST:PORT?...` (the backend is `mooncake_store`)."""

from __future__ import annotations

from dataclasses import dataclass

from .errors import BackendConfigError
from .options import BackendOptions, check_range, options_from_query, url_option

DEFAULT_PORT = 50051
_PROTOCOLS = ("tcp", "rdma")
_MIN_SEGMENT_BYTES = 16 << 20


@dataclass(frozen=True)
class MooncakeOptions(BackendOptions):
    master: tuple[str, int] = ("127.0.0.1", DEFAULT_PORT)
    prefix: str = url_option("prefix", "str", "hicache:", doc="object name prefix: a namespace")
    protocol: str = url_option("protocol", "str", "tcp", doc="tcp | rdma")
    device: str = url_option("device", "str", "", doc="rdma devices, e.g. mlx5_0,mlx5_1; ''=all")
    metadata: str = url_option(
        "metadata", "str", "P2PHANDSHAKE", doc="P2PHANDSHAKE, or http://... / etcd://... service"
    )
    local_host: str = url_option(
        "local_host", "str", "", doc="this host as peers reach it; '': the route to the master"
    )
    segment_bytes: int = url_option(
        "segment", "size", 0, doc="memory this process lends to the store; 0: a client only"
    )
    buffer_bytes: int = url_option(
        "buffer", "size", 256 << 20, doc="registered staging memory pages move through"
    )
    direct_bytes: int = url_option(
        "direct",
        "size",
        256 << 10,
        doc="pages this large or larger move straight into and out of a lent pool; 0: never",
    )
    replicas: int = url_option("replicas", "int", 1, doc="copies of each page, on other segments")
    soft_pin_s: float = url_option(
        "soft_pin", "duration", 0.0, doc="pages are evicted after unpinned ones for this; 0: off"
    )
    io_threads: int = url_option("io_threads", "int", 4, doc="transfers in flight at once")
    connect_timeout_s: float = url_option("connect_timeout", "duration", 2.0)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.protocol not in _PROTOCOLS:
            raise BackendConfigError(f"protocol must be tcp or rdma, got {self.protocol!r}")
        if self.device and self.protocol != "rdma":
            raise BackendConfigError("device names RDMA devices: it needs protocol=rdma")
        if self.segment_bytes and self.segment_bytes < _MIN_SEGMENT_BYTES:
            raise BackendConfigError(
                f"segment must be 0 or at least 16MiB (Mooncake's least), got {self.segment_bytes}"
            )
        check_range("buffer", self.buffer_bytes, low=1 << 20, high=1 << 40)
        check_range("direct", self.direct_bytes, low=0, high=1 << 40)
        check_range("replicas", self.replicas, low=1, high=64)
        check_range("soft_pin", self.soft_pin_s, low=0.0, high=365 * 86400.0)
        check_range("io_threads", self.io_threads, low=1, high=64)
        check_range("connect_timeout", self.connect_timeout_s, low=0.001)
        if not self.master[0] or not 0 < self.master[1] < 65536:
            raise BackendConfigError(f"the master must be host:port, got {self.master}")


def _parse_master(url: str, netloc: str) -> tuple[str, int]:
    if "@" in netloc or "," in netloc:
        raise BackendConfigError(f"{url}: the master is one host:port (no user, no list)")
    if netloc.startswith("["):  # [::1]:50051
        host, _, port = netloc[1:].partition("]")
        port = port.lstrip(":")
    else:
        host, _, port = netloc.rpartition(":") if ":" in netloc else (netloc, "", "")
    if not host:
        raise BackendConfigError(f"{url}: the master's host is missing (mooncake://HOST:PORT)")
    try:
        return host, int(port) if port else DEFAULT_PORT
    except ValueError:
        raise BackendConfigError(f"{url}: bad port in {netloc!r}") from None


def options_from_url(url: str, name: str) -> MooncakeOptions:
    """The options a mooncake:// URL gives (`name`: the URL as errors show it)."""
    rest = url.split("://", 1)[1]
    rest, _, query = rest.partition("?")
    netloc, _, path = rest.partition("/")
    if path.strip("/"):
        raise BackendConfigError(f"{name}: a mooncake:// URL has no path, got /{path}")
    if any(pair.partition("=")[0] == "lease" for pair in query.split("&")):
        raise BackendConfigError(
            f"{name}: lease is the master's: how long a read holds a page against eviction is "
            "mooncake_master --default_kv_lease_ttl (soft_pin= keeps pages longer from here)"
        )
    return options_from_query(MooncakeOptions, query, url=name, master=_parse_master(name, netloc))
