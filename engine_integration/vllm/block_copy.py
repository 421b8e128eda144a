"""Token copies between hicache's L1 pages and vLLM's KV blocks, on the GPU: one Triton
kernel per layer and direction.

The connector stages KV in hicache's L1 (the copy engines bring L2 pages there at the
link's rate, layer by layer); each layer then moves from the L1 pages into the request's
vLLM blocks on the compute stream. That move is a gather-transpose-scatter per token
(L1 holds a token as (2, H, D), vLLM as (H, 2 * D) at its layout's strides), which torch's
advanced indexing does in three passes at ~0.35 TB/s; the kernel here does it in one, each
program moving BLOCK_T tokens of one (K or V, head) pair: D contiguous values on both sides.

Where the kernel finds each token comes from two int64 offset arrays (the token's first
value in the L1 layer and in the vLLM layer, in elements), built on the host. They must not
travel by cudaMemcpy: the connector's loads keep the host-to-device copy engines busy for
the whole prefix (tens of ms), and a small copy queued on them after the loads lands only
when the loads are done, so every layer's copy, and the forward behind it, would wait for
the last layer's load (measured on an H200: the first compute-stream copy started at
39.3 ms, right after the 32-layer load). So `upload` reads the pinned offsets with an SM
kernel instead, which runs as soon as the stream reaches it.

This module knows tensors and offsets, never tokens or pages.
"""

from __future__ import annotations

import collections

import torch

from tiers.jit import tl, triton  # triton, or a stand-in without it

BLOCK_T = 64  # tokens per program
_UPLOAD_BLOCK = 1024


@triton.jit
def _upload_kernel(src_ptr, dst_ptr, numel, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < numel
    tl.store(dst_ptr + offsets, tl.load(src_ptr + offsets, mask=mask), mask=mask)


@triton.jit
def _token_copy_kernel(
    l1_ptr,  # one L1 layer, (P, S, 2, H, D) contiguous
    kv_ptr,  # one vLLM layer, (B, H, N, 2 * D) at any strides
    l1_start_ptr,  # (n,) int64: element offset of each token's (2, H, D) in the L1 layer
    kv_start_ptr,  # (n,) int64: element offset of each token's (H, 2D) origin in vLLM's layer
    num_tokens,
    kv_head_stride,
    kv_value_stride,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    TO_VLLM: tl.constexpr,
    BLOCK: tl.constexpr,
):
    part = tl.program_id(1)  # (K or V) * H + head
    which = part // NUM_HEADS
    head = part % NUM_HEADS
    tokens = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    token_mask = tokens < num_tokens
    l1_start = tl.load(l1_start_ptr + tokens, mask=token_mask, other=0)
    kv_start = tl.load(kv_start_ptr + tokens, mask=token_mask, other=0)
    dims = tl.arange(0, BLOCK_D)
    mask = token_mask[:, None] & (dims < HEAD_DIM)[None, :]
    l1_offsets = l1_start[:, None] + (part * HEAD_DIM + dims)[None, :]
    kv_offsets = (
        kv_start[:, None]
        + head * kv_head_stride
        + ((which * HEAD_DIM + dims) * kv_value_stride)[None, :]
    )
    if TO_VLLM:
        tl.store(kv_ptr + kv_offsets, tl.load(l1_ptr + l1_offsets, mask=mask), mask=mask)
    else:
        tl.store(l1_ptr + l1_offsets, tl.load(kv_ptr + kv_offsets, mask=mask), mask=mask)


class OffsetUploader:
    """Puts host-built offset arrays on the device through `_upload_kernel`, keeping each
    pinned source alive until the stream has read it (nothing else knows the kernel reads
    it: the pinned allocator would hand the block out again)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._in_flight: collections.deque = collections.deque()  # (event, pinned)

    def upload(self, host: torch.Tensor) -> torch.Tensor:
        """A device copy of the int64 CPU tensor `host`, ordered on the current stream."""
        self._forget_read()
        pinned = host.contiguous().pin_memory()
        device = torch.empty_like(pinned, device=self.device)
        numel = pinned.numel()
        if numel:
            grid = (triton.cdiv(numel, _UPLOAD_BLOCK),)
            _upload_kernel[grid](pinned, device, numel, BLOCK=_UPLOAD_BLOCK)
            event = torch.cuda.Event()
            event.record()
            self._in_flight.append((event, pinned))
        return device

    def _forget_read(self) -> None:
        while self._in_flight and self._in_flight[0][0].query():
            self._in_flight.popleft()


def copy_tokens(
    l1_layer: torch.Tensor,
    kv_layer: torch.Tensor,
    l1_starts: torch.Tensor,
    kv_starts: torch.Tensor,
    *,
    to_vllm: bool,
) -> None:
    """Move len(l1_starts) tokens between one L1 layer (P, S, 2, H, D) and one vLLM layer
    (B, H, N, 2D) of the same dtype, at the offsets given (see `_token_copy_kernel`)."""
    num_tokens = l1_starts.numel()
    if not num_tokens:
        return
    _, num_heads, _, width = kv_layer.shape
    head_dim = width // 2
    grid = (triton.cdiv(num_tokens, BLOCK_T), 2 * num_heads)
    _token_copy_kernel[grid](
        l1_layer,
        kv_layer,
        l1_starts,
        kv_starts,
        num_tokens,
        kv_layer.stride(1),
        kv_layer.stride(3),
        NUM_HEADS=num_heads,
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        TO_VLLM=to_vllm,
        BLOCK=BLOCK_T,
        num_warps=4,
    )
