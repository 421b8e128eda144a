"""HiCacheConnector against the real vLLM 0.33 classes, driven as vLLM's scheduler and GPU
model runner drive a connector (tests/support/vllm_driver.py says which calls, in which
order), over KV tensors vLLM's own allocator lays out."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
import zmq

pytest.importorskip("vllm", reason="vllm==0.33.0 (tests/engine_integration/requirements-vllm.txt)")

from vllm.config.kv_transfer import KVTransferConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402
from vllm.v1.metrics.cache_hit_source import CacheHitSource  # noqa: E402

from engine_integration.vllm.config import kv_layout, namespace_for, read_settings  # noqa: E402
from engine_integration.vllm.connector import HiCacheConnector  # noqa: E402
from engine_integration.vllm.lookup import (  # noqa: E402
    Found,
    LookupClient,
    ask_all,
    lookup_address,
    shortest,
)
from radix.keys import page_keys  # noqa: E402
from tests.hicache.test_faults import flip_byte, locate, page_names  # noqa: E402
from tests.support.benchmarks import run_smoke  # noqa: E402
from tests.support.engines import random_prompt, run_one  # noqa: E402
from tests.support.servers import RedisProcess, free_port  # noqa: E402
from tests.support.vllm_driver import (  # noqa: E402
    POISON,
    Shape,
    TestVllmConfig,
    VllmEngine,
    transfer_config_json,
)

BASE = {"l2_size": "4MiB", "l2_reserve": 0, "prefetch_policy": "wait_complete"}


@pytest.fixture
def vllm_engines():
    """make(extra, shape) -> a VllmEngine; every one is shut down afterwards."""
    made = []

    def make(extra=None, shape=None, **kwargs):
        extra = {**BASE, **(extra or {})}
        engine = VllmEngine(extra, shape or Shape(), engine_id=f"e{len(made)}", **kwargs)
        made.append(engine)
        return engine

    yield make
    for engine in made:
        if engine.worker._shared is not None or engine.scheduler._shared is not None:
            engine.shutdown()


def compute_a(engine, tokens, req_id="a"):
    """Request A computes its prompt and saves it; returns the KV it wrote, per layer."""
    request = engine.request(req_id, tokens)
    result = engine.step(request)
    assert result.num_external_tokens == 0 and not result.failed_block_ids
    written = [engine.kv_of(req_id, layer, 0, len(tokens)) for layer in range(2)]
    engine.finish(request)
    return written


def test_the_factory_resolves_the_connector_from_the_json():
    text = transfer_config_json(BASE, "json-engine")
    transfer = KVTransferConfig(**json.loads(text))
    cls = KVConnectorFactory.get_connector_class(transfer)
    assert cls is HiCacheConnector
    assert KVConnectorFactory.supports_hma_config(transfer)


CASES = [
    # vLLM block size, kernel block size, hicache page size, vLLM's physical layout
    pytest.param(16, None, 16, KVCacheLayout.LBNHC, id="block16-page16-LBNHC"),
    pytest.param(16, None, 32, KVCacheLayout.BLHNC, id="block16-page32-BLHNC"),
    pytest.param(32, 16, 16, KVCacheLayout.LBHNC, id="block32-kernel16-page16-LBHNC"),
    pytest.param(8, None, 24, KVCacheLayout.BLNHC, id="block8-page24-BLNHC"),
]


@pytest.mark.parametrize(("block_size", "kernel", "page_size", "layout"), CASES)
def test_b_loads_a_prefix_layer_by_layer_bitwise(
    vllm_engines, block_size, kernel, page_size, layout
):
    shape = Shape(block_size=block_size, kernel_block_size=kernel, layout=layout)
    engine = vllm_engines({"page_size": page_size}, shape)
    prompt_a = random_prompt(1, 5 * page_size + 3, vocab=1000)
    written = compute_a(engine, prompt_a)
    engine.cache.evict("l1", 10**6)  # A's pages live in L2 now: B loads them over the link
    prompt_b = prompt_a[: 4 * page_size + 5] + random_prompt(2, 9, vocab=1000)
    hit = 4 * page_size
    result = engine.step(engine.request("b", prompt_b))
    assert result.num_external_tokens == hit
    assert not result.failed_block_ids
    for layer in range(2):
        assert result.unloaded_before_wait[layer]  # copied into vLLM's blocks at its wait
        assert torch.equal(result.seen[layer], written[layer][:hit])
    assert engine.cache.stats().hit_pages["l2"] == 4
    b = engine.request("b-sources", prompt_b)  # what vLLM's hit-source metrics are told
    engine.scheduler.get_num_new_matched_tokens(b, 0)
    assert engine.scheduler.get_external_cache_hit_sources(b, hit) == {CacheHitSource.HOST: hit}


def test_the_load_leaves_vllm_own_prefix_hit_alone(vllm_engines):
    engine = vllm_engines({"page_size": 32})
    prompt = random_prompt(3, 100, vocab=1000)
    written = compute_a(engine, prompt)
    # vLLM's prefix cache already has the first block (16 tokens): hicache loads 16..96.
    result = engine.step(engine.request("b", prompt), num_computed_tokens=16)
    assert result.num_external_tokens == 96 - 16
    for layer in range(2):
        assert bool((result.seen[layer][:16] == POISON).all())
        assert torch.equal(result.seen[layer][16:], written[layer][16:96])


@pytest.mark.parametrize("store", ["file", "mooncake"])
def test_a_restarted_engine_hits_the_pages_in_l3(vllm_engines, tmp_path, store, request):
    url = f"file://{tmp_path / 'l3'}?capacity=64MiB"
    if store == "mooncake":  # the store's own processes hold the pages between the engines
        address = request.getfixturevalue("mooncake_store").address
        url = f"mooncake://{address}?prefix={tmp_path.name}:&buffer=8MiB"
    first = vllm_engines({"page_size": 16, "l3_url": url})
    prompt = random_prompt(4, 70, vocab=1000)
    written = compute_a(first, prompt)
    first.shutdown()  # flushes what it saved to L3, then closes
    second = vllm_engines({"page_size": 16, "l3_url": url})
    result = second.step(second.request("b", prompt[:64] + [7, 7]))
    assert result.num_external_tokens == 64
    assert not result.failed_block_ids
    for layer in range(2):
        assert torch.equal(result.seen[layer], written[layer][:64])
    assert second.cache.stats().hit_pages["l3"] == 4
    again = second.request("c", prompt[:64] + [8])
    second.cache.evict("l1", 10**6)
    second.cache.evict("l2", 10**6)  # in L3 only again
    assert second.scheduler.get_num_new_matched_tokens(again, 0) == (64, False)
    assert second.scheduler.get_external_cache_hit_sources(again, 64) == {CacheHitSource.DISK: 64}


def test_a_corrupt_l3_page_is_reported_and_never_copied_in(vllm_engines, tmp_path):
    directory = tmp_path / "l3"
    url = f"file://{directory}?capacity=64MiB"
    shape = Shape(block_size=8)
    first = vllm_engines({"page_size": 16, "l3_url": url}, shape)
    prompt = random_prompt(5, 5 * 16 + 1, vocab=1000)
    written = compute_a(first, prompt)
    first.shutdown()
    layout = kv_layout(first.worker._spec, 2, 16)
    third = page_keys(prompt, namespace_for("test/model", layout), 16)[2].hex()
    (victim,) = [path for path in page_names(directory) if path.name == third]
    offset, length = locate(victim)
    flip_byte(victim, offset + length - 3)

    second = vllm_engines({"page_size": 16, "l3_url": url}, shape)
    request = second.request("b", prompt)
    result = second.step(request)
    assert result.num_external_tokens == 80  # L3 holds 5 pages as far as `exists` can tell
    blocks = second.block_ids["b"]
    assert result.failed_block_ids == set(blocks[4:10])  # pages 2..4: blocks 4..9
    for layer in range(2):
        assert torch.equal(result.seen[layer][:32], written[layer][:32])
        assert bool((result.seen[layer][32:80] == POISON).all())  # never copied in
    assert second.cache.stats().l3_corrupt_pages >= 1

    # vLLM recomputes from the first failed block; the connector saves the prompt again,
    # and the new copy replaces the damaged page in L3.
    request.num_computed_tokens = 32
    assert not second.step_batch([], [request])["b"].failed_block_ids
    second.shutdown()
    third = vllm_engines({"page_size": 16, "l3_url": url}, shape)
    result = third.step(third.request("c", prompt))
    assert result.num_external_tokens == 80 and not result.failed_block_ids
    for layer in range(2):
        assert torch.equal(result.seen[layer], written[layer][:80])


def test_l3_down_gives_no_external_hit_within_the_timeout(vllm_engines, tmp_path):
    server = RedisProcess(tmp_path / "redis", free_port()).start()
    url = server.url + "?timeout=300ms"
    try:
        first = vllm_engines({"page_size": 16, "l3_url": url})
        prompt = random_prompt(6, 70, vocab=1000)
        compute_a(first, prompt)
        first.shutdown()
        second = vllm_engines({"page_size": 16, "l3_url": url})
        server.pause()  # up, but answering nothing
        request = second.request("b", prompt)
        # (a stopped server answers nothing: only the lookup's own timeout ends the call)
        assert second.scheduler.get_num_new_matched_tokens(request, 0) == (0, False)
        # The next request is a miss too, and does not hang on the store.
        other = second.request("c", random_prompt(10, 70, vocab=1000))
        assert second.scheduler.get_num_new_matched_tokens(other, 0) == (0, False)
    finally:
        server.stop()


def test_cache_salt_is_part_of_the_key(vllm_engines):
    engine = vllm_engines({"page_size": 16})
    prompt = random_prompt(7, 40, vocab=1000)
    request = engine.request("a", prompt, cache_salt="tenant-1")
    engine.step(request)
    engine.finish(request)
    other = engine.request("b", prompt, cache_salt="tenant-2")
    assert engine.scheduler.get_num_new_matched_tokens(other, 0) == (0, False)
    same = engine.request("c", prompt, cache_salt="tenant-1")
    assert engine.scheduler.get_num_new_matched_tokens(same, 0) == (32, False)
    unsalted = engine.request("d", prompt)
    assert engine.scheduler.get_num_new_matched_tokens(unsalted, 0) == (0, False)


def test_settings_use_the_hicache_names_and_refuse_the_rest():
    settings = read_settings({"l2_size": "1GiB", "l3_url": "memory://", "page_size": 32}, "m", {})
    assert settings.environ == {"HICACHE_L2_SIZE": "1GiB", "HICACHE_L3_URL": "memory://"}
    assert settings.page_size == 32
    env = {"HICACHE_WRITE_POLICY": "write_back", "HICACHE_L2_SIZE": "2GiB"}
    settings = read_settings({"l2_size": "1GiB"}, "m", env)
    assert settings.environ["HICACHE_L2_SIZE"] == "1GiB"  # the JSON over the environment
    assert settings.environ["HICACHE_WRITE_POLICY"] == "write_back"
    with pytest.raises(ValueError, match="l2_sise"):
        read_settings({"l2_sise": "1GiB"}, "m", {})
    with pytest.raises(ValueError, match="device: set by vLLM"):
        read_settings({"device": "cuda:1"}, "m", {})


def test_an_engine_without_l2_or_with_pipeline_stages_is_refused(vllm_engines):
    with pytest.raises(ValueError, match="l2_size"):
        VllmEngine({"l2_size": "0"}, engine_id="no-l2")
    engine = vllm_engines()
    config = TestVllmConfig(
        kv_transfer_config=engine.config.kv_transfer_config,
        model_config=SimpleNamespace(model="m"),
        parallel_config=SimpleNamespace(
            tensor_parallel_size=1, pipeline_parallel_size=2, distributed_executor_backend="mp"
        ),
        scheduler_config=engine.config.scheduler_config,
    )
    with pytest.raises(ValueError, match="pipeline_parallel_size 2"):
        KVConnectorFactory.create_connector(
            config, KVConnectorRole.SCHEDULER, engine.kv_cache_config
        )


def test_tensor_parallel_ranks_answer_over_their_sockets(vllm_engines):
    """Two tensor-parallel workers, each with its own cache and KV shard, out of the
    scheduler's reach but for their lookup sockets (as in vLLM's 'mp' executor)."""
    engine = vllm_engines({"page_size": 16}, num_ranks=2, backend="mp")
    assert engine.scheduler._shared is None
    prompt = random_prompt(14, 4 * 16 + 1, vocab=1000)
    a = engine.request("a", prompt)
    engine.step(a)
    written = [[engine.kv_of("a", i, 0, 64, rank=r) for i in range(2)] for r in range(2)]
    assert not torch.equal(written[0][0], written[1][0])  # the shards differ
    engine.finish(a)
    result = engine.step(engine.request("b", prompt[:64] + [9]))
    assert result.num_external_tokens == 64 and not result.failed_block_ids
    for rank in range(2):
        for layer in range(2):
            assert torch.equal(result.seen_by_rank[rank][layer], written[rank][layer])
    # A malformed request gets a miss, and the rank goes on answering.
    socket = zmq.Context.instance().socket(zmq.REQ)
    socket.connect(lookup_address("e0", 1))
    socket.send_multipart([b"", b"\x01\x02\x03"])
    assert socket.recv() == bytes(24)
    socket.send_multipart([b"", bytes(64 * 4), b"yes"])  # L3 asked or not: b"1" or b"0"
    assert socket.recv() == bytes(24)
    socket.close(linger=0)
    again = engine.request("b2", prompt[:64] + [7])
    assert engine.scheduler.get_num_new_matched_tokens(again, 0) == (64, False)
    # A page counts only when every rank holds its shard of it.
    engine.cache_of(1).evict("l1", 10**6)
    engine.cache_of(1).evict("l2", 10**6)
    other = engine.request("c", prompt[:64] + [8])
    assert engine.scheduler.get_num_new_matched_tokens(other, 0) == (0, False)


def test_the_embedded_engine_kv_reaches_vllm_layout_bitwise(
    source_only_model, engines, vllm_engines, tmp_path
):
    """A real model end to end: the embedded engine computes a prompt and writes its KV
    to L3; a vLLM engine (blocks of 8 tokens, block-outermost layout) on the same L3 loads
    it through the connector; what its attention sees equals the engine's own KV. (A
    full-attention model: a hybrid one's pages also hold the embedded engine's boundary
    residual, which vLLM's layout has no place for.)"""
    url = f"file://{tmp_path / 'l3'}?capacity=64MiB"
    engine = engines(source_only_model, l1_pages=64, l2_pages=64, l3_url=url)
    prompt = random_prompt(8, 5 * 16 + 4)
    run_one(engine, prompt)
    engine.cache.flush()
    match = engine.cache.match(prompt, engine.namespace)
    assert match.num_tokens == 80
    pages = engine.cache.device_pool.kv[:, match.device_page_ids]  # (L, n, S, 2, H, D)
    engine.cache.release(match)

    config = source_only_model.config
    shape = Shape(
        num_layers=config.num_source_layers,
        block_size=8,
        num_kv_heads=config.num_kv_heads,
        head_size=config.head_dim,
        layout=KVCacheLayout.BLNHC,
    )
    vllm = vllm_engines({"page_size": 16, "l3_url": url, "model_id": config.model_id}, shape)
    result = vllm.step(vllm.request("b", prompt))
    assert result.num_external_tokens == 80 and not result.failed_block_ids
    for layer in range(config.num_source_layers):
        expected = pages[layer].reshape(80, 2, config.num_kv_heads, config.head_dim)
        expected = expected.transpose(1, 2).reshape(80, config.num_kv_heads, -1)  # (n, H, C)
        assert torch.equal(result.seen[layer], expected)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("page_size", [16, 64])
