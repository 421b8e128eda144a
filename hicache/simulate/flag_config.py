"""From parsed flags (flags.py) to a `SimulationConfig`: what the flags alone can get wrong,
named by flag, then the config they ask for (cli.py runs it).
"""

from __future__ import annotations

import argparse

from hicache.config import PolicyConfig
from hicache.simulate.config import (
    Prices,
    SimulationConfig,
    default_gpus_per_instance,
    default_l1_bytes,
    default_l2_bytes,
)
from hicache.simulate.errors import SimulationError
from hicache.simulate.hardware import load_hardware
from hicache.simulate.l3 import STORE_PRESETS
from hicache.simulate.model_presets import load_model
from hicache.simulate.models import canonical_dtype
from hicache.simulate.profile import load_profile
from hicache.simulate.sweep import parse_capacity
from hicache.simulate.trace import Trace

_DEFAULT = SimulationConfig.__dataclass_fields__


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
