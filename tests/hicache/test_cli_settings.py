"""`hicache serve` and `hicache demo` settings from a TOML file (`--config`) and
HICACHE_SERVE_* / HICACHE_DEMO_* variables: flag > variable > file > the flag's default, and
a wrong key or value is one line naming it and where it came from, exit code 2."""

from __future__ import annotations

from pathlib import Path

import pytest

import engine_integration.serve.demo as demo_cli
import hicache.server.cli as serve_cli
from engine_integration.serve.demo_config import DemoConfig
from hicache.cli import main
from hicache.config import HiCacheConfig
from hicache.server.config import NamespaceSpec, ServerConfig
from tests.support.cli import run_hicache
from tiers.layout import KVLayout

LAYOUT = KVLayout(
    kind="mha", num_layers=2, page_size=16, dtype="bfloat16", num_kv_heads=2, head_dim=8
)


@pytest.fixture(autouse=True)
def _no_settings_in_the_environment(monkeypatch):
    import os

    for name in list(os.environ):
        if name.startswith(("HICACHE_SERVE_", "HICACHE_DEMO_")):
            monkeypatch.delenv(name)


@pytest.fixture
def served(monkeypatch):
    """The ServerConfig `hicache serve` would run with (nothing is served)."""
    seen: list[ServerConfig] = []

    def run(args):
        seen.append(serve_cli.config_from_args(args))
        return 0

    monkeypatch.setattr(serve_cli, "run", run)

    def serve(*argv: str) -> ServerConfig:
        seen.clear()
        assert main(["serve", *argv]) == 0
        return seen[0]

    return serve


@pytest.fixture
def demoed(monkeypatch):
    """The DemoConfig `hicache demo` would run with (no model is loaded)."""
    seen: list[DemoConfig] = []
    fields = DemoConfig.__dataclass_fields__

    def run(args):
        seen.append(DemoConfig(**{k: v for k, v in vars(args).items() if k in fields}))
        return 0

    monkeypatch.setattr(demo_cli, "run", run)

    def demo(*argv: str) -> DemoConfig:
        seen.clear()
        assert main(["demo", *argv]) == 0
        return seen[0]

    return demo


