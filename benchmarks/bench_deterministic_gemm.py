"""Benchmark (CUDA): the deterministic path's matmul (`model/deterministic.py`) against
torch's (cuBLAS) on a model's projection shapes, for candidate tile configurations, in one
run. Each configuration is a different deterministic model (its BLOCK_K regroups the sums),
so this picks the one to fix, it never tunes at run time.

    python benchmarks/bench_deterministic_gemm.py                 # the 1.1B model's shapes
    python benchmarks/bench_deterministic_gemm.py --rows 1,4096 --tiles 128,128,64,8,3

Prints, per configuration and row count, the time of one layer's four projections against
torch's as a ratio (deterministic / torch: lower is better, 1.0 is cuBLAS), and one JSON line
per configuration.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks.common import cuda_median_ms, device_name, emit  # noqa: E402
from benchmarks.engine_models import MODELS  # noqa: E402
from engine_integration.engine.model import deterministic  # noqa: E402

CANDIDATES = (
    (128, 128, 64, 8, 3),
    (128, 128, 64, 4, 4),
    (128, 256, 64, 8, 3),
    (64, 128, 64, 4, 4),
    (128, 64, 64, 4, 4),
    (64, 64, 64, 4, 4),
)


def projection_shapes(name: str) -> list[tuple[str, int, int]]:
    """(label, N, K) of one layer's matmuls: qkv, o, gate_up, down."""
    c = MODELS[name]
    qkv = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
    return [
        ("qkv", qkv, c.hidden_size),
        ("o", c.hidden_size, c.num_heads * c.head_dim),
        ("gate_up", 2 * c.intermediate_size, c.hidden_size),
        ("down", c.hidden_size, c.intermediate_size),
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="1b", choices=sorted(MODELS))
    p.add_argument("--rows", default="1,64,4096,16384", help="M values (tokens in a step)")
    p.add_argument(
        "--tiles", action="append", help="M,N,K,WARPS,STAGES (repeatable; default: a sweep)"
    )
    p.add_argument("--reps", type=int, default=20)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA device")
    rows = [int(r) for r in args.rows.split(",")]
    candidates = [tuple(int(v) for v in t.split(",")) for t in args.tiles or []] or CANDIDATES
    shapes = projection_shapes(args.model)
    gen = torch.Generator(device="cuda").manual_seed(0)
    weights = {
        label: torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
        for label, n, k in shapes
    }
    inputs = {
        (m, k): torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
        for m in rows
        for _, _, k in shapes
    }
    base = {
        (m, label): cuda_median_ms(
            lambda x=inputs[m, k], w=weights[label]: F.linear(x, w), args.reps, warmups=2
        )
        for m in rows
        for label, _, k in shapes
    }
    default = deterministic.GEMM_16BIT
    results = []
    try:
        for tiles in candidates:
            deterministic.GEMM_16BIT = deterministic.GemmTiles(*tiles)
            by_rows = {}
            for m in rows:
                ours = sum(
                    cuda_median_ms(
                        lambda x=inputs[m, k], w=weights[label]: deterministic.matmul(x, w),
                        args.reps,
                        warmups=2,
                    )
                    for label, _, k in shapes
                )
                by_rows[m] = ours / sum(base[m, label] for label, _, _ in shapes)
            results.append((tiles, by_rows))
    finally:
        deterministic.GEMM_16BIT = default
    print(f"\ndeterministic matmul / torch, {args.model} projections, bf16, {device_name('cuda')}")
    print(f"{'tiles M,N,K,W,S':>18} " + " ".join(f"{f'M={m}':>9}" for m in rows))
    for tiles, by_rows in results:
        mark = " (current)" if tiles == dataclasses.astuple(default) else ""
        print(f"{','.join(map(str, tiles)):>18} " + " ".join(f"{by_rows[m]:8.2f}x" for m in rows)
              + mark)  # fmt: skip
        emit({"bench": "deterministic_gemm", "model": args.model, "tiles": list(tiles),
              "ratio_by_rows": {str(m): round(r, 3) for m, r in by_rows.items()}})  # fmt: skip
    big = max(rows)
    best = min(results, key=lambda r: r[1][big])
    print(f"best at M={big}: {','.join(map(str, best[0]))} ({best[1][big]:.2f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
