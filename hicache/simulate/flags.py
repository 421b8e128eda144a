"""`hicache simulate`'s flags: what the parser accepts, with its defaults and help.

Defaults come from the dataclasses they configure (`PolicyConfig`, `L3Config`,
`SimulationConfig`, the model and hardware presets), so the CLI never disagrees with the
library. Sizes are GB unless a unit is given ("512", "1.5TB", "800GiB"). flag_config.py
checks the parsed flags and turns them into a `SimulationConfig`; cli.py runs it.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from hicache.config import (
    EVICTION_POLICIES,
    L3_WRITE_POLICIES,
    PREFETCH_POLICIES,
    WRITE_POLICIES,
    L3Config,
    PolicyConfig,
)
from hicache.simulate.calibrate import WAIT_S
from hicache.simulate.config import ROUTING, SimulationConfig
from hicache.simulate.hardware import PRESETS as HARDWARE_PRESETS
from hicache.simulate.l3 import STORE_PRESETS
from hicache.simulate.model_presets import PRESETS as MODEL_PRESETS
from hicache.simulate.trace import CONVERSATIONS

_POLICY = PolicyConfig()
SWEEP_OUT = Path("hicache-sweep")  # where a sweep writes without --out
_L3 = L3Config()
_DEFAULT = SimulationConfig.__dataclass_fields__


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a flag's default unless it has none or its help already says it."""

    def _get_help_string(self, action):
        if action.default in (None, False) or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


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
        f"{SWEEP_OUT}); the file --calibrate writes",
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
