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
   every host pool class's `__init__` is given pin_memory=False (counted), nothing else
   changes.

The pools are built the way SGLang builds a draft model's host pool: a real device pool
(`MHATokenToKVPool` / `MLATokenToKVPool`) on device "cpu", then SGLang's own
`_build_mha_mla_host_pool` for a host layout.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

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


# Packages only the tests' own process may import: torchvision 0.28.0, installed here by
# .ci/run (`pip install --no-deps --target .test-site`), never into the environment, where
# every other process (a benchmark's, a replica's) would import it unguarded through
# transformers or vLLM and fail.
TEST_SITE = Path(__file__).resolve().parents[2] / ".test-site"


def guard_torchvision_ops() -> None:
    """Put `TEST_SITE` on this process's path, and from now on skip `register_fake` of
    torchvision's nms/qnms while the operator does not exist (idempotent; no import).
    Applied by tests/conftest.py for the whole run: with torchvision importable,
    transformers imports it too (its image utilities), from any test, and must not fail
    there either."""
    if TEST_SITE.is_dir() and str(TEST_SITE) not in sys.path:
        sys.path.append(str(TEST_SITE))  # after site-packages: never shadows what is there
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
    """Every SGLang host pool class is built with pin_memory=False: no cudaHostRegister of
    its buffers, no pinned staging or dummy pages (which CPU torch cannot allocate)."""
    import inspect

    import sglang.srt.mem_cache.memory_pool_host  # noqa: F401 (defines the DeepSeek-V4 pools)
    from sglang.srt.mem_cache.pool_host import dsa, mamba, mha, mla  # noqa: F401
    from sglang.srt.mem_cache.pool_host.base import HostKVCache

    classes, todo = [], [HostKVCache]
    while todo:
        cls = todo.pop()
        classes.append(cls)
        todo.extend(cls.__subclasses__())
    for cls in classes:
        init = cls.__dict__.get("__init__")
        if init is None or getattr(init, "unpinned", False):
            continue
        if "pin_memory" not in inspect.signature(init).parameters:
            continue
        cls.__init__ = _unpinned(init)


def _unpinned(init):
    def unpinned_init(self, *args, **kwargs):
        if kwargs.get("pin_memory", True):
            num_unpinned_pools[0] += 1
        kwargs["pin_memory"] = False
        init(self, *args, **kwargs)

    unpinned_init.unpinned = True
    unpinned_init.__wrapped__ = init
    return unpinned_init


def _budget():
    """SGLang sizes host pools against free memory less a 10 GiB reserve for a serving host;
    a test machine (24 GiB, shared) may have less free than that. Pools built inside are
    booked against SGLang's own `host_memory_budget_scope` of 64 GiB instead."""
    from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope

    return host_memory_budget_scope(64 << 30)


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
    with _budget():
        return _build_mha_mla_host_pool(
            pool=device, host_to_device_ratio=2.0, page_size=page_size, layout=layout,
            allocator_type="default", pool_label="kv",
        )  # fmt: skip


# -- the extra host pools of hybrid models (SGLang's v2 storage API) -------------------------


def swa_group(*, page_size: int, num_pages: int, head_num: int = 2, head_dim: int = 8):
    """SGLang's `HostPoolGroup` of a sliding-window hybrid (full layers 0, 2; window layers
    1, 3): entries "kv" and "swa", both `MHATokenToKVPoolHost`, from a real `SWAKVPool`."""
    install()
    from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import build_hybrid_swa_group
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

    _server_args(page_size)
    device = SWAKVPool(
        size=num_pages * page_size // 2, size_swa=num_pages * page_size // 2,
        page_size=page_size, dtype=torch.bfloat16, head_num=head_num, head_dim=head_dim,
        swa_attention_layer_ids=[1, 3], full_attention_layer_ids=[0, 2], device="cpu",
    )  # fmt: skip
    with _budget():
        return build_hybrid_swa_group(
            page_size=page_size, full_kv_pool=device.full_kv_pool,
            swa_kv_pool=device.swa_kv_pool, full_layer_mapping={0: 0, 2: 1},
            swa_layer_mapping={1: 0, 3: 1}, use_mla=False,
        )  # fmt: skip


DSA_PAGE_SIZE = 64  # DSATokenToKVPool asserts 64-token pages


def dsa_group(*, num_pages: int):
    """SGLang's `HostPoolGroup` of a DeepSeek-V3.2 (DSA) model: "kv" (MLA) and "indexer"
    (`DSAIndexerPoolHost`), from a real `DSATokenToKVPool` through its own declarations;
    pages of `DSA_PAGE_SIZE` tokens."""
    install()
    page_size = DSA_PAGE_SIZE
    from sglang.srt.mem_cache.hybrid_cache.host_pool_config import prepare_host_pool_config
    from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import build_host_pool_group
    from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool

    _server_args(page_size)
    device = DSATokenToKVPool(
        size=num_pages * page_size // 2, page_size=page_size, kv_lora_rank=8,
        dtype=torch.bfloat16, qk_rope_head_dim=4, layer_num=2, device="cpu",
        index_head_dim=128, enable_memory_saver=False, kv_cache_dim=12,
    )  # fmt: skip
    config = prepare_host_pool_config(
        decls=device.host_pool_decls(), full_layer_mapping={0: 0, 1: 1},
        transfer_layer_id_max=2, transfer_page_size=page_size,
    )  # fmt: skip
    with _budget():
        return build_host_pool_group(config=config)


