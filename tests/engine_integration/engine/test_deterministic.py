"""The deterministic path's kernels (`model/deterministic*.py`) on the CPU, through Triton's
interpreter (tests/conftest.py sets TRITON_INTERPRET=1): every row's bits the same whatever
the row count, the query count, the split point or the launch, and the values those of the
torch functions within rounding; then the model with them: a hit equals the cold prefill.

The interpreter's bfloat16 dot is wrong (numpy has none), so bfloat16 tiles are multiplied
as float32 copies there (`tiers.jit.INTERPRETED`): bfloat16 cases here check the kernels'
order of work and their masking, the GPU tests (`test_gpu_deterministic.py`) their bits on
the tensor cores."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from engine_integration.engine.embedded import load_model
from engine_integration.engine.model import deterministic, deterministic_attention, kernel_support
from engine_integration.engine.model.paged_attention import DeviceStep
from engine_integration.engine.model.window import LateWindow
from engine_integration.engine.sampling import SamplingParams
from tests.support.engines import ENGINE, SMALL, cache_off, random_prompt, run_one

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# The attention cases in bfloat16 repeat float32's order of work (the interpreter multiplies
# float32 copies) at twice the time: long-running.
ATTENTION_DTYPES = [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.slow)]
# Small cuts, so that short tests cross tiles and partitions (the real ones: 64 and 1,024).
SMALL_TILES = deterministic_attention.AttentionTiles(block_m=16, block_n=16, part_tiles=2)


def _tolerance(dtype):
    return 1e-5 if dtype == torch.float32 else 3e-2


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_matmul_row_has_the_same_bits_in_any_batch(dtype):
    """Rows in calls of 1, 3 and 7 rows, at any offset, strided or not, equal the rows of
    one call of 150 (more than a tile of rows); the result is F.linear's within rounding."""
    generator = torch.Generator().manual_seed(1)
    wide = torch.randn(150, 2 * 80, generator=generator).to(dtype)
    x = wide[:, :80]  # rows 160 apart: the gate half of a gate/up output
    weight = torch.randn(200, 80, generator=generator).to(dtype)  # K = 80: a partial K step
    bias = torch.randn(200, generator=generator).to(dtype)
    out = torch.full((150, 200), float("nan"), dtype=dtype)
    full = deterministic.matmul(x, weight, bias, out=out)
    assert full.data_ptr() == out.data_ptr() and not out.isnan().any()
    want = F.linear(x.double(), weight.double(), bias.double())
    assert ((full.double() - want).abs() / want.abs().clamp_min(1)).max() < _tolerance(dtype)
    for start, count in ((0, 1), (5, 3), (149, 1), (64, 7), (60, 7), (0, 7)):
        rows = slice(start, start + count)
        assert torch.equal(deterministic.matmul(x[rows], weight, bias), full[rows]), (start, count)
        assert torch.equal(deterministic.matmul(x[rows].contiguous(), weight, bias), full[rows])


