"""TransferEngine: synchronous on the CPU; on CUDA, ordered on a copy stream by events."""

from __future__ import annotations

import warnings

import pytest
import torch

from tiers.device_pool import DevicePool
from tiers.errors import KVTensorError, PageIdError
from tiers.host_pool import HostPool, UnpinnedHostMemoryWarning
from tiers.layout import KVLayout
from tiers.transfer import LINK_SAMPLE_BYTES, TransferEngine

MHA = KVLayout("mha", num_layers=4, page_size=16, dtype="bfloat16", num_kv_heads=2, head_dim=8)
MLA = KVLayout("mla", num_layers=3, page_size=4, dtype="float16", kv_lora_rank=20, rope_dim=4)


def pools(layout, num_device_pages=6, num_host_pages=8, device="cpu", pin=True):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnpinnedHostMemoryWarning)
        host = HostPool(layout, num_host_pages, pin=pin)
    return DevicePool(layout, num_device_pages, device=device), host


@pytest.mark.parametrize("kernel", ["reference", "triton"])
@pytest.mark.parametrize("layout", [MHA, MLA], ids=["mha", "mla"])
def test_cpu_backup_then_load_round_trips(kernel, layout, kvh):
    device_pool, host_pool = pools(layout)
    engine = TransferEngine(device_pool, host_pool, kernel=kernel)
    assert engine.kernel == kernel and engine.copy_stream is None
    kvh.fill_random_(device_pool.kv, torch.Generator().manual_seed(5))
    kvh.poison_(host_pool.kv)
    source = device_pool.kv.clone()

    backup = engine.backup_async([4, 0, 2], [7, 1, 3])
    assert backup.is_done()  # synchronous on the CPU
    backup.wait()
    for d, h in [(4, 7), (0, 1), (2, 3)]:
        assert kvh.same_bytes(host_pool.kv[h], source[:, d])

    kvh.poison_(device_pool.kv)
    load = engine.load_async([7, 1, 3], [1, 5, 3])
    assert load.is_done() and load.num_layers == layout.num_layers
    for layer in range(layout.num_layers):
        load.wait_layer(layer)
    load.wait()
    for d_src, d_dst in [(4, 1), (0, 5), (2, 3)]:
        assert kvh.same_bytes(device_pool.kv[:, d_dst], source[:, d_src])
    untouched = device_pool.kv[:, [0, 2, 4]].reshape(-1).view(torch.uint8)
    assert bool((untouched == kvh.POISON_BYTE).all())


def test_auto_picks_the_reference_path_on_the_cpu():
    engine = TransferEngine(*pools(MHA))
    assert engine.kernel == "reference"


def test_wait_layer_checks_its_argument():
    load = TransferEngine(*pools(MHA)).load_async([0], [0])
    with pytest.raises(IndexError, match="out of range"):
        load.wait_layer(MHA.num_layers)
    with pytest.raises(TypeError):
        load.wait_layer("0")


def test_bad_ids_issue_nothing(kvh):
    device_pool, host_pool = pools(MLA)
    engine = TransferEngine(device_pool, host_pool)
    kvh.poison_(host_pool.kv)
    kvh.poison_(device_pool.kv)
    with pytest.raises(PageIdError, match="listed twice"):
        engine.backup_async([0, 1], [2, 2])
    with pytest.raises(PageIdError, match="listed twice"):
        engine.load_async([0, 1], [3, 3])
    with pytest.raises(PageIdError, match="out of range"):
        engine.load_async([8], [0])
    with pytest.raises(PageIdError, match="out of range"):
        engine.backup_async([6], [0])
    assert bool((host_pool.kv.view(-1).view(torch.uint8) == kvh.POISON_BYTE).all())
    assert bool((device_pool.kv.view(-1).view(torch.uint8) == kvh.POISON_BYTE).all())


def test_empty_transfers_are_done_at_once():
    engine = TransferEngine(*pools(MHA))
    assert engine.backup_async([], []).is_done()
    load = engine.load_async([], [])
    assert load.is_done()
    load.wait_layer(0)


def test_pools_of_different_layouts_are_rejected():
    device_pool, _ = pools(MHA)
    _, host_pool = pools(MLA)
    with pytest.raises(KVTensorError, match="different layouts"):
        TransferEngine(device_pool, host_pool)


def test_engine_options_are_checked(monkeypatch):
    with pytest.raises(ValueError, match="kernel must be one of"):
        TransferEngine(*pools(MHA), kernel="cuda")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(KVTensorError, match="TRITON_INTERPRET"):
        TransferEngine(*pools(MHA), kernel="triton")


# -- GPU: streams and events ------------------------------------------------------------------

GQA_8B = KVLayout(
    "mha", num_layers=32, page_size=64, dtype="bfloat16", num_kv_heads=8, head_dim=128
)