def test_on_cuda_b_loads_a_prefix_layer_by_layer_bitwise(vllm_engines, page_size):
    """The same on a GPU: L2 pinned, hicache's copy engines / kernels for L2 -> L1, the
    copies into vLLM's blocks on the compute stream after each layer's event."""
    shape = Shape(block_size=16, dtype=torch.bfloat16, device="cuda", num_blocks=96,
                  num_kv_heads=8, head_size=128, layout=KVCacheLayout.LBNHC)  # fmt: skip
    engine = vllm_engines({"page_size": page_size, "l2_size": "256MiB", "l2_pin": True}, shape)
    prompt = random_prompt(9, 8 * page_size + 1, vocab=1000)
    written = compute_a(engine, prompt)
    engine.cache.flush()
    engine.cache.evict("l1", 10**6)
    result = engine.step(engine.request("b", prompt[: 6 * page_size] + [5]))
    torch.cuda.synchronize()
    assert result.num_external_tokens == 6 * page_size
    for layer in range(2):
        assert torch.equal(result.seen[layer], written[layer][: 6 * page_size])


@pytest.mark.slow
def test_bench_vllm_connector_smoke_prints_one_json_line_per_case():
    lines, stdout = run_smoke("bench_vllm_connector.py")
    assert [r["case"] for r in lines] == ["ceiling", "load", "hicache", "compute", "overlap"]
    for r in lines:
        assert r["bench"] == "vllm_connector" and r["git"] and r["prefix_tokens"] == 256
    assert 0 < lines[1]["of_ceiling"] and 0 <= lines[-1]["hidden"] <= 1
    assert "of ceiling" in stdout


