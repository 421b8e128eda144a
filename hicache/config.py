"""Configuration of a HiCache: one frozen dataclass per component, composed.

Every field is validated in `__post_init__` with a ValueError that names the field and the
allowed values. `HiCacheConfig.from_env()` reads `HICACHE_*` variables; this is the only
place the environment is read (`command_environment` reads the `hicache serve` and
`hicache demo` variables, `HICACHE_SERVE_*` and `HICACHE_DEMO_*`, for the CLI, and
`read_config_file` their TOML files; `backend_environment` the two an L3 backend inside
another engine takes). No torch here: the simulator uses these classes too.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from storage_backends.options import parse_size  # the one size grammar of the project
from tiers.layout import KVLayout

WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
L3_WRITE_POLICIES = ("on_backup", "on_evict")
PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")
EVICTION_POLICIES = ("lru", "lfu", "priority")
L3_FETCH_POLICIES = ("measured", "always")
L2_LOAD_POLICIES = ("measured", "always")


# The longest wait a setting may ask for. Far longer ones are mistakes, and past about 2**33 s
# the waits themselves (threading, asyncio) raise OverflowError. A prefetch's budget is
# base + per-1k x tokens/1000: even at this bound and 10**6 tokens, 3.6e6 s, in range.
MAX_WAIT_S = 3600.0


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _one_of(owner: str, name: str, value: str, allowed: tuple[str, ...]) -> None:
    _require(value in allowed, f"{owner}.{name} must be one of {allowed}, got {value!r}")


@dataclass(frozen=True)
class L1Config:
    """Device pool. `num_pages` 0 sizes the pool from free device memory after
    `reserve_bytes` (on the CPU, where free memory means little, give `num_pages`)."""

    device: str = "cpu"
    num_pages: int = 0
    reserve_bytes: int = 2 * 1024**3
    memory_fraction: float = 0.9

    def __post_init__(self) -> None:
        _require(self.num_pages >= 0, f"L1Config.num_pages must be >= 0, got {self.num_pages}")
        _require(
            self.reserve_bytes >= 0,
            f"L1Config.reserve_bytes must be >= 0, got {self.reserve_bytes}",
        )
        _require(
            0 < self.memory_fraction <= 1,
            f"L1Config.memory_fraction must be in (0, 1], got {self.memory_fraction}",
        )
        _require(
            self.device == "cpu" or self.device.startswith("cuda"),
            f"L1Config.device must be 'cpu' or 'cuda[:N]', got {self.device!r}",
        )


@dataclass(frozen=True)
class L2Config:
    """Host pool. `budget_bytes` 0 disables L2 (and so L3, which is fed from L2)."""

    budget_bytes: int = 0
    reserve_bytes: int = 4 * 1024**3
    pin_memory: bool = True

    def __post_init__(self) -> None:
        _require(
            self.budget_bytes >= 0, f"L2Config.budget_bytes must be >= 0, got {self.budget_bytes}"
        )
        _require(
            self.reserve_bytes >= 0,
            f"L2Config.reserve_bytes must be >= 0, got {self.reserve_bytes}",
        )


@dataclass(frozen=True)
class L3Config:
    """Shared storage, given as a backend URL (`memory://`, `file:///...`, `redis://...`)."""

    url: str | None = None
    write_policy: str = "on_backup"  # when L2 pages go to L3: on backup, or on L2 eviction
    exists_timeout_s: float = 0.5
    # How long a scheduler lets its L3 lookup of a waiting request stand: its admission, and
    # each step it waits for room, match the index alone until then (`HiCache.match(ask_l3=
    # False)`: the index holds what L3 had), not a round trip each. Another writer's pages
    # reach a waiting request this much later at most; a new request always asks. 0: ask
    # every time. The embedded engine, the vLLM connector and the simulator read it.
    ask_again_s: float = 0.5
    prefetch_chunk_pages: int = 32  # pages per read; a prefetch is usable chunk by chunk
    # A read batch holds at most this many bytes too (fewer pages of a large page), and up
    # to `read_batches` of them are in flight at once (0: one per core, at most 4), so a
    # long prefetch reads at the host's memory speed and lands in L2 chunk by chunk. The
    # backends' native readers share their threads between the batches in flight, so a few
    # large batches use the cores as well as many small ones, with less Python between
    # them (bench_engine --read-batches; figures in docs/performance.md).
    read_chunk_bytes: int = 48 << 20
    read_batches: int = 0
    # Pages known only to L3 that the index keeps (least recently used forgotten first; a
    # lookup past a match finds them again). 0: what the backend says it can hold, else 2**20.
    max_indexed_pages: int = 0
    # The tenant's secret, a file (the backend URL's `secret_file=`; never the secret itself):
    # pages are written with a MAC keyed by it, and a page without a valid one is a miss.
    secret_file: str | None = None

    def __post_init__(self) -> None:
        _one_of("L3Config", "write_policy", self.write_policy, L3_WRITE_POLICIES)
        _require(
            self.max_indexed_pages >= 0,
            f"L3Config.max_indexed_pages must be >= 0, got {self.max_indexed_pages}",
        )
        _require(
            self.url is None or "://" in self.url,
            f"L3Config.url must be a backend URL like file:///path, got {self.url!r}",
        )
        _require(
            0 < self.exists_timeout_s <= MAX_WAIT_S,
            f"L3Config.exists_timeout_s must be in (0, {MAX_WAIT_S:g}] seconds, got "
            f"{self.exists_timeout_s}",
        )
        _require(
            0 <= self.ask_again_s <= MAX_WAIT_S,
            f"L3Config.ask_again_s must be in [0, {MAX_WAIT_S:g}] seconds (0: ask every "
            f"time), got {self.ask_again_s}",
        )
        _require(
            self.secret_file is None or (self.url is not None and bool(self.secret_file)),
            "L3Config.secret_file needs an L3 url, and names a file (the secret's path)",
        )
        _require(
            self.prefetch_chunk_pages >= 1,
            f"L3Config.prefetch_chunk_pages must be >= 1, got {self.prefetch_chunk_pages}",
        )
        _require(
            self.read_chunk_bytes >= 1,
            f"L3Config.read_chunk_bytes must be >= 1, got {self.read_chunk_bytes}",
        )
        _require(
            0 <= self.read_batches <= 256,
            f"L3Config.read_batches must be in [0, 256] (0: one per core), got {self.read_batches}",
        )

    def pages_per_read(self, bytes_per_page: int) -> int:
        """Pages in one read batch of a prefetch: `prefetch_chunk_pages`, fewer when that
        many would hold more than `read_chunk_bytes` (never less than one)."""
        return max(1, min(self.prefetch_chunk_pages, self.read_chunk_bytes // bytes_per_page))


@dataclass(frozen=True)
class PolicyConfig:
    """What moves when (DESIGN.md names)."""

    # write_through by default: on multi-turn traffic a turn's new pages are hit once, by
    # the next turn, often after L1 has evicted them; selective write-through has not backed
    # them up by then (bench_controller: hit rate 0.47 against 0.86), and write-back gets
    # the same hits but makes eviction wait for the copy, on the allocation path.
    write_policy: str = "write_through"
    write_through_threshold: int = 2  # hits before a selective write-through backs a run up
    prefetch_policy: str = "timeout"
    prefetch_timeout_base_s: float = 0.05
    prefetch_timeout_per_1k_tokens_s: float = 0.01
    prefetch_min_pages: int = 1  # L3 runs shorter than this are not worth a lookup
    eviction_policy: str = "lru"
    # How much of an L3 run a match fetches: "measured" fetches the leading part whose
    # estimated time to first token (L3 read + L2->L1, by the rates this cache measured)
    # beats recomputing it (by the compute rate the engine reports: `record_compute`);
    # "always" fetches the whole run. Until the compute rate is reported, "measured" fetches
    # all; until L3 has been read, it weighs a read at the priors below, so a short run is
    # recomputed until a read has measured the store; a run no fetch could pay for is not
    # even looked up in L3 (`fetch_plan`).
    l3_fetch_policy: str = "measured"
    # Whether a match loads the L2 run that ends its prefix into L1: "measured" loads it
    # unless loading (its pages over the L2 -> L1 link) takes longer than recomputing its
    # tokens would (a small model whose step costs the same at any length); "always" loads.
    # Until the compute rate is reported, "measured" loads.
    l2_load_policy: str = "measured"
    # Priors of the rates until measured (bytes/s): an L3 read, an L2 -> L1 load (a GPU's
    # cache times one when built); and the latency an unread store's first read is charged
    # (s): what a backend's first read costs once (its threads started, its tables read).
    l3_read_prior_bytes_per_s: float = 2e9
    l2_load_prior_bytes_per_s: float = 10e9
    l3_latency_prior_s: float = 2e-3

    def __post_init__(self) -> None:
        _one_of("PolicyConfig", "write_policy", self.write_policy, WRITE_POLICIES)
        _one_of("PolicyConfig", "prefetch_policy", self.prefetch_policy, PREFETCH_POLICIES)
        _one_of("PolicyConfig", "eviction_policy", self.eviction_policy, EVICTION_POLICIES)
        _one_of("PolicyConfig", "l3_fetch_policy", self.l3_fetch_policy, L3_FETCH_POLICIES)
        _one_of("PolicyConfig", "l2_load_policy", self.l2_load_policy, L2_LOAD_POLICIES)
        for name in ("l3_read_prior_bytes_per_s", "l2_load_prior_bytes_per_s"):
            value = getattr(self, name)
            _require(
                math.isfinite(value) and value > 0,
                f"PolicyConfig.{name} must be finite and > 0, got {value}",
            )
        _require(
            math.isfinite(self.l3_latency_prior_s) and 0 <= self.l3_latency_prior_s <= 60,
            f"PolicyConfig.l3_latency_prior_s must be in [0, 60] seconds, "
            f"got {self.l3_latency_prior_s}",
        )
        _require(
            self.write_through_threshold >= 1,
            "PolicyConfig.write_through_threshold must be >= 1, "
            f"got {self.write_through_threshold}",
        )
        for name in ("prefetch_timeout_base_s", "prefetch_timeout_per_1k_tokens_s"):
            value = getattr(self, name)
            _require(  # (a huge budget overflows the wait: a stated range, not just finite)
                0 <= value <= MAX_WAIT_S,
                f"PolicyConfig.{name} must be in [0, {MAX_WAIT_S:g}] seconds, got {value}",
            )
        _require(
            self.prefetch_min_pages >= 1,
            f"PolicyConfig.prefetch_min_pages must be >= 1, got {self.prefetch_min_pages}",
        )

    def prefetch_budget_s(self, num_tokens: int) -> float:
        """How long a `timeout` prefetch of `num_tokens` may take."""
        return self.prefetch_timeout_base_s + self.prefetch_timeout_per_1k_tokens_s * (
            num_tokens / 1000
        )


@dataclass(frozen=True)
class HiCacheConfig:
    layout: KVLayout
    l1: L1Config = field(default_factory=L1Config)
    l2: L2Config = field(default_factory=L2Config)
    l3: L3Config = field(default_factory=L3Config)
    policy: PolicyConfig = field(default_factory=PolicyConfig)

    def __post_init__(self) -> None:
        _require(
            isinstance(self.layout, KVLayout),
            f"HiCacheConfig.layout must be a KVLayout, got {type(self.layout).__name__}",
        )
        _require(
            self.l3.url is None or self.l2.budget_bytes > 0,
            "HiCacheConfig: an L3 backend needs an L2 pool (l2.budget_bytes > 0): "
            "pages reach L3 through host memory",
        )

    @property
    def page_size(self) -> int:
        return self.layout.page_size

    @classmethod
    def from_env(
        cls, layout: KVLayout | None = None, environ: Mapping[str, str] | None = None
    ) -> HiCacheConfig:
        """Build a config from `HICACHE_*` variables (see `ENV_VARIABLES`).

        The layout comes from `layout` or from HICACHE_LAYOUT (a layout descriptor).
        """
        env = os.environ if environ is None else environ
        unknown = _other_variables(env, ENV_VARIABLES)
        _require(
            not unknown, f"unknown HICACHE_ variables {unknown}; known: {sorted(ENV_VARIABLES)}"
        )
        if layout is None:
            _require("HICACHE_LAYOUT" in env, "HICACHE_LAYOUT is required when no layout is given")
            layout = KVLayout.from_descriptor(env["HICACHE_LAYOUT"])
        parts: dict[str, dict] = {"l1": {}, "l2": {}, "l3": {}, "policy": {}}
        for variable, (part, name, convert) in ENV_VARIABLES.items():
            if variable in env and part:
                try:
                    parts[part][name] = convert(env[variable])
                except ValueError as error:
                    raise ValueError(f"{variable}={env[variable]!r}: {error}") from None
        return cls(
            layout=layout,
            l1=L1Config(**parts["l1"]),
            l2=L2Config(**parts["l2"]),
            l3=L3Config(**parts["l3"]),
            policy=PolicyConfig(**parts["policy"]),
        )

    def replace(self, **changes) -> HiCacheConfig:
        return dataclasses.replace(self, **changes)


def _bool(text: str) -> bool:
    lowered = text.strip().lower()
    _require(lowered in ("1", "0", "true", "false", "yes", "no"), "expected true or false")
    return lowered in ("1", "true", "yes")


# variable -> (component, field, parser); HICACHE_LAYOUT is read by from_env itself.
ENV_VARIABLES = {
    "HICACHE_LAYOUT": ("", "", str),
    "HICACHE_DEVICE": ("l1", "device", str),
    "HICACHE_L1_PAGES": ("l1", "num_pages", int),
    "HICACHE_L1_RESERVE": ("l1", "reserve_bytes", parse_size),
    "HICACHE_L2_SIZE": ("l2", "budget_bytes", parse_size),
    "HICACHE_L2_RESERVE": ("l2", "reserve_bytes", parse_size),
    "HICACHE_L2_PIN": ("l2", "pin_memory", _bool),
    "HICACHE_L3_URL": ("l3", "url", str),
    "HICACHE_L3_WRITE_POLICY": ("l3", "write_policy", str),
    "HICACHE_L3_MAX_INDEXED_PAGES": ("l3", "max_indexed_pages", int),
    "HICACHE_L3_SECRET_FILE": ("l3", "secret_file", str),
    "HICACHE_L3_READ_BATCHES": ("l3", "read_batches", int),
    "HICACHE_L3_READ_CHUNK": ("l3", "read_chunk_bytes", parse_size),
    "HICACHE_L3_EXISTS_TIMEOUT_S": ("l3", "exists_timeout_s", float),
    "HICACHE_L3_ASK_AGAIN_S": ("l3", "ask_again_s", float),
    "HICACHE_L3_FETCH_POLICY": ("policy", "l3_fetch_policy", str),
    "HICACHE_L3_LATENCY_PRIOR_S": ("policy", "l3_latency_prior_s", float),
    "HICACHE_L2_LOAD_POLICY": ("policy", "l2_load_policy", str),
    "HICACHE_WRITE_POLICY": ("policy", "write_policy", str),
    "HICACHE_WRITE_THROUGH_THRESHOLD": ("policy", "write_through_threshold", int),
    "HICACHE_PREFETCH_POLICY": ("policy", "prefetch_policy", str),
    "HICACHE_PREFETCH_TIMEOUT_BASE_S": ("policy", "prefetch_timeout_base_s", float),
    "HICACHE_PREFETCH_TIMEOUT_PER_1K_S": ("policy", "prefetch_timeout_per_1k_tokens_s", float),
    "HICACHE_PREFETCH_MIN_PAGES": ("policy", "prefetch_min_pages", int),
    "HICACHE_EVICTION_POLICY": ("policy", "eviction_policy", str),
}


# What a storage backend inside another engine takes from the environment (SGLang's: the
# engine sizes its own host pool and runs its own policies, so the rest would go unhonoured).
BACKEND_ENV_VARIABLES = ("HICACHE_L3_URL", "HICACHE_L3_SECRET_FILE")


def backend_environment(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The `BACKEND_ENV_VARIABLES` that `environ` sets, by their L3Config field (`url`,
    `secret_file`). Any other `HICACHE_` variable (the commands' own aside) is a ValueError
    that names it, as is an empty one."""
    env = os.environ if environ is None else environ
    refused = _other_variables(env, BACKEND_ENV_VARIABLES)
    _require(
        not refused,
        f"{', '.join(refused)}: a storage backend inside an engine takes only "
        f"{' and '.join(BACKEND_ENV_VARIABLES)} (the engine sizes and runs its own tiers)",
    )
    settings = {}
    for variable in BACKEND_ENV_VARIABLES:
        if variable in env:
            _require(bool(env[variable]), f"{variable} is set but empty")
            settings[ENV_VARIABLES[variable][1]] = env[variable]
    return settings


