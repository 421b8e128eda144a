"""Helpers shared by the benchmark scripts: provenance and the one-JSON-line output."""

from __future__ import annotations

import json
import platform
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_TRACE = REPO / "benchmarks" / "traces" / "mooncake_synthetic_trace.jsonl.gz"


def git_revision() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
        )
    except OSError:
        return "unknown"
    dirty = subprocess.run(["git", "diff", "--quiet"], cwd=REPO).returncode != 0
    return (out.stdout.strip() or "unknown") + ("-dirty" if dirty else "")


def device_name(device: str = "cpu") -> str:
    if device.startswith("cuda"):
        import torch

        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine()


def emit(result: dict) -> None:
    """Print one JSON line of results, stamped with the revision."""
    print(json.dumps({"git": git_revision(), **result}), flush=True)
