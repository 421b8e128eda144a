"""Copy kernels against the plain torch reference, on fresh random bytes, output poisoned first.

On the CPU the kernels run under TRITON_INTERPRET=1 (set by tests/conftest.py) at small
sizes; the `gpu` tests repeat the checks on a CUDA device at realistic sizes.
"""

from __future__ import annotations

import pytest
import torch

from tiers.errors import KVTensorError, PageIdError
from tiers.kernels import (
    CopyConfig,
    backup,
    backup_reference,
    check_page_ids,
    load_layer,
    load_layer_reference,
)
from tiers.layout import KVLayout

SHAPES = {  # small geometries for the interpreter
    "mha": dict(kind="mha", num_kv_heads=2, head_dim=8),
    "mla": dict(kind="mla", kv_lora_rank=12, rope_dim=4),
}


def small_layout(kind: str, dtype: str, page_size: int, num_layers: int = 3) -> KVLayout:
    return KVLayout(num_layers=num_layers, page_size=page_size, dtype=dtype, **SHAPES[kind])


def make_kv(layout: KVLayout, num_device_pages: int, num_host_pages: int, device="cpu"):
    """(device_kv (L, Pd, S, *tok), host_kv (Ph, L, S, *tok)) of `layout`, uninitialized."""
    tail = (layout.page_size, *layout.token_shape)
    device_kv = torch.empty(
        (layout.num_layers, num_device_pages, *tail), dtype=layout.torch_dtype, device=device
    )
    pin = torch.device(device).type == "cuda"
    host_kv = torch.empty(
        (num_host_pages, layout.num_layers, *tail), dtype=layout.torch_dtype, pin_memory=pin
    )
    return device_kv, host_kv


def gapped_ids(generator: torch.Generator, num: int, num_src: int, num_dst: int):
    """`num` distinct random ids on each side, in random order (gaps and no runs)."""
    src = torch.randperm(num_src, generator=generator)[:num]
    dst = torch.randperm(num_dst, generator=generator)[:num]
    return src.tolist(), dst.tolist()


def check_backup(layout, kvh, *, config=None, seed=0, num_dev=7, num_host=9, num=4):
    gen = torch.Generator().manual_seed(seed)
    device_kv, host_kv = make_kv(layout, num_dev, num_host)
    kvh.fill_random_(device_kv, gen)
    kvh.poison_(host_kv)
    expected = host_kv.clone()
    dev_ids, host_ids = gapped_ids(gen, num, num_dev, num_host)
    kwargs = {} if config is None else {"config": config}
    plan = backup(device_kv, host_kv, dev_ids, host_ids, **kwargs)
    backup_reference(device_kv, expected, dev_ids, host_ids)
    assert kvh.same_bytes(host_kv, expected)
    # The reference itself: each target page holds its source's layers, the rest is poison.
    for d, h in zip(dev_ids, host_ids, strict=True):
        assert kvh.same_bytes(expected[h], device_kv[:, d])
    untouched = [p for p in range(num_host) if p not in host_ids]
    assert bool((host_kv[untouched].view(-1).view(torch.uint8) == kvh.POISON_BYTE).all())
    return plan


def check_load_all_layers(layout, kvh, *, config=None, seed=0, num_dev=7, num_host=9, num=4):
    gen = torch.Generator().manual_seed(seed)
    device_kv, host_kv = make_kv(layout, num_dev, num_host)
    kvh.fill_random_(host_kv, gen)
    kvh.poison_(device_kv)
    expected = device_kv.clone()
    host_ids, dev_ids = gapped_ids(gen, num, num_host, num_dev)
    kwargs = {} if config is None else {"config": config}
    for layer in range(layout.num_layers):
        load_layer(host_kv, device_kv, layer, host_ids, dev_ids, **kwargs)
        load_layer_reference(host_kv, expected, layer, host_ids, dev_ids)
        assert kvh.same_bytes(device_kv, expected), f"layer {layer}"
    for h, d in zip(host_ids, dev_ids, strict=True):
        assert kvh.same_bytes(expected[:, d], host_kv[h])
    untouched = [p for p in range(num_dev) if p not in dev_ids]
    assert bool((device_kv[:, untouched].view(-1).view(torch.uint8) == kvh.POISON_BYTE).all())


@pytest.mark.parametrize("kind", ["mha", "mla"])
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_backup_matches_reference(kind, page_size, dtype, kvh):
    plan = check_backup(small_layout(kind, dtype, page_size), kvh, seed=page_size)
    assert plan is not None and plan.num_programs <= 16


