"""Scattered page copies through `TransferEngine`: the copy engines against the Triton kernels.

For each geometry of the transfer claim, a load (every layer in turn) and a backup of random,
non-contiguous pages run through `TransferEngine` with kernel="copy_engine" (batched
`cuMemcpyBatchAsync`, no SMs) and kernel="triton" (16 SMs), next to the ceiling: one
contiguous pinned `copy_` of the same bytes in the same direction. Copies are checked byte
for byte. One JSON line per (case, op), then a table.

    python benchmarks/bench_copy_engine.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.common import cuda_median_ms, device_name, emit  # noqa: E402
from tiers.device_pool import DevicePool  # noqa: E402
from tiers.host_pool import HostPool  # noqa: E402
from tiers.layout import KVLayout  # noqa: E402
from tiers.transfer import TransferEngine  # noqa: E402

CASES = [
    ("gqa8b-p64", "mha;layers=32;page=64;kv_heads=8;head_dim=128;dtype=bfloat16", 1000),
    ("gqa8b-p16", "mha;layers=32;page=16;kv_heads=8;head_dim=128;dtype=bfloat16", 1000),
    ("mla-dsv3-p64", "mla;layers=61;page=64;kv_lora_rank=512;rope_dim=64;dtype=bfloat16", 1000),
    ("mla-dsv3-p16", "mla;layers=61;page=16;kv_lora_rank=512;rope_dim=64;dtype=bfloat16", 4000),
]


def run_case(name: str, descriptor: str, num_pages: int) -> list[dict]:
    layout = KVLayout.from_descriptor(descriptor)
    pool_pages = num_pages + num_pages // 4
    device_pool = DevicePool(layout, pool_pages, "cuda")
    host_pool = HostPool(layout, pool_pages)
    for page in range(0, pool_pages, 64):  # random data made on the GPU: quick to fill
        block = host_pool.kv[page : page + 64]
        block.copy_(torch.randn_like(block, device="cuda"))
    device_pool.kv.normal_()
    gen = torch.Generator().manual_seed(0)
    host_ids = torch.randperm(pool_pages, generator=gen)[:num_pages].tolist()
    dev_ids = torch.randperm(pool_pages, generator=gen)[:num_pages].tolist()
    total = num_pages * layout.bytes_per_page
    elements = total // host_pool.kv.element_size()
    flat_host = host_pool.kv.view(-1)[:elements]
    flat_dev = torch.empty(elements, dtype=host_pool.kv.dtype, device="cuda")
    ceilings = {
        "load": cuda_median_ms(lambda: flat_dev.copy_(flat_host, non_blocking=True)),
        "backup": cuda_median_ms(lambda: flat_host.copy_(flat_dev, non_blocking=True)),
    }
    engines = {
        k: TransferEngine(device_pool, host_pool, kernel=k) for k in ("copy_engine", "triton")
    }
    rows = []
    for op in ("load", "backup"):
        row = {"bench": "copy_engine", "device": device_name("cuda"), "case": name, "op": op,
               "num_pages": num_pages, "chunk_bytes": layout.bytes_per_page_per_layer,
               "ceiling_gbps": round(total / ceilings[op] / 1e6, 2)}  # fmt: skip
        for kernel, engine in engines.items():
            if op == "load":
                ms = cuda_median_ms(lambda e=engine: e.load_async(host_ids, dev_ids).wait())
            else:
                ms = cuda_median_ms(lambda e=engine: e.backup_async(dev_ids, host_ids).wait())
            row[f"{kernel}_gbps"] = round(total / ms / 1e6, 2)
            row[f"{kernel}_ratio"] = round(ceilings[op] / ms, 3)
        row["correct"] = check(engines["copy_engine"], device_pool, host_pool, host_ids, dev_ids)
        emit(row)
        rows.append(row)
    return rows


def check(engine, device_pool, host_pool, host_ids, dev_ids) -> bool:
    sample = slice(0, 64)
    device_pool.kv.fill_(-7.0)
    engine.load_async(host_ids, dev_ids).wait()
    idx = torch.tensor(dev_ids[sample], device="cuda")
    expected = host_pool.kv[host_ids[sample]].transpose(0, 1).cuda()
    return bool(torch.equal(device_pool.kv[:, idx], expected))


def main() -> None:
    rows = [row for case in CASES for row in run_case(*case)]
    print(f"{'case':14} {'op':7} {'chunk':>7} {'ceil GB/s':>9} {'CE GB/s':>8} {'CE %':>6} "
          f"{'triton GB/s':>11} {'triton %':>8} ok")  # fmt: skip
    for r in rows:
        print(f"{r['case']:14} {r['op']:7} {r['chunk_bytes']:7d} {r['ceiling_gbps']:9.1f} "
              f"{r['copy_engine_gbps']:8.1f} {r['copy_engine_ratio']:6.1%} "
              f"{r['triton_gbps']:11.1f} {r['triton_ratio']:8.1%} {r['correct']}")  # fmt: skip


if __name__ == "__main__":
    main()
