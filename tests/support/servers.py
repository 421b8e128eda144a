"""Real servers for tests, on loopback and free ports: started by fixtures, stopped after."""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

_ports = random.Random(os.urandom(8))  # never the global generator: tests may seed that


def free_port(*, with_cluster_bus: bool = False) -> int:
    """A loopback port nobody listens on (and port + 10000 too, for a cluster node's bus),
    outside the kernel's ephemeral range. A port free now is not reserved: a server started
    on it a moment later lost it, under load, to the local end of some outgoing connection
    (redis-server: "bind: Address already in use"), which the kernel takes from that range.
    Each pytest-xdist worker takes its own residue of the port number, so that two workers
    never pick the same port at once."""
    span = 10000 if with_cluster_bus else 0
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    ranges = [  # this worker's ports: those of its residue
        range(r.start + (worker - r.start) % workers, r.stop, workers)
        for r in _ports_outside_ephemeral(span)
    ]
    ranges = [r for r in ranges if len(r)]
    for _ in range(200):
        (chosen,) = _ports.choices(ranges, weights=[len(r) for r in ranges])
        port = _ports.choice(chosen)
        wanted = [port, port + span] if span else [port]
        if all(_can_bind(p) for p in wanted):
            return port
    raise RuntimeError("no free loopback port found")


def _ports_outside_ephemeral(span: int) -> list[range]:
    """Ports p from 10000 up with p and p + span both outside the ephemeral range."""
    try:
        text = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text()
        low, high = (int(field) for field in text.split())
    except (OSError, ValueError):
        low, high = 32768, 60999  # Linux's default
    top = 65535 - span
    below, above = range(10000, min(low - span, top + 1)), range(high + 1, top + 1)
    return [r for r in (below, above) if len(r)]


