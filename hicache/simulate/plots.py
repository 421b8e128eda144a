"""A sweep's plots, in one PNG of three panels: hit rate and TTFT against the swept
capacity, and cache cost against hit rate. matplotlib with the Agg backend (no display);
imported only when plotting."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from hicache.simulate.sweep import SweepAxis


def plot_sweep(axes: Sequence[SweepAxis], rows: Sequence[dict], path: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x_axis = axes[0]
    series = _series(axes, rows)
    figure, (hits, ttft, cost) = plt.subplots(1, 3, figsize=(15, 4.6), dpi=80)
    for label, points in series:
        xs = [row[f"{x_axis.tier}_gb"] for row in points]
        suffix = f" ({label})" if label else ""
        hits.plot(xs, [100 * row["hit_rate"] for row in points], marker="o", label=f"all{suffix}")
        if len(series) == 1:
            for tier in ("l1", "l2", "l3"):
                values = [100 * row[f"{tier}_hit_rate"] for row in points]
                if any(values):
                    hits.plot(xs, values, linestyle="--", marker=".", label=tier.upper())
            for name, style in (("p50", "-"), ("p90", "--"), ("p99", ":")):
                ttft.plot(
                    xs, [row[f"ttft_{name}_s"] for row in points], style, marker="o", label=name
                )
        else:
            ttft.plot(xs, [row["ttft_p90_s"] for row in points], marker="o", label=f"p90{suffix}")
        cost.plot(
            [100 * row["hit_rate"] for row in points],
            [row["cache_cost_per_month"] for row in points],
            marker="o",
            label=label or x_axis.tier.upper(),
        )
        for row in points:
            cost.annotate(
                f"{row[f'{x_axis.tier}_gb']:,.0f}",
                (100 * row["hit_rate"], row["cache_cost_per_month"]),
                textcoords="offset points",
                xytext=(4, 4),
                fontsize=7,
            )
    hits.set(xlabel=x_axis.label, ylabel="hit rate (% of prompt tokens)", title="Hit rate")
    ttft.set(xlabel=x_axis.label, ylabel="TTFT (s)", title="Time to first token")
    ttft.set_yscale("log")
    cost.set(
        xlabel="hit rate (% of prompt tokens)",
        ylabel="cache cost (USD / month)",
        title=f"Cost against hit rate (points: {x_axis.tier.upper()} GB)",
    )
    for panel in (hits, ttft, cost):
        panel.grid(True, alpha=0.3)
        panel.legend(fontsize=8)
    figure.suptitle(title, fontsize=10)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    plt.close(figure)
    return path


def _series(axes: Sequence[SweepAxis], rows: Sequence[dict]) -> list[tuple[str, list[dict]]]:
    """One line per value of the second axis (or one line)."""
    if len(axes) == 1:
        return [("", list(rows))]
    second = axes[1]
    groups: dict[float, list[dict]] = {}
    for row in rows:
        groups.setdefault(row[f"{second.tier}_gb"], []).append(row)
    return [
        (
            f"{second.tier.upper()} {value:,.0f} GB",
            sorted(points, key=lambda r: r[f"{axes[0].tier}_gb"]),
        )
        for value, points in groups.items()
    ]
