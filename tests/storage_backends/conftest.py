"""Real servers and backend URLs for the storage-backend tests.

The contract suite runs once per entry of `BACKENDS`: a backend name and the fixture that
returns its URL factory. A URL factory is called as `make_url(**query_options)` and returns
the URL of a fresh, empty namespace (its own prefix, directory or store), with the given
options. Adding a backend to the suite (the cache-server daemon's grpc://) is one line here
plus its fixture.

Redis servers and the three-node Redis Cluster are real `redis-server` processes on loopback
ports, started once per session and stopped afterwards; tests that kill a server start their
own.
"""

from __future__ import annotations

import contextlib
import itertools
import random
import resource
import signal
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import urlencode

import pytest

from tests.support.daemon import DaemonProcess
from tests.support.servers import (
    MooncakeMaster,
    RedisProcess,
    free_port,
    require_binary,
)

LAYOUT = "mha;layers=2;page=16;kv_heads=2;head_dim=8;dtype=bfloat16"
OTHER_LAYOUT = "mha;layers=2;page=16;kv_heads=2;head_dim=8;dtype=float16"

BACKENDS = {
    "memory": "memory_url",
    "file": "file_url",
    "redis": "redis_url",
    "redis_cluster": "redis_cluster_url",
    "grpc": "grpc_url",
    "grpc_two_servers": "grpc_two_servers_url",
    "mooncake": "mooncake_url",
}

UrlFactory = Callable[..., str]


@pytest.fixture(params=list(BACKENDS))
def make_url(request: pytest.FixtureRequest) -> UrlFactory:
    """The URL factory of each backend in turn (servers start only when first needed)."""
    return request.getfixturevalue(BACKENDS[request.param])


def _with_query(base: str, defaults: dict[str, object], options: dict[str, object]) -> str:
    query = urlencode({**defaults, **options})
    return f"{base}?{query}" if query else base


@pytest.fixture
def memory_url() -> UrlFactory:
    return lambda **options: _with_query("memory://", {"capacity": "64MiB"}, options)


@pytest.fixture
def file_url(tmp_path: Path) -> UrlFactory:
    def make(**options: object) -> str:
        directory = tmp_path / f"l3-{uuid.uuid4().hex[:8]}"
        return _with_query(f"file://{directory}", {"capacity": "64MiB"}, options)

    return make


@pytest.fixture
def redis_url(redis_server: RedisProcess) -> UrlFactory:
    def make(**options: object) -> str:
        defaults = {"prefix": f"t{uuid.uuid4().hex[:12]}:", "timeout": "5s"}
        return _with_query(f"redis://127.0.0.1:{redis_server.port}/0", defaults, options)

    return make


@pytest.fixture
def redis_cluster_url(redis_cluster: list[RedisProcess]) -> UrlFactory:
    def make(**options: object) -> str:
        defaults = {"prefix": f"t{uuid.uuid4().hex[:12]}:", "timeout": "5s"}
        return _with_query(f"redis+cluster://127.0.0.1:{redis_cluster[0].port}", defaults, options)

    return make


# -- Mooncake Store (the master and holder: `mooncake_store`, tests/conftest.py) --------------


@pytest.fixture
def mooncake_url(mooncake_store: MooncakeMaster) -> UrlFactory:
    def make(**options: object) -> str:
        defaults = {"prefix": f"t{uuid.uuid4().hex[:12]}:", "buffer": "16MiB", "timeout": "10s"}
        return _with_query(f"mooncake://{mooncake_store.address}", defaults, options)

    return make


# -- cache-server daemons ----------------------------------------------------------------------

_NUM_DAEMON_NAMESPACES = 256  # a fresh namespace per URL: tests never see each other's pages
_daemon_namespaces = itertools.count()


@pytest.fixture(scope="session")
def cache_servers() -> Iterator[list[DaemonProcess]]:
    """Two `hicache serve` processes on loopback, each with namespaces t0..t255 (64 MiB each)."""
    names = [arg for i in range(_NUM_DAEMON_NAMESPACES) for arg in ("--namespace", f"t{i}")]
    capacity = f"{64 * _NUM_DAEMON_NAMESPACES}MiB"
    daemons: list[DaemonProcess] = []
    try:
        for _ in range(2):
            daemons.append(DaemonProcess("--capacity", capacity, *names).start())
        yield daemons
    finally:
        for daemon in daemons:
            daemon.stop()


