"""benchmarks/bench_backends.py runs end to end (tiny sizes) and prints its JSON lines."""

from __future__ import annotations

from tests.support.benchmarks import run_smoke


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
