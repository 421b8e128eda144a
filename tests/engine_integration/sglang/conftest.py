"""SGLang's real host pools on the CPU: apply tests.support.sglang_cpu's two guards (the
torchvision operators CPU torch lacks, CUDA host pinning) before any test imports SGLang."""

import pytest

sglang = pytest.importorskip(
    "sglang", reason="install tests/engine_integration/requirements-sglang.txt"
)

from tests.support import sglang_cpu  # noqa: E402

sglang_cpu.install()
