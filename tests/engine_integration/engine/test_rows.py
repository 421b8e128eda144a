"""The premises of the batch-invariant CPU path, checked on the machine the tests run on, and
the tiled source attention against a dense reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine_integration.engine.model import rows as rows_module
from engine_integration.engine.model.rows import RowLayout, tail_free
from engine_integration.engine.model.tile_attention import nested_tile_attention, tiled_attention


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize(("num_in", "num_out"), [(64, 256), (576, 960), (1536, 576), (64, 96)])
def test_gemm_gives_a_row_the_same_bits_for_any_multiple_of_its_row_group(threads, num_in, num_out):
    """rows.py's premise: there is a row group G (measured by `gemm_row_group`, at most a
    block) such that a projection over all packed rows gives each row the bits it gets in any
    other multiple-of-G row count, at any offset."""
    group = rows_module.gemm_row_group([(num_in, num_out)], torch.float32, 16)
    if group is None and threads > 1:  # seen on some AVX-512 machines at 2 threads
        pytest.skip(f"this CPU's sgemm keeps no row group at {threads} threads at this shape")
    assert group is not None, "no row group up to a 16-row block keeps the gemm's bits"
    generator = torch.Generator().manual_seed(num_in + num_out)
    weight = torch.randn(num_out, num_in, generator=generator)
    x = torch.randn(1024, num_in, generator=generator)
    full = F.linear(x, weight)
    strided = torch.cat([x, x], dim=1)[:, :num_in]  # the same rows, 2 * num_in apart
    for num_rows in sorted({group * m for m in (1, 2, 3, 4, 5, 12, 25, 64)}):
        for offset in (0, 4, 1024 - num_rows):
            rows = slice(offset, offset + num_rows)
            assert torch.equal(F.linear(x[rows], weight), full[rows]), (num_rows, offset)
            assert torch.equal(F.linear(strided[rows], weight), full[rows]), (num_rows, offset)


def test_silu_in_one_call_only_where_no_scalar_tail(threads):
    """A silu share ending in a scalar tail gives other bits there (seen on this machine:
    thousands of elements of 100,003 differ in chunks of 7): `pointwise` runs one call only
    where `tail_free` holds, and then each block's rows keep their bits."""
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(48 * 16, 2 * 1536, generator=generator) * 4
    layout = RowLayout.build([(0, x.shape[0])], 16, "cpu")

    def swiglu(block):
        gate, up = block.chunk(2, dim=-1)
        return F.silu(gate) * up

    assert tail_free(x.shape[0] * 1536, 1536)
    whole = layout.pointwise(swiglu, x, width=1536)
    assert torch.equal(whole, layout.map_blocks(swiglu, x))
    assert not tail_free(100_003) and not tail_free(16 * 100, 100)


def test_swiglu_in_place_in_the_gate_half_keeps_every_bit(threads):
    """The model computes silu(gate) * up in place in the gate half of the gate/up output:
    the same bits as out of place, in one call and block by block."""
    generator = torch.Generator().manual_seed(4)
    x = torch.randn(44 * 16, 2 * 1536, generator=generator) * 4
    gate, up = x.chunk(2, dim=-1)
    expected = F.silu(gate) * up
    in_place = x.clone()
    gate, up = in_place.chunk(2, dim=-1)
    assert torch.equal(F.silu(gate, inplace=True).mul_(up), expected)
    for number, block in enumerate(x.clone().split(16)):
        gate, up = block.chunk(2, dim=-1)
        part = expected[number * 16 : (number + 1) * 16]
        assert torch.equal(F.silu(gate, inplace=True).mul_(up), part)


def test_exp_gives_an_element_the_same_bits_at_any_length_and_offset(threads):
    """The nested tile attention merges its parts with `torch.exp` over tensors whose
    length follows the step's row count: exp must not compute a tail with another formula
    (unlike silu, above, it is one vectorised map with a partial last vector)."""
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(150_000, generator=generator) * 20
    whole = torch.exp(x)
    for length in [*range(1, 70), 1000, 1001, 33_333, 65_537, 100_003]:
        for offset in (0, 1, 3, 17, 36):
            part = slice(offset, offset + length)
            assert torch.equal(torch.exp(x[part]), whole[part]), (length, offset)


