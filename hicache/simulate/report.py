"""Text output: one run's report, the verdict, and a sweep's table (Markdown, so the same
text reads on a terminal and renders in a README or an issue)."""

from __future__ import annotations

import os
import platform
from collections.abc import Sequence

from hicache.simulate.config import HOURS_PER_MONTH, SimulationConfig
from hicache.simulate.result import SimulationResult
from hicache.simulate.sweep import SweepAxis
from hicache.simulate.trace import Trace
from hicache.simulate.verdict import Verdict

_DIRECTION_NAMES = {
    "l1_to_l2": "L1->L2",
    "l2_to_l1": "L2->L1",
    "l2_to_l3": "L2->L3",
    "l3_to_l2": "L3->L2",
}


def human_bytes(num_bytes: float) -> str:
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6)):
        if abs(num_bytes) >= size:
            return f"{num_bytes / size:,.2f} {unit}"
    return f"{num_bytes:,.0f} B"


def human_seconds(seconds: float) -> str:
    if seconds < 1:
        return f"{seconds * 1e3:,.1f} ms"
    return f"{seconds:,.2f} s"


def format_header(config: SimulationConfig, trace: Trace) -> str:
    model, hw = config.model, config.hardware
    return "\n".join(
        [
            f"hicache simulate: {trace.name}: {trace.num_requests:,} requests, "
            f"{trace.total_tokens / 1e6:,.2f} M prompt tokens over {trace.duration_s:,.0f} s",
            f"model {model.name}: {model.kv_bytes_per_token:,} B of KV per token, "
            f"{human_bytes(model.weight_bytes)} of weights; {config.num_instances} instance(s) "
            f"of {config.gpus_per_instance} x {hw.name.upper()}"
            + (" (its prices; its costs as profiled below)" if config.profile else "")
            + f"; pages of {config.page_size} "
            f"tokens ({human_bytes(config.page_bytes)})",
            f"policies: write {config.policy.write_policy}, L3 writes {config.l3_write_policy}, "
            f"prefetch {config.policy.prefetch_policy}, eviction {config.policy.eviction_policy}, "
            f"routing {config.routing}",
        ]
        + _profile_line(config)
    )


def _profile_line(config: SimulationConfig) -> list[str]:
    """With a calibrated profile: where its costs were measured, and how many samples
    stand behind each (0: the cache's prior, not a measurement)."""
    p = config.profile
    if p is None:
        return []
    fit = p.compute
    return [
        f"costs measured on {p.device} ({p.dtype}) at {p.source or '?'} {p.measured_at}: "
        f"step {fit.per_step_s * 1e3:.3f} ms + {fit.per_row_s * 1e6:.3f} us/row + "
        f"{fit.per_pair_s * 1e9:.4f} ns/pair ({p.num_compute_samples} steps); L2->L1 "
        f"{p.l2_load_bytes_per_s / 1e9:.2f} GB/s ({p.num_load_samples} loads); L3 read "
        f"{config.l3_instance_bytes_per_s / 1e9:.2f} GB/s ({p.num_read_samples} reads)"
    ]


def format_result(result: SimulationResult, config: SimulationConfig, where: str = "") -> str:
    """One run's report; `where` describes the machine it ran on (see `machine`)."""
    scope = {"l1": "per instance", "l2": "per instance", "l3": "shared"}
    if not config.l3_shared:
        scope["l3"] = "per instance"
    rows = [
        ["tier", "capacity", "", "hit tokens", "hit rate", "hit pages", "$/month"],
    ]
    for tier, tier_result in result.tiers.items():
        rows.append(
            [
                tier.upper(),
                human_bytes(tier_result.capacity_bytes),
                scope[tier],
                f"{tier_result.hit_tokens / 1e6:,.2f} M",
                f"{tier_result.hit_rate:.2%}",
                f"{tier_result.hit_pages:,}",
                f"{tier_result.cost_per_month:,.0f}",
            ]
        )
    rows.append(
        [
            "all",
            "",
            "",
            f"{result.hit_tokens / 1e6:,.2f} M",
            f"{result.hit_rate:.2%}",
            f"{result.hit_pages:,} ({result.page_hit_rate:.2%})",
            f"{result.cache_cost_per_month:,.0f}",
        ]
    )
    p = result.prefill
    gpu_price = config.effective_prices.gpu_hour
    moved = ", ".join(
        f"{name} {human_bytes(result.bytes_moved[d])}" for d, name in _DIRECTION_NAMES.items()
    )
    utilization = ", ".join(f"{u:.0%}" for u in result.utilization)
    lines = [
        _columns(rows),
        "",
        f"prefill: {p.saved_fraction:.1%} of compute saved ({p.gpu_seconds_saved / 3600:,.2f} "
        f"of {(p.gpu_seconds + p.gpu_seconds_saved) / 3600:,.2f} GPU-hours), worth "
        f"${result.saved_per_month:,.0f}/month at ${gpu_price:.2f}/GPU-hour",
        savings_basis(result, config),
        f"TTFT: p50 {human_seconds(result.ttft.p50)}, p90 {human_seconds(result.ttft.p90)}, "
        f"p99 {human_seconds(result.ttft.p99)} (queueing p90 {human_seconds(result.queue.p90)};"
        f" waits in match p99 {human_seconds(result.match_wait.p99)})",
        f"bytes moved: {moved}",
        f"prefill busy: {utilization}; L3 prefetches {result.prefetches['issued']:,} "
        f"({result.prefetches['cut_short']:,} cut short)",
        f"cost per month: L1 ${result.cost_per_month['l1']:,.0f}, "
        f"L2 ${result.cost_per_month['l2']:,.0f}, L3 ${result.cost_per_month['l3']:,.0f}, "
        f"GPUs ${result.cost_per_month['gpus']:,.0f}",
        f"simulated in {result.elapsed_s:.2f} s" + (f" on {where}" if where else ""),
    ]
    return "\n".join(lines)


