"""What one simulation runs: model, hardware, instances, tier sizes, links, policies, prices.

`SimulationConfig` is frozen and validated like the controller's own config; `defaults`
fills in what a planner would start from (GPUs per instance from the weights, L1 from the
HBM the weights leave, L2 from host memory). Capacities are bytes per instance for L1 and
L2, and for L3 bytes of the one shared store (or of each instance's own, when local).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from hicache.config import L3_WRITE_POLICIES, PolicyConfig
from hicache.routing import POLICIES
from hicache.simulate.hardware import HardwareSpec
from hicache.simulate.models import ModelSpec
from hicache.simulate.profile import HardwareProfile

HOURS_PER_MONTH = 730.0
ROUTING = POLICIES  # hicache.routing: the policies of `hicache route`
HBM_FRACTION = 0.9  # of HBM an engine gives to weights and KV (the rest: activations, graphs)
WEIGHT_SHARE_LIMIT = 0.75  # default GPUs per instance: weights take at most this share of HBM
L2_HOST_FRACTION = 0.5  # default L2: this share of the instance's host memory


@dataclass(frozen=True)
class Prices:
    """USD. `l1_per_gb_month` None: the GPU's price spread over its HBM."""

    gpu_hour: float
    l1_per_gb_month: float | None = None
    l2_per_gb_month: float = 0.50
    l3_per_gb_month: float = 0.10

    def __post_init__(self) -> None:
        for name in ("gpu_hour", "l2_per_gb_month", "l3_per_gb_month"):
            if getattr(self, name) < 0:
                raise ValueError(f"Prices.{name} must be >= 0, got {getattr(self, name)}")
        if self.l1_per_gb_month is not None and self.l1_per_gb_month < 0:
            raise ValueError("Prices.l1_per_gb_month must be >= 0")


