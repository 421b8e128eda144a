"""How fast `hicache simulate` plays a trace: the whole synthetic Mooncake trace with three tiers
on one core, and a 10-point capacity sweep, against the issue's budgets (10 s and 60 s).

DeepSeek-V3 on one 8 x H200 instance; L1 100 GB and L2 300 GB per instance, a 3 TB L3, so
every tier serves hits; default policies. One JSON line per case, with the ratio of the
time taken to its budget (below 1 meets it).

    python benchmarks/bench_simulate.py [--trace T] [--page-size 512] [--jobs N]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import DEFAULT_TRACE, device_name, emit  # noqa: E402
from hicache.simulate import simulate  # noqa: E402
from hicache.simulate.config import SimulationConfig  # noqa: E402
from hicache.simulate.hardware import PRESETS as HARDWARE  # noqa: E402
from hicache.simulate.model_presets import PRESETS as MODELS  # noqa: E402
from hicache.simulate.sweep import SweepAxis, grid, run_configs  # noqa: E402
from hicache.simulate.trace import load_mooncake  # noqa: E402

WHOLE_TRACE_BUDGET_S = 10.0
SWEEP_BUDGET_S = 60.0


def base_config(page_size: int) -> SimulationConfig:
    return SimulationConfig(
        model=MODELS["deepseek-v3"],
        hardware=HARDWARE["h200"],
        page_size=page_size,
        gpus_per_instance=8,
        l1_bytes=100e9,
        l2_bytes=300e9,
        l3_bytes=3e12,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    parser.add_argument("--page-size", type=int, default=512)
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    if not args.trace.exists():
        parser.error(f"trace not found: {args.trace} (pass --trace)")
    trace = load_mooncake(args.trace)
    config = base_config(args.page_size)
    simulate(config, trace.head(200))  # warm-up
    started = time.perf_counter()
    result = simulate(config, trace)
    seconds = time.perf_counter() - started
    common = {"device": device_name(), "trace": trace.name, "page_size": args.page_size}
    emit(
        {
            "bench": "simulate_whole_trace",
            **common,
            "requests": result.requests,
            "total_tokens": result.total_tokens,
            "hit_rate": round(result.hit_rate, 6),
            "l1_l2_l3_hit_tokens": [result.tiers[t].hit_tokens for t in ("l1", "l2", "l3")],
            "seconds": round(seconds, 3),
            "budget_s": WHOLE_TRACE_BUDGET_S,
            "ratio_to_budget": round(seconds / WHOLE_TRACE_BUDGET_S, 4),
        }
    )
    axis = SweepAxis("l2", tuple((100 + 200 * i) * 1e9 for i in range(10)))  # 100 GB to 1.9 TB
    configs = grid(config, [axis])
    for jobs in sorted({1, args.jobs}):
        started = time.perf_counter()
        results = run_configs(configs, trace, jobs=jobs)
        seconds = time.perf_counter() - started
        emit(
            {
                "bench": "simulate_sweep",
                **common,
                "points": len(configs),
                "jobs": jobs,
                "hit_rates": [round(r.hit_rate, 4) for r in results],
                "slowest_point_s": round(max(r.elapsed_s for r in results), 3),
                "seconds": round(seconds, 3),
                "budget_s": SWEEP_BUDGET_S,
                "ratio_to_budget": round(seconds / SWEEP_BUDGET_S, 4),
            }
        )


if __name__ == "__main__":
    main()
