"""The engine's model against a dense float64 reference, and its batch invariance."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine_integration.engine.embedded import load_model
from engine_integration.engine.model.config import EngineConfig, RopeScaling
from engine_integration.engine.model.forward import Model
from engine_integration.engine.model.norm_rope import (
    RotaryTable,
    _inverse_frequencies,
    apply_rope,
)
from engine_integration.engine.model.rows import RowLayout
from engine_integration.engine.sampling import SamplingParams
from tests.support.engines import ENGINE, GREEDY, SMALL, cache_off, random_prompt, run_one
from tests.support.reference_model import reference_logits


def _check_against_reference(model, output):
    tokens = output.prompt_token_ids + output.token_ids
    expected = reference_logits(model.config, model.weights, tokens[:-1])
    # the reference's logits at the positions that produced each generated token
    wanted = expected[len(output.prompt_token_ids) - 1 :]
    torch.testing.assert_close(output.logits.double(), wanted, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("length", [5, 40, 150])
def test_model_with_late_layers_matches_reference(small_model, length):
    output = run_one(cache_off(small_model), random_prompt(length, length))
    _check_against_reference(small_model, output)


@pytest.mark.parametrize(("window", "num_late"), [(32, 2), (16, 3), (8, 1)])
def test_stacked_window_layers_are_the_checkpoints_model(window, num_late):
    """K stacked window layers see K * (W - 1) + 1 positions back: sending only the last W
    rows through them (the old plan) was another model, 1.7e-2 off a real Qwen2's logits."""
    config = SMALL.replace(
        num_layers=2 + num_late, window_tokens=window, model_id=f"test-k{num_late}-w{window}"
    )
    model, _ = load_model(None, ENGINE, seed=4, model_config=config)
    output = run_one(cache_off(model), random_prompt(8, 150))
    _check_against_reference(model, output)


def test_source_only_model_matches_reference(source_only_model):
    output = run_one(cache_off(source_only_model), random_prompt(3, 90))
    _check_against_reference(source_only_model, output)


# 600 tokens on 2 threads: 58 s on a loaded 2-core machine; the slow lane runs it.
@pytest.mark.parametrize("length", [150, pytest.param(600, marks=pytest.mark.slow)])
@pytest.mark.parametrize("threads", [1, 2])
def test_chunking_and_batching_never_change_a_bit(small_model, threads, length):
    """Batch invariance: chunk size and batch neighbours leave every logit unchanged (600
    tokens: past the attention's coarsest tile, 512 positions with these 8-row blocks)."""
    torch.set_num_threads(threads)
    _assert_chunk_and_batch_invariant(small_model, random_prompt(11, length))


@pytest.mark.parametrize("threads", [1, 2])
def test_an_mlp_width_with_scalar_tails_runs_in_whole_blocks(threads):
    """An MLP of 100 columns, which `tail_free` cannot clear for one silu call over the
    packed rows: the runs fill whole blocks and silu runs block by block, bit for bit."""
    torch.set_num_threads(threads)
    config = SMALL.replace(intermediate_size=100, model_id="test-mlp-100")
    model, _ = load_model(None, ENGINE, seed=6, model_config=config)
    layout = model._layout([(5, 19), (40, 41)])
    assert layout.aligned_rows == 8 and layout.num_packed == 24 + model.align_rows  # + singles
    _assert_chunk_and_batch_invariant(model, random_prompt(12, 150))


def _assert_chunk_and_batch_invariant(model, tokens):
    alone = run_one(cache_off(model), tokens)
    for chunk in (8, 24, 1000):
        config = dataclasses.replace(ENGINE, prefill_chunk_tokens=chunk)
        assert torch.equal(run_one(cache_off(model, config), tokens).logits, alone.logits)
    crowded = cache_off(model)
    others = [crowded.add_request(random_prompt(20 + i, 30 + 17 * i), GREEDY) for i in range(3)]
    mine = crowded.add_request(tokens, GREEDY)
    outputs = {output.request_id: output for output in crowded.run()}
    assert len(outputs) == len(others) + 1
    assert torch.equal(outputs[mine.request_id].logits, alone.logits)


