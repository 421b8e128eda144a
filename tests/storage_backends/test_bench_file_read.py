"""benchmarks/bench_file_read.py runs end to end (tiny sizes) and prints its JSON lines."""

from __future__ import annotations

from tests.support.benchmarks import run_smoke


def test_bench_file_read_smoke_prints_one_json_line_per_window(tmp_path):
    lines, stdout = run_smoke("bench_file_read.py", cwd=tmp_path)
    assert [r["window_bytes"] for r in lines] == [4096, 0]
    for r in lines:
        assert r["bench"] == "file_read" and r["git"]
        assert r["page_bytes"] == 64 << 10 and r["total_bytes"] == 2 << 20
        assert r["read_gb_s"] > 0 and r["ceiling_gb_s"] > 0 and r["of_ceiling"] > 0
    assert lines[1]["of_whole_stretch"] == 1.0
    assert stdout.splitlines()[-1].split()[0] == "whole"  # the table comes last
