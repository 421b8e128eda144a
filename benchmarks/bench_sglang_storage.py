"""Benchmark: SGLang's L3 through hicache's file:// against SGLang's own `file` backend.

Claim (issue 19): on the same directory and the same host pool, `batch_get_v1` through
hicache's SGLang backend (`engine_integration.sglang.storage`, URL file://) reads pages at
>= 1.5x the rate of SGLang's built-in `HiCacheFile`, with every page verified by hicache's
object checks (SGLang's backend checks nothing). Writes (`batch_set_v1`) are printed too.

Both sides run the call sequence SGLang's `cache_controller` runs for them, in one process,
on one host pool (the layout SGLang uses by default, page_first):

- hicache (`interface_v1: 1`): `batch_set_v1(keys, host_indices)` / `batch_get_v1(...)`,
  straight out of and into the pool's pages;
- SGLang `file` (no zero-copy interface): `_generic_page_set` - `get_data_page(i)` per page,
  then `batch_set(keys, pages)` - and `_generic_page_get` - `batch_get(keys, dummy pages)`,
  then `set_from_flat_data_page` per page.

Cases: a Llama-3.1-8B-like MHA pool (32 layers, 8 KV heads of 128, bf16) and a
DeepSeek-V3-like MLA pool (61 layers, 576-wide latent, bf16), batches of 128 pages
(SGLang's STORAGE_BATCH_SIZE). Every repetition writes new keys (both backends skip or
replace pages already there), backends interleaved, after a warm-up; medians are printed.
Each side stores under its own folder of `--dir`. After each timed read, the pages read are
compared with the pages written, bit for bit, outside the timing: `pages_verified` counts
them. One JSON line per case, then a table.

    python benchmarks/bench_sglang_storage.py                 # both cases
    python benchmarks/bench_sglang_storage.py --dir /mnt/kv   # the directory to compare on
    python benchmarks/bench_sglang_storage.py --smoke         # tiny, for the test suite
"""

from __future__ import annotations

import argparse
import logging
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import (  # noqa: E402
    STORAGE_BATCH_SIZE,
    HiCacheFile,
    HiCacheStorageConfig,
)
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402

from benchmarks.common import device_name, emit, met_target  # noqa: E402
from tests.support.sglang_pools import HostPool  # noqa: E402

CASES = {
    "mha_llama_8b": dict(attention="mha", layer_num=32, head_num=8, head_dim=128),
    "mla_deepseek_v3": dict(attention="mla", layer_num=61, kv_cache_dim=576),
}
TARGET_GET_RATIO = 1.5


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--page-size", type=int, default=32, help="tokens per page")
    parser.add_argument("--batch-pages", type=int, default=STORAGE_BATCH_SIZE)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dir", default=None, help="directory both backends store under")
    parser.add_argument(
        "--torch-threads", type=int, default=1,
        help="torch intra-op threads (1: SGLang's page copies are not slowed by OpenMP "
        "threads spinning against other work on a busy machine)",
    )  # fmt: skip
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, one rep")
    args = parser.parse_args()
    if args.smoke:
        args.page_size, args.batch_pages, args.reps = 4, 8, 1
    return args


def storage_config(mla: bool, extra: dict) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=mla, enable_storage_metrics=False, is_page_first_layout=True,
        model_name="bench/model", extra_config=extra,
    )  # fmt: skip


def build_pool(case: dict, args: argparse.Namespace) -> HostPool:
    """Room for two batches: the pages written (first half) and the pages read (second)."""
    dims = dict(case)
    if args.smoke:
        dims["layer_num"] = 2
    pool = HostPool(
        dims.pop("attention"), "page_first", page_size=args.page_size,
        num_pages=2 * args.batch_pages, **dims,
    )  # fmt: skip
    generator = torch.Generator().manual_seed(args.seed)
    source = token_span(pool, case["attention"], 0, args.batch_pages * args.page_size)
    source.copy_(torch.randn(source.shape, generator=generator))
    return pool


def token_span(pool: HostPool, attention: str, start: int, num_tokens: int) -> torch.Tensor:
    """The KV of `num_tokens` tokens from `start` (page_first: tokens are axis 1 for MHA,
    after K/V, and axis 0 for MLA)."""
    return pool.kv_buffer.narrow(1 if attention == "mha" else 0, start, num_tokens)


