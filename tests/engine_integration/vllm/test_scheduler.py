"""HiCacheConnector under vLLM's real `Scheduler` (tests/support/vllm_scheduler.py): the
scheduler decides admission, chunking, preemption and recovery; the runner checks every
position every layer's attention reads, every step, against the model's own KV."""

from __future__ import annotations

import asyncio
import functools
import re
import threading
import time
import uuid
from urllib.parse import unquote, urlsplit

import pytest
import torch

pytest.importorskip("vllm", reason="vllm==0.33.0 (tests/engine_integration/requirements-vllm.txt)")

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorProm  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVQuantMode,
    MambaSpec,
    SlidingWindowSpec,
)

from engine_integration.vllm.config import namespace_for  # noqa: E402
from engine_integration.vllm.connector import HiCacheConnector  # noqa: E402
from engine_integration.vllm.groups import kv_groups  # noqa: E402
from radix.keys import page_keys  # noqa: E402
from storage_backends.file_store import FileBackend, FileOptions  # noqa: E402
from storage_backends.options import options_from_query  # noqa: E402
from storage_backends.registry import register_backend  # noqa: E402
from tests.hicache.test_faults import flip_byte, locate, page_names  # noqa: E402
from tests.support.engines import random_prompt  # noqa: E402
from tests.support.vllm_scheduler import (  # noqa: E402
    EngineShape,
    GroupShape,
    ServingEngine,
    make_vllm_config,
    transfer_config,
)

BASE = {"l2_size": "4MiB", "l2_reserve": 0, "prefetch_policy": "wait_complete", "page_size": 16}


@pytest.fixture
def serving():
    """make(extra, shape) -> a ServingEngine; every one is shut down afterwards."""
    made = []

    def make(extra=None, shape=None, **kwargs):
        engine = ServingEngine(
            {**BASE, **(extra or {})},
            shape or EngineShape(),
            engine_id=f"s{len(made)}-{uuid.uuid4().hex[:8]}",  # its sockets' names
            **kwargs,
        )
        made.append(engine)
        return engine

    yield make
    for engine in made:
        if engine.worker._shared is not None:
            engine.shutdown()


def first_step(engine, req_id, prompt):
    """Admit a request and run one step: (tokens computed before it, tokens it computed)."""
    engine.add(req_id, prompt)
    output = engine.step()
    (new,) = [r for r in output.scheduled_new_reqs if r.req_id == req_id]
    return new.num_computed_tokens, output.num_scheduled_tokens[req_id]


# Each scenario on a model of one full-attention group and on an MLA model.
ONE_GROUP = pytest.mark.parametrize(
    "groups",
    [(GroupShape("full", 2),), (GroupShape("mla", 2),)],
    ids=["full", "mla"],
)


@ONE_GROUP
def test_a_prefix_evicted_from_vllm_is_loaded_from_hicache(serving, groups):
    engine = serving(shape=EngineShape(groups=groups))
    prompt_a = random_prompt(1, 100, vocab=1000)
    engine.add("a", prompt_a)
    engine.run()
    assert engine.scheduler.reset_prefix_cache()  # vLLM forgets A; hicache still holds it
    prompt_b = prompt_a[:90] + random_prompt(2, 7, vocab=1000)
    computed, scheduled = first_step(engine, "b", prompt_b)
    assert (computed, scheduled) == (80, len(prompt_b) - 80)  # 5 pages of 16 from hicache
    engine.run()
    assert engine.wrong_reads == []
    assert engine.cache.stats().hit_pages["l1"] + engine.cache.stats().hit_pages["l2"] == 5
    assert not any(engine.invalid_block_ids)


