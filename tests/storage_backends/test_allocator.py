"""The malloc policy for large messages: applied once on glibc, observable, and never over a
policy the environment chose. Each case runs in a fresh interpreter (the policy is
process-wide, and the test process may have set it already)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from storage_backends.allocator import MMAP_THRESHOLD_BYTES, TRIM_THRESHOLD_BYTES

ROOT = Path(__file__).resolve().parents[2]

# Allocates and frees an 8 MiB block, then reports from glibc's mallinfo2 whether the block was
# mmapped and how much freed memory the heap kept at its top.
_PROBE = """
import ctypes, json, sys
from storage_backends.allocator import tune_for_large_messages

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
applied = [tune_for_large_messages() for _ in range(2)] if sys.argv[1] == "tune" else []
mmapped_before = libc.mallinfo2().hblkhd
block = bytes(8 << 20)
mmapped = libc.mallinfo2().hblkhd - mmapped_before
del block
print(json.dumps({"applied": applied, "mmapped": mmapped, "kept": libc.mallinfo2().keepcost}))
"""


def _probe(mode: str, **env: str) -> dict:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, mode],
        cwd=ROOT,
        env={**clean, **env},
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout)


glibc_only = pytest.mark.skipif(
    not hasattr(os, "confstr") or not os.confstr("CS_GNU_LIBC_VERSION"),
    reason="the policy applies to glibc malloc only",
)


@glibc_only
def test_the_policy_keeps_message_sized_blocks_on_the_heap_and_their_pages_after_free():
    assert 8 << 20 < MMAP_THRESHOLD_BYTES < TRIM_THRESHOLD_BYTES
    default = _probe("none")
    assert default["mmapped"] >= 8 << 20  # glibc's default: a fresh mapping per large block
    assert default["kept"] < 8 << 20  # ... and freed memory goes back to the kernel
    tuned = _probe("tune")
    assert tuned["applied"] == [True, True]
    assert tuned["mmapped"] == 0
    assert tuned["kept"] >= 8 << 20  # the next message reuses these pages, no faults


@glibc_only
@pytest.mark.parametrize(
    "env",
    [
        {"MALLOC_TRIM_THRESHOLD_": "131072"},
        {"MALLOC_MMAP_THRESHOLD_": "131072"},
        {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=131072"},
    ],
)
def test_a_policy_chosen_in_the_environment_is_left_alone(env):
    probe = _probe("tune", **env)
    assert probe["applied"] == [False, False]
    assert probe["mmapped"] >= 8 << 20
