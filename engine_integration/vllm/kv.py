"""vLLM's paged KV tensors, and the copies between them and hicache's L1 pages.

vLLM 0.33 hands a connector one tensor per attention layer, a view of its logical page
shape

    kv_layer  (B, H, N, C)   kernel blocks, KV heads, tokens per kernel block,
                             C = K then V (head_size each), of spec.dtype

whose physical order (vLLM's KVCacheLayout: LBNHC, BLHNC, ...) lives in the strides. A
manager block of `block_size` tokens is `block_size // N` consecutive kernel blocks. Torch
indexing follows the strides, so every layout vLLM allocates is read the same way here.

hicache's L1 pool holds the same KV page by page, layer-first:

    l1_kv  (L, P, S, 2, H, D)     MHA/GQA
    l1_kv  (L, P, S, 1, R)        MLA: vLLM's (B, 1, N, R), one latent of R per token

Tokens are mapped one by one: token t of a request is at vLLM block `block_ids[t // B]`,
offset `t % B`, and at hicache page `page_ids[t // S]`, offset `t % S`. A block size other
than the page size therefore needs nothing special: a page may span several blocks or a
block several pages, and a copy may start or end inside either.

This module knows tensors and ids, never tokens' values or keys.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine_integration.vllm.block_copy import OffsetUploader, copy_tokens


@dataclass(frozen=True)
class TokenSlots:
    """Where `num_tokens` consecutive tokens live on both sides, on the KV device.

    On the CPU: index tensors (n,) each for torch's indexing. On CUDA: `l1_starts` and
    `kv_starts`, each token's first element in an L1 layer and in a vLLM layer, for
    `vllm_copy.copy_tokens`."""

    num_tokens: int
    kernel_blocks: torch.Tensor | None = None
    kernel_offsets: torch.Tensor | None = None
    page_ids: torch.Tensor | None = None
    page_offsets: torch.Tensor | None = None
    l1_starts: torch.Tensor | None = None
    kv_starts: torch.Tensor | None = None


class VllmKV:
    """The registered KV tensors of one worker, checked against the attention spec."""

    def __init__(
        self,
        kv_caches: dict,
        layer_names: list[str],
        spec,
        num_blocks: int,
        *,
        use_kernel: bool | None = None,
    ) -> None:
        """`use_kernel`: copy through `vllm_copy`'s Triton kernel (default: on CUDA; on the
        CPU only under TRITON_INTERPRET=1, for tests), else through torch's indexing."""
        missing = [name for name in layer_names if name not in kv_caches]
        if missing:
            raise ValueError(f"register_kv_caches: no KV tensor for layers {missing}")
        self.layer_names = list(layer_names)
        self._index = {name: i for i, name in enumerate(layer_names)}
        self.layers = [kv_caches[name] for name in layer_names]
        first = self.layers[0]
        self.device = first.device
        self.block_size = spec.block_size
        self.num_heads = spec.num_kv_heads
        self.head_size = spec.head_size
        self.mla = type(spec).__name__ == "MLAAttentionSpec"
        self.kernel_block_size = first.shape[2]
        expected = (
            num_blocks * (self.block_size // self.kernel_block_size),
            self.num_heads,
            self.kernel_block_size,
            self.head_size if self.mla else 2 * self.head_size,
        )
        for name, tensor in zip(layer_names, self.layers, strict=True):
            if (
                tuple(tensor.shape) != expected
                or tensor.dtype != spec.dtype
                or tensor.device != self.device
                or tensor.stride() != first.stride()
                or self.block_size % self.kernel_block_size
            ):
                raise ValueError(
                    f"register_kv_caches: layer {name} is {tuple(tensor.shape)} {tensor.dtype} "
                    f"on {tensor.device}; expected (B, H, N, C) = {expected} {spec.dtype} on "
                    f"{self.device}, N dividing block_size {self.block_size}, the strides of "
                    f"layer {layer_names[0]}"
                )
        on_cuda = self.device.type == "cuda"
        self.use_kernel = on_cuda if use_kernel is None else use_kernel
        self.use_kernel &= not self.mla  # the kernel moves (K or V, head) pairs; MLA: indexing
        self._uploader = OffsetUploader(self.device) if on_cuda and self.use_kernel else None

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def layer_index(self, layer_name: str) -> int:
        index = self._index.get(layer_name)
        if index is None:
            raise KeyError(f"HiCacheConnector: no registered KV for layer {layer_name!r}")
        return index

    def slots(
        self, block_ids: list[int], page_ids: list[int], page_size: int, start: int, end: int
    ) -> TokenSlots:
        """Where tokens [start, end) are: blocks from `block_ids` (the request's, from token
        0), pages from `page_ids` (hicache L1 pages, from token 0)."""
        if end > len(block_ids) * self.block_size or end > len(page_ids) * page_size:
            raise ValueError(
                f"tokens [{start}, {end}) exceed {len(block_ids)} blocks of {self.block_size} "
                f"or {len(page_ids)} pages of {page_size}"
            )
        tokens = torch.arange(start, end)
        blocks = torch.as_tensor(block_ids, dtype=torch.long)[tokens // self.block_size]
        within = tokens % self.block_size
        kernel_blocks = blocks * (self.block_size // self.kernel_block_size)
        kernel_blocks += within // self.kernel_block_size
        kernel_offsets = within % self.kernel_block_size
        pages = torch.as_tensor(page_ids, dtype=torch.long)[tokens // page_size]
        page_offsets = tokens % page_size
        if not self.use_kernel:
            return TokenSlots(end - start, kernel_blocks, kernel_offsets, pages, page_offsets)
        first = self.layers[0]
        starts = torch.stack(
            [
                (pages * page_size + page_offsets) * (2 * self.num_heads * self.head_size),
                kernel_blocks * first.stride(0) + kernel_offsets * first.stride(2),
            ]
        )
        if self._uploader is not None:
            starts = self._uploader.upload(starts)
        return TokenSlots(end - start, l1_starts=starts[0], kv_starts=starts[1])

    def copy_in(self, layer: int, l1_layer: torch.Tensor, slots: TokenSlots) -> None:
        """vLLM layer `layer` <- hicache L1 (one layer: (P, S, 2, H, D)), at `slots`."""
        if not slots.num_tokens:
            return
        kv = self.layers[layer]
        if slots.l1_starts is not None:
            copy_tokens(l1_layer, kv, slots.l1_starts, slots.kv_starts, to_vllm=True)
            return
        values = l1_layer[slots.page_ids, slots.page_offsets]  # (n, 2, H, D) or MLA (n, 1, R)
        if not self.mla:
            values = values.transpose(1, 2).reshape(slots.num_tokens, self.num_heads, -1)
        kv[slots.kernel_blocks, :, slots.kernel_offsets] = values  # (n, H, C)

    def copy_out(self, layer: int, l1_layer: torch.Tensor, slots: TokenSlots) -> None:
        """hicache L1 (one layer) <- vLLM layer `layer`, at `slots`."""
        if not slots.num_tokens:
            return
        kv = self.layers[layer]
        if slots.l1_starts is not None:
            copy_tokens(l1_layer, kv, slots.l1_starts, slots.kv_starts, to_vllm=False)
            return
        values = kv[slots.kernel_blocks, :, slots.kernel_offsets]  # (n, H, C)
        if not self.mla:
            values = values.view(slots.num_tokens, self.num_heads, 2, self.head_size)
            values = values.transpose(1, 2)  # (n, 2, H, D)
        l1_layer[slots.page_ids, slots.page_offsets] = values
