"""Benchmark: SGLang's v2 storage path through hicache's file:// against SGLang's own `file`
backend, on the same pages of SGLang's real host pools.

Claim (issues 19, 36): on the same directory and the same host pool, hicache's SGLang backend
(`engine_integration.sglang.storage`, URL file://) reads and writes the pages of every host
layout, MHA and MLA, at >= 1.0x the rate of SGLang's built-in `HiCacheFile`, with every page
verified by hicache's object checks (SGLang's backend checks nothing).

Both sides get the calls SGLang's hybrid cache controller makes for a pool registered through
`register_mem_host_pool_v2`: `batch_set_v2([PoolTransfer("kv", host_indices, keys)])` and
`batch_get_v2(...)`. HiCacheFile implements them page by page through flat pages
(`get_data_page` / `get_dummy_flat_data_page` + `set_from_flat_data_page`); hicache moves the
pool's own bytes (no staging copy).

Cases: every host layout (page_first, layer_first, page_first_direct) of a Llama-3.1-8B-like
MHA pool (32 layers, 8 KV heads of 128, bf16) and a DeepSeek-V3-like MLA pool (61 layers,
kv_lora_rank 512 + rope 64, bf16), at page sizes 16 and 64, batches of `--batch-pages` pages.
The pools are SGLang's real `MHATokenToKVPoolHost` / `MLATokenToKVPoolHost`, built on the CPU
(tests/support/sglang_cpu.py). Every repetition writes new keys, sides interleaved, after a
warm-up; medians are printed, of the rate (wall clock) and of the CPU time per GB (every
thread of the process, user and system: what each side costs, whatever the neighbours on a
shared machine do; `cpu ratio` > 1 where hicache's is lower). After each timed read, the
pages read are compared with the pages written, bit for bit, outside the timing:
`pages_verified` counts them. One JSON line per case, then a table.

    python benchmarks/bench_sglang_storage.py                  # every case
    python benchmarks/bench_sglang_storage.py --dir /mnt/kv    # the directory to compare on
    python benchmarks/bench_sglang_storage.py --smoke          # tiny, for the test suite
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
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from tests.support import sglang_cpu  # noqa: E402

sglang_cpu.install()  # SGLang's real host pools on a CPU-only machine (see its docstring)

from sglang.srt.mem_cache.hicache_storage import (  # noqa: E402
    HiCacheFile,
    HiCacheStorageConfig,
    PoolName,
    PoolTransfer,
)
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402

from benchmarks.common import device_name, emit, met_target  # noqa: E402

MODELS = {
    "mha_llama_8b": dict(attention="mha", layer_num=32, head_num=8, head_dim=128),
    "mla_deepseek_v3": dict(attention="mla", layer_num=61, kv_lora_rank=512, qk_rope_head_dim=64),
}
LAYOUTS = ("page_first", "layer_first", "page_first_direct")
TARGET_RATIO = 1.0


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--page-sizes", default="16,64", help="tokens per page, comma-separated")
    parser.add_argument("--batch-mib", type=int, default=128, help="bytes per batch, about")
    parser.add_argument("--reps", type=int, default=2)
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
        args.page_sizes, args.batch_mib, args.reps = "4", 0, 1
    return args


def storage_config(mla: bool, extra: dict) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=mla, enable_storage_metrics=False, is_page_first_layout=True,
        model_name="bench/model", extra_config=extra,
    )  # fmt: skip


class Case(NamedTuple):
    model: str
    layout: str
    page_size: int

    @property
    def name(self) -> str:
        return f"{self.model}/{self.layout}/p{self.page_size}"


def build_pool(case: Case, args: argparse.Namespace):
    """Room for two batches: the pages written (first half) and the pages read (second),
    the first filled with random bits page by page through the pool's own flat pages."""
    dims = dict(MODELS[case.model])
    if args.smoke:
        dims["layer_num"] = 2
    attention = dims.pop("attention")
    if attention == "mha":  # K and V: layers x tokens x heads x head_dim, bf16
        page_bytes = (
            2 * dims["layer_num"] * case.page_size * dims["head_num"] * dims["head_dim"] * 2
        )
    else:  # one latent row of kv_lora_rank + rope per layer and token, bf16
        width = dims["kv_lora_rank"] + dims["qk_rope_head_dim"]
        page_bytes = dims["layer_num"] * case.page_size * width * 2
    batch_pages = max(4, (args.batch_mib << 20) // page_bytes)
    # SGLang 0.5.23's MLA page_first_direct pool indexes its page axis by layer while it
    # builds per-layer views: it needs at least as many pages as layers.
    num_pages = max(2 * batch_pages, dims["layer_num"] + 1)
    pool = sglang_cpu.host_pool(
        attention, case.layout, page_size=case.page_size, num_pages=num_pages, **dims
    )  # fmt: skip
    if _page_bytes(pool) != page_bytes:
        raise RuntimeError(f"{case.name}: a page is {_page_bytes(pool)} bytes, not {page_bytes}")
    generator = torch.Generator().manual_seed(args.seed)
    for page in range(batch_pages):
        dummy = pool.get_dummy_flat_data_page()
        pool.set_from_flat_data_page(
            page * case.page_size, torch.randn(dummy.shape, generator=generator).to(dummy.dtype)
        )
    return pool, batch_pages


def _page_bytes(pool) -> int:
    page = pool.get_dummy_flat_data_page()
    return page.numel() * page.element_size()


class Sides:
    """The two backends on one pool, each given SGLang's v2 calls for the KV pool."""

    def __init__(self, pool, mla: bool, root: Path) -> None:
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
        sglang_extra = {"file_storage_path": str(root / "sglang")}
        self.sglang = StorageBackendFactory.create_backend(
            "file", storage_config(mla, sglang_extra), pool
        )
        assert isinstance(self.sglang, HiCacheFile)
        for backend in (self.hicache, self.sglang):
            backend.register_mem_pool_host(pool)
            backend.register_mem_host_pool_v2(pool, PoolName.KV)

    def call(self, side: str, op: str, keys: list[str], host_indices: torch.Tensor) -> bool:
        backend = self.hicache if side == "h" else self.sglang
        transfers = [PoolTransfer(name=PoolName.KV, host_indices=host_indices, keys=keys)]
        call = backend.batch_set_v2 if op == "set" else backend.batch_get_v2
        return all(call(transfers)[PoolName.KV])

    def close(self) -> None:
        self.hicache.close()


def timed(call: Callable[[], bool]) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this whole process: every thread, user and system) of
    one call. On a shared machine the wall clock also measures the neighbours; the CPU time
    is what the call itself cost."""
    start, start_cpu = time.perf_counter(), time.process_time()
    ok = call()
    elapsed, cpu = time.perf_counter() - start, time.process_time() - start_cpu
    if not ok:
        raise RuntimeError("a benchmark call failed (a page was not stored or not read)")
    return elapsed, cpu


def run_case(case: Case, args: argparse.Namespace, root: Path) -> dict:
    """One case in a folder of its own, removed when the case ends: the 0.5 GiB a case
    writes would otherwise stay dirty in the page cache, and the kernel throttles writers
    (both sides, unevenly) once dirty pages pile up across cases."""
    folder = root / case.name.replace("/", "-")
    try:
        return _run_case(case, args, folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _run_case(case: Case, args: argparse.Namespace, folder: Path) -> dict:
    pool, n = build_pool(case, args)
    attention = MODELS[case.model]["attention"]
    sides = Sides(pool, attention == "mla", folder)
    page = case.page_size
    written = torch.arange(0, n * page)  # the first half of the pool
    read = torch.arange(n * page, 2 * n * page)  # the second half
    expected = [pool.get_data_page(i * page, flat=True).clone() for i in range(n)]
    poison = torch.zeros_like(pool.get_dummy_flat_data_page())
    times: dict[str, list[float]] = {op: [] for op in ("h_set", "h_get", "s_set", "s_get")}
    cpu: dict[str, list[float]] = {op: [] for op in times}
    verified = 0
    for rep in range(args.reps + 1):  # rep 0 warms up
        for side in ("s", "h") if rep % 2 else ("h", "s"):
            keys = [f"{case.name.replace('/', '-')}-{rep}-{side}-{i:04d}" for i in range(n)]
            set_s = timed(lambda side=side, keys=keys: sides.call(side, "set", keys, written))
            for i in range(n):  # poison the target pages
                pool.set_from_flat_data_page((n + i) * page, poison)
            get_s = timed(lambda side=side, keys=keys: sides.call(side, "get", keys, read))
            for i in range(n):
                if not torch.equal(pool.get_data_page((n + i) * page, flat=True), expected[i]):
                    raise RuntimeError(f"{case.name}: page {i} read back wrong ({side})")
            if rep:
                for op, (wall_s, cpu_s) in (("set", set_s), ("get", get_s)):
                    times[f"{side}_{op}"].append(wall_s)
                    cpu[f"{side}_{op}"].append(cpu_s)
                verified += n if side == "h" else 0
    sides.close()
    page_bytes = _page_bytes(pool)
    batch_gb = n * page_bytes / 1e9
    rate = {op: batch_gb / statistics.median(ts) for op, ts in times.items()}
    get_ratio, set_ratio = rate["h_get"] / rate["s_get"], rate["h_set"] / rate["s_set"]
    cpu_s_per_gb = {op: max(statistics.median(ts), 1e-9) / batch_gb for op, ts in cpu.items()}
    return {
        "bench": "sglang_storage",
        "case": case.name,
        "model": case.model,
        "layout": case.layout,
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
        "get_ratio": round(get_ratio, 3),
        "hicache_set_gbps": round(rate["h_set"], 3),
        "sglang_file_set_gbps": round(rate["s_set"], 3),
        "set_ratio": round(set_ratio, 3),
        # CPU seconds per GB moved (all threads): SGLang's / hicache's, > 1 where cheaper
        **{
            f"{side}_{op}_cpu_s_per_gb": round(cpu_s_per_gb[f"{key}_{op}"], 4)
            for side, key in (("hicache", "h"), ("sglang_file", "s"))
            for op in ("get", "set")
        },
        "get_cpu_ratio": round(cpu_s_per_gb["s_get"] / cpu_s_per_gb["h_get"], 3),
        "set_cpu_ratio": round(cpu_s_per_gb["s_set"] / cpu_s_per_gb["h_set"], 3),
        "target_ratio": TARGET_RATIO,
        "meets_target": min(get_ratio, set_ratio) >= TARGET_RATIO,
    }


def main() -> int:
    args = parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args.torch_threads)
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="bench-sglang-"))
    work = root / f"bench-sglang-storage-{time.time_ns()}"
    cases = [
        Case(model, layout, int(page_size))
        for model in args.models.split(",")
        for layout in args.layouts.split(",")
        for page_size in args.page_sizes.split(",")
    ]
    records = []
    try:
        for case in cases:
            if case.model not in MODELS or case.layout not in LAYOUTS:
                raise SystemExit(f"unknown model or layout in case {case.name}")
            record = run_case(case, args, work)
            emit(record)
            records.append(record)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    print(
        f"\n{'case':<42}{'op':<5}{'hicache GB/s':>14}{'sglang file GB/s':>18}{'ratio':>8}"
        f"{'cpu ratio':>11}"
    )
    for r in records:
        for op in ("get", "set"):
            print(
                f"{r['case']:<42}{op:<5}{r[f'hicache_{op}_gbps']:>14.3f}"
                f"{r[f'sglang_file_{op}_gbps']:>18.3f}{r[f'{op}_ratio']:>8.2f}"
                f"{r[f'{op}_cpu_ratio']:>11.2f}"
            )
    if args.smoke:  # too small to judge
        return 0
    met = [
        met_target(f"{r['case']}: hicache / sglang file {op}", r[f"{op}_ratio"], TARGET_RATIO)
        for r in records
        for op in ("get", "set")
    ]
    return 0 if all(met) else 1


if __name__ == "__main__":
    sys.exit(main())