@ONE_GROUP
def test_chunked_prefill_saves_once_complete_and_loads_in_the_first_chunk(serving, groups):
    engine = serving(shape=EngineShape(groups=groups, step_tokens=48))
    prompt_a = random_prompt(3, 150, vocab=1000)
    engine.add("a", prompt_a)
    engine.run()
    assert engine.cache.stats().inserted_pages == 9  # the whole prompt, in its last chunk
    assert engine.scheduler.reset_prefix_cache()
    computed, scheduled = first_step(engine, "b", prompt_a[:140] + [1, 2, 3])
    assert computed == 128 and scheduled == 143 - 128
    engine.run()
    assert engine.wrong_reads == []


@ONE_GROUP
def test_preempted_requests_resume_from_hicache(serving, groups):
    # 24 blocks of 16 (one is vLLM's null block): three requests that grow past it.
    engine = serving(shape=EngineShape(groups=groups, num_blocks=24, max_num_seqs=3))
    for i in range(3):
        engine.add(f"r{i}", random_prompt(10 + i, 96, vocab=1000), max_tokens=60)
    preempted = set()
    resumed_with_hit = set()
    for _ in range(400):
        if not engine.scheduler.has_unfinished_requests():
            break
        output = engine.step()
        preempted |= set(output.preempted_req_ids or ())
        cached = output.scheduled_cached_reqs
        resumed = [
            (req_id, cached.num_computed_tokens[i])
            for i, req_id in enumerate(cached.req_ids)
            if req_id in cached.resumed_req_ids
        ]
        resumed += [(r.req_id, r.num_computed_tokens) for r in output.scheduled_new_reqs]
        resumed_with_hit |= {r for r, computed in resumed if r in preempted and computed >= 96}
    assert not engine.scheduler.has_unfinished_requests()
    assert preempted, "the pool was meant to run out"
    assert resumed_with_hit  # a resumed request skipped its prompt (vLLM's cache or ours)
    assert engine.wrong_reads == []


@ONE_GROUP
def test_a_failed_load_is_recomputed_by_vllm(serving, tmp_path, groups):
    directory = tmp_path / "l3"
    url = f"file://{directory}?capacity=64MiB"
    first = serving({"l3_url": url}, shape=EngineShape(groups=groups))
    prompt = random_prompt(20, 5 * 16 + 1, vocab=1000)
    first.add("a", prompt)
    first.run()
    first.shutdown()  # flushes A's pages to L3
    layout = first.worker._layout
    third = page_keys(prompt, namespace_for("test/model", layout), 16)[2].hex()
    (victim,) = [path for path in page_names(directory) if path.name == third]
    offset, length = locate(victim)
    flip_byte(victim, offset + length - 3)

    second = serving({"l3_url": url}, shape=EngineShape(groups=groups))
    computed, _ = first_step(second, "b", prompt)
    assert computed == 80  # as far as L3's `exists` can tell
    assert second.invalid_block_ids[-1]  # page 2 did not verify: reported, not copied in
    second.run()
    assert second.wrong_reads == []  # vLLM recomputed from the first bad block
    assert second.cache.stats().l3_corrupt_pages >= 1


HYBRID = EngineShape(groups=(GroupShape("full", 2), GroupShape("sliding", 2, window=40)))


# How long a test steps the engine waiting for something a lookup decides. A hybrid model's
# lookup (and any lookup past L3) runs on the planner's thread, waited for only
# `LOOKUP_WAIT_S` a step, so under load its answer can come many steps late.
ANSWER_WAIT_S = 60.0


def step_until(engine, done, what: str):
    """Steps the engine until `done(output)` holds for a step's SchedulerOutput; returns that
    output. Fails after `ANSWER_WAIT_S`, not after a number of steps."""
    deadline = time.monotonic() + ANSWER_WAIT_S
    while time.monotonic() < deadline:
        output = engine.step()
        if done(output):
            return output
    raise AssertionError(f"{what} within {ANSWER_WAIT_S:.0f} s")


def newly_scheduled(output, req_id: str):
    return next((new for new in output.scheduled_new_reqs if new.req_id == req_id), None)


