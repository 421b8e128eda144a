"""L3 -> L2 -> L1 as a pipeline: a read batch is loaded on into L1 as soon as it lands, the
engine reads no page's layer before that layer's load event, and the real executor reads a
prefetch's batches concurrently, in order, stopping at the first page L3 lacks."""

from __future__ import annotations

import asyncio
import dataclasses
from urllib.parse import unquote, urlsplit

import pytest
import torch

from hicache.config import HiCacheConfig, L1Config, L2Config, L3Config, PolicyConfig
from hicache.controller import HiCache
from hicache.ops import LoadOp, PrefetchOp
from hicache.ownership import QUARANTINE
from radix.keys import page_keys
from storage_backends.file_store import FileBackend, FileOptions
from storage_backends.options import options_from_query
from storage_backends.registry import register_backend
from tests.support.caches import MHA, NS, make_cache, put, read_pages, tokens_for
from tests.support.hostile import (
    CALM,
    LAYOUT,
    URL_SCHEME,
    VALUE_BYTES,
    HostileExecutor,
    expected_pages,
    garbage,
    namespace,
    new_store,
    page_bytes,
)

# ---------------------------------------------------------------------- the ordering


class PipelineExecutor(HostileExecutor):
    """A prefetch lands `batch_pages` pages per `wait_ready`; a load reads its host pages
    when it is submitted (as a copy stream may) and writes layer i into L1 only when layer
    i's event is waited for, so a page read before its event holds garbage."""

    def __init__(self, *, batch_pages: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.batch_pages = batch_pages
        self.sources: dict[int, list[bytes]] = {}  # load op id -> its host pages, as read
        self.layers_done: dict[int, set[int]] = {}
        self.loads_while_reading = 0  # loads submitted while a prefetch was still reading

    def submit(self, op) -> None:
        super().submit(op)
        if isinstance(op, LoadOp):
            self.sources[op.op_id] = [self.host[page] for page in op.host_page_ids]
            self.layers_done[op.op_id] = set()
            for page in op.device_page_ids:
                self.device[page] = garbage(self.num_layers, self.rng)
            reading = [p for p in self._inflight if isinstance(p, PrefetchOp)]
            self.loads_while_reading += any(p.num_ready < p.num_pages for p in reading)

    def wait_ready(self, op: PrefetchOp, num_pages: int, timeout_s) -> bool:
        if op.done:
            return True
        end = min(op.num_pages, op.num_ready + self.batch_pages)
        for index in range(op.num_ready, end):
            self.host[op.host_page_ids[index]] = self.store.get(op.keys[index])
            op.num_ready = index + 1
        if op.num_ready == op.num_pages:
            self.finish(op)
        return True

    def wait_layer(self, op: LoadOp, layer: int) -> None:
        if op not in self._inflight:
            return
        self._write_layer(op, layer)
        self.layers_done[op.op_id].add(layer)
        if len(self.layers_done[op.op_id]) == self.num_layers:
            self.finish(op)

    def _write_layer(self, op: LoadOp, layer: int) -> None:
        cut = slice(layer * VALUE_BYTES, (layer + 1) * VALUE_BYTES)
        for source, page in zip(self.sources[op.op_id], op.device_page_ids, strict=True):
            value = bytearray(self.device[page])
            value[cut] = source[cut]
            self.device[page] = bytes(value)

    def _copy(self, op, fails: bool) -> None:
        if not isinstance(op, LoadOp):
            return super()._copy(op, fails)
        for layer in range(self.num_layers):  # what is left: from what was read at submit
            if layer not in self.layers_done[op.op_id]:
                self._write_layer(op, layer)


def pipeline_cache(num_pages: int, batch_pages: int):
    store = new_store()
    executor = PipelineExecutor(
        batch_pages=batch_pages,
        num_device_pages=2 * num_pages,
        num_host_pages=2 * num_pages,
        num_layers=LAYOUT.num_layers,
        seed=0,
        faults=CALM,  # ops move on only as this test's engine asks
        stores={"l3": store},
    )
    config = HiCacheConfig(
        layout=LAYOUT,
        l1=L1Config(num_pages=2 * num_pages),
        l2=L2Config(budget_bytes=2 * num_pages * LAYOUT.bytes_per_page, reserve_bytes=0),
        l3=L3Config(url=f"{URL_SCHEME}l3"),
        policy=PolicyConfig(prefetch_policy="wait_complete"),
    )
    return HiCache(config, executor), executor, store


def layer_of(value: bytes, layer: int) -> bytes:
    return value[layer * VALUE_BYTES : (layer + 1) * VALUE_BYTES]


def test_each_landed_batch_is_loaded_before_the_read_ends_and_read_only_after_its_event():
    cache, executor, store = pipeline_cache(num_pages=12, batch_pages=3)
    ns = namespace()
    tokens = tokens_for(7, 12, page_size=LAYOUT.page_size)
    for key in page_keys(tokens, ns, LAYOUT.page_size):
        store.put(key, page_bytes(key, LAYOUT.num_layers))
    match = cache.match(tokens, ns)
    assert match.num_l3_pages == 12
    assert executor.loads_while_reading >= 3  # batches 1-3 went on while batch 4 was read
    expected = expected_pages(tokens, ns)
    pages = match.device_page_ids
    for layer in range(LAYOUT.num_layers):
        unwaited = [
            i
            for i, page in enumerate(pages)
            if layer_of(executor.device[page], layer) != layer_of(expected[i], layer)
        ]
        assert unwaited, "the fake must leave a layer unloaded until its event is waited for"
        cache.wait_layer(match, layer)
        wrong = [
            i
            for i, page in enumerate(pages)
            if layer_of(executor.device[page], layer) != layer_of(expected[i], layer)
        ]
        assert wrong == [], f"layer {layer}: pages {wrong} read before their load event"
    cache.release(match)
    cache.check_invariants()
    cache.close()


def test_a_pipelined_match_after_an_l2_prefix_loads_both_and_counts_each_tier():
    cache, executor, store = pipeline_cache(num_pages=12, batch_pages=2)
    ns = namespace()
    tokens = tokens_for(3, 12, page_size=LAYOUT.page_size)
    keys = page_keys(tokens, ns, LAYOUT.page_size)
    for key in keys[4:]:
        store.put(key, page_bytes(key, LAYOUT.num_layers))
    ids = cache.alloc_device_pages(4)
    for offset, page in enumerate(ids):
        executor.device[page] = page_bytes(keys[offset], LAYOUT.num_layers)
    cache.insert(tokens[: 4 * LAYOUT.page_size], ids, ns)
    cache.flush()
    assert cache.evict("l1", 4) == 4  # pages 0-3 only in L2 now
    match = cache.match(tokens, ns)
    assert (match.num_l1_pages, match.num_l2_pages, match.num_l3_pages) == (0, 4, 8)
    for layer in range(LAYOUT.num_layers):
        cache.wait_layer(match, layer)
    expected = expected_pages(tokens, ns)
    assert [executor.device[p] for p in match.device_page_ids] == expected[:12]
    cache.release(match)
    cache.check_invariants()
    cache.close()


# ---------------------------------------------------------------------- the real executor


class CountingFileBackend(FileBackend):
    """The file backend, counting the read batches in flight at once (each waits, up to a
    second, for a second one to start, so a serial reader shows as 1), and losing the pages
    whose keys are in `lost` (a miss, as if another process's eviction took them)."""

    scheme = "tallyfile"
    in_flight = 0
    most_in_flight = 0
    lost: frozenset[bytes] = frozenset()

    async def _fetch_into(self, keys, views, guard):
        cls = CountingFileBackend
        cls.in_flight += 1
        cls.most_in_flight = max(cls.most_in_flight, cls.in_flight)
        try:
            for _ in range(100):
                if cls.most_in_flight >= 2:
                    break
                await asyncio.sleep(0.01)
            outcomes = await super()._fetch_into(keys, views, guard)
            pairs = zip(keys, outcomes, strict=True)
            return [None if key in cls.lost else got for key, got in pairs]
        finally:
            cls.in_flight -= 1


def _open_counting(url: str, *, layout=None, name: str = "") -> CountingFileBackend:
    parts = urlsplit(url)
    options = options_from_query(FileOptions, parts.query, url=url, path=unquote(parts.path))
    return CountingFileBackend(options, layout, name=name or url)


# (a name that sorts after the built-in schemes: tests read the list of known ones)
register_backend("tallyfile", _open_counting, replace=True)


@pytest.fixture
def l3_with_pages(tmp_path):
    """An L3 directory holding 12 pages of one prompt, and the KV they hold."""
    url = f"file://{tmp_path}?capacity=64MiB"
    cache = make_cache(MHA, l1_pages=16, l2_pages=32, l3_url=url)
    tokens = tokens_for(5, 12)
    values = put(cache, tokens, seed=5)
    cache.flush()
    cache.close()
    return tmp_path, tokens, values


def test_a_prefetch_reads_its_batches_at_once_and_hands_over_the_right_pages(l3_with_pages):
    directory, tokens, values = l3_with_pages
    CountingFileBackend.most_in_flight = 0
    cache = make_cache(
        MHA,
        l1_pages=16,
        l2_pages=32,
        l3_url=f"tallyfile://{directory}?capacity=64MiB",
        l3_read_chunk_bytes=2 * MHA.bytes_per_page,  # 6 batches of 2 pages
        l3_read_batches=4,
        prefetch_policy="wait_complete",
    )
    try:
        match = cache.match(tokens, NS)
        assert match.num_l3_pages == 12
        assert CountingFileBackend.most_in_flight >= 2
        for layer in range(MHA.num_layers):
            cache.wait_layer(match, layer)
        assert torch.equal(cache.device_pool.kv[:, match.device_page_ids], values)
        cache.release(match)
        cache.check_invariants()
    finally:
        CountingFileBackend.lost = frozenset()
        cache.close()


def test_a_page_missing_from_l3_ends_the_prefetch_there(tmp_path):
    url = f"tallyfile://{tmp_path}?capacity=64MiB"
    cache = make_cache(
        MHA,
        l1_pages=16,
        l2_pages=32,
        l3_url=url,
        l3_read_chunk_bytes=2 * MHA.bytes_per_page,
        l3_read_batches=3,
        prefetch_policy="wait_complete",
    )
    try:
        tokens = tokens_for(5, 12)
        values = put(cache, tokens, seed=5)
        cache.flush()
        assert cache.evict("l1", 16) == 12 and cache.evict("l2", 32) == 12  # in L3 only
        CountingFileBackend.lost = frozenset(page_keys(tokens, NS, MHA.page_size)[5:6])
        match = cache.match(tokens, NS)  # the index knows all 12: one prefetch of 12
        assert match.num_pages == 5  # the pages before the gap, none after it
        for layer in range(MHA.num_layers):
            cache.wait_layer(match, layer)
        assert torch.equal(cache.device_pool.kv[:, match.device_page_ids], values[:, :5])
        cache.release(match)
        assert cache.stats().prefetch_pages_missing == 12 - 5
        cache.check_invariants()
    finally:
        CountingFileBackend.lost = frozenset()
        cache.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_a_pipelined_l3_hit_hands_over_the_bytes_written(tmp_path):
    """Many read batches, each loaded on the copy stream as it lands, a layer's event
    waited for by the compute stream: what the match's pages hold is what was written."""
    layout = MHA
    config = HiCacheConfig(
        layout=layout,
        l1=L1Config(device="cuda", num_pages=64),
        l2=L2Config(budget_bytes=64 * layout.bytes_per_page, reserve_bytes=0),
        l3=L3Config(
            url=f"file://{tmp_path}?capacity=64MiB", read_chunk_bytes=layout.bytes_per_page
        ),
        policy=PolicyConfig(prefetch_policy="wait_complete"),
    )
    cache = HiCache(config)
    try:
        tokens = tokens_for(9, 40)
        ids = cache.alloc_device_pages(40)
        values = torch.randn((layout.num_layers, 40, *cache.device_pool.kv.shape[2:]))
        cache.device_pool.kv[:, ids] = values.to(cache.device_pool.kv.dtype).cuda()
        cache.insert(tokens, ids, NS)
        cache.flush()
        assert cache.evict("l1", 64) == 40 and cache.evict("l2", 64) == 40
        match = cache.match(tokens, NS)
        assert match.num_l3_pages == 40
        for layer in range(layout.num_layers):
            cache.wait_layer(match, layer)
        got = cache.device_pool.kv[:, match.device_page_ids].cpu()
        assert torch.equal(got, values.to(got.dtype))
        cache.release(match)
        cache.check_invariants()
    finally:
        cache.close()


# ---------------------------------------------------------------------- late transfers


def test_pages_a_late_transfer_still_writes_are_quarantined_then_freed():
    """A prefetch cut short whose transfer goes on writing its unfilled L2 pages after the
    op is done (an L3 backend reading straight into a lent L2 pool, past its deadline):
    those pages are owned by the quarantine, never handed to another op, and freed only
    when the executor says the transfer is over."""
    store = new_store()
    tokens = list(range(1, 4 * LAYOUT.page_size + 1))
    ns = namespace()
    for key, value in zip(
        page_keys(tokens, ns, LAYOUT.page_size), expected_pages(tokens, ns), strict=True
    ):
        store.put(key, value)
    faults = dataclasses.replace(CALM, prefetch_cut=1.0, late_write=1.0)
    executor = HostileExecutor(
        num_device_pages=8, num_host_pages=8, num_layers=LAYOUT.num_layers, seed=3,
        faults=faults, stores={"l3": store},
    )  # fmt: skip
    config = HiCacheConfig(
        layout=LAYOUT,
        l1=L1Config(num_pages=8),
        l2=L2Config(budget_bytes=8 * LAYOUT.bytes_per_page, reserve_bytes=0),
        l3=L3Config(url=f"{URL_SCHEME}l3"),
        policy=PolicyConfig(prefetch_policy="wait_complete"),
    )
    cache = HiCache(config, executor)
    host = cache._host
    try:
        cache.prefetch(tokens + [0], ns)  # the index learns L3 has the 4 pages ...
        match = cache.match(tokens + [0], ns)  # ... and the cut prefetch leaves them late
        assert match.num_pages == 0
        cache.release(match)
        late = sorted(executor.late)
        assert len(late) == 4
        cache.poll()
        assert executor.late  # (1 to 40 polls each)
        assert all(host.owner_of(page) == QUARANTINE for page in late if page in executor.late)
        cache.check_invariants()
        # Every other L2 page is taken and given back while the transfer still writes: the
        # executor refuses an op on a late page, and the allocator never hands one out.
        others = host.alloc(host.num_free, "test")
        assert not set(others) & set(executor.late)
        host.free(others, "test")
        while executor.late:
            cache.poll()
            cache.check_invariants()
        cache.poll()
        assert all(host.owner_of(page) is None for page in late)  # freed, once it is over
    finally:
        cache.close()


def test_the_engine_lends_l2_to_mooncake_and_reads_l3_pages_straight_into_it(mooncake_store):
    """The real executor lends its L2 pool to a Mooncake L3: pages go out of and come back
    into L2 with no staging copy (direct= at the page size here), and equal what was
    written."""
    url = f"mooncake://{mooncake_store.address}?prefix=engine-lent:&direct=512&timeout=10s"
    cache = make_cache(
        MHA, l3_url=url, write_policy="write_through", prefetch_policy="wait_complete"
    )
    try:
        backend = cache._executor._backend
        assert cache._executor._lent_to == [backend]
        direct = backend._fetch_direct
        reads = []

        async def counted(*args):
            reads.append(len(args[0]))
            return await direct(*args)

        backend._fetch_direct = counted
        tokens = tokens_for(7, 6)
        values = put(cache, tokens, seed=7)
        cache.flush()
        assert cache.evict("l1", 16) == 6 and cache.evict("l2", 32) == 6  # in L3 only
        match = cache.match(tokens, NS)
        assert match.num_pages == 6 and sum(reads) == 6
        for layer in range(MHA.num_layers):
            cache.wait_layer(match, layer)
        assert torch.equal(read_pages(cache, match.device_page_ids), values)
        cache.release(match)
        cache.check_invariants()
    finally:
        cache.close()