def _other_variables(env: Mapping[str, str], taken: Collection[str]) -> list[str]:
    """The `HICACHE_` variables of `env` not `taken` (the commands' own aside), sorted."""
    return sorted(
        k
        for k in env
        if k.startswith("HICACHE_") and k not in taken and not k.startswith(COMMAND_ENV_PREFIXES)
    )


# ---------------------------------------------------------------- the commands' settings

# `hicache serve` and `hicache demo` take their settings from flags, then these variables,
# then a TOML file (hicache.cli_settings); HiCacheConfig.from_env leaves them alone.
COMMAND_ENV_PREFIXES = ("HICACHE_SERVE_", "HICACHE_DEMO_")


def command_environment(prefix: str, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """`prefix`* variables (a COMMAND_ENV_PREFIXES entry) as {key: text}, the key lower-cased
    without the prefix: HICACHE_SERVE_SPILL_DIR is `spill_dir`."""
    _require(prefix in COMMAND_ENV_PREFIXES, f"unknown command prefix {prefix!r}")
    env = os.environ if environ is None else environ
    return {
        name[len(prefix) :].lower(): text for name, text in env.items() if name.startswith(prefix)
    }


def read_config_file(path: str | os.PathLike) -> dict[str, Any]:
    """A TOML file's top-level table, read with the standard library; a missing, unreadable
    or malformed file is a ValueError that names it (keys are checked by the caller)."""
    try:
        import tomllib  # the standard library's, from Python 3.11
    except ModuleNotFoundError:
        raise ValueError(f"--config {path}: reading TOML needs Python 3.11 or newer") from None
    try:
        with open(path, "rb") as file:
            return tomllib.load(file)
    except FileNotFoundError:
        raise ValueError(f"--config {path}: no such file") from None
    except IsADirectoryError:
        raise ValueError(f"--config {path}: is a directory, not a TOML file") from None
    except OSError as error:
        raise ValueError(f"--config {path}: cannot be read ({error.strerror})") from None
    except tomllib.TOMLDecodeError as error:
        raise ValueError(f"{path}: not valid TOML: {error}") from None
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not valid TOML: not UTF-8 text") from None
