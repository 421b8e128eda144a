"""Bearer tokens: who is calling, and which namespaces that caller may use.

Tokens come from `--tenants-file` (each bound to its namespaces, see `tenants`) and from
`--auth-token-file` (one token that may use every namespace). A call must carry
`authorization: Bearer <token>` metadata. The presented token is looked up by its SHA-256
digest, so the lookup's timing says nothing about any token's characters. The health service
is not checked: load balancers and orchestrators probe it without credentials, and it says
nothing but "serving". /metrics takes the same tokens in an HTTP `Authorization` header
(plus `--metrics-token-file`, a scraper's token that sees every namespace and nothing else).
"""

from __future__ import annotations

import hashlib
import logging
import os
import stat
from collections.abc import Iterable
from dataclasses import dataclass

from storage_backends.protocol import AUTH_METADATA_KEY, BEARER_PREFIX

from .config import ServerConfig, TenantSpec

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Tenant:
    """A caller: the namespaces it may use (None: every one), and where its token came from."""

    namespaces: frozenset[str] | None
    source: str
    grpc: bool = True  # False: a /metrics-only token

    def may_use(self, namespace: str) -> bool:
        return self.namespaces is None or namespace in self.namespaces


ANYONE = Tenant(None, "no token configured")  # the caller of a daemon without tokens


class Refused(Exception):
    """The call carries no valid token; the message says what is wrong."""


class TokenCheck:
    def __init__(self, tenants: Iterable[tuple[str, Tenant]]) -> None:
        self._by_digest: dict[bytes, Tenant] = {}
        for token, tenant in tenants:
            if not token:
                raise ValueError(f"{tenant.source}: the token is empty")
            self._by_digest[_digest(token.encode())] = tenant

    @classmethod
    def from_config(cls, config: ServerConfig) -> TokenCheck | None:
        """The daemon's tokens, or None when it has none (every caller is `ANYONE`)."""
        if not config.has_tokens and config.metrics_token_file is None:
            return None
        entries = [_tenant_entry(spec, config.tenants_file) for spec in config.tenants]
        if config.auth_token_file is not None:
            token = read_token_file(config.auth_token_file, "--auth-token-file")
            entries.append((token, Tenant(None, "--auth-token-file")))
        if config.metrics_token_file is not None:
            token = read_token_file(config.metrics_token_file, "--metrics-token-file")
            entries.append((token, Tenant(None, "--metrics-token-file", grpc=False)))
        tokens = [token for token, _ in entries]
        if len(set(tokens)) != len(tokens):
            raise ValueError("the same token is given twice (tenants, auth and metrics tokens)")
        return cls(entries)

    def tenant(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> Tenant:
        """The caller of a gRPC call by its metadata; raises Refused."""
        values = [value for key, value in metadata or () if key == AUTH_METADATA_KEY]
        if not values:
            raise Refused(
                f"missing bearer token: this server needs '{AUTH_METADATA_KEY}: "
                f"{BEARER_PREFIX}<token>' metadata (grpc:// URL option token_file)"
            )
        tenant = self.http_tenant(values[-1])
        if not tenant.grpc:
            raise Refused("wrong bearer token")  # the metrics token does not open the store
        return tenant

    def http_tenant(self, header: str | bytes | None) -> Tenant:
        """The caller by an `Authorization` value; raises Refused."""
        if header is None:
            raise Refused(f"missing bearer token ('{AUTH_METADATA_KEY}: {BEARER_PREFIX}<token>')")
        if isinstance(header, str):
            header = header.encode()
        prefix = BEARER_PREFIX.encode()
        if not header.startswith(prefix):
            raise Refused(f"the {AUTH_METADATA_KEY} metadata is not '{BEARER_PREFIX}<token>'")
        tenant = self._by_digest.get(_digest(header[len(prefix) :].strip()))
        if tenant is None:
            raise Refused("wrong bearer token")
        return tenant


def read_token_file(path: str, flag: str) -> str:
    """One token (surrounding whitespace dropped); ValueError names the flag."""
    try:
        with open(path, "rb") as f:
            token = f.read().decode().strip()
            mode = os.fstat(f.fileno()).st_mode
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{flag}: cannot read {path}: {exc}") from None
    if not token:
        raise ValueError(f"{flag}: {path} is empty")
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        logger.warning("%s: the token file is readable by other users", path)
    return token


def _tenant_entry(spec: TenantSpec, path: str | None) -> tuple[str, Tenant]:
    namespaces = None if spec.namespaces is None else frozenset(spec.namespaces)
    return spec.token, Tenant(namespaces, f"{path or '--tenants-file'} {spec.source}")


def _digest(token: bytes) -> bytes:
    return hashlib.sha256(token).digest()
