"""benchmarks/bench_checksum.py runs end to end (tiny sizes) and prints its JSON lines."""

from __future__ import annotations

from tests.support.benchmarks import run_smoke


def test_bench_checksum_smoke_prints_one_json_line_per_page_size(tmp_path):
    lines, stdout = run_smoke("bench_checksum.py", cwd=tmp_path)
    assert [r["page_bytes"] for r in lines] == [4096, 65536]
    for r in lines:
        assert r["bench"] == "checksum" and r["git"]
        assert r["vs_xxhash_package"]["xxhash_package"] == 1.0
        assert all(rate > 0 for rate in r["gb_s"].values())
    assert stdout.splitlines()[-3].split()[0] == "page_bytes"  # the table comes last
