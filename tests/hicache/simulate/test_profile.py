"""Hardware profiles (`hicache.simulate.profile`): the file round trip, the simulator's TTFT
with a profile (the profile's own formula), and what a bad profile or a conflicting flag
gets (one line, exit 2)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from hicache.config import PolicyConfig
from hicache.fetch_plan import ComputeFit, attention_pairs
from hicache.simulate import TracePlayer
from hicache.simulate.config import SimulationConfig
from hicache.simulate.errors import SimulationError
from hicache.simulate.hardware import PRESETS as HARDWARE
from hicache.simulate.models import ModelSpec
from hicache.simulate.profile import (
    PROFILE_FORMAT,
    HardwareProfile,
    load_profile,
    profile_from_dict,
)
from hicache.simulate.trace import Request, Trace
from tests.support.cli import run_hicache

MODEL = ModelSpec(
    name="tiny-hybrid",
    attention="gqa",
    num_layers=6,
    hidden_size=256,
    num_heads=4,
    head_dim=64,
    num_kv_heads=2,
    vocab_size=258,
    intermediate_size=512,
    sliding_window=128,
    num_sliding_layers=2,
    num_boundary_layers=1,
    kv_dtype="float32",
)
PAGE = 16


def make_profile(**changes) -> HardwareProfile:
    values = dict(
        model=MODEL,
        device="cpu (test)",
        dtype="float32",
        page_size=PAGE,
        page_bytes=MODEL.kv_bytes_per_token * PAGE,
        prefill_chunk_tokens=100,
        max_running_requests=4,
        compute=ComputeFit(per_step_s=0.01, per_row_s=2e-5, per_pair_s=3e-8),
        num_compute_samples=12,
        l2_load_bytes_per_s=5e9,
        num_load_samples=3,
        l3_read_bytes_per_s=1e9,
        num_read_samples=0,
        l3_latency_s=2e-4,
        source="http://127.0.0.1:1",
        measured_at="2026-12-05T00:00:00Z",
    )
    values.update(changes)
    return HardwareProfile(**values)


def test_boundary_layers_ride_in_every_page():
    # 4 full layers + 1 boundary layer, 2 x 2 heads x 64 x 4 bytes each
    assert MODEL.kv_bytes_per_token == 5 * 2 * 2 * 64 * 4
    assert MODEL.kv_layout(PAGE).bytes_per_page == MODEL.kv_bytes_per_token * PAGE


def test_round_trip(tmp_path):
    profile = make_profile()
    path = tmp_path / "profile.json"
    profile.write(path)
    document = json.loads(path.read_text())
    assert document["format"] == PROFILE_FORMAT and document["version"] == 1
    assert load_profile(path) == profile
    assert profile_from_dict(profile.as_dict(), "here") == profile


def test_prefill_is_one_step_per_chunk():
    profile = make_profile()
    fit = profile.compute
    # rows [30, 250) in chunks of 100: [30, 130), [130, 230), [230, 250)
    expected = sum(
        fit.seconds(end - start, attention_pairs(start, end))
        for start, end in ((30, 130), (130, 230), (230, 250))
    )
    assert profile.prefill_s(30, 250) == pytest.approx(expected, rel=1e-12)
    assert profile.prefill_s(250, 250) == 0.0


def test_simulated_ttft_is_the_profile_formula():
    """Requests far apart (no queueing), no cache: each TTFT is the prefill of its whole
    prompt, by the profile's steps, plus its request overhead, and nothing else."""
    profile = make_profile(request_overhead_s=0.004)
    rng = np.random.default_rng(0)
    lengths = [40, 130, 257, 64]
    requests = [
        Request(arrival_s=100.0 * i, input_length=n, output_length=1,
                stream=rng.integers(0, 258, n).astype(np.uint32))
        for i, n in enumerate(lengths)
    ]  # fmt: skip
    config = SimulationConfig(
        model=MODEL,
        hardware=HARDWARE["h200"],
        page_size=PAGE,
        gpus_per_instance=1,
        l1_bytes=0,
        l2_bytes=0,
        policy=PolicyConfig(),
        profile=profile,
    )
    player = TracePlayer(config, Trace("four", requests))
    player.run()
    stats = player.request_stats
    ttft = stats.end_s - stats.arrival_s
    expected = [profile.prefill_s(0, n) + 0.004 for n in lengths]
    np.testing.assert_allclose(ttft, expected, rtol=1e-9)
    assert ttft[2] > ttft[1] > ttft[0]


