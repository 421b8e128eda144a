"""Helpers shared by the tiers tests: random KV bytes, poison, byte-exact comparison."""

from __future__ import annotations

import pytest
import torch

POISON_BYTE = 0xA5


def fill_random_(kv: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Overwrite `kv` with random bytes (every bit pattern of every dtype, NaNs included)."""
    flat = kv.view(-1).view(torch.uint8)
    flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8, generator=generator))
    return kv


def poison_(kv: torch.Tensor) -> torch.Tensor:
    kv.view(-1).view(torch.uint8).fill_(POISON_BYTE)
    return kv


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equality (NaN == NaN), on the CPU."""
    return a.shape == b.shape and torch.equal(
        a.detach().cpu().contiguous().view(-1).view(torch.uint8),
        b.detach().cpu().contiguous().view(-1).view(torch.uint8),
    )


class KVHelpers:
    fill_random_ = staticmethod(fill_random_)
    poison_ = staticmethod(poison_)
    same_bytes = staticmethod(same_bytes)
    POISON_BYTE = POISON_BYTE


@pytest.fixture
def kvh() -> type[KVHelpers]:
    return KVHelpers


@pytest.fixture
def cuda_device() -> torch.device:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    return torch.device("cuda", torch.cuda.current_device())