def _busy_then_fill_(kv_pages: torch.Tensor, value: float) -> None:
    """On the current stream: keep the GPU busy for a while, then write `value` into the pages.

    A transfer that does not wait for the current stream would run during the sleep and see
    the old contents."""
    torch.cuda._sleep(50_000_000)  # ~25 ms at ~2 GHz
    kv_pages.fill_(value)


GPU_KERNELS = pytest.mark.parametrize("kernel", ["triton", "copy_engine"])


@pytest.mark.gpu
@GPU_KERNELS
def test_gpu_backup_waits_for_the_compute_stream(cuda_device, kvh, kernel):
    device_pool, host_pool = pools(GQA_8B, 64, 96, device=cuda_device)
    engine = TransferEngine(device_pool, host_pool, kernel=kernel)
    assert engine.kernel == kernel and host_pool.pinned
    engine.backup_async([0], [0]).wait()  # warm: kernels compiled, pinned id buffers cached
    kvh.poison_(host_pool.kv)
    dev_ids, host_ids = [3, 40, 17], [90, 2, 55]
    for d in dev_ids:
        _busy_then_fill_(device_pool.kv[:, d], float(d))
    backup = engine.backup_async(dev_ids, host_ids)
    backup.wait()
    assert backup.is_done()
    for d, h in zip(dev_ids, host_ids, strict=True):
        assert bool((host_pool.kv[h] == float(d)).all()), f"host page {h} is stale"


@pytest.mark.gpu
@GPU_KERNELS
def test_gpu_load_layer_events_order_the_consumer(cuda_device, kvh, kernel):
    device_pool, host_pool = pools(GQA_8B, 96, 64, device=cuda_device)
    engine = TransferEngine(device_pool, host_pool, kernel=kernel)
    gen = torch.Generator().manual_seed(9)
    kvh.fill_random_(host_pool.kv, gen)
    kvh.poison_(device_pool.kv)
    host_ids = torch.randperm(64, generator=gen)[:40].tolist()
    dev_ids = torch.randperm(96, generator=gen)[:40].tolist()
    torch.cuda.synchronize()
    load = engine.load_async(host_ids, dev_ids)
    idx = torch.tensor(dev_ids, device=cuda_device)
    seen = []
    for layer in range(GQA_8B.num_layers):  # the consumer: read layer i right after its event
        load.wait_layer(layer)
        seen.append(device_pool.layer(layer)[idx].clone())
    torch.cuda.current_stream().synchronize()
    assert load.is_done()
    expected = host_pool.kv[host_ids]  # (n, L, S, 2, H, D)
    for layer in range(GQA_8B.num_layers):
        assert kvh.same_bytes(seen[layer], expected[:, layer]), f"layer {layer} read too early"


@pytest.mark.gpu
@GPU_KERNELS
def test_gpu_load_waits_for_earlier_readers_and_backups_follow_loads(cuda_device, kvh, kernel):
    device_pool, host_pool = pools(GQA_8B, 8, 8, device=cuda_device)
    engine = TransferEngine(device_pool, host_pool, kernel=kernel)
    kvh.fill_random_(host_pool.kv, torch.Generator().manual_seed(4))
    engine.load_async([6], [2]).wait()  # warm: kernels compiled, pinned id buffers cached
    device_pool.kv.fill_(1.0)
    torch.cuda.synchronize()
    torch.cuda._sleep(50_000_000)
    before = device_pool.kv[:, 2].clone()  # a reader queued before the load
    engine.load_async([6], [2])
    after = engine.backup_async([2], [0])  # same stream: sees the loaded page
    after.wait()
    torch.cuda.synchronize()
    assert bool((before == 1.0).all()), "the load overwrote a page an earlier kernel was reading"
    assert kvh.same_bytes(host_pool.kv[0], host_pool.kv[6])


@pytest.mark.gpu
def test_gpu_unpinned_host_pool_falls_back_to_the_reference(cuda_device, kvh):
    device_pool, host_pool = pools(MLA, 6, 8, device=cuda_device, pin=False)
    engine = TransferEngine(device_pool, host_pool)
    assert engine.kernel == "reference"
    kvh.fill_random_(host_pool.kv, torch.Generator().manual_seed(8))
    engine.load_async([5, 1], [0, 4]).wait()
    assert kvh.same_bytes(device_pool.kv[:, 0], host_pool.kv[5])
    assert kvh.same_bytes(device_pool.kv[:, 4], host_pool.kv[1])
    with pytest.raises(KVTensorError, match="pinned"):
        TransferEngine(device_pool, host_pool, kernel="triton")


def test_copy_engine_needs_cuda():
    with pytest.raises(KVTensorError, match="copy_engine"):
        TransferEngine(*pools(MHA), kernel="copy_engine")


