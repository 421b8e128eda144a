"""The raw Mooncake client's time for a batch of objects, by object size around a page: where
the store's cost steps up with size, and what a framed page (the page and its header, as
the backend stores it) costs against the bare page.

    python benchmarks/bench_mooncake_sizes.py                          # 64 KiB pages
    python benchmarks/bench_mooncake_sizes.py --page-bytes 2097152 --in-flight 1,4
    python benchmarks/bench_mooncake_sizes.py --sizes 65480,65490,65536,65540
    python benchmarks/bench_mooncake_sizes.py --movers tcp,tcp-64k     # the control alone

Beside the client (`raw`), two controls move the same objects over plain loopback TCP,
framed as Mooncake's TCP transport frames a request (loopback_tcp.py): `tcp` in as few
system calls as the kernel allows, `tcp-64k` in operations of at most 64 KiB, as the
transport's asio reads and writes move a body. A step that `tcp-64k` shows and `tcp` does
not is the transport's, not the kernel's.

A master and one holder start on loopback, as in bench_backends.py. Each size is put and
read back as `--batch` objects a call and `--batches` calls a caller, by 1 and by 4 callers
at once (threads), with fresh keys each repetition; within a repetition the movers and
sizes take turns, so drift falls on all of them alike. One JSON line per (mover, callers,
size), then a table: the median microseconds of a call, GB/s of object bytes, and the
median over repetitions of this size's time over the page's (1.00 is the page; 1.13 takes
13 % longer for the same count).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.backend_servers import raw_mooncake_client, start_mooncake  # noqa: E402
from benchmarks.backend_workload import LAYOUT  # noqa: E402
from benchmarks.common import device_name, emit, sig  # noqa: E402
from benchmarks.loopback_tcp import ASIO_OP_BYTES, LoopbackBatches, timed_at_once  # noqa: E402
from storage_backends.objects import header_size  # noqa: E402


def default_sizes(page: int) -> list[int]:
    """Around the page: a page less 4 KiB and less a header, the page, four bytes more, a
    framed page, 4 KiB more (those above zero)."""
    head = header_size(LAYOUT)
    sizes = [page - 4096, page - head, page, page + 4, page + head, page + 4096]
    return [size for size in sizes if size > 0]


class RawBatches:
    """One raw client with registered source and destination memory for `callers` callers'
    batches of objects of up to `largest` bytes; `run` times one size's puts, then its gets."""

    def __init__(self, address: str, callers: int, batch: int, batches: int, largest: int):
        self.client = raw_mooncake_client(address)
        self.batch, self.batches = batch, batches
        self.slot = -(-largest // 4096) * 4096
        nbytes = callers * batch * self.slot
        self.src = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
        self.dst = np.zeros(nbytes, np.uint8)
        for array in (self.src, self.dst):
            if self.client.register_buffer(array.ctypes.data, array.nbytes) != 0:
                raise RuntimeError("the raw Mooncake client could not register its buffers")
        self.pool = ThreadPoolExecutor(callers)
        self.made = 0

    def run(self, callers: int, size: int) -> tuple[float, float]:
        """Seconds for `callers` callers to put, then to get, their batches of `size`."""
        self.made += 1
        tag = f"sizes{self.made}"
        names = [
            [[f"{tag}:{c}:{b}:{i}" for i in range(self.batch)] for b in range(self.batches)]
            for c in range(callers)
        ]

        sizes = [size] * self.batch
        steps = (("put", self.client.batch_put_from, self.src, 0),
                 ("get", self.client.batch_get_into, self.dst, size))  # fmt: skip

        def move(caller: int, step: tuple) -> None:
            op, method, array, want = step
            base = array.ctypes.data + caller * self.batch * self.slot
            addresses = [base + i * self.slot for i in range(self.batch)]
            for keys in names[caller]:
                codes = method(keys, addresses, sizes)
                if codes != [want] * self.batch:
                    raise RuntimeError(f"{op} of {size} B objects: {codes}")

        put_s, get_s = timed_at_once(
            self.pool, callers, [functools.partial(move, step=step) for step in steps]
        )
        for per_caller in names:
            for keys in per_caller:
                self.client.batch_remove(keys, True)
        return put_s, get_s

    def close(self) -> None:
        self.pool.shutdown()
        self.client.close()


MOVERS = ("raw", "tcp", "tcp-64k")


def start_store(stack: ExitStack, live: int) -> str:
    """A master and one holder with room for twice `live` bytes, stopped when `stack`
    closes; the master's address."""
    scratch = stack.enter_context(tempfile.TemporaryDirectory())
    master, holder = start_mooncake(Path(scratch), max(64 << 20, -(-2 * live >> 20) << 20))
    stack.callback(master.stop)
    stack.callback(holder.stop)
    return master.address


def measure(args: argparse.Namespace, movers: dict, sizes: list[int]) -> list[dict]:
    """Per (mover, callers, size): each repetition's put and get seconds, after one to warm
    up."""
    times: dict[tuple[str, int, int], list[tuple[float, float]]] = {}
    for rep in range(args.reps + 1):
        for name, mover in movers.items():
            for callers in args.in_flight:
                for size in sizes:
                    took = mover.run(callers, size)
                    if rep > 0:
                        times.setdefault((name, callers, size), []).append(took)
    rows = []
    for name, callers in ((name, callers) for name in movers for callers in args.in_flight):
        page = times[(name, callers, args.page_bytes)]
        for size in sizes:
            mine = times[(name, callers, size)]
            calls = callers * args.batches
            row = {"mover": name, "in_flight": callers, "object_bytes": size}
            for j, op in enumerate(("put", "get")):
                median_s = statistics.median(t[j] for t in mine)
                row[f"{op}_us_per_call"] = sig(median_s / args.batches * 1e6)
                row[f"{op}_gbps"] = sig(calls * args.batch * size / median_s / 1e9)
                row[f"{op}_time_vs_page"] = sig(
                    statistics.median(m[j] / p[j] for m, p in zip(mine, page, strict=True))
                )
            rows.append(row)
    return rows


def print_table(rows: list[dict], page: int) -> None:
    framed = page + header_size(LAYOUT)
    print(f"\n{'mover':>7} {'callers':>7} {'object B':>9}   {'put us':>7} {'GB/s':>6} "
          f"{'x page':>6}   {'get us':>7} {'GB/s':>6} {'x page':>6}")  # fmt: skip
    print("-" * 74)
    for r in rows:
        note = "  (a framed page)" if r["object_bytes"] == framed else ""
        note = "  (the page)" if r["object_bytes"] == page else note
        print(
            f"{r['mover']:>7} {r['in_flight']:>7} {r['object_bytes']:>9}   "
            f"{r['put_us_per_call']:>7.0f} "
            f"{r['put_gbps']:>6.2f} {r['put_time_vs_page']:>6.2f}   {r['get_us_per_call']:>7.0f} "
            f"{r['get_gbps']:>6.2f} {r['get_time_vs_page']:>6.2f}{note}"
        )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--page-bytes", type=int, default=65536)
    p.add_argument(
        "--sizes", help="object sizes in bytes, comma-separated (default: around the page)"
    )
    p.add_argument("--in-flight", help="callers at once, comma-separated (default 1,4)")
    p.add_argument(
        "--movers", default=",".join(MOVERS),
        help="raw (the Mooncake client), tcp and tcp-64k (plain loopback TCP, whole or in "
        "64 KiB operations), comma-separated (default all three)",
    )  # fmt: skip
    p.add_argument("--batch", type=int, default=32, help="objects a call")
    p.add_argument("--batches", type=int, default=8, help="calls a caller, each repetition")
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--smoke", action="store_true", help="tiny sizes, one repetition")
    args = p.parse_args(argv)
    if args.smoke:
        args.page_bytes, args.batch, args.batches, args.reps = 4096, 4, 2, 1
    args.in_flight = args.in_flight or ("1,2" if args.smoke else "1,4")
    args.in_flight = [int(k) for k in args.in_flight.split(",")]
    args.sizes = [int(s) for s in args.sizes.split(",")] if args.sizes else None
    if any(k < 1 for k in args.in_flight) or args.batch < 1 or args.batches < 1 or args.reps < 1:
        p.error("--in-flight, --batch, --batches and --reps take positive numbers")
    if args.sizes and any(s < 1 for s in args.sizes):
        p.error("--sizes takes positive byte counts")
    args.movers = args.movers.split(",")
    unknown = sorted(set(args.movers) - set(MOVERS))
    if unknown or not args.movers:
        p.error(f"--movers takes {', '.join(MOVERS)}, not {', '.join(unknown) or 'nothing'}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    sizes = args.sizes or default_sizes(args.page_bytes)
    if args.page_bytes not in sizes:
        sizes = [args.page_bytes, *sizes]  # (every ratio is to the page's time)
    callers = max(args.in_flight)
    shape = (callers, args.batch, args.batches, max(sizes))
    with ExitStack() as stack:
        movers = {}
        for name in dict.fromkeys(args.movers):
            if name == "raw":
                address = start_store(stack, callers * args.batches * args.batch * max(sizes))
                movers[name] = RawBatches(address, *shape)
            else:
                movers[name] = LoopbackBatches(*shape, ASIO_OP_BYTES if name == "tcp-64k" else None)
            stack.callback(movers[name].close)
        rows = measure(args, movers, sizes)
    for row in rows:
        emit({"bench": "mooncake_sizes", "page_bytes": args.page_bytes, "batch": args.batch,
              "reps": args.reps, **row, "device": device_name()})  # fmt: skip
    print_table(rows, args.page_bytes)


if __name__ == "__main__":
    main()
