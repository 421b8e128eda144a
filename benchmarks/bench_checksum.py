"""Benchmark: the page checksum's throughput on one thread, the C extension's XXH3 (the xxHash
library's, `pageio.xxh3_64`, with each vector unit this CPU has) against the `xxhash`
package's (`xxh3_64_intdigest`, the baseline: where Python computes a checksum).

Claim (issue 34): the checksum comes from the xxHash library, not code of our own, and is no
slower than the hand-written XXH3 it replaced. `--compare-build` loads another build of the
extension (for instance the one before the change, copied aside) and times it in the same
run, in turns with the others, so that the before/after ratio shares the machine's noise.

Each case hashes the same page over and over (it stays in the core's cache: this is the
hash's own rate, not memory's) for `--seconds` per round, best of `--rounds`. Prints one JSON
line per page size, then a table of GB/s.

    python benchmarks/bench_checksum.py
    python benchmarks/bench_checksum.py --compare-build old/_pageio.cpython-311-x86_64-linux-gnu.so
    python benchmarks/bench_checksum.py --smoke               # tiny, for the test suite
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import xxhash  # noqa: E402

from benchmarks.common import device_name, emit  # noqa: E402
from storage_backends.options import parse_size  # noqa: E402

Hash = Callable[..., int]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--page-sizes", default="4KiB,64KiB,256KiB,1792KiB")
    parser.add_argument("--seconds", type=float, default=0.3, help="per case and round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--compare-build", default="", help="another build of _pageio (.so)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, one short round")
    args = parser.parse_args()
    if args.smoke:
        args.page_sizes, args.seconds, args.rounds = "4KiB,64KiB", 0.01, 1
    return args


def load_build(path: str):
    """An extension build loaded from `path` under its own name (not the project's)."""
    spec = importlib.util.spec_from_file_location("_pageio", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"--compare-build {path!r}: not a loadable extension")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def cases(compare: str) -> dict[str, tuple[Hash, Callable[[], None]]]:
    """name -> (hash, what to call first to select it)."""

    def nothing() -> None:
        return None

    found: dict[str, tuple[Hash, Callable[[], None]]] = {
        "xxhash_package": (xxhash.xxh3_64_intdigest, nothing)
    }
    try:
        from storage_backends import _pageio
    except ImportError:
        print("bench_checksum: the C extension is not built; timing the package alone")
        return found
    for unit in ("baseline", "avx2", "avx512"):
        try:
            _pageio.simd(unit)
        except ValueError:
            continue
        found[f"pageio_{unit}"] = (_pageio.xxh3_64, lambda unit=unit: _pageio.simd(unit))
    if compare:
        other = load_build(compare)
        found["compare_build"] = (other.xxh3_64, nothing)
    return found


def rate_gb_s(fn: Hash, page: bytes, seconds: float) -> float:
    """Bytes hashed per second (GB/s) over about `seconds` of calls."""
    calls = max(1, int(2e9 * seconds) // len(page))  # ~2 GB/s at least: one timing per round
    begin = time.perf_counter()
    for _ in range(calls):
        fn(page)
    return calls * len(page) / (time.perf_counter() - begin) / 1e9


def compared(best: dict[str, float]) -> dict[str, dict[str, float]]:
    """Each case's rate as a share of the other build's, where one was given."""
    if "compare_build" not in best:
        return {}
    return {"vs_compare_build": {k: round(v / best["compare_build"], 3) for k, v in best.items()}}


def main() -> None:
    args = parse_args()
    found = cases(args.compare_build)
    sizes = [parse_size(s) for s in args.page_sizes.split(",")]
    table = []
    for size in sizes:
        page = os.urandom(size)
        want = xxhash.xxh3_64_intdigest(page)
        best = dict.fromkeys(found, 0.0)
        for _ in range(args.rounds):
            for name, (fn, select) in found.items():
                select()
                if fn(page) != want:
                    raise SystemExit(f"{name}: a different XXH3 of a {size}-byte page")
                best[name] = max(best[name], rate_gb_s(fn, page, args.seconds))
        base = best["xxhash_package"]
        emit(
            {
                "bench": "checksum",
                "device": device_name(),
                "page_bytes": size,
                "gb_s": {k: round(v, 2) for k, v in best.items()},
                "vs_xxhash_package": {k: round(v / base, 3) for k, v in best.items()},
                **compared(best),
            }
        )
        table.append((size, best))
    names = list(found)
    print("page_bytes " + " ".join(f"{n:>15}" for n in names))
    for size, best in table:
        print(f"{size:>10} " + " ".join(f"{best[n]:>15.1f}" for n in names))


if __name__ == "__main__":
    main()
