"""Where bench_serving.py sends its trace: one configuration's processes (`Deployment`: its
L3, N `hicache engine serve` replicas, the router), started from what every configuration of
a run shares (`Setup`), with the replicas' flags (`replica_flags`, `model_flags`).
bench_planner.py starts its calibration replica from the same. Imports no sibling but
engine_models.py (for a synthetic model's config)."""

from __future__ import annotations

import concurrent.futures
import tempfile
from dataclasses import dataclass
from pathlib import Path

# ---------------------------------------------------------------------------- the deployment


@dataclass(frozen=True)
class Setup:
    """What every configuration of one run shares (from the command line)."""

    model_flags: tuple[str, ...]  # `model_flags`
    device: str
    dtype: str | None
    replicas: int
    routing: str
    page_size: int
    max_running: int
    l1_pages: int
    l2_pages: int
    l3_capacity: str
    threads: int
    seed: int
    l3_fetch: str = "measured"  # the replicas' --l3-fetch, where they have an L3


def replica_flags(setup: Setup, config: str, l3_url: str | None) -> list[str]:
    flags = [
        "--page-size", str(setup.page_size), "--max-running", str(setup.max_running),
        "--l1-pages", str(setup.l1_pages), "--device", setup.device, "--seed", str(setup.seed),
        "--threads", str(setup.threads),
    ]  # fmt: skip
    flags += list(setup.model_flags)
    if setup.dtype:
        flags += ["--dtype", setup.dtype]
    if config == "off":
        return flags + ["--no-cache"]
    # Every cached page is announced to the router (prefix routing reads these).
    flags += ["--events-endpoint", "tcp://127.0.0.1:0", "--events-replay-endpoint",
              "tcp://127.0.0.1:0"]  # fmt: skip
    if config != "l1":
        flags += ["--l2-pages", str(setup.l2_pages)]
    if l3_url:
        flags += ["--l3-url", l3_url, "--l3-fetch", setup.l3_fetch]
    return flags


class Deployment:
    """One configuration's processes: its L3 (a directory or a daemon), N replicas, the
    router; `stop()` ends all of them (and removes the directory)."""

    def __init__(self, setup: Setup, config: str) -> None:
        from tests.support.replicas import HttpProcess

        self.setup, self.config = setup, config
        self.daemon = self.tmp = None
        self.l3_url: str | None = None
        self.processes: list = []
        self.router = None
        try:
            if config == "l1l2l3-file":
                self.tmp = tempfile.TemporaryDirectory(prefix="hicache-bench-serving-")
                self.l3_url = f"file://{self.tmp.name}/l3?capacity={setup.l3_capacity}"
            elif config == "l1l2l3-daemon":
                from tests.support.daemon import DaemonProcess

                self.daemon = DaemonProcess("--capacity", setup.l3_capacity).start(timeout_s=60)
                self.l3_url = f"grpc://{self.daemon.address}"
            flags = replica_flags(setup, config, self.l3_url)
            self.processes = [
                HttpProcess("engine", "serve", "--port", "0", "--name", f"r{i}", *flags)
                for i in range(setup.replicas)
            ]
            with concurrent.futures.ThreadPoolExecutor(len(self.processes)) as pool:
                list(pool.map(lambda p: p.start(timeout_s=900), self.processes))
            replica_args = [f for p in self.processes for f in ("--replica", p.url)]
            self.router = HttpProcess("route", "--port", "0", "--policy", setup.routing,
                                      *replica_args).start(timeout_s=120)  # fmt: skip
        except BaseException:
            self.stop()
            raise

    def info(self) -> dict:
        from tests.support.replicas import get_json

        return get_json(f"{self.processes[0].url}/hicache/info")

    def stop(self) -> None:
        for process in ([self.router] if self.router else []) + self.processes:
            process.stop()
        if self.daemon is not None:
            self.daemon.stop()
        if self.tmp is not None:
            self.tmp.cleanup()


def model_flags(name: str | None, workdir: Path) -> list[str]:
    """`hicache engine serve`'s flags for `--model`: none (the tiny model), a packaged
    checkpoint (`smollm2`, `gemma3`) or a checkpoint's path, which the replica takes as they
    are, or a synthetic model of bench_engine's (`1b`, `8b`, `tiny-full`: its config written
    to `workdir`, random weights)."""
    if name is None or name == "tiny":
        return []
    if name in ("smollm2", "gemma3") or Path(name).exists():
        return ["--model", name]
    from benchmarks.engine_models import MODELS
    from engine_integration.engine.model.config import model_config_to_json

    if name not in MODELS:
        raise SystemExit(f"bench_serving: --model {name}: no such file, and not one of "
                         f"smollm2, gemma3, {', '.join(sorted(MODELS))}")  # fmt: skip
    path = workdir / f"{name}.json"
    path.write_text(model_config_to_json(MODELS[name]))
    return ["--model-config", str(path)]
