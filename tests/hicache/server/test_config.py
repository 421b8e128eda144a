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
        (["--host", "0.0.0.0"], "reachable from other machines: give --tenants-file or --auth-token-file"),
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
