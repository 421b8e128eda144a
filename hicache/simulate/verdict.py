"""The verdict: where the next dollar of cache should go, and whether a shared L3 for
prefill/decode disaggregation pays off, in plain words, from measured runs.

`plan_probes` lists the extra runs the answer needs: the trace's reuse ceiling (an L1 that
holds everything), the base configuration with the same extra budget put into L1, L2 or L3
in turn (a share of the monthly GPU bill, `BUDGET_SHARE`), and the base with and without a
shared L3. `build_verdict` compares their results with the base run.

Money: the cache's return is the prefill GPU time it saves, valued at the GPU-hour price
(the prefill capacity it frees), extrapolated from the trace's span to a month.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hicache.simulate.config import SimulationConfig, default_l1_bytes
from hicache.simulate.result import SimulationResult
from hicache.simulate.trace import Trace

BUDGET_SHARE = 0.02  # the probed extra spend: 2 % of the monthly GPU bill
HOST_FRACTION_LIMIT = 0.9  # L2 may use at most this share of host memory
SATURATED = 0.9
AT_CEILING = 0.999  # of the reuse ceiling: no capacity can add hits


@dataclass(frozen=True)
class Probe:
    config: SimulationConfig | None
    note: str = ""  # why there is no run


@dataclass(frozen=True)
class TierMargin:
    tier: str
    added_bytes: float
    added_cost: float  # USD / month
    added_savings: float  # USD / month
    hit_rate: float
    ttft_p90_s: float
    note: str = ""

    @property
    def return_per_dollar(self) -> float:
        return self.added_savings / self.added_cost if self.added_cost > 0 else 0.0


@dataclass(frozen=True)
class SharedL3Check:
    instances: int
    l3_bytes: float
    hit_rate_shared: float
    hit_rate_local: float
    savings: float  # USD / month the shared L3 adds
    l3_cost: float  # USD / month more than the instances' own L3s cost
    pd_gb_per_s: float  # P->D KV transfer per prefill instance
    pd_direct_fraction: float  # requests whose every full page is cached: no prefill first
    nic_fraction: float  # of the instance's NIC, with the L3 reads
    local_l3_bytes: float = 0.0  # the per-instance L3s the shared one is compared with

    @property
    def pays_off(self) -> bool:
        return self.savings > max(self.l3_cost, 0.0) and self.nic_fraction < 1.0


@dataclass(frozen=True)
class Verdict:
    budget_per_month: float
    ceiling_hit_rate: float
    margins: list[TierMargin]
    shared_l3: SharedL3Check | None
    lines: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {
            "budget_per_month": round(self.budget_per_month, 2),
            "ceiling_hit_rate": round(self.ceiling_hit_rate, 6),
            "next_dollar": [
                {
                    "tier": m.tier,
                    "added_gb": round(m.added_bytes / 1e9, 3),
                    "added_cost_per_month": round(m.added_cost, 2),
                    "added_savings_per_month": _clean(m.added_savings),
                    "return_per_dollar": _clean(m.return_per_dollar, 4),
                    "hit_rate": round(m.hit_rate, 6),
                    "note": m.note,
                }
                for m in self.margins
            ],
            "shared_l3": None
            if self.shared_l3 is None
            else {
                "pays_off": self.shared_l3.pays_off,
                "instances": self.shared_l3.instances,
                "l3_gb": round(self.shared_l3.l3_bytes / 1e9, 3),
                "hit_rate_shared": round(self.shared_l3.hit_rate_shared, 6),
                "hit_rate_local": round(self.shared_l3.hit_rate_local, 6),
                "savings_per_month": _clean(self.shared_l3.savings),
                "l3_cost_per_month": round(self.shared_l3.l3_cost, 2),
                "pd_gb_per_s": round(self.shared_l3.pd_gb_per_s, 3),
                "pd_direct_fraction": round(self.shared_l3.pd_direct_fraction, 4),
                "nic_fraction": round(self.shared_l3.nic_fraction, 4),
            },
            "text": self.lines,
        }


# ---------------------------------------------------------------------------- planning


def budget_per_month(config: SimulationConfig) -> float:
    return BUDGET_SHARE * config.monthly_cost()["gpus"]


def tier_limits(config: SimulationConfig) -> dict[str, float]:
    """The most each tier can hold per instance on this hardware (L3: no limit)."""
    hw = config.hardware
    return {
        "l1": default_l1_bytes(config.model, hw, config.gpus_per_instance) + 1.0,
        "l2": HOST_FRACTION_LIMIT * hw.host_bytes * config.gpus_per_instance,
        "l3": float("inf"),
    }


def plan_probes(config: SimulationConfig, trace: Trace) -> dict[str, Probe]:
    probes: dict[str, Probe] = {}
    cached_tokens = trace.total_tokens  # (with their answers, as the engine caches them)
    if config.engine_requests:
        cached_tokens += sum(request.output_length for request in trace.requests)
    every_page = (cached_tokens // config.page_size + 1) * config.page_bytes
    probes["ceiling"] = Probe(
        config.replace(
            l1_bytes=every_page, l2_bytes=0.0, l3_bytes=0.0, num_instances=1, routing="round_robin"
        )
    )
    budget = budget_per_month(config)
    prices = config.effective_prices
    limits = tier_limits(config)
    per_gb = {
        "l1": prices.l1_per_gb_month,
        "l2": prices.l2_per_gb_month,
        "l3": prices.l3_per_gb_month,
    }
    for tier in ("l1", "l2", "l3"):
        copies = 1 if tier == "l3" and config.l3_shared else config.num_instances
        current = getattr(config, f"{tier}_bytes")
        added = budget / copies / per_gb[tier] * 1e9 if per_gb[tier] > 0 else 0.0
        added = min(added, limits[tier] - current)
        if tier == "l3" and not config.l2_pages:
            probes[tier] = Probe(None, "L3 needs an L2 to stage pages")
        elif added < config.page_bytes:
            probes[tier] = Probe(None, f"{tier.upper()} is at this hardware's limit")
        else:
            probes[tier] = Probe(config.replace(**{f"{tier}_bytes": current + added}))
    if config.l3_pages and config.l3_shared:
        probes["other_l3"] = Probe(config.replace(l3_bytes=0.0))  # each instance on its own
    elif config.l3_pages:  # one L3 per instance: the same bytes as one shared store
        total = config.l3_bytes * config.num_instances
        probes["other_l3"] = Probe(config.replace(l3_bytes=total, l3_shared=True))
    elif config.l2_pages:  # no L3: a shared one that holds every page
        probes["other_l3"] = Probe(config.replace(l3_bytes=every_page, l3_shared=True))
    else:
        probes["other_l3"] = Probe(None, "an L3 needs an L2")
    return probes


# ---------------------------------------------------------------------------- judging


def build_verdict(
    config: SimulationConfig,
    trace: Trace,
    base: SimulationResult,
    probes: dict[str, Probe],
    results: dict[str, SimulationResult],
) -> Verdict:
    ceiling = results["ceiling"].hit_rate if "ceiling" in results else 0.0
    margins = [
        _margin(tier, config, base, probes[tier], results.get(tier)) for tier in ("l1", "l2", "l3")
    ]
    shared = _shared_l3_check(config, trace, base, results.get("other_l3"))
    verdict = Verdict(budget_per_month(config), ceiling, margins, shared)
    verdict.lines.extend(_sentences(config, base, verdict, probes))
    return verdict


def _margin(tier, config, base, probe: Probe, result: SimulationResult | None) -> TierMargin:
    if probe.config is None or result is None:
        return TierMargin(tier, 0.0, 0.0, 0.0, base.hit_rate, base.ttft.p90, probe.note)
    added = getattr(probe.config, f"{tier}_bytes") - getattr(config, f"{tier}_bytes")
    return TierMargin(
        tier=tier,
        added_bytes=added,
        added_cost=result.cache_cost_per_month - base.cache_cost_per_month,
        added_savings=result.saved_per_month - base.saved_per_month,
        hit_rate=result.hit_rate,
        ttft_p90_s=result.ttft.p90,
    )


def _shared_l3_check(config, trace, base, other: SimulationResult | None):
    """Instances sharing one L3 against instances on their own (L1/L2, or an L3 each)."""
    if other is None:
        return None
    price = config.effective_prices.l3_per_gb_month
    if config.l3_pages and config.l3_shared:
        shared, local = base, other
        shared_bytes, local_bytes = config.l3_bytes, 0.0
    else:
        shared, local = other, base
        local_bytes = config.l3_bytes * config.num_instances
        # sized to the data: as much as the shared store held, or the same bytes as the
        # per-instance stores it replaces
        shared_bytes = local_bytes or shared.l3_pages_used * config.page_bytes
    duration = max(base.duration_s, 1e-9)
    # What crosses to decode: the pages prefill replicas compute for the requests the
    # router would send them (hicache.routing.needs_prefill, counted by the simulation).
    pd_bytes_per_s = shared.pd_handoff_pages * config.page_bytes / duration
    pd_bytes_per_s /= config.num_instances
    l3_read_per_s = shared.bytes_moved["l3_to_l2"] / duration / config.num_instances
    nic = config.hardware.nic_bytes_per_s * config.gpus_per_instance
    return SharedL3Check(
        instances=config.num_instances,
        l3_bytes=shared_bytes,
        hit_rate_shared=shared.hit_rate,
        hit_rate_local=local.hit_rate,
        savings=shared.saved_per_month - local.saved_per_month,
        l3_cost=(shared_bytes - local_bytes) / 1e9 * price,
        pd_gb_per_s=pd_bytes_per_s / 1e9,
        pd_direct_fraction=1.0 - shared.pd_prefills / max(shared.requests, 1),
        nic_fraction=(pd_bytes_per_s + l3_read_per_s) / nic,
        local_l3_bytes=local_bytes,
    )


def _money(value: float) -> str:
    return f"${_clean(value, 0):,.0f}"


def _clean(value: float, digits: int = 2) -> float:
    """Rounded, without the -0.0 that rounding a tiny negative difference leaves."""
    return round(value, digits) + 0.0


def _seconds(value: float) -> str:
    if value < 1:
        return f"{value * 1e3:,.0f} ms"
    return f"{value:,.3g} s" if value < 100 else f"{value:,.0f} s"


def _sentences(config, base: SimulationResult, verdict: Verdict, probes) -> list[str]:
    lines = []
    if verdict.ceiling_hit_rate:
        share = base.hit_rate / verdict.ceiling_hit_rate
        lines.append(
            f"Reuse ceiling: {verdict.ceiling_hit_rate:.1%} of prompt tokens repeat an earlier "
            f"prefix; this cache serves {base.hit_rate:.1%} ({share:.0%} of the ceiling)."
        )
    lines.append(_next_dollar(verdict, base.hit_rate))
    if verdict.shared_l3 is not None:
        lines.append(_pd_sentence(config, verdict.shared_l3))
    busiest = max(base.utilization, default=0.0)
    if busiest > SATURATED:
        lines.append(
            f"Careful: an instance is {busiest:.0%} busy with prefill, so TTFT here is mostly "
            "queueing; add instances (--instances) before reading TTFT."
        )
    return lines


def _next_dollar(verdict: Verdict, base_hit_rate: float) -> str:
    ranked = sorted(
        (m for m in verdict.margins if m.added_cost > 0),
        key=lambda m: m.return_per_dollar,
        reverse=True,
    )
    budget = _money(verdict.budget_per_month)
    if not ranked:
        return "No tier can grow on this hardware; the cache is as large as it can be."
    detail = "; ".join(
        f"{m.tier.upper()} +{m.added_bytes / 1e9:,.0f} GB returns "
        f"${_clean(m.return_per_dollar):.2f}"
        for m in ranked
    ) + "".join(f"; {m.tier.upper()}: {m.note}" for m in verdict.margins if m.note)
    best = ranked[0]
    if verdict.ceiling_hit_rate and base_hit_rate >= AT_CEILING * verdict.ceiling_hit_rate:
        return (
            f"Next dollar: nowhere. The cache already serves the trace's reuse ceiling: more "
            f"capacity in any tier cannot add hits (per $1 of {budget}/month: {detail})."
        )
    if best.return_per_dollar < 1.0:
        return (
            f"Next dollar: nowhere. {budget}/month more in any tier saves less prefill GPU "
            f"time than it costs (per $1: {detail}): the cache is big enough for this trace."
        )
    return (
        f"Next dollar: {best.tier.upper()}. {budget}/month more there "
        f"(+{best.added_bytes / 1e9:,.0f} GB) saves {_money(best.added_savings)}/month of "
        f"prefill GPU time, hit rate {best.hit_rate:.1%}, p90 TTFT {_seconds(best.ttft_p90_s)} "
        f"(per $1: {detail})."
    )


def _pd_sentence(config: SimulationConfig, check: SharedL3Check) -> str:
    if check.instances < 2:
        # One instance has nobody to share an L3 with: a verdict either way would be made up.
        return (
            "Prefill/decode disaggregation with a shared L3: not judged with one prefill "
            f"instance (nothing to share); run with --instances 2 or more. Handing prompt KV "
            f"to decode would take {check.pd_gb_per_s:.2f} GB/s ({check.nic_fraction:.0%} of "
            "the NIC with the L3 reads)."
        )
    words = "pays off" if check.pays_off else "does not pay off"
    instances = f"{check.instances} prefill instances"
    own = "their own L1/L2"
    if check.local_l3_bytes:
        own += f" and an L3 each of {check.local_l3_bytes / check.instances / 1e12:,.2f} TB"
    reason = " The NIC cannot carry it." if check.nic_fraction >= 1.0 else ""
    return (
        f"Prefill/decode disaggregation with a shared L3 {words} on this trace: with "
        f"{instances} sharing an L3 of {check.l3_bytes / 1e12:,.2f} TB the hit rate is "
        f"{check.hit_rate_shared:.1%} against {check.hit_rate_local:.1%} on {own}; the "
        f"extra hits save {_money(check.savings)}/month of prefill for "
        f"{_money(check.l3_cost)}/month more of L3. {check.pd_direct_fraction:.0%} of the "
        "requests would go straight to decode (every full page cached, as the router "
        "decides); the prompt KV the others hand to decode takes "
        f"{check.pd_gb_per_s:.2f} GB/s per prefill instance ({check.nic_fraction:.0%} of its "
        f"NIC with the L3 reads).{reason}"
    )


__all__ = ["Probe", "Verdict", "build_verdict", "plan_probes"]
