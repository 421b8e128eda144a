"""RoPE and RMS norm in torch's ops: the rotary table of every position and the two
row-wise functions the forward pass (`forward.py`, `rowwise.py`) applies where the fused
kernels do not run; `fused.py` gives their bits in one kernel each."""

from __future__ import annotations

import math

import torch

from engine_integration.engine.model.config import ModelConfig


class RotaryTable:
    """cos/sin of every position, computed per position in float64 (so a value never
    depends on how large the table is), grown by doubling; the two halves of a row are the
    same frequencies, so hold the same values (`apply_rope` relies on it)."""

    def __init__(
        self, config: ModelConfig, device, dtype: torch.dtype, *, local: bool = False
    ) -> None:
        """`local`: the windowed layers' table (`ModelConfig.local_rope_theta`)."""
        self._inv_freq = _inverse_frequencies(config, local=local)
        self._device = device
        self._dtype = dtype
        self._cos = self._sin = torch.empty(0, config.head_dim, dtype=dtype, device=device)

    def lookup(self, positions: torch.Tensor, max_position: int):
        """cos, sin (n, 1, D) of `positions`, all <= max_position (given by the caller, so
        that no device value is read back here)."""
        if max_position >= self._cos.shape[0]:
            size = max(max_position + 1, 2 * self._cos.shape[0], 4096)
            angles = torch.outer(torch.arange(size, dtype=torch.float64), self._inv_freq)
            angles = torch.cat([angles, angles], dim=-1)
            self._cos = angles.cos().to(self._dtype).to(self._device)
            self._sin = angles.sin().to(self._dtype).to(self._device)
        return self._cos[positions][:, None, :], self._sin[positions][:, None, :]


def _inverse_frequencies(config: ModelConfig, *, local: bool = False) -> torch.Tensor:
    dim = config.head_dim
    theta = (config.local_rope_theta or config.rope_theta) if local else config.rope_theta
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    scaling = None if local else config.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    low_wavelen = scaling.original_max_position_tokens / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_tokens / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (scaling.original_max_position_tokens / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS norm over the last dim. A float32 weight on lower-precision x (Gemma 3's 1 + w)
    scales in float32 before the cast back, as Gemma's norm does; otherwise (Llama) the
    normalised x is cast first."""
    variance = x.float().pow(2).mean(-1, keepdim=True)
    if weight.dtype != x.dtype:
        return (weight * (x.float() * torch.rsqrt(variance + eps))).to(x.dtype)
    return weight * (x.float() * torch.rsqrt(variance + eps)).to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, out: torch.Tensor):
    """out = x * cos + rotate_half(x) * sin (rotate_half(x) = [-x2, x1] of the halves x1,
    x2 of the last dim), bit for bit, in fewer passes over memory: cos and sin hold the
    same values in both halves (`RotaryTable`), and -(a * b) == a * -b, a + -b == a - b
    exactly, so the first half is x1 * c - x2 * s and the second x2 * c + x1 * s."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    sin_half = sin[..., :half]
    torch.mul(x, cos, out=out)
    out[..., :half].sub_(x2 * sin_half)
    out[..., half:].add_(x1 * sin_half)
