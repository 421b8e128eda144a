"""A sweep's plots, in one PNG of three panels against the swept capacity: hit rate (with the
trace's reuse ceiling, the most any cache can serve), time to first token, and money per
month (what the cache saves, what it costs, and the difference, net). The recommended point,
the sweep's best net, is marked in every panel. matplotlib with the Agg backend (no
display); imported only when plotting."""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from pathlib import Path

from hicache.simulate.errors import SimulationError
from hicache.simulate.sweep import SweepAxis

BEST_COLOR = "crimson"


def require_matplotlib() -> None:
    """The plot's one dependency, an extra (`hicache[plot]`): missing, it is one line."""
    if importlib.util.find_spec("matplotlib") is None:
        raise SimulationError(
            "--sweep draws sweep.png with matplotlib, which is not installed: "
            "pip install 'hicache[plot]' (or matplotlib)"
        )


def plot_sweep(
    axes: Sequence[SweepAxis],
    rows: Sequence[dict],
    path: Path,
    title: str,
    *,
    ceiling_hit_rate: float | None = None,
) -> Path:
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    x_axis = axes[0]
    x_key = f"{x_axis.tier}_gb"
    series = _series(axes, rows)
    best = max(rows, key=lambda row: row["net_per_month"])
    figure, (hits, ttft, money) = plt.subplots(1, 3, figsize=(16, 5.2), dpi=90)
    for index, (label, points) in enumerate(series):
        color = f"C{index}"
        xs = [row[x_key] for row in points]
        suffix = f" ({label})" if label else ""
        _hit_lines(hits, xs, points, suffix, color, single=len(series) == 1)
        _ttft_lines(ttft, xs, points, suffix, color, single=len(series) == 1)
        _money_lines(money, xs, points, suffix, color, single=len(series) == 1)
    if ceiling_hit_rate:
        hits.axhline(100 * ceiling_hit_rate, color="0.35", linestyle=":", linewidth=1.5)
        hits.annotate(
            f"reuse ceiling {ceiling_hit_rate:.1%}: the most any cache serves",
            (0.02, 100 * ceiling_hit_rate),
            xycoords=("axes fraction", "data"),
            xytext=(0, 4),
            textcoords="offset points",
            fontsize=8,
            color="0.25",
            bbox={"boxstyle": "round,pad=0.15", "facecolor": "white", "edgecolor": "none"},
        )
    _mark_best(hits, ttft, money, best, x_key, axes)
    top = max(
        100 * ceiling_hit_rate if ceiling_hit_rate else 0, *(100 * r["hit_rate"] for r in rows)
    )
    hits.set_ylim(0, min(100, top * 1.15 + 2))
    hits.set(xlabel=x_axis.label, ylabel="hit rate (% of prompt tokens)", title="Hit rate")
    ttft.set(xlabel=x_axis.label, ylabel="TTFT (s, log scale)", title="Time to first token")
    ttft.set_yscale("log")
    money.set(
        xlabel=x_axis.label,
        ylabel="USD / month",
        title="Money: saved prefill GPU time, cache cost, net",
    )
    money.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"${value:,.0f}"))
    money.axhline(0, color="0.5", linewidth=0.8)
    for panel in (hits, ttft, money):
        panel.grid(True, alpha=0.3)
        panel.margins(x=0.04)
    hits.legend(fontsize=8, loc="lower right")
    single = len(series) == 1
    ttft.legend(fontsize=8, loc="lower left" if single else "best")
    # Room above the curves for the legend, so that it hides none of them.
    low, high = money.get_ylim()
    money.set_ylim(min(low, 0), high + 0.45 * (high - min(low, 0)))
    money.legend(fontsize=8, loc="upper left", ncol=2 if single else 1)
    figure.suptitle(title, fontsize=11)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    plt.close(figure)
    return path


def _hit_lines(panel, xs, points, suffix, color, *, single: bool) -> None:
    panel.plot(
        xs, [100 * r["hit_rate"] for r in points], marker="o", color=color, label=f"all{suffix}"
    )
    if not single:
        return
    for index, tier in enumerate(("l1", "l2", "l3"), start=1):
        values = [100 * row[f"{tier}_hit_rate"] for row in points]
        if any(values):
            panel.plot(
                xs, values, linestyle="--", marker=".", color=f"C{index}", label=tier.upper()
            )


def _ttft_lines(panel, xs, points, suffix, color, *, single: bool) -> None:
    if not single:
        panel.plot(
            xs, [r["ttft_p90_s"] for r in points], marker="o", color=color, label=f"p90{suffix}"
        )
        return
    for name, style in (("p50", "-"), ("p90", "--"), ("p99", ":")):
        panel.plot(xs, [r[f"ttft_{name}_s"] for r in points], style, marker="o", label=name)


def _money_lines(panel, xs, points, suffix, color, *, single: bool) -> None:
    net = [r["net_per_month"] for r in points]
    panel.plot(xs, net, marker="o", linewidth=2.2, color=color, label=f"net = saved - cost{suffix}")
    if not single:
        return
    panel.plot(
        xs,
        [r["saved_per_month"] for r in points],
        "--",
        color="C2",
        label="saved (prefill GPU time)",
    )
    panel.plot(
        xs,
        [r["cache_cost_per_month"] for r in points],
        ":",
        color="C3",
        label="cache cost (L1+L2+L3)",
    )


def _mark_best(hits, ttft, money, best: dict, x_key: str, axes: Sequence[SweepAxis]) -> None:
    """A vertical line at the recommended capacity in each panel, a star on each curve."""
    x = best[x_key]
    where = ", ".join(f"{a.tier.upper()} {best[f'{a.tier}_gb']:,.0f} GB" for a in axes)
    for panel in (hits, ttft, money):
        panel.axvline(x, color=BEST_COLOR, linestyle="-", linewidth=1, alpha=0.35)
    star = {"marker": "*", "s": 220, "color": BEST_COLOR, "zorder": 5, "edgecolors": "white"}
    hits.scatter([x], [100 * best["hit_rate"]], **star)
    ttft.scatter([x], [best["ttft_p90_s"]], **star)
    money.scatter([x], [best["net_per_month"]], label=f"recommended: {where}", **star)
    money.annotate(
        f"best net ${best['net_per_month']:,.0f}/mo\n{where}, hit {best['hit_rate']:.1%}",
        (x, best["net_per_month"]),
        xytext=(0, 12),
        textcoords="offset points",
        ha="center",
        va="bottom",
        fontsize=8,
        color=BEST_COLOR,
    )
    hits.annotate(
        f"{best['hit_rate']:.1%}",
        (x, 100 * best["hit_rate"]),
        xytext=(6, -14),
        textcoords="offset points",
        fontsize=8,
        color=BEST_COLOR,
    )
    ttft.annotate(
        f"p90 {best['ttft_p90_s']:.2f} s",
        (x, best["ttft_p90_s"]),
        xytext=(6, 6),
        textcoords="offset points",
        fontsize=8,
        color=BEST_COLOR,
    )


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
