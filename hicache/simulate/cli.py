"""`hicache simulate`: flags, the runs they ask for, and the output.

Defaults come from the dataclasses they configure (`PolicyConfig`, `L3Config`,
`SimulationConfig`, the model and hardware presets), so the CLI never disagrees with the
library. Sizes are GB unless a unit is given ("512", "1.5TB", "800GiB").
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import NamedTuple

from hicache.config import (
    EVICTION_POLICIES,
    L3_WRITE_POLICIES,
    PREFETCH_POLICIES,
    WRITE_POLICIES,
    L3Config,
    PolicyConfig,
)
from hicache.simulate.calibrate import WAIT_S, calibrate
from hicache.simulate.config import (
    ROUTING,
    Prices,
    SimulationConfig,
    default_gpus_per_instance,
    default_l1_bytes,
    default_l2_bytes,
)
from hicache.simulate.errors import SimulationError
from hicache.simulate.hardware import PRESETS as HARDWARE_PRESETS
from hicache.simulate.hardware import load_hardware
from hicache.simulate.l3 import STORE_PRESETS
from hicache.simulate.models import PRESETS as MODEL_PRESETS
from hicache.simulate.models import canonical_dtype, load_model
from hicache.simulate.player import TracePlayer
from hicache.simulate.profile import load_profile
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
from hicache.simulate.sweep import grid, parse_capacity, parse_sweep, run_configs
from hicache.simulate.trace import CONVERSATIONS, Trace, load_trace
from hicache.simulate.verdict import build_verdict, plan_probes

_POLICY = PolicyConfig()
_SWEEP_OUT = Path("hicache-sweep")
_L3 = L3Config()
_DEFAULT = SimulationConfig.__dataclass_fields__


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a flag's default unless it has none or its help already says it."""

    def _get_help_string(self, action):
        if action.default in (None, False) or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


