"""The cache-server daemon as a real process, for tests: `python -m hicache serve ...`.

It listens on a free loopback port it picks itself (`--port 0`) and says which on its first
line, so there is no race for the port; `start()` returns once the health service answers
SERVING. `kill()` is SIGKILL (a crash), `stop()` is SIGTERM (graceful), `restart()` keeps
the same flags (and port, so clients' URLs stay valid).
"""

from __future__ import annotations

import os
import re
import resource
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]
_LISTENING = re.compile(r"^hicache serve: listening on \S+:(\d+)")  # (not a library's log line)
_CHECK_S = 2.0  # one health check's deadline in `wait_serving`


class DaemonProcess:
    def __init__(
        self,
        *args: str,
        credentials: grpc.ChannelCredentials | None = None,
        address_space_bytes: int | None = None,
    ) -> None:
        """`args`: flags of `hicache serve`; `credentials`: TLS ones, to probe a TLS daemon;
        `address_space_bytes`: an RLIMIT_AS cap on the daemon process, so that a test of a
        memory bound that regresses fails there instead of taking the machine down."""
        self.args = list(args)
        self.credentials = credentials
        self.address_space_bytes = address_space_bytes
        self.port: int | None = None
        self.proc: subprocess.Popen | None = None
        self.output: list[str] = []
        self._drainer: threading.Thread | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 20.0) -> DaemonProcess:
        port_args = ["--port", str(self.port if self.port is not None else 0)]
        command = [sys.executable, "-m", "hicache", "serve", *port_args, *self.args]
        self.output = []
        self.proc = subprocess.Popen(
            command,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            preexec_fn=self._limit if self.address_space_bytes else None,
        )
        first = self._read_until_listening(timeout_s)
        self.port = int(first)
        self._drainer = threading.Thread(target=self._drain, daemon=True)
        self._drainer.start()
        self.wait_serving(timeout_s)
        return self

    def _limit(self) -> None:
        resource.setrlimit(resource.RLIMIT_AS, (self.address_space_bytes,) * 2)

    def rss_bytes(self) -> int:
        """The daemon's resident memory now."""
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) << 10
        raise RuntimeError("no VmRSS")

    def _read_until_listening(self, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                self.proc.wait(timeout=10)
                raise RuntimeError(f"hicache serve exited {self.proc.returncode}: {self.log}")
            self.output.append(line)
            match = _LISTENING.search(line)
            if match:
                return match.group(1)
        raise RuntimeError(f"hicache serve did not start: {self.log}")

    def _drain(self) -> None:
        for line in self.proc.stdout:
            self.output.append(line)

    @property
    def log(self) -> str:
        return "".join(self.output)

    def wait_serving(self, timeout_s: float = 20.0) -> None:
        """Until the health service answers SERVING, asking on a fresh connection at most
        every `_CHECK_S`: a connection the test process made to this port before (to a
        daemon since stopped) carries nothing over, such as gRPC's reconnect backoff. Past
        `timeout_s`, or if the daemon exits, a RuntimeError with its log."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            try:
                status = self._check(min(_CHECK_S, max(left, 0.1)))
            except grpc.RpcError as error:
                status = error.code()
            if status == health_pb2.HealthCheckResponse.SERVING:
                return
            if not self.alive() or left <= 0:
                raise RuntimeError(
                    f"daemon on {self.address} is not serving after {timeout_s}s "
                    f"(last answer: {status}); its log:\n{self.log[-4000:]}"
                )

    def _check(self, timeout_s: float):
        options = [("grpc.use_local_subchannel_pool", 1)]  # a connection of its own
        channel = (
            grpc.secure_channel(self.address, self.credentials, options=options)
            if self.credentials is not None
            else grpc.insecure_channel(self.address, options=options)
        )
        with channel:
            stub = health_pb2_grpc.HealthStub(channel)
            request = health_pb2.HealthCheckRequest()
            return stub.Check(request, timeout=timeout_s, wait_for_ready=True).status

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL: a crash, nothing flushed."""
        if self.alive():
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)
            self._drained()

    def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM: graceful shutdown. Returns the exit status."""
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
            self._drained()
        return self.proc.returncode if self.proc is not None else 0

    def _drained(self) -> None:
        """Wait for the exited daemon's last lines to reach `log` (the pipe's end)."""
        if self._drainer is not None:
            self._drainer.join(timeout=10)

    def restart(self) -> DaemonProcess:
        self.stop()
        return self.start()