def admitted(engine, req_id: str) -> int:
    """Steps until the request is scheduled; returns the tokens computed before that step
    (vLLM's own hit plus the connector's load)."""
    output = step_until(
        engine,
        lambda output: newly_scheduled(output, req_id) is not None,
        f"{req_id} was not scheduled",
    )
    return newly_scheduled(output, req_id).num_computed_tokens


def test_a_hybrid_model_loads_full_pages_and_only_the_window(serving):
    engine = serving(shape=HYBRID)
    full, sliding = engine.worker._shared.caches
    prompt_a = random_prompt(30, 100, vocab=1000)
    engine.add("a", prompt_a)
    engine.run()
    assert full.stats().inserted_pages == 6
    # The window before 96: positions 57.. ; stored from the page boundary 48: 3 pages.
    assert sliding.stats().inserted_pages == 3
    assert engine.scheduler.reset_prefix_cache()
    engine.add("b", prompt_a[:100] + [1, 2])
    assert engine.step().num_scheduled_tokens == {}  # B waits for its asynchronous load
    assert admitted(engine, "b") == 96
    # C shares 4 pages with A, but no window was stored at 64: no hit, no wrong KV.
    engine.add("c", prompt_a[:70] + [3])
    assert admitted(engine, "c") == 0
    engine.run()
    assert engine.wrong_reads == []


def test_a_hybrid_model_under_chunked_prefill_and_preemption(serving):
    shape = EngineShape(groups=HYBRID.groups, step_tokens=48, num_blocks=40, max_num_seqs=3)
    engine = serving(shape=shape)
    prompt = random_prompt(31, 150, vocab=1000)
    engine.add("a", prompt)
    engine.run()
    assert engine.scheduler.reset_prefix_cache()
    engine.add("b", prompt + [9])
    assert admitted(engine, "b") == 144  # the window at 144 was kept through the chunks
    for i in range(3):
        engine.add(f"r{i}", prompt[: 100 + i] + random_prompt(40 + i, 20, vocab=1000), 50)
    engine.run(max_steps=600)
    assert engine.wrong_reads == []


@pytest.fixture(params=["prompt", "late"])
def lookup_answers(request, monkeypatch):
    """A hybrid model's lookup runs on the planner's thread; under load it answers a step
    or more after the request arrives. "late": every answer waits at least one step."""
    if request.param == "late":
        monkeypatch.setattr("engine_integration.vllm.plan.LOOKUP_WAIT_S", 0)
    return request.param


def test_a_hybrid_load_that_fails_is_recomputed_from_the_start(serving, lookup_answers):
    engine = serving(shape=HYBRID)
    _, sliding = engine.worker._shared.caches
    prompt = random_prompt(32, 100, vocab=1000)
    engine.add("a", prompt)
    engine.run()
    assert engine.scheduler.reset_prefix_cache()

    evicted = []

    def evict_the_windows(output):  # between the scheduler's lookup and the worker's load
        if output.kv_connector_metadata.plan.loads and not evicted:
            sliding.evict("l1", 10**6)
            sliding.evict("l2", 10**6)
            evicted.append(engine.num_steps)

    engine.before_execute = evict_the_windows
    engine.add("b", prompt + [5])
    step_until(engine, lambda _: evicted, "no step carried b's load")  # whenever it comes
    engine.before_execute = None
    assert admitted(engine, "b") == 0  # the load failed (failed_recving): recomputed
    engine.run()
    assert engine.wrong_reads == []


def test_mla_pages_hold_one_latent_per_token(serving):
    engine = serving(shape=EngineShape(groups=(GroupShape("mla", 3),), head_size=24))
    assert engine.cache.config.layout.kind == "mla"
    prompt = random_prompt(33, 90, vocab=1000)
    engine.add("a", prompt)
    engine.run()
    assert engine.scheduler.reset_prefix_cache()
    engine.add("b", prompt[:85])
    assert admitted(engine, "b") == 80
    engine.run()
    assert engine.wrong_reads == []
    assert engine.cache.config.layout.bytes_per_token == 3 * 24 * 4  # no K/V pair, no heads