# The one line `hicache --help` shows for this subcommand.
HELP = "plan KV cache capacity: play a trace through hicache's policies in virtual time"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = _HelpFormatter
    work = parser.add_argument_group("workload")
    work.add_argument(
        "--trace",
        default=CONVERSATIONS,
        help="a Mooncake JSONL trace, 'mooncake' for the synthetic one bundled with hicache, "
        "or 'conversations[:sessions=N,turns=T,seed=S,...]' for the built-in conversation "
        "generator",
    )
    work.add_argument("--limit", type=int, help="play only the first N requests")
    work.add_argument(
        "--page-size",
        type=int,
        help="tokens per page (default: the trace's block size, 512 for Mooncake traces; else 64)",
    )

    model = parser.add_argument_group("model and hardware")
    model.add_argument(
        "--model",
        help=f"a preset ({', '.join(MODEL_PRESETS)}) or a config.json path "
        "(default: the --profile's model, else deepseek-v3)",
    )
    model.add_argument("--kv-dtype", help="KV cache dtype (bf16, fp8, ...; default: the model's)")
    model.add_argument(
        "--mtp",
        action="store_true",
        help="use the model's MTP layers (their KV and weights share the budget)",
    )
    model.add_argument(
        "--draft",
        help="a draft model (preset or config.json) for speculative "
        "decoding; its KV and weights share the budget",
    )
    model.add_argument("--hardware", default="h200", help=f"one of {', '.join(HARDWARE_PRESETS)}")
    model.add_argument(
        "--gpus-per-instance",
        type=int,
        help="GPUs per serving instance (default: the fewest, a power of two, "
        "whose HBM the weights fill to at most 75%%)",
    )
    model.add_argument(
        "--instances",
        type=int,
        default=_DEFAULT["num_instances"].default,
        help="serving (prefill) instances",
    )
    model.add_argument(
        "--routing",
        choices=ROUTING,
        default=_DEFAULT["routing"].default,
        help="how requests pick an instance, as `hicache route` does (hicache.routing): "
        "round_robin, least_load (least queued prefill), or prefix (the most valuable "
        "tier-weighted cached prefix among instances within 1 s of queued prefill of the least "
        "busy)",
    )
    model.add_argument(
        "--mfu",
        type=float,
        help=f"prefill model-FLOPs utilization (default: {_DEFAULT['mfu'].default}; "
        "not with --profile)",
    )
    model.add_argument(
        "--profile",
        type=Path,
        metavar="FILE",
        help="a hardware profile measured on a replica (--calibrate): prefill costs its "
        "measured engine steps and the links its measured rates, instead of --mfu, --tflops "
        "and the link presets",
    )
    model.add_argument(
        "--engine-requests",
        action="store_true",
        help="play requests as `hicache engine serve` runs them: look up the prompt but its "
        "last token, and cache the answer's pages with the prompt's (default: prompts only, "
        "as on a P/D prefill side)",
    )
    model.add_argument(
        "--shared-device",
        action="store_true",
        help="every instance runs on one device (replicas sharing a GPU): their prefills "
        "take turns on it",
    )
    model.add_argument(
        "--calibrate",
        metavar="URL",
        help="measure a running `hicache engine serve` replica (warm-up prompts, then its "
        "/v1/hicache/profile) and write the profile to --out (default: print it); runs nothing "
        "else",
    )
    model.add_argument(
        "--calibrate-rounds",
        type=int,
        default=3,
        help="warm-up prompts of each length --calibrate sends first (0: none)",
    )
    model.add_argument(
        "--calibrate-wait",
        type=float,
        default=WAIT_S,
        metavar="SECONDS",
        help="how long --calibrate waits for a replica that is still starting "
        "(default: %(default)s)",
    )
    for flag, name, unit in (
        ("--hbm", "hbm_bytes", "GB per GPU"),
        ("--host-memory", "host_bytes", "GB per GPU"),
        ("--host-link-bandwidth", "host_link_bytes_per_s", "GB/s per GPU, per direction"),
        ("--nic-bandwidth", "nic_bytes_per_s", "GB/s per GPU, per direction"),
        ("--tflops", "flops", "TFLOP/s per GPU, dense, at the model's compute dtype"),
    ):
        model.add_argument(
            flag,
            type=float,
            dest=f"hw_{name}",
            metavar=unit.split()[0].upper().rstrip(","),
            help=f"override: {unit}",
        )
    model.add_argument(
        "--gpu-hour-price", type=float, metavar="USD", help="override: USD per GPU-hour"
    )

    tiers = parser.add_argument_group("tiers (sizes in GB unless a unit is given)")
    tiers.add_argument(
        "--l1", metavar="SIZE", help="HBM for KV per instance (default: 90%% of HBM less weights)"
    )
    tiers.add_argument(
        "--l2", metavar="SIZE", help="host memory for KV per instance (default: half the host's)"
    )
    tiers.add_argument("--l3", metavar="SIZE", default="0", help="shared L3 store (0: none)")
    tiers.add_argument(
        "--l3-local",
        action="store_true",
        help="each instance has its own L3 of that size instead of one shared",
    )
    tiers.add_argument(
        "--l3-bandwidth",
        type=float,
        metavar="GB/S",
        help="GB/s per instance to L3 (default: the instance's NICs)",
    )
    tiers.add_argument(
        "--l3-aggregate-bandwidth",
        type=float,
        metavar="GB/S",
        help="GB/s the shared L3 serves in all (default: no limit)",
    )
    tiers.add_argument(
        "--l3-latency-us",
        type=float,
        help=f"per L3 request (default: --l3-store's, else "
        f"{_DEFAULT['l3_latency_s'].default * 1e6:g})",
    )
    tiers.add_argument(
        "--l3-store",
        choices=sorted(STORE_PRESETS),
        help="the bandwidth and latency measured on a real store (bench_backends.py); "
        "--l3-bandwidth and --l3-latency-us override them",
    )
    for tier, default in (("l1", "the GPU's price over its HBM"), ("l2", "0.50"), ("l3", "0.10")):
        tiers.add_argument(
            f"--price-{tier}",
            type=float,
            help=f"USD per GB-month of {tier.upper()} (default: {default})",
        )

    policy = parser.add_argument_group("policies (as in the controller)")
    policy.add_argument("--write-policy", choices=WRITE_POLICIES, default=_POLICY.write_policy)
    policy.add_argument(
        "--write-through-threshold", type=int, default=_POLICY.write_through_threshold
    )
    policy.add_argument("--l3-write-policy", choices=L3_WRITE_POLICIES, default=_L3.write_policy)
    policy.add_argument(
        "--prefetch-policy", choices=PREFETCH_POLICIES, default=_POLICY.prefetch_policy
    )
    policy.add_argument(
        "--prefetch-timeout-base-ms", type=float, default=_POLICY.prefetch_timeout_base_s * 1e3
    )
    policy.add_argument(
        "--prefetch-timeout-per-1k-ms",
        type=float,
        default=_POLICY.prefetch_timeout_per_1k_tokens_s * 1e3,
    )
    policy.add_argument(
        "--eviction-policy", choices=EVICTION_POLICIES, default=_POLICY.eviction_policy
    )

    out = parser.add_argument_group("output")
    out.add_argument(
        "--sweep",
        action="append",
        default=[],
        metavar="TIER=VALUES",
        help="sweep a capacity: l2=0,256,1024 or l3=0:8000:5 (linear) or "
        "l3=100..10000:5 (geometric); give it twice for a grid",
    )
    out.add_argument(
        "--out",
        type=Path,
        help=f"where a sweep writes sweep.json, sweep.md and sweep.png (default: "
        f"{_SWEEP_OUT}); the file --calibrate writes",
    )
    out.add_argument(
        "--jobs", type=int, help="processes for sweeps and the verdict (default: one per CPU)"
    )
    out.add_argument(
        "--no-verdict", action="store_true", help="skip the verdict (and the extra runs it takes)"
    )
    out.add_argument("--json", action="store_true", help="print one JSON line instead of text")
    out.add_argument("--debug", action="store_true", help="on a mistake, print the traceback too")
    out.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bar on stderr (default: when stderr is a terminal)",
    )


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


