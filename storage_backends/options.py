"""Typed backend options, parsed from a backend URL's query string.

Each backend declares one frozen dataclass of options. A field that may be set from the URL
carries `url_option(...)` metadata: the query name users type (`capacity`, not
`capacity_bytes`) and how its text is parsed (a size such as "8GiB", a duration such as
"250ms", a bool, an int, a choice). `options_from_query` turns a query into the dataclass and
names the offending option in every error; the dataclass' `__post_init__` checks ranges.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar
from urllib.parse import parse_qsl, urlencode

from .errors import BackendConfigError

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
MAX_DURATION_S = 86400.0  # a day: any longer is a mistake (and past ~2**33 s waits overflow)
_DURATION_UNITS = {"": 1.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "m": 60.0, "min": 60.0, "h": 3600.0}
_NUMBER_WITH_UNIT = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*$")
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def parse_size(text: str | int, *, name: str = "size") -> int:
    """Bytes from "8GiB", "100GB", "512MiB", "64KiB", "4096" (units: B, KB..TB, KiB..TiB).

    The one size grammar of the project (flags, URLs, HICACHE_* variables, config files):
    strict, so "8G" (decimal or binary?), a typo or a fraction of a byte is an error.
    """
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise BackendConfigError(f"{name}: {text} is not a size (it is negative)")
        return text
    match = _NUMBER_WITH_UNIT.match(str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _SIZE_UNITS:
        raise BackendConfigError(
            f"{name}: {text!r} is not a size; use a byte count or a number with a unit "
            f"(B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), e.g. 8GiB or 100GB"
        )
    value = float(match.group(1)) * _SIZE_UNITS[unit]
    if value != int(value):
        raise BackendConfigError(f"{name}: {text!r} is not a whole number of bytes")
    return int(value)


def parse_duration(text: str | float, *, name: str = "duration") -> float:
    """Seconds from "250ms", "2s", "1.5", "5m", "1h" (a bare number is seconds)."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        return float(text)
    match = _NUMBER_WITH_UNIT.match(str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _DURATION_UNITS:
        raise BackendConfigError(
            f"{name}: {text!r} is not a duration; use seconds or a number with a unit "
            f"(us, ms, s, m, h), e.g. 250ms or 2s"
        )
    seconds = float(match.group(1)) * _DURATION_UNITS[unit]
    if not seconds <= MAX_DURATION_S:
        raise BackendConfigError(
            f"{name}: {text!r} is out of range: a duration is at most {MAX_DURATION_S:g}s"
        )
    return seconds


def parse_bool(text: str | bool, *, name: str = "flag") -> bool:
    if isinstance(text, bool):
        return text
    lowered = str(text).strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise BackendConfigError(f"{name}: {text!r} is not a boolean; use true or false")


def parse_int(text: str | int, *, name: str = "count") -> int:
    if isinstance(text, int) and not isinstance(text, bool):
        return text
    try:
        return int(str(text).strip())
    except ValueError:
        raise BackendConfigError(f"{name}: {text!r} is not an integer") from None


def parse_str(text: str, *, name: str = "option") -> str:
    return str(text)


_PARSERS = {
    "size": parse_size,
    "duration": parse_duration,
    "bool": parse_bool,
    "int": parse_int,
    "str": parse_str,
}


def url_option(query_name: str, kind: str, default: Any, *, doc: str = "") -> Any:
    """A dataclass field settable from the URL query as `query_name`, parsed as `kind`."""
    if kind not in _PARSERS:
        raise ValueError(f"unknown option kind {kind!r}")
    return field(default=default, metadata={"query": query_name, "kind": kind, "doc": doc})


def check_range(name: str, value: float, *, low: float, high: float | None = None) -> None:
    """Raise BackendConfigError unless low <= value (<= high); NaN is never in range."""
    if not (value >= low) or (high is not None and value > high):
        allowed = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise BackendConfigError(f"{name} must be {allowed}, got {value}")


@dataclass(frozen=True)
class BackendOptions:
    """Options every backend has. Backends subclass this with their own fields."""

    timeout_s: float = url_option(
        "timeout", "duration", 5.0, doc="deadline of one call; past it, pending pages miss"
    )
    compression: str = url_option(
        "compression", "str", "none", doc="none | lz4 (lz4 kept only when it saves space)"
    )
    warn_interval_s: float = url_option(
        "warn_interval", "duration", 30.0, doc="at most one warning of a kind per interval"
    )
    close_grace_s: float = url_option(
        "close_grace", "duration", 5.0, doc="close() waits this long for work under way"
    )
    secret_file: str = url_option(
        "secret_file", "str", "", doc="the tenant's secret: pages carry a MAC keyed by it"
    )
    breaker_failures: int = url_option(
        "breaker_failures", "int", 3, doc="faults in a row that open the circuit breaker; 0: off"
    )
    breaker_backoff_s: float = url_option(
        "breaker_backoff", "duration", 1.0, doc="calls fail fast this long, then one probe"
    )
    breaker_max_backoff_s: float = url_option(
        "breaker_max_backoff", "duration", 30.0, doc="the back-off doubles up to this"
    )

    def __post_init__(self) -> None:
        check_range("timeout", self.timeout_s, low=0.001, high=3600.0)
        check_range("warn_interval", self.warn_interval_s, low=0.0)
        check_range("close_grace", self.close_grace_s, low=0.01, high=3600.0)
        check_range("breaker_failures", self.breaker_failures, low=0)
        check_range("breaker_backoff", self.breaker_backoff_s, low=0.001, high=3600.0)
        check_range("breaker_max_backoff", self.breaker_max_backoff_s, low=0.001, high=86400.0)
        if self.compression not in ("none", "lz4"):
            raise BackendConfigError(
                f"compression must be 'none' or 'lz4', got {self.compression!r}"
            )


Options = TypeVar("Options", bound=BackendOptions)


def query_names(cls: type[BackendOptions]) -> dict[str, dataclasses.Field]:
    return {f.metadata["query"]: f for f in dataclasses.fields(cls) if "query" in f.metadata}


def options_from_query(
    cls: type[Options], query: str | Mapping[str, str], *, url: str, **fixed: Any
) -> Options:
    """Build `cls` from a URL query string; `fixed` are fields taken from the rest of the URL.

    Every error names the option and the URL (with any password removed by the caller).
    """
    pairs = parse_qsl(query, keep_blank_values=True) if isinstance(query, str) else query.items()
    known = query_names(cls)
    values: dict[str, Any] = {}
    seen: set[str] = set()
    for name, text in pairs:
        spec = known.get(name)
        if spec is None:
            raise BackendConfigError(
                f"{url}: unknown option {name!r}; known options: {', '.join(sorted(known))}"
            )
        if name in seen:
            raise BackendConfigError(f"{url}: option {name!r} given twice")
        seen.add(name)
        values[spec.name] = _PARSERS[spec.metadata["kind"]](text, name=name)
    try:
        return cls(**fixed, **values)
    except BackendConfigError as exc:
        raise BackendConfigError(f"{url}: {exc}") from None


def with_option(url: str, name: str, value: str) -> str:
    """`url` with one more query option: a setting given apart from the URL (the tenant's
    secret file from a config or the environment). Given in the URL as well, it is the error
    "given twice" when the URL is opened."""
    return url + ("&" if "?" in url else "?") + urlencode({name: value})


def redact_url(url: str) -> str:
    """The URL with any password replaced by ***, for names, logs and error messages."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    netloc, slash, tail = rest.partition("/")
    userinfo, at, hosts = netloc.rpartition("@")
    if not at or ":" not in userinfo:
        return url
    user = userinfo.split(":", 1)[0]
    return f"{scheme}://{user}:***@{hosts}{slash}{tail}"
