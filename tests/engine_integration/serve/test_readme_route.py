"""The README's routing example runs as pasted: three replicas, a router, a chat request
through it, the router's stats, and everything stopped by the block's own last line."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


def readme_block() -> str:
    text = (ROOT / "README.md").read_text()
    return text.split("<!-- route example -->\n```bash\n", 1)[1].split("```", 1)[0]


@pytest.mark.slow  # two replicas and a router: 46 s on a loaded 2-core machine
def test_the_readme_routing_example_runs_as_pasted():
    block = readme_block()
    assert "kill %1 %2 %3 %4" in block
    # `hicache` of this checkout: exec, so that the block's `kill %N` reaches the process
    script = 'hicache() { exec python -m hicache "$@"; }\n' + block
    proc = subprocess.Popen(
        ["bash", "-c", script],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=240)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # whatever the block did not stop
        except ProcessLookupError:
            pass
    assert proc.returncode == 0, output
    lines = [line for line in output.splitlines() if line.startswith("{")]
    answer, stats = json.loads(lines[0]), json.loads(lines[1])
    assert answer["object"] == "chat.completion" and len(answer["hicache"]["token_ids"]) == 8
    assert answer["hicache"]["replica"] in ("r0", "r1", "r2")
    assert [r["alive"] for r in stats["replicas"]] == [True] * 3
    assert sum(r["routed"] for r in stats["replicas"]) == 1
