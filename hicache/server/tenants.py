"""The tenants file (`--tenants-file`): which bearer token may use which namespaces.

One tenant a line; blank lines and lines starting with `#` are skipped:

    # TOKEN                             NAMESPACES
    9f0c4e...c2d1                        team-a=16GiB,team-a-eval=2GiB
    51be77...0a9e                        team-b
    d3a8f1...77e0                        *

A token is at least 16 characters without whitespace (`openssl rand -hex 32` makes one).
NAMESPACES is `*` (every namespace: an operator's token) or a comma-separated list of
`NAME[=QUOTA]`, the grammar of `--namespace`: each is created (a quota is its memory, as with
`--namespace`) and this token may use it and nothing else. A namespace may be listed by
several tokens (a shared one); its quota is given once, or the same each time.

A call with a token for another namespace is refused with PERMISSION_DENIED; Stats and
/metrics show a tenant only its own namespaces. `--auth-token-file` (one token) is the same
as a tenants file line `TOKEN *`.
"""

from __future__ import annotations

import logging
import os
import stat

from storage_backends.options import parse_size

from .config import NamespaceSpec, TenantSpec

logger = logging.getLogger(__name__)
MIN_TOKEN_CHARS = 16


def read_tenants_file(path: str) -> tuple[tuple[TenantSpec, ...], tuple[NamespaceSpec, ...]]:
    """The tenants and the namespaces a tenants file names. ValueError names the line."""
    try:
        with open(path, "rb") as f:
            text = f.read().decode()
            mode = os.fstat(f.fileno()).st_mode
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"--tenants-file: cannot read {path}: {exc}") from None
    tenants: list[TenantSpec] = []
    quotas: dict[str, int | None] = {}
    seen: dict[str, int] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        words = line.split()
        if not words or words[0].startswith("#"):
            continue
        where = f"--tenants-file {path}, line {number}"
        if len(words) != 2:
            raise ValueError(f"{where}: expected 'TOKEN NAMESPACES', got {len(words)} fields")
        token, scope = words
        if len(token) < MIN_TOKEN_CHARS:
            raise ValueError(f"{where}: the token is shorter than {MIN_TOKEN_CHARS} characters")
        if token in seen:
            raise ValueError(f"{where}: the same token as line {seen[token]}")
        seen[token] = number
        if scope == "*":
            tenants.append(TenantSpec(token, None, f"line {number}"))
            continue
        names = []
        for item in scope.split(","):
            name, sep, quota_text = item.partition("=")
            try:
                quota = parse_size(quota_text, name=name) if sep else None
            except ValueError as exc:
                raise ValueError(f"{where}: {exc}") from None
            if name in names:
                raise ValueError(f"{where}: namespace {name!r} is listed twice")
            if quota is not None and quotas.get(name) not in (None, quota):
                raise ValueError(f"{where}: namespace {name!r} has another quota on a line above")
            quotas[name] = quota if quota is not None else quotas.get(name)
            names.append(name)
        tenants.append(TenantSpec(token, tuple(names), f"line {number}"))
    if not tenants:
        raise ValueError(f"--tenants-file: {path} names no tenant")
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        logger.warning("%s: the tenants file is readable by other users", path)
    return tuple(tenants), tuple(NamespaceSpec(name, quota) for name, quota in quotas.items())


def merge_namespaces(
    flags: tuple[NamespaceSpec, ...], listed: tuple[NamespaceSpec, ...]
) -> tuple[NamespaceSpec, ...]:
    """`--namespace` flags plus the namespaces a tenants file names (a quota may be given in
    one place, or the same in both)."""
    merged = {spec.name: spec for spec in flags}
    for spec in listed:
        known = merged.get(spec.name)
        if known is None:
            merged[spec.name] = spec
        elif spec.quota_bytes is not None and known.quota_bytes not in (None, spec.quota_bytes):
            raise ValueError(
                f"namespace {spec.name!r}: --namespace and --tenants-file give different quotas"
            )
        elif spec.quota_bytes is not None:
            merged[spec.name] = spec
    return tuple(merged.values())
