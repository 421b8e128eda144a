"""`hicache simulate` mistakes, as a newcomer makes them: each is one line naming the flag or
the file, exit code 2, no traceback (`--debug` shows it). In this process, but for one real
process and --debug."""

from __future__ import annotations

import gzip
import re
import subprocess
from pathlib import Path

import pytest

from hicache.cli import main
from tests.support.cli import run_hicache

SMALL = "conversations:sessions=2,turns=2"


def _files(tmp: Path) -> None:
    (tmp / "trace.csv").write_text("timestamp,input_length\n0,100\n")
    (tmp / "array.json").write_text('[{"timestamp": 0}]\n')
    (tmp / "fake.jsonl.gz").write_bytes(b"not gzip at all")
    (tmp / "cut.jsonl.gz").write_bytes(
        gzip.compress(b'{"timestamp": 0, "input_length": 512, "hash_ids": [1]}\n' * 50)[:60]
    )
    (tmp / "binary.jsonl").write_bytes(gzip.compress(b"{}\n"))
    (tmp / "bad-line.jsonl").write_text(
        '{"timestamp": 0, "input_length": 512, "hash_ids": [1]}\n{"timestamp": 1}\n'
    )
    (tmp / "a-file").write_text("")
    (tmp / "dir").mkdir()


CASES = {
    "missing trace": (["--trace", "{tmp}/no.jsonl"], r"no\.jsonl: cannot open the trace: No such"),
    "a directory": (["--trace", "{tmp}/dir"], r"dir: cannot open the trace: Is a directory"),
    "a CSV": (["--trace", "{tmp}/trace.csv"], r"trace\.csv: not a Mooncake JSONL trace \(line 1"),
    "a JSON array": (["--trace", "{tmp}/array.json"], r"array\.json: not a Mooncake JSONL .* list"),
    "not gzip": (["--trace", "{tmp}/fake.jsonl.gz"], r"fake\.jsonl\.gz: cannot read the trace"),
    "truncated gzip": (["--trace", "{tmp}/cut.jsonl.gz"], r"cut\.jsonl\.gz: cannot read the trace"),
    "gzip not named .gz": (["--trace", "{tmp}/binary.jsonl"], r"not UTF-8 text; compressed\?"),
    "bad line": (["--trace", "{tmp}/bad-line.jsonl"], r"bad-line\.jsonl:2: missing field"),
    "unknown generator key": (["--trace", "conversations:sesions=3"], r"cannot read 'sesions=3'"),
    "bad size": (["--l3", "8G"], r"--l3 8G: .*'8G' is not a size"),
    "negative size": (["--l2", "-5"], r"--l2 must be >= 0, got -5"),
    "bad sweep": (["--sweep", "l2=abc"], r"--sweep 'l2=abc': .*'abc' is not a size"),
    "sweep of no tier": (["--sweep", "l9=1,2"], r"--sweep 'l9=1,2': expected l1="),
    "three sweeps": (["--sweep", "l2=1", "--sweep", "l3=1", "--sweep", "l1=1"], r"at most twice"),
    "unknown model": (["--model", "llama-9"], r"unknown model 'llama-9': use a preset"),
    "missing config.json": (["--model", "{tmp}/config.json"], r"config\.json: cannot read"),
    "unknown hardware": (["--hardware", "h999"], r"unknown hardware 'h999'; presets: h100"),
    "unknown dtype": (["--kv-dtype", "int3"], r"unknown dtype 'int3'"),
    "no instances": (["--instances", "0"], r"--instances must be >= 1"),
    "mfu above 1": (["--mfu", "2"], r"--mfu must be in \(0, 1\]"),
    "no jobs": (["--jobs", "0"], r"--jobs must be >= 1"),
    "no requests": (["--limit", "0"], r"--limit must be >= 1"),
    "pages of 0 tokens": (["--page-size", "0"], r"--page-size must be >= 1"),
    "weights that do not fit": (
        ["--gpus-per-instance", "3"],
        r"--gpus-per-instance 3: .* leave no",
    ),
    "out is a file": (["--sweep", "l2=0,1", "--out", "{tmp}/a-file"], r"--out .*a-file: exists"),
    "bad policy": (["--write-policy", "sometimes"], r"argument --write-policy: invalid choice"),
    "unknown flag": (
        ["--instnaces", "2"],
        r"unrecognized arguments: --instnaces 2 \(did you mean --instances",
    ),
    "count not a number": (["--instances", "two"], r"argument --instances: invalid int value"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_mistake_is_one_line_and_exit_code_2(case, tmp_path, capsys):
    _files(tmp_path)
    argv = [a.replace("{tmp}", str(tmp_path)) for a in CASES[case][0]]
    if "--trace" not in argv:
        argv += ["--trace", SMALL]
    try:
        code = main(["simulate", "--no-verdict", *argv])
    except SystemExit as exit_info:  # argparse's own mistakes
        code = exit_info.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("hicache simulate: error: "), lines[0]
    assert re.search(CASES[case][1], lines[0]), lines[0]


def _simulate(*argv: str) -> subprocess.CompletedProcess:
    return run_hicache("simulate", *argv)


def test_in_a_real_process_a_mistake_is_one_line(tmp_path):
    _files(tmp_path)
    done = _simulate("--trace", str(tmp_path / "fake.jsonl.gz"))
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_debug_shows_the_traceback(tmp_path):
    _files(tmp_path)
    done = _simulate("--trace", str(tmp_path / "trace.csv"), "--debug")
    assert done.returncode != 0
    assert "Traceback" in done.stderr and "TraceError" in done.stderr


def test_a_sweep_without_matplotlib_is_one_line_before_it_runs(capsys, monkeypatch, tmp_path):
    """matplotlib is an extra (`hicache[plot]`): a sweep without it stops at once, naming it."""
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "matplotlib" else real_find_spec(name, *a),
    )
    code = main(["simulate", "--no-verdict", "--sweep", "l2=1,2", "--out", str(tmp_path / "o")])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pip install 'hicache[plot]'" in err[0], err
    assert not (tmp_path / "o").exists()  # stopped before the sweep ran