@pytest.mark.parametrize("chunk", [24, 1000])
@pytest.mark.parametrize("fixture", ["small_model", "source_only_model"])
def test_the_last_layer_runs_only_the_rows_read_bit_for_bit(request, monkeypatch, fixture, chunk):
    """The last layer's attention output, MLP and norm run only for the rows the head reads
    (a hybrid model's last late layer; a full-attention model's last layer), while every new
    row still writes its K/V: logits (prefill and decode) and every K/V (and boundary
    residual) of the pool equal those of the path that runs every row through every layer,
    bit for bit, in a batch of three requests, whole and in chunks of 24."""
    model = request.getfixturevalue(fixture)
    config = dataclasses.replace(ENGINE, prefill_chunk_tokens=chunk)
    prompts = [random_prompt(30 + i, length) for i, length in enumerate((150, 61, 9))]
    finished_runs = []
    finish_some = Model._finish_some

    def spy(self, weights, x, index, runs, attn):
        finished_runs.extend(runs)
        return finish_some(self, weights, x, index, runs, attn)

    def run():
        return _logits_and_pool(model, config, prompts)

    monkeypatch.setattr(Model, "_finish_some", spy)
    skipped_logits, skipped_kv = run()
    assert (149, 150) in finished_runs  # the restriction was at work
    if model.config.num_late_layers:  # only in the last late layer: the last source layer's
        # output of every row is stored (the boundary residual)
        assert all(end == start + 1 for start, end in finished_runs)
    finished_runs.clear()
    monkeypatch.setattr(model, "skip_unread_rows", False)
    every_logits, every_kv = run()
    assert not finished_runs
    for skipped, every in zip(skipped_logits, every_logits, strict=True):
        assert skipped.shape == every.shape and torch.equal(skipped, every)
    for skipped, every in zip(skipped_kv, every_kv, strict=True):
        assert torch.equal(skipped, every)


def _logits_and_pool(model, config, prompts):
    """Run `prompts` as one batch: each request's logits, and a copy of every K/V (and
    boundary residual) layer of the pool, over pages filled with the same stale values."""
    engine = cache_off(model, config)
    shape = model.config  # the source layers' K/V and the boundary residual
    num_layers = shape.num_source_layers + shape.num_boundary_layers
    layers = [engine.pages.layer(i) for i in range(num_layers)]
    for layer in layers:
        layer.fill_(7.0)
    requests = [engine.add_request(tokens, GREEDY) for tokens in prompts]
    outputs = {output.request_id: output for output in engine.run()}
    return [outputs[r.request_id].logits for r in requests], [t.clone() for t in layers]


