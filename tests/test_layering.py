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
    "hicache.simulate.player",
    "hicache.server",
    "engine_integration.serve.demo",
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


PACKAGES = ["hicache", "tiers", "radix", "engine_integration", "storage_backends"]


def test_no_module_imports_itself_in_a_circle():
    """Import cycles make a room impossible to read alone: none, even through an import
    made inside a function (the static graph sees those too)."""
    import grimp

    graph = grimp.build_graph(*PACKAGES, cache_dir=None, exclude_type_checking_imports=True)
    cycles = [sorted(group) for group in _strongly_connected(graph) if len(group) > 1]
    assert cycles == [], f"import cycles: {cycles}"


def _imported_by(graph, module: str) -> list[str]:
    """What `module` imports, less its own ancestors: grimp reads `from . import _ext` (a
    compiled submodule it cannot see) as an import of the package itself."""
    return sorted(
        other
        for other in graph.find_modules_directly_imported_by(module)
        if not module.startswith(other + ".")
    )


def _strongly_connected(graph) -> list[set[str]]:
    """Tarjan's algorithm over the graph's direct imports, iteratively."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    groups: list[set[str]] = []
    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, iter(_imported_by(graph, root)))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            module, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(_imported_by(graph, child))))
                elif child in on_stack:
                    low[module] = min(low[module], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[module])
            if low[module] == index[module]:
                group = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.add(member)
                    if member == module:
                        break
                groups.append(group)
    return groups


@pytest.mark.slow  # imports sglang and vllm in fresh processes: 109 s on a loaded 2-core machine
def test_old_adapter_paths_still_load_with_a_deprecation_warning():
    for old, new, name in [
        (
            "engine_integration.vllm_connector",
            "engine_integration.vllm.connector",
            "HiCacheConnector",
        ),
        (
            "engine_integration.sglang_storage",
            "engine_integration.sglang.storage",
            "HiCacheSGLangStorage",
        ),
    ]:
        code = (
            # SGLang imports torchvision, whose CUDA build needs the tests' guard on CPU torch
            "from tests.support.sglang_cpu import guard_torchvision_ops\n"
            "guard_torchvision_ops()\n"
            "import importlib, warnings\n"
            "with warnings.catch_warnings(record=True) as caught:\n"
            "    warnings.simplefilter('always')\n"
            f"    old = getattr(importlib.import_module({old!r}), {name!r})\n"
            "for w in caught:\n"
            "    if w.category is DeprecationWarning and 'engine_integration' in str(w.message):\n"
            "        print('warned:', w.message)\n"
            f"new = getattr(importlib.import_module({new!r}), {name!r})\n"
            "print('same class:', old is new)"
        )
        result = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT
        )
        assert result.returncode == 0, result.stderr
        assert f"warned: {old} is deprecated" in result.stdout, result.stdout
        assert new in result.stdout and "same class: True" in result.stdout, result.stdout


def test_ruff_finds_nothing():
    ruff = shutil.which("ruff")
    assert ruff is not None, "ruff is part of the dev extra"
    result = subprocess.run([ruff, "check", "."], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
