"""The connector's GPU copy (`vllm_copy`'s Triton kernel) moves exactly what torch's
indexing moves, in every vLLM layout, both ways. On the CPU the kernel runs under
TRITON_INTERPRET=1 (tests/conftest.py); on CUDA the `gpu` test runs it for real."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec  # noqa: E402
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402

from engine_integration.vllm.kv import VllmKV  # noqa: E402
from tests.support.vllm_driver import Shape, _kv_tensors  # noqa: E402

LAYOUTS = [
    (KVCacheLayout.LBNHC, None),
    (KVCacheLayout.BLHNC, None),
    (KVCacheLayout.LBHNC, 8),
    (KVCacheLayout.BLNHC, None),
]


def _pair(layout, kernel_block, device):
    shape = Shape(num_layers=2, num_blocks=12, block_size=16, num_kv_heads=2, head_size=12,
                  layout=layout, kernel_block_size=kernel_block, device=device)  # fmt: skip
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=12, dtype=torch.float32)
    names = ["layer.0", "layer.1"]
    sides = []
    for use_kernel in (False, True):
        config, tensors = _kv_tensors(spec, shape, names)
        kv = VllmKV(tensors, names, spec, config.num_blocks, use_kernel=use_kernel)
        sides.append(kv)
    return sides


def _check_both_ways(layout, kernel_block, device):
    torch.manual_seed(0)
    plain, kernel = _pair(layout, kernel_block, device)
    page_size, num_pages = 8, 10
    l1 = torch.randn(num_pages, page_size, 2, 2, 12, device=device)
    block_ids, page_ids = [5, 0, 9, 3], [7, 2, 4, 9, 0, 1, 6, 8]
    start, end = 5, 61  # starts and ends inside a block and a page
    for kv in (plain, kernel):
        slots = kv.slots(block_ids, page_ids, page_size, start, end)
        kv.copy_in(1, l1[:, :], slots)
    assert torch.equal(plain.layers[1], kernel.layers[1])
    assert not torch.equal(plain.layers[1], plain.layers[0])  # something moved
    outs = []
    for kv in (plain, kernel):
        out = torch.zeros_like(l1)
        kv.copy_out(1, out, kv.slots(block_ids, page_ids, page_size, start, end))
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
    flat = l1.view(-1, 2, 2, 12)
    slots = [page_ids[t // page_size] * page_size + t % page_size for t in range(start, end)]
    assert torch.equal(outs[1].view(-1, 2, 2, 12)[slots], flat[slots])  # the round trip


@pytest.mark.parametrize(("layout", "kernel_block"), LAYOUTS, ids=lambda v: str(v))
def test_the_kernel_moves_what_torch_indexing_moves(layout, kernel_block):
    _check_both_ways(layout, kernel_block, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("layout", "kernel_block"), LAYOUTS, ids=lambda v: str(v))
def test_on_cuda_the_kernel_moves_what_torch_indexing_moves(layout, kernel_block):
    _check_both_ways(layout, kernel_block, "cuda")
