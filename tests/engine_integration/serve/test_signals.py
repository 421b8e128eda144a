"""Signals and start-up mistakes of the serving commands, in real processes.

A signal ends every command with one line and a documented exit code (hicache/cli.py's
EXIT_ON_SIGNAL): `hicache demo` Ctrl-C'd or SIGTERM'd mid-run says so in one line (130 /
143), no traceback, with what it cached written to L3; a server that listens stops
gracefully on SIGTERM ("stopped", exit 0) and its process ends at once (it lingered
10-20 s after "stopped" on a busy machine); one still starting (awaiting replicas) ends
with 143. A taken port is named (`--port`, exit 2) before the model loads, and a `--replica`
that is not one is exit 2, one line.
"""

from __future__ import annotations

import http.server
import json
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tests.support.cli import ROOT, run_hicache
from tests.support.servers import free_port

# Bounds on waiting, not timings asserted: a process that outlives them has hung.
_EXIT_BOUND_S = 60


def _start(*argv: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "hicache", *argv],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
    )


def _read_until(proc: subprocess.Popen, marker: str) -> str:
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if marker in line:
            return "".join(seen)
    proc.kill()
    raise AssertionError(f"never printed {marker!r}:\n{''.join(seen)}\n{proc.stderr.read()}")


def _stop(proc: subprocess.Popen, signum: int) -> tuple[int, str, str]:
    proc.send_signal(signum)
    try:
        out, err = proc.communicate(timeout=_EXIT_BOUND_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    return proc.returncode, out, err


def _one_line(err: str) -> str:
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def _stored_files(directory: Path) -> int:
    return sum(len(files) for _, _, files in os.walk(directory))


@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_the_demo_stopped_mid_run_says_so_in_one_line_and_keeps_its_l3(tmp_path, signum, code):
    l3 = tmp_path / "l3"
    proc = _start(
        "demo", "--model", "builtin", "--users", "2", "--turns", "3", "--max-new-tokens", "8",
        "--l3-url", f"file://{l3}?capacity=64MiB",
    )  # fmt: skip
    _read_until(proc, "turn 0 user 0:")  # one request done: its pages are the cache's
    returncode, _out, err = _stop(proc, signum)
    assert returncode == code
    assert _one_line(err) == f"hicache demo: stopped by {signal.Signals(signum).name} (exit {code})"
    assert _stored_files(l3) > 0  # the cache closed: what it had written is in L3


def test_a_replica_stops_on_sigterm_and_its_process_ends():
    proc = _start("engine", "serve", "--port", "0", "--threads", "1")
    _read_until(proc, "listening on http://")
    returncode, out, err = _stop(proc, signal.SIGTERM)
    assert returncode == 0, err
    assert out.strip().splitlines()[-1] == "hicache engine serve: stopped"
    assert "Traceback" not in err


def test_the_router_stopped_while_awaiting_replicas_exits_143_in_one_line():
    port = free_port()
    proc = _start(
        "route", "--replica", f"http://127.0.0.1:{free_port()}", "--port", str(port),
        "--wait", "600",
    )  # fmt: skip
    _wait_until_listening(port, proc)  # bound before the replicas are awaited
    returncode, _out, err = _stop(proc, signal.SIGTERM)
    assert returncode == 143
    assert _one_line(err) == "hicache route: stopped by SIGTERM (exit 143)"


def _wait_until_listening(port: int, proc: subprocess.Popen) -> None:
    while proc.poll() is None:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            threading.Event().wait(0.05)  # polling a condition, not waiting for time
    raise AssertionError(proc.stderr.read())


@pytest.fixture
def taken_port():
    with socket.create_server(("127.0.0.1", 0)) as sock:
        yield sock.getsockname()[1]


@pytest.mark.parametrize("command", [["engine", "serve"], ["route", "--replica", "http://x:1"]])
def test_a_taken_port_is_named_before_the_slow_start(taken_port, command):
    # --model names a file that does not exist: the port is checked before the model is
    # looked at, let alone loaded (and before the router awaits its replicas).
    extra = ["--model", "/no/such/model.gguf"] if command[0] == "engine" else []
    done = run_hicache(*command, *extra, "--port", str(taken_port))
    assert done.returncode == 2
    line = _one_line(done.stderr)
    assert line.startswith(f"hicache {command[0]}")
    assert f"--port: cannot listen on 127.0.0.1:{taken_port}: Address already in use" in line


_INFO = {"namespace_digest": "00" * 16, "name": "x", "role": "both", "started_s": 0.0}
_BAD_INFO = {  # path -> /hicache/info with something out of range
    "/page-0": _INFO | {"page_size": 0},
    "/sidecar": _INFO | {"page_size": 16, "sidecar": {"span_pages": 0}},
}


class _NotAReplica(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (http.server's name)
        body = b"<html>hello</html>"
        for path, info in _BAD_INFO.items():
            if self.path == path + "/hicache/info":
                self.path, body = "/hicache/info", json.dumps(info).encode()
        self.send_response(200 if self.path == "/hicache/info" else 404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def not_a_replica():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _NotAReplica)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize(
    "path, reason",
    [
        ("", "JSONDecodeError"),
        ("/nowhere", "HTTP 404"),
        ("/page-0", "page size"),
        ("/sidecar", "sidecar.num_windowed_layers"),
    ],
)
def test_routing_to_a_server_that_is_not_a_replica_is_exit_2_in_one_line(
    not_a_replica, path, reason
):
    url = not_a_replica + path
    done = run_hicache("route", "--replica", url, "--port", "0", "--wait", "600")
    assert done.returncode == 2
    line = _one_line(done.stderr)
    assert line.startswith(f"hicache route: error: --replica {url}: not a `hicache engine serve`")
    assert reason in line
