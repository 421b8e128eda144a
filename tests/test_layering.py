"""The layering rules of DESIGN.md, checked on every test run.

import-linter checks the static import graph (pyproject.toml holds the contracts); the
subprocess checks catch what a static graph cannot: a torch import at run time.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_import_linter_contracts_hold():
    lint_imports = shutil.which("lint-imports")
    assert lint_imports is not None, "import-linter is part of the dev extra"
    result = subprocess.run(
        [lint_imports, "--config", str(ROOT / "pyproject.toml")],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr


# What must run without torch: the index, L3 storage, the controller's policy core, the
# simulator, the cache-server daemon, and the CLI that starts them.
TORCH_FREE_MODULES = [
    "radix",
    "radix.tree",
    "radix.keys",
    "storage_backends",
    "storage_backends.registry",
    "storage_backends.objects",
    "storage_backends.grpc_store",
    "tiers",
    "tiers.layout",
    "tiers.allocator",
    "hicache.cli",
    "hicache.config",
    "hicache.controller",
    "hicache.mover",
    "hicache.match",
    "hicache.simulate",
    "hicache.simulate.replay",
    "hicache.server",
    "engine_integration.demo",
]


@pytest.mark.parametrize("module", TORCH_FREE_MODULES)
def test_module_does_not_import_torch(module):
    assert importlib.util.find_spec(module) is not None, f"{module} does not exist"
    code = (
        "import importlib, sys; "
        f"importlib.import_module({module!r}); "
        "bad = sorted(m for m in ('torch', 'triton') if m in sys.modules); "
        "print(','.join(bad))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "", f"importing {module} pulled in {result.stdout.strip()}"


def test_ruff_finds_nothing():
    ruff = shutil.which("ruff")
    assert ruff is not None, "ruff is part of the dev extra"
    result = subprocess.run([ruff, "check", "."], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
