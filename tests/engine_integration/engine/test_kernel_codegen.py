"""What the compiler makes of the paged kernels for an H100/H200 (sm_90), checked on the CPU.

A CUDA graph's kernels read the step's pool layer and page table from the device; an
address loaded from memory had lost the compiler its alignment, and the split kernel's loads
of keys and values went scalar (140 global loads in its PTX against 24, no cp.async) at
twice its time on the H200. `paged_attention.DeviceStep` gives the kernels 16-byte steps
from anchors instead. This compiles both variants to PTX (Triton's own compiler and ptxas,
no GPU needed) and compares them, in a process of its own: the tests' Triton interpreter
(TRITON_INTERPRET=1) replaces what the compiler needs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]

_PRELUDE = r"""
import json, re
try:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
except ImportError as exc:
    print(json.dumps({"unavailable": str(exc)})); raise SystemExit

def ptx(kernel, types, constexprs, options):
    signature = {name: "constexpr" for name in constexprs}
    signature.update(types)
    pointers = [i for i, name in enumerate(kernel.arg_names) if types.get(name, "").startswith("*")]
    attrs = {(i,): [["tt.divisibility", 16]] for i in pointers}  # what a launch specialises
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]

def count(text, pattern):
    return len(re.findall(pattern, text))
"""

_SCRIPT = (
    _PRELUDE
    + r"""
from engine_integration.engine.model import paged_attention as pa

split_types = {"q_ptr": "*bf16", "kv_ptr": "*bf16", "table_ptr": "*i64", "part_ptr": "*fp32",
               "lse_ptr": "*fp32", "step_ptr": "*i64", "start": "i32", "num_rows": "i32",
               "capacity": "i32", "layer": "i32", "scale_log2": "fp32"}
shape = {"NUM_HEADS": 32, "NUM_KV": 8, "GROUP": 4, "DIM": 64, "PAGE": 64, "KV_UNIT": 8,
         "BLOCK_M": pa.TUNING.block_m, "BLOCK_N": pa.TUNING.block_n}
options = {"num_warps": pa.TUNING.warps, "num_stages": pa.TUNING.stages}
out = {}
for on_device in (False, True):
    text = ptx(pa._split_kernel, split_types, {**shape, "ON_DEVICE": on_device}, options)
    out[f"split {on_device}"] = [count(text, r"ld\.global"), count(text, r"cp\.async")]
write_types = {"kv_ptr": "*bf16", "pool_ptr": "*bf16", "table_ptr": "*i64", "step_ptr": "*i64",
               "layer": "i32"}
text = ptx(pa._write_kernel, write_types,
           {"ROW": 1024, "BLOCK": 1024, "PAGE": 64, "KV_UNIT": 8}, {"num_warps": 4})
out["write"] = [count(text, r"st\.global[^\n]*\.v4"), count(text, r"st\.global")]
print(json.dumps(out))
"""
)


def test_the_graphs_kernels_keep_their_loads_vectorised():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    counts = json.loads(done.stdout.strip().splitlines()[-1])
    if "unavailable" in counts:
        pytest.skip(f"Triton cannot compile for CUDA here: {counts['unavailable']}")
    eager_loads, eager_async = counts["split False"]
    graph_loads, graph_async = counts["split True"]
    assert eager_async > 0 and graph_async > 0, counts  # keys and values: asynchronous copies
    assert graph_loads <= eager_loads + 8, counts  # (the step's own scalars: a few loads)
    vector_stores, stores = counts["write"]
    assert vector_stores == stores > 0, counts  # a K/V row: 16-byte stores


_DETERMINISTIC_SCRIPT = (
    _PRELUDE
    + r"""
from engine_integration.engine.model import deterministic as d, deterministic_attention as da

