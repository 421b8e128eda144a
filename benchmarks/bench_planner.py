"""The planner checked: `hicache simulate`'s predictions against a measured serving run.

1. Runs `benchmarks/bench_serving.py` (every flag not named below goes to it), which replays
   a trace against N `hicache engine serve` replicas behind `hicache route`, once per
   cache configuration, and writes one JSON line per configuration (or reads such lines
   from `--serving-json` instead of running it).
2. Calibrates: starts one replica of the same model, device, dtype, page size and pools,
   sends it the calibration's warm-up prompts and reads its profile (`hicache simulate
   --calibrate`; or takes `--profile FILE`).
3. For each configuration, plays the same requests (the very token ids bench_serving sent,
   at the same arrival times and output lengths) through the simulator with the same
   replica count, routing, L1/L2 pages, L3 capacity, cache policies and the profile, as
   the engine runs requests (`SimulationConfig.engine_requests`).
4. Prints predicted / measured per configuration: hit tokens per tier (goal: within 2 % of
   the measured figure; a tier that served less than 5 % of the prompt tokens is held to
   2 % of that 5 %, so that a handful of tokens is not a 100 % miss) and TTFT p50 / p90
   (goal: within 15 %), met or MISSED per figure, and one JSON line per configuration.
   Exits 1 when any figure missed.

What the simulator leaves out, and so where a TTFT can miss (the note in
docs/performance.md): several prefills sharing one engine step (it runs one prefill at a
time per replica, each decode step it models one row); the router's hop (the request
overhead is measured at a replica); the GIL between a replica's HTTP thread and its engine
thread; on a CPU, the replicas, router and client contending for cores. It models a
request's decode steps (holding its pages, its pages cached when its answer ends), a
prefill waiting for the decode step running, and replicas on one GPU taking turns.

    python benchmarks/bench_planner.py --trace conversations:sessions=12,system_prompts=2,\\
        system_tokens=300,turns=3,user_tokens=120,output_tokens=8,think_s=3,rate=1 \\
        --block-tokens 16 --page-size 16 --max-output-tokens 8 --threads 1 \\
        --configs off,l1,l1l2,l1l2l3-file                    # the tiny model on the CPU
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import bench_serving  # noqa: E402
from benchmarks.common import emit, git_revision  # noqa: E402
from benchmarks.serving_deployment import Setup, model_flags, replica_flags  # noqa: E402
from engine_integration.serve.replica_config import fetch_policies  # noqa: E402
from hicache.config import PolicyConfig  # noqa: E402
from hicache.simulate import TracePlayer  # noqa: E402
from hicache.simulate.calibrate import WARMUP_LENGTHS, calibrate  # noqa: E402
from hicache.simulate.config import SimulationConfig  # noqa: E402
from hicache.simulate.hardware import PRESETS as HARDWARE  # noqa: E402
from hicache.simulate.profile import HardwareProfile, load_profile  # noqa: E402
from hicache.simulate.trace import Request, Trace, load_trace  # noqa: E402
from storage_backends.options import parse_size  # noqa: E402

HIT_GOAL = 0.02  # hit tokens per tier: relative error
HIT_FLOOR = 0.05  # ... of at least this share of the prompt tokens
TTFT_GOAL = 0.15  # TTFT p50 and p90: relative error
TIERS = ("l1", "l2", "l3")
# Keys of a bench_serving line that must equal this run's flags (its --serving-json).
_SAME = ("replicas", "routing", "page_size", "l1_pages", "rate_scale", "block_tokens")


def parse_args(argv=None) -> tuple[argparse.Namespace, argparse.Namespace, list[str]]:
    """(this script's flags, bench_serving's, the flags passed on to bench_serving)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], add_help=False)
    a = p.add_argument
    a("--serving-json", type=Path, help="bench_serving's JSON lines (default: run it now)")
    a("--profile", type=Path, help="a hardware profile (default: calibrate a replica now)")
    a("--calibrate-rounds", type=int, default=3, help="warm-up prompts of each length")
    a(
        "--calibrate-no-l3",
        action="store_true",
        help="leave the profile's L3 rate at the prior unless the warm-up reads L3 itself",
    )
    a("--planner-json-out", type=Path, help="also write this script's JSON lines here")
    a("--serving-json-out", type=Path, help="keep bench_serving's JSON lines here")
    a("--profile-out", type=Path, help="keep the calibrated profile here")
    ours, rest = p.parse_known_args(argv)
    if "-h" in rest or "--help" in rest:
        p.print_help()
        print("\nevery other flag is bench_serving.py's:")
    serving = bench_serving.parse_args(rest)
    return ours, serving, rest


# ---------------------------------------------------------------------------- the three runs


