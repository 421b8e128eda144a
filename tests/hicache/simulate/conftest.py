"""Fixtures for the simulator's tests: the bundled Mooncake trace, small configurations."""

from __future__ import annotations

import pytest

from hicache.config import PolicyConfig
from hicache.simulate.config import SimulationConfig
from hicache.simulate.hardware import PRESETS as HARDWARE
from hicache.simulate.model_presets import PRESETS as MODELS
from hicache.simulate.trace import BUNDLED, load_mooncake

MOONCAKE = BUNDLED["mooncake"]


@pytest.fixture(scope="session")
def mooncake():
    """The synthetic Mooncake trace bundled with the package."""
    return load_mooncake(MOONCAKE)


def make_config(
    *, page_size=512, l1_pages=0, l2_pages=0, l3_pages=0, model="deepseek-v3", **changes
) -> SimulationConfig:
    """DeepSeek-V3 on one 8 x H200 instance, with capacities given in pages."""
    spec = MODELS[model]
    page_bytes = spec.kv_bytes_per_token * page_size
    policy = changes.pop("policy", None) or PolicyConfig(
        write_policy=changes.pop("write_policy", "write_through"),
        prefetch_policy=changes.pop("prefetch_policy", "wait_complete"),
    )
    return SimulationConfig(
        model=spec,
        hardware=changes.pop("hardware", HARDWARE["h200"]),
        page_size=page_size,
        gpus_per_instance=changes.pop("gpus_per_instance", 8),
        l1_bytes=l1_pages * page_bytes,
        l2_bytes=l2_pages * page_bytes,
        l3_bytes=l3_pages * page_bytes,
        policy=policy,
        **changes,
    )


@pytest.fixture
def config_factory():
    return make_config
