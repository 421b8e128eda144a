"""`hicache engine serve` replicas and `hicache route` as real processes, for tests and the
routing benchmark. Each listens on a free loopback port it picks itself (`--port 0`) and
says which on its first line; `start()` returns once it answers `/health`. `kill()` is
SIGKILL (a crash), `stop()` SIGTERM."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_LISTENING = re.compile(r"listening on (http://\S+?:\d+)")


class HttpProcess:
    def __init__(self, *command: str) -> None:
        self.command = list(command)
        self.proc: subprocess.Popen | None = None
        self.url: str | None = None
        self.output: list[str] = []

    def start(self, timeout_s: float = 120.0) -> HttpProcess:
        self.output = []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "hicache", *self.command],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        deadline = time.monotonic() + timeout_s
        for line in self.proc.stdout:
            self.output.append(line)
            found = _LISTENING.search(line)
            if found:
                self.url = found[1]
                break
            if time.monotonic() > deadline:
                break
        if self.url is None:
            self.kill()
            raise RuntimeError("the process did not start:\n" + "".join(self.output))
        threading.Thread(target=self._drain, daemon=True).start()
        while get_json(f"{self.url}/health", timeout_s=2) is None:
            if time.monotonic() > deadline or self.proc.poll() is not None:
                self.kill()
                raise RuntimeError("the process never answered /health:\n" + "".join(self.output))
            time.sleep(0.1)
        return self

    def _drain(self) -> None:
        for line in self.proc.stdout:
            self.output.append(line)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def stop(self, timeout_s: float = 20.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()


def replica(*flags: str) -> HttpProcess:
    """A replica of the built-in tiny model with one torch thread on a free port."""
    return HttpProcess("engine", "serve", "--port", "0", "--threads", "1", *flags)


def router(*flags: str) -> HttpProcess:
    return HttpProcess("route", "--port", "0", *flags)


def get_json(url: str, timeout_s: float = 10.0):
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as reply:
            return json.loads(reply.read())
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return None


def post_json(url: str, body: dict, timeout_s: float = 300.0) -> tuple[int, dict]:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def post_stream(url: str, body: dict, timeout_s: float = 300.0) -> list:
    """The `data:` events of a streamed response, decoded ("[DONE]" kept as is)."""
    request = urllib.request.Request(
        url,
        data=json.dumps({**body, "stream": True}).encode(),
        headers={"Content-Type": "application/json"},
    )
    events = []
    with urllib.request.urlopen(request, timeout=timeout_s) as reply:
        for raw in reply:
            line = raw.decode().strip()
            if line.startswith("data: "):
                data = line[len("data: ") :]
                events.append(data if data == "[DONE]" else json.loads(data))
    return events


def wait_events_applied(url: str, timeout_s: float = 60.0) -> None:
    """Until the router has applied every event batch each replica has published so far
    (no fixed sleep: on a loaded machine the events may take longer than any guess)."""
    replicas = [r for r in get_json(f"{url}/hicache/route/stats")["replicas"] if r["alive"]]
    infos = {r["url"]: get_json(f"{r['url']}/hicache/info") for r in replicas}
    published = {u: info["events_seq"] for u, info in infos.items() if info is not None}
    deadline = time.monotonic() + timeout_s
    while True:
        applied = {
            r["url"]: r["events_seq"] for r in get_json(f"{url}/hicache/route/stats")["replicas"]
        }
        if all(applied[u] >= seq for u, seq in published.items()):
            return
        assert time.monotonic() < deadline, (published, applied)
        time.sleep(0.01)
