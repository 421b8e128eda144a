"""Benchmark: moving KV pages between the device pool (L1) and the pinned host pool (L2).

Claim (issue 3): `load_layer` (every layer in turn) and `backup` move random, non-contiguous
pages at >= 90 % of a contiguous pinned `copy_` of the same bytes for a Llama-3.1-8B-like GQA
layout at page size 64, and >= 80 % for a DeepSeek-V3-like MLA layout at page size 16, from at
most 16 SMs; and both beat the baseline most engines use, one `copy_` (cudaMemcpyAsync) per
(page, layer) chunk, at page size 16.

For each case and direction it measures, in the same run: the kernel, the ceiling (one
contiguous pinned `copy_` of the same number of bytes, same direction) and the per-chunk
baseline (views built before timing, so the loop issues bare copies). Times are medians of
CUDA-event timings after a warm-up. Prints one JSON line per (case, op), then a table.

    python benchmarks/bench_transfer.py                 # the four cases of the claim
    python benchmarks/bench_transfer.py --sweep         # also other launch shapes
    python benchmarks/bench_transfer.py --smoke         # tiny, on the CPU (interpreter)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
if "--smoke" in sys.argv:  # the Triton interpreter must be chosen before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import triton  # noqa: E402

from benchmarks.common import sig  # noqa: E402
from tiers.device_pool import DevicePool  # noqa: E402
from tiers.host_pool import HostPool  # noqa: E402
from tiers.kernels import DEFAULT_COPY_CONFIG, CopyConfig, backup, load_layer  # noqa: E402
from tiers.layout import KVLayout  # noqa: E402


@dataclass(frozen=True)
class Case:
    name: str
    descriptor: str
    num_pages: int


CASES = [
    Case("gqa8b-p16", "mha;layers=32;page=16;kv_heads=8;head_dim=128;dtype=bfloat16", 4000),
    Case("gqa8b-p64", "mha;layers=32;page=64;kv_heads=8;head_dim=128;dtype=bfloat16", 2000),
    Case("mla-dsv3-p16", "mla;layers=61;page=16;kv_lora_rank=512;rope_dim=64;dtype=bfloat16", 8000),
    Case("mla-dsv3-p64", "mla;layers=61;page=64;kv_lora_rank=512;rope_dim=64;dtype=bfloat16", 2000),
]
SMOKE_CASES = [
    Case("smoke-mha", "mha;layers=3;page=4;kv_heads=2;head_dim=8;dtype=bfloat16", 6),
    Case("smoke-mla", "mla;layers=2;page=2;kv_lora_rank=12;rope_dim=4;dtype=float16", 6),
]
SWEEP = [  # CopyConfig(max_programs, num_warps, tile_bytes)
    (16, 4, 16384),
    (16, 16, 65536),
    (16, 32, 131072),
    (8, 16, 65536),
]


def main() -> None:
    args = parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    cases = SMOKE_CASES if args.smoke else [c for c in CASES if c.name in args.cases]
    meta = run_metadata(device, args.seed)
    rows, sweep_rows = [], []
    for case in cases:
        num_pages = args.num_pages or case.num_pages
        configs = [DEFAULT_COPY_CONFIG]
        if args.sweep:
            configs += [CopyConfig(*shape) for shape in SWEEP]
        for result in bench_case(case, num_pages, configs, device, args):
            print(json.dumps({**meta, **result}), flush=True)
            (sweep_rows if result["sweep"] else rows).append(result)
    if sweep_rows:
        print_sweep(rows + sweep_rows)
    print_table(rows, meta)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="+", default=[c.name for c in CASES])
    parser.add_argument("--num-pages", type=int, default=0, help="override each case's count")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--baseline-pages", type=int, default=256, help="pages per baseline rep")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sweep", action="store_true", help="also time other launch shapes")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU")
    return parser.parse_args()


def run_metadata(device, seed: int) -> dict:
    try:
        rev = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
    except OSError:
        rev = ""
    meta = {
        "bench": "transfer",
        "git_rev": os.environ.get("HICACHE_GIT_REV") or rev or "unknown",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "seed": seed,
    }
    if device.type == "cuda":
        meta["device_sms"] = torch.cuda.get_device_properties(device).multi_processor_count
    return meta


def bench_case(case: Case, num_pages: int, configs, device, args):
    """Yield one result dict per (op, config); the first config is the library default."""
    layout = KVLayout.from_descriptor(case.descriptor)
    pool_pages = num_pages + max(num_pages // 8, 4)  # spare pages: the ids leave gaps
    device_pool = DevicePool(layout, pool_pages, device)
    host_pool = HostPool(layout, pool_pages, pin=device.type == "cuda")
    fill_random_(device_pool.kv, args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    dev_ids = torch.randperm(pool_pages, generator=gen)[:num_pages]
    host_ids = torch.randperm(pool_pages, generator=gen)[:num_pages]
    ctx = Transfers(device_pool, host_pool, dev_ids, host_ids, device, args.reps)

    num_bytes = num_pages * layout.bytes_per_page
    ceiling = ctx.contiguous_copy_samples(num_bytes)
    baseline_pages = min(num_pages, args.baseline_pages)
    baseline_ms = ctx.per_chunk_copy_ms(baseline_pages)
    measured = []
    for index, config in enumerate(configs):
        for op in ("load_layer", "backup"):
            ms, plan = ctx.kernel_ms(op, config)
            measured.append((index, config, op, ms, plan, ctx.verify()))
    # The ceiling again after the kernels: its median over both passes absorbs drift.
    for op, samples in ctx.contiguous_copy_samples(num_bytes).items():
        ceiling[op] += samples
    for index, config, op, ms, plan, verified in measured:
        gbps = num_bytes / ms / 1e6
        ceiling_gbps = num_bytes / statistics.median(ceiling[op]) / 1e6
        baseline_gbps = baseline_pages * layout.bytes_per_page / baseline_ms[op] / 1e6
        yield {
            "case": case.name,
            "op": op,
            "sweep": index > 0,
            "verified": verified,
            "layout": layout.descriptor(),
            "num_pages": num_pages,
            "bytes": num_bytes,
            "chunk_bytes": layout.bytes_per_page_per_layer,
            "ms": sig(ms),
            "gbps": sig(gbps),
            "ceiling_gbps": sig(ceiling_gbps),
            "ratio_to_ceiling": sig(gbps / ceiling_gbps),
            "baseline_gbps": sig(baseline_gbps),
            "baseline_pages": baseline_pages,
            "ratio_to_baseline": sig(gbps / baseline_gbps),
            "num_programs": plan.num_programs,
            "max_sms": plan.num_programs,
            "config": asdict(config),
            "plan": asdict(plan),
        }
    host_pool.close()
    del ctx, device_pool, host_pool
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


class Transfers:
    """The timed operations of one case, over one pair of pools and one id mapping."""

    def __init__(self, device_pool, host_pool, dev_ids, host_ids, device, reps):
        self.dev_kv, self.host_kv = device_pool.kv, host_pool.kv
        self.dev_list, self.host_list = dev_ids.tolist(), host_ids.tolist()
        self.dev_ids, self.host_ids = dev_ids.to(device), host_ids.to(device)
        self.device, self.reps = device, reps
        self.num_layers = self.dev_kv.shape[0]

    def contiguous_copy_samples(self, num_bytes: int) -> dict:
        """The ceiling: one contiguous pinned copy_ of `num_bytes`, each direction (samples)."""
        dev = self.dev_kv.view(-1).view(torch.uint8)[:num_bytes]
        host = self.host_kv.view(-1).view(torch.uint8)[:num_bytes]
        return {
            "backup": self.time_samples(lambda: host.copy_(dev, non_blocking=True)),
            "load_layer": self.time_samples(lambda: dev.copy_(host, non_blocking=True)),
        }

    def per_chunk_copy_ms(self, num_pages: int) -> dict:
        """One copy_ per (page, layer) chunk, the views made before timing."""
        layers = range(self.num_layers)
        pairs = zip(self.dev_list[:num_pages], self.host_list[:num_pages], strict=True)
        chunks = [(self.dev_kv[i, d], self.host_kv[h, i]) for d, h in pairs for i in layers]

        def backup():
            for dev, host in chunks:
                host.copy_(dev, non_blocking=True)

        def load():
            for dev, host in chunks:
                dev.copy_(host, non_blocking=True)

        reps = max(2, self.reps // 2)
        return {"backup": self.time_ms(backup, reps), "load_layer": self.time_ms(load, reps)}

    def kernel_ms(self, op: str, config):
        plans = []

        def run_backup():
            plans.append(
                backup(self.dev_kv, self.host_kv, self.dev_ids, self.host_ids, config=config,
                       check_ids=False)
            )  # fmt: skip

        def run_load():
            for layer in range(self.num_layers):
                plans.append(
                    load_layer(self.host_kv, self.dev_kv, layer, self.host_ids, self.dev_ids,
                               config=config, check_ids=False)
                )  # fmt: skip

        ms = self.time_ms(run_backup if op == "backup" else run_load)
        return ms, max(plans, key=lambda plan: plan.num_programs)

    def verify(self) -> bool:
        """Spot-check that host and device hold the same bytes for a few mapped pages."""
        step = max(1, len(self.dev_list) // 4)
        for d, h in list(zip(self.dev_list, self.host_list, strict=True))[::step]:
            dev = self.dev_kv[:, d].cpu().contiguous().view(-1).view(torch.uint8)
            host = self.host_kv[h].contiguous().view(-1).view(torch.uint8)
            if not bool((dev == host).all()):
                return False
        return True

    def time_ms(self, fn, reps: int | None = None) -> float:
        return statistics.median(self.time_samples(fn, reps))

    def time_samples(self, fn, reps: int | None = None) -> list[float]:
        reps = reps or self.reps
        fn()  # warm-up: compilation, first touch
        times = []
        for _ in range(reps):
            if self.device.type == "cuda":
                start, end = (
                    torch.cuda.Event(enable_timing=True),
                    torch.cuda.Event(enable_timing=True),
                )
                torch.cuda.synchronize()
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                begin = time.perf_counter()
                fn()
                times.append((time.perf_counter() - begin) * 1e3)
        return times


def fill_random_(kv, seed: int) -> None:
    gen = torch.Generator(device=kv.device).manual_seed(seed)
    kv.view(-1).view(torch.int16).random_(generator=gen)


def print_table(rows: list[dict], meta: dict) -> None:
    print(
        f"\n{meta['device']}  rev {meta['git_rev']}  torch {meta['torch']}  triton {meta['triton']}"
    )
    header = (
        f"{'case':<14}{'op':<11}{'pages':>6}{'GB/s':>8}{'ceil GB/s':>10}{'% ceil':>8}"
        f"{'chunk GB/s':>11}{'x chunk':>8}{'SMs':>5}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['case']:<14}{r['op']:<11}{r['num_pages']:>6}{r['gbps']:>8.1f}"
            f"{r['ceiling_gbps']:>10.1f}{100 * r['ratio_to_ceiling']:>7.1f}%"
            f"{r['baseline_gbps']:>11.1f}{r['ratio_to_baseline']:>8.1f}{r['max_sms']:>5}"
            f"{'' if r['verified'] else '  WRONG DATA'}"
        )


def print_sweep(rows: list[dict]) -> None:
    print("\nlaunch shapes (programs x warps, tile): GB/s and % of ceiling")
    for r in rows:
        c = r["config"]
        shape = f"{c['max_programs']}x{c['num_warps']} {c['tile_bytes'] // 1024}K"
        print(
            f"{r['case']:<14}{r['op']:<11}{shape:<20}{r['gbps']:>8.1f}"
            f"{100 * r['ratio_to_ceiling']:>7.1f}%{'' if r['sweep'] else '  (default)'}"
            f"{'' if r['verified'] else '  WRONG DATA'}"
        )


if __name__ == "__main__":
    main()
