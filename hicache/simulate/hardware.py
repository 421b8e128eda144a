"""Hardware presets: per-GPU memory, links, prefill throughput and price.

Numbers are per GPU, from the vendors' published specifications (dense tensor FLOPs, not
the 2:4-sparse headline figures; link rates per direction). Host memory is the node's DRAM
divided by its GPUs (Grace's LPDDR5X for the GB systems). Prices are on-demand cloud
ballparks for planning, not quotes: override them with `--gpu-hour-price` and the tier
prices. Every field can be overridden from the command line.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from hicache.simulate.errors import SimulationError

GB = 1e9


@dataclass(frozen=True)
class HardwareSpec:
    name: str
    hbm_bytes: float  # per GPU
    host_bytes: float  # host DRAM per GPU
    host_link_bytes_per_s: float  # L1 <-> L2, per direction (PCIe or NVLink-C2C)
    host_link_latency_s: float  # per copy op
    nic_bytes_per_s: float  # per GPU, per direction (L2 <-> L3 over the network)
    bf16_flops: float  # dense, per GPU
    fp8_flops: float  # dense, per GPU
    gpu_hour_price: float  # USD
    gpus_per_node: int = 8

    def __post_init__(self) -> None:
        for name in (
            "hbm_bytes",
            "host_bytes",
            "host_link_bytes_per_s",
            "nic_bytes_per_s",
            "bf16_flops",
            "fp8_flops",
        ):
            if not getattr(self, name) > 0:
                raise ValueError(f"HardwareSpec.{name} must be > 0, got {getattr(self, name)}")
        if self.host_link_latency_s < 0 or self.gpu_hour_price < 0:
            raise ValueError("HardwareSpec latency and price must be >= 0")
        if self.gpus_per_node < 1:
            raise ValueError(f"HardwareSpec.gpus_per_node must be >= 1, got {self.gpus_per_node}")

    def peak_flops(self, compute_dtype: str) -> float:
        return self.fp8_flops if compute_dtype == "fp8" else self.bf16_flops

    def replace(self, **changes) -> HardwareSpec:
        return dataclasses.replace(self, **changes)


_PCIE5 = 55 * GB  # x16 Gen5: 64 GB/s raw per direction, about 55 achieved
_PCIE6 = 110 * GB  # x16 Gen6
_C2C = 200 * GB  # NVLink-C2C: 900 GB/s both ways per Grace, shared by its two GPUs

PRESETS: dict[str, HardwareSpec] = {
    "h100": HardwareSpec("h100", 80 * GB, 256 * GB, _PCIE5, 10e-6, 50 * GB, 989e12, 1979e12, 2.5),
    "h200": HardwareSpec("h200", 141 * GB, 256 * GB, _PCIE5, 10e-6, 50 * GB, 989e12, 1979e12, 3.5),
    "b200": HardwareSpec("b200", 180 * GB, 256 * GB, _PCIE5, 10e-6, 50 * GB, 2250e12, 4500e12, 5.0),
    "b300": HardwareSpec(
        "b300", 288 * GB, 256 * GB, _PCIE6, 10e-6, 100 * GB, 2250e12, 4500e12, 6.5
    ),
    "gb200": HardwareSpec(
        "gb200", 186 * GB, 240 * GB, _C2C, 5e-6, 50 * GB, 2500e12, 5000e12, 6.0, gpus_per_node=4
    ),
    "gb300": HardwareSpec(
        "gb300", 288 * GB, 240 * GB, _C2C, 5e-6, 100 * GB, 2500e12, 5000e12, 7.5, gpus_per_node=4
    ),
}


def load_hardware(name: str) -> HardwareSpec:
    preset = PRESETS.get(name.lower())
    if preset is None:
        raise SimulationError(f"unknown hardware {name!r}; presets: {', '.join(PRESETS)}")
    return preset
