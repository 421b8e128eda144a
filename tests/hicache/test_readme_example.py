"""The README's engine example runs as pasted, twice, in two processes on one L3.

The second process starts with empty L1 and L2 and finds the first one's pages in L3; under
every prefetch policy it must run clean (under `timeout` and `best_effort` a prefetch still
in flight when the request inserts its prompt once crashed it), and under `wait_complete`
it must hit every full page but the last one's token.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
URL = "file:///tmp/hicache-example?capacity=1GiB"


def readme_example() -> str:
    text = (ROOT / "README.md").read_text()
    block = text.split("<!-- engine example -->\n```python\n", 1)[1].split("```", 1)[0]
    assert URL in block and 'prefetch_policy="timeout"' in block
    return block


def run(script: Path, cwd: Path) -> tuple[int, int]:
    done = subprocess.run(
        [sys.executable, str(script)],
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    found = re.search(r"hit (\d+) of 100 tokens \(L1 \d+, L2 \d+, L3 (\d+) pages\)", done.stdout)
    assert found, done.stdout
    return int(found[1]), int(found[2])


@pytest.mark.parametrize("policy", ["timeout", "best_effort", "wait_complete"])
def test_the_readme_engine_example_runs_twice_on_one_l3(tmp_path, policy):
    script = tmp_path / "example.py"
    url = f"file://{tmp_path / 'l3'}?capacity=1GiB"
    code = readme_example().replace(URL, url)
    script.write_text(code.replace('prefetch_policy="timeout"', f'prefetch_policy="{policy}"'))
    assert run(script, tmp_path) == (0, 0)  # a cold cache
    hit_tokens, l3_pages = run(script, tmp_path)  # a new process: its L1 and L2 are empty
    if policy == "wait_complete":
        assert (hit_tokens, l3_pages) == (96, 6)
    else:
        assert hit_tokens == 16 * l3_pages  # whatever arrived in time, and nothing else