def test_asynchronous_loads_of_one_group(serving):
    engine = serving({"load_async": True})
    prompt = random_prompt(34, 90, vocab=1000)
    engine.add("a", prompt)
    engine.run()
    assert engine.scheduler.reset_prefix_cache()
    engine.add("b", prompt + [4])
    assert engine.step().num_scheduled_tokens == {}
    assert admitted(engine, "b") == 80
    engine.run()
    assert engine.wrong_reads == []


def test_reset_prefix_cache_with_the_connector_empties_hicache(serving):
    engine = serving()
    prompt = random_prompt(35, 90, vocab=1000)
    engine.add("a", prompt)
    engine.run()
    assert engine.scheduler.reset_prefix_cache(reset_connector=True)
    assert engine.cache.pages_in_use("l1") == engine.cache.pages_in_use("l2") == 0
    engine.add("b", prompt)
    assert admitted(engine, "b") == 0
    engine.run()
    assert engine.wrong_reads == []


def _config_of(*specs):
    groups = [KVCacheGroupSpec([f"layer{i}"], spec) for i, spec in enumerate(specs)]
    return KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=groups)


FULL = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.float32)
REFUSED = [
    pytest.param(
        (FullAttentionSpec(
            block_size=16, num_kv_heads=2, head_size=8, dtype=torch.float8_e4m3fn,
            kv_quant_mode=KVQuantMode.FP8_PER_TENSOR,
        ),),
        "kv_quant_mode=FP8_PER_TENSOR",
        id="scaled-fp8",
    ),
    pytest.param(
        (FULL, MambaSpec(block_size=16, shapes=((4,),), dtypes=(torch.float32,))),
        "spec MambaSpec",
        id="mamba",
    ),
    pytest.param(
        (FULL, ChunkedLocalAttentionSpec(
            block_size=16, num_kv_heads=2, head_size=8, dtype=torch.float32,
            attention_chunk_size=64,
        )),
        "spec ChunkedLocalAttentionSpec",
        id="chunked-local",
    ),
    pytest.param(
        (SlidingWindowSpec(
            block_size=16, num_kv_heads=2, head_size=8, dtype=torch.float32, sliding_window=64
        ),),
        "needs a full-attention or MLA KV group",
        id="sliding-only",
    ),
    pytest.param(
        (FullAttentionSpec(
            block_size=16, num_kv_heads=2, head_size=8, head_size_v=4, dtype=torch.float32
        ),),
        "head_size_v 4 != head_size 8",
        id="head-size-v",
    ),
]  # fmt: skip


@pytest.mark.parametrize(("specs", "named"), REFUSED)
def test_kv_the_connector_cannot_cache_is_refused_by_name(specs, named):
    with pytest.raises(ValueError, match=re.escape(named)):
        kv_groups(_config_of(*specs))


def test_hicache_residency_reaches_vllm_kv_event_stream(serving, tmp_path):
    url = f"file://{tmp_path / 'l3'}?capacity=64MiB"
    engine = serving({"l3_url": url}, shape=HYBRID, kv_events=True)
    published = []
    engine.scheduler.kv_event_publisher.publish = published.append
    prompt = random_prompt(36, 100, vocab=1000)
    engine.add("a", prompt)
    engine.run()
    for cache in engine.worker._shared.caches:
        cache.flush()  # L2 -> L3 done
    engine.scheduler.reset_prefix_cache(reset_connector=True)  # L2 emptied: removals
    engine.add("idle", [1, 2, 3], max_tokens=1)
    engine.run()  # a step whose output carries the events
    events = [event for batch in published for event in batch.events]
    ours = [e for e in events if getattr(e, "medium", None) in ("CPU", "STORAGE")]
    stored = {(e.medium, e.group_idx): e for e in ours if type(e).__name__ == "BlockStored"}
    assert set(stored) == {("CPU", 0), ("CPU", 1), ("STORAGE", 0), ("STORAGE", 1)}
    full = stored[("CPU", 0)]
    assert full.token_ids == prompt[:96] and full.block_size == 16
    assert full.kv_cache_spec_kind == "full_attention" and len(full.block_hashes) == 6
    window = stored[("CPU", 1)]
    assert window.token_ids == prompt[48:96]  # the window entry only
    assert window.kv_cache_spec_sliding_window == 40
    removed = [e for e in ours if type(e).__name__ == "BlockRemoved" and e.medium == "CPU"]
    assert {e.group_idx for e in removed} == {0, 1}