MLA_P64 = KVLayout(
    "mla", num_layers=5, page_size=64, dtype="bfloat16", kv_lora_rank=512, rope_dim=64
)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", [GQA_8B, MLA_P64], ids=["gqa", "mla"])
def test_gpu_copy_engine_round_trip_with_gaps(cuda_device, kvh, layout):
    device_pool, host_pool = pools(layout, 48, 64, device=cuda_device)
    auto = TransferEngine(device_pool, host_pool, kernel="copy_engine")
    assert TransferEngine(device_pool, host_pool).kernel == "copy_engine+triton"
    gen = torch.Generator().manual_seed(11)
    kvh.fill_random_(device_pool.kv, gen)
    kvh.poison_(host_pool.kv)
    dev_ids = torch.randperm(48, generator=gen)[:20].tolist()
    host_ids = torch.randperm(64, generator=gen)[:20].tolist()
    source = device_pool.kv.clone()
    auto.backup_async(dev_ids, host_ids).wait()
    for d, h in zip(dev_ids, host_ids, strict=True):
        assert kvh.same_bytes(host_pool.kv[h], source[:, d])
    others = sorted(set(range(64)) - set(host_ids))
    assert bool((host_pool.kv[others].view(-1).view(torch.uint8) == kvh.POISON_BYTE).all())
    kvh.poison_(device_pool.kv)
    targets = torch.randperm(48, generator=gen)[:20].tolist()
    load = auto.load_async(host_ids, targets)
    load.wait()
    for h, d in zip(host_ids, targets, strict=True):
        assert kvh.same_bytes(device_pool.kv[:, d], host_pool.kv[h])
    with pytest.raises(PageIdError, match="listed twice"):
        auto.load_async([1, 2], [5, 5])


@pytest.mark.gpu
def test_gpu_small_chunks_stay_on_the_kernels(cuda_device):
    small = KVLayout(
        "mla", num_layers=4, page_size=16, dtype="bfloat16", kv_lora_rank=512, rope_dim=64
    )
    assert TransferEngine(*pools(small, 8, 8, device=cuda_device)).kernel == "triton"


def test_page_runs_split_pairs_where_both_ids_step_by_one():
    from tiers.copy_engine import page_runs

    runs, rest = page_runs([4, 5, 6, 9, 1, 2, 8], [10, 11, 12, 13, 0, 3, 4])
    assert runs == [(4, 10, 3)]  # (9, 13) is alone; (1, 0) -> (2, 3) skips a device id
    assert rest.tolist() == [3, 4, 5, 6]
    assert page_runs([], [])[0] == [] and page_runs([], [])[1].size == 0


@pytest.mark.gpu
def test_gpu_copy_engine_moves_runs_and_stray_pages_alike(cuda_device, kvh):
    """Runs of consecutive pages go as one strided copy per layer, the rest as a batch:
    every page lands where it belongs, and nothing else is written."""
    device_pool, host_pool = pools(GQA_8B, 48, 64, device=cuda_device)
    engine = TransferEngine(device_pool, host_pool, kernel="copy_engine")
    gen = torch.Generator().manual_seed(3)
    kvh.fill_random_(host_pool.kv, gen)
    kvh.poison_(device_pool.kv)
    host_ids = [*range(10, 30), 40, 2, *range(50, 55)]
    dev_ids = [*range(0, 20), 33, 21, *range(40, 45)]
    load = engine.load_async(host_ids, dev_ids)
    load.wait()
    for h, d in zip(host_ids, dev_ids, strict=True):
        assert kvh.same_bytes(device_pool.kv[:, d], host_pool.kv[h])
    untouched = sorted(set(range(48)) - set(dev_ids))
    assert bool((device_pool.kv[:, untouched].view(-1).view(torch.uint8) == kvh.POISON_BYTE).all())


def test_cpu_warm_up_times_nothing():
    device_pool, host_pool = pools(MHA)
    assert TransferEngine(device_pool, host_pool).warm_up() is None


@pytest.mark.gpu
def test_gpu_warm_up_times_a_load_large_enough_to_show_the_link(cuda_device):
    """warm_up times a load of LINK_SAMPLE_BYTES on the copy stream: the link's rate for a
    new cache's load-or-recompute choice (hicache.fetch_plan), before any request has
    measured it. Pools too small for a load that size time nothing."""
    pages = -(-LINK_SAMPLE_BYTES // MHA.bytes_per_page)
    device_pool, host_pool = pools(MHA, pages + 3, pages, device=cuda_device)
    num_bytes, seconds = TransferEngine(device_pool, host_pool).warm_up()
    assert num_bytes == pages * MHA.bytes_per_page >= LINK_SAMPLE_BYTES
    assert num_bytes / seconds > 1e9  # a few GB/s at the least over any PCIe or NVLink
    device_pool, host_pool = pools(MHA, 20, 24, device=cuda_device)
    assert TransferEngine(device_pool, host_pool).warm_up() is None
