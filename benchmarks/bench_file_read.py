"""Benchmark: the file:// backend's read of an L3 hit's pages from the page cache into host
memory (pinned where there is a GPU), against the host's plain parallel read of as many bytes.

Claim (issue 21): the C reader checks each page while its bytes are still in the core's
cache, by reading a stretch a window (`file_read._WINDOW_BYTES`) at a time and hashing each
window as it lands, and so reads checked pages at the rate the host reads plain bytes, where
reading a whole page and then hashing it went through memory twice. The run times the
reader at several window sizes in turns (0: a stretch in one read, then hashed: the reader
before the change) and the ceiling between them:

  ceiling   one file of the same size, a thread per core, each its own contiguous share in
            4 MiB preadv calls into one buffer (bench_engine's L3 read ceiling)
  reader    `batch_get` of every page, in batches of `--batch-bytes` with `--batches` of them
            in flight, as the cache's executor reads an L3 run

The pages are the 1.1B benchmark model's (1.75 MiB: 12 source layers and 2 boundary layers
of 64 tokens x 8 KV heads x 64 x bf16, K and V) unless `--page-bytes` says otherwise.
Prints one JSON line per window, then a table.

    python benchmarks/bench_file_read.py                      # 896 MiB, the 32K-token hit
    python benchmarks/bench_file_read.py --total-bytes 64MiB --repeats 3   # a quick look
    python benchmarks/bench_file_read.py --smoke              # tiny, for the test suite
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.common import emit, parallel_read_s, write_random_file  # noqa: E402
from storage_backends import file_read, open_backend  # noqa: E402
from storage_backends.options import parse_size  # noqa: E402

LAYOUT = "mha;layers=14;page=64;kv_heads=8;head_dim=64;dtype=bfloat16"  # 1.75 MiB pages
CPUS = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--page-bytes", default="1792KiB")
    parser.add_argument("--total-bytes", default="896MiB", help="the hit's bytes")
    parser.add_argument("--batch-bytes", default="48MiB", help="L3Config.read_chunk_bytes")
    parser.add_argument("--batches", type=int, default=4, help="batches in flight")
    parser.add_argument(
        "--io-threads",
        type=int,
        default=max(1, min(16, CPUS * 3 // 4)),
        help="file:// io_threads (default: bench_engine's, three quarters of the cores)",
    )
    parser.add_argument(
        "--windows",
        default="65536,131072,262144,524288,0",
        help="read windows in bytes, 0 for a whole stretch in one read (the old reader)",
    )
    parser.add_argument("--repeats", type=int, default=7, help="timed rounds (medians)")
    parser.add_argument("--dir", default=None, help="where the L3 files go (default: a temp dir)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, for the test suite")
    args = parser.parse_args()
    if args.smoke:
        args.page_bytes, args.total_bytes, args.batch_bytes = "64KiB", "2MiB", "512KiB"
        args.windows, args.repeats = "4096,0", 1
    args.page_bytes = parse_size(args.page_bytes)
    args.total_bytes = parse_size(args.total_bytes)
    args.batch_bytes = parse_size(args.batch_bytes)
    args.windows = [int(w) for w in args.windows.split(",")]
    if args.repeats < 1 or args.batches < 1:
        parser.error("--repeats and --batches must be >= 1")
    return args


def host_buffer(num_bytes: int) -> memoryview:
    """`num_bytes` of host memory, pinned where CUDA is there (as the L2 pool is)."""
    try:
        import torch
    except ImportError:
        return memoryview(bytearray(num_bytes))
    pinned = torch.cuda.is_available()
    return memoryview(torch.empty(num_bytes, dtype=torch.uint8, pin_memory=pinned).numpy())


class Reader:
    """One directory of pages, read back as the executor reads an L3 run."""

    def __init__(self, store, keys: list[bytes], views: list[memoryview], args) -> None:
        self.store, self.keys, self.views = store, keys, views
        per_batch = max(1, args.batch_bytes // args.page_bytes)
        self.spans = [(i, min(i + per_batch, len(keys))) for i in range(0, len(keys), per_batch)]
        self.batches = args.batches

    async def read_all(self) -> float:
        gate = asyncio.Semaphore(self.batches)

        async def batch(start: int, end: int) -> None:
            async with gate:
                found = await self.store.batch_get(self.keys[start:end], self.views[start:end])
            if not all(found):
                raise RuntimeError(f"pages [{start}, {end}) not all read: {found}")

        began = time.perf_counter()
        await asyncio.gather(*(batch(start, end) for start, end in self.spans))
        return time.perf_counter() - began


async def measure(args, directory: Path) -> dict[int, list[float]]:
    num_pages = max(1, args.total_bytes // args.page_bytes)
    total = num_pages * args.page_bytes
    # (from 1: a pack table marks a deleted entry with the all-zero key)
    keys = [(i + 1).to_bytes(16, "little") for i in range(num_pages)]
    memory = host_buffer(total)
    views = [memory[i * args.page_bytes : (i + 1) * args.page_bytes] for i in range(num_pages)]
    url = f"file://{directory / 'l3'}?capacity={2 * total}&io_threads={args.io_threads}"
    flat = directory / "ceiling.bin"
    write_random_file(flat, total)
    times: dict[int, list[float]] = {w: [] for w in [*args.windows, -1]}  # -1: the ceiling
    async with open_backend(url, layout=LAYOUT) as store:
        per_put = max(1, args.batch_bytes // args.page_bytes)
        for start in range(0, num_pages, per_put):  # written as the cache writes, batch by batch
            end = min(start + per_put, num_pages)
            pages = [os.urandom(args.page_bytes) for _ in range(start, end)]
            assert await store.batch_put(keys[start:end], pages) == [True] * (end - start)
        reader = Reader(store, keys, views, args)
        with concurrent.futures.ThreadPoolExecutor(CPUS) as pool:
            for round_index in range(args.repeats + 1):  # the first round warms up
                order = args.windows[round_index % len(args.windows) :]
                order += args.windows[: round_index % len(args.windows)]
                for window in order:
                    file_read._WINDOW_BYTES = window or (1 << 40)
                    seconds = await reader.read_all()
                    ceiling = parallel_read_s(flat, memory, pool, CPUS)
                    if round_index:
                        times[window].append(seconds)
                        times[-1].append(ceiling)
        stats = store.stats()
        if stats.num_corrupt_total:
            raise RuntimeError(f"corrupt pages counted: {stats.num_corrupt}")
    return times


def main() -> None:
    args = parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as scratch:
        times = asyncio.run(measure(args, Path(scratch)))
    num_pages = max(1, args.total_bytes // args.page_bytes)
    total = num_pages * args.page_bytes
    ceiling = total / statistics.median(times[-1]) / 1e9
    whole = total / statistics.median(times[0]) / 1e9 if 0 in times else None
    rows = []
    for window in args.windows:
        rate = total / statistics.median(times[window]) / 1e9
        row = {
            "bench": "file_read",
            "page_bytes": args.page_bytes,
            "total_bytes": total,
            "io_threads": args.io_threads,
            "cpus": CPUS,
            "window_bytes": window,
            "read_gb_s": round(rate, 2),
            "ceiling_gb_s": round(ceiling, 2),
            "of_ceiling": round(rate / ceiling, 3),
            "of_whole_stretch": round(rate / whole, 3) if whole else None,
        }
        emit(row)
        rows.append(row)
    print(
        f"\n{total / 2**20:.0f} MiB of {args.page_bytes / 2**20:.2f} MiB pages, "
        f"{args.io_threads} io threads, {CPUS} cores; ceiling {ceiling:.1f} GB/s"
    )
    print(f"{'window':>10} {'GB/s':>7} {'of ceiling':>11} {'vs whole':>9}")
    for row in rows:
        label = f"{row['window_bytes'] >> 10} KiB" if row["window_bytes"] else "whole"
        vs = f"{row['of_whole_stretch']:.2f}x" if row["of_whole_stretch"] else "-"
        print(f"{label:>10} {row['read_gb_s']:>7.1f} {row['of_ceiling']:>10.0%} {vs:>9}")


if __name__ == "__main__":
    main()
