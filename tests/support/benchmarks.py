"""Run a benchmark script end to end (its --smoke sizes) and read the JSON lines it prints."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


class SmokeRun(NamedTuple):
    records: list[dict]  # the JSON lines, parsed
    stdout: str  # everything it printed (the table comes last)


def run_smoke(script: str, *args: str, cwd: Path | None = None) -> SmokeRun:
    """`python benchmarks/<script> --smoke *args`; asserts it exits 0."""
    result = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), "--smoke", *args],
        capture_output=True,
        text=True,
        timeout=600,  # a bound on a hang: bench_model's smoke took over 120 s at load 10
        cwd=cwd,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    records = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    return SmokeRun(records, result.stdout)
