"""`hicache serve` mistakes, as a newcomer makes them: each is one line naming the flag, exit
code 2, no traceback, found before the daemon opens its stores (`--debug` shows the
traceback). The checks that need no server run in this process; a port taken by a real
daemon, and --debug, run as processes."""

from __future__ import annotations

import re
import socket
import subprocess
from pathlib import Path

import pytest

from hicache.cli import main
from tests.support.cli import run_hicache


@pytest.fixture
def listening() -> int:
    """A loopback port something else listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def serve_in_process(capsys, *argv: str) -> tuple[int, str]:
    try:
        code = main(["serve", *argv])
    except SystemExit as exit_info:  # argparse's own mistakes
        code = exit_info.code
    return code, capsys.readouterr().err


def assert_one_line(code: int, stderr: str, message: str) -> None:
    assert code == 2, stderr
    assert "Traceback" not in stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("hicache serve: error: "), lines[0]
    assert re.search(message, lines[0]), lines[0]


def test_a_port_in_use_is_named(listening, capsys):
    code, err = serve_in_process(capsys, "--port", str(listening))
    assert_one_line(code, err, rf"--port {listening}: 127\.0\.0\.1:{listening} is in use")


def test_a_metrics_port_in_use_is_named(listening, capsys):
    code, err = serve_in_process(capsys, "--port", "0", "--metrics-port", str(listening))
    assert_one_line(code, err, rf"--metrics-port {listening}: .* is in use")


def _tls_garbage(tmp_path: Path) -> list[str]:
    (tmp_path / "cert.pem").write_text("not a certificate\n")
    (tmp_path / "key.pem").write_text("not a key\n")
    return ["--tls-cert", str(tmp_path / "cert.pem"), "--tls-key", str(tmp_path / "key.pem")]


CASES = {
    "bad size": (["--capacity", "8G"], r"argument --capacity: .*'8G' is not a size"),
    "port out of range": (["--port", "70000"], r"--port must be in \[0, 65535\], got 70000"),
    "port not a number": (["--port", "abc"], r"argument --port: invalid int value: 'abc'"),
    "unknown flag": (["--prot", "1"], r"unrecognized arguments: --prot 1 \(did you mean --port"),
    "host that does not resolve": (
        ["--host", "no-such-host.invalid", "--port", "0"],
        r"--host no-such-host\.invalid: not an address or a name that resolves",
    ),
    "address of another machine": (
        ["--host", "192.0.2.1", "--insecure-any-host", "--port", "0", "--metrics-port", "9"],
        r"--host 192\.0\.2\.1: not an address of this machine",
    ),
    "open host without a token": (
        ["--host", "0.0.0.0", "--port", "0"],
        r"--host 0\.0\.0\.0 is reachable from other machines: give --tenants-file",
    ),
    "relative spill dir": (["--spill-dir", "spill"], r"--spill-dir must be absolute: spill"),
    "spill dir is a file": (
        ["--spill-dir", "{tmp}/file"],
        r"--spill-dir .*/file exists and is not",
    ),
    "write-through without spill": (
        ["--spill-mode", "write-through"],
        r"--spill-mode write-through needs --spill-dir",
    ),
    "missing tenants file": (["--tenants-file", "{tmp}/nope"], r"--tenants-file: cannot read"),
    "missing token file": (["--auth-token-file", "{tmp}/nope"], r"--auth-token-file: no such file"),
    "quota above capacity": (
        ["--capacity", "1GiB", "--namespace", "a=2GiB"],
        r"--namespace: quotas add up to .* more than --capacity",
    ),
    "TLS files that do not load": (None, r"--tls-cert .* not a PEM certificate chain"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_mistake_is_one_line_and_exit_code_2(case, tmp_path, capsys):
    argv, message = CASES[case]
    (tmp_path / "file").write_text("")
    argv = _tls_garbage(tmp_path) + ["--port", "0"] if argv is None else argv
    code, err = serve_in_process(capsys, *(a.replace("{tmp}", str(tmp_path)) for a in argv))
    assert_one_line(code, err, message)


def test_a_second_daemon_on_a_taken_port_is_one_line(start_daemon):
    daemon = start_daemon("--capacity", "16MiB")
    done = _serve("--port", str(daemon.port), "--capacity", "16MiB")
    assert_one_line(done.returncode, done.stderr, rf"--port {daemon.port}: .* is in use")
    assert daemon.alive()


def test_debug_shows_the_traceback(listening):
    done = _serve("--port", str(listening), "--debug")
    assert done.returncode != 0
    assert "Traceback" in done.stderr and "is in use" in done.stderr


def _serve(*argv: str) -> subprocess.CompletedProcess:
    return run_hicache("serve", *argv, timeout=60)
