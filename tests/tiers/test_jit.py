"""Without triton (a CPU-only install leaves it out) everything imports and the CPU paths run;
a kernel launched is one error naming what to install. The stand-in's arithmetic is
triton's."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tiers.jit import _TritonStandIn

ROOT = Path(__file__).resolve().parents[2]

WITHOUT_TRITON = textwrap.dedent(
    """
    import sys
    sys.modules["triton"] = None  # as where it is not installed: importing it fails

    import engine_integration.engine.model.forward
    import engine_integration.vllm.block_copy
    import hicache.controller
    from tiers import kernels
    from tiers.jit import HAVE_TRITON, TritonMissingError

    assert not HAVE_TRITON
    block = open("README.md").read().split("<!-- engine example -->\\n```python\\n")[1]
    block = block.split("```")[0].replace("file:///tmp/hicache-example", sys.argv[1])
    exec(compile(block, "README engine example", "exec"))  # HiCache on the CPU, L1 to L3
    try:
        kernels._copy_chunks_kernel[(1,)]()
    except TritonMissingError as error:
        print("refused:", error)
    """
)


def test_without_triton_the_cpu_paths_run_and_a_kernel_launch_names_the_extra(tmp_path):
    done = subprocess.run(
        [sys.executable, "-c", WITHOUT_TRITON, f"file://{tmp_path}"],
        cwd=ROOT,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "hit 0 of 100 tokens" in done.stdout
    assert "refused: the kernel _copy_chunks_kernel needs triton" in done.stdout
    assert "pip install 'hicache[gpu]'" in done.stdout


def test_the_stand_ins_arithmetic_is_tritons():
    triton = pytest.importorskip("triton")
    stand_in = _TritonStandIn()
    # n = 0 is left out: triton 3.8 says 1, 3.9 says 0; no launch is sized by it.
    for n in range(1, 2049):
        assert stand_in.next_power_of_2(n) == triton.next_power_of_2(n), n
        for d in (1, 3, 64):
            assert stand_in.cdiv(n, d) == triton.cdiv(n, d)
