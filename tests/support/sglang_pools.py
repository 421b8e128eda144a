"""A host pool with exactly the surface of SGLang's that the hicache storage backend and
SGLang's own flat-page path use, for tests and the benchmark on a CPU-only machine.

Why not SGLang's own `MHATokenToKVPoolHost` / `MLATokenToKVPoolHost`: with sglang 0.5.23 on
the CPU build of torch 2.13 they cannot be imported. `sglang.srt.mem_cache.memory_pool_host`
imports `pool_host.group`, which imports `memory_pool`, which imports the `sglang.srt.configs`
package, whose `__init__` imports `nano_nemotron_vl` and so `multimodal.internvl_utils`, which
runs `import torchvision.transforms`. The only torchvision for torch 2.13 on the registry
(0.28.0) is a CUDA build: its `_C.so` does not load against the CPU torch, and its
`_meta_registrations` then stops the import with "operator torchvision::nms does not exist".

So this class restates, from SGLang 0.5.23's `pool_host/mha.py` and `pool_host/mla.py`, what
they expose and the tests need:

    layout, page_size, dtype, kv_buffer      (the shapes below, one contiguous tensor)
    get_data_page(index, flat=True)          a view of one page (flattened: a copy)
    get_dummy_flat_data_page()               a zeroed flat page
    set_from_flat_data_page(index, page)     write a flat page back

The adapter uses the first five names only (test_sglang_storage records every attribute it
reads); SGLang's flat-page path (`_generic_page_get/_set` in its cache_controller, taken with
its `file` backend) uses the last two as well. One difference: SGLang allocates its dummy
pages with `pin_memory` of the pool (pinned on a GPU host, dearer); here they are not pinned.
"""

from __future__ import annotations

import torch

MHA_SHAPES = {  # (2, ...) : K then V
    "layer_first": lambda L, n, P, H, D: (2, L, n * P, H, D),
    "page_first": lambda L, n, P, H, D: (2, n * P, L, H, D),
    "page_first_direct": lambda L, n, P, H, D: (2, n, L, P, H, D),
}
MLA_SHAPES = {  # one latent row of kv_cache_dim per token and layer
    "layer_first": lambda L, n, P, D: (L, n * P, 1, D),
    "page_first": lambda L, n, P, D: (n * P, L, 1, D),
    "page_first_direct": lambda L, n, P, D: (n, L, P, 1, D),
}


class HostPool:
    """An SGLang host pool of `num_pages` pages: MHA (`head_num` x `head_dim` K and V) or MLA
    (`kv_cache_dim` per token: kv_lora_rank + qk_rope_head_dim)."""

    def __init__(
        self,
        attention: str,
        layout: str,
        *,
        layer_num: int,
        page_size: int,
        num_pages: int,
        dtype: torch.dtype = torch.bfloat16,
        head_num: int = 0,
        head_dim: int = 0,
        kv_cache_dim: int = 0,
    ) -> None:
        self.layout = layout
        self.page_size = page_size
        self.dtype = dtype
        self._attention = attention
        if attention == "mha":
            shape = MHA_SHAPES[layout](layer_num, num_pages, page_size, head_num, head_dim)
        else:
            shape = MLA_SHAPES[layout](layer_num, num_pages, page_size, kv_cache_dim)
        self.kv_buffer = torch.zeros(shape, dtype=dtype)

    def _page(self, index: int) -> torch.Tensor:
        """The view of the page starting at token `index` (as SGLang's get_data_page)."""
        if self.layout == "page_first_direct":
            span = slice(index // self.page_size, index // self.page_size + 1)
        else:
            span = slice(index, index + self.page_size)
        axis = 1 if self.layout == "layer_first" else 0
        if self._attention == "mha":
            axis += 1  # the leading K/V axis
        return self.kv_buffer[(slice(None),) * axis + (span,)]

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        page = self._page(index)
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros(self._page(0).numel(), dtype=self.dtype)

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        page = self._page(index)
        page.copy_(data_page.reshape(page.shape))


def llama_8b_like(layout: str = "page_first", *, num_pages: int, page_size: int = 64) -> HostPool:
    """Llama-3.1-8B at tp=1: 32 layers, 8 KV heads of 128, bf16 (a 64-token page: 8 MiB)."""
    return HostPool(
        "mha", layout, layer_num=32, page_size=page_size, num_pages=num_pages,
        head_num=8, head_dim=128,
    )  # fmt: skip


def deepseek_v3_like(
    layout: str = "page_first", *, num_pages: int, page_size: int = 64
) -> HostPool:
    """DeepSeek-V3 MLA: 61 layers, kv_lora_rank 512 + rope 64 = 576, bf16 (a page: 4.3 MiB)."""
    return HostPool(
        "mla", layout, layer_num=61, page_size=page_size, num_pages=num_pages, kv_cache_dim=576
    )
