"""The top-level `hicache` command: its version, and --log-level on either side of the
subcommand."""

from __future__ import annotations

import subprocess
import sys

import pytest

from hicache.cli import build_parser, version


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
