"""SGLang's v2 storage API through hicache, on SGLang's real extra host pools.

Each hybrid model's extra pool, built on the CPU by `tests.support.sglang_cpu` the way
SGLang's assembler builds it: the sliding-window pool of a `HostPoolGroup` (SWA hybrids:
Gemma, Qwen3.5), the DSA indexer of a `HostPoolGroup` (DeepSeek-V3.2), Mamba state
(Qwen3-Next, Nemotron-H), DeepSeek-V4's c4/c128 compressed KV and c4 compress state, and a
draft model's KV. The calls are the ones SGLang's `HybridCacheController` makes:
`register_mem_host_pool_v2`, `batch_exists_v2` with `PoolTransfer`s and hit policies,
`batch_set_v2` / `batch_get_v2` per pool. Every read is checked bit for bit.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

pytest.importorskip("sglang", reason="install tests/engine_integration/requirements-sglang.txt")
pytest.importorskip("torchvision", reason="pip install --no-deps torchvision==0.28.0 (.ci/run)")

from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorageConfig,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
)
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
from sglang.srt.mem_cache.utils import get_storage_hash_str

from engine_integration.sglang.storage import HiCacheSGLangStorage
from storage_backends import BackendConfigError
from tests.support import sglang_cpu

PAGE = 4
NUM_PAGES = 8


def extra_config(url: str) -> dict:
    return {
        "backend_name": "hicache", "module_path": "engine_integration.sglang.storage",
        "class_name": "HiCacheSGLangStorage", "interface_v1": 1, "url": url,
    }  # fmt: skip


def storage_config(url: str, *, mla: bool, tp=(0, 1)) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(
        tp_rank=tp[0], tp_size=tp[1], pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=mla, enable_storage_metrics=False, is_page_first_layout=True,
        model_name="org/hybrid", extra_config=extra_config(url),
    )  # fmt: skip


def _entry(group, name: PoolName):
    return next(e.host_pool for e in group.entries if e.name == name)


def _plain(attention: str, page_size: int = PAGE):
    return sglang_cpu.host_pool(
        attention, "page_first", layer_num=2, page_size=page_size, num_pages=NUM_PAGES
    )


def build(kind: str):
    """(KV anchor pool, extra pool name, extra pool, is_mla) of one hybrid kind."""
    if kind == "swa":
        group = sglang_cpu.swa_group(page_size=PAGE, num_pages=NUM_PAGES)
        return _entry(group, PoolName.KV), "swa", _entry(group, PoolName.SWA), False
    if kind == "indexer":
        group = sglang_cpu.dsa_group(num_pages=NUM_PAGES)
        return _entry(group, PoolName.KV), "indexer", _entry(group, PoolName.INDEXER), True
    if kind == "mamba":
        return _plain("mha"), "mamba", sglang_cpu.mamba_pool(num_slots=NUM_PAGES), False
    if kind == "draft":
        return _plain("mha"), "draft", _plain("mha"), False
    pools = sglang_cpu.deepseek_v4_pools(page_size=PAGE, num_pages=NUM_PAGES)
    return _plain("mla"), kind, pools[kind], True


KINDS = ("swa", "indexer", "mamba", "draft", "deepseek_v4_c4", "deepseek_v4_c128",
         "deepseek_v4_c4_state")  # fmt: skip


def page_size_of(pool) -> int:
    return int(getattr(pool, "page_size", 1) or 1)


def slots(pool, *pages: int) -> torch.Tensor:
    """Host indices of whole pages of `pool` (page_size slots per page)."""
    size = page_size_of(pool)
    return torch.cat([torch.arange(p * size, (p + 1) * size) for p in pages])


def fill(pool, pages, seed: int) -> None:
    """Random bytes into each page, through the pool's own flat-page call."""
    generator = torch.Generator().manual_seed(seed)
    size = page_size_of(pool)
    for page in pages:
        dummy = pool.get_dummy_flat_data_page()
        raw = torch.randint(0, 256, (dummy.numel() * dummy.element_size(),), dtype=torch.uint8,
                            generator=generator)  # fmt: skip
        pool.set_from_flat_data_page(page * size, raw.view(dummy.dtype))