@pytest.mark.parametrize("kind", ["mha", "mla"])
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_load_layer_matches_reference(kind, page_size, dtype, kvh):
    check_load_all_layers(small_layout(kind, dtype, page_size), kvh, seed=page_size + 1)


@pytest.mark.parametrize(
    "config",
    [
        CopyConfig(max_programs=1, tile_bytes=8),  # one row of one access per step
        CopyConfig(max_programs=3, tile_bytes=128),  # tiles span chunks; ragged last tile
        CopyConfig(max_programs=5, tile_bytes=2048),
        CopyConfig(max_programs=1, tile_bytes=16),
    ],
)
def test_launch_shapes_that_split_and_join_chunks(config, kvh):
    layout = small_layout("mla", "float16", 4)  # 4 x 16 x 2 B = 128 B chunks
    plan = check_backup(layout, kvh, config=config, seed=11)
    assert plan.num_programs <= config.max_programs
    check_load_all_layers(layout, kvh, config=config, seed=12)


@pytest.mark.parametrize(
    ("layout", "width"),
    [
        (KVLayout("mha", 2, 1, "float16", num_kv_heads=1, head_dim=1), 4),  # 4 B chunks
        (KVLayout("mla", 2, 1, "bfloat16", kv_lora_rank=1, rope_dim=0), 2),  # 2 B chunks
        (KVLayout("mla", 2, 3, "float8_e4m3fn", kv_lora_rank=3, rope_dim=0), 1),  # 9 B chunks
        (KVLayout("mla", 2, 2, "float8_e4m3fn", kv_lora_rank=36, rope_dim=4), 8),  # 80 B chunks
    ],
)
def test_narrow_chunks_use_a_narrower_access(layout, width, kvh):
    plan = check_backup(layout, kvh, seed=21)
    assert plan.width_bytes == width
    check_load_all_layers(layout, kvh, seed=22)


def test_destination_listed_twice_is_rejected_and_nothing_is_written(kvh):
    layout = small_layout("mha", "bfloat16", 4)
    device_kv, host_kv = make_kv(layout, 4, 4)
    kvh.fill_random_(device_kv, torch.Generator().manual_seed(0))
    kvh.poison_(host_kv)
    for copy in (backup, backup_reference):
        with pytest.raises(PageIdError, match="destination page id 2 listed twice"):
            copy(device_kv, host_kv, [0, 1], [2, 2])
    for copy in (load_layer, load_layer_reference):
        with pytest.raises(PageIdError, match="destination page id 3 listed twice"):
            copy(host_kv, device_kv, 0, [0, 1, 2], [3, 1, 3])
    assert bool((host_kv.view(-1).view(torch.uint8) == kvh.POISON_BYTE).all())


def test_a_source_may_be_listed_twice(kvh):
    layout = small_layout("mla", "float32", 2)
    device_kv, host_kv = make_kv(layout, 3, 3)
    kvh.fill_random_(device_kv, torch.Generator().manual_seed(1))
    kvh.poison_(host_kv)
    backup(device_kv, host_kv, [1, 1], [0, 2])
    assert kvh.same_bytes(host_kv[0], device_kv[:, 1])
    assert kvh.same_bytes(host_kv[2], device_kv[:, 1])


@pytest.mark.parametrize(
    ("src", "dst", "message"),
    [
        ([0, 7], [0, 1], "source page id 7 out of range"),
        ([-1], [0], "source page id -1 out of range"),
        ([0], [4], "destination page id 4 out of range"),
        ([0, 1], [0], "2 source page ids but 1 destination"),
        ([0.0], [1], "integers"),
        ([[0]], [[1]], "one-dimensional"),
        ([[]], [[]], "one-dimensional"),
        (["a"], [1], "page ids"),
    ],
)
def test_bad_page_ids_are_rejected(src, dst, message):
    layout = small_layout("mha", "float16", 2)
    device_kv, host_kv = make_kv(layout, 7, 4)
    with pytest.raises(PageIdError, match=message):
        backup(device_kv, host_kv, src, dst)
    with pytest.raises(PageIdError, match=message):
        backup_reference(device_kv, host_kv, src, dst)


def test_page_ids_may_be_tensors_or_arrays():
    import numpy as np

    src, dst = check_page_ids(np.array([3, 1], dtype=np.int32), torch.tensor([0, 2]), 4, 4)
    assert src.dtype == dst.dtype == torch.int64
    assert src.tolist() == [3, 1] and dst.tolist() == [0, 2]
    empty_src, empty_dst = check_page_ids([], [], 4, 4)
    assert empty_src.numel() == empty_dst.numel() == 0