def run_chunked(engine, request, chunk_tokens, num_computed_tokens=0):
    """The request's prompt in chunks of `chunk_tokens`, one step each (chunked prefill);
    returns the first step's result."""
    rid = request.request_id
    first = engine.step_batch([(request, num_computed_tokens)], [], chunk_tokens)[rid]
    while request.num_computed_tokens < request.num_tokens:
        result = engine.step_batch([], [request], chunk_tokens)[rid]
        assert not result.failed_block_ids
    return first


def test_chunked_prefill_loads_in_its_first_step_and_saves_in_its_last(vllm_engines):
    engine = vllm_engines({"page_size": 16})
    prompt_a = random_prompt(11, 5 * 16 + 3, vocab=1000)
    a = engine.request("a", prompt_a)
    run_chunked(engine, a, chunk_tokens=32)
    written_a = [engine.kv_of("a", layer, 0, 80) for layer in range(2)]
    assert engine.cache.stats().inserted_pages == 5  # once, when the prompt was complete
    engine.finish(a)
    engine.cache.evict("l1", 10**6)

    prompt_b = prompt_a[:64] + random_prompt(12, 40, vocab=1000)  # 104 tokens, 6 pages
    b = engine.request("b", prompt_b)
    first = run_chunked(engine, b, chunk_tokens=24)
    assert first.num_external_tokens == 64
    assert all(torch.equal(first.seen[i], written_a[i][:64]) for i in range(2))
    written_b = [engine.kv_of("b", layer, 0, 96) for layer in range(2)]
    engine.finish(b)
    # B's prompt was saved whole: its loaded pages and the ones it computed.
    c = engine.request("c", prompt_b[:96] + [3])
    result = engine.step(c)
    assert result.num_external_tokens == 96
    assert all(torch.equal(result.seen[i], written_b[i]) for i in range(2))