@dataclass(frozen=True)
class SimulationConfig:
    model: ModelSpec
    hardware: HardwareSpec
    page_size: int
    gpus_per_instance: int
    l1_bytes: float  # per instance: HBM left for KV
    l2_bytes: float  # per instance: host memory for KV
    l3_bytes: float = 0.0  # the shared store (or each instance's, when not shared)
    num_instances: int = 1
    l3_shared: bool = True
    l3_bandwidth_bytes_per_s: float | None = None  # per instance; None: its NICs
    l3_aggregate_bytes_per_s: float | None = None  # the shared store's total; None: no cap
    l3_latency_s: float = 100e-6
    l3_write_policy: str = "on_backup"
    prefetch_chunk_pages: int = 32
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    routing: str = "round_robin"
    route_balance_s: float = 1.0  # prefix routing: skip instances this much busier than the least
    mfu: float = 0.4
    prices: Prices | None = None  # None: the hardware's GPU price and default tier prices
    # Measured on a replica (`hicache simulate --calibrate`): prefill costs its compute fit,
    # not FLOPs / (peak x mfu). Its link rates are the caller's to put in `hardware` and the
    # L3 fields (the CLI does).
    profile: HardwareProfile | None = None
    # Requests as the embedded engine (`hicache engine serve`) runs them: it looks up the
    # prompt but its last token (whose logits it needs), and caches the answer's pages with
    # the prompt's (the prompt and all but the last output token; the answer's tokens are
    # the request's own, shared with nothing). Off: prompts only, looked up whole (the
    # prefill side of a P/D deployment).
    engine_requests: bool = False
    # Every instance runs on one device (replicas sharing a GPU): their prefills take
    # turns on it, first come first served. Off: each instance has its own GPUs.
    shared_device: bool = False
    # Engine requests with a profile and an L1 smaller than a request (the cache off): the
    # engine's own KV pool in pages, which bounds the requests it runs at once (None: room
    # for `max_running_requests` of the largest).
    engine_pool_pages: int | None = None

    def __post_init__(self) -> None:
        checks = [
            (self.page_size >= 1, "page_size must be >= 1"),
            (self.gpus_per_instance >= 1, "gpus_per_instance must be >= 1"),
            (self.num_instances >= 1, "num_instances must be >= 1"),
            (
                self.l1_bytes >= 0 and self.l2_bytes >= 0 and self.l3_bytes >= 0,
                "tier capacities must be >= 0",
            ),
            (0 < self.mfu <= 1, f"mfu must be in (0, 1], got {self.mfu}"),
            (self.l3_latency_s >= 0, "l3_latency_s must be >= 0"),
            (self.prefetch_chunk_pages >= 1, "prefetch_chunk_pages must be >= 1"),
            (self.routing in ROUTING, f"routing must be one of {ROUTING}, got {self.routing!r}"),
            (
                self.l3_write_policy in L3_WRITE_POLICIES,
                f"l3_write_policy must be one of {L3_WRITE_POLICIES}",
            ),
            (self.route_balance_s >= 0, "route_balance_s must be >= 0"),
            (
                self.engine_pool_pages is None or self.engine_pool_pages >= 1,
                f"engine_pool_pages must be >= 1 (or None), got {self.engine_pool_pages}",
            ),
        ]
        for name in ("l3_bandwidth_bytes_per_s", "l3_aggregate_bytes_per_s"):
            value = getattr(self, name)
            checks.append((value is None or value > 0, f"{name} must be > 0"))
        if self.profile is not None:
            checks.append(
                (
                    self.profile.page_size == self.page_size
                    and self.profile.page_bytes == self.page_bytes,
                    f"the profile measured pages of {self.profile.page_size} tokens, "
                    f"{self.profile.page_bytes} bytes; this run's are {self.page_size} tokens, "
                    f"{self.page_bytes} bytes",
                )
            )
        for ok, message in checks:
            if not ok:
                raise ValueError(f"SimulationConfig: {message}")
        if self.l3_pages and not self.l2_pages:
            raise ValueError(
                "SimulationConfig: an L3 needs an L2 (pages reach L3 through host memory); "
                "give L2 at least one page"
            )

    def replace(self, **changes) -> SimulationConfig:
        return dataclasses.replace(self, **changes)

    # -- derived ----------------------------------------------------------------------------

    @property
    def page_bytes(self) -> int:
        return self.model.kv_bytes_per_token * self.page_size

    @property
    def l1_pages(self) -> int:
        return int(self.l1_bytes // self.page_bytes)

    @property
    def l2_pages(self) -> int:
        return int(self.l2_bytes // self.page_bytes)

    @property
    def l3_pages(self) -> int:
        return int(self.l3_bytes // self.page_bytes)

    def prefill_s(self, num_cached: int, num_tokens: int) -> float:
        """Seconds one instance takes to prefill tokens [num_cached, num_tokens): the
        profile's measured steps, else the model's FLOPs at the instance's FLOP/s."""
        if self.profile is not None:
            return self.profile.prefill_s(num_cached, num_tokens)
        return self.model.prefill_flops(num_cached, num_tokens) / self.instance_flops

    @property
    def instance_flops(self) -> float:
        """Prefill FLOP/s one instance sustains."""
        peak = self.hardware.peak_flops(self.model.compute_dtype)
        return self.gpus_per_instance * peak * self.mfu

    @property
    def l3_instance_bytes_per_s(self) -> float:
        if self.l3_bandwidth_bytes_per_s is not None:
            return self.l3_bandwidth_bytes_per_s
        return self.hardware.nic_bytes_per_s * self.gpus_per_instance

    @property
    def effective_prices(self) -> Prices:
        prices = self.prices or Prices(gpu_hour=self.hardware.gpu_hour_price)
        if prices.l1_per_gb_month is None:
            per_gb = prices.gpu_hour * HOURS_PER_MONTH / (self.hardware.hbm_bytes / 1e9)
            prices = dataclasses.replace(prices, l1_per_gb_month=per_gb)
        return prices

    def monthly_cost(self) -> dict[str, float]:
        """USD per month of each tier as configured, and of the GPUs."""
        prices = self.effective_prices
        n = self.num_instances
        l3_copies = 1 if self.l3_shared else n
        return {
            "l1": n * self.l1_bytes / 1e9 * prices.l1_per_gb_month,
            "l2": n * self.l2_bytes / 1e9 * prices.l2_per_gb_month,
            "l3": l3_copies * self.l3_bytes / 1e9 * prices.l3_per_gb_month,
            "gpus": n * self.gpus_per_instance * prices.gpu_hour * HOURS_PER_MONTH,
        }


def default_gpus_per_instance(model: ModelSpec, hardware: HardwareSpec) -> int:
    """The smallest power of two of GPUs whose HBM the weights fill to at most 75 %."""
    gpus = 1
    while model.weight_bytes > WEIGHT_SHARE_LIMIT * gpus * hardware.hbm_bytes:
        gpus *= 2
    return gpus


def default_l1_bytes(model: ModelSpec, hardware: HardwareSpec, gpus: int) -> float:
    """HBM left for KV: 90 % of the instance's HBM, less the weights and the sliding-window
    KV of one running sequence (never cached, always resident)."""
    left = HBM_FRACTION * gpus * hardware.hbm_bytes - model.weight_bytes
    return max(0.0, left - model.sliding_kv_bytes_per_sequence)


def default_l2_bytes(hardware: HardwareSpec, gpus: int) -> float:
    return L2_HOST_FRACTION * gpus * hardware.host_bytes


def round_down_gb(num_bytes: float) -> float:
    return math.floor(num_bytes / 1e9) * 1e9
