"""What a simulation measured: per-request records, and the summary a planner reads.

`RequestStats` holds one row per request (times and hits by tier), filled in by the
play. `summarize` turns them, and the controllers' own `HiCacheStats`, into a
`SimulationResult`: hit rates by tier (tokens and pages), prefill compute saved, TTFT
percentiles, bytes per link, and monthly costs. `SimulationResult.as_dict()` is the `--json`
output.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from hicache.metrics import DIRECTIONS, TIERS, HiCacheStats
from hicache.routing import CachedPrefix, needs_prefill
from hicache.simulate.config import HOURS_PER_MONTH, SimulationConfig
from hicache.simulate.l3 import L3Stats
from hicache.simulate.trace import Trace


@dataclass
class RequestStats:
    """Per-request columns; row i is trace request i."""

    arrival_s: np.ndarray
    began_s: np.ndarray  # the instance took it (after queueing)
    matched_s: np.ndarray  # its match returned (after L3 lookups and prefetch waits)
    end_s: np.ndarray  # its first token
    hit_pages: np.ndarray  # (requests, 3): pages served from L1, L2, L3
    computed_from: np.ndarray  # first token position prefilled
    instance: np.ndarray

    @classmethod
    def empty(cls, num_requests: int) -> RequestStats:
        def times():
            return np.full(num_requests, np.nan)

        return cls(
            arrival_s=times(),
            began_s=times(),
            matched_s=times(),
            end_s=times(),
            hit_pages=np.zeros((num_requests, 3), dtype=np.int64),
            computed_from=np.zeros(num_requests, dtype=np.int64),
            instance=np.zeros(num_requests, dtype=np.int32),
        )

    def record(
        self,
        index: int,
        *,
        arrival_s,
        began_s,
        matched_s,
        end_s,
        match,
        page_size,
        computed_from,
        instance,
    ) -> None:
        self.arrival_s[index] = arrival_s
        self.began_s[index] = began_s
        self.matched_s[index] = matched_s
        self.end_s[index] = end_s
        self.hit_pages[index] = (match.num_l1_pages, match.num_l2_pages, match.num_l3_pages)
        self.computed_from[index] = computed_from
        self.instance[index] = instance


@dataclass(frozen=True)
class Percentiles:
    p50: float
    p90: float
    p99: float
    mean: float

    @classmethod
    def of(cls, values: np.ndarray) -> Percentiles:
        if not len(values):
            return cls(0.0, 0.0, 0.0, 0.0)
        p50, p90, p99 = np.percentile(values, [50, 90, 99])
        return cls(float(p50), float(p90), float(p99), float(np.mean(values)))


@dataclass(frozen=True)
class TierResult:
    hit_tokens: int
    hit_pages: int
    hit_rate: float  # of all prompt tokens
    capacity_bytes: float  # per instance for L1/L2; the store for L3
    cost_per_month: float


@dataclass(frozen=True)
class PrefillResult:
    flops_without_cache: float
    flops: float
    gpu_seconds: float
    gpu_seconds_saved: float

    @property
    def saved_fraction(self) -> float:
        if not self.flops_without_cache:
            return 0.0
        return 1.0 - self.flops / self.flops_without_cache


@dataclass(frozen=True)
class SimulationResult:
    requests: int
    total_tokens: int
    total_pages: int  # full pages of all prompts
    hit_tokens: int
    hit_pages: int
    tiers: dict[str, TierResult]
    prefill: PrefillResult
    ttft: Percentiles
    queue: Percentiles
    match_wait: Percentiles  # L3 lookups and prefetch waits inside match
    bytes_moved: dict[str, int]  # by direction, as the controllers counted them
    prefetches: dict[str, int]
    evicted_pages: dict[str, int]
    l3_evicted_pages: int
    l3_pages_used: int  # pages the L3 store(s) hold at the end
    # P/D through a shared L3, decided per request as the router decides it
    # (hicache.routing.needs_prefill on the request's match): the requests a prefill replica
    # would compute first, and the full pages it would hand to decode through L3.
    pd_prefills: int
    pd_handoff_pages: int
    utilization: list[float]  # per instance: prefill busy time over the trace's span
    cost_per_month: dict[str, float]  # l1, l2, l3, gpus
    # The prefill GPU time the cache saves, in USD: GPU-seconds saved over the run's span,
    # scaled to a month at the GPU-hour price (see report.savings_basis).
    saved_per_month: float
    duration_s: float
    elapsed_s: float
    config: dict

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.total_tokens if self.total_tokens else 0.0

    @property
    def page_hit_rate(self) -> float:
        return self.hit_pages / self.total_pages if self.total_pages else 0.0

    @property
    def prefill_gpus_busy(self) -> float:
        """GPUs the prefill compute keeps busy, on average over the run's span."""
        return self.prefill.gpu_seconds / self.duration_s

    @property
    def prefill_gpus_busy_without_cache(self) -> float:
        """The same for the same traffic with no cache: every prompt token computed."""
        return (self.prefill.gpu_seconds + self.prefill.gpu_seconds_saved) / self.duration_s

    @property
    def cache_cost_per_month(self) -> float:
        return sum(self.cost_per_month[tier] for tier in TIERS)

    def as_dict(self) -> dict:
        out = {
            "requests": self.requests,
            "total_tokens": self.total_tokens,
            "hit_tokens": self.hit_tokens,
            "hit_rate": round(self.hit_rate, 6),
            "total_pages": self.total_pages,
            "hit_pages": self.hit_pages,
            "page_hit_rate": round(self.page_hit_rate, 6),
        }
        for tier, result in self.tiers.items():
            out[tier] = {
                "hit_tokens": result.hit_tokens,
                "hit_pages": result.hit_pages,
                "hit_rate": round(result.hit_rate, 6),
                "capacity_gb": round(result.capacity_bytes / 1e9, 3),
                "cost_per_month": round(result.cost_per_month, 2),
            }
        out["prefill"] = {
            "saved_fraction": round(self.prefill.saved_fraction, 6),
            "gpu_hours": round(self.prefill.gpu_seconds / 3600, 4),
            "gpu_hours_saved": round(self.prefill.gpu_seconds_saved / 3600, 4),
            "pflops": round(self.prefill.flops / 1e15, 3),
            "pflops_without_cache": round(self.prefill.flops_without_cache / 1e15, 3),
            "gpus_busy": round(self.prefill_gpus_busy, 3),
            "gpus_busy_without_cache": round(self.prefill_gpus_busy_without_cache, 3),
        }
        out["ttft_s"] = _rounded(self.ttft)
        out["queue_s"] = _rounded(self.queue)
        out["match_wait_s"] = _rounded(self.match_wait)
        out["bytes_moved"] = dict(self.bytes_moved)
        out["prefetches"] = dict(self.prefetches)
        out["evicted_pages"] = {**self.evicted_pages, "l3": self.l3_evicted_pages}
        out["l3_pages_used"] = self.l3_pages_used
        out["pd"] = {"prefills": self.pd_prefills, "handoff_pages": self.pd_handoff_pages}
        out["utilization"] = [round(u, 4) for u in self.utilization]
        out["cost_per_month"] = {k: round(v, 2) for k, v in self.cost_per_month.items()}
        out["saved_per_month"] = round(self.saved_per_month, 2)
        out["duration_s"] = round(self.duration_s, 3)
        out["elapsed_s"] = round(self.elapsed_s, 3)
        out["config"] = self.config
        return out


