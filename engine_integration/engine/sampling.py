"""Sampling parameters and the sampler: greedy, or temperature with top-k / top-p.

Each request that samples has its own generator seeded from `SamplingParams.seed`, so its
tokens do not depend on which other requests share its batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """max_new_tokens: tokens to generate at most (>= 1).
    temperature:    0 is greedy (argmax); > 0 samples from softmax(logits / temperature).
    top_k, top_p:   keep the k most likely tokens (0: all) / the smallest set whose
                    probability reaches p (1.0: all) before sampling.
    seed:           the request's sampling seed.
    stop_token_ids: generation ends after producing one of these.
    return_logits:  keep each generated token's logits (float32, on the CPU).
    """

    max_new_tokens: int = 32
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()
    return_logits: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.max_new_tokens, bool) or self.max_new_tokens < 1:
            raise ValueError(
                f"SamplingParams.max_new_tokens must be >= 1, got {self.max_new_tokens!r}"
            )
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def sample(logits: torch.Tensor, params: SamplingParams, generator) -> int:
    """One token from logits (vocab,) float32."""
    if params.greedy:
        return int(torch.argmax(logits))
    scaled = logits / params.temperature
    if params.top_k:
        kth = torch.topk(scaled, min(params.top_k, scaled.numel())).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if params.top_p < 1:
        sorted_probs, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_probs, dim=0) - sorted_probs < params.top_p
        probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_probs[keep])
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))