def test_mismatched_tensors_are_rejected():
    layout = small_layout("mha", "float16", 2)
    device_kv, host_kv = make_kv(layout, 4, 4)
    other_dtype = host_kv.to(torch.float32)
    with pytest.raises(KVTensorError, match="dtype mismatch"):
        backup(device_kv, other_dtype, [0], [0])
    fewer_layers = host_kv[:, :2].contiguous()
    with pytest.raises(KVTensorError, match="shape mismatch"):
        backup(device_kv, fewer_layers, [0], [0])
    other_heads = make_kv(KVLayout("mha", 3, 2, "float16", num_kv_heads=1, head_dim=16), 4, 4)[1]
    with pytest.raises(KVTensorError, match="shape mismatch"):
        load_layer(other_heads, device_kv, 0, [0], [0])
    strided = device_kv.transpose(0, 1)
    with pytest.raises(KVTensorError, match="contiguous"):
        backup(strided, host_kv, [0], [0])
    with pytest.raises(KVTensorError, match=">= 4 dims"):
        backup(device_kv.view(3, 4, -1), host_kv, [0], [0])
    with pytest.raises(KVTensorError, match="torch.Tensor"):
        backup(device_kv.numpy(), host_kv, [0], [0])


@pytest.mark.parametrize("layer", [-1, 3, True, 1.0])
def test_layer_out_of_range_is_rejected(layer):
    device_kv, host_kv = make_kv(small_layout("mla", "float16", 2), 4, 4)
    with pytest.raises(KVTensorError, match="layer must be an int in"):
        load_layer(host_kv, device_kv, layer, [0], [0])
    with pytest.raises(KVTensorError, match="layer must be an int in"):
        load_layer_reference(host_kv, device_kv, layer, [0], [0])


def test_unchecked_ids_must_be_int64_tensors_on_the_device():
    device_kv, host_kv = make_kv(small_layout("mla", "float16", 2), 4, 4)
    with pytest.raises(PageIdError, match="check_ids=False"):
        backup(device_kv, host_kv, [0], [0], check_ids=False)
    with pytest.raises(PageIdError, match="check_ids=False"):
        backup(
            device_kv,
            host_kv,
            torch.tensor([0], dtype=torch.int32),
            torch.tensor([0]),
            check_ids=False,
        )


def test_empty_copy_launches_nothing(kvh):
    device_kv, host_kv = make_kv(small_layout("mha", "float16", 2), 4, 4)
    kvh.poison_(host_kv)
    assert backup(device_kv, host_kv, [], []) is None
    assert load_layer(host_kv, device_kv, 0, [], []) is None
    assert bool((host_kv.view(-1).view(torch.uint8) == kvh.POISON_BYTE).all())


def test_kernels_refuse_cpu_tensors_outside_the_interpreter(monkeypatch):
    device_kv, host_kv = make_kv(small_layout("mha", "float16", 2), 4, 4)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(KVTensorError, match="need a CUDA device"):
        backup(device_kv, host_kv, [0], [0])


@pytest.mark.parametrize(
    "kwargs", [{"max_programs": 0}, {"num_warps": 3}, {"tile_bytes": 100}, {"tile_bytes": 4}]
)
def test_copy_config_is_validated(kwargs):
    with pytest.raises(ValueError, match="CopyConfig"):
        CopyConfig(**kwargs)


# -- GPU, realistic sizes ---------------------------------------------------------------------

GPU_LAYOUTS = {
    "gqa-8b-p64-bf16": KVLayout("mha", 32, 64, "bfloat16", num_kv_heads=8, head_dim=128),
    "gqa-8b-p16-fp16": KVLayout("mha", 32, 16, "float16", num_kv_heads=8, head_dim=128),
    "mla-dsv3-p16-bf16": KVLayout("mla", 61, 16, "bfloat16", kv_lora_rank=512, rope_dim=64),
    "mla-dsv3-p64-bf16": KVLayout("mla", 61, 64, "bfloat16", kv_lora_rank=512, rope_dim=64),
    "mha-p1-fp32": KVLayout("mha", 8, 1, "float32", num_kv_heads=4, head_dim=64),
}


