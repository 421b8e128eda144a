"""The `hicache` command in a real process (`python -m hicache ...`, from the repository
root), for tests of what a user sees: exit codes, one-line errors, no tracebacks."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_hicache(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hicache", *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
