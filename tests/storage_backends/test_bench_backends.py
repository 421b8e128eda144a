"""benchmarks/bench_backends.py runs end to end (tiny sizes) and prints its JSON lines."""

from __future__ import annotations

import subprocess
import sys

from storage_backends.lent import address_of
from tests.support.benchmarks import BENCHMARKS, run_smoke


def test_bench_backends_smoke_prints_one_json_line_per_backend(tmp_path):
    lines, stdout = run_smoke("bench_backends.py", cwd=tmp_path)
    assert [r["backend"] for r in lines] == [
        "memory",
        "file",
        "file_fsync",
        "file_aiofiles",
        "redis",
        "mooncake",
    ]
    for r in lines:
        assert r["bench"] == "backends" and r["git"] and r["device"]
        assert r["page_bytes"] == 4096 and r["batch_pages"] == 4
        assert r["put_gbps"] > 0 and r["get_gbps"] > 0
        assert r["ceiling_put_gbps"] > 0 and r["ceiling_get_gbps"] > 0
        assert r["put_ratio"] > 0 and r["get_ratio"] > 0
    assert lines[1]["target_ratio"] == 0.7 and lines[4]["target_ratio"] == 0.9
    assert lines[5]["target_ratio"] == 0.9 and lines[5]["ceiling"].startswith("raw Mooncake")
    assert lines[1]["fsync_put_ceiling_gbps"] > 0 and lines[1]["put_ratio_vs_fsync_put"] > 0
    assert lines[2]["batch_fsync_put_ceiling_gbps"] > 0
    assert lines[2]["put_ratio_vs_batch_fsync_put"] > 0
    assert lines[1]["per_file_get_gbps"] > 0
    assert lines[1]["bare_pack_get_gbps"] > 0 and lines[1]["bare_pack_get_ratio"] > 0
    assert "target" in stdout.splitlines()[-8]  # the table comes last


def test_bench_backends_moves_batches_in_flight_on_mooncake(tmp_path):
    """With --in-flight 2, two callers move the batches at once, and so does the raw client
    (its calls all made on threads: the row on a thread would be the same baseline)."""
    lines, stdout = run_smoke(
        "bench_backends.py", "--backends", "mooncake", "--in-flight", "2", cwd=tmp_path
    )
    [row] = lines
    assert row["in_flight"] == 2 and row["put_gbps"] > 0 and row["get_gbps"] > 0
    assert row["ceiling_put_gbps"] > 0 and row["get_ratio_vs_raw_framed_get"] > 0
    assert "raw_threaded_get_gbps" not in row
    assert "2 batches in flight" in stdout.splitlines()[-1]


def test_bench_backends_refuses_in_flight_for_a_backend_that_does_not_take_it(tmp_path):
    result = subprocess.run(
        [sys.executable, str(BENCHMARKS / "bench_backends.py"), "--smoke", "--backends",
         "memory,mooncake", "--in-flight", "2"],
        capture_output=True, text=True, timeout=60, cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode != 0
    assert "--in-flight 2: only mooncake takes it, not ['memory']" in result.stderr


def test_each_stream_puts_from_and_reads_into_pages_of_its_own():
    """Streams share no page: the backend refuses a lent page that an earlier call's
    transfer still moves, so two streams putting one set of pages would fail each other."""
    from benchmarks.backend_workload import Workload

    work = Workload(4096, 4, 5 * 4 * 4096, seed=0, streams=2)
    assert [len(b) for b in work.streams_of(work.batches)] == [3, 2]
    for parts in (work.sources, work.intos):
        addresses = {address_of(page) for stream in parts for page in stream}
        assert len(addresses) == 8
    assert [bytes(p) for p in work.sources[1]] == work.pages
