"""`GET /v1/hicache/profile` on a real `hicache engine serve` replica (the built-in tiny
model, random weights, on a free loopback port), and `hicache simulate --calibrate` against
it: what the endpoint answers, and the profile file the command writes."""

from __future__ import annotations

import json
import threading

import pytest

from engine_integration.engine.core import kv_layout_for
from engine_integration.engine.embedded import load_model
from engine_integration.engine.model.config import (
    EngineConfig,
    model_config_to_json,
    tiny_model_config,
)
from hicache.simulate.calibrate import MAX_FILL_PROMPTS, calibrate, fill_prompts, warmup_lengths
from hicache.simulate.errors import SimulationError
from hicache.simulate.profile import PROFILE_FORMAT, PROFILE_PATH, load_profile
from tests.support.cli import run_hicache
from tests.support.replicas import get_json, replica
from tests.support.servers import free_port

PAGE = 16


@pytest.fixture(scope="module")
def served():
    process = replica("--page-size", str(PAGE), "--l1-pages", "512", "--max-running", "4")
    process.start()
    try:
        yield process
    finally:
        process.stop()


def test_the_endpoint_answers_what_the_replica_runs(served):
    document = get_json(served.url + PROFILE_PATH)
    assert document["format"] == PROFILE_FORMAT and document["version"] == 1
    model, _ = load_model(None, EngineConfig(page_size=PAGE))
    assert document["model"]["name"] == model.config.model_id
    assert document["model"]["num_layers"] == model.config.num_layers
    assert document["model"]["num_sliding_layers"] == model.config.num_late_layers
    assert document["model"]["num_boundary_layers"] == model.config.num_boundary_layers
    assert document["page_size"] == PAGE
    assert document["page_bytes"] == kv_layout_for(model, PAGE).bytes_per_page
    assert document["dtype"] == "float32" and document["device"].startswith("cpu")
    assert document["prefill_chunk_tokens"] == EngineConfig().prefill_chunk_tokens
    assert document["max_running_requests"] == 4
    for name in ("l2_load_bytes_per_s", "l3_read_bytes_per_s"):
        assert document[name] > 0
    assert document["l3_latency_s"] >= 0


def test_calibrate_fits_the_steps_it_sent(served):
    profile = calibrate(served.url, rounds=1)
    assert profile.num_compute_samples >= 6  # one step per warm-up prompt
    fit = profile.compute
    assert fit.per_row_s > 0 or fit.per_pair_s > 0
    # a longer prompt costs more, as the engine's steps did
    assert profile.prefill_s(0, 2048) > profile.prefill_s(0, 64)
    assert profile.source == served.url
    assert 0 <= profile.request_overhead_s < 10  # HTTP and the hand-over, never negative
    assert profile.page_bytes == profile.model.kv_bytes_per_token * PAGE


def test_the_command_writes_a_profile_the_simulator_reads(served, tmp_path):
    path = tmp_path / "replica.json"
    done = run_hicache("simulate", "--calibrate", served.url, "--out", str(path))
    assert done.returncode == 0, done.stderr
    assert f"wrote {path}" in done.stdout
    profile = load_profile(path)
    document = json.loads(path.read_text())
    assert document["source"] == served.url
    assert document["request_overhead_s"] == profile.request_overhead_s >= 0
    planned = run_hicache(
        "simulate", "--profile", str(path), "--trace", "conversations:sessions=2,turns=2",
        "--l1", "8MB", "--l2", "0", "--no-verdict", "--json",
    )  # fmt: skip
    assert planned.returncode == 0, planned.stderr
    assert json.loads(planned.stdout)["config"]["model"] == profile.model.name


def test_calibrate_names_an_address_that_is_not_a_replica(served):
    with pytest.raises(SimulationError, match="answered HTTP 404"):
        calibrate(served.url + "/nothing-here", rounds=0)
    done = run_hicache("simulate", "--calibrate", "ftp://example.invalid")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "hicache simulate: error: --calibrate ftp://example.invalid: expected an http:// or "
        "https:// URL"
    ]


def test_calibrate_samples_l3_reads_on_a_replica_sized_for_it(tmp_path):
    """L1 for about one of the longest warm-up prompts (2,048 tokens: 128 pages), L2 for
    two, over a file:// L3: the repeated prompts come back from L3, and the profile's L3
    read rate is measured (the first read of a cache is no sample), not the prior."""
    profile = _calibrated_over_l3(tmp_path, l1_pages=130, l2_pages=260, rounds=3)
    assert profile.num_read_samples >= 1 and profile.num_load_samples >= 1
    assert profile.l3_latency_s > 0