def savings_basis(result: SimulationResult, config: SimulationConfig) -> str:
    """What "saved $/month" is computed from, and why it can exceed the GPU bill."""
    price = config.effective_prices.gpu_hour
    deployed = config.num_instances * config.gpus_per_instance
    bill = config.monthly_cost()["gpus"]
    without, with_cache = result.prefill_gpus_busy_without_cache, result.prefill_gpus_busy
    text = (
        f"saved $/month: the prefill GPU time the cache avoids "
        f"({result.prefill.gpu_seconds_saved / 3600:,.2f} GPU-hours in this run's "
        f"{result.duration_s:,.0f} s), as if this traffic ran all month ({HOURS_PER_MONTH:.0f} "
        f"h) at ${price:.2f}/GPU-hour: {without - with_cache:,.1f} GPUs' worth. Prefill of this "
        f"traffic keeps {without:,.1f} GPUs busy on average without the cache and "
        f"{with_cache:,.1f} with it; {deployed} are deployed (${bill:,.0f}/month)"
    )
    if without > deployed:
        return text + (
            ", so without the cache they could not keep up, and the saving can exceed their "
            "bill: it prices the GPUs that serving this traffic uncached would add."
        )
    return text + "."


def machine() -> str:
    """This machine in a few words, for quoting how long a run took: CPUs, and how busy."""
    cpus = os.cpu_count() or 1
    model = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            model = next(
                (line.split(":", 1)[1].strip() for line in info if line.startswith("model name")),
                "",
            )
    except OSError:
        model = platform.processor()
    # The load average before the run: other work on the machine slows it.
    load = f", load {os.getloadavg()[0]:.1f} before the run" if hasattr(os, "getloadavg") else ""
    return f"{cpus} CPUs" + (f" of {model}" if model else "") + load


def format_verdict(verdict: Verdict) -> str:
    return "verdict:\n" + "\n".join(f"- {line}" for line in verdict.lines)


def _columns(rows: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in rows
    )


# ---------------------------------------------------------------------------- sweeps


def sweep_rows(
    axes: Sequence[SweepAxis],
    configs: Sequence[SimulationConfig],
    results: Sequence[SimulationResult],
) -> list[dict]:
    rows = []
    for config, result in zip(configs, results, strict=True):
        row = {
            f"{axis.tier}_gb": round(getattr(config, f"{axis.tier}_bytes") / 1e9, 3)
            for axis in axes
        }
        row.update(
            hit_rate=result.hit_rate,
            l1_hit_rate=result.tiers["l1"].hit_rate,
            l2_hit_rate=result.tiers["l2"].hit_rate,
            l3_hit_rate=result.tiers["l3"].hit_rate,
            page_hit_rate=result.page_hit_rate,
            prefill_saved=result.prefill.saved_fraction,
            ttft_p50_s=result.ttft.p50,
            ttft_p90_s=result.ttft.p90,
            ttft_p99_s=result.ttft.p99,
            cache_cost_per_month=result.cache_cost_per_month,
            saved_per_month=result.saved_per_month,
            net_per_month=result.saved_per_month - result.cache_cost_per_month,
            elapsed_s=result.elapsed_s,
        )
        rows.append(row)
    return rows


def format_sweep_table(axes: Sequence[SweepAxis], rows: Sequence[dict]) -> str:
    header = [f"{axis.tier.upper()} GB" for axis in axes] + [
        "hit %",
        "L1 %",
        "L2 %",
        "L3 %",
        "prefill saved",
        "TTFT p50",
        "p90",
        "p99",
        "cache $/mo",
        "saved $/mo",
        "net $/mo",
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---:|" * len(header)]
    for row in rows:
        cells = [f"{row[f'{axis.tier}_gb']:,.0f}" for axis in axes] + [
            f"{row['hit_rate']:.2%}",
            f"{row['l1_hit_rate']:.2%}",
            f"{row['l2_hit_rate']:.2%}",
            f"{row['l3_hit_rate']:.2%}",
            f"{row['prefill_saved']:.1%}",
            human_seconds(row["ttft_p50_s"]),
            human_seconds(row["ttft_p90_s"]),
            human_seconds(row["ttft_p99_s"]),
            f"{row['cache_cost_per_month']:,.0f}",
            f"{row['saved_per_month']:,.0f}",
            f"{row['net_per_month']:,.0f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def best_sweep_point(axes: Sequence[SweepAxis], rows: Sequence[dict]) -> str:
    """The sweep point with the most net savings, in words."""
    best = max(rows, key=lambda row: row["net_per_month"])
    where = ", ".join(f"{axis.tier.upper()} {best[f'{axis.tier}_gb']:,.0f} GB" for axis in axes)
    return (
        f"Best point of the sweep by prefill savings less cache cost: {where}: hit rate "
        f"{best['hit_rate']:.1%}, net ${best['net_per_month']:,.0f}/month, "
        f"p90 TTFT {human_seconds(best['ttft_p90_s'])}."
    )
