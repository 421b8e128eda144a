"""DevicePool and HostPool: shapes, views, sizing from memory, pinning and its fallback."""

from __future__ import annotations

import warnings

import pytest
import torch

from tiers.device_pool import DevicePool
from tiers.errors import MemoryBudgetError, PageIdError
from tiers.host_pool import HostPool, UnpinnedHostMemoryWarning, available_host_memory_bytes
from tiers.layout import KVLayout

MHA = KVLayout("mha", num_layers=3, page_size=4, dtype="bfloat16", num_kv_heads=2, head_dim=8)
MLA = KVLayout("mla", num_layers=2, page_size=16, dtype="float16", kv_lora_rank=24, rope_dim=8)


def host_pool(layout, num_pages):
    """A host pool that does not warn on machines that cannot pin."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnpinnedHostMemoryWarning)
        return HostPool(layout, num_pages)


@pytest.mark.parametrize("layout", [MHA, MLA])
def test_device_pool_is_one_layer_first_allocation(layout):
    pool = DevicePool(layout, 5, device="cpu")
    assert pool.kv.shape == (layout.num_layers, 5, layout.page_size, *layout.token_shape)
    assert pool.kv.dtype == layout.torch_dtype and pool.kv.is_contiguous()
    assert pool.nbytes == 5 * layout.bytes_per_page
    assert pool.num_pages == 5
    assert not hasattr(pool, "allocator")  # one allocator over these ids: its owner's
    layer = pool.layer(1)
    assert layer.shape == (5, layout.page_size, *layout.token_shape)
    layer[3].fill_(1.5)  # a view: writes land in the pool
    assert bool((pool.kv[1, 3] == 1.5).all())


def test_device_pool_layer_view_aliases_the_pool():
    pool = DevicePool(MHA, 4, device="cpu")
    offset = pool.layer(2).data_ptr() - pool.kv.data_ptr()
    assert offset == 2 * 4 * MHA.bytes_per_page_per_layer


@pytest.mark.parametrize("layer", [-1, 3])
def test_device_pool_layer_out_of_range(layer):
    with pytest.raises(IndexError, match="out of range"):
        DevicePool(MHA, 2, device="cpu").layer(layer)


def test_device_pool_from_free_memory_sizes_from_the_budget():
    page = MHA.bytes_per_page
    pool = DevicePool.from_free_memory(
        MHA, "cpu", free_bytes=100 * page + 1000, reserve_bytes=1000, fraction=0.5
    )
    assert pool.num_pages == 50
    assert pool.device == torch.device("cpu")


def test_device_pool_from_free_memory_errors():
    page = MHA.bytes_per_page
    with pytest.raises(MemoryBudgetError, match="less than one page"):
        DevicePool.from_free_memory(MHA, "cpu", free_bytes=page, reserve_bytes=page // 2)
    with pytest.raises(MemoryBudgetError, match="less than one page"):
        DevicePool.from_free_memory(MHA, "cpu", free_bytes=page, reserve_bytes=2 * page)
    with pytest.raises(ValueError, match="free_bytes must be given"):
        DevicePool.from_free_memory(MHA, "cpu")
    with pytest.raises(ValueError, match="fraction"):
        DevicePool.from_free_memory(MHA, "cpu", free_bytes=10 * page, fraction=0)
    with pytest.raises(ValueError, match="reserve_bytes"):
        DevicePool.from_free_memory(MHA, "cpu", free_bytes=10 * page, reserve_bytes=-1)


@pytest.mark.parametrize("layout", [MHA, MLA])
def test_host_pool_is_page_first(layout):
    pool = host_pool(layout, 6)
    assert pool.kv.shape == (6, layout.num_layers, layout.page_size, *layout.token_shape)
    assert pool.kv.device.type == "cpu" and pool.kv.is_contiguous()
    assert pool.nbytes == 6 * layout.bytes_per_page
    assert pool.num_pages == 6
    assert not hasattr(pool, "allocator")


def test_page_bytes_is_a_zero_copy_writable_view_of_one_page(kvh):
    pool = host_pool(MHA, 4)
    kvh.fill_random_(pool.kv, torch.Generator().manual_seed(0))
    view = pool.page_bytes(2)
    assert isinstance(view, memoryview) and not view.readonly
    assert view.nbytes == MHA.bytes_per_page
    assert bytes(view) == pool.kv[2].contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    view[:] = b"\x01" * MHA.bytes_per_page  # writes reach the pool, and only page 2
    assert bool((pool.kv[2].view(-1).view(torch.uint8) == 1).all())
    assert not bool((pool.kv[1].view(-1).view(torch.uint8) == 1).all())
    pool.kv[2].zero_()  # and the pool's writes show through the view
    assert bytes(view) == bytes(MHA.bytes_per_page)


@pytest.mark.parametrize("bad", [-1, 4, True, 1.0])
def test_page_bytes_rejects_bad_ids(bad):
    with pytest.raises(PageIdError):
        host_pool(MHA, 4).page_bytes(bad)


@pytest.mark.skipif(torch.cuda.is_available(), reason="pinning works here")
def test_host_pool_without_cuda_falls_back_with_one_warning():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        pools = [HostPool(MHA, 2) for _ in range(3)]
    unpinned = [w for w in caught if issubclass(w.category, UnpinnedHostMemoryWarning)]
    assert len(unpinned) == 1 and "no CUDA device" in str(unpinned[0].message)
    assert not any(pool.pinned for pool in pools)
    assert not pools[0].kv.is_pinned()


def test_host_pool_without_pinning_asked_does_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pool = HostPool(MLA, 2, pin=False)
    assert not pool.pinned


def test_host_pool_from_budget_counts_pages_and_checks_ram():
    page = MLA.bytes_per_page
    pool = HostPool.from_budget(
        MLA, 10 * page + 5, reserve_bytes=page, available_bytes=20 * page, pin=False
    )
    assert pool.num_pages == 10
    with pytest.raises(MemoryBudgetError, match="does not fit") as info:
        HostPool.from_budget(MLA, 10 * page, reserve_bytes=page, available_bytes=10 * page)
    assert "10 pages" in str(info.value)
    with pytest.raises(MemoryBudgetError, match="less than one page"):
        HostPool.from_budget(MLA, page - 1, available_bytes=100 * page)
    with pytest.raises(ValueError, match="budget_bytes"):
        HostPool.from_budget(MLA, -1)


def test_host_pool_from_budget_reads_available_ram():
    available = available_host_memory_bytes()
    assert available > 0
    with pytest.raises(MemoryBudgetError, match="RAM available"):
        HostPool.from_budget(MLA, available + (1 << 30), reserve_bytes=0)


@pytest.mark.gpu
def test_gpu_host_pool_is_pinned_and_unpins_on_close(cuda_device):
    pool = HostPool(MHA, 8)
    assert pool.pinned and pool.kv.is_pinned()
    pool.close()
    assert not pool.pinned and not pool.kv.is_pinned()
    pool.close()  # idempotent


@pytest.mark.gpu
def test_gpu_device_pool_from_free_memory(cuda_device):
    free_bytes, _ = torch.cuda.mem_get_info(cuda_device)
    reserve = free_bytes - 64 * MHA.bytes_per_page  # leave room for about 64 pages
    pool = DevicePool.from_free_memory(MHA, "cuda", reserve_bytes=reserve, fraction=1.0)
    assert 32 <= pool.num_pages <= 64
    assert pool.kv.device == cuda_device