def _can_bind(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


_INSTALL_HINTS = {
    "mooncake_master": "pip install mooncake-transfer-engine-non-cuda (and apt-get install "
    "libibverbs1 libnuma1)",
    "mooncake_client": "pip install mooncake-transfer-engine-non-cuda (and apt-get install "
    "libibverbs1 libnuma1)",
}


def require_binary(binary: str) -> str:
    path = shutil.which(binary)
    if path is None:
        hint = _INSTALL_HINTS.get(binary, "install redis-server and redis-tools (apt-get)")
        pytest.fail(f"{binary} not found on PATH: {hint}")
    return path


class ServerProcess:
    """A server the tests start as a subprocess (`proc`): killed or stopped the same way."""

    proc: subprocess.Popen | None = None

    def kill(self) -> None:
        """SIGKILL: no goodbye to the clients."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        """SIGTERM, and SIGKILL if it is not gone within 10 s (a paused one is continued
        first, to hear the TERM)."""
        if self.proc is not None and self.proc.poll() is None:
            self.resume()
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Hung for the block (`pause`), as a server that keeps its connections and answers
        nothing; continued after it, however the block ends."""
        self.pause()
        try:
            yield
        finally:
            self.resume()

    def pause(self, timeout_s: float = 10.0) -> None:
        """SIGSTOP, returning once every thread of the process is stopped. `kill` returns as
        soon as the signal is queued, and until the thread picked to take it gets a core the
        others run on: a paused Mooncake holder served a read in that window."""
        assert self.proc is not None and self.proc.poll() is None, "nothing to pause"
        self.proc.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + timeout_s
        while not all_threads_stopped(self.proc.pid):
            if self.proc.poll() is not None:
                raise RuntimeError(f"process {self.proc.pid} exited as it was paused")
            if time.monotonic() > deadline:
                raise RuntimeError(f"process {self.proc.pid} did not stop within {timeout_s} s")
            time.sleep(0.001)

    def resume(self) -> None:
        """SIGCONT (a paused process must go on to hear a TERM); nothing if it is gone."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)


def all_threads_stopped(pid: int) -> bool:
    """Whether every thread of `pid` is in the stopped state (Linux: /proc/PID/task)."""
    states = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except FileNotFoundError:  # a thread that ended meanwhile
            continue
        states.append(stat[stat.rindex(")") + 2])  # the field after the (name)
    return bool(states) and all(state in "Tt" for state in states)


class RedisProcess(ServerProcess):
    """One redis-server on 127.0.0.1:port; start/kill/restart keep the port."""

    def __init__(self, workdir: Path, port: int, *extra_args: str) -> None:
        self.workdir = workdir
        self.port = port
        self.extra_args = extra_args
        self.proc: subprocess.Popen | None = None
        workdir.mkdir(parents=True, exist_ok=True)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisProcess:
        args = [
            require_binary("redis-server"),
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "no",
            "--dir", str(self.workdir),
            "--logfile", str(self.workdir / "redis.log"),
            *self.extra_args,
        ]  # fmt: skip
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self.wait_ready()
        return self

    def wait_ready(self, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited: {self.proc.stderr.read().decode()}")
            if self.command("PING").strip() == "PONG":
                return
            time.sleep(0.02)
        raise RuntimeError(f"redis-server on port {self.port} did not answer PING")

    def command(self, *args: str) -> str:
        """One command through redis-cli; "" if the server does not answer."""
        result = subprocess.run(
            [require_binary("redis-cli"), "-p", str(self.port), *args],
            capture_output=True,
            text=True,
            timeout=10,
        )
        return result.stdout if result.returncode == 0 else ""


class MooncakeMaster(ServerProcess):
    """One `mooncake_master` on 127.0.0.1 (its RPC port and its metrics port), without the
    HTTP metadata server: clients use P2PHANDSHAKE. `client_ttl_s` is how long the master
    keeps a silent client's segment (short here, so a killed holder is noticed quickly)."""

    def __init__(self, workdir: Path, *, client_ttl_s: int = 2) -> None:
        self.workdir = workdir
        self.port = free_port()
        self.metrics_port = free_port()
        self.client_ttl_s = client_ttl_s
        self.proc: subprocess.Popen | None = None
        workdir.mkdir(parents=True, exist_ok=True)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> MooncakeMaster:
        args = [
            require_binary("mooncake_master"),
            f"--rpc_port={self.port}",
            "--rpc_address=127.0.0.1",
            f"--metrics_port={self.metrics_port}",
            "--metrics_host=127.0.0.1",
            "--enable_http_metadata_server=false",
            f"--client_ttl={self.client_ttl_s}",
        ]
        log = open(self.workdir / "master.log", "ab")  # noqa: SIM115 (the process keeps it)
        self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mooncake_master exited; see {self.workdir / 'master.log'}")
            if self.metric("master_total_capacity_bytes") is not None:
                return self
            time.sleep(0.05)
        raise RuntimeError(f"mooncake_master on port {self.port} did not answer")

    def metric(self, name: str) -> float | None:
        """A value of the master's Prometheus metrics (None: no answer)."""
        import urllib.request

        try:
            url = f"http://127.0.0.1:{self.metrics_port}/metrics"
            with urllib.request.urlopen(url, timeout=2) as reply:
                text = reply.read().decode()
        except OSError:
            return None
        for line in text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        return None

    def wait_capacity(self, at_least: int, *, at_most: int | None = None, timeout_s=30.0) -> None:
        """Until the segments mounted add up to `at_least` (and at most `at_most`) bytes."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            total = self.metric("master_total_capacity_bytes") or 0
            if total >= at_least and (at_most is None or total <= at_most):
                return
            time.sleep(0.05)
        raise RuntimeError(f"mooncake segments total {total} bytes, wanted >= {at_least}")


class MooncakeHolder(ServerProcess):
    """One `mooncake_client`: a process that lends `segment_bytes` of memory to the store
    (where pages live while the clients that put them come and go)."""

    def __init__(self, master: MooncakeMaster, segment_bytes: int, name: str = "holder") -> None:
        self.master = master
        self.segment_bytes = segment_bytes
        self.name = name
        self.proc: subprocess.Popen | None = None

    def start(self) -> MooncakeHolder:
        before = int(self.master.metric("master_total_capacity_bytes") or 0)
        args = [
            require_binary("mooncake_client"),
            f"--global_segment_size={self.segment_bytes}",
            f"--master_server_address={self.master.address}",
            "--metadata_server=P2PHANDSHAKE",
            "--host=127.0.0.1",
            f"--port={free_port()}",
        ]
        log = open(self.master.workdir / f"{self.name}.log", "ab")  # noqa: SIM115
        self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + 30
        while (
            self.master.metric("master_total_capacity_bytes") or 0
        ) < before + self.segment_bytes:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                log = self.master.workdir / f"{self.name}.log"
                raise RuntimeError(f"mooncake_client did not lend its segment; see {log}")
            time.sleep(0.05)
        return self
