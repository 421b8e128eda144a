"""The top-level `hicache` command: its version, and --log-level on either side of the
subcommand."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from hicache.cli import build_parser, main, version


def test_version_prints_the_installed_version():
    done = subprocess.run(
        [sys.executable, "-m", "hicache", "--version"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0
    assert done.stdout.strip() == f"hicache {version()}"
    assert version()[0].isdigit()


@pytest.mark.parametrize(
    "argv, level",
    [
        (["simulate"], "WARNING"),
        (["--log-level", "INFO", "simulate"], "INFO"),
        (["simulate", "--log-level", "DEBUG"], "DEBUG"),
        (["--log-level", "INFO", "serve", "--log-level", "ERROR"], "ERROR"),
    ],
)
def test_log_level_is_accepted_before_and_after_the_subcommand(argv, level):
    assert build_parser().parse_args(argv).log_level == level


def test_a_bad_log_level_is_refused_in_one_line(capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["demo", "--log-level", "LOUD"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'LOUD'" in capsys.readouterr().err


def _parsers(parser: argparse.ArgumentParser, prog: str = "hicache"):
    """(prog, parser) for the top-level parser and every subcommand's, nested ones too."""
    yield prog, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, f"{prog} {name}")


def test_every_parser_refuses_abbreviations():
    """argparse's default would take `--turn 2` for `--turns 2` without a word; every
    subcommand's parser (nested ones too) is built with abbreviations off."""
    progs = [prog for prog, parser in _parsers(build_parser()) if parser.allow_abbrev]
    assert progs == []
    assert len(list(_parsers(build_parser()))) >= 7  # hicache, its 5 commands, engine serve


@pytest.mark.parametrize(
    "argv, named",
    [
        (["demo", "--turn", "2"], "--turn 2 (did you mean --turns?)"),
        (["simulate", "--trac", "x"], "--trac x"),
        (["engine", "serve", "--por", "1"], "--por 1 (did you mean --port?)"),
        (["route", "--replica", "http://127.0.0.1:1", "--wai", "1"], "--wai 1"),
    ],
)
def test_an_abbreviated_flag_is_one_line_and_exit_code_2(capsys, argv, named):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unrecognized arguments" in err[0] and named in err[0], err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--deterministic"], "--deterministic runs its kernels on CUDA (--device cuda)"),
        (["--device", "tpu"], "--device must be 'cpu' or 'cuda[:N]', got 'tpu'"),
    ],
)
def test_engine_serve_refuses_what_it_cannot_run_before_loading(capsys, argv, message):
    """`--deterministic` needs CUDA; a device is 'cpu' or 'cuda[:N]': one line, exit 2."""
    assert main(["engine", "serve", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("hicache engine serve: error: "), err
    assert message in err[0]


def test_say_writes_a_line_in_one_write(monkeypatch):
    """A line the test harnesses read a port off ("listening on HOST:PORT") reaches stdout in
    one write: with print() under PYTHONUNBUFFERED the newline came in a write of its own, and
    a log line on stderr (the same pipe) landed between them, making the port 448492026."""
    import io

    from hicache.cli import say

    writes = []

    class Unbuffered(io.TextIOBase):  # what print() meets under PYTHONUNBUFFERED
        def write(self, text):
            writes.append(text)
            return len(text)

    monkeypatch.setattr(sys, "stdout", Unbuffered())
    print("hicache serve: listening on 127.0.0.1:44849", flush=True)
    assert len(writes) == 2  # (the fault: two writes, with room for a log line between)
    writes.clear()
    say("hicache serve: listening on 127.0.0.1:44849")
    assert writes == ["hicache serve: listening on 127.0.0.1:44849\n"]