def measure(ours, rest: list[str], workdir: Path) -> list[dict]:
    """bench_serving's lines: from --serving-json, or from running it now."""
    path = ours.serving_json
    if path is None:
        path = ours.serving_json_out or workdir / "serving.jsonl"
        code = bench_serving.main([*rest, "--json-out", str(path)])
        if code != 0 and not path.exists():
            raise SystemExit(f"bench_planner: bench_serving failed (exit {code})")
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (OSError, json.JSONDecodeError) as error:
        raise SystemExit(f"bench_planner: --serving-json {path}: {error}") from None


def calibrate_replica(serving, rounds: int, *, through_l3: bool = True) -> HardwareProfile:
    """A profile of a fresh replica of bench_serving's model, device, dtype, page size,
    engine and pools, over a file:// L3 (calibration pushes its prompts through to it and
    measures its read rate). Its L1 holds at least one of the longest single-chunk warm-up
    prompts and L2 two: the served replicas' pools may be smaller, and pool sizes change no
    step's cost. An L1 that holds several chunks' prompt gets those too (`warmup_lengths`),
    which tell a pair's cost from a row's."""
    from tests.support.replicas import HttpProcess

    pages = -(-max(WARMUP_LENGTHS) // serving.page_size) + 2
    l1_pages, l2_pages = max(serving.l1_pages, pages), max(serving.l2_pages, 2 * pages)
    with tempfile.TemporaryDirectory(prefix="hicache-bench-planner-") as workdir:
        setup = Setup(
            tuple(model_flags(serving.model, Path(workdir))), serving.device,
            serving.dtype, 1, serving.routing, serving.page_size, serving.max_running,
            l1_pages, l2_pages, serving.l3_capacity, serving.threads, serving.seed,
        )  # fmt: skip
        l3_url = f"file://{workdir}/l3?capacity={serving.l3_capacity}"
        flags = replica_flags(setup, "l1l2l3-file", l3_url)
        process = HttpProcess("engine", "serve", "--port", "0", "--name", "calibration", *flags)
        process.start(timeout_s=900)
        try:
            return calibrate(process.url, rounds=rounds, through_l3=through_l3)
        finally:
            process.stop()


def simulated_trace(serving, vocab_size: int) -> Trace:
    """The requests bench_serving sent (its `build_work`: same ids, arrivals, outputs)."""
    trace = load_trace(serving.trace, serving.requests)
    work = bench_serving.build_work(trace, serving, vocab_size)
    requests = [
        Request(arrival_s=arrival_s, input_length=len(ids), output_length=max_tokens,
                stream=np.asarray(ids, dtype=np.uint32))
        for arrival_s, ids, max_tokens in work
    ]  # fmt: skip
    return Trace(trace.name, requests)


def simulation_config(row: dict, profile: HardwareProfile, serving) -> SimulationConfig:
    """The simulator set up as the row's deployment was, costs from the profile."""
    page_bytes = profile.page_bytes
    cache_on = row["config"] != "off"
    l3_bytes = float(parse_size(serving.l3_capacity, name="--l3-capacity")) if row["l3_url"] else 0
    hardware = HARDWARE["h200"].replace(  # prices and sizes only; the links are measured
        host_link_bytes_per_s=profile.l2_load_bytes_per_s, host_link_latency_s=0.0
    )
    return SimulationConfig(
        model=profile.model,
        hardware=hardware,
        page_size=profile.page_size,
        gpus_per_instance=1,
        l1_bytes=row["l1_pages"] * page_bytes if cache_on else 0,
        l2_bytes=row["l2_pages"] * page_bytes,
        l3_bytes=l3_bytes,
        num_instances=row["replicas"],
        l3_bandwidth_bytes_per_s=profile.l3_read_bytes_per_s,
        l3_latency_s=profile.l3_latency_s,
        # the replicas' policies (engine_integration/serve/replica.py)
        policy=PolicyConfig(
            write_policy="write_through", **fetch_policies("both", row.get("l3_fetch"))
        ),
        routing=row["routing"],
        profile=profile,
        engine_requests=True,
        # bench_serving starts every replica on the same --device: on a GPU they share it
        # (on the CPU each replica has its own --threads, on cores of their own if the box
        # has them)
        shared_device=serving.device.startswith("cuda"),
        engine_pool_pages=None if cache_on else row["l1_pages"],  # `off`'s private pages
    )


def predict(row: dict, profile: HardwareProfile, trace: Trace, serving) -> dict:
    player = TracePlayer(simulation_config(row, profile, serving), trace)
    player.run()
    stats = player.request_stats
    hit = stats.hit_pages.sum(axis=0) * profile.page_size
    lengths = np.array([r.input_length for r in trace.requests])
    ttft_ms = (stats.end_s - stats.arrival_s) * 1000
    return {
        "hit_tokens": {
            **{tier: int(v) for tier, v in zip(TIERS, hit, strict=True)},
            "computed": int(lengths.sum() - hit.sum()),
        },
        "ttft_ms": {f"p{p}": round(float(np.percentile(ttft_ms, p)), 2) for p in (50, 90, 99)},
    }


# ---------------------------------------------------------------------------- the check


def check(predicted: dict, measured: dict) -> list[dict]:
    """One entry per figure: predicted, measured, relative error, met."""
    figures = []
    floor = HIT_FLOOR * max(1, measured["prompt_tokens"])
    for tier in TIERS:
        p, m = predicted["hit_tokens"][tier], measured["hit_tokens"][tier]
        scale = max(m, floor)
        figures.append(_figure(f"hit tokens {tier.upper()}", p, m, abs(p - m) / scale, HIT_GOAL))
    for point in ("p50", "p90"):
        p, m = predicted["ttft_ms"][point], measured["ttft_ms"][point]
        error = abs(p - m) / m if m else float("inf")
        figures.append(_figure(f"TTFT {point} ms", p, m, error, TTFT_GOAL))
    return figures


def _figure(name: str, predicted, measured, error: float, goal: float) -> dict:
    return {
        "figure": name,
        "predicted": predicted,
        "measured": measured,
        "error": round(error, 4),
        "goal": goal,
        "met": bool(error <= goal),
        "verdict": "met" if error <= goal else "MISSED",
    }


def check_same_run(rows: list[dict], serving) -> None:
    """A --serving-json line must describe the run these flags describe."""
    for row in rows:
        for key in _SAME:
            if row.get(key) != getattr(serving, key):
                raise SystemExit(
                    f"bench_planner: --serving-json: {row['config']} ran with {key}="
                    f"{row.get(key)!r}, these flags say {getattr(serving, key)!r}"
                )


def print_table(results: list[dict]) -> None:
    print(f"\n{'config':<14} {'figure':<16} {'predicted':>11} {'measured':>11} {'error':>8}  "
          f"{'goal':>5}")  # fmt: skip
    for result in results:
        for f in result["figures"]:
            print(
                f"{result['config']:<14} {f['figure']:<16} {f['predicted']:>11,} "
                f"{f['measured']:>11,} {100 * f['error']:>7.1f}%  {100 * f['goal']:>4.0f}%  "
                f"{f['verdict']}"
            )


def main(argv=None) -> int:
    ours, serving, rest = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="hicache-bench-planner-") as tmp:
        rows = measure(ours, rest, Path(tmp))
    if ours.serving_json is not None:
        check_same_run(rows, serving)
    if ours.profile is not None:
        profile = load_profile(ours.profile)
    else:
        profile = calibrate_replica(
            serving, ours.calibrate_rounds, through_l3=not ours.calibrate_no_l3
        )
        if ours.profile_out is not None:
            profile.write(ours.profile_out)
    print(f"\nbench_planner: profile of {profile.model.name} on {profile.device} "
          f"({profile.dtype}): step {profile.compute.per_step_s * 1e3:.3f} ms + "
          f"{profile.compute.per_row_s * 1e6:.3f} us/row + "
          f"{profile.compute.per_pair_s * 1e9:.4f} ns/pair", flush=True)  # fmt: skip
    trace = simulated_trace(serving, profile.model.vocab_size)
    with concurrent.futures.ProcessPoolExecutor(min(len(rows), os.cpu_count() or 1)) as pool:
        futures = [pool.submit(predict, row, profile, trace, serving) for row in rows]
        predictions = [future.result() for future in futures]
    results = []
    for row, predicted in zip(rows, predictions, strict=True):
        figures = check(predicted, row)
        results.append({
            "bench": "planner",
            "config": row["config"],
            "model_id": row.get("model_id"),
            "device": profile.device,
            "replicas": row["replicas"],
            "routing": row["routing"],
            "trace": row["trace"],
            "requests": row["requests"],
            "answered": row["answered"],
            "predicted": predicted,
            "measured": {"hit_tokens": row["hit_tokens"], "ttft_ms": row["ttft_ms"]},
            "figures": figures,
            "met_target": all(f["met"] for f in figures),
        })  # fmt: skip
    print_table(results)
    for result in results:
        emit(result)
    if ours.planner_json_out:
        revision = git_revision()
        lines = [json.dumps({"git": revision, **r}) + "\n" for r in results]
        ours.planner_json_out.write_text("".join(lines))
    missed = [
        f"{r['config']}: {f['figure']}" for r in results for f in r["figures"] if not f["met"]
    ]
    print(f"planner: {len(missed)} of {sum(len(r['figures']) for r in results)} figures missed "
          f"their goal" + (f" ({'; '.join(missed)})" if missed else ""), flush=True)  # fmt: skip
    return 1 if missed else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