def test_loads_of_one_step_share_the_l1_staging_pages(vllm_engines):
    engine = vllm_engines({"page_size": 16, "l1_pages": 6})
    prompt = random_prompt(13, 4 * 16 + 1, vocab=1000)
    written = compute_a(engine, prompt)
    engine.cache.evict("l1", 10**6)
    b1 = engine.request("b1", prompt[:64] + [1])
    b2 = engine.request("b2", prompt[:64] + [2])
    results = engine.step_batch([(b1, 0), (b2, 0)], [])
    # L1 stages 6 pages a step: b1 gets its 4, b2 the 2 left (it computes the rest).
    assert results["b1"].num_external_tokens == 64
    assert results["b2"].num_external_tokens == 32
    for layer in range(2):
        assert torch.equal(results["b1"].seen[layer], written[layer][:64])
        assert torch.equal(results["b2"].seen[layer], written[layer][:32])
    assert not results["b1"].failed_block_ids and not results["b2"].failed_block_ids


def test_ranks_agree_on_the_shortest_prefix_and_a_silent_rank_is_a_miss(tmp_path):
    answers = [Found(2, 1, 1), Found(0, 3, 2)]
    assert shortest(answers) == Found(0, 3, 1)  # 4 pages; L1 on neither; L2 covers 3 on both
    silent = LookupClient(f"ipc://{tmp_path / 'nobody.sock'}", timeout_s=0.2)
    assert ask_all([silent], [1, 2, 3], "") == Found(0, 0, 0)  # its timeout ends the wait
    silent.close()


