"""The SGLang storage backend against SGLang 0.5.23's real classes and real L3 stores.

Built as SGLang builds it: `StorageBackendFactory.create_backend("dynamic", config, pool)`
from the extra-config JSON given on the command line, then `register_mem_pool_host`. The host
pools are SGLang's own `MHATokenToKVPoolHost` / `MLATokenToKVPoolHost`, built on the CPU by
`tests.support.sglang_cpu` (this folder's conftest applies its two guards: torchvision's
missing operators, CUDA host pinning); a test here checks the adapter reads only the pool
attributes it names.
Stores: files, a real redis-server and a real cache-server daemon, on loopback.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import json
import os
import sys
import threading
import types
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

pytest.importorskip("sglang", reason="install tests/engine_integration/requirements-sglang.txt")
pytest.importorskip("torchvision", reason="pip install --no-deps torchvision==0.28.0 (.ci/run)")

from sglang.srt.mem_cache.hicache_storage import (  # noqa: E402
    HiCacheStorageConfig,
    PoolName,
    PoolTransfer,
)
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402
from sglang.srt.mem_cache.utils import get_storage_hash_str  # noqa: E402

from engine_integration.sglang.storage import HiCacheSGLangStorage  # noqa: E402
from storage_backends import (  # noqa: E402
    BackendConfigError,
    BackendUnavailableError,
    file_read,
)
from storage_backends.file_pack import read_table  # noqa: E402
from storage_backends.file_space import page_path  # noqa: E402
from tests.support.daemon import DaemonProcess  # noqa: E402
from tests.support.deadline import WITHIN_S, wait_until, within_deadline  # noqa: E402
from tests.support.servers import RedisProcess, free_port  # noqa: E402
from tests.support.sglang_cpu import host_pool as real_host_pool  # noqa: E402

LAYOUTS = ("page_first", "layer_first", "page_first_direct")
PAGE = 4  # tokens per page
NUM_PAGES = 8  # pages in each test pool
POOL_SURFACE = {"layout", "page_size", "dtype", "kv_buffer", "get_data_page"}


def command_line_config(url: str) -> dict:
    """--hicache-storage-backend-extra-config, parsed as SGLang parses it (json.loads)."""
    text = (
        '{"backend_name": "hicache", "module_path": "engine_integration.sglang.storage", '
        '"class_name": "HiCacheSGLangStorage", "interface_v1": 1, "url": "' + url + '"}'
    )
    return json.loads(text)


def storage_config(
    extra: dict, *, mla=False, tp=(0, 1), model="org/model-8b", metrics=False, tp_lcm_size=None
):
    return HiCacheStorageConfig(
        tp_rank=tp[0], tp_size=tp[1], pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=mla, enable_storage_metrics=metrics, is_page_first_layout=True,
        model_name=model, extra_config=extra, tp_lcm_size=tp_lcm_size,
        should_split_heads=bool(tp_lcm_size and tp_lcm_size > tp[1] and not mla),
    )  # fmt: skip


def host_pool(attention="mha", layout="page_first", dtype=torch.bfloat16, seed=0, heads=2):
    """SGLang's real host pool (MLA: kv_lora_rank 8 + rope 4), filled with random bits."""
    pool = real_host_pool(
        attention, layout, layer_num=3, page_size=PAGE, num_pages=NUM_PAGES, dtype=dtype,
        head_num=heads,
    )  # fmt: skip
    generator = torch.Generator().manual_seed(seed)
    pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape, generator=generator))
    return pool


def attach(url: str, pool, **config) -> HiCacheSGLangStorage:
    """What SGLang's cache_controller.attach_storage_backend does."""
    cfg = storage_config(command_line_config(url), **config)
    backend = StorageBackendFactory.create_backend("dynamic", cfg, pool)
    backend.register_mem_pool_host(pool)
    return backend


def indices(*pages: int) -> torch.Tensor:
    """Host token indices of whole pages, as SGLang allocates them."""
    return torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE) for p in pages])


def page_bits(pool, page: int) -> torch.Tensor:
    return pool.get_data_page(page * PAGE).view(torch.int16).clone()


def keys_of(*names: object) -> list[str]:
    """SGLang's own page hashes (chained) of a fresh random prompt, one per name."""
    generator = torch.Generator().manual_seed(uuid.uuid4().int % 2**63)
    tokens = torch.randint(0, 128_000, (len(names) * PAGE,), generator=generator).tolist()
    return get_storage_hash_str(tokens, None, page_size=PAGE)


# -- stores -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory) -> Iterator[RedisProcess]:
    server = RedisProcess(tmp_path_factory.mktemp("redis"), free_port()).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def daemon() -> Iterator[DaemonProcess]:
    server = DaemonProcess("--capacity", "64MiB").start()
    yield server
    server.stop()


@pytest.fixture
def file_url(tmp_path: Path) -> Callable[[], str]:
    return lambda: f"file://{tmp_path / uuid.uuid4().hex[:8]}?capacity=64MiB"


