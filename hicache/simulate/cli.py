"""`hicache simulate`: the runs the flags ask for, and the output.

The flags are in flags.py; flag_config.py checks them and builds the `SimulationConfig`.
This module is the command (`HELP`, `add_arguments`, `run`, as hicache/cli.py loads it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import NamedTuple

from hicache.simulate.calibrate import calibrate
from hicache.simulate.errors import SimulationError
from hicache.simulate.flag_config import build_config, check_flags
from hicache.simulate.flags import SWEEP_OUT, add_arguments
from hicache.simulate.player import TracePlayer
from hicache.simulate.progress import ProgressBar
from hicache.simulate.report import (
    best_sweep_point,
    format_header,
    format_result,
    format_sweep_table,
    format_verdict,
    machine,
    savings_basis,
    sweep_rows,
)
from hicache.simulate.sweep import grid, parse_sweep, run_configs
from hicache.simulate.trace import Trace, load_trace
from hicache.simulate.verdict import build_verdict, plan_probes

# What a subcommand module exposes to hicache/cli.py (add_arguments lives in flags.py).
__all__ = ["HELP", "add_arguments", "run"]

# The one line `hicache --help` shows for this subcommand.
HELP = "plan KV cache capacity: play a trace through hicache's policies in virtual time"


def run(args: argparse.Namespace) -> int:
    try:
        if args.calibrate:
            return _calibrate(args)
        return _run(args)
    except (SimulationError, ValueError) as error:
        if args.debug:
            raise
        print(f"hicache simulate: error: {error}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    where = machine()  # before the runs load it
    check_flags(args)
    trace = load_trace(args.trace, args.limit)
    config = build_config(args, trace)
    axes = [parse_sweep(spec) for spec in args.sweep]
    if len(axes) > 2:
        raise ValueError("--sweep at most twice (one or two capacities)")
    sweep_configs = grid(config, axes) if axes else []
    bar = ProgressBar("simulate", enabled=args.progress)
    base = TracePlayer(config, trace, progress=None if sweep_configs else bar).run()
    probes = {} if args.no_verdict else plan_probes(config, trace)
    probe_names = [name for name, probe in probes.items() if probe.config is not None]
    extra = sweep_configs + [probes[name].config for name in probe_names]
    runs_bar = ProgressBar("runs", enabled=args.progress, delay_s=0.0)
    extra_results = run_configs(extra, trace, jobs=args.jobs, progress=runs_bar) if extra else []
    sweep_results = extra_results[: len(sweep_configs)]
    probe_results = dict(zip(probe_names, extra_results[len(sweep_configs) :], strict=True))
    verdict = None if args.no_verdict else build_verdict(config, trace, base, probes, probe_results)
    wall_s = time.perf_counter() - started
    if axes:
        timing = Timing(wall_s, 1 + len(extra), _jobs(args, len(extra)), where)
        return _sweep_output(
            args, config, trace, axes, sweep_configs, sweep_results, verdict, timing
        )
    if args.json:
        out = base.as_dict()
        out["verdict"] = verdict.as_dict() if verdict else None
        out["wall_s"] = round(wall_s, 3)
        out["machine"] = where
        print(json.dumps(out))
        return 0
    print(format_header(config, trace))
    print()
    print(format_result(base, config, where))
    if verdict is not None:
        print()
        print(format_verdict(verdict))
    if extra:
        print()
        print(f"{1 + len(extra)} runs (the base and the verdict's) in {wall_s:.1f} s, "
              f"{_jobs(args, len(extra))} processes, on {where}")  # fmt: skip
    return 0


class Timing(NamedTuple):
    """How long a command took, and where: a time means little without the machine."""

    wall_s: float
    num_runs: int
    num_processes: int
    machine: str


def _jobs(args: argparse.Namespace, num_extra: int) -> int:
    """Processes the extra runs use (as run_configs picks them)."""
    return max(1, min(num_extra, args.jobs or os.cpu_count() or 1))


def _sweep_output(args, config, trace: Trace, axes, configs, results, verdict, timing) -> int:
    from hicache.simulate.plots import plot_sweep

    rows = sweep_rows(axes, configs, results)
    table = format_sweep_table(axes, rows)
    best = best_sweep_point(axes, rows)
    best_result = results[max(range(len(rows)), key=lambda i: rows[i]["net_per_month"])]
    basis = savings_basis(best_result, configs[0])
    out_dir: Path = args.out or SWEEP_OUT
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise SimulationError(f"--out {out_dir}: cannot make it ({error.strerror})") from None
    title = (
        f"{trace.name}: {config.model.name} on {config.num_instances} x "
        f"{config.gpus_per_instance} {config.hardware.name.upper()}"
    )
    ceiling = verdict.ceiling_hit_rate if verdict else None
    plot = plot_sweep(axes, rows, out_dir / "sweep.png", title, ceiling_hit_rate=ceiling)
    document = {
        "trace": trace.name,
        "requests": trace.num_requests,
        "total_tokens": trace.total_tokens,
        "axes": [{"tier": a.tier, "gb": [v / 1e9 for v in a.values_bytes]} for a in axes],
        "points": [
            {**row, "result": result.as_dict()} for row, result in zip(rows, results, strict=True)
        ],
        "best": best,
        "verdict": verdict.as_dict() if verdict else None,
        "wall_s": round(timing.wall_s, 3),
        "machine": timing.machine,
    }
    (out_dir / "sweep.json").write_text(json.dumps(document, indent=1) + "\n")
    (out_dir / "sweep.md").write_text(f"{title}\n\n{table}\n\n{best}\n\n{basis}\n")
    if args.json:
        print(
            json.dumps(
                {
                    "points": rows,
                    "best": best,
                    "verdict": document["verdict"],
                    "files": [str(out_dir / n) for n in ("sweep.json", "sweep.md", plot.name)],
                    "wall_s": round(timing.wall_s, 3),
                    "machine": timing.machine,
                }
            )
        )
        return 0
    print(format_header(config, trace))
    print()
    print(table)
    print()
    print(best)
    print(basis)
    if verdict is not None:
        print()
        print(format_verdict(verdict))
    print()
    print(
        f"{len(results)} sweep points ({timing.num_runs} runs with the base and the verdict's) "
        f"in {timing.wall_s:.1f} s, {timing.num_processes} processes, on {timing.machine}; "
        f"wrote {out_dir / 'sweep.json'}, {out_dir / 'sweep.md'}, {plot}"
    )
    return 0


def _calibrate(args: argparse.Namespace) -> int:
    """`--calibrate URL`: measure the replica, write (or print) its profile."""
    if args.profile is not None:
        raise SimulationError("--calibrate and --profile: calibrate first, then plan with it")
    profile = calibrate(args.calibrate, rounds=args.calibrate_rounds, wait_s=args.calibrate_wait)
    if args.out is None:
        print(json.dumps(profile.as_dict()))
        return 0
    profile.write(args.out)
    fit = profile.compute
    print(
        f"wrote {args.out}: {profile.model.name} on {profile.device} ({profile.dtype}), "
        f"step {fit.per_step_s * 1e3:.3f} ms + {fit.per_row_s * 1e6:.3f} us/row + "
        f"{fit.per_pair_s * 1e9:.4f} ns/pair ({profile.num_compute_samples} steps), "
        f"L2 load {profile.l2_load_bytes_per_s / 1e9:.2f} GB/s ({profile.num_load_samples}), "
        f"L3 read {profile.l3_read_bytes_per_s / 1e9:.2f} GB/s ({profile.num_read_samples}), "
        f"L3 lookup {profile.l3_latency_s * 1e6:.0f} us"
    )
    return 0
