"""The daemon's deployment files (docs/deploy): a systemd unit and a container recipe.

Neither systemd nor a container engine runs here, so these check what can go stale without
them: the command lines are `hicache serve`'s own flags, the unit stops later than the
daemon's shutdown flush may take, and the container installs every package the daemon
imports (and not torch).
"""

from __future__ import annotations

import configparser
import importlib.metadata
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

from hicache.cli import build_parser

DEPLOY = Path(__file__).resolve().parents[3] / "docs" / "deploy"


def serve_args(argv: list[str]):
    assert argv[:2] == ["hicache", "serve"] or argv[0].endswith("/hicache"), argv
    flags = argv[2:] if argv[1] == "serve" and argv[0] == "hicache" else argv[2:]
    return build_parser().parse_args(["serve", *flags])  # exits 2 on an unknown flag


def test_the_systemd_unit_runs_the_daemon_with_its_own_flags():
    unit = configparser.ConfigParser(interpolation=None, strict=False)
    unit.optionxform = str  # systemd keys are case-sensitive
    unit.read(DEPLOY / "hicache-serve.service")
    assert set(unit.sections()) == {"Unit", "Service", "Install"}
    service = unit["Service"]
    argv = shlex.split(service["ExecStart"])
    assert argv[0].endswith("/hicache") and argv[1] == "serve"
    args = serve_args(argv)
    assert args.host == "0.0.0.0" and args.auth_token_file  # beyond loopback: with a token
    assert args.spill_dir.startswith("/var/lib/hicache")  # inside StateDirectory
    assert service["StateDirectory"] == "hicache"
    assert float(service["TimeoutStopSec"]) > args.flush_timeout  # the flush may finish
    assert service["KillSignal"] == "SIGTERM" and service["User"] == "hicache"
    assert unit["Install"]["WantedBy"] == "multi-user.target"


def containerfile() -> str:
    return (DEPLOY / "Containerfile").read_text()


def test_the_container_runs_the_daemon_with_its_own_flags():
    text = containerfile()
    entry = json.loads(re.search(r"^ENTRYPOINT (\[.*\])$", text, re.M)[1])
    command = json.loads(re.search(r"^CMD (\[.*\])$", text, re.M)[1])
    assert entry == ["hicache", "serve"]
    args = serve_args([*entry, *command])
    assert args.host == "0.0.0.0" and args.auth_token_file
    assert re.search(r"^USER hicache$", text, re.M) and "STOPSIGNAL SIGTERM" in text


def requirements_of(packages: set[str]) -> set[str]:
    """What the listed packages pull in themselves (from their installed metadata)."""
    found: set[str] = set()
    todo = list(packages)
    while todo:
        try:
            requires = importlib.metadata.requires(todo.pop()) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        for line in requires:
            if "extra ==" in line:
                continue
            name = re.split(r"[ ;<>=!~\[(]", line, maxsplit=1)[0].lower().replace("_", "-")
            if name not in found:
                found.add(name)
                todo.append(name)
    return found


def test_the_container_installs_what_the_daemon_imports_and_not_torch():
    listed = re.search(
        r"--no-deps \. \\\n && pip install --no-cache-dir (.*?)\\\n(.*?)\\\n", containerfile(), re.S
    )
    packages = set((listed[1] + listed[2]).split())
    probe = (
        "import sys, importlib.metadata as md\n"
        "before = set(sys.modules)\n"  # what the interpreter's start-up loaded is not ours
        "import hicache.server.daemon, hicache.server.cli\n"
        "dists = md.packages_distributions()\n"
        "new = {m.split('.')[0] for m in set(sys.modules) - before}\n"
        "print(' '.join(sorted({d for m in new for d in dists.get(m, [])})))\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    imported = {name.lower().replace("_", "-") for name in done.stdout.split()}
    # grpc imports grpc_tools when it happens to be installed; the daemon does not need it.
    needed = imported - {"hicache", "grpcio-tools"} - requirements_of(packages)
    assert "torch" not in needed  # the daemon runs without it
    assert needed <= {p.lower() for p in packages}, sorted(needed - packages)
