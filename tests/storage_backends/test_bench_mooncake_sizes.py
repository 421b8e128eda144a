"""benchmarks/bench_mooncake_sizes.py runs end to end on a real master and holder (tiny
sizes) and prints a row per mover, caller count and object size, each timed against the
page; its loopback controls move real bytes over real sockets (benchmarks/loopback_tcp.py)."""

from __future__ import annotations

import subprocess
import sys

from benchmarks.backend_workload import LAYOUT
from benchmarks.loopback_tcp import ASIO_OP_BYTES, LoopbackBatches
from storage_backends.objects import header_size
from tests.support.benchmarks import BENCHMARKS, run_smoke


def test_bench_mooncake_sizes_smoke_times_each_size_against_the_page(tmp_path):
    lines, stdout = run_smoke("bench_mooncake_sizes.py", cwd=tmp_path)
    head = header_size(LAYOUT)
    sizes = [4096 - head, 4096, 4100, 4096 + head, 8192]  # (4096 - 4 KiB is no size)
    movers = ("raw", "tcp", "tcp-64k")
    assert [(r["mover"], r["in_flight"], r["object_bytes"]) for r in lines] == [
        (mover, k, size) for mover in movers for k in (1, 2) for size in sizes
    ]
    for r in lines:
        assert r["bench"] == "mooncake_sizes" and r["page_bytes"] == 4096 and r["git"]
        assert r["put_gbps"] > 0 and r["get_gbps"] > 0 and r["put_us_per_call"] > 0
        if r["object_bytes"] == 4096:
            assert r["put_time_vs_page"] == r["get_time_vs_page"] == 1.0
    table = stdout.splitlines()
    assert table[-1].split()[:3] == ["tcp-64k", "2", "8192"]  # the table comes last
    assert sum("(a framed page)" in line for line in table) == 6
    assert sum("(the page)" in line for line in table) == 6


def test_bench_mooncake_sizes_times_the_page_even_when_not_asked(tmp_path):
    lines, _ = run_smoke(
        "bench_mooncake_sizes.py", "--sizes", "4000,5000", "--in-flight", "1",
        "--movers", "raw", cwd=tmp_path,
    )  # fmt: skip
    assert [r["object_bytes"] for r in lines] == [4096, 4000, 5000]


def test_the_loopback_controls_run_without_a_store(tmp_path):
    lines, stdout = run_smoke(
        "bench_mooncake_sizes.py", "--movers", "tcp-64k", "--sizes", "70000", cwd=tmp_path
    )
    assert [(r["mover"], r["in_flight"], r["object_bytes"]) for r in lines] == [
        ("tcp-64k", k, size) for k in (1, 2) for size in (4096, 70000)
    ]
    assert stdout.splitlines()[-1].split()[:3] == ["tcp-64k", "2", "70000"]


def test_a_loopback_get_returns_the_bytes_put_in_64_kib_operations():
    """Objects past 64 KiB go in two sends and two receives each way, and come back whole
    (the mover checks the bytes each get read: a framing slip raises)."""
    mover = LoopbackBatches(2, 3, 2, 70000, ASIO_OP_BYTES)
    try:
        for size in (1, 65535, 65536, 65540, 70000):
            put_s, get_s = mover.run(2, size)
            assert put_s > 0 and get_s > 0
    finally:
        mover.close()
    assert not any(thread.is_alive() for thread in mover.servers)


def test_bench_mooncake_sizes_refuses_a_size_of_no_bytes(tmp_path):
    result = subprocess.run(
        [sys.executable, str(BENCHMARKS / "bench_mooncake_sizes.py"), "--smoke", "--sizes", "0"],
        capture_output=True, text=True, timeout=60, cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 2 and "--sizes takes positive byte counts" in result.stderr


def test_bench_mooncake_sizes_names_a_mover_it_does_not_know(tmp_path):
    result = subprocess.run(
        [sys.executable, str(BENCHMARKS / "bench_mooncake_sizes.py"), "--smoke",
         "--movers", "tcp,udp"],
        capture_output=True, text=True, timeout=60, cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 2
    assert "--movers takes raw, tcp, tcp-64k, not udp" in result.stderr