# flag -> (the least value, what it counts); None (not given) takes the default.
_AT_LEAST = {
    "limit": (1, "requests"),
    "page_size": (1, "tokens"),
    "gpus_per_instance": (1, "GPUs"),
    "instances": (1, "instances"),
    "jobs": (1, "processes"),
    "write_through_threshold": (1, "hits"),
}


def check_flags(args: argparse.Namespace) -> None:
    """What the flags alone can get wrong, named by flag, before the trace is read."""
    for name, (least, unit) in _AT_LEAST.items():
        value = getattr(args, name)
        if value is not None and value < least:
            raise SimulationError(
                f"--{name.replace('_', '-')} must be >= {least} {unit}, got {value}"
            )
    if args.profile is not None:
        for flag, value in (
            ("--mfu", args.mfu),
            ("--tflops", args.hw_flops),
            ("--host-link-bandwidth", args.hw_host_link_bytes_per_s),
            ("--kv-dtype", args.kv_dtype),
            ("--draft", args.draft),
        ):
            if value is not None:
                raise SimulationError(
                    f"{flag} and --profile: the profile's measured costs replace {flag}; "
                    "give one of them"
                )
        if args.mtp:
            raise SimulationError("--mtp and --profile: the profile measured the model as served")
        load_profile(args.profile)  # a bad file is named before the trace is read
    if args.mfu is not None and not 0 < args.mfu <= 1:
        raise SimulationError(
            f"--mfu must be in (0, 1] (a fraction of peak FLOP/s), got {args.mfu}"
        )
    for name in ("l1", "l2", "l3"):
        if getattr(args, name) is not None:
            _capacity(args, name)
    if args.sweep and args.out and args.out.exists() and not args.out.is_dir():
        raise SimulationError(f"--out {args.out}: exists and is not a directory")
    if args.sweep:
        from hicache.simulate.plots import require_matplotlib

        require_matplotlib()  # before the sweep runs, not after


def _capacity(args: argparse.Namespace, tier: str) -> float:
    """--l1/--l2/--l3 in bytes (GB unless a unit is given), named by its flag."""
    text = getattr(args, tier)
    try:
        value = parse_capacity(text)
    except ValueError as error:
        raise SimulationError(f"--{tier} {text}: {error}") from None
    if value < 0:
        raise SimulationError(f"--{tier} must be >= 0, got {text}")
    return value


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
    out_dir: Path = args.out or _SWEEP_OUT
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


# ---------------------------------------------------------------------------- config