@pytest.fixture(params=["file", "redis", "grpc", "mooncake"])
def make_url(request, tmp_path) -> Callable[[], str]:
    """A fresh store of each kind: its own directory, Redis or Mooncake key prefix, or daemon
    namespace."""
    if request.param == "file":
        return lambda: f"file://{tmp_path / uuid.uuid4().hex[:8]}?capacity=64MiB"
    if request.param == "redis":
        port = request.getfixturevalue("redis_server").port
        return lambda: f"redis://127.0.0.1:{port}/0?prefix={uuid.uuid4().hex[:8]}:"
    if request.param == "mooncake":
        address = request.getfixturevalue("mooncake_store").address
        return lambda: f"mooncake://{address}?prefix={uuid.uuid4().hex[:8]}:&buffer=8MiB"
    address = request.getfixturevalue("daemon").address
    return lambda: f"grpc://{address}"


# -- round trips --------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("attention", ["mha", "mla"])
def test_pages_round_trip_bitwise_through_each_store(make_url, attention, layout):
    url = make_url()
    writer_pool = host_pool(attention, layout, seed=1)
    writer = attach(url, writer_pool, mla=attention == "mla")
    keys = keys_of(0, 1, 2)
    assert writer.batch_set_v1(keys, indices(5, 0, 3)) == [True, True, True]
    expected = [page_bits(writer_pool, p) for p in (5, 0, 3)]
    writer.close()

    reader_pool = host_pool(attention, layout, seed=2)  # another engine, other bytes
    untouched = [page_bits(reader_pool, p) for p in (0, 7)]
    reader = attach(url, reader_pool, mla=attention == "mla")
    assert reader.batch_exists(keys) == 3
    assert reader.batch_get_v1(keys, indices(2, 6, 4)) == [True, True, True]
    for page, bits in zip((2, 6, 4), expected, strict=True):
        assert torch.equal(page_bits(reader_pool, page), bits)
    assert [page_bits(reader_pool, p) for p in (0, 7)][0].equal(untouched[0])
    assert torch.equal(page_bits(reader_pool, 7), untouched[1])  # only the pages asked for

    # SGLang's flat-page path (interface_v1 off) reads the same objects.
    flats = reader.batch_get(keys, [reader_pool.get_dummy_flat_data_page() for _ in keys])
    assert all(torch.equal(f.view(torch.int16), b) for f, b in zip(flats, expected, strict=True))
    stats = reader.backend_stats()
    assert stats.num_hits > 0 and stats.num_corrupt_total == 0
    reader.close()


def test_flat_page_calls_and_zero_copy_calls_store_the_same_objects(file_url):
    url = file_url()
    pool = host_pool("mha", "page_first", seed=3)
    backend = attach(url, pool)
    key, other = keys_of("flat", "missing")
    assert backend.set(key, pool.get_data_page(2 * PAGE))  # non-contiguous view, flattened
    assert backend.exists(key) and not backend.exists(other)
    assert backend.batch_get_v1([key], indices(6)) == [True]
    assert torch.equal(page_bits(pool, 6), page_bits(pool, 2))
    assert torch.equal(backend.get(key).view(torch.int16), page_bits(pool, 2))
    assert backend.get(other) is None
    assert backend.batch_set([other], [pool.get_data_page(1 * PAGE)])
    assert backend.batch_exists([key, other]) == 2
    backend.close()