@pytest.mark.parametrize("fixture", ["small_model", "source_only_model"])
def test_the_cpu_workspace_changes_no_bit_and_is_reused(request, monkeypatch, fixture):
    """The CPU forward writes its four projections' gemms into the model's reused buffers:
    logits (prefill in chunks of 24, then decode) and every K/V of the pool equal those of
    fresh tensors, bit for bit, in a batch of three; the buffers stay the same memory
    over the run's steps, grown once to its largest."""
    model = request.getfixturevalue(fixture)
    config = dataclasses.replace(ENGINE, prefill_chunk_tokens=24)
    prompts = [random_prompt(40 + i, length) for i, length in enumerate((90, 33, 7))]
    workspace = model.workspace
    assert workspace is not None
    taken = []
    take = type(workspace).take

    def spy(self, name, rows, width, like):
        buffer = take(self, name, rows, width, like)
        taken.append((name, buffer.data_ptr()))
        return buffer

    monkeypatch.setattr(type(workspace), "take", spy)
    reused_logits, reused_kv = _logits_and_pool(model, config, prompts)
    names = {name for name, _ in taken}
    assert names == {"qkv", "o", "gate_up", "down"}
    for name in names:  # one buffer for every layer and step after the largest
        addresses = [address for n, address in taken if n == name]
        assert len(addresses) >= 20 and len(set(addresses[len(addresses) // 2 :])) == 1
    monkeypatch.setattr(model, "workspace", None)
    fresh_logits, fresh_kv = _logits_and_pool(model, config, prompts)
    for reused, fresh in zip(reused_logits, fresh_logits, strict=True):
        assert reused.shape == fresh.shape and torch.equal(reused, fresh)
    for reused, fresh in zip(reused_kv, fresh_kv, strict=True):
        assert torch.equal(reused, fresh)


def test_dense_path_is_the_same_model(small_model):
    """Without invariance (the CUDA path, here on the CPU) results agree to float error."""
    config = dataclasses.replace(ENGINE, batch_invariant=False)
    dense, _ = load_model(None, config, seed=1, model_config=SMALL)
    assert dense.block_rows is None
    tokens = random_prompt(5, 100)
    blocked = run_one(cache_off(small_model), tokens)
    unblocked = run_one(cache_off(dense, config), tokens)
    torch.testing.assert_close(unblocked.logits, blocked.logits, rtol=1e-4, atol=1e-4)


def test_row_layout_groups_runs_by_position():
    layout = RowLayout.build([(5, 19), (40, 41), (43, 44), (48, 49)], 8, "cpu", pointwise_width=128)
    # run (5, 19): the groups of 4 positions it touches (positions 4..19); the single tokens
    # follow, one after another, padded to 4 rows.
    assert layout.num_packed == 16 + 4
    assert layout.index[:14].tolist() == list(range(1, 15))
    assert layout.positions[layout.index].tolist() == [*range(5, 19), 40, 43, 48]
    assert len(set(layout.index.tolist())) == layout.index.numel()
    # an MLP width whose silu would end in a scalar tail: whole blocks (positions 0..23)
    blocked = RowLayout.build([(5, 19), (40, 41)], 8, "cpu", pointwise_width=100)
    assert blocked.num_packed == 24 + 4 and blocked.index[:14].tolist() == list(range(5, 19))
    with pytest.raises(ValueError, match="pointwise_width=100"):
        RowLayout.build([(5, 19)], 8, "cpu").pointwise(torch.sin, torch.zeros(16, 100), width=100)
    # a prompt of a multiple of 4 tokens from position 0 needs no padding
    assert not RowLayout.build([(0, 700)], 16, "cpu", pointwise_width=1536).padded
    dense = RowLayout.build([(5, 19), (40, 41)], None, "cpu")
    assert dense.num_packed == 15 and dense.positions.tolist() == [*range(5, 19), 40]


@pytest.mark.parametrize("threads", [1, 2])
def test_rope_in_halves_is_the_textbook_formula_bit_for_bit(threads):
    """apply_rope computes x * cos + rotate_half(x) * sin in fewer passes: the same bits."""
    torch.set_num_threads(threads)
    config = SMALL.replace(head_dim=64, rope_theta=100000.0)
    positions = torch.arange(3000, 3700)
    cos, sin = RotaryTable(config, "cpu", torch.float32).lookup(positions, 3699)
    x = torch.randn(700, 15, 64, generator=torch.Generator().manual_seed(3))[:, 2:11]  # strided
    half = x.shape[-1] // 2
    textbook = x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin
    out = torch.full_like(textbook, float("nan"))
    apply_rope(x, cos, sin, out=out)
    assert torch.equal(out, textbook)


def test_llama3_rope_scaling_keeps_high_frequencies():
    base = SMALL.replace(head_dim=64, rope_theta=500000.0)
    scaled = base.replace(rope_scaling=RopeScaling(kind="llama3", factor=8.0))
    plain, stretched = _inverse_frequencies(base), _inverse_frequencies(scaled)
    assert torch.equal(stretched[:4], plain[:4])  # short wavelengths untouched
    torch.testing.assert_close(stretched[-1], plain[-1] / 8)  # long ones divided by factor


def test_temperature_sampling_is_seeded_per_request(small_model):
    params = SamplingParams(max_new_tokens=12, temperature=1.5, top_k=20, top_p=0.9, seed=5)
    tokens = random_prompt(9, 40)
    first = run_one(cache_off(small_model), tokens, params)
    again = run_one(cache_off(small_model), tokens, params)
    other = run_one(cache_off(small_model), tokens, dataclasses.replace(params, seed=6))
    assert first.token_ids == again.token_ids
    assert first.token_ids != other.token_ids
    greedy = run_one(cache_off(small_model), tokens, SamplingParams(max_new_tokens=12))
    assert first.token_ids != greedy.token_ids


def test_stop_tokens_end_generation(small_model):
    tokens = random_prompt(4, 30)
    free = run_one(cache_off(small_model), tokens, SamplingParams(max_new_tokens=8))
    stop = free.token_ids[2]
    stopped = run_one(
        cache_off(small_model), tokens, SamplingParams(max_new_tokens=8, stop_token_ids=(stop,))
    )
    cut = free.token_ids.index(stop) + 1
    assert stopped.token_ids == free.token_ids[:cut]
    assert stopped.finish_reason == "stop" and free.finish_reason == "length"


def test_engine_config_rejects_bad_values():
    with pytest.raises(ValueError, match="block_tokens"):
        EngineConfig(page_size=16, block_tokens=6)
    with pytest.raises(ValueError, match="device"):
        EngineConfig(device="tpu")
    with pytest.raises(ValueError, match="num_source_layers"):
        SMALL.replace(num_source_layers=0)