def build_config(args: argparse.Namespace, trace: Trace) -> SimulationConfig:
    profile = load_profile(args.profile) if args.profile is not None else None
    if profile is None:
        model = load_model(args.model or "deepseek-v3")
    else:
        model = profile.model
        if args.model and load_model(args.model).name != model.name:
            raise SimulationError(
                f"--model {args.model} and --profile {args.profile}: the profile measured "
                f"{model.name}; calibrate a replica of {args.model} instead"
            )
    if args.kv_dtype:
        model = model.replace(kv_dtype=canonical_dtype(args.kv_dtype))
    if args.mtp:
        if not model.mtp_layers:
            raise SimulationError(f"{model.name} has no MTP layers (--mtp)")
        model = model.replace(use_mtp=True)
    if args.draft:
        model = model.replace(draft=load_model(args.draft))
    hardware = _hardware(args)
    if profile is not None:
        gpus = args.gpus_per_instance or 1  # the profile measured one replica
        hardware = hardware.replace(  # the measured rate holds the copies' latency
            host_link_bytes_per_s=profile.l2_load_bytes_per_s / gpus, host_link_latency_s=0.0
        )
    else:
        gpus = args.gpus_per_instance or default_gpus_per_instance(model, hardware)
    l1 = _capacity(args, "l1") if args.l1 else default_l1_bytes(model, hardware, gpus)
    if not args.l1 and l1 <= 0:
        raise SimulationError(
            f"--gpus-per-instance {gpus}: {model.name}'s weights ({model.weight_bytes / 1e9:,.0f}"
            f" GB) leave no HBM for KV on {gpus} x {hardware.name.upper()} "
            f"({hardware.hbm_bytes / 1e9:,.0f} GB each); give more GPUs or --l1"
        )
    l2 = _capacity(args, "l2") if args.l2 else default_l2_bytes(hardware, gpus)
    policy = PolicyConfig(
        write_policy=args.write_policy,
        write_through_threshold=args.write_through_threshold,
        prefetch_policy=args.prefetch_policy,
        prefetch_timeout_base_s=args.prefetch_timeout_base_ms / 1e3,
        prefetch_timeout_per_1k_tokens_s=args.prefetch_timeout_per_1k_ms / 1e3,
        eviction_policy=args.eviction_policy,
    )
    prices = Prices(
        gpu_hour=args.gpu_hour_price
        if args.gpu_hour_price is not None
        else hardware.gpu_hour_price,
        l1_per_gb_month=args.price_l1,
        **{
            f"{t}_per_gb_month": getattr(args, f"price_{t}")
            for t in ("l2", "l3")
            if getattr(args, f"price_{t}") is not None
        },
    )
    return SimulationConfig(
        model=model,
        hardware=hardware,
        page_size=args.page_size or (profile.page_size if profile else trace.block_size or 64),
        gpus_per_instance=gpus,
        l1_bytes=l1,
        l2_bytes=l2,
        l3_bytes=_capacity(args, "l3"),
        num_instances=args.instances,
        l3_shared=not args.l3_local,
        l3_bandwidth_bytes_per_s=_l3_bandwidth(args, profile),
        l3_aggregate_bytes_per_s=(
            args.l3_aggregate_bandwidth * 1e9 if args.l3_aggregate_bandwidth else None
        ),
        l3_latency_s=_l3_latency(args, profile),
        l3_write_policy=args.l3_write_policy,
        policy=policy,
        routing=args.routing,
        mfu=args.mfu if args.mfu is not None else _DEFAULT["mfu"].default,
        prices=prices,
        profile=profile,
        engine_requests=args.engine_requests,
        shared_device=args.shared_device,
    )


def _l3_bandwidth(args: argparse.Namespace, profile) -> float | None:
    """Bytes/s per instance to L3: the flag, else the store preset's, else the profile's
    measured read rate, else None (the NICs)."""
    if args.l3_bandwidth:
        return args.l3_bandwidth * 1e9
    if args.l3_store:
        return STORE_PRESETS[args.l3_store].bandwidth_bytes_per_s
    return profile.l3_read_bytes_per_s if profile else None


def _l3_latency(args: argparse.Namespace, profile) -> float:
    if args.l3_latency_us is not None:
        return args.l3_latency_us / 1e6
    if args.l3_store:
        return STORE_PRESETS[args.l3_store].latency_s
    if profile is not None:
        return profile.l3_latency_s
    return _DEFAULT["l3_latency_s"].default


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


def _hardware(args: argparse.Namespace):
    hardware = load_hardware(args.hardware)
    changes = {}
    for name, scale in (
        ("hbm_bytes", 1e9),
        ("host_bytes", 1e9),
        ("host_link_bytes_per_s", 1e9),
        ("nic_bytes_per_s", 1e9),
    ):
        value = getattr(args, f"hw_{name}")
        if value is not None:
            changes[name] = value * scale
    if args.hw_flops is not None:
        changes["bf16_flops"] = changes["fp8_flops"] = args.hw_flops * 1e12
    if args.gpu_hour_price is not None:
        changes["gpu_hour_price"] = args.gpu_hour_price
    return hardware.replace(**changes) if changes else hardware
