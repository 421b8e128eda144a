"""Benchmark: the cache-server daemon (`grpc://`) against Redis, same payloads, same run.

Claim (issue 8): on loopback, with 4 client processes putting and getting batches of 32 pages
of 256 KiB and of 2 MiB, the daemon's get throughput is at least Redis's (a real
`redis-server` through the `redis://` backend). Both go through the same StorageBackend API,
so both frame and verify every page the same way; what differs is the server and the
transport.

For each page size and backend: 4 processes (spawned) each put `--rounds` batches of fresh
keys, then get them back, after a warm-up round; aggregate GB/s is all payload bytes over
the wall time from the common start to the last process' end; p50 / p99 are per-batch
latencies over every process. `--repeats` repetitions alternate between the backends (so
load from elsewhere on the machine falls on both alike); GB/s is the median.
Prints one JSON line per case (the daemon's lines carry the ratio to Redis), then a table.

    python benchmarks/bench_server.py              # 256 KiB and 2 MiB pages
    python benchmarks/bench_server.py --smoke      # tiny, for the test suite
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from benchmarks.common import device_name, emit  # noqa: E402
from storage_backends import open_backend  # noqa: E402

LAYOUT = "mha;layers=32;page=64;kv_heads=8;head_dim=128;dtype=bfloat16"  # an opaque label
SEED = 1234


# -- servers ----------------------------------------------------------------------------------


def start_daemon(capacity: str, extra: list[str]) -> tuple[subprocess.Popen, int]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "hicache", "serve", "--port", "0", "--capacity", capacity, *extra],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    line = proc.stdout.readline()
    match = re.search(r"listening on \S+:(\d+)", line)
    if match is None:
        proc.kill()
        raise RuntimeError(f"hicache serve did not start: {line!r}")
    return proc, int(match.group(1))


def start_redis(workdir: str) -> tuple[subprocess.Popen, int]:
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server is not installed (apt-get install redis-server)")
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", workdir],
        stdout=subprocess.DEVNULL,
    )  # fmt: skip
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return proc, port
        except OSError:
            time.sleep(0.02)
    proc.kill()
    raise RuntimeError("redis-server did not start")


# -- one client process -----------------------------------------------------------------------


def client(args: tuple) -> dict:
    url, worker, page_bytes, batch_pages, rounds, repeats, barrier = args
    return asyncio.run(_client(url, worker, page_bytes, batch_pages, rounds, repeats, barrier))


async def _client(url, worker, page_bytes, batch_pages, rounds, repeats, barrier) -> dict:
    rng = np.random.default_rng(SEED + worker)
    pages = [rng.bytes(page_bytes) for _ in range(batch_pages)]
    into = [bytearray(page_bytes) for _ in range(batch_pages)]
    phases: dict[str, list] = {"put": [], "get": []}
    async with open_backend(url, layout=LAYOUT) as store:
        for repeat in range(repeats + 1):  # the first is the warm-up
            batches = [
                [rng.bytes(16) for _ in range(batch_pages)] for _ in range(rounds)
            ]  # fresh keys every repetition
            for phase in ("put", "get"):
                await asyncio.get_running_loop().run_in_executor(None, barrier.wait)
                started = time.monotonic()
                latencies = []
                for keys in batches:
                    t0 = time.perf_counter()
                    if phase == "put":
                        ok = await store.batch_put(keys, pages)
                    else:
                        ok = await store.batch_get(keys, into)
                    latencies.append(time.perf_counter() - t0)
                    if not all(ok):
                        raise RuntimeError(f"{url}: {phase} failed for {ok.count(False)} pages")
                if repeat:
                    phases[phase].append((started, time.monotonic(), latencies))
            for keys in batches:  # untimed: keep both servers' memory to one round's pages
                await store.delete(keys)
        if bytes(into[-1]) != pages[-1]:
            raise RuntimeError("a get returned other bytes than were put")
    return phases


def run_round(url: str, page_bytes: int, batch_pages: int, rounds: int, num_clients: int) -> dict:
    """One measured repetition (after one warm-up) of `num_clients` processes: per phase,
    the aggregate GB/s and every batch latency."""
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        barrier = manager.Barrier(num_clients)
        with ctx.Pool(num_clients) as pool:
            args = [
                (url, w, page_bytes, batch_pages, rounds, 1, barrier) for w in range(num_clients)
            ]
            results = pool.map(client, args)
    out = {}
    for phase in ("put", "get"):
        spans = [r[phase][0] for r in results]
        wall = max(end for _, end, _ in spans) - min(start for start, _, _ in spans)
        out[phase] = (
            num_clients * rounds * page_bytes * batch_pages / wall / 1e9,
            [lat for _, _, lats in spans for lat in lats],
        )
    return out


def summarize(rounds: list[dict]) -> dict:
    """Median GB/s over repetitions; p50 / p99 over all batches of all repetitions."""
    out = {}
    for phase in ("put", "get"):
        rates = [r[phase][0] for r in rounds]
        latencies = [lat for r in rounds for lat in r[phase][1]]
        out[f"{phase}_gb_s"] = round(statistics.median(rates), 3)
        out[f"{phase}_p50_ms"] = round(float(np.percentile(latencies, 50)) * 1e3, 2)
        out[f"{phase}_p99_ms"] = round(float(np.percentile(latencies, 99)) * 1e3, 2)
    return out


# -- main ------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--page-sizes", default="256KiB,2MiB")
    parser.add_argument("--batch-pages", type=int, default=32)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=4, help="batches per client per repeat")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-message", default="4MiB", help="daemon and client message limit")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, for the test suite")
    args = parser.parse_args(argv)
    if args.smoke:
        args.page_sizes, args.batch_pages, args.clients = "64KiB", 4, 2
        args.rounds, args.repeats = 2, 1
    from storage_backends import parse_size

    sizes = [parse_size(s) for s in args.page_sizes.split(",")]
    per_repeat = max(sizes) * args.batch_pages * args.rounds * args.clients
    capacity = f"{2 * per_repeat + (256 << 20)}"
    workdir = tempfile.mkdtemp(prefix="bench-server-")
    daemon, daemon_port = start_daemon(capacity, ["--max-message-bytes", args.max_message])
    redis, redis_port = start_redis(workdir)
    urls = {
        "redis": f"redis://127.0.0.1:{redis_port}/0?timeout=60s",
        # The client processes here are hicache's own: they may tune their malloc for gRPC.
        "grpc": f"grpc://127.0.0.1:{daemon_port}?timeout=60s&max_message={args.max_message}"
        "&tune_malloc=true",
    }
    rows = []
    try:
        for page_bytes in sizes:
            rounds: dict[str, list[dict]] = {"redis": [], "grpc": []}
            for _ in range(args.repeats):  # interleaved, so load from elsewhere hits both alike
                for backend in rounds:
                    rounds[backend].append(
                        run_round(
                            urls[backend], page_bytes, args.batch_pages, args.rounds, args.clients
                        )
                    )
            measured = {backend: summarize(r) for backend, r in rounds.items()}
            for backend, result in measured.items():
                line = {
                    "bench": "server",
                    "backend": backend,
                    "page_bytes": page_bytes,
                    "batch_pages": args.batch_pages,
                    "clients": args.clients,
                    **result,
                    "device": device_name(),
                    "cpus": os.cpu_count(),
                }
                if backend == "grpc":
                    for phase in ("put", "get"):
                        line[f"{phase}_vs_redis"] = round(
                            result[f"{phase}_gb_s"] / measured["redis"][f"{phase}_gb_s"], 3
                        )
                    line["target"] = "get_vs_redis >= 1.0"
                emit(line)
                rows.append(line)
    finally:
        daemon.terminate()
        redis.terminate()
        daemon.wait(timeout=30)
        redis.wait(timeout=30)
        shutil.rmtree(workdir, ignore_errors=True)
    _table(rows)
    return 0


def _table(rows: list[dict]) -> None:
    print(f"\n{'backend':8} {'page':>8} {'put GB/s':>9} {'get GB/s':>9} "
          f"{'put p50/p99 ms':>16} {'get p50/p99 ms':>16} {'get vs redis':>13}")  # fmt: skip
    for r in rows:
        ratio = f"{r['get_vs_redis']:.2f}x" if "get_vs_redis" in r else ""
        print(
            f"{r['backend']:8} {r['page_bytes'] >> 10:>6}Ki {r['put_gb_s']:>9.2f} "
            f"{r['get_gb_s']:>9.2f} {r['put_p50_ms']:>7.1f}/{r['put_p99_ms']:<8.1f} "
            f"{r['get_p50_ms']:>7.1f}/{r['get_p99_ms']:<8.1f} {ratio:>13}"
        )


if __name__ == "__main__":
    sys.exit(main())
