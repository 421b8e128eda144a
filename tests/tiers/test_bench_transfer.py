"""benchmarks/bench_transfer.py runs end to end (tiny sizes, CPU) and prints its JSON lines."""

from __future__ import annotations

from tests.support.benchmarks import run_smoke


def test_bench_transfer_smoke_prints_one_json_line_per_case_and_op():
    lines, stdout = run_smoke("bench_transfer.py", "--reps", "1")
    assert [(r["case"], r["op"]) for r in lines] == [
        ("smoke-mha", "load_layer"),
        ("smoke-mha", "backup"),
        ("smoke-mla", "load_layer"),
        ("smoke-mla", "backup"),
    ]
    for r in lines:
        assert r["bench"] == "transfer" and r["git_rev"] and r["device"] == "cpu"
        assert r["bytes"] == r["num_pages"] * r["chunk_bytes"] * int(
            r["layout"].split("layers=")[1].split(";")[0]
        )
        assert r["gbps"] > 0 and r["ceiling_gbps"] > 0 and r["baseline_gbps"] > 0
        assert 1 <= r["num_programs"] <= 16
    assert "x chunk" in stdout.splitlines()[-6]  # the table comes last
