"""SGLang's real host pools on the CPU: apply tests.support.sglang_cpu's guards (the
torchvision operators CPU torch lacks, CUDA host pinning) before any test imports SGLang's
pools. Without sglang or torchvision installed, the test modules skip themselves."""

import importlib.util

if importlib.util.find_spec("sglang") and importlib.util.find_spec("torchvision"):
    from tests.support import sglang_cpu

    sglang_cpu.install()