def test_calls_from_sglang_style_threads_at_once(file_url):
    """SGLang's prefetch, prefetch-I/O and backup threads call at the same time."""
    pool = host_pool("mha", "page_first", seed=4)
    backend = attach(file_url(), pool)
    written = keys_of(*range(4))
    assert all(backend.batch_set_v1(written, indices(0, 1, 2, 3)))
    errors: list[BaseException] = []
    results: dict[str, object] = {}

    def run(name: str, call: Callable[[], object]) -> None:
        try:
            results[name] = [call() for _ in range(20)][-1]
        except BaseException as exc:  # noqa: BLE001 (reported below)
            errors.append(exc)

    calls = {
        "exists": lambda: backend.batch_exists(written),
        "get": lambda: backend.batch_get_v1(written[:2], indices(4, 5)),
        "set": lambda: backend.batch_set_v1(keys_of(7), indices(7)),
    }
    threads = [threading.Thread(target=run, args=item) for item in calls.items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not errors
    assert results == {"exists": 4, "get": [True, True], "set": [True]}
    assert torch.equal(page_bits(pool, 4), page_bits(pool, 0))
    backend.close()


def test_adapter_uses_only_the_named_pool_attributes(file_url):
    seen: set[str] = set()

    class Recording:
        def __init__(self, pool) -> None:
            object.__setattr__(self, "_pool", pool)

        def __getattr__(self, name: str):
            seen.add(name)
            return getattr(self._pool, name)

    pool = host_pool("mla", "layer_first", seed=5)
    backend = attach(file_url(), Recording(pool), mla=True)
    keys = keys_of(0, 1)
    assert backend.batch_set_v1(keys, indices(0, 1)) == [True, True]
    assert backend.batch_get_v1(keys, indices(2, 3)) == [True, True]
    assert backend.batch_get(keys)[0] is not None
    backend.close()
    assert seen <= POOL_SURFACE, seen - POOL_SURFACE


# -- prefix semantics, shards, wrong pages ---------------------------------------------------


def test_batch_exists_counts_the_leading_run_of_whole_pages(file_url):
    pool = host_pool("mha", "page_first", seed=6)
    backend = attach(file_url(), pool)
    keys = keys_of(*range(5))
    assert backend.batch_set_v1(keys[:3], indices(0, 1, 2)) == [True] * 3
    assert backend.batch_set_v1(keys[4:], indices(4)) == [True]
    assert backend.batch_exists(keys) == 3  # stops at the first absent page
    assert backend.batch_exists(keys[3:]) == 0
    assert backend.batch_exists([]) == 0
    # A page with one part (its V) gone is absent, and so is everything after it.
    store = backend._attached
    assert store.store.delete(store.object_keys([keys[1]])[1:]) == 1
    assert backend.batch_exists(keys) == 1
    assert backend.batch_get_v1(keys[:3], indices(5, 6, 7)) == [True, False, True]
    backend.close()


def test_tp_ranks_do_not_see_each_others_shards(file_url):
    url = file_url()
    rank0 = attach(url, host_pool(seed=7), tp=(0, 2))
    rank1_pool = host_pool(seed=8)
    rank1 = attach(url, rank1_pool, tp=(1, 2))
    keys = keys_of(0, 1)
    assert rank0.batch_set_v1(keys, indices(0, 1)) == [True, True]
    before = page_bits(rank1_pool, 3)
    assert rank1.batch_exists(keys) == 0
    assert rank1.batch_get_v1(keys, indices(3, 4)) == [False, False]
    assert torch.equal(page_bits(rank1_pool, 3), before)
    alone = attach(url, host_pool(seed=9), tp=(0, 1))
    assert alone.batch_exists(keys) == 0  # the tp size is part of the shard too
    for backend in (rank0, rank1, alone):
        backend.close()


def test_mla_pages_have_one_writer_and_every_rank_reads_them(file_url):
    url = file_url()
    writer_pool = host_pool("mla", seed=10)
    writer = attach(url, writer_pool, mla=True, tp=(0, 4))
    replica = attach(url, host_pool("mla", seed=11), mla=True, tp=(3, 4))
    keys, theirs = keys_of(0, 1), keys_of(2)
    assert replica.batch_set_v1(theirs, indices(2)) == [False]  # not this rank's to write
    assert replica.num_refused_writes == 1 and writer.batch_exists(theirs) == 0
    assert writer.batch_set_v1(keys, indices(0, 1)) == [True, True]
    assert replica.batch_get_v1(keys, indices(5, 6)) == [True, True]
    assert torch.equal(page_bits(replica.mem_pool_host, 5), page_bits(writer_pool, 0))
    writer.close()
    replica.close()


def test_another_model_or_dtype_does_not_see_the_pages(file_url):
    url = file_url()
    writer = attach(url, host_pool(seed=12), model="org/model-a")
    keys = keys_of(0)
    assert writer.batch_set_v1(keys, indices(0)) == [True]
    other_model = attach(url, host_pool(seed=13), model="org/model-b")
    other_dtype = attach(url, host_pool(dtype=torch.float16, seed=14), model="org/model-a")
    other_layout = attach(url, host_pool(layout="layer_first", seed=15), model="org/model-a")
    for backend in (other_model, other_dtype, other_layout):
        assert backend.batch_exists(keys) == 0
        assert backend.batch_get_v1(keys, indices(1)) == [False]
        backend.close()
    writer.close()


def _damage(blob: bytes, how: str, forged_key: bytes) -> bytes:
    if how == "corrupt":
        damaged = bytearray(blob)
        damaged[-7] ^= 0x10  # a bit of the payload
        return bytes(damaged)
    if how == "truncated":
        return blob[:-100]
    return blob  # "foreign": another model's page, stored under our key


@pytest.mark.parametrize("how", ["corrupt", "truncated", "foreign"])
@pytest.mark.parametrize("store_kind", ["file", "redis"])
def test_a_damaged_or_foreign_page_is_a_miss(how, store_kind, file_url, request):
    if store_kind == "file":
        url = file_url()
    else:
        url = f"redis://127.0.0.1:{request.getfixturevalue('redis_server').port}/0?prefix=d{how}:"
    foreign = attach(url, host_pool(seed=16), model="org/other-model")
    ours_pool = host_pool(seed=17)
    ours = attach(url, ours_pool)
    keys = keys_of(0, 1)
    assert ours.batch_set_v1(keys, indices(0, 1)) == [True, True]
    assert foreign.batch_set_v1(keys, indices(0, 1)) == [True, True]
    target = ours._attached.object_keys(keys[:1])[0]  # page 0's first part
    source = (foreign if how == "foreign" else ours)._attached.object_keys(keys[:1])[0]
    store = ours._attached.store
    blob = store.batch_get_objects([source], verify=False)[0]
    assert store.batch_put_objects([target], [_damage(blob, how, target)], verify=False) == [True]
    # A miss: SGLang uses none of page 5 (it keeps the leading run of hits, here none).
    assert ours.batch_get_v1(keys, indices(5, 6)) == [False, True]
    assert torch.equal(page_bits(ours_pool, 6), page_bits(ours_pool, 1))
    assert ours.get(keys[0]) is None
    assert ours.backend_stats().num_corrupt_total == 2
    foreign.close()
    ours.close()


# -- page_head and tp_lcm_size (heads split across tp sizes) -----------------------------------


def heads_of(pool, page: int, first: int, count: int) -> torch.Tensor:
    """The K and V of heads [first, first+count) of one page_head page, as bits."""
    data = pool.get_data_page(page * PAGE, flat=False)  # (2, 1, heads, page, layers, dim)
    return data[:, :, first : first + count].view(torch.int16).clone()


def test_page_head_round_trips_bitwise_through_v1_v2_and_flat_pages(file_url):
    url = file_url()
    writer_pool = host_pool(layout="page_head", seed=40, heads=4)
    writer = attach(url, writer_pool)
    keys = keys_of(0, 1, 2)
    assert writer.batch_set_v1(keys[:2], indices(5, 0)) == [True, True]
    kv = PoolName.KV
    assert writer.batch_set_v2([PoolTransfer(kv, indices(3), keys=keys[2:])]) == {kv: [True]}
    expected = [page_bits(writer_pool, p) for p in (5, 0, 3)]
    writer.close()

    reader_pool = host_pool(layout="page_head", seed=41, heads=4)
    untouched = page_bits(reader_pool, 7)
    reader = attach(url, reader_pool)
    assert reader.batch_exists(keys) == 3
    assert reader.batch_exists_v2(keys).kv_hit_pages == 3
    got = reader.batch_get_v2([PoolTransfer(kv, indices(2, 6), keys=keys[:2])])
    assert got == {kv: [True, True]}
    assert reader.batch_get_v1(keys[2:], indices(4)) == [True]
    for page, bits in zip((2, 6, 4), expected, strict=True):
        assert torch.equal(page_bits(reader_pool, page), bits)
    assert torch.equal(page_bits(reader_pool, 7), untouched)
    flats = reader.batch_get(keys, [reader_pool.get_dummy_flat_data_page() for _ in keys])
    assert all(torch.equal(f.view(torch.int16), b) for f, b in zip(flats, expected, strict=True))
    assert reader.backend_stats().num_corrupt_total == 0
    reader.close()


def test_a_tp1_writer_is_read_by_two_tp2_ranks_each_getting_its_heads(file_url):
    url = file_url()
    writer_pool = host_pool(layout="page_head", seed=42, heads=4)
    writer = attach(url, writer_pool, tp=(0, 1), tp_lcm_size=2)
    assert writer._attached.geometry.num_objects == 4  # 2 head slices x (K, V)
    keys = keys_of(0, 1)
    assert writer.batch_set_v1(keys, indices(1, 6)) == [True, True]
    # The flat-page path stores the same objects: a third page through set().
    flat_key = keys_of("flat")[0]
    assert writer.set(flat_key, writer_pool.get_data_page(2 * PAGE))
    writer.close()
    for rank in (0, 1):
        pool = host_pool(layout="page_head", seed=43 + rank, heads=2)
        reader = attach(url, pool, tp=(rank, 2), tp_lcm_size=2)
        assert reader.batch_exists(keys + [flat_key]) == 3
        assert reader.batch_get_v1(keys + [flat_key], indices(3, 0, 5)) == [True] * 3
        for mine, theirs in ((3, 1), (0, 6), (5, 2)):
            want = heads_of(writer_pool, theirs, 2 * rank, 2)
            assert torch.equal(heads_of(pool, mine, 0, 2), want)
        reader.close()


def test_two_tp2_writers_are_read_whole_by_a_tp1_rank(file_url):
    url = file_url()
    keys = keys_of(0, 1)
    writer_pools = []
    for rank in (0, 1):
        pool = host_pool(layout="page_head", seed=50 + rank, heads=2)
        writer = attach(url, pool, tp=(rank, 2), tp_lcm_size=2)
        half = writer.batch_set_v2([PoolTransfer(PoolName.KV, indices(4, 2), keys=keys)])
        assert half == {PoolName.KV: [True, True]}
        writer_pools.append(pool)
        if rank == 0:  # one rank's heads alone are not a page at tp 1
            reader = attach(url, host_pool(layout="page_head", seed=52, heads=4), tp_lcm_size=2)
            assert reader.batch_exists(keys) == 0
            assert reader.batch_get_v1(keys, indices(0, 1)) == [False, False]
            reader.close()
        writer.close()
    pool = host_pool(layout="page_head", seed=53, heads=4)
    reader = attach(url, pool, tp=(0, 1), tp_lcm_size=2)
    assert reader.batch_exists(keys) == 2
    assert reader.batch_get_v2([PoolTransfer(PoolName.KV, indices(7, 0), keys=keys)]) == {
        PoolName.KV: [True, True]
    }
    for mine, theirs in ((7, 4), (0, 2)):
        whole = torch.cat([heads_of(p, theirs, 0, 2) for p in writer_pools], dim=2)
        assert torch.equal(heads_of(pool, mine, 0, 4), whole)
    # SGLang's flat-page path reads the same slices, each to its heads' place.
    flat = reader.get(keys[1], pool.get_dummy_flat_data_page())
    assert torch.equal(flat.view(torch.int16), page_bits(pool, 0))
    reader.close()


def test_one_damaged_head_slice_makes_the_whole_page_a_miss(file_url):
    url = file_url()
    writer_pool = host_pool(layout="page_head", seed=60, heads=4)
    writer = attach(url, writer_pool, tp_lcm_size=2)
    keys = keys_of(0, 1)
    assert writer.batch_set_v1(keys, indices(0, 1)) == [True, True]
    objects = writer._attached.object_keys(keys[:1])  # page 0: slice 0 K, V; slice 1 K, V
    store = writer._attached.store
    blob = store.batch_get_objects([objects[3]], verify=False)[0]
    assert store.batch_put_objects([objects[3]], [_damage(blob, "corrupt", b"")], verify=False)
    writer.close()

    pool = host_pool(layout="page_head", seed=61, heads=4)
    reader = attach(url, pool, tp_lcm_size=2)
    assert reader.batch_get_v1(keys, indices(5, 6)) == [False, True]
    assert torch.equal(page_bits(pool, 6), page_bits(writer_pool, 1))
    assert reader.get(keys[0]) is None
    assert reader.backend_stats().num_corrupt_total == 2
    # The rank at tp 2 whose heads are the intact slice still has its page.
    rank0_pool = host_pool(layout="page_head", seed=62, heads=2)
    rank0 = attach(url, rank0_pool, tp=(0, 2), tp_lcm_size=2)
    assert rank0.batch_get_v1(keys[:1], indices(3)) == [True]
    assert torch.equal(heads_of(rank0_pool, 3, 0, 2), heads_of(writer_pool, 0, 0, 2))
    rank1 = attach(url, host_pool(layout="page_head", seed=63, heads=2), tp=(1, 2), tp_lcm_size=2)
    assert rank1.batch_get_v1(keys[:1], indices(3)) == [False]
    reader.close()
    rank0.close()
    rank1.close()


# -- a slow or dead store --------------------------------------------------------------------


def test_a_stalled_then_killed_redis_gives_misses_within_the_timeout(tmp_path):
    server = RedisProcess(tmp_path / "redis", free_port()).start()
    try:
        pool = host_pool(seed=18)
        url = f"redis://127.0.0.1:{server.port}/0?timeout=300ms"
        backend = attach(url, pool)
        keys = keys_of(*range(4))
        assert backend.batch_set_v1(keys, indices(0, 1, 2, 3)) == [True] * 4
        with server.paused():  # alive, answering nothing: the worst case
            # (answering nothing, the server leaves only the calls' own timeouts to end them)
            found = within_deadline(backend.batch_get_v1, keys, indices(4, 5, 6, 7))
            assert found == [False] * 4
            assert within_deadline(backend.batch_exists, keys) == 0
            assert within_deadline(backend.batch_set_v1, keys_of(1), indices(0)) == [False]
        server.kill()
        assert within_deadline(backend.batch_get_v1, keys, indices(4, 5, 6, 7)) == [False] * 4
        assert backend.backend_stats().num_timeouts >= 3
        backend.close()
    finally:
        server.stop()


def test_a_daemon_killed_mid_batch_gives_misses_within_the_timeout():
    server = DaemonProcess("--capacity", "64MiB").start()
    try:
        pool = host_pool(seed=19)
        backend = attach(f"grpc://{server.address}?timeout=500ms", pool)
        keys = keys_of(*range(6))
        assert backend.batch_set_v1(keys, indices(*range(6))) == [True] * 6
        outcomes: list[list[bool]] = []
        stop = threading.Event()

        def prefetch_io() -> None:  # SGLang's prefetch-I/O thread, reading on and on
            while not stop.is_set():
                outcomes.append(backend.batch_get_v1(keys[:2], indices(6, 7)))

        reader = threading.Thread(target=prefetch_io)
        reader.start()
        wait_until(lambda: len(outcomes) >= 2, "reads while the daemon is up")
        server.kill()
        killed = len(outcomes)  # reads from here on may have begun before the kill
        wait_until(lambda: len(outcomes) >= killed + 3, "reads after the kill")
        stop.set()
        reader.join(WITHIN_S)
        assert not reader.is_alive()  # no call hung (each ends by its own timeout)
        assert outcomes[0] == [True, True]
        assert outcomes[killed + 1 :] == [[False, False]] * (len(outcomes) - killed - 1)
        backend.close()
    finally:
        server.stop()


# -- configuration errors -------------------------------------------------------------------


def _create(extra: dict, pool=None, **config):
    cfg = storage_config(extra, **config)
    backend = StorageBackendFactory.create_backend("dynamic", cfg, pool)
    if pool is not None:
        backend.register_mem_pool_host(pool)
    return backend


def test_config_errors_name_the_field(file_url, monkeypatch):
    monkeypatch.delenv("HICACHE_L3_URL", raising=False)
    base = command_line_config(file_url())
    with pytest.raises(BackendConfigError, match="'prefix_size'"):
        _create({**base, "prefix_size": 3})
    without_url = {k: v for k, v in base.items() if k != "url"}
    with pytest.raises(BackendConfigError, match="'url' is missing"):
        _create(without_url)
    with pytest.raises(BackendConfigError, match="'url': .*unknown storage backend 'ftp'"):
        _create({**base, "url": "ftp://host/kv"})
    with pytest.raises(BackendConfigError, match="'url': .*unknown option 'capacty'"):
        _create({**base, "url": file_url().replace("capacity", "capacty")})
    with pytest.raises(BackendConfigError, match="'model_id'"):
        _create(base, model=None)
    with pytest.raises(BackendConfigError, match="tp_lcm_size=3 must be a multiple of tp_size=2"):
        HiCacheSGLangStorage(storage_config(base, tp=(0, 2), tp_lcm_size=3), {})
    with pytest.raises(BackendConfigError, match="dcp_size=2: decode context parallelism"):
        cfg = storage_config(base, mla=True)
        cfg.dcp_size = 2
        HiCacheSGLangStorage(cfg, {})
    # No model name from SGLang, but model_id set: attaches, and files pages under it.
    named = _create({**base, "model_id": "org/by-id"}, host_pool(seed=23), model=None)
    assert named.settings.model_id == "org/by-id"
    assert named.batch_set_v1(keys_of(0), indices(0)) == [True]
    named.close()
    with pytest.raises(BackendConfigError, match="host layout 'page_head' .* for mla"):
        pool = host_pool("mla")
        pool.layout = "page_head"  # SGLang's MLA pool has none; a stand-in claiming one
        _create(base, pool, mla=True)
    with pytest.raises(BackendConfigError, match="tp_lcm_size .* needs --hicache-mem-layout"):
        _create(base, host_pool(heads=4), tp=(0, 2), tp_lcm_size=4)  # page_first
    with pytest.raises(BackendConfigError, match="tp_lcm_size splits each page's 2 KV heads 4"):
        _create(base, host_pool(layout="page_head"), tp=(0, 1), tp_lcm_size=4)
    backend = _create(base)
    with pytest.raises(BackendConfigError, match="host pool 'mamba' .* has no get_data_page"):
        backend.register_mem_host_pool_v2(object(), "mamba")
    monkeypatch.setenv("HICACHE_L3_URL", file_url())
    assert _create(without_url, host_pool()).batch_exists(keys_of(0)) == 0


def test_the_tenant_secret_in_the_environment_signs_and_checks_pages(
    file_url, monkeypatch, tmp_path
):
    """HICACHE_L3_SECRET_FILE, as the engine and the vLLM connector take it: pages are
    written with a MAC, and a page written without the secret is a miss, counted forged."""
    secret = tmp_path / "team-a.secret"
    secret.write_bytes(os.urandom(32))
    url = file_url()
    monkeypatch.delenv("HICACHE_L3_SECRET_FILE", raising=False)
    outsider = attach(url, host_pool(seed=40))
    keys = keys_of(0, 1)
    assert outsider.batch_set_v1(keys[:1], indices(0)) == [True]
    monkeypatch.setenv("HICACHE_L3_SECRET_FILE", str(secret))
    tenant_pool = host_pool(seed=41)
    tenant = attach(url, tenant_pool)
    assert tenant.batch_get_v1(keys[:1], indices(5)) == [False]
    objects = len(tenant._attached.object_keys(keys[:1]))  # (K and V, here)
    assert tenant.backend_stats().num_forged == objects
    assert tenant.batch_set_v1(keys[1:], indices(1)) == [True]
    assert tenant.batch_get_v1(keys[1:], indices(6)) == [True]
    assert torch.equal(page_bits(tenant_pool, 6), page_bits(tenant_pool, 1))
    with pytest.raises(BackendConfigError, match="'secret_file' given twice"):
        attach(url + "&secret_file=" + str(secret), host_pool())
    outsider.close()
    tenant.close()


@pytest.mark.parametrize(
    "variable", ["HICACHE_L2_SIZE", "HICACHE_L3_WRITE_POLICY", "HICACHE_L3_URI"]
)
def test_a_variable_the_backend_cannot_honour_is_an_error_naming_it(
    variable, file_url, monkeypatch
):
    """SGLang keeps its own host pool and policies: a hicache variable for them (or a
    misspelt one) would be ignored, so it is refused by name."""
    monkeypatch.setenv(variable, "64GiB")
    with pytest.raises(BackendConfigError, match=variable):
        _create(command_line_config(file_url()))


def test_an_unreachable_store_fails_the_attach_naming_the_url():
    url = f"redis://127.0.0.1:{free_port()}/0?timeout=500ms"
    with pytest.raises(BackendUnavailableError, match="extra config 'url'"):
        _create(command_line_config(url), host_pool())


def test_misuse_of_the_calls_is_an_error_that_says_what(file_url):
    backend = _create(command_line_config(file_url()))
    with pytest.raises(RuntimeError, match="register_mem_pool_host"):
        backend.batch_exists(["k"])
    backend.register_mem_pool_host(host_pool())
    with pytest.raises(ValueError, match="host_indices has 4 entries for 2 keys"):
        backend.batch_get_v1(keys_of(0, 1), indices(0))
    with pytest.raises(ValueError, match="page-aligned"):
        backend.batch_get_v1(keys_of(0), indices(0) + 1)
    with pytest.raises(ValueError, match="outside the host pool"):
        backend.batch_set_v1(keys_of(0), indices(backend._attached.geometry.num_pages))
    with pytest.raises(ValueError, match=r"keys\[1\] must be a str"):
        backend.batch_exists(["a", b"b"])
    assert backend.clear() is False  # a shared store is not one engine's to wipe
    backend.close()


METRICS_MODULE = "sglang.srt.observability.metrics_collector"


def _storage_metrics_module(monkeypatch) -> None:
    """SGLang's metrics module, or, where it cannot be imported (on the CPU build of torch it
    imports torchvision, see tests/support/sglang_pools.py), a module holding SGLang's own
    `StorageMetrics`, its class statement taken from that module's source as installed: the
    adapter then builds the very dataclass SGLang defines, field for field."""
    try:
        importlib.import_module(METRICS_MODULE)
        return
    except ImportError:
        pass
    source = Path(importlib.util.find_spec("sglang").submodule_search_locations[0])
    tree = ast.parse((source / "srt/observability/metrics_collector.py").read_text())
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "StorageMetrics"]
    module = types.ModuleType(METRICS_MODULE)
    monkeypatch.setitem(sys.modules, METRICS_MODULE, module)  # (dataclass looks it up)
    header = "from dataclasses import dataclass, field\nfrom typing import List\n"
    exec(compile(header + ast.unparse(cls), METRICS_MODULE, "exec"), module.__dict__)


