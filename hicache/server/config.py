"""The cache-server's configuration: one frozen dataclass, checked when it is built.

`hicache serve` takes its flag defaults from here. Every check raises ValueError naming the
field (as its flag) and what is allowed.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from dataclasses import dataclass, field
from typing import NamedTuple

from storage_backends.protocol import (
    DEFAULT_NAMESPACE,
    DEFAULT_PORT,
    MAX_MESSAGE_BYTES,
    MIN_MESSAGE_BYTES,
    check_namespace,
)

SPILL_MODES = ("evict", "write-through")
# Stores a spill may be given as a URL: each namespace's pages under a prefix of its own.
SPILL_URL_SCHEMES = ("mooncake", "redis", "rediss", "redis+cluster", "rediss+cluster")

# The memory budget (--memory-limit): pages (--capacity), plus what calls in flight hold, plus
# the process itself. A call in flight holds up to RECEIVE_COPIES copies of one message of
# --max-message-bytes: gRPC's receive buffer, the bytearray it gathers the message into, the
# bytes object the handler gets. Pieces a BatchPut stream keeps past its message are charged
# to its namespace (part of --capacity). Measured by tests/hicache/server/test_memory_budget.py.
BASE_BYTES = 192 << 20  # the interpreter, gRPC, libraries, and free memory malloc keeps
RECEIVE_COPIES = 3
MESSAGE_SLACK_BYTES = 4096  # gRPC's limit counts the whole message; ours counts pages
OTHER_CALLS = 16  # calls other than BatchPut (gets, exists, deletes, stats) budgeted at once
REFUSAL_CALLS = 4  # of the calls budgeted, kept for calls on their way to being refused
MAX_WAIT_S = 86400.0  # any timeout: a day (past ~2**33 s the waits raise OverflowError)
DEFAULT_STREAMS = 32  # --max-streams when neither it nor --memory-limit is given


class NamespaceSpec(NamedTuple):
    """A tenant: its name, and the memory it may hold (None: an equal share of what is left)."""

    name: str
    quota_bytes: int | None = None


class MemoryBudget(NamedTuple):
    """How `limit_bytes` is spent: pages, the process, and `num_calls` calls in flight at
    `call_bytes` each (gRPC refuses a call past them, RESOURCE_EXHAUSTED)."""

    limit_bytes: int
    capacity_bytes: int
    base_bytes: int
    call_bytes: int
    num_calls: int

    def describe(self) -> str:
        return (
            f"memory limit {self.limit_bytes >> 20} MiB: {self.capacity_bytes >> 20} MiB of "
            f"pages + {self.base_bytes >> 20} MiB for the process + {self.num_calls} calls in "
            f"flight x {self.call_bytes >> 20} MiB"
        )


@dataclass(frozen=True)
class TenantSpec:
    """A bearer token and the namespaces it may use (None: every namespace)."""

    token: str = field(repr=False)
    namespaces: tuple[str, ...] | None
    source: str = ""  # where it was given ("line 3"), for messages; never the token


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT  # 0: any free port (printed on start)
    capacity_bytes: int = 4 << 30  # memory for pages, headers included, all namespaces
    namespaces: tuple[NamespaceSpec, ...] = (NamespaceSpec(DEFAULT_NAMESPACE),)
    spill_dir: str | None = None  # evicted pages go here (a file:// store), one folder each ns
    spill_url: str | None = None  # or into a shared store (mooncake://, redis://), a prefix each ns
    spill_capacity_bytes: int = 64 << 30
    spill_mode: str = "evict"  # evict: on eviction and shutdown; write-through: before the ack
    spill_fsync: bool = False  # fsync spilled pages (write-through acks survive power loss)
    auth_token_file: str | None = None  # one token that may use every namespace
    tenants_file: str | None = None  # where `tenants` came from (see tenants.py)
    tenants: tuple[TenantSpec, ...] = ()  # tokens bound to namespaces
    insecure_any_host: bool = False  # allow a non-loopback host without a token
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    max_message_bytes: int = 8 << 20  # the largest gRPC message, either way
    max_batch_keys: int = 16384  # keys (pages) of one call
    max_object_bytes: int = 256 << 20  # one page object
    max_put_bytes: int = 4 << 30  # one BatchPut call, all pages
    metrics_port: int | None = None  # Prometheus /metrics on host:port
    metrics_token_file: str | None = None  # a scraper's token: /metrics of every namespace
    max_streams: int | None = None  # BatchPut streams at once, all clients (None: the budget's)
    memory_limit_bytes: int | None = None  # None: --capacity plus the calls' stated overhead
    max_streams_per_client: int | None = None  # ... from one client connection (None: 8)
    stream_idle_timeout_s: float = 10.0  # a BatchPut stream silent this long is dropped
    shutdown_grace_s: float = 30.0  # SIGTERM: how long in-flight calls may finish
    flush_timeout_s: float = 120.0  # SIGTERM: how long writing memory to the spill may take
    spill_timeout_s: float = 60.0  # one spill read or write batch
    events_endpoint: str | None = None  # publish L3 KV events on this ZMQ PUB address
    events_replay_endpoint: str | None = None  # ... and serve replays on this ROUTER address
    events_topic: str | None = None  # the events' first frame; None: kv@<host>@hicache-serve
    events_format: str = "vllm"  # or "sglang": the schema of the events

    def __post_init__(self) -> None:
        _check(bool(self.host), "--host must not be empty")
        _check(0 <= self.port < 65536, f"--port must be in [0, 65535], got {self.port}")
        _check(self.capacity_bytes > 0, f"--capacity must be > 0, got {self.capacity_bytes}")
        self._check_namespaces()
        self._check_spill()
        self._check_access()
        self._check_limits()
        self._check_events()

    def _check_spill(self) -> None:
        """--spill-*: one place to spill to, and what it takes."""
        if self.spill_dir is not None:
            _check(os.path.isabs(self.spill_dir), f"--spill-dir must be absolute: {self.spill_dir}")
            _check(
                not os.path.exists(self.spill_dir) or os.path.isdir(self.spill_dir),
                f"--spill-dir {self.spill_dir} exists and is not a directory",
            )
            _check(
                self.spill_capacity_bytes > 0,
                f"--spill-capacity must be > 0, got {self.spill_capacity_bytes}",
            )
        _check(
            self.spill_mode in SPILL_MODES,
            f"--spill-mode must be one of {', '.join(SPILL_MODES)}, got {self.spill_mode!r}",
        )
        _check(
            self.spill_dir is None or self.spill_url is None,
            "--spill-dir and --spill-url are two places for one spill: give one",
        )
        if self.spill_url is not None:
            scheme = self.spill_url.partition("://")[0].lower()
            _check(
                scheme in SPILL_URL_SCHEMES,
                f"--spill-url takes a store shared by prefix ({', '.join(SPILL_URL_SCHEMES)}), "
                f"got {scheme!r}",
            )
            _check(not self.spill_fsync, "--spill-fsync needs --spill-dir (files to fsync)")
        _check(
            self.spill_mode == "evict" or self.spill_dir is not None or self.spill_url is not None,
            "--spill-mode write-through needs --spill-dir or --spill-url",
        )

    def _check_access(self) -> None:
        """TLS, the token files, the tenants, and who can reach the host."""
        _check(
            (self.tls_cert_file is None) == (self.tls_key_file is None),
            "--tls-cert and --tls-key go together",
        )
        for flag, path in (
            ("--auth-token-file", self.auth_token_file),
            ("--metrics-token-file", self.metrics_token_file),
            ("--tls-cert", self.tls_cert_file),
            ("--tls-key", self.tls_key_file),
        ):
            _check(path is None or os.path.isfile(path), f"{flag}: no such file: {path}")
        self._check_tenants()
        _check(
            self.has_tokens or self.insecure_any_host or is_loopback(self.host),
            f"--host {self.host} is reachable from other machines: give --tenants-file or "
            "--auth-token-file (or --insecure-any-host to serve anyone who can connect)",
        )

    def _check_limits(self) -> None:
        """Message, batch and object sizes, streams and memory, and the waits."""
        _check(
            MIN_MESSAGE_BYTES <= self.max_message_bytes <= MAX_MESSAGE_BYTES,
            f"--max-message-bytes must be in [{MIN_MESSAGE_BYTES}, {MAX_MESSAGE_BYTES}], "
            f"got {self.max_message_bytes}",
        )
        _check(self.max_batch_keys >= 1, f"max_batch_keys must be >= 1: {self.max_batch_keys}")
        _check(self.max_object_bytes >= 1, "max_object_bytes must be >= 1")
        _check(self.max_put_bytes >= self.max_object_bytes, "max_put_bytes < max_object_bytes")
        _check(
            self.metrics_port is None or 0 <= self.metrics_port < 65536,
            f"--metrics-port must be in [0, 65535], got {self.metrics_port}",
        )
        self._resolve_budget()
        _check(
            1 <= self.max_streams_per_client <= self.max_streams,
            f"--max-streams-per-client must be in [1, --max-streams {self.max_streams}], "
            f"got {self.max_streams_per_client}",
        )
        for flag, value, low in (
            ("--stream-idle-timeout", self.stream_idle_timeout_s, "("),
            ("--shutdown-grace", self.shutdown_grace_s, "["),
            ("--flush-timeout", self.flush_timeout_s, "("),
            ("spill_timeout_s", self.spill_timeout_s, "("),
        ):
            _check(
                (0 < value if low == "(" else 0 <= value) and value <= MAX_WAIT_S,
                f"{flag} must be in {low}0, {MAX_WAIT_S:g}] seconds, got {value}",
            )

    def _check_events(self) -> None:
        """--events-*: ZMQ addresses, and a replay socket only beside a publisher."""
        for flag, endpoint in (
            ("--events-endpoint", self.events_endpoint),
            ("--events-replay-endpoint", self.events_replay_endpoint),
        ):
            _check(
                endpoint is None or endpoint.startswith(("tcp://", "ipc://")),
                f"{flag} must be a ZMQ address (tcp://HOST:PORT or ipc://PATH), got {endpoint}",
            )
        _check(
            self.events_replay_endpoint is None or self.events_endpoint is not None,
            "--events-replay-endpoint needs --events-endpoint",
        )
        _check(
            self.events_format in ("vllm", "sglang"),
            f"--events-format must be vllm or sglang, got {self.events_format!r}",
        )

    def _resolve_budget(self) -> None:
        """Fill in --max-streams and --memory-limit from each other (see MemoryBudget)."""
        _check(
            self.max_streams is None or self.max_streams >= 1,
            f"--max-streams must be >= 1, got {self.max_streams}",
        )
        call_bytes = RECEIVE_COPIES * (self.max_message_bytes + MESSAGE_SLACK_BYTES)
        fixed = self.capacity_bytes + BASE_BYTES
        limit, streams = self.memory_limit_bytes, self.max_streams
        if limit is None:
            streams = DEFAULT_STREAMS if streams is None else streams
            limit = fixed + (streams + OTHER_CALLS) * call_bytes
        num_calls = max(limit - fixed, 0) // call_bytes
        needed = fixed + (max(streams or 1, 1) + OTHER_CALLS) * call_bytes
        _check(
            num_calls - OTHER_CALLS >= (streams or 1),
            f"--memory-limit {limit} is too small: --capacity {self.capacity_bytes} + "
            f"{BASE_BYTES >> 20} MiB for the process + {call_bytes} bytes for each call in "
            f"flight ({RECEIVE_COPIES} x --max-message-bytes {self.max_message_bytes}) x "
            f"({streams or 1} BatchPut streams (--max-streams) + {OTHER_CALLS} other calls) "
            f"needs {needed}",
        )
        object.__setattr__(self, "memory_limit_bytes", limit)
        object.__setattr__(self, "max_streams", streams or num_calls - OTHER_CALLS)
        if self.max_streams_per_client is None:
            object.__setattr__(self, "max_streams_per_client", min(8, self.max_streams))

    @property
    def num_tenants(self) -> int:
        """Callers told apart by their token (1 without tokens: every caller is the same)."""
        return max(len(self.tenants) + (self.auth_token_file is not None), 1)

    @property
    def calls_per_tenant(self) -> int:
        """Calls one tenant is guaranteed in flight (`shares.FairShares` of the budget's
        calls, less a few kept for refusing calls); it may borrow what others leave idle."""
        return max((self.budget.num_calls - REFUSAL_CALLS) // self.num_tenants, 1)

    @property
    def budget(self) -> MemoryBudget:
        """What the memory limit pays for."""
        call_bytes = RECEIVE_COPIES * (self.max_message_bytes + MESSAGE_SLACK_BYTES)
        num_calls = (self.memory_limit_bytes - self.capacity_bytes - BASE_BYTES) // call_bytes
        return MemoryBudget(
            self.memory_limit_bytes, self.capacity_bytes, BASE_BYTES, call_bytes, num_calls
        )

    def _check_namespaces(self) -> None:
        _check(len(self.namespaces) > 0, "at least one --namespace is needed")
        names = [spec.name for spec in self.namespaces]
        for name in names:
            try:
                check_namespace(name)
            except ValueError as exc:
                raise ValueError(f"--namespace: {exc}") from None
        _check(len(set(names)) == len(names), f"--namespace: a name is given twice: {names}")
        quotas = [spec.quota_bytes for spec in self.namespaces if spec.quota_bytes is not None]
        _check(all(q > 0 for q in quotas), "--namespace: a quota must be > 0")
        _check(
            sum(quotas) <= self.capacity_bytes,
            f"--namespace: quotas add up to {sum(quotas)} bytes, more than --capacity "
            f"{self.capacity_bytes}",
        )
        shared = [spec for spec in self.namespaces if spec.quota_bytes is None]
        _check(
            not shared or sum(quotas) < self.capacity_bytes,
            "--namespace: quotas take all of --capacity; namespaces without one get nothing",
        )

    def _check_tenants(self) -> None:
        _check(
            self.tenants_file is None or bool(self.tenants),
            "tenants_file is given but not its tenants (read it with "
            "hicache.server.tenants.read_tenants_file, as `hicache serve` does)",
        )
        known = {spec.name for spec in self.namespaces}
        tokens = [tenant.token for tenant in self.tenants]
        _check(len(set(tokens)) == len(tokens), "--tenants-file: a token is given twice")
        for tenant in self.tenants:
            _check(bool(tenant.token), f"--tenants-file {tenant.source}: the token is empty")
            unknown = sorted(set(tenant.namespaces or ()) - known)
            _check(
                not unknown,
                f"--tenants-file {tenant.source}: namespaces {unknown} are not served",
            )

    @property
    def has_tokens(self) -> bool:
        """Whether calls must carry a bearer token."""
        return self.auth_token_file is not None or bool(self.tenants)

    def namespace_capacities(self) -> dict[str, int]:
        """Memory bytes of each namespace: its quota, or an equal share of what quotas leave."""
        quotas = sum(spec.quota_bytes or 0 for spec in self.namespaces)
        shared = [spec.name for spec in self.namespaces if spec.quota_bytes is None]
        share = (self.capacity_bytes - quotas) // len(shared) if shared else 0
        return {spec.name: spec.quota_bytes or share for spec in self.namespaces}


def is_loopback(host: str) -> bool:
    """True if `host` (a name or an address) only ever means this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0]).is_loopback for i in infos)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)
