"""Triton for the GPU kernels, where it is installed; where it is not, a stand-in.

CUDA builds of torch bring triton; a CPU-only install has no use for it (nothing launches a
kernel without a GPU) and leaves it out: `pip install 'hicache[gpu]'` adds it, and the test
extra has it for the kernel tests (Triton's interpreter on the CPU). Without it, the kernel
modules still import (their kernels are defined, never compiled) and launching one raises
`TritonMissingError`, which says what to install; `triton.cdiv` and `next_power_of_2`, plain
arithmetic, still work.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

# Triton's interpreter (TRITON_INTERPRET=1, read by triton at import): kernels run on the CPU
# through numpy. Its tl.dot of bfloat16 operands is wrong (numpy has no bfloat16), so a
# kernel that multiplies bfloat16 tiles upcasts them to float32 first when interpreted.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


class TritonMissingError(ImportError):
    """A Triton kernel was launched where triton is not installed."""


class _Kernel:
    def __init__(self, fn: Callable) -> None:
        self.fn = fn

    def __getitem__(self, grid: Any):
        raise TritonMissingError(
            f"the kernel {self.fn.__name__} needs triton, which is not installed: "
            "pip install 'hicache[gpu]' (CUDA builds of torch bring it)"
        )


class _TritonStandIn:
    """What the kernel modules use of `triton` at import time, and its arithmetic."""

    def jit(self, fn: Callable | None = None, **options: Any):
        return _Kernel(fn) if fn is not None else _Kernel

    @staticmethod
    def cdiv(x: int, y: int) -> int:
        return (x + y - 1) // y

    @staticmethod
    def next_power_of_2(n: int) -> int:
        return 0 if n == 0 else 1 << (int(n) - 1).bit_length()


try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:
    triton = _TritonStandIn()
    tl = None  # only kernel bodies and their (unevaluated) annotations name it
    HAVE_TRITON = False

__all__ = ["HAVE_TRITON", "INTERPRETED", "TritonMissingError", "tl", "triton"]
