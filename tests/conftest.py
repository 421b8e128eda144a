"""Shared test set-up.

Triton kernels run on the CPU through the interpreter; the variable must be set before
triton is first imported, so it is set here, at collection time, on machines without a GPU.
"""

from __future__ import annotations

import os

if not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("TRITON_INTERPRET", "1")