class Sides:
    """The two backends on one pool, and the sequence SGLang runs for each."""

    def __init__(self, pool: HostPool, mla: bool, root: Path, page_size: int) -> None:
        self.pool = pool
        self.page_size = page_size
        hicache_extra = {
            "backend_name": "hicache",
            "module_path": "engine_integration.sglang.storage",
            "class_name": "HiCacheSGLangStorage",
            "interface_v1": 1,
            "url": f"file://{root / 'hicache'}?capacity=64GiB&timeout=120s",
        }
        self.hicache = StorageBackendFactory.create_backend(
            "dynamic", storage_config(mla, hicache_extra), pool
        )
        self.hicache.register_mem_pool_host(pool)
        sglang_extra = {"file_storage_path": str(root / "sglang")}
        self.sglang = StorageBackendFactory.create_backend(
            "file", storage_config(mla, sglang_extra), pool
        )
        assert isinstance(self.sglang, HiCacheFile)

    def hicache_set(self, keys: list[str], host_indices: torch.Tensor) -> bool:
        return all(self.hicache.batch_set_v1(keys, host_indices))

    def hicache_get(self, keys: list[str], host_indices: torch.Tensor) -> bool:
        return all(self.hicache.batch_get_v1(keys, host_indices))

    def sglang_set(self, keys: list[str], host_indices: torch.Tensor) -> bool:
        data = [
            self.pool.get_data_page(int(host_indices[i * self.page_size])) for i in range(len(keys))
        ]
        return self.sglang.batch_set(keys, data)

    def sglang_get(self, keys: list[str], host_indices: torch.Tensor) -> bool:
        dummy = [self.pool.get_dummy_flat_data_page() for _ in keys]
        pages = self.sglang.batch_get(keys, dummy)
        for i, page in enumerate(pages):
            if page is None:
                return False
            self.pool.set_from_flat_data_page(int(host_indices[i * self.page_size]), page)
        return True

    def close(self) -> None:
        self.hicache.close()


def timed(call: Callable[[], bool]) -> float:
    start = time.perf_counter()
    ok = call()
    elapsed = time.perf_counter() - start
    if not ok:
        raise RuntimeError("a benchmark call failed (a page was not stored or not read)")
    return elapsed


def run_case(name: str, case: dict, args: argparse.Namespace, root: Path) -> dict:
    pool = build_pool(case, args)
    sides = Sides(pool, case["attention"] == "mla", root / name, args.page_size)
    n, page = args.batch_pages, args.page_size
    written = torch.arange(0, n * page)  # the first half of the pool
    read = torch.arange(n * page, 2 * n * page)  # the second half
    expected = [pool.get_data_page(i * page).clone() for i in range(n)]
    page_bytes = expected[0].numel() * expected[0].element_size()
    times: dict[str, list[float]] = {op: [] for op in ("h_set", "h_get", "s_set", "s_get")}
    verified = 0
    for rep in range(args.reps + 1):  # rep 0 warms up
        for side in ("s", "h") if rep % 2 else ("h", "s"):
            keys = [f"{name}-{rep}-{side}-{i:04d}" for i in range(n)]
            set_call = sides.hicache_set if side == "h" else sides.sglang_set
            get_call = sides.hicache_get if side == "h" else sides.sglang_get
            set_s = timed(lambda set_call=set_call, keys=keys: set_call(keys, written))
            token_span(pool, case["attention"], n * page, n * page).zero_()  # poison the target
            get_s = timed(lambda get_call=get_call, keys=keys: get_call(keys, read))
            for i in range(n):
                if not torch.equal(pool.get_data_page((n + i) * page), expected[i]):
                    raise RuntimeError(f"{name}: page {i} read back wrong ({side})")
            if rep:
                times[f"{side}_set"].append(set_s)
                times[f"{side}_get"].append(get_s)
                verified += n if side == "h" else 0
    sides.close()
    batch_gb = n * page_bytes / 1e9
    rate = {op: batch_gb / statistics.median(ts) for op, ts in times.items()}
    return {
        "bench": "sglang_storage",
        "case": name,
        "device": device_name(),
        "page_tokens": page,
        "page_bytes": page_bytes,
        "batch_pages": n,
        "reps": args.reps,
        "torch_threads": torch.get_num_threads(),
        "pages": n * args.reps,
        "pages_verified": verified,
        "hicache_get_gbps": round(rate["h_get"], 3),
        "sglang_file_get_gbps": round(rate["s_get"], 3),
        "get_ratio": round(rate["h_get"] / rate["s_get"], 3),
        "hicache_set_gbps": round(rate["h_set"], 3),
        "sglang_file_set_gbps": round(rate["s_set"], 3),
        "set_ratio": round(rate["h_set"] / rate["s_set"], 3),
        "target_get_ratio": TARGET_GET_RATIO,
        "meets_target": rate["h_get"] / rate["s_get"] >= TARGET_GET_RATIO,
    }


def main() -> int:
    args = parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args.torch_threads)
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="bench-sglang-"))
    work = root / f"bench-sglang-storage-{time.time_ns()}"
    records = []
    try:
        for name in args.cases.split(","):
            record = run_case(name, CASES[name], args, work)
            emit(record)
            records.append(record)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    print(f"\n{'case':<18}{'op':<5}{'hicache GB/s':>14}{'sglang file GB/s':>18}{'ratio':>8}")
    for r in records:
        for op in ("get", "set"):
            print(
                f"{r['case']:<18}{op:<5}{r[f'hicache_{op}_gbps']:>14.3f}"
                f"{r[f'sglang_file_{op}_gbps']:>18.3f}{r[f'{op}_ratio']:>8.2f}"
            )
    met = [
        met_target(f"{r['case']}: hicache / sglang file get", r["get_ratio"], TARGET_GET_RATIO)
        for r in records
    ]
    return 0 if all(met) else 1


if __name__ == "__main__":
    sys.exit(main())