def test_a_profile_of_other_pages_is_refused():
    with pytest.raises(ValueError, match="the profile measured pages of 16 tokens"):
        SimulationConfig(
            model=MODEL,
            hardware=HARDWARE["h200"],
            page_size=32,
            gpus_per_instance=1,
            l1_bytes=0,
            l2_bytes=0,
            profile=make_profile(),
        )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"format": "other"}, "not a hardware profile"),
        ({"version": 99}, "profile version 99"),
        ({"compute": None}, "compute must be an object"),
        ({"page_bytes": 12}, "page_bytes 12 is not the model's"),
        ({"l2_load_bytes_per_s": -1.0}, "l2_load_bytes_per_s must be a finite number > 0"),
        ({"prefill_chunk_tokens": 0}, "prefill_chunk_tokens must be an integer >= 1"),
        ({"request_overhead_s": float("nan")}, "request_overhead_s must be a finite number"),
        ({"extra": 1}, "unknown field 'extra'"),
    ],
)
def test_bad_profile_documents(change, message):
    document = {**make_profile().as_dict(), **change}
    with pytest.raises(SimulationError, match=message):
        profile_from_dict(document, "--profile x.json")


def test_a_missing_field_is_named():
    document = make_profile().as_dict()
    del document["l3_latency_s"]
    with pytest.raises(SimulationError, match="has no 'l3_latency_s'"):
        profile_from_dict(document, "--profile x.json")


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{", "not valid JSON"),
        ("[1, 2]", "not a hardware profile"),
        (None, "cannot read"),
        (json.dumps({**make_profile().as_dict(), "compute": {"per_step_s": 1}}), "compute must"),
    ],
)
def test_bad_profile_file_is_one_line_and_exit_2(tmp_path, content, message):
    path = tmp_path / "profile.json"
    if content is not None:
        path.write_text(content)
    done = run_hicache("simulate", "--profile", str(path), "--limit", "2", "--no-verdict")
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and "--profile" in lines[0], done.stderr


