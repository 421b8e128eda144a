"""Real servers for tests, on loopback and free ports: started by fixtures, stopped after."""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

_ports = random.Random(os.urandom(8))  # never the global generator: tests may seed that


def free_port(*, with_cluster_bus: bool = False) -> int:
    """A loopback port nobody listens on (and port + 10000 too, for a cluster node's bus)."""
    for _ in range(200):
        port = _ports.randint(20000, 55000)
        wanted = [port, port + 10000] if with_cluster_bus else [port]
        if all(_can_bind(p) for p in wanted):
            return port
    raise RuntimeError("no free loopback port found")


def _can_bind(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def require_binary(binary: str) -> str:
    path = shutil.which(binary)
    if path is None:
        pytest.fail(f"{binary} not found on PATH: install redis-server and redis-tools (apt-get)")
    return path


class RedisProcess:
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

    def kill(self) -> None:
        """SIGKILL: no goodbye to the clients."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()