def _daemon_url(daemons: list[DaemonProcess]) -> UrlFactory:
    def make(**options: object) -> str:
        namespace = f"t{next(_daemon_namespaces) % _NUM_DAEMON_NAMESPACES}"
        hosts = ",".join(daemon.address for daemon in daemons)
        return _with_query(f"grpc://{hosts}", {"namespace": namespace}, options)

    return make


@pytest.fixture
def grpc_url(cache_servers: list[DaemonProcess]) -> UrlFactory:
    return _daemon_url(cache_servers[:1])


@pytest.fixture
def grpc_two_servers_url(cache_servers: list[DaemonProcess]) -> UrlFactory:
    """Keys split between two daemons by rendezvous hashing."""
    return _daemon_url(cache_servers)


# -- redis-server processes ------------------------------------------------------------------


@pytest.fixture
def unused_port() -> int:
    return free_port()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisProcess]:
    server = RedisProcess(tmp_path_factory.mktemp("redis"), free_port()).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[RedisProcess]]:
    """Three masters on loopback, slots split by `redis-cli --cluster create`."""
    root = tmp_path_factory.mktemp("redis-cluster")
    nodes: list[RedisProcess] = []
    try:
        for i in range(3):
            port = free_port(with_cluster_bus=True)
            cluster_args = (
                "--cluster-enabled", "yes",
                "--cluster-config-file", f"nodes-{port}.conf",
                "--cluster-node-timeout", "2000",
            )  # fmt: skip
            nodes.append(RedisProcess(root / f"node{i}", port, *cluster_args).start())
        create = subprocess.run(
            [require_binary("redis-cli"), "--cluster", "create"]
            + [f"127.0.0.1:{node.port}" for node in nodes]
            + ["--cluster-replicas", "0", "--cluster-yes"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert create.returncode == 0, create.stdout + create.stderr
        _wait_cluster_ok(nodes)
        yield nodes
    finally:
        for node in nodes:
            node.stop()


def _wait_cluster_ok(nodes: list[RedisProcess], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        infos = [node.command("CLUSTER", "INFO") for node in nodes]
        if all("cluster_state:ok" in info and "cluster_known_nodes:3" in info for info in infos):
            return
        time.sleep(0.1)
    raise RuntimeError(f"cluster did not become ready: {infos}")


@pytest.fixture
def start_redis(tmp_path: Path) -> Iterator[Callable[..., RedisProcess]]:
    """Start redis-servers of this test alone (to kill, pause, restart or misconfigure)."""
    started: list[RedisProcess] = []

    def start(*extra_args: str) -> RedisProcess:
        server = RedisProcess(tmp_path / f"redis-{len(started)}", free_port(), *extra_args)
        started.append(server)
        return server.start()

    yield start
    for server in started:
        server.stop()


# -- helpers ---------------------------------------------------------------------------------


class PageMaker:
    """Deterministic keys and pages: any process can recompute what a key's page must be."""

    LAYOUT = LAYOUT
    OTHER_LAYOUT = OTHER_LAYOUT

    @staticmethod
    def key(i: int, salt: str = "") -> bytes:
        import xxhash

        return xxhash.xxh3_128_digest(f"{salt}:{i}".encode())

    @staticmethod
    def page(key: bytes, nbytes: int) -> bytes:
        return random.Random(key).randbytes(nbytes)

    @staticmethod
    def pool_views(num_pages: int, page_bytes: int) -> tuple[bytearray, list[memoryview]]:
        """One poisoned bytearray "pool" and a writable slice per page, as L2 would pass."""
        pool = bytearray(b"\xa5" * (num_pages * page_bytes))
        view = memoryview(pool)
        return pool, [view[i * page_bytes : (i + 1) * page_bytes] for i in range(num_pages)]


@pytest.fixture
def pages() -> type[PageMaker]:
    return PageMaker


@pytest.fixture
def file_size_limit() -> Callable[[int], contextlib.AbstractContextManager[None]]:
    """`with file_size_limit(nbytes):` this process's writes past `nbytes` of a file fail
    with EFBIG: a real write error half-way through a file, as a full disk gives."""

    @contextlib.contextmanager
    def limit(nbytes: int) -> Iterator[None]:
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG, not a killed process
        resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, hard))
        try:
            yield
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
            signal.signal(signal.SIGXFSZ, handler)

    return limit
