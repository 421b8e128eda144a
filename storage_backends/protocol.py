"""What the cache-server and its client agree on besides proto/kvstore.proto.

Method paths, the namespace rule, how the bearer token travels, the default port and the
message-size floor. The daemon (hicache.server) and the `grpc://` backend both import this,
so the two can never disagree.
"""

from __future__ import annotations

import re

SERVICE = "hicache.v1.KVStore"
HEALTH_SERVICE = "grpc.health.v1.Health"

DEFAULT_PORT = 50051
DEFAULT_NAMESPACE = "default"
AUTH_METADATA_KEY = "authorization"  # value: "Bearer <token>"
BEARER_PREFIX = "Bearer "

MIN_MESSAGE_BYTES = 64 << 10  # a smaller message limit could not carry pages efficiently
DEFAULT_MESSAGE_BYTES = 4 << 20  # gRPC's own default receive limit
MAX_MESSAGE_BYTES = (1 << 31) - 1  # gRPC's hard limit on one message

_NAMESPACE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def method_path(name: str) -> str:
    """The full gRPC method path of a KVStore call, e.g. "/hicache.v1.KVStore/BatchGet"."""
    return f"/{SERVICE}/{name}"


def check_namespace(name: str) -> str:
    """A namespace name: 1-64 of [A-Za-z0-9._-], starting with a letter or digit (it names a
    spill directory on the server). Raises ValueError naming the rule."""
    if not isinstance(name, str) or _NAMESPACE.fullmatch(name) is None:
        raise ValueError(
            f"namespace {name!r} is not valid: use 1-64 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return name


def bearer_metadata(token: str) -> tuple[tuple[str, str], ...]:
    """The call metadata that carries `token` ("" for none)."""
    return ((AUTH_METADATA_KEY, BEARER_PREFIX + token),) if token else ()