def test_a_matmul_refuses_mixed_dtypes_and_a_wrong_k():
    x = torch.zeros(2, 8)
    with pytest.raises(ValueError, match="one dtype"):
        deterministic.matmul(x, torch.zeros(4, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match="K differs"):
        deterministic.matmul(x, torch.zeros(4, 9))


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_is_torchs_swiglu_element_by_element(dtype):
    generator = torch.Generator().manual_seed(2)
    gate_up = (torch.randn(37, 2 * 40, generator=generator) * 4).to(dtype)
    out = deterministic.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    want = F.silu(gate.float()).to(dtype).float() * up.float()
    assert ((out.float() - want).abs() / want.abs().clamp_min(1)).max() < _tolerance(dtype)
    for start, count in ((0, 1), (3, 3), (30, 7)):
        rows = slice(start, start + count)
        assert torch.equal(deterministic.silu_mul(gate_up[rows]), out[rows])


def _paged_case(length, num_heads, num_kv, dim, page, dtype, seed):
    """A pool whose request's pages are scattered, its slots past `length` poisoned (NaN:
    stale bytes), and queries for positions [0, length)."""
    generator = torch.Generator().manual_seed(seed)
    num_pages = -(-length // page)
    pool = torch.randn(num_pages + 3, page, 2, num_kv, dim, generator=generator).to(dtype)
    table = torch.randperm(num_pages + 3, generator=generator)[:num_pages]
    slots = (table[:, None] * page + torch.arange(page)).view(-1)
    pool.view(-1, 2, num_kv, dim)[slots[length:]] = float("nan")
    q = torch.randn(length, num_heads, dim, generator=generator).to(dtype)
    return q, pool, table, slots[:length]


def _reference(q, keys, values, scale, mask):
    """float64 attention: q (n, Hq, D) over keys and values (L, H, D), mask (n, L) True
    where seen."""
    group = q.shape[1] // keys.shape[1]
    k = keys.double().repeat_interleave(group, dim=1).transpose(0, 1)
    v = values.double().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = q.double().transpose(0, 1) @ k.transpose(1, 2) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    return (torch.softmax(scores, dim=-1) @ v).transpose(0, 1)


@pytest.mark.parametrize("dtype", ATTENTION_DTYPES)
@pytest.mark.parametrize("tiles", ["small", "real"])
def test_paged_attention_gives_a_query_the_same_bits_whatever_the_call(dtype, tiles, monkeypatch):
    """Queries computed in calls of 1, 3 and 7 (a decode step, a hit's few rows, at and
    across tile and partition cuts), split over partitions or merged in place, equal the
    rows of one causal call over every position; stale slots past the keys never leak in;
    the values are attention's within rounding."""
    if tiles == "small":
        monkeypatch.setattr(deterministic_attention, "tiles_for", lambda dim: SMALL_TILES)
    length, page = (90, 8) if tiles == "small" else (150, 16)
    q, pool, table, slots = _paged_case(length, 4, 2, 16, page, dtype, seed=3)
    full = deterministic_attention.paged_attention(q, 0, pool, table, scale=0.3, split=False)
    kv = pool.view(-1, 2, 2, 16)[slots]
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    want = _reference(q, kv[:, 0], kv[:, 1], 0.3, causal)
    assert (full.double() - want).abs().max() < _tolerance(dtype)
    for start, count in ((0, 1), (length - 1, 1), (31, 3), (30, 7), (64, 7), (40, length - 40)):
        end = start + count
        poisoned = pool.clone()  # what the call cannot see yet: as stale as the rest
        poisoned.view(-1, 2, 2, 16)[slots[end:]] = float("nan")
        for split in (False, True):
            part = deterministic_attention.paged_attention(
                q[start:end], start, poisoned, table, scale=0.3, split=split
            )
            assert torch.equal(part, full[start:end]), (start, count, split)


@pytest.mark.parametrize(("start", "num_rows"), [(70, 1), (37, 11), (0, 16)])
def test_a_step_read_from_the_device_has_the_bits_of_the_host_launch(start, num_rows, monkeypatch):
    """A CUDA graph's launch (capacity 16 rows; the step's position, rows, page table and
    pool layer read from the device), over as many partitions as the step needs or more:
    its first rows have the bits of `paged_attention`'s."""
    monkeypatch.setattr(deterministic_attention, "tiles_for", lambda dim: SMALL_TILES)
    capacity, end = 16, start + num_rows
    q, pool, table, _slots = _paged_case(start + capacity, 4, 2, 16, 8, torch.float32, seed=6)
    other = torch.full_like(pool, 3.0)  # layer 0 of the step; `pool` is its layer 1
    step = DeviceStep(2, pool.dtype, "cpu")
    step.set(start, num_rows, table, [other, pool])
    want = deterministic_attention.paged_attention(q[:num_rows], start, pool, table, scale=0.3)
    needed = deterministic_attention.slots_for(end, 16)
    for num_slots in (needed, 2 * needed):
        out = deterministic_attention.paged_attention_on_device(
            q[:capacity], other, 1, step, scale=0.3, num_slots=num_slots
        )
        assert torch.equal(out[:num_rows], want), num_slots


@pytest.mark.parametrize("dtype", ATTENTION_DTYPES)
def test_window_attention_gives_a_query_the_same_bits_however_the_window_was_fed(
    dtype, monkeypatch
):
    """Late-window attention of positions [0, 50) fed to the ring in one call, or in steps
    of 1, 3 and 7 (a decode step sees the ring; a prefill's first rows see only their own
    keys): the same bits, split or not; the values are windowed attention's."""
    monkeypatch.setattr(deterministic_attention, "tiles_for", lambda dim: SMALL_TILES)
    width, length = 20, 50
    generator = torch.Generator().manual_seed(4)
    q = torch.randn(length, 4, 16, generator=generator).to(dtype)
    kv = torch.randn(length, 2, 2, 16, generator=generator).to(dtype)

    def ring():
        return LateWindow(1, width, 2, 16, dtype=dtype, device="cpu")

    full = deterministic_attention.window_attention(q, kv, 0, ring(), 0, scale=0.3)
    query, key = torch.arange(length)[:, None], torch.arange(length)[None, :]
    seen = (key <= query) & (key > query - width)
    want = _reference(q, kv[:, 0], kv[:, 1], 0.3, seen)
    assert (full.double() - want).abs().max() < _tolerance(dtype)
    for steps, split in (((16, 1, 1, 1, 1, 30), False), ((3, 7, 1, 30, 9), True), ((7,) * 8, None)):
        window, start, parts = ring(), 0, []
        for count in steps:
            end = start + count
            parts.append(
                deterministic_attention.window_attention(
                    q[start:end], kv[start:end], start, window, 0, scale=0.3, split=split
                )
            )
            start = end
        assert torch.equal(torch.cat(parts), full), steps


def test_a_replay_that_starts_mid_window_sees_only_what_it_rebuilt(monkeypatch):
    """A hit's replay starts with an empty ring: its first rows see only the replayed keys
    (the ring's flags), and a row whose whole window was replayed has a cold prefill's bits."""
    monkeypatch.setattr(deterministic_attention, "tiles_for", lambda dim: SMALL_TILES)
    width = 20
    generator = torch.Generator().manual_seed(5)
    q = torch.randn(80, 4, 16, generator=generator)
    kv = torch.randn(80, 2, 2, 16, generator=generator)
    window = LateWindow(1, width, 2, 16, dtype=torch.float32, device="cpu")
    cold = deterministic_attention.window_attention(q, kv, 0, window, 0, scale=0.3)
    replay = LateWindow(1, width, 2, 16, dtype=torch.float32, device="cpu")
    part = deterministic_attention.window_attention(q[37:], kv[37:], 37, replay, 0, scale=0.3)
    assert torch.equal(part[width - 1 :], cold[37 + width - 1 :])
    assert not torch.equal(part[:1], cold[37:38])  # position 37 alone: only its own key


# ------------------------------------------------------------------ the model

DETERMINISTIC = dataclasses.replace(ENGINE, deterministic=True)
PARAMS = SamplingParams(max_new_tokens=2, return_logits=True)


@pytest.fixture(scope="module")
def deterministic_model():
    model, _ = load_model(None, DETERMINISTIC, seed=1, model_config=SMALL)
    assert model.deterministic and model.block_rows is None and model.workspace is None
    return model


def test_a_hit_and_a_batch_give_the_cold_prefills_bits(deterministic_model, engines):
    """The hybrid test model on the deterministic path: a hit from L1 that replays the late
    window, and the same prompt batched with another, give the logits of the cache-off
    prefill bit for bit, decode steps included."""
    model = deterministic_model
    first = random_prompt(1, 80)
    second = first[:70] + random_prompt(2, 8)
    cold = run_one(cache_off(model, DETERMINISTIC), second, PARAMS)
    engine = engines(model, config=DETERMINISTIC)
    run_one(engine, first, PARAMS)
    hit = run_one(engine, second, PARAMS)
    assert hit.metrics.hit_tokens["l1"] == 64 and hit.metrics.replayed_tokens > 0
    assert hit.token_ids == cold.token_ids and torch.equal(hit.logits, cold.logits)
    batched = cache_off(model, DETERMINISTIC).generate([random_prompt(3, 30), second], PARAMS)
    assert torch.equal(batched[1].logits, cold.logits)


def test_deterministic_is_refused_by_name_where_it_cannot_hold(monkeypatch):
    with pytest.raises(ValueError, match="deterministic and batch_invariant=True"):
        dataclasses.replace(ENGINE, deterministic=True, batch_invariant=True)
    gemma = SMALL.replace(block="gemma3", model_id="test-gemma-shape")
    with pytest.raises(ValueError, match="deterministic does not implement Gemma 3's block"):
        load_model(None, DETERMINISTIC, model_config=gemma)
    with pytest.raises(ValueError, match="power-of-two head_dim"):
        load_model(None, DETERMINISTIC, model_config=SMALL.replace(head_dim=24))
    monkeypatch.setattr(kernel_support, "INTERPRETED", False)  # a plain CPU run
    with pytest.raises(ValueError, match="deterministic runs its Triton kernels on CUDA"):
        load_model(None, DETERMINISTIC, model_config=SMALL)


def test_deterministic_pages_live_apart_from_the_default_paths(deterministic_model, engines):
    """Pages the default path wrote round otherwise: a deterministic engine never hits them."""
    default_model, _ = load_model(None, ENGINE, seed=1, model_config=SMALL)
    default = engines(default_model)
    prompt = random_prompt(6, 40)
    run_one(default, prompt, PARAMS)
    from engine_integration.engine.core import Engine

    other = Engine(deterministic_model, DETERMINISTIC, cache=default.cache)
    assert other.namespace != default.namespace
    assert run_one(other, prompt, PARAMS).metrics.total_hit_tokens == 0


@pytest.mark.slow  # the interpreter over every layer of every step, twice
def test_source_layers_read_from_the_device_step_keep_the_bits(deterministic_model, monkeypatch):
    """A one-request step run layer by layer as CUDA graphs would (`Model.layer_steps`: each
    layer reads the step from the device; on the CPU here, without graphs): a cold prompt's
    chunks and decode steps give the bits of the host launches."""
    model = deterministic_model
    monkeypatch.setattr(deterministic_attention, "tiles_for", lambda dim: SMALL_TILES)
    steps = []
    method = type(model)._source_layers_on_device
    monkeypatch.setattr(
        type(model),
        "_source_layers_on_device",
        lambda self, *a: steps.append(a[5].num_rows) or method(self, *a),
    )
    prompt = random_prompt(8, 100)
    plain = run_one(cache_off(model, DETERMINISTIC), prompt, PARAMS)
    monkeypatch.setattr(model, "layer_steps", True)
    on_device = run_one(cache_off(model, DETERMINISTIC), prompt, PARAMS)
    assert steps == [64, 36, 1]  # the chunks and the decode step
    assert on_device.token_ids == plain.token_ids
    assert torch.equal(on_device.logits, plain.logits)
