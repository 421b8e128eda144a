"""Serving under load: a trace replayed open loop against `hicache route` over N `hicache
engine serve` replicas, once per cache configuration, on the same trace and machine.

Configurations (`CONFIGS`), each with fresh replicas, router and L3, and the cache's
load-or-recompute choice on (`--l3-fetch measured`, the default; `always` reads every run L3
holds, the same choice whatever a replica measures):

    off             no cache at all (`--no-cache`): every prompt computed whole; the baseline
    l1              L1 only
    l1l2            L1 and an L2 host pool per replica
    l1l2l3-file     ... and a file:// L3 directory the replicas share
    l1l2l3-daemon   ... and a `hicache serve` daemon the replicas share (grpc://)

The trace (`--trace`): a Mooncake JSONL file or the bundled `mooncake`, whose `hash_ids`
become prompts of `--block-tokens` deterministic token ids per id (`block_tokens`), so
equal ids are equal tokens and shared prefixes are real shared tokens; or the simulator's
conversation generator (`conversations:sessions=8,...`), whose token streams are used as
they are (modulo the vocabulary). A block is `--block-tokens` tokens here, not 512: the
simulator plays the same sharing at a page size of `page_size * 512 / block_tokens` (the
last, cut blocks' pages rounded alike). Requests are sent at the trace's arrival times divided by
`--rate-scale` (2: twice the request rate), whatever is still in flight (open loop), each
streamed on its own connection, `max_tokens` = the trace's output length (at most
`--max-output-tokens`), EOS ignored, greedy.

Per request, at the client: TTFT (send to the first token's chunk), time per output token
(first to last token over the tokens between), and from the replica's last chunk (its
`hicache` object) the prompt tokens served from L1, L2, L3 and computed. Per configuration:
output throughput, TTFT p50/p90/p99, TPOT p50, goodput (requests per second whose TTFT met
`--ttft-target-ms`), and each TTFT percentile's ratio to `off`'s (the baseline).

Prints a table and one JSON line per configuration (also appended to `--json-out`); its
keys are an interface (`benchmarks/bench_planner.py` compares them with the simulator's
predictions): config, model, replicas, routing, trace, rate_scale, requests, l1_pages,
l2_pages, l3_url, l3_fetch, page_size, block_tokens, hit_tokens {l1, l2, l3, computed},
ttft_ms {p50, p90, p99}, tpot_ms {p50}, throughput_tok_s, goodput, ttft_target_ms, ...

    python benchmarks/bench_serving.py --requests 40 --block-tokens 16 --page-size 16 \\
        --max-output-tokens 16                                # the tiny model on the CPU
    python benchmarks/bench_serving.py --model PATH --device cuda --requests 400 \\
        --rate-scale 2 --configs off,l1,l1l2,l1l2l3-file      # a real model on a GPU
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import device_name, emit  # noqa: E402
from benchmarks.serving_client import MOONCAKE_BLOCK, prompt_ids, replay, summarize  # noqa: E402
from benchmarks.serving_deployment import Deployment, Setup, model_flags  # noqa: E402
from engine_integration.serve.replica_config import L3_FETCHES  # noqa: E402
from hicache.routing import POLICIES  # noqa: E402
from hicache.simulate.trace import Trace, load_trace  # noqa: E402

CONFIGS = ("off", "l1", "l1l2", "l1l2l3-file", "l1l2l3-daemon")
BASELINE = "off"


# ---------------------------------------------------------------------------- the run


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    a = p.add_argument
    a("--model", default=None, help="smollm2, gemma3 (their packages), a .gguf file or HF "
      "directory, or a synthetic model of bench_engine's: 1b, 8b, tiny-full (default: the "
      "tiny model)")  # fmt: skip
    a("--device", default="cpu", help="'cpu' or 'cuda[:N]' (default: %(default)s)")
    a("--dtype", default=None, choices=("float32", "bfloat16", "float16"))
    a("--replicas", type=int, default=2)
    a("--routing", default="prefix", choices=POLICIES)
    a("--trace", default="mooncake", help="a Mooncake JSONL file, 'mooncake' (bundled), or "
      "'conversations[:k=v,...]' (default: %(default)s)")  # fmt: skip
    a("--requests", type=int, default=None, help="the trace's first N requests (default: all)")
    a("--rate-scale", type=float, default=1.0, help="arrival rate x this (default: %(default)s)")
    a("--block-tokens", type=int, default=MOONCAKE_BLOCK,
      help="prompt tokens per Mooncake hash id (default: %(default)s; less on a CPU)")  # fmt: skip
    a("--max-output-tokens", type=int, default=None, help="cap on each request's output")
    a("--page-size", type=int, default=64)
    a("--max-running", type=int, default=8, help="requests each replica's engine runs at once")
    a("--l1-pages", type=int, default=512, help="each replica's L1 (and `off`'s KV) pages")
    a("--l2-pages", type=int, default=2048, help="each replica's L2 pages (l1l2*)")
    a("--l3-capacity", default="4GiB", help="the shared L3's capacity (l1l2l3-*)")
    a("--l3-fetch", default="measured", choices=L3_FETCHES,
      help="the replicas' --l3-fetch: measured (load or recompute, by what each measures) "
      "or always (every run L3 holds, whole)")  # fmt: skip
    a("--threads", type=int, default=0, help="torch CPU threads per replica (0: default)")
    a("--seed", type=int, default=0, help="the tiny model's weights")
    a("--ttft-target-ms", type=float, default=1000.0, help="goodput's TTFT target")
    a("--configs", default=",".join(CONFIGS), help=f"some of {','.join(CONFIGS)}")
    a("--json-out", default=None, help="also write the JSON lines to this file")
    args = p.parse_args(argv)
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in args.configs if c not in CONFIGS]
    checks = [
        (not unknown, f"--configs: unknown {', '.join(unknown)}; choose from {', '.join(CONFIGS)}"),
        (args.configs, "--configs: give at least one"),
        (args.replicas >= 1, "--replicas must be >= 1"),
        (args.rate_scale > 0, "--rate-scale must be > 0"),
        (args.block_tokens >= 1, "--block-tokens must be >= 1"),
        (args.requests is None or args.requests >= 1, "--requests must be >= 1"),
        (args.max_output_tokens is None or args.max_output_tokens >= 1,
         "--max-output-tokens must be >= 1"),
        (args.ttft_target_ms > 0, "--ttft-target-ms must be > 0"),
    ]  # fmt: skip
    for ok, message in checks:
        if not ok:
            p.error(message)
    return args


def build_work(trace: Trace, args, vocab_size: int) -> list[tuple[float, list[int], int]]:
    """(arrival_s, prompt ids, max_tokens) per request, arrivals from 0 at the scaled rate."""
    t0 = trace.requests[0].arrival_s
    work = []
    for request in trace.requests:
        ids = prompt_ids(request, args.block_tokens, vocab_size)
        max_tokens = max(1, request.output_length)
        if args.max_output_tokens:
            max_tokens = min(max_tokens, args.max_output_tokens)
        work.append(((request.arrival_s - t0) / args.rate_scale, ids, max_tokens))
    longest = max(len(ids) + n for _, ids, n in work)
    if longest > args.l1_pages * args.page_size:
        raise SystemExit(
            f"bench_serving: error: --l1-pages {args.l1_pages} x --page-size {args.page_size} "
            f"holds {args.l1_pages * args.page_size} tokens, the longest request needs "
            f"{longest}: raise --l1-pages, or cut --block-tokens / --max-output-tokens"
        )
    return work


def run_config(setup: Setup, config: str, trace: Trace, args, work_cache: dict) -> dict:
    deployment = Deployment(setup, config)
    try:
        info = deployment.info()
        vocab = int(info["vocab_size"])
        if vocab not in work_cache:
            work_cache[vocab] = build_work(trace, args, vocab)
        outcomes = asyncio.run(replay(deployment.router.url, work_cache[vocab]))
        result = summarize(outcomes, args.ttft_target_ms)
        l3_url = deployment.l3_url
    finally:
        deployment.stop()
    cache_on = config != "off"
    return {
        "bench": "serving",
        "config": config,
        "model": args.model or "tiny",
        "model_id": info["model"],
        "device": device_name("cpu") if args.device == "cpu" else args.device,
        "dtype": info.get("dtype"),
        "replicas": args.replicas,
        "routing": args.routing,
        "trace": trace.name,
        "block_tokens": args.block_tokens,
        "rate_scale": args.rate_scale,
        "max_output_tokens": args.max_output_tokens,
        "max_running": args.max_running,
        "l1_pages": args.l1_pages,
        "l2_pages": args.l2_pages if cache_on and config != "l1" else 0,
        "l3_url": l3_url,
        "l3_capacity": args.l3_capacity if l3_url else None,
        "l3_fetch": args.l3_fetch if l3_url else None,
        "page_size": args.page_size,
        "ttft_target_ms": args.ttft_target_ms,
        **result,
    }


def add_ratios(rows: list[dict]) -> None:
    """Each row's TTFT speed-up over the baseline's (`off`: its p50 / this p50, > 1 faster)."""
    base = next((r for r in rows if r["config"] == BASELINE), None)
    for row in rows:
        row["ttft_speedup_vs_off"] = None
        if base is None:
            continue
        row["ttft_speedup_vs_off"] = {
            p: round(base["ttft_ms"][p] / row["ttft_ms"][p], 3)
            if base["ttft_ms"][p] and row["ttft_ms"][p]
            else None
            for p in ("p50", "p90", "p99")
        }


def print_table(rows: list[dict]) -> None:
    print(f"\n{'config':<14} {'done':>5} {'hit L1/L2/L3 %':>16} {'TTFT p50':>9} {'p90':>9} "
          f"{'p99':>9} {'vs off':>7} {'TPOT p50':>9} {'out tok/s':>10} {'goodput':>8}")  # fmt: skip
    for row in rows:
        prompt = max(1, row["prompt_tokens"])
        hit = row["hit_tokens"]
        tiers = "/".join(f"{100 * hit[t] / prompt:.0f}" for t in ("l1", "l2", "l3"))
        ttft, tpot = row["ttft_ms"], row["tpot_ms"]
        speedup = (row.get("ttft_speedup_vs_off") or {}).get("p50")
        print(
            f"{row['config']:<14} {row['answered']:>5} {tiers:>16} {_ms(ttft['p50']):>9} "
            f"{_ms(ttft['p90']):>9} {_ms(ttft['p99']):>9} "
            f"{(f'{speedup:.2f}x' if speedup else '-'):>7} {_ms(tpot['p50']):>9} "
            f"{row['throughput_tok_s'] or 0:>10.1f} {row['goodput'] or 0:>8.2f}"
        )


def _ms(value) -> str:
    return "-" if value is None else f"{value:.1f}ms"


def main(argv=None) -> int:
    args = parse_args(argv)
    trace = load_trace(args.trace, args.requests)
    with tempfile.TemporaryDirectory(prefix="hicache-bench-serving-") as workdir:
        flags = tuple(model_flags(args.model, Path(workdir)))
        setup = Setup(flags, args.device, args.dtype, args.replicas, args.routing,
                      args.page_size, args.max_running, args.l1_pages, args.l2_pages,
                      args.l3_capacity, args.threads, args.seed, args.l3_fetch)  # fmt: skip
        print(f"bench_serving: {trace.num_requests} requests of {trace.name} over "
              f"{trace.duration_s / args.rate_scale:.1f} s, {args.replicas} replicas, "
              f"{args.routing} routing; configurations: {', '.join(args.configs)}",
              flush=True)  # fmt: skip
        rows, work_cache = [], {}
        for config in args.configs:
            started = time.perf_counter()
            rows.append(run_config(setup, config, trace, args, work_cache))
            print(f"  {config}: {rows[-1]['answered']}/{rows[-1]['requests']} answered "
                  f"({time.perf_counter() - started:.0f} s with start-up)", flush=True)  # fmt: skip
    add_ratios(rows)
    print_table(rows)
    for row in rows:
        emit(row)
    if args.json_out:
        from benchmarks.common import git_revision

        revision = git_revision()
        lines = [json.dumps({"git": revision, **row}) for row in rows]
        Path(args.json_out).write_text("".join(line + "\n" for line in lines))
    return 0 if all(row["failed"] == 0 for row in rows) else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