def bits(pool, page: int) -> torch.Tensor:
    flat = pool.get_data_page(page * page_size_of(pool), flat=True)
    return flat.contiguous().view(torch.uint8).clone()


def keys_of(num_pages: int, page_size: int) -> list[str]:
    generator = torch.Generator().manual_seed(uuid.uuid4().int % 2**63)
    tokens = torch.randint(0, 128_000, (num_pages * page_size,), generator=generator).tolist()
    return get_storage_hash_str(tokens, None, page_size=page_size)


def attach(url: str, anchor, name: str, extra, *, mla: bool, tp=(0, 1)) -> HiCacheSGLangStorage:
    """What SGLang's HybridCacheController.attach_storage_backend does."""
    cfg = storage_config(url, mla=mla, tp=tp)
    backend = StorageBackendFactory.create_backend("dynamic", cfg, anchor)
    backend.register_mem_pool_host(anchor)
    backend.register_mem_host_pool_v2(anchor, PoolName.KV)
    backend.register_mem_host_pool_v2(extra, PoolName(name))
    backend.on_host_pools_registered()
    return backend


@pytest.fixture
def url(tmp_path: Path) -> Callable[[], str]:
    return lambda: f"file://{tmp_path / uuid.uuid4().hex[:8]}?capacity=64MiB"


def write_hybrid(url: str, kind: str, num_pages: int = 3):
    """A writer stores KV pages 0.. and the extra pool's pages 0.. under the same keys."""
    anchor, name, extra, mla = build(kind)
    fill(anchor, range(num_pages), seed=1)
    fill(extra, range(num_pages), seed=2)
    writer = attach(url, anchor, name, extra, mla=mla)
    keys = keys_of(num_pages, page_size_of(anchor))
    pages = list(range(num_pages))
    assert writer.batch_set_v1(keys, slots(anchor, *pages)) == [True] * num_pages
    stored = writer.batch_set_v2(
        [PoolTransfer(name=PoolName(name), host_indices=slots(extra, *pages), keys=keys)]
    )
    assert stored == {PoolName(name): [True] * num_pages}
    expected = [bits(extra, p) for p in pages]
    writer.close()
    return keys, expected


@pytest.mark.parametrize("kind", KINDS)
def test_each_extra_pool_round_trips_bitwise_with_its_pages(url, kind):
    store = url()
    keys, expected = write_hybrid(store, kind)
    anchor, name, extra, mla = build(kind)
    fill(extra, range(NUM_PAGES), seed=3)  # another engine's bytes
    untouched = bits(extra, 0)
    reader = attach(store, anchor, name, extra, mla=mla)
    hit = reader.batch_exists_v2(keys, [PoolTransfer(name=PoolName(name), keys=keys)])
    assert hit.kv_hit_pages == 3 and hit.restorable_prefix_pages == [1, 2, 3]
    assert hit.extra_pool_hit_pages == {PoolName.KV: 3, PoolName(name): 3}
    transfer = PoolTransfer(name=PoolName(name), host_indices=slots(extra, 5, 3, 4), keys=keys)
    assert reader.batch_get_v2([transfer]) == {PoolName(name): [True, True, True]}
    for page, want in zip((5, 3, 4), expected, strict=True):
        assert torch.equal(bits(extra, page), want)
    assert torch.equal(bits(extra, 0), untouched)  # only the pages asked for
    reader.close()


