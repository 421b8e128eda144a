"""SGLang 0.5.23's real host pools on a CPU-only machine: the two guards that need, and
builders of real pools for the tests and the benchmark.

Two things stop SGLang's `MHATokenToKVPoolHost` / `MLATokenToKVPoolHost` from being built with
the CPU build of torch, and `install()` guards exactly those, nothing of the pools' own logic:

1. Importing the pools imports `sglang.srt.configs`, which imports `torchvision.transforms`.
   torchvision 0.28.0 (the release for torch 2.13; installed with --no-deps) is a CUDA build
   whose C++ ops do not load against CPU torch; its `_meta_registrations` then calls
   `torch.library.register_fake("torchvision::nms")` (and `"qnms"`) for operators that were
   never defined, which raises. Those two calls are skipped when the operator does not
   exist (its other meta kernels already check `_has_ops()` first); tests/conftest.py applies
   this guard for the whole run, since transformers imports torchvision too.
2. With `pin_memory=True` (SGLang's default), a host pool's buffer is registered with
   `cudaHostRegister`, and its staging and dummy flat pages are allocated pinned; CPU torch
   has neither. Pinning only speeds GPU<->host copies, which a CPU machine has none of:
   `HostKVCache.__init__` is given pin_memory=False (counted), everything else unchanged.

The pools are built the way SGLang builds a draft model's host pool: a real device pool
(`MHATokenToKVPool` / `MLATokenToKVPool`) on device "cpu", then SGLang's own
`_build_mha_mla_host_pool` for a host layout.
"""

from __future__ import annotations

import threading

import torch

NMS_OPERATORS = ("torchvision::nms", "torchvision::qnms")
_lock = threading.Lock()
_installed = False
num_unpinned_pools = [0]  # pools built that asked for pinned memory, since install()


def install() -> None:
    """Apply both guards (idempotent). Call before importing sglang's memory pools."""
    global _installed
    with _lock:
        if _installed:
            return
        guard_torchvision_ops()
        _unpin_host_pools()
        _installed = True


def _operator_exists(name: str) -> bool:
    try:
        torch._C._dispatch_find_schema_or_throw(name, "")
    except RuntimeError:
        return False
    return True


def guard_torchvision_ops() -> None:
    """From now on, `register_fake` of torchvision's nms/qnms is skipped while the operator
    does not exist (idempotent; no import). Applied by tests/conftest.py for the whole run:
    with torchvision installed, transformers imports it too (its image utilities), from any
    test, and must not fail there either."""
    register_fake = torch.library.register_fake
    if getattr(register_fake, "guards_torchvision_ops", False):
        return

    def guarded(op, *args, **kwargs):
        if op in NMS_OPERATORS and not _operator_exists(op):
            return lambda fn: fn  # the operator was never defined: nothing to fake
        return register_fake(op, *args, **kwargs)

    guarded.guards_torchvision_ops = True
    torch.library.register_fake = guarded


def _unpin_host_pools() -> None:
    """Every SGLang host pool is built with pin_memory=False: no cudaHostRegister of its
    buffer, no pinned staging or dummy pages (which CPU torch cannot allocate)."""
    from sglang.srt.mem_cache.pool_host.base import HostKVCache

    init = HostKVCache.__init__
    if getattr(init, "unpinned", False):
        return

    def unpinned_init(self, *args, **kwargs):
        if kwargs.get("pin_memory"):
            num_unpinned_pools[0] += 1
        kwargs["pin_memory"] = False
        init(self, *args, **kwargs)

    unpinned_init.unpinned = True
    HostKVCache.__init__ = unpinned_init


def _server_args(page_size: int) -> None:
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    set_global_server_args_for_scheduler(ServerArgs(model_path="dummy", page_size=page_size))


def host_pool(
    attention: str,
    layout: str,
    *,
    layer_num: int,
    page_size: int,
    num_pages: int,
    dtype: torch.dtype = torch.bfloat16,
    head_num: int = 2,
    head_dim: int = 8,
    kv_lora_rank: int = 8,
    qk_rope_head_dim: int = 4,
):
    """SGLang's real host pool ("mha" or "mla") of `num_pages` pages in `layout`, behind a
    real device pool on the CPU of half as many tokens (SGLang's host:device ratio 2)."""
    install()
    from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import (
        _build_mha_mla_host_pool,
    )
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool

    _server_args(page_size)
    device_tokens = num_pages * page_size // 2
    if attention == "mha":
        device = MHATokenToKVPool(
            size=device_tokens, page_size=page_size, dtype=dtype, head_num=head_num,
            head_dim=head_dim, layer_num=layer_num, device="cpu", enable_memory_saver=False,
        )  # fmt: skip
    elif attention == "mla":
        device = MLATokenToKVPool(
            size=device_tokens, page_size=page_size, dtype=dtype, kv_lora_rank=kv_lora_rank,
            qk_rope_head_dim=qk_rope_head_dim, layer_num=layer_num, device="cpu",
            enable_memory_saver=False,
        )  # fmt: skip
    else:
        raise ValueError(f"attention must be 'mha' or 'mla', got {attention!r}")
    return _build_mha_mla_host_pool(
        pool=device, host_to_device_ratio=2.0, page_size=page_size, layout=layout,
        allocator_type="default", pool_label="kv",
    )  # fmt: skip