def toml(tmp_path: Path, text: str, name: str = "hicache.toml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


# ------------------------------------------------------------------------- precedence


def test_serve_precedence_flag_over_variable_over_file_over_default(served, tmp_path, monkeypatch):
    path = toml(
        tmp_path,
        'port = 50100\ncapacity = "2GiB"\nmax_streams = 32\nspill_fsync = true\n'
        'namespace = ["team-a=1GiB", "team-b"]\n',
    )
    defaults = ServerConfig()
    from_file = served("--config", path)
    assert (from_file.port, from_file.capacity_bytes, from_file.max_streams) == (50100, 2 << 30, 32)
    assert from_file.spill_fsync is True
    assert from_file.namespaces == (NamespaceSpec("team-a", 1 << 30), NamespaceSpec("team-b"))
    assert from_file.shutdown_grace_s == defaults.shutdown_grace_s  # not in the file

    monkeypatch.setenv("HICACHE_SERVE_PORT", "50200")
    monkeypatch.setenv("HICACHE_SERVE_NAMESPACE", "ops")
    over_file = served("--config", path)
    assert over_file.port == 50200 and over_file.namespaces == (NamespaceSpec("ops"),)
    assert over_file.capacity_bytes == 2 << 30  # the file still gives what the variables do not

    flags = served("--config", path, "--port", "50300", "--namespace", "x", "--namespace", "y")
    assert flags.port == 50300  # flag over variable over file
    assert flags.namespaces == (NamespaceSpec("x"), NamespaceSpec("y"))  # replaced, not added
    assert flags.max_streams == 32

    monkeypatch.delenv("HICACHE_SERVE_PORT")
    monkeypatch.delenv("HICACHE_SERVE_NAMESPACE")
    assert served().port == defaults.port  # no file, no variables: the dataclass's defaults


def test_demo_precedence_flag_over_variable_over_file_over_default(demoed, tmp_path, monkeypatch):
    path = toml(tmp_path, 'turns = 2\nusers = 3\ncompare = false\nl3_url = "memory://"\n')
    from_file = demoed("--config", path)
    assert (from_file.turns, from_file.users, from_file.compare) == (2, 3, False)
    assert from_file.l3_url == "memory://"
    assert from_file.max_new_tokens == DemoConfig().max_new_tokens

    monkeypatch.setenv("HICACHE_DEMO_TURNS", "5")
    monkeypatch.setenv("HICACHE_DEMO_COMPARE", "true")
    over_file = demoed("--config", path)
    assert (over_file.turns, over_file.users, over_file.compare) == (5, 3, True)

    flags = demoed("--config", path, "--turns", "7", "--no-compare")
    assert (flags.turns, flags.compare) == (7, False)


def test_a_log_level_in_the_file_yields_to_the_flag_on_either_side(tmp_path, monkeypatch):
    from hicache import cli

    levels = []
    monkeypatch.setattr(serve_cli, "run", lambda args: levels.append(args.log_level) or 0)
    monkeypatch.setattr(cli.logging, "basicConfig", lambda **kwargs: None)
    path = toml(tmp_path, 'log_level = "INFO"\n')
    main(["serve", "--config", path])
    main(["--log-level", "ERROR", "serve", "--config", path])
    main(["serve", "--config", path, "--log-level", "DEBUG"])
    assert levels == ["INFO", "ERROR", "DEBUG"]


def test_the_commands_variables_do_not_trouble_hicache_config_from_env():
    environ = {"HICACHE_SERVE_PORT": "1", "HICACHE_DEMO_TURNS": "2", "HICACHE_L1_PAGES": "3"}
    config = HiCacheConfig.from_env(LAYOUT, environ)
    assert config.l1.num_pages == 3
    with pytest.raises(ValueError, match="HICACHE_L1_PAGEZ"):
        HiCacheConfig.from_env(LAYOUT, {"HICACHE_L1_PAGEZ": "3"})


# ------------------------------------------------------------------------- mistakes

FILE_MISTAKES = [
    ("prot = 50051\n", r"hicache\.toml: unknown key 'prot' \(did you mean port\?\)"),
    ('port = "50051"\n', r"hicache\.toml: port: expected an integer, got '50051' \(a string\)"),
    ("port = true\n", r"hicache\.toml: port: expected an integer, got True \(a boolean\)"),
    ('capacity = "8G"\n', r"hicache\.toml: capacity: .*'8G' is not a size"),
    ('spill_mode = "sometimes"\n', r"hicache\.toml: spill_mode: expected one of evict, write"),
    ('spill_fsync = "yes"\n', r"hicache\.toml: spill_fsync: expected true or false"),
    ('namespace = "team-a"\n', r"hicache\.toml: namespace: expected a list of strings"),
    ("[serve]\nport = 1\n", r"hicache\.toml: unknown key 'serve'"),
    ("port = \n", r"hicache\.toml: not valid TOML: .*line 1"),
]


@pytest.mark.parametrize("text, message", FILE_MISTAKES, ids=[m[0] for m in FILE_MISTAKES])
def test_serve_file_mistakes_are_one_line_naming_the_key_and_the_file(
    text, message, tmp_path, capsys
):
    assert main(["serve", "--config", toml(tmp_path, text)]) == 2
    _one_line(capsys.readouterr().err, "serve", message)


@pytest.mark.parametrize(
    "text, message",
    [
        ("turn = 2\n", r"unknown key 'turn' \(did you mean turns\?\)"),
        ("turns = 2.5\n", r"turns: expected an integer, got 2\.5 \(a number\)"),
        ('compare = "no"\n', r"compare: expected true or false"),
        ("no_compare = true\n", r"unknown key 'no_compare'"),
    ],
)
def test_demo_file_mistakes_are_one_line_naming_the_key_and_the_file(
    text, message, tmp_path, capsys
):
    assert main(["demo", "--config", toml(tmp_path, text)]) == 2
    _one_line(capsys.readouterr().err, "demo", r"hicache\.toml: " + message)


@pytest.mark.parametrize(
    "variable, text, message",
    [
        ("HICACHE_SERVE_PROT", "1", r"unknown variable HICACHE_SERVE_PROT \(did you mean "),
        ("HICACHE_SERVE_PORT", "abc", r"HICACHE_SERVE_PORT='abc': expected an integer"),
        ("HICACHE_SERVE_SPILL_FSYNC", "maybe", r"HICACHE_SERVE_SPILL_FSYNC='maybe': expected true"),
    ],
)
def test_variable_mistakes_are_one_line_naming_the_variable(
    variable, text, message, monkeypatch, capsys
):
    monkeypatch.setenv(variable, text)
    assert main(["serve"]) == 2
    _one_line(capsys.readouterr().err, "serve", message)


def test_a_missing_config_file_is_named(tmp_path, capsys):
    missing = tmp_path / "nope.toml"
    assert main(["demo", "--config", str(missing)]) == 2
    _one_line(capsys.readouterr().err, "demo", f"--config {missing}: no such file")


def test_a_config_mistake_in_a_real_process_has_no_traceback(tmp_path):
    path = toml(tmp_path, 'port = "x"\n')
    done = run_hicache("serve", "--config", path, timeout=60)
    assert done.returncode == 2
    _one_line(done.stderr, "serve", r"port: expected an integer")


def _one_line(stderr: str, command: str, message: str) -> None:
    import re

    assert "Traceback" not in stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"hicache {command}: error: "), lines[0]
    assert re.search(message, lines[0]), lines[0]