def test_the_answer_is_saved_when_the_request_ends(vllm_engines):
    """A request decodes past its prompt's pages; when it ends its blocks wait for one
    more step, in which the connector saves the answer's pages, and the next turn hits
    them."""
    engine = vllm_engines({"page_size": 16})
    prompt = random_prompt(15, 40, vocab=1000)  # 2 full pages
    a = engine.request("a", prompt)
    engine.step(a)
    for token in random_prompt(16, 30, vocab=1000):  # decode: one token a step
        a.append_output_token_ids(token)
        engine.step_batch([], [a])
    a.append_output_token_ids(5)  # sampled, never fed: it has no KV
    written = [engine.kv_of("a", layer, 0, 64) for layer in range(2)]
    turn = list(a.all_token_ids)
    assert engine.finish(a)  # 70 tokens with KV: 4 full pages, 2 past the prompt's
    assert "a" in engine.sending and engine.scheduler.has_pending_block_frees()
    engine.idle_step()
    assert "a" not in engine.sending  # saved, and the blocks given back
    assert not engine.scheduler.has_pending_block_frees()
    b = engine.request("b", turn + random_prompt(17, 10, vocab=1000))
    result = engine.step(b)
    assert result.num_external_tokens == 64 and not result.failed_block_ids
    for layer in range(2):
        assert torch.equal(result.seen[layer], written[layer])