def _dense_reference(q, first, keys, values, scale):
    """float64 causal attention of q (m, Hq, D) at positions [first, first + m)."""
    m, num_heads, _ = q.shape
    group = num_heads // keys.shape[0]
    k = keys.double().repeat_interleave(group, 0)  # (Hq, L, D)
    v = values.double().repeat_interleave(group, 0)
    scores = torch.einsum("mhd,hld->hml", q.double(), k) * scale
    positions = torch.arange(first, first + m)
    hidden = torch.arange(keys.shape[1])[None, :] > positions[:, None]
    probs = torch.softmax(scores.masked_fill(hidden, float("-inf")), dim=-1)
    return torch.einsum("hml,hld->mhd", probs, v)


def per_query_head(keys, values, group=3):
    return keys.repeat_interleave(group, 0), values.repeat_interleave(group, 0)


def test_tiled_attention_is_causal_attention_and_row_invariant(threads):
    """Against float64; and a query's bits are the same whichever rows of its tile share
    the call and whatever lies in the keys past it (not written yet: zeros)."""
    generator = torch.Generator().manual_seed(7)
    tile, length = 32, 96  # 3 tiles of 4 blocks of 8 rows
    q = torch.randn(length, 6, 16, generator=generator)
    keys = torch.randn(2, length, 16, generator=generator)
    values = torch.randn(2, length, 16, generator=generator)
    scale = 16**-0.5
    full = tiled_attention(q, 0, *per_query_head(keys, values), scale, tile=tile)
    expected = _dense_reference(q, 0, keys, values, scale)
    torch.testing.assert_close(full.double(), expected, rtol=1e-5, atol=1e-5)
    for start, end in [(8, 16), (24, 40), (40, 96), (88, 96), (0, 64), (4, 8), (92, 96), (60, 68)]:
        written = end  # keys past the queries are zeros, as before they are written
        k, v = keys.clone(), values.clone()
        k[:, written:] = 0
        v[:, written:] = 0
        part = tiled_attention(q[start:end], start, *per_query_head(k, v), scale, tile=tile)
        assert torch.equal(part, full[start:end]), (start, end)


def _zero_past(keys, values, written):
    """The keys as a request's pages hold them before positions >= written exist."""
    keys, values = keys.clone(), values.clone()
    keys[:, written:] = 0
    values[:, written:] = 0
    return keys, values


def test_nested_tile_attention_is_causal_attention_and_row_invariant(threads):
    """The CPU's attention (nested tiles of 64, 16 and 8 positions) against float64, and a
    query's bits whichever rows share its calls (a decode step's 4 rows, a chunk, a replay
    after a hit) and whatever lies in the keys past it."""
    generator = torch.Generator().manual_seed(8)
    tiles, length = (64, 16, 8), 200
    q = torch.randn(length, 6, 16, generator=generator)
    keys = torch.randn(2, length, 16, generator=generator)
    values = torch.randn(2, length, 16, generator=generator)
    scale = 16**-0.5
    full = nested_tile_attention(q, 0, keys, values, scale, tiles=tiles)
    expected = _dense_reference(q, 0, keys, values, scale)
    torch.testing.assert_close(full.double(), expected, rtol=1e-5, atol=1e-5)
    ranges = [(0, 4), (8, 16), (60, 68), (64, 68), (120, 200), (128, 132), (132, 200),
              (196, 200), (4, 180), (76, 84), (0, 200)]  # fmt: skip
    for start, end in ranges:
        k, v = _zero_past(keys, values, end)
        part = nested_tile_attention(q[start:end], start, k, v, scale, tiles=tiles)
        assert torch.equal(part, full[start:end]), (start, end)


