"""benchmarks/bench_server.py runs end to end (tiny sizes) and prints its JSON lines."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_bench_server_smoke_prints_one_json_line_per_backend(tmp_path):
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_server.py"), "--smoke"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert [r["backend"] for r in lines] == ["redis", "grpc"]
    for r in lines:
        assert r["put_gb_s"] > 0 and r["get_gb_s"] > 0
        assert 0 < r["get_p50_ms"] <= r["get_p99_ms"]
        assert r["git"] and r["device"]
    assert lines[1]["get_vs_redis"] == round(lines[1]["get_gb_s"] / lines[0]["get_gb_s"], 3)
