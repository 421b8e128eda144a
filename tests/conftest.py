"""Shared test set-up.

Triton kernels run on the CPU through the interpreter; the variable must be set before
triton is first imported, so it is set here, at collection time, on machines without a GPU.
"""

from __future__ import annotations

import os

if not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

# torchvision (installed for SGLang's real host pools) is a CUDA build whose operators do not
# load against CPU torch; guard the two registrations that then fail, before anything (SGLang,
# transformers' image utilities) imports it. See tests/support/sglang_cpu.py.
from tests.support.sglang_cpu import guard_torchvision_ops  # noqa: E402

guard_torchvision_ops()