def gpu_pools(layout, device, pool_bytes=1 << 30):
    num_dev = max(8, pool_bytes // layout.bytes_per_page)
    num_host = num_dev + num_dev // 4
    device_kv, host_kv = make_kv(layout, num_dev, num_host, device=device)
    return device_kv, host_kv, int(num_dev * 3 // 4)


def fill_random_cuda_(kv: torch.Tensor, seed: int) -> None:
    """Random bytes, drawn on the device (fast at GiB sizes)."""
    gen = torch.Generator(device=kv.device).manual_seed(seed)
    kv.view(-1).view(torch.uint8).random_(0, 256, generator=gen)


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(GPU_LAYOUTS))
def test_gpu_backup_and_load_match_reference(name, cuda_device, kvh):
    layout = GPU_LAYOUTS[name]
    device_kv, host_kv, num = gpu_pools(layout, cuda_device)
    gen = torch.Generator().manual_seed(7)
    dev_ids, host_ids = gapped_ids(gen, num, device_kv.shape[1], host_kv.shape[0])
    fill_random_cuda_(device_kv, 1)
    kvh.poison_(host_kv)
    plan = backup(device_kv, host_kv, dev_ids, host_ids)
    torch.cuda.synchronize()
    assert plan.num_programs <= 16
    host_on_gpu = host_kv.to(cuda_device)
    expected = device_kv[:, torch.tensor(dev_ids, device=cuda_device)].transpose(0, 1)
    assert kvh.same_bytes(host_on_gpu[torch.tensor(host_ids, device=cuda_device)], expected)
    untouched = torch.ones(host_kv.shape[0], dtype=torch.bool)
    untouched[host_ids] = False
    poison = host_on_gpu[untouched.to(cuda_device)].view(-1).view(torch.uint8)
    assert bool((poison == kvh.POISON_BYTE).all())
    del host_on_gpu, poison, expected

    # Load every layer back into other device pages (poisoned), and compare with the source.
    load_dev_ids = torch.randperm(device_kv.shape[1], generator=gen)[:num].tolist()
    reloaded = kvh.poison_(torch.empty_like(device_kv))
    for layer in range(layout.num_layers):
        load_layer(host_kv, reloaded, layer, host_ids, load_dev_ids)
    torch.cuda.synchronize()
    load_idx = torch.tensor(load_dev_ids, device=cuda_device)
    src_idx = torch.tensor(dev_ids, device=cuda_device)
    assert kvh.same_bytes(reloaded[:, load_idx], device_kv[:, src_idx])
    untouched = torch.ones(device_kv.shape[1], dtype=torch.bool, device=cuda_device)
    untouched[load_idx] = False
    assert bool((reloaded[:, untouched].view(-1).view(torch.uint8) == kvh.POISON_BYTE).all())


GPU_CONFIGS = {
    "default": CopyConfig(),
    "small-tiles": CopyConfig(tile_bytes=16384, num_warps=4),
    "8-programs": CopyConfig(max_programs=8, tile_bytes=65536, num_warps=16),
}


@pytest.mark.gpu
@pytest.mark.parametrize("config_name", list(GPU_CONFIGS))
@pytest.mark.parametrize("name", ["mla-dsv3-p16-bf16", "gqa-8b-p16-fp16", "mha-p1-fp32"])
def test_gpu_reference_path_agrees_with_kernels(name, config_name, cuda_device, kvh):
    layout, config = GPU_LAYOUTS[name], GPU_CONFIGS[config_name]
    device_kv, host_kv, num = gpu_pools(layout, cuda_device, pool_bytes=256 << 20)
    gen = torch.Generator().manual_seed(3)
    dev_ids, host_ids = gapped_ids(gen, num, device_kv.shape[1], host_kv.shape[0])
    fill_random_cuda_(device_kv, 2)
    kvh.poison_(host_kv)
    expected = host_kv.clone()
    plan = backup(device_kv, host_kv, dev_ids, host_ids, config=config)
    torch.cuda.synchronize()
    assert plan.num_programs <= config.max_programs
    backup_reference(device_kv, expected, dev_ids, host_ids)
    assert kvh.same_bytes(host_kv, expected)
    reloaded = kvh.poison_(torch.empty_like(device_kv))
    expected_dev = reloaded.clone()
    for layer in (0, layout.num_layers // 2, layout.num_layers - 1):
        load_layer(host_kv, reloaded, layer, host_ids, dev_ids, config=config)
        load_layer_reference(host_kv, expected_dev, layer, host_ids, dev_ids)
    torch.cuda.synchronize()
    assert kvh.same_bytes(reloaded, expected_dev)


@pytest.mark.gpu
def test_gpu_kernels_refuse_unpinned_host_memory(cuda_device):
    layout = small_layout("mha", "bfloat16", 16)
    device_kv = torch.empty(
        (3, 4, 16, *layout.token_shape), dtype=torch.bfloat16, device=cuda_device
    )
    host_kv = torch.empty((4, 3, 16, *layout.token_shape), dtype=torch.bfloat16)
    with pytest.raises(KVTensorError, match="not pinned"):
        backup(device_kv, host_kv, [0], [0])