def test_throughput_metrics_in_the_form_sglang_reads(file_url, monkeypatch):
    _storage_metrics_module(monkeypatch)
    backend = attach(file_url(), host_pool(seed=20), metrics=True)
    keys = keys_of(0, 1)
    backend.batch_set_v1(keys, indices(0, 1))
    backend.batch_get_v1(keys, indices(2, 3))
    taken = backend.take_throughput()
    assert taken["backup_pgs"] == [2] and taken["prefetch_pgs"] == [2]
    assert taken["prefetch_bandwidth"][0] > 0 and taken["backup_bandwidth"][0] > 0
    assert backend.take_throughput()["prefetch_pgs"] == []  # since the last read, as SGLang's
    before = backend.backend_stats().num_hits
    backend.batch_get_v1(keys, indices(2, 3))
    metrics = backend.get_stats()
    assert type(metrics).__name__ == "StorageMetrics"
    assert metrics.prefetch_pgs == [2] and metrics.backup_pgs == []
    assert metrics.prefetch_bandwidth[0] > 0
    # the backend's own counters ride along. They count objects: an MHA page is stored as
    # its K and its V part, so this get of 2 pages is 4 more hits (the old assertion of 6
    # after two gets counted pages; the backend counted 8)
    assert metrics.hicache.num_hits == before + 2 * 2
    backend.close()