class GatedFileBackend(FileBackend):
    """The real file backend whose lookups (`exists`) wait until the test opens `GATE`:
    an L3 as slow as the test wants, without a timing in the test."""

    GATE = threading.Event()

    async def _exists(self, keys):
        while not self.GATE.is_set():
            await asyncio.sleep(0.005)
        return await super()._exists(keys)


def _open_gated(url: str, *, layout=None, name: str = "") -> GatedFileBackend:
    parts = urlsplit(url)
    options = options_from_query(FileOptions, parts.query, url=url, path=unquote(parts.path))
    return GatedFileBackend(options, layout, name=name or url)


register_backend("gatedfile", _open_gated, replace=True)


def test_an_asynchronous_l3_lookup_never_holds_the_scheduler(serving, tmp_path):
    directory = tmp_path / "l3"
    first = serving({"l3_url": f"file://{directory}?capacity=64MiB"})
    prompt = random_prompt(37, 90, vocab=1000)
    first.add("a", prompt)
    first.run()
    first.shutdown()  # A's pages are in L3 only now

    GatedFileBackend.GATE.set()
    url = f"gatedfile://{directory}?capacity=64MiB&timeout=30s"
    second = serving({"l3_url": url, "load_async": True, "l3_exists_timeout_s": 30})
    second.add("c", random_prompt(38, 40, vocab=1000), max_tokens=20)
    assert admitted(second, "c") == 0
    GatedFileBackend.GATE.clear()
    try:
        second.add("b", prompt)
        for _ in range(3):  # B's lookup is stuck in L3; the scheduler goes on with C
            output = second.step()
            assert "b" not in output.num_scheduled_tokens
            assert output.num_scheduled_tokens.get("c") == 1
    finally:
        GatedFileBackend.GATE.set()
    assert admitted(second, "b") == 80
    second.run()
    assert second.wrong_reads == []


def test_connector_stats_reach_vllm_prometheus_counters(serving):
    engine = serving()
    prompt = random_prompt(39, 90, vocab=1000)
    engine.add("a", prompt)
    engine.run()
    assert engine.scheduler.reset_prefix_cache()
    engine.add("b", prompt + [1])
    engine.run()
    total = HiCacheConnector.build_kv_connector_stats()
    for data in engine.connector_stats:
        total = total.aggregate(HiCacheConnector.build_kv_connector_stats(data))
    assert total.reduce() == {
        "loaded_tokens": 80, "failed_tokens": 0, "saved_pages": 5, "saves_skipped": 0,
    }  # fmt: skip

    registry = CollectorRegistry()

    class Prom(KVConnectorProm):  # vLLM's own, on a registry of the test's
        _gauge_cls = functools.partial(Gauge, registry=registry)
        _counter_cls = functools.partial(Counter, registry=registry)
        _histogram_cls = functools.partial(Histogram, registry=registry)

    prom = Prom(engine.config, ["model_name", "engine"], {0: ["test/model", "0"]})
    prom.observe(total.reduce(), engine_idx=0)
    labels = {"model_name": "test/model", "engine": "0"}
    assert registry.get_sample_value("vllm:hicache_loaded_tokens_total", labels) == 80
    assert registry.get_sample_value("vllm:hicache_saved_pages_total", labels) == 5


