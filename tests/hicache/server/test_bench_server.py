"""benchmarks/bench_server.py runs end to end (tiny sizes) and prints its JSON lines."""

from __future__ import annotations

from tests.support.benchmarks import run_smoke


def test_bench_server_smoke_prints_one_json_line_per_backend(tmp_path):
    lines, stdout = run_smoke("bench_server.py", cwd=tmp_path)
    assert [r["backend"] for r in lines] == ["redis", "grpc"]
    for r in lines:
        assert r["put_gb_s"] > 0 and r["get_gb_s"] > 0
        assert 0 < r["get_p50_ms"] <= r["get_p99_ms"]
        assert r["git"] and r["device"]
    assert lines[1]["get_vs_redis"] == round(lines[1]["get_gb_s"] / lines[0]["get_gb_s"], 3)