def mamba_pool(*, num_slots: int = 8):
    """SGLang's `MambaPoolHost` (Mamba2 conv + SSM state of layers 1 and 3; one slot a
    page), from the real device `MambaPool` of a `HybridReqToTokenPool`."""
    install()
    from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateShape
    from sglang.srt.environ import envs
    from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import build_mamba_host_pool
    from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool

    _server_args(1)
    with envs.SGLANG_MAMBA_SSM_DTYPE.override("bfloat16"):
        shape = Mamba2StateShape.create(
            tp_world_size=1, intermediate_size=32, n_groups=1, num_heads=2, head_dim=16,
            state_size=8, conv_kernel=4,
        )  # fmt: skip
        params = Mamba2CacheParams(shape=shape, layers=[1, 3])
    requests = HybridReqToTokenPool(
        size=4, mamba_size=num_slots, mamba_spec_state_size=4, max_context_len=64,
        device="cpu", enable_memory_saver=False, cache_params=params, mamba_layer_ids=[1, 3],
        enable_mamba_extra_buffer=False, speculative_num_draft_tokens=3,
    )  # fmt: skip
    (info,) = requests.mamba_pool.get_device_pool_infos()
    with _budget():
        return build_mamba_host_pool(requests.mamba_pool, info, host_size=0, layout="page_first")


def deepseek_v4_pools(*, page_size: int, num_pages: int) -> dict:
    """DeepSeek-V4's compressed pools as SGLang's assembler builds them: c4 and c128 main
    KV (`DeepSeekV4PagedHostPool` over per-layer device page rows) and the c4 compress state
    (`DeepSeekV4StateHostPool` over real `CompressStatePool`s), two layers each, and the
    KV anchor "kv", a `LogicalHostPool` (page slots, no bytes)."""
    install()
    from sglang.srt.mem_cache.deepseek_v4_compress_state import CompressStatePool
    from sglang.srt.mem_cache.memory_pool_host import (
        DeepSeekV4PagedHostPool,
        DeepSeekV4StateHostPool,
        LogicalHostPool,
    )

    _server_args(page_size)
    with _budget():
        pools = {}
        for name, item_bytes in (("deepseek_v4_c4", 96), ("deepseek_v4_c128", 48)):
            rows = [torch.zeros(num_pages // 2, item_bytes, dtype=torch.uint8) for _ in range(2)]
            pools[name] = DeepSeekV4PagedHostPool(
                pool_name=name, device_buffers=rows, item_bytes=item_bytes,
                num_host_pages=num_pages, slot_page_size=page_size, layout="page_first",
                page_aligned_only=True,
            )  # fmt: skip
        states = [
            CompressStatePool(
                size=num_pages * page_size,
                ring_size=8,
                overlap=False,
                head_dim=16,
                dtype=torch.float32,
                device="cpu",
                enable_memory_saver=False,
                ratio=4,
                swa_page_size=page_size,
            )  # fmt: skip
            for _ in range(2)
        ]
        pools["deepseek_v4_c4_state"] = DeepSeekV4StateHostPool(
            pool_name="deepseek_v4_c4_state", state_pools=states, num_host_pages=num_pages,
            swa_page_size=page_size, layout="page_first",
        )  # fmt: skip
        pools["kv"] = LogicalHostPool(size=num_pages * page_size, page_size=page_size)
    return pools


# -- SGLang's own storage kit on the CPU -----------------------------------------------------


def install_kit_shims() -> None:
    """For SGLang's unified-radix-cache storage kit (`sglang.test.kits.unified_radix_cache`),
    beyond `install()`: its fixtures run on device "cpu" (their `get_device()` raises without
    an accelerator), and the MHA host pool's device<->host copies (CUDA kernels from
    sgl_kernel) become plain index copies between the same tensors. Nothing else is shimmed:
    the radix cache, the cache controller, its threads and the storage factory are SGLang's."""
    install()
    import sglang.test.kits.unified_radix_cache.fixtures as fixtures
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    fixtures.get_device = lambda: "cpu"
    if getattr(MHATokenToKVPoolHost.backup_from_device_all_layer, "on_cpu", False):
        return

    def backup_from_device_all_layer(self, device_pool, host_indices, device_indices, io):
        for layer in range(self.layer_num):
            for kv, device in ((0, self.device_k_buffers), (1, self.device_v_buffers)):
                host = _host_layer(self, kv, layer)
                host[_host_rows(self, host_indices)] = device[layer][device_indices]

    def load_to_device_per_layer(
        self, device_pool, host_indices, device_indices, layer_id, io, *, is_draft=False
    ):
        if not is_draft and not 0 <= layer_id < self.target_layer_num:
            return
        for kv, device in ((0, self.device_k_buffers), (1, self.device_v_buffers)):
            host = _host_layer(self, kv, layer_id)
            device[layer_id][device_indices] = host[_host_rows(self, host_indices)]

    backup_from_device_all_layer.on_cpu = True
    MHATokenToKVPoolHost.backup_from_device_all_layer = backup_from_device_all_layer
    MHATokenToKVPoolHost.load_to_device_per_layer = load_to_device_per_layer


def _host_layer(pool, kv: int, layer: int) -> torch.Tensor:
    """One layer of K (kv=0) or V (1) in the host pool. page_head keeps layers inside a page
    (pages, heads, page, layers, head_dim): its data refs are not per layer, so slice it."""
    if pool.layout == "page_head":
        return pool.kv_buffer[kv][:, :, :, layer]
    return (pool.k_data_refs, pool.v_data_refs)[kv][layer]


def _host_rows(pool, host_indices: torch.Tensor):
    """The index of host token rows in one layer's view (page_first_direct: page, offset;
    page_head: page, every head, offset)."""
    indices = host_indices.to(torch.int64)
    if pool.layout == "page_first_direct":
        return indices // pool.page_size, indices % pool.page_size
    if pool.layout == "page_head":
        return indices // pool.page_size, slice(None), indices % pool.page_size
    return indices