@pytest.mark.parametrize("kind", ["swa", "mamba", "deepseek_v4_c4_state"])
@pytest.mark.parametrize("how", ["corrupt", "missing"])
def test_a_damaged_or_missing_sidecar_page_is_a_whole_miss(url, kind, how):
    store = url()
    keys, expected = write_hybrid(store, kind)
    anchor, name, extra, mla = build(kind)
    reader = attach(store, anchor, name, extra, mla=mla)
    sidecar = reader._sidecars[name]
    target = sidecar.object_keys(keys[1:2])
    if how == "missing":
        assert sidecar.store.delete(target) == 1
    else:
        blob = sidecar.store.batch_get_objects(target, verify=False)[0]
        damaged = bytearray(blob)
        damaged[-3] ^= 0x01  # one bit of the payload
        assert sidecar.store.batch_put_objects(target, [bytes(damaged)], verify=False) == [True]
    fill(extra, range(NUM_PAGES), seed=4)
    before = bits(extra, 6)
    transfer = PoolTransfer(name=PoolName(name), host_indices=slots(extra, 5, 6, 7), keys=keys)
    assert reader.batch_get_v2([transfer]) == {PoolName(name): [True, False, True]}
    assert torch.equal(bits(extra, 6), before)  # no partial load of the bad page
    assert torch.equal(bits(extra, 5), expected[0]) and torch.equal(bits(extra, 7), expected[2])
    if how == "missing":  # presence: the prefix stops there for an all-pages pool
        hit = reader.batch_exists_v2(keys, [PoolTransfer(name=PoolName(name), keys=keys)])
        assert hit.kv_hit_pages == 1 and hit.extra_pool_hit_pages[PoolName(name)] == 1
    else:
        assert sidecar.store.stats().num_corrupt_total == 1
    reader.close()


def test_trailing_pages_policy_restores_where_the_window_is_whole(url):
    """SWA / Mamba state: only the last `len(keys)` pages before a stop point must exist."""
    store = url()
    keys, _ = write_hybrid(store, "swa", num_pages=4)
    anchor, name, extra, _ = build("swa")
    reader = attach(store, anchor, name, extra, mla=False)
    sidecar = reader._sidecars[name]
    assert sidecar.store.delete(sidecar.object_keys(keys[1:2])) == 1  # page 1's window gone
    window = [
        PoolTransfer(name=PoolName.SWA, keys=keys[-1:], hit_policy=PoolHitPolicy.TRAILING_PAGES)
    ]
    hit = reader.batch_exists_v2(keys, window)
    assert hit.restorable_prefix_pages == [1, 3, 4] and hit.kv_hit_pages == 4
    wide = [
        PoolTransfer(name=PoolName.SWA, keys=keys[-2:], hit_policy=PoolHitPolicy.TRAILING_PAGES)
    ]
    hit = reader.batch_exists_v2(keys, wide)
    assert hit.restorable_prefix_pages == [1, 4] and hit.kv_hit_pages == 4
    all_pages = [PoolTransfer(name=PoolName.SWA, keys=keys)]
    assert reader.batch_exists_v2(keys, all_pages).kv_hit_pages == 1
    reader.close()


def test_mla_replicated_pools_have_one_writer_and_mamba_state_is_per_rank(url):
    store = url()
    anchor, _, indexer, _ = build("indexer")
    keys = keys_of(2, page_size_of(anchor))
    replica = attach(store, anchor, "indexer", indexer, mla=True, tp=(1, 2))
    done = replica.batch_set_v2(
        [PoolTransfer(name=PoolName.INDEXER, host_indices=slots(indexer, 0, 1), keys=keys)]
    )
    assert done == {PoolName.INDEXER: [False, False]} and replica.num_refused_writes == 2
    replica.close()

    mla_anchor = _plain("mla")
    states = [sglang_cpu.mamba_pool(num_slots=NUM_PAGES) for _ in range(2)]
    ranks = [
        attach(store, mla_anchor, "mamba", s, mla=True, tp=(r, 2)) for r, s in enumerate(states)
    ]
    fill(states[1], [0], seed=5)
    mamba = [PoolTransfer(name=PoolName.MAMBA, host_indices=slots(states[1], 0), keys=keys[:1])]
    assert ranks[1].batch_set_v2(mamba) == {PoolName.MAMBA: [True]}  # every rank writes its own
    probe = [PoolTransfer(name=PoolName.MAMBA, host_indices=slots(states[0], 2), keys=keys[:1])]
    assert ranks[0].batch_get_v2(probe) == {PoolName.MAMBA: [False]}  # rank 0 never sees rank 1's
    for backend in ranks:
        backend.close()