def _rounded(p: Percentiles) -> dict:
    return {name: round(value, 6) for name, value in dataclasses.asdict(p).items()}


def summarize(
    config: SimulationConfig,
    trace: Trace,
    stats: RequestStats,
    cache_stats: list[HiCacheStats],
    busy_s: list[float],
    l3_stats: list[L3Stats],
    *,
    elapsed_s: float,
) -> SimulationResult:
    page_size = config.page_size
    lengths = np.fromiter((r.input_length for r in trace.requests), dtype=np.int64)
    hit_pages = stats.hit_pages.sum(axis=0)
    total_tokens = int(lengths.sum())
    costs = config.monthly_cost()
    capacities = {
        "l1": config.l1_bytes,
        "l2": config.l2_bytes,
        "l3": config.l3_bytes,
    }
    tiers = {
        tier: TierResult(
            hit_tokens=int(hit_pages[i]) * page_size,
            hit_pages=int(hit_pages[i]),
            hit_rate=int(hit_pages[i]) * page_size / total_tokens if total_tokens else 0.0,
            capacity_bytes=capacities[tier],
            cost_per_month=costs[tier],
        )
        for i, tier in enumerate(TIERS)
    }
    prefill = _prefill(config, lengths, stats.computed_from)
    duration_s = max(float(np.nanmax(stats.end_s) - np.nanmin(stats.arrival_s)), 1e-9)
    prices = config.effective_prices
    saved_per_month = prefill.gpu_seconds_saved / duration_s * HOURS_PER_MONTH * prices.gpu_hour
    return SimulationResult(
        requests=trace.num_requests,
        total_tokens=total_tokens,
        total_pages=int((lengths // page_size).sum()),
        hit_tokens=int(hit_pages.sum()) * page_size,
        hit_pages=int(hit_pages.sum()),
        tiers=tiers,
        prefill=prefill,
        ttft=Percentiles.of(stats.end_s - stats.arrival_s),
        queue=Percentiles.of(stats.began_s - stats.arrival_s),
        match_wait=Percentiles.of(stats.matched_s - stats.began_s),
        bytes_moved={d: sum(s.bytes_moved[d] for s in cache_stats) for d in DIRECTIONS},
        prefetches={
            "issued": sum(s.prefetches_issued for s in cache_stats),
            "cut_short": sum(s.prefetches_cut_short for s in cache_stats),
            "pages_missing": sum(s.prefetch_pages_missing for s in cache_stats),
        },
        evicted_pages={t: sum(s.evicted_pages[t] for s in cache_stats) for t in ("l1", "l2")},
        l3_evicted_pages=sum(s.num_evictions for s in l3_stats),
        l3_pages_used=sum(s.num_pages for s in l3_stats),
        **_pd_handoff(lengths, stats.hit_pages, page_size),
        utilization=[b / duration_s for b in busy_s],
        cost_per_month=costs,
        saved_per_month=saved_per_month,
        duration_s=duration_s,
        elapsed_s=elapsed_s,
        config=describe(config),
    )


def _pd_handoff(lengths: np.ndarray, hit_pages: np.ndarray, page_size: int) -> dict:
    """Per request, the router's P/D decision over what its match found (pages per tier):
    a request whose every full page (all but the last token's) is cached goes straight to
    decode; any other is prefilled, and the pages it lacked cross to decode through L3."""
    prefills = handoff = 0
    for length, (l1, l2, l3) in zip(lengths.tolist(), hit_pages.tolist(), strict=True):
        num_pages = (length - 1) // page_size
        if needs_prefill(CachedPrefix(l1, l2, l3), num_pages):
            prefills += 1
            handoff += num_pages - (l1 + l2 + l3)
    return {"pd_prefills": prefills, "pd_handoff_pages": handoff}


def _prefill(config: SimulationConfig, lengths: np.ndarray, computed_from: np.ndarray):
    """FLOPs by the model; GPU-seconds by `config.prefill_s` (FLOPs at the instance's
    FLOP/s, or the calibrated profile's measured steps)."""
    model = config.model
    flops = without = seconds = seconds_without = 0.0
    for length, start in zip(lengths.tolist(), computed_from.tolist(), strict=True):
        flops += model.prefill_flops(start, length)
        without += model.prefill_flops(0, length)
        seconds += config.prefill_s(start, length)
        seconds_without += config.prefill_s(0, length)
    gpus = config.gpus_per_instance
    return PrefillResult(
        flops_without_cache=without,
        flops=flops,
        gpu_seconds=seconds * gpus,
        gpu_seconds_saved=(seconds_without - seconds) * gpus,
    )


def describe(config: SimulationConfig) -> dict:
    """The configuration in plain numbers, for the JSON output."""
    policy = config.policy
    prices = config.effective_prices
    return {
        "model": config.model.name,
        "kv_bytes_per_token": config.model.kv_bytes_per_token,
        "hardware": config.hardware.name,
        "gpus_per_instance": config.gpus_per_instance,
        "instances": config.num_instances,
        "page_size": config.page_size,
        "l1_gb": round(config.l1_bytes / 1e9, 3),
        "l2_gb": round(config.l2_bytes / 1e9, 3),
        "l3_gb": round(config.l3_bytes / 1e9, 3),
        "l3_shared": config.l3_shared,
        "l3_gb_per_s": round(config.l3_instance_bytes_per_s / 1e9, 3),
        "l3_latency_us": round(config.l3_latency_s * 1e6, 3),
        "write_policy": policy.write_policy,
        "l3_write_policy": config.l3_write_policy,
        "prefetch_policy": policy.prefetch_policy,
        "eviction_policy": policy.eviction_policy,
        "routing": config.routing,
        "mfu": None if config.profile else config.mfu,
        "profile": (
            {
                "source": config.profile.source,
                "device": config.profile.device,
                "dtype": config.profile.dtype,
                "measured_at": config.profile.measured_at,
            }
            if config.profile
            else None
        ),
        "gpu_hour_price": prices.gpu_hour,
        "price_per_gb_month": {
            "l1": round(prices.l1_per_gb_month, 4),
            "l2": prices.l2_per_gb_month,
            "l3": prices.l3_per_gb_month,
        },
    }
