"""Backends by URL: `open_backend("redis://host:6379/0?prefix=ns1:", layout=...)`.

A scheme maps to a factory, given as "module:function" so that a backend's client library is
imported only when a URL of that scheme is opened (`import storage_backends` never imports
redis). A factory is called as `factory(url, layout=..., name=...)` and returns an unopened
`StorageBackend`; it parses its options with `options.options_from_query`, so an unknown
option or a bad size fails here, before anything connects.

Built in: memory, file, redis, rediss, redis+cluster, rediss+cluster, mooncake (Mooncake
Store), and the cache-server client grpc and grpcs (TLS).
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable
from urllib.parse import unquote, urlsplit

from .base import StorageBackend
from .errors import BackendConfigError
from .options import redact_url

BackendFactory = Callable[..., StorageBackend]

_BUILTIN: dict[str, str] = {
    "memory": "storage_backends.memory_store:open_url",
    "file": "storage_backends.file_store:open_url",
    "redis": "storage_backends.redis_store:open_url",
    "rediss": "storage_backends.redis_store:open_url",
    "redis+cluster": "storage_backends.redis_store:open_url",
    "rediss+cluster": "storage_backends.redis_store:open_url",
    "grpc": "storage_backends.grpc_store:open_url",
    "grpcs": "storage_backends.grpc_store:open_url",
    "mooncake": "storage_backends.mooncake_store:open_url",
}

_factories: dict[str, str | BackendFactory] = dict(_BUILTIN)
_lock = threading.Lock()


def register_backend(scheme: str, factory: str | BackendFactory, *, replace: bool = False) -> None:
    """Make `scheme://...` URLs open with `factory` ("module:function" or a callable)."""
    scheme = scheme.lower()
    if not scheme or "://" in scheme or ":" in scheme:
        raise ValueError(f"scheme must be a bare name such as 'grpc', got {scheme!r}")
    if isinstance(factory, str) and factory.count(":") != 1:
        raise ValueError(f"factory must be 'module:function' or a callable, got {factory!r}")
    with _lock:
        if scheme in _factories and not replace and _factories[scheme] != factory:
            raise ValueError(f"scheme {scheme!r} is already registered (pass replace=True)")
        _factories[scheme] = factory


def known_schemes() -> list[str]:
    with _lock:
        return sorted(_factories)


def open_backend(url: str, *, layout: str | None = None) -> StorageBackend:
    """Build the backend a URL names. Nothing connects yet: the first call (or `connect()`)
    does, and raises BackendUnavailableError if the backend cannot be reached.

    `layout` is the KV layout descriptor pages are written and expected under; leave it out
    only for a store that handles already-encoded objects (`*_objects` calls).
    """
    if not isinstance(url, str) or "://" not in url:
        raise BackendConfigError(f"not a backend URL: {url!r} (expected scheme://...)")
    name = redact_url(_printable(url))
    _check_url_text(url, name)
    scheme = url.split("://", 1)[0].lower()
    with _lock:
        factory = _factories.get(scheme)
    if factory is None:
        raise BackendConfigError(
            f"{name}: unknown storage backend {scheme!r}; known: {', '.join(known_schemes())}"
        )
    if isinstance(factory, str):
        module_name, function_name = factory.split(":")
        factory = getattr(importlib.import_module(module_name), function_name)
    try:
        return factory(url, layout=layout, name=name)
    except BackendConfigError:
        raise
    except ValueError as exc:  # what the URL parser or a path check found: still the URL's
        raise BackendConfigError(f"{name}: {exc}") from None


def _printable(url: str) -> str:
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in url)


def _check_url_text(url: str, name: str) -> None:
    """A URL holds no control character, as written or percent-decoded (a NUL in a path
    would only fail later, inside the OS call); its host part parses."""
    for form, text in (("", url), ("percent-decoded ", unquote(url))):
        bad = next((c for c in text if not c.isprintable()), None)
        if bad is not None:
            raise BackendConfigError(
                f"{name}: the {form}URL holds a control character {ascii(bad)}"
            )
    try:
        urlsplit(url)
    except ValueError as exc:
        raise BackendConfigError(f"{name}: {exc}") from None