out = {}
g = d.GEMM_16BIT
text = ptx(d._matmul_kernel,
           {"x_ptr": "*bf16", "w_ptr": "*bf16", "bias_ptr": "*bf16", "out_ptr": "*bf16",
            "num_rows": "i32", "x_stride": "i32", "out_stride": "i32"},
           {"N": 2048, "K": 2048, "HAS_BIAS": False, "BLOCK_M": g.block_m, "BLOCK_N": g.block_n,
            "BLOCK_K": g.block_k, "GROUP_M": d._GROUP_M, "ALIGN": 8, "PRECISION": "tf32",
            "UPCAST": False},
           {"num_warps": g.warps, "num_stages": g.stages})
out["matmul"] = [count(text, r"wgmma\.mma_async"), count(text, r"mma\.sync")]
out["matmul io"] = [count(text, r"ld\.global"), count(text, r"cp\.async\.cg\.shared\.global"),
                    count(text, r"st\.global"), count(text, r"st\.global[^\n]*\.v4")]
t = da.tiles_for(64)
types = {"q_ptr": "*bf16", "kv_ptr": "*bf16", "table_ptr": "*i64", "valid_ptr": "*i8",
         "out_ptr": "*bf16", "part_ptr": "*fp32", "lse_ptr": "*fp32", "step_ptr": "*i64",
         "start": "i32", "num_rows": "i32", "key_first": "i32", "key_end": "i32", "window": "i32",
         "row_stride": "i32", "layer": "i32", "scale_log2": "fp32"}
shape = {"NUM_HEADS": 32, "NUM_KV": 8, "GROUP": 4, "DIM": 64, "PAGE": 64, "BLOCK_M": t.block_m,
         "BLOCK_N": t.block_n, "PART_TILES": t.part_tiles, "PRECISION": "tf32", "UPCAST": False,
         "KV_UNIT": 8, "PAGED": True, "HAS_VALID": False}
options = {"num_warps": t.warps, "num_stages": t.stages, "enable_fp_fusion": False}
for split, on_device in ((False, False), (True, False), (True, True)):
    text = ptx(da._attention_kernel, types, {**shape, "SPLIT": split, "ON_DEVICE": on_device},
               options)
    out[f"attention {split} {on_device}"] = [count(text, r"wgmma\.mma_async"),
                                             count(text, r"fma\.rn\.f32")]
text = ptx(da._combine_kernel, {"part_ptr": "*fp32", "lse_ptr": "*fp32", "out_ptr": "*bf16",
                                "row_stride": "i32", "num_slots": "i32"},
           {"NUM_HEADS": 32, "DIM": 64}, {"num_warps": 1, "enable_fp_fusion": False})
out["combine"] = [1, count(text, r"fma\.rn\.f32")]
print(json.dumps(out))
"""
)


def test_the_deterministic_kernels_compile_for_sm90_with_no_contraction():
    """The deterministic path's kernels compile for an H100/H200 (what the interpreter never
    checks): the bf16 matmul and attention on the tensor cores (wgmma), the matmul's tiles
    moved 16 bytes at a time, and no multiply and
    add contracted into one (`fma.rn.f32`: 72 of them with contraction on) in the
    attention's launches or its merge kernel, so the merge in registers and the merge from
    memory round alike (`deterministic_attention`; the `fma.rn.ftz.f32` of libdevice's log2
    are the same code in every variant)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, "-c", _DETERMINISTIC_SCRIPT],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    counts = json.loads(done.stdout.strip().splitlines()[-1])
    if "unavailable" in counts:
        pytest.skip(f"Triton cannot compile for CUDA here: {counts['unavailable']}")
    assert counts.pop("matmul")[0] > 0, counts
    # x and w reach shared memory by 16-byte cp.async, out leaves 16 bytes a store: with the
    # row strides' alignment unsaid, x's tile was loaded 2 bytes at a time (32 loads) and out
    # stored so (64 stores), at 3-4x cuBLAS's time on the H200
    loads, async_copies, stores, vector_stores = counts.pop("matmul io")
    assert loads == 0 and async_copies > 0 and stores == vector_stores > 0, counts
    for name, (tensor_core, fused) in counts.items():
        assert tensor_core > 0 and fused == 0, (name, counts)
