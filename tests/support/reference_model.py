"""A plain, dense float64 forward pass to check the engine's model against.

No pages, no blocks, no window ring, no replay: every layer runs on every position; the
source layers attend causally, the late layers over (t - W, t]. That is the checkpoint's
model (what transformers computes for a sliding-window layer), written the obvious way.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine_integration.engine.model.config import ModelConfig
from engine_integration.engine.model.norm_rope import _inverse_frequencies
from engine_integration.engine.model.weights import ModelWeights


def _norm(x, weight, eps):
    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _rope(x, positions, config):
    inv_freq = _inverse_frequencies(config)
    angles = positions.double()[:, None] * inv_freq[None, :]
    cos = torch.cat([angles.cos(), angles.cos()], -1)[:, None, :]
    sin = torch.cat([angles.sin(), angles.sin()], -1)[:, None, :]
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def _layer(config, layer, x, positions, mask):
    n = x.shape[0]
    h = _norm(x, layer.input_norm, config.rms_norm_eps)
    qkv = F.linear(h, layer.qkv, layer.qkv_bias)
    q, k, v = qkv.split([config.q_size, config.kv_size, config.kv_size], dim=-1)
    q = _rope(q.reshape(n, config.num_heads, config.head_dim), positions, config)
    k = _rope(k.reshape(n, config.num_kv_heads, config.head_dim), positions, config)
    v = v.reshape(n, config.num_kv_heads, config.head_dim)
    group = config.num_heads // config.num_kv_heads
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * config.head_dim**-0.5
    scores = scores.masked_fill(~mask, float("-inf"))
    attn = torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1), v).reshape(n, -1)
    x = x + F.linear(attn, layer.o, layer.o_bias)
    gate, up = F.linear(_norm(x, layer.post_norm, config.rms_norm_eps), layer.gate_up).chunk(2, -1)
    return x + F.linear(F.silu(gate) * up, layer.down)


def _double(weights: ModelWeights) -> ModelWeights:
    def cast(t):
        return None if t is None else t.double().cpu()

    layers = [
        type(layer)(**{k: cast(v) for k, v in vars(layer).items()}) for layer in weights.layers
    ]
    return ModelWeights(
        cast(weights.embed), layers, cast(weights.final_norm), cast(weights.lm_head)
    )


@torch.no_grad()
def reference_logits(config: ModelConfig, weights: ModelWeights, tokens: list[int]) -> torch.Tensor:
    """Logits (float64) at every position of `tokens`."""
    w = _double(weights)
    positions = torch.arange(len(tokens))
    x = w.embed[torch.tensor(tokens)]
    t, j = positions[:, None], positions[None, :]
    causal = j <= t
    window = causal & (j > t - config.window_tokens)
    for i, layer in enumerate(w.layers):
        x = _layer(config, layer, x, positions, causal if i < config.num_source_layers else window)
    return F.linear(_norm(x, w.final_norm, config.rms_norm_eps), w.lm_head)