def test_mfu_with_a_profile_names_both(tmp_path):
    path = tmp_path / "profile.json"
    make_profile().write(path)
    done = run_hicache("simulate", "--profile", str(path), "--mfu", "0.3")
    assert done.returncode == 2
    assert "--mfu and --profile" in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_cli_plans_with_the_profile(tmp_path):
    path = tmp_path / "profile.json"
    make_profile().write(path)
    done = run_hicache(
        "simulate", "--profile", str(path), "--trace", "conversations:sessions=3,turns=2",
        "--l1", "2MB", "--l2", "0", "--no-verdict", "--json",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["config"]["model"] == "tiny-hybrid"
    assert out["config"]["page_size"] == PAGE and out["config"]["mfu"] is None
    assert out["config"]["profile"]["device"] == "cpu (test)"
    assert out["config"]["l3_latency_us"] == pytest.approx(200.0)


def _config(**changes) -> SimulationConfig:
    values = dict(
        model=MODEL,
        hardware=HARDWARE["h200"],
        page_size=PAGE,
        gpus_per_instance=1,
        l1_bytes=100 * MODEL.kv_bytes_per_token * PAGE,
        l2_bytes=0,
        profile=make_profile(),
    )
    values.update(changes)
    return SimulationConfig(**values)


def test_the_controllers_weigh_fetches_by_the_profile():
    request = Request(arrival_s=0.0, input_length=32, output_length=1,
                      stream=np.arange(32, dtype=np.uint32))  # fmt: skip
    player = TracePlayer(_config(), Trace("one", [request]))
    fit = player.caches[0].fetch_rates().compute
    expected = make_profile().compute
    for name in ("per_step_s", "per_row_s", "per_pair_s"):
        assert getattr(fit, name) == pytest.approx(getattr(expected, name), rel=1e-6)


@pytest.mark.parametrize(("engine", "hit_pages"), [(False, 4), (True, 3)])
def test_engine_requests_look_up_all_but_the_last_token(engine, hit_pages):
    """A prompt of 4 whole pages, twice: the engine looks up 63 tokens (3 pages), and
    caches each answer's page too (output 20 tokens: 64 + 19 -> 5 pages, the fifth each
    request's own): 4 prompt pages + 2 answer pages."""
    prompt = np.arange(64, dtype=np.uint32)
    requests = [
        Request(arrival_s=100.0 * i, input_length=64, output_length=20, stream=prompt)
        for i in range(2)
    ]
    player = TracePlayer(_config(engine_requests=engine), Trace("twice", requests))
    player.run()
    assert player.request_stats.hit_pages[1].tolist() == [hit_pages, 0, 0]
    assert player.caches[0].pages_in_use("l1") == (6 if engine else 4)


def test_a_prefill_waits_for_the_decode_step_running():
    """With engine requests and a profile, the first request decodes 10 steps after its
    first token; a second arriving in the middle of the third step starts when it ends."""
    profile = make_profile()
    first_s = profile.prefill_s(0, 32)
    step_s = profile.step_s(1, 33)
    arrival_s = first_s + 2.5 * step_s
    requests = [
        Request(arrival_s=0.0, input_length=32, output_length=11,
                stream=np.arange(32, dtype=np.uint32)),
        Request(arrival_s=arrival_s, input_length=48, output_length=2,
                stream=np.arange(1000, 1048, dtype=np.uint32)),
        Request(arrival_s=arrival_s + 10.0, input_length=16, output_length=1,
                stream=np.arange(2000, 2016, dtype=np.uint32)),
    ]  # fmt: skip
    player = TracePlayer(_config(engine_requests=True), Trace("three", requests))
    player.run()
    stats = player.request_stats
    ttft = stats.end_s - stats.arrival_s
    assert ttft[0] == pytest.approx(first_s)
    assert ttft[1] == pytest.approx(0.5 * step_s + profile.prefill_s(0, 48))
    assert ttft[2] == pytest.approx(profile.prefill_s(0, 16))  # every decode long done


def test_pages_reach_the_cache_when_the_answer_ends():
    """As in the engine, a request's pages are cached when its last token is out: the
    same prompt again while the first still decodes finds nothing; after, 3 pages."""
    profile = make_profile()
    prompt = np.arange(64, dtype=np.uint32)
    first_s = profile.prefill_s(0, 64)
    requests = [
        Request(arrival_s=0.0, input_length=64, output_length=11, stream=prompt),
        Request(arrival_s=first_s + 1.5 * profile.step_s(1, 65), input_length=64,
                output_length=2, stream=prompt),
        Request(arrival_s=100.0, input_length=64, output_length=1, stream=prompt),
    ]  # fmt: skip
    player = TracePlayer(_config(engine_requests=True), Trace("again", requests))
    player.run()
    assert player.request_stats.hit_pages[:, 0].tolist() == [0, 0, 3]


@pytest.mark.parametrize("shared", [False, True])
def test_instances_on_one_device_take_turns(shared):
    """Two requests at once, one per instance (round robin): on a device of their own
    both prefill at once; on one shared device the second waits for the first."""
    profile = make_profile()
    requests = [
        Request(arrival_s=0.0, input_length=96, output_length=1,
                stream=np.arange(i * 1000, i * 1000 + 96, dtype=np.uint32))
        for i in range(2)
    ]  # fmt: skip
    config = _config(num_instances=2, routing="round_robin", shared_device=shared)
    player = TracePlayer(config, Trace("two", requests))
    player.run()
    stats = player.request_stats
    ttft = sorted(stats.end_s - stats.arrival_s)
    alone = profile.prefill_s(0, 96)
    assert sorted(stats.instance.tolist()) == [0, 1]
    assert ttft == pytest.approx([alone, 2 * alone if shared else alone])


@pytest.mark.parametrize("pool_pages", [None, 3])
def test_a_cache_off_engine_runs_what_its_pool_holds(pool_pages):
    """No cache (L1 0), the engine's pool 3 pages: a request of 32 + 10 tokens holds all 3
    while it decodes, so the next waits for it to end; a pool of None holds both."""
    profile = make_profile()
    first_s = profile.prefill_s(0, 32)
    step_s = profile.step_s(1, 33)
    arrival_s = first_s + 0.5 * step_s
    requests = [
        Request(arrival_s=0.0, input_length=32, output_length=11,
                stream=np.arange(32, dtype=np.uint32)),
        Request(arrival_s=arrival_s, input_length=32, output_length=1,
                stream=np.arange(100, 132, dtype=np.uint32)),
    ]  # fmt: skip
    config = _config(l1_bytes=0, engine_requests=True, engine_pool_pages=pool_pages)
    player = TracePlayer(config, Trace("two", requests))
    player.run()
    stats = player.request_stats
    waited_s = stats.began_s[1] - arrival_s
    if pool_pages is None:
        assert waited_s == pytest.approx(0.5 * step_s)  # the decode step running
    else:
        assert waited_s == pytest.approx(first_s + 10 * step_s - arrival_s)
    assert stats.hit_pages.sum() == 0
