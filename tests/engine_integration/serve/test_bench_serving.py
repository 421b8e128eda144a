"""benchmarks/bench_serving.py end to end on the CPU: a 12-request Mooncake trace with shared
prefixes, 2 tiny-model replicas behind `hicache route`, the `off` and `l1l2l3-file`
configurations. Counts only, never timings."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from benchmarks import bench_serving
from benchmarks.serving_client import prompt_ids
from benchmarks.serving_deployment import Setup, replica_flags
from hicache.simulate.trace import Request
from tests.support.benchmarks import BENCHMARKS

BLOCK = 16  # tokens per hash id, and per page: every shared block is a shared page
NUM_REQUESTS = 12
KEYS = {
    "config", "model", "replicas", "routing", "trace", "rate_scale", "requests", "l1_pages",
    "l2_pages", "l3_url", "page_size", "hit_tokens", "ttft_ms", "tpot_ms", "throughput_tok_s",
    "goodput", "ttft_target_ms",
}  # fmt: skip


def write_trace(path) -> None:
    """Three documents of 4 blocks, each sent first at t=0, then 9 more times from t=2 s on
    (by then the first three are long done), each request with a block of its own after the
    document; the last request's own part is 1 block and 100 tokens (cut to 4 tokens)."""
    records = []
    for i in range(NUM_REQUESTS):
        doc = [100 * (i % 3) + b for b in range(4)]
        last = i == NUM_REQUESTS - 1
        records.append(
            {"timestamp": 0 if i < 3 else 2000 + 100 * i,
             "input_length": 5 * 512 + (100 if last else 0), "output_length": 3,
             "hash_ids": doc + [1000 + i] + ([2000] if last else [])}
        )  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_prompts_share_exactly_the_shared_blocks():
    def request(ids, length):
        return Request(0.0, length, 1, block_ids=np.array(ids))

    a = prompt_ids(request([7, 8, 9], 3 * 512), 16, 258)
    b = prompt_ids(request([7, 8, 5], 2 * 512 + 100), 16, 258)
    assert len(a) == 48 and len(b) == 32 + 4  # the last block cut: ceil(100 * 16 / 512)
    assert a[:32] == b[:32] and a[32:36] != b[32:36]
    assert all(0 <= t < 258 for t in a + b)
    assert prompt_ids(request([7], 1), 16, 258) == a[:1]


def test_bench_serving_off_and_shared_file_l3(tmp_path):
    write_trace(tmp_path / "trace.jsonl")
    out = tmp_path / "lines.jsonl"
    command = [
        sys.executable, str(BENCHMARKS / "bench_serving.py"),
        "--trace", str(tmp_path / "trace.jsonl"),
        "--block-tokens", str(BLOCK), "--page-size", str(BLOCK), "--replicas", "2",
        "--l1-pages", "64", "--l2-pages", "128", "--l3-capacity", "64MiB", "--threads", "1",
        "--max-output-tokens", "3", "--configs", "off,l1l2l3-file", "--json-out", str(out),
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    printed = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert (
        [r["config"] for r in written] == ["off", "l1l2l3-file"] == [r["config"] for r in printed]
    )
    prompt_tokens = NUM_REQUESTS * 5 * BLOCK + 4
    for row in written:
        assert KEYS <= row.keys()
        assert row["requests"] == row["answered"] == NUM_REQUESTS and row["failed"] == 0
        assert row["output_tokens"] == 3 * NUM_REQUESTS
        assert row["prompt_tokens"] == prompt_tokens
        hit = row["hit_tokens"]
        assert hit["l1"] + hit["l2"] + hit["l3"] + hit["computed"] == prompt_tokens
        assert set(row["ttft_ms"]) == {"p50", "p90", "p99"} and row["ttft_ms"]["p50"] > 0
        assert row["replicas"] == 2 and sum(row["per_replica"].values()) == NUM_REQUESTS
    off, cached = written
    assert off["hit_tokens"] == {"l1": 0, "l2": 0, "l3": 0, "computed": prompt_tokens}
    assert off["l3_url"] is None and off["l2_pages"] == 0
    assert cached["l3_url"].startswith("file://") and cached["l2_pages"] == 128
    # 9 of the 12 requests repeat a 4-block document: at most those blocks are hits.
    cached_hits = sum(cached["hit_tokens"][t] for t in ("l1", "l2", "l3"))
    assert 0 < cached_hits <= 9 * 4 * BLOCK
    assert "l1l2l3-file" in result.stdout.split("config")[-1]  # the table


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--configs", "off,l4"], "--configs: unknown l4"),
        (["--rate-scale", "0"], "--rate-scale must be > 0"),
        (["--requests", "0"], "--requests must be >= 1"),
    ],
)
def test_bench_serving_refuses_bad_flags(flags, message, capsys):
    with pytest.raises(SystemExit):
        bench_serving.parse_args(flags)
    assert message in capsys.readouterr().err


def test_replicas_with_an_l3_are_told_how_to_read_it():
    setup = Setup(("--model-config", "m.json"), "cpu", None, 1, "prefix", 16, 8, 12, 14,
                  "1GiB", 1, 0, l3_fetch="always")  # fmt: skip
    flags = replica_flags(setup, "l1l2l3-file", "file:///l3")
    assert flags[flags.index("--l3-url") :] == ["--l3-url", "file:///l3", "--l3-fetch", "always"]
    assert "--l3-fetch" not in replica_flags(setup, "l1l2", None)
    assert bench_serving.parse_args([]).l3_fetch == "measured"
