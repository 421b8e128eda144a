"""ServerConfig and the `hicache serve` flags: each bad value named, in-process, no server."""

from __future__ import annotations

import pytest

from hicache.cli import build_parser
from hicache.server.cli import config_from_args
from hicache.server.config import NamespaceSpec, ServerConfig, is_loopback


def _config(*argv: str) -> ServerConfig:
    return config_from_args(build_parser().parse_args(["serve", *argv]))


def test_defaults_come_from_the_config_dataclass():
    assert _config() == ServerConfig()
    config = _config("--capacity", "2GiB", "--namespace", "a=512MiB", "--namespace", "b")
    assert config.capacity_bytes == 2 << 30
    assert config.namespaces == (NamespaceSpec("a", 512 << 20), NamespaceSpec("b"))
    assert config.namespace_capacities() == {"a": 512 << 20, "b": (2 << 30) - (512 << 20)}


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--host", "0.0.0.0"], "reachable from other machines: give --tenants-file"),
        (["--port", "70000"], r"--port must be in \[0, 65535\]"),
        (["--capacity", "0"], "--capacity must be > 0"),
        (["--namespace", "a=3GiB", "--capacity", "2GiB"], "more than --capacity"),
        (["--namespace", "a=2GiB", "--namespace", "b", "--capacity", "2GiB"], "get nothing"),
        (["--namespace", "../etc"], "namespace '../etc' is not valid"),
        (["--namespace", "a", "--namespace", "a"], "given twice"),
        (["--spill-dir", "relative/dir"], "--spill-dir must be absolute"),
        (["--spill-mode", "write-through"], "write-through needs --spill-dir"),
        (["--tls-cert", "/nonexistent.pem"], "--tls-cert and --tls-key go together"),
        (["--auth-token-file", "/nonexistent"], "no such file"),
        (["--max-message-bytes", "1KiB"], r"--max-message-bytes must be in \[65536"),
    ],
)
def test_bad_flags_are_named(argv, message):
    with pytest.raises(ValueError, match=message):
        _config(*argv)


def test_any_host_with_a_token_or_explicitly_insecure(tmp_path):
    token = tmp_path / "token"
    token.write_text("secret\n")
    assert _config("--host", "0.0.0.0", "--auth-token-file", str(token)).host == "0.0.0.0"
    assert _config("--host", "0.0.0.0", "--insecure-any-host").insecure_any_host


def test_bad_sizes_fail_in_argparse(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--capacity", "lots"])
    assert "is not a size" in capsys.readouterr().err


def test_loopback_detection():
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert is_loopback("127.3.2.1")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3") and not is_loopback("::")


@pytest.mark.parametrize("spill_dir", ["/etc/passwd", "/etc/passwd/below", "/proc/hicache"])
def test_a_spill_dir_that_cannot_be_one_is_one_line_and_exit_2(spill_dir):
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "hicache", "serve", "--port", "0", "--spill-dir", spill_dir],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hicache serve: error: --spill-dir"), lines
    assert spill_dir.split("/")[2] in lines[0]


def _tenants(tmp_path, text: str) -> str:
    path = tmp_path / "tenants"
    path.write_text(text)
    path.chmod(0o600)
    return str(path)


def test_a_tenants_file_makes_its_namespaces_and_binds_its_tokens(tmp_path):
    path = _tenants(tmp_path, "# t\n" + "a" * 16 + " team-a=1GiB,shared\n" + "b" * 16 + " *\n")
    config = _config("--capacity", "4GiB", "--tenants-file", path, "--namespace", "other")
    assert config.namespaces == (
        NamespaceSpec("other"),
        NamespaceSpec("team-a", 1 << 30),
        NamespaceSpec("shared"),
    )
    assert [(t.namespaces, t.source) for t in config.tenants] == [
        (("team-a", "shared"), "line 2"),
        (None, "line 3"),
    ]
    assert "a" * 16 not in repr(config)  # tokens never reach a log line
    assert _config("--host", "0.0.0.0", "--tenants-file", path).host == "0.0.0.0"


@pytest.mark.parametrize(
    "text, message",
    [
        ("short team-a\n", "line 1: the token is shorter than 16"),
        ("a" * 16 + " team-a extra\n", "line 1: expected 'TOKEN NAMESPACES', got 3"),
        ("a" * 16 + " x\n" + "a" * 16 + " y\n", "line 2: the same token as line 1"),
        ("a" * 16 + " ../etc\n", "namespace '../etc' is not valid"),
        ("a" * 16 + " x=1GiB\n" + "b" * 16 + " x=2GiB\n", "'x' has another quota"),
        ("a" * 16 + " x=lots\n", "line 1: x: 'lots' is not a size"),
        ("# nobody\n", "names no tenant"),
    ],
)
def test_bad_tenants_files_are_named(tmp_path, text, message):
    with pytest.raises(ValueError, match=message):
        _config("--tenants-file", _tenants(tmp_path, text))


@pytest.mark.parametrize(
    "field", ["stream_idle_timeout_s", "shutdown_grace_s", "flush_timeout_s", "spill_timeout_s"]
)
@pytest.mark.parametrize("value", [1e308, 1e18, float("inf"), float("nan"), 86401.0])
def test_a_timeout_out_of_its_stated_range_is_refused(field, value):
    with pytest.raises(ValueError, match=r"must be in .*86400\]"):
        ServerConfig(**{field: value})