def test_bench_sglang_storage_smoke(tmp_path, monkeypatch, capsys):
    """The benchmark end to end at its --smoke sizes, in this process (SGLang is imported
    already: a second interpreter would spend most of the run importing it again)."""
    from benchmarks import bench_sglang_storage

    threads = torch.get_num_threads()
    monkeypatch.setattr("sys.argv", ["bench", "--smoke", "--dir", str(tmp_path)])
    try:
        bench_sglang_storage.main()
    finally:
        torch.set_num_threads(threads)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    records = [json.loads(line) for line in lines]
    assert {r["model"] for r in records} == {"mha_llama_8b", "mla_deepseek_v3"}
    assert {r["layout"] for r in records} == {"page_first", "layer_first", "page_first_direct"}
    assert len(records) == 6
    for record in records:
        assert record["pages_verified"] == record["pages"] > 0
        assert record["get_ratio"] > 0 and record["set_ratio"] > 0
    assert list(tmp_path.iterdir()) == []  # it removes what it wrote


def kv_transfer(keys: list[str], *pages: int) -> list[PoolTransfer]:
    """The v2 call SGLang's cache controller makes for the KV pool."""
    return [PoolTransfer(name=PoolName.KV, host_indices=indices(*pages), keys=keys)]


@pytest.mark.parametrize("attention", ["mha", "mla"])
def test_layer_first_pages_move_straight_between_their_layers_and_l3(
    file_url, attention, monkeypatch
):
    """A layer_first page (a part per layer: K and V of each for MHA) is one object, written
    from the pool's own parts and read straight back into them (the storage API's page in
    pieces, no staging copy), bitwise, through the v2 calls SGLang makes; the object is the
    flat page's."""
    url = file_url()
    writer_pool = host_pool(attention, "layer_first", seed=31)
    writer = attach(url, writer_pool, mla=attention == "mla")
    geometry = writer._attached.geometry
    assert geometry.gathered and geometry.num_objects == 1
    assert geometry.num_parts == (6 if attention == "mha" else 3)  # 3 layers
    keys = keys_of(0, 1, 2)
    assert writer.batch_set_v2(kv_transfer(keys, 0, 1, 2)) == {PoolName.KV: [True] * 3}
    expected = [page_bits(writer_pool, p) for p in (0, 1, 2)]
    writer.close()

    handed = []  # how the file reader got each page: its pieces
    real_into = file_read.BatchRead.into

    def into(self, views, guard):
        handed.extend(len(view) if isinstance(view, list) else 1 for view in views)
        return real_into(self, views, guard)

    monkeypatch.setattr(file_read.BatchRead, "into", into)
    reader_pool = host_pool(attention, "layer_first", seed=32)
    reader_pool.kv_buffer.zero_()
    reader = attach(url, reader_pool, mla=attention == "mla")
    assert reader.batch_get_v2(kv_transfer(keys, 6, 4, 5)) == {PoolName.KV: [True] * 3}
    assert handed == [geometry.num_parts] * 3
    for page, bits in zip((6, 4, 5), expected, strict=True):
        assert torch.equal(page_bits(reader_pool, page), bits)
    assert not page_bits(reader_pool, 7).any()  # nothing else written
    flat = reader.batch_get(keys[:1], [reader_pool.get_dummy_flat_data_page()])[0]
    assert torch.equal(flat.view(torch.int16), expected[0])  # the object is the flat page
    reader.close()