def test_nested_tiles_keep_a_rows_bits_across_the_flash_kernels_query_splits(threads):
    """At the engine's sizes (SmolLM2's 9 query and 3 KV heads of 64, tiles of 1,024, 256
    and 128 positions) the CPU flash kernel cuts a call's queries into blocks of 32, 64 or
    256 rows by how many rows the call has: a query's bits must not follow that cut."""
    generator = torch.Generator().manual_seed(9)
    tiles, length = (1024, 256, 128), 1280
    q = torch.randn(length, 9, 64, generator=generator)
    keys = torch.randn(3, length, 64, generator=generator)
    values = torch.randn(3, length, 64, generator=generator)
    full = nested_tile_attention(q, 0, keys, values, 0.125, tiles=tiles)
    for start, end in [(1024, 1028), (1276, 1280), (1100, 1280), (700, 1160), (256, 1280)]:
        k, v = _zero_past(keys, values, end)
        part = nested_tile_attention(q[start:end], start, k, v, 0.125, tiles=tiles)
        assert torch.equal(part, full[start:end]), (start, end)


def test_a_cpu_whose_gemm_breaks_the_premise_is_named_at_model_load(monkeypatch, caplog):
    """The model checks the premise at its own projection shapes when it is built; where it
    fails, one warning says hits will equal cold prefills only to rounding."""
    from engine_integration.engine.model import rows

    assert rows.gemm_row_group([(64, 96)], torch.float32, 16) is not None
    real = F.linear

    def drifting(x, weight, bias=None):  # a BLAS whose bits depend on the row count
        out = real(x, weight, bias)
        return out + (x.shape[0] % 32) * 1e-7

    monkeypatch.setattr(rows.F, "linear", drifting)
    rows._gemm_rows_invariant.cache_clear()
    with caplog.at_level("WARNING", logger="engine_integration.engine.model.rows"):
        assert rows.gemm_row_group([(64, 96)], torch.float32, 16) is None
    assert "only to rounding" in caplog.text
    rows._gemm_rows_invariant.cache_clear()


def test_a_cpu_whose_attention_breaks_the_premise_is_named_at_model_load(monkeypatch, caplog):
    """The model also checks, at its head shapes, that the nested tile attention keeps a
    query's bits across calls of different row counts; where it does not, one warning."""
    from engine_integration.engine.model import tile_attention

    assert tile_attention.check_tile_invariance(4, 2, 16, 8, torch.float32)
    real = tile_attention._FLASH

    def drifting(q, k, v, **kwargs):  # a kernel whose bits depend on the row count
        out, lse = real(q, k, v, **kwargs)
        return out + (q.shape[2] % 24) * 1e-7, lse

    monkeypatch.setattr(tile_attention, "_FLASH", drifting)
    tile_attention._tiles_row_invariant.cache_clear()
    with caplog.at_level("WARNING", logger="engine_integration.engine.model.tile_attention"):
        assert not tile_attention.check_tile_invariance(4, 2, 16, 8, torch.float32)
    assert "only to rounding" in caplog.text
    tile_attention._tiles_row_invariant.cache_clear()


def test_a_cpu_whose_gemm_needs_larger_row_groups_gets_them(monkeypatch):
    """Where the gemm keeps a row's bits only in calls of a multiple of 16 rows (seen on
    some AVX-512 machines), the group measured is 16, and a layout built with it puts runs
    and single tokens in 16-row groups, aligned to positions."""
    from engine_integration.engine.model import rows

    real = F.linear

    def sixteen(x, weight, bias=None):  # bits depend on the row count modulo 16
        return real(x, weight, bias) + (x.shape[0] % 16) * 1e-7

    monkeypatch.setattr(rows.F, "linear", sixteen)
    rows._gemm_rows_invariant.cache_clear()
    try:
        assert rows.gemm_row_group([(64, 96)], torch.float32, 16) == 16
        assert rows.gemm_row_group([(64, 96)], torch.float32, 8) is None  # no block of 16
    finally:
        rows._gemm_rows_invariant.cache_clear()
    layout = RowLayout.build([(5, 15), (40, 41), (43, 44)], 16, "cpu", align_rows=16)
    assert layout.num_packed == 16 + 16  # positions [0, 16), then two singles padded to 16
    assert layout.positions[:16].tolist() == list(range(16))
    assert layout.index.tolist() == [*range(5, 15), 16, 17]