def test_a_hybrid_conversation_hits_the_deepest_boundary_with_a_window(serving):
    """A's answer ends with its window released below the last token's (vLLM keeps no
    more): its full pages are saved to 128, its window only where the prompt saved it (96).
    The next turn's lookup steps down from 128 to the deepest boundary with a window."""
    engine = serving(shape=HYBRID)
    full, sliding = engine.worker._shared.caches
    a = engine.add("a", random_prompt(41, 100, vocab=1000), max_tokens=40)
    engine.run()
    assert full.stats().inserted_pages == 8  # the prompt's 6, then the answer's 2
    turn = list(a.all_token_ids)
    assert engine.scheduler.reset_prefix_cache()
    engine.add("b", turn + random_prompt(42, 5, vocab=1000))
    assert admitted(engine, "b") == 96
    engine.run()
    assert engine.wrong_reads == []


def test_tensor_parallel_hybrid_ranks_answer_over_their_sockets(serving):
    engine = serving(shape=HYBRID, num_ranks=2)
    prompt = random_prompt(43, 100, vocab=1000)
    engine.add("a", prompt)
    engine.run()
    assert engine.scheduler.reset_prefix_cache()
    engine.add("b", prompt + [6])
    assert admitted(engine, "b") == 96  # every rank holds the full pages and the window
    assert len(engine.connector._clients) == 2  # asked over the ranks' sockets
    engine.run()
    assert engine.wrong_reads == []


def test_mla_under_tensor_parallelism_has_one_writer(serving, tmp_path):
    url = f"file://{tmp_path / 'l3'}?capacity=64MiB"
    mla = EngineShape(groups=(GroupShape("mla", 2),))
    engine = serving({"l3_url": url}, shape=mla, num_ranks=2)
    rank0, rank1 = (worker._shared.cache for worker in engine.workers)
    prompt = random_prompt(44, 90, vocab=1000)
    engine.add("a", prompt)
    engine.run()
    assert rank0.stats().inserted_pages == 5 and rank1.stats().inserted_pages == 0
    rank0.flush()  # in L3: rank 1 finds rank 0's latent there
    assert engine.scheduler.reset_prefix_cache()
    engine.add("b", prompt + [6])
    assert admitted(engine, "b") == 80
    engine.run()
    assert rank1.stats().hit_pages["l3"] == 5
    assert engine.wrong_reads == []


@pytest.mark.parametrize("name", ["decode_context_parallel_size", "prefill_context_parallel_size"])
def test_context_parallelism_is_refused_by_name(name):
    config = make_vllm_config(transfer_config(BASE, "cp"), EngineShape())
    setattr(config.parallel_config, name, 2)
    kv_cache_config = _config_of(FULL)
    with pytest.raises(ValueError, match=name):
        KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER, kv_cache_config)


@pytest.mark.parametrize("ask_again_s", [0, 60])
def test_a_request_waiting_for_blocks_asks_l3_once(serving, tmp_path, ask_again_s):
    """vLLM asks the connector about the request at the head of its queue at every step it
    waits for blocks (here one request's worth of them at a time). L3 is asked about it
    again only once its last lookup is `l3_ask_again_s` old (here longer than the test, so
    that no timing counts); the workers' indexes answer meanwhile."""
    url = f"file://{tmp_path / 'l3'}?capacity=64MiB"
    shape = EngineShape(num_blocks=8, max_num_seqs=4)
    engine = serving({"l3_url": url, "l3_ask_again_s": ask_again_s}, shape=shape)
    for i in range(3):
        engine.add(f"r{i}", random_prompt(50 + i, 90, vocab=1000), max_tokens=8)
    engine.run()
    lookups = engine.worker._shared.cache.stats().l3_lookups
    if ask_again_s:
        assert lookups == 3
    else:  # one a step while it waited (21 here)
        assert lookups > 3
    assert engine.wrong_reads == []