@pytest.mark.parametrize("attention", ["mha", "mla"])
def test_a_layer_first_page_damaged_on_disk_is_a_counted_miss(file_url, attention):
    """One byte flipped in the file of a layer_first page: read straight into the pool's
    parts, it fails its check, so SGLang is told False for it (and frees that host page);
    the corrupt counter rises; its neighbours land bitwise."""
    url = file_url()
    writer_pool = host_pool(attention, "layer_first", seed=21)
    writer = attach(url, writer_pool, mla=attention == "mla")
    keys = keys_of(0, 1, 2)
    assert writer.batch_set_v2(kv_transfer(keys, 0, 1, 2)) == {PoolName.KV: [True] * 3}
    expected = [page_bits(writer_pool, p) for p in (0, 1, 2)]
    root = writer._attached.store.backend.root
    target = writer._attached.object_keys(keys[1:2])[0]
    writer.close()
    path = page_path(root, target)
    fd = os.open(path, os.O_RDWR)
    try:
        table = read_table(fd, os.fstat(fd), path)
        offset, length = table.entries[target]
        at = offset + length - 5  # a byte of the last layer's part
        os.pwrite(fd, bytes([os.pread(fd, 1, at)[0] ^ 0x20]), at)
    finally:
        os.close(fd)

    reader_pool = host_pool(attention, "layer_first", seed=22)
    reader = attach(url, reader_pool, mla=attention == "mla")
    assert reader.batch_get_v2(kv_transfer(keys, 5, 6, 7)) == {PoolName.KV: [True, False, True]}
    assert torch.equal(page_bits(reader_pool, 5), expected[0])
    assert torch.equal(page_bits(reader_pool, 7), expected[2])
    stats = reader.backend_stats()
    assert stats.num_corrupt == {"checksum": 1} and stats.num_hits == 2
    assert reader.batch_get_v1(keys[1:2], indices(6)) == [False]  # and again, every time
    assert reader.backend_stats().num_corrupt == {"checksum": 2}
    reader.close()
