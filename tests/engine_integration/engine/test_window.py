"""Sliding-window attention on the dense path (CUDA's; here on the CPU): a prefill's first
late rows attend over their own keys alone (the ring holds none they see), later rows over
the ring too; both equal plain sliding-window attention computed in float64."""

from __future__ import annotations

import torch

from engine_integration.engine.model.window import LateWindow
from engine_integration.engine.model.window_attention import window_attention

WIDTH, HEADS, KV_HEADS, DIM = 8, 4, 2, 16


def _reference(q, kv, width):
    """Float64 attention of every position t over keys (t - width, t]."""
    n = q.shape[0]
    keys = kv[:, 0].double().repeat_interleave(HEADS // KV_HEADS, dim=1)  # (n, Hq, D)
    values = kv[:, 1].double().repeat_interleave(HEADS // KV_HEADS, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), keys) * DIM**-0.5
    t = torch.arange(n)
    hidden = (t[None, :] > t[:, None]) | (t[None, :] <= t[:, None] - width)
    probs = scores.masked_fill(hidden, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, values)


def test_dense_window_attention_with_and_without_the_ring():
    generator = torch.Generator().manual_seed(0)
    n, more = 21, 6
    q = torch.randn(n + more, HEADS, DIM, generator=generator)
    kv = torch.randn(n + more, 2, KV_HEADS, DIM, generator=generator)
    window = LateWindow(1, WIDTH, KV_HEADS, DIM, dtype=torch.float32, device="cpu")
    assert not window.holds_from(0, 0)
    scale = DIM**-0.5
    first = window_attention(q[:n], kv[:n], 0, window, 0, scale=scale, block_rows=None)
    assert window.holds_from(0, n - WIDTH + 1) and window.held_positions() == list(
        range(n - WIDTH, n)
    )
    later = window_attention(q[n:], kv[n:], n, window, 0, scale=scale, block_rows=None)
    expected = _reference(q, kv, WIDTH)
    torch.testing.assert_close(first.double(), expected[:n], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(later.double(), expected[n:], rtol=1e-5, atol=1e-5)


def test_a_ring_written_long_before_is_not_read():
    """Positions written earlier than the window reaches back are never a query's keys:
    the ring is skipped, and the result is the fresh one."""
    generator = torch.Generator().manual_seed(1)
    q = torch.randn(10, HEADS, DIM, generator=generator)
    kv = torch.randn(10, 2, KV_HEADS, DIM, generator=generator)
    window = LateWindow(1, WIDTH, KV_HEADS, DIM, dtype=torch.float32, device="cpu")
    window.write(0, 0, torch.randn(30, 2, KV_HEADS, DIM, generator=generator))
    assert not window.holds_from(0, 100 - WIDTH + 1)
    out = window_attention(q, kv, 100, window, 0, scale=DIM**-0.5, block_rows=None)
    torch.testing.assert_close(out.double(), _reference(q, kv, WIDTH), rtol=1e-5, atol=1e-5)
