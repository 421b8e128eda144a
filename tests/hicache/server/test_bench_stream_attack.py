"""benchmarks/bench_stream_attack.py runs end to end (tiny sizes) and prints its JSON line."""

from __future__ import annotations

from tests.support.benchmarks import run_smoke


def test_bench_stream_attack_smoke_prints_rss_against_the_limit(tmp_path):
    (record,) = run_smoke("bench_stream_attack.py", cwd=tmp_path).records
    assert record["bench"] == "stream_attack" and record["git"] and record["device"]
    assert 0 < record["idle_rss_mib"] <= record["peak_rss_mib"]
    ratio = record["peak_rss_mib"] / record["memory_limit_mib"]
    assert abs(record["peak_vs_limit"] - ratio) < 0.01
    assert sum(record["streams"].values()) == 4 and record["healthy_rounds"] > 0
