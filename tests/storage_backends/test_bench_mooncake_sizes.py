"""benchmarks/bench_mooncake_sizes.py runs end to end on a real master and holder (tiny
sizes) and prints a row per caller count and object size, each timed against the page."""

from __future__ import annotations

import subprocess
import sys

from benchmarks.backend_workload import LAYOUT
from storage_backends.objects import header_size
from tests.support.benchmarks import BENCHMARKS, run_smoke


def test_bench_mooncake_sizes_smoke_times_each_size_against_the_page(tmp_path):
    lines, stdout = run_smoke("bench_mooncake_sizes.py", cwd=tmp_path)
    head = header_size(LAYOUT)
    sizes = [4096 - head, 4096, 4100, 4096 + head, 8192]  # (4096 - 4 KiB is no size)
    assert [(r["in_flight"], r["object_bytes"]) for r in lines] == [
        (k, size) for k in (1, 2) for size in sizes
    ]
    for r in lines:
        assert r["bench"] == "mooncake_sizes" and r["page_bytes"] == 4096 and r["git"]
        assert r["put_gbps"] > 0 and r["get_gbps"] > 0 and r["put_us_per_call"] > 0
        if r["object_bytes"] == 4096:
            assert r["put_time_vs_page"] == r["get_time_vs_page"] == 1.0
    table = stdout.splitlines()
    assert table[-1].split()[:2] == ["2", "8192"]  # the table comes last
    assert sum("(a framed page)" in line for line in table) == 2
    assert sum("(the page)" in line for line in table) == 2


def test_bench_mooncake_sizes_times_the_page_even_when_not_asked(tmp_path):
    lines, _ = run_smoke(
        "bench_mooncake_sizes.py", "--sizes", "4000,5000", "--in-flight", "1", cwd=tmp_path
    )
    assert [r["object_bytes"] for r in lines] == [4096, 4000, 5000]


def test_bench_mooncake_sizes_refuses_a_size_of_no_bytes(tmp_path):
    result = subprocess.run(
        [sys.executable, str(BENCHMARKS / "bench_mooncake_sizes.py"), "--smoke", "--sizes", "0"],
        capture_output=True, text=True, timeout=60, cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 2 and "--sizes takes positive byte counts" in result.stderr