def test_calibrate_sends_ids_the_replica_takes_when_its_model_outgrows_its_tokenizer(tmp_path):
    """A model whose embedding has more rows than its tokenizer has tokens (the benchmarks'
    random-weight models over the byte-level tokenizer, or a checkpoint padded for its
    kernels): the replica takes prompt ids below the tokenizer's size only, so that is the
    range calibration draws from, not the model's."""
    config = tmp_path / "padded.json"
    config.write_text(model_config_to_json(tiny_model_config(0).replace(vocab_size=4096)))
    process = replica("--model-config", str(config), "--page-size", str(PAGE))
    process.start()
    try:
        assert get_json(process.url + PROFILE_PATH)["model"]["vocab_size"] == 4096
        profile = calibrate(process.url, rounds=1)
    finally:
        process.stop()
    assert profile.num_compute_samples >= 6


def test_calibrate_waits_for_a_replica_that_is_still_starting(tmp_path):
    """As the README pastes it: the replica started in the background, --calibrate at once.
    The port opens only once the server is up (here: a replica started after the call)."""
    port = free_port()
    late = replica("--page-size", str(PAGE), "--l1-pages", "512", "--port", str(port))
    starter = threading.Timer(1.0, late.start)  # the call below begins before the replica
    starter.start()
    try:
        profile = calibrate(f"http://127.0.0.1:{port}", rounds=1, wait_s=300)
        assert profile.num_compute_samples >= 3
    finally:
        starter.join()
        late.stop()


def test_calibrate_gives_up_on_nothing_listening_naming_the_wait():
    port = free_port()
    with pytest.raises(SimulationError, match=r"within 0 s \(--calibrate-wait\)"):
        calibrate(f"http://127.0.0.1:{port}", wait_s=0)


def test_calibrate_samples_l3_reads_however_large_the_replicas_l1_and_l2(tmp_path):
    """An L1 and L2 that hold every warm-up prompt (here 200 + 400 pages: 9,600 tokens, the
    planner's H200 replicas 196K): calibration pushes enough prompts through them that the
    oldest come back from L3, so the profile's L3 read rate is measured there too."""
    profile = _calibrated_over_l3(tmp_path, l1_pages=200, l2_pages=400, rounds=1)
    assert profile.num_read_samples >= 1


def _calibrated_over_l3(tmp_path, *, l1_pages: int, l2_pages: int, rounds: int):
    """The profile `calibrate` makes of a replica of these pools over a file:// L3."""
    process = replica(
        "--page-size", str(PAGE), "--l1-pages", str(l1_pages), "--l2-pages", str(l2_pages),
        "--l3-url", f"file://{tmp_path}/l3?capacity=1GiB",
    )  # fmt: skip
    process.start()
    try:
        return calibrate(process.url, rounds=rounds)
    finally:
        process.stop()


def test_the_warm_up_spans_rows_up_to_a_chunk_then_chunks_over_a_cached_prefix():
    ladder = [64, 128, 256, 512, 1024, 2048]
    assert warmup_lengths(2048, 65536) == ladder + [4096, 8192]  # the H200 planner's L1
    assert warmup_lengths(2048, 8192) == ladder + [4096]  # half the L1 holds one: no more
    assert warmup_lengths(2048, 0) == ladder  # a replica that does not say
    assert warmup_lengths(512, 1 << 20) == [64, 128, 256, 512, 1024, 2048]
    assert warmup_lengths(48, 1 << 20) == [48, 96, 192]
    assert warmup_lengths(1 << 40, 1 << 62) == ladder  # what a replica says is bounded


def test_the_prompts_that_push_the_warm_up_into_l3_cover_l1_and_l2():
    info = {"l3": True, "l1_pages": 200, "l2_pages": 400, "page_size": 16}
    assert fill_prompts(info, 2048) == 6  # 9,600 tokens: 5 prompts hold them, one more
    assert fill_prompts(info | {"l3": False}, 2048) == 0
    assert fill_prompts(info | {"l2_pages": "400"}, 2048) == 3  # L1 only (not a count)
    big = info | {"l1_pages": 1 << 20, "l2_pages": 1 << 20}
    assert fill_prompts(big, 2048) == MAX_FILL_PROMPTS
