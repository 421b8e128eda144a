"""Helpers shared by the benchmark scripts: provenance and the one-JSON-line output."""

from __future__ import annotations

import concurrent.futures
import json
import os
import platform
import subprocess
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_TRACE = REPO / "hicache" / "simulate" / "traces" / "mooncake_synthetic_trace.jsonl.gz"


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


def sig(value: float) -> float:
    """Four significant digits: readable in a JSON line at any scale (a slow tiny smoke run
    must not round to 0)."""
    return float(f"{value:.4g}")


def emit(result: dict) -> None:
    """Print one JSON line of results, stamped with the revision."""
    print(json.dumps({"git": git_revision(), **result}), flush=True)


def met_target(what: str, value: float, target: float) -> bool:
    """Say in one line whether `value` met its `target` (a ratio, higher is better), and
    return it: a benchmark that names a target exits 1 when any is missed."""
    met = value >= target
    verdict = "met" if met else "MISSED"
    print(f"{what} {value:.2f}x, target >= {target:g}x: {verdict}", flush=True)
    return met


def write_random_file(path: Path, num_bytes: int) -> None:
    """`path` with at least `num_bytes` of random bytes (whole MiB), in the page cache now."""
    block = os.urandom(1 << 20)
    with open(path, "wb") as out:
        for _ in range(-(-num_bytes // len(block))):
            out.write(block)


def parallel_read_s(
    path: Path, buffer: memoryview, pool: concurrent.futures.Executor, num_threads: int
) -> float:
    """Seconds for one plain read of `path` into `buffer` (as many bytes as it holds), in
    `num_threads` contiguous shares on `pool`, 4 MiB a preadv (it lets the GIL go): what the
    host reads from the page cache with no format, checks or pages."""
    num_bytes = len(buffer)
    shares = [
        (i * num_bytes // num_threads, (i + 1) * num_bytes // num_threads)
        for i in range(num_threads)
    ]
    fd = os.open(path, os.O_RDONLY)

    def read(share: tuple[int, int]) -> None:
        start, end = share
        while start < end:
            got = os.preadv(fd, [buffer[start : min(end, start + (4 << 20))]], start)
            if got <= 0:
                raise OSError(f"short read of {path} at {start}")
            start += got

    try:
        began = time.perf_counter()
        list(pool.map(read, shares))
        return time.perf_counter() - began
    finally:
        os.close(fd)


def cuda_median_ms(body, repeats: int = 5, warmups: int = 1) -> float:
    """The median milliseconds of `body()` on the current CUDA stream, each call timed by a
    pair of CUDA events, after `warmups` untimed calls."""
    import torch

    for _ in range(warmups):
        body()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        body()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end))
    return sorted(samples)[len(samples) // 2]
