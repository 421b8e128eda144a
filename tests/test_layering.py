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


TORCH_FREE_MODULES = [
    "radix",
    "storage_backends",
    "hicache.cli",
    "tiers",
    "tiers.layout",
    "tiers.allocator",
]

# Modules that later issues add; checked as soon as they exist.
TORCH_FREE_WHEN_PRESENT = [
    "radix.tree",
    "radix.keys",
    "storage_backends.registry",
    "storage_backends.objects",
    "hicache.config",
    "hicache.controller",
    "hicache.simulate",
    "hicache.server",
]


@pytest.mark.parametrize("module", TORCH_FREE_MODULES + TORCH_FREE_WHEN_PRESENT)
def test_module_does_not_import_torch(module):
    if module in TORCH_FREE_WHEN_PRESENT and importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} does not exist yet")
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