def test_v2_misuse_is_an_error_naming_the_pool(url):
    anchor, name, extra, mla = build("swa")
    backend = attach(url(), anchor, name, extra, mla=mla)
    keys = keys_of(1, PAGE)
    with pytest.raises(ValueError, match="host pool 'mamba' was not registered"):
        backend.batch_get_v2(
            [PoolTransfer(name=PoolName.MAMBA, host_indices=slots(extra, 0), keys=keys)]
        )
    with pytest.raises(BackendConfigError, match="block_groups"):
        backend.batch_exists_v2(
            keys,
            [PoolTransfer(name=PoolName.SWA, keys=keys, hit_policy=PoolHitPolicy.BLOCK_GROUPS)],
        )
    with pytest.raises(ValueError, match="pool 'swa': host_indices has 1 entries"):
        backend.batch_set_v2(
            [PoolTransfer(name=PoolName.SWA, host_indices=torch.arange(1), keys=keys)]
        )
    with pytest.raises(BackendConfigError, match="not the pool given to register_mem_pool_host"):
        backend.register_mem_host_pool_v2(_plain("mha"), PoolName.KV)
    backend.close()


def test_deepseek_v4_logical_anchor_with_its_compressed_pools(url):
    """DeepSeek-V4: the KV anchor has no bytes; c4, c128 and the c4 state carry each page."""
    store = url()
    names = ("deepseek_v4_c4", "deepseek_v4_c128", "deepseek_v4_c4_state")

    def engine(seed: int):
        pools = sglang_cpu.deepseek_v4_pools(page_size=PAGE, num_pages=NUM_PAGES)
        cfg = storage_config(store, mla=True)
        backend = StorageBackendFactory.create_backend("dynamic", cfg, pools["kv"])
        backend.register_mem_pool_host(pools["kv"])
        backend.register_mem_host_pool_v2(pools["kv"], PoolName.KV)
        for name in names:
            fill(pools[name], range(NUM_PAGES), seed=seed)
            backend.register_mem_host_pool_v2(pools[name], PoolName(name))
        return pools, backend

    def transfers(pools, keys, *pages):
        return [
            PoolTransfer(name=PoolName(n), host_indices=slots(pools[n], *pages), keys=keys)
            for n in names
        ]

    writer_pools, writer = engine(seed=6)
    keys = keys_of(3, PAGE)
    assert writer.batch_exists(keys) == 0  # no KV objects: v1 claims nothing
    assert writer.batch_set_v1(keys, slots(writer_pools["kv"], 0, 1, 2)) == [True] * 3
    done = writer.batch_set_v2(transfers(writer_pools, keys, 0, 1, 2))
    assert done == {PoolName(n): [True] * 3 for n in names}
    expected = {n: [bits(writer_pools[n], p) for p in (0, 1, 2)] for n in names}
    writer.close()

    reader_pools, reader = engine(seed=7)
    sidecar = reader._sidecars["deepseek_v4_c128"]
    assert sidecar.store.delete(sidecar.object_keys(keys[2:])) == 1  # c128 lacks page 2
    hit = reader.batch_exists_v2(keys, [PoolTransfer(name=PoolName(n), keys=keys) for n in names])
    assert hit.kv_hit_pages == 2 and hit.restorable_prefix_pages == [1, 2]
    assert reader.batch_exists_v2(keys, []).kv_hit_pages == 0  # no pool, no claim
    got = reader.batch_get_v2(transfers(reader_pools, keys[:2], 4, 5))
    assert got == {PoolName(n): [True, True] for n in names}
    for n in names:
        for page, want in zip((4, 5), expected[n][:2], strict=True):
            assert torch.equal(bits(reader_pools[n], page), want)
    with pytest.raises(BackendConfigError, match="logical"):
        reader.batch_get(keys[:1])
    reader.close()
