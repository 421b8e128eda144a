"""benchmarks.common.met_target: a benchmark that names a target says in one line whether it
met it, and its exit status follows (bench_routing printed "(target >= 1.5x)" under a 1.08x
ratio and exited 0)."""

from __future__ import annotations

from benchmarks.common import met_target


def test_a_missed_target_says_missed_and_returns_false(capsys):
    assert met_target("shared: prefix / round_robin hit rate", 1.08, 1.5) is False
    assert capsys.readouterr().out == (
        "shared: prefix / round_robin hit rate 1.08x, target >= 1.5x: MISSED\n"
    )


def test_a_met_target_says_met_and_returns_true(capsys):
    assert met_target("own: prefix / round_robin hit rate", 1.5, 1.5) is True
    assert capsys.readouterr().out.endswith("1.50x, target >= 1.5x: met\n")
