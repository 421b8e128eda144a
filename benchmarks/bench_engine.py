"""Benchmark: the embedded engine's time to first token, cold versus a prefix hit served
from L1, from L2 and from L3 (file:// on local disk), on a ~1B-parameter hybrid model.

Claim (issue 6): a hit turns a long prefill into an encoder replay of the last
K * (W - 1) + 1 positions (K stacked window layers) plus the uncached suffix; from L2 the
KV arrives layer by layer over the host link while earlier layers compute, and the load runs
near the link's ceiling.

The model (random weights, bf16): 16 layers, hidden 2048, 32 query heads and 8 KV heads of
64, MLP 8192, vocabulary 32000 (1.1B parameters). The first 12 layers are source layers
(full attention, KV cached); the last 4 use a 128-token sliding window (rebuilt by replay):
a quarter of the layers on a window is a common hybrid ratio, and the cache then holds
the 12 layers that replay could not rebuild cheaply.

For each prompt length: TTFT cold (cache off); then, with the cache on, the same prompt
again: a hit of every full page but the last (the last prompt token needs its logits), so
replay of the positions [L - 509, H) (4 window layers of 128: 4 * 127 + 1 rows reach the
last one) plus 64 new tokens. From L1; from L2 after evicting L1; from L3 after a
restart (a new cache over the same directory: empty L1 and L2). Medians of `--repeats`
after a warm-up. For the L2 hit: the KV bytes over the load's own time (one load of as
many pages, synchronised wall time) against the link ceiling (one contiguous pinned copy
of the same bytes, same run), and how much of the load hides behind compute:
hidden = (TTFT_L1 + load - TTFT_L2) / load. L3 reads come from files the run has just
written, so from the OS page cache: a warm local disk.

    python benchmarks/bench_engine.py                      # the H200 run (CUDA)
    python benchmarks/bench_engine.py --smoke              # tiny model on the CPU
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.common import device_name, emit  # noqa: E402
from engine_integration.config import EngineConfig, ModelConfig, tiny_model_config  # noqa: E402
from engine_integration.embedded import CacheSizes, build_cache, load_model  # noqa: E402
from engine_integration.engine import Engine  # noqa: E402
from engine_integration.sampling import SamplingParams  # noqa: E402
from hicache.config import PolicyConfig  # noqa: E402

MODEL_1B = ModelConfig(
    vocab_size=32000,
    hidden_size=2048,
    intermediate_size=8192,
    num_layers=16,
    num_heads=32,
    num_kv_heads=8,
    head_dim=64,
    num_source_layers=12,
    window_tokens=128,
    rope_theta=500000.0,
    model_id="bench-1b-seed0",
)
POLICY = PolicyConfig(write_policy="write_through", prefetch_policy="wait_complete")
ONE_TOKEN = SamplingParams(max_new_tokens=1)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="4096,16384,32768", help="prompt lengths")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--chunk", type=int, default=8192, help="prefill tokens per step")
    parser.add_argument("--l3-dir", default=None, help="L3 directory (default: a temp dir)")
    parser.add_argument("--smoke", action="store_true", help="tiny model, CPU, short prompts")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.smoke:
        args.lengths = "256,512"
        args.repeats = 2
    args.lengths = [int(n) for n in args.lengths.split(",")]
    return args


def main() -> None:
    args = parse_args()
    device = "cpu" if args.smoke or not torch.cuda.is_available() else "cuda"
    config = EngineConfig(device=device, page_size=64, prefill_chunk_tokens=args.chunk)
    model_config = tiny_model_config(args.seed) if args.smoke else MODEL_1B
    model, _ = load_model(None, config, seed=args.seed, model_config=model_config)
    longest = max(args.lengths)
    page_bytes = _page_bytes(model, config.page_size)
    l1_pages = 2 * (-(-longest // config.page_size)) + 64
    l2_pages = sum(-(-n // config.page_size) for n in args.lengths) + 64
    meta = {
        "bench": "engine",
        "device": device_name(device),
        "model": model_config.model_id,
        "parameters": model_config.num_parameters,
        "source_layers": model_config.num_source_layers,
        "late_layers": model_config.num_late_layers,
        "window_tokens": model_config.window_tokens,
        "dtype": str(model.dtype).removeprefix("torch."),
        "page_size": config.page_size,
        "prefill_chunk_tokens": args.chunk,
        "repeats": args.repeats,
    }
    with tempfile.TemporaryDirectory(dir=args.l3_dir) as l3_dir:
        url = f"file://{l3_dir}?capacity={4 * l2_pages * page_bytes}"
        sizes = CacheSizes(l1_pages, l2_pages, url, POLICY)
        _warm_up(model, config, sizes)
        rows = []
        rng = random.Random(args.seed)
        for length in args.lengths:
            prompt = [rng.randrange(model_config.vocab_size) for _ in range(length)]
            rows.append(_measure(model, config, sizes, prompt, args.repeats, meta))
    _print_table(rows)


def _page_bytes(model, page_size: int) -> int:
    from engine_integration.engine import kv_layout_for

    return kv_layout_for(model, page_size).bytes_per_page


def _warm_up(model, config: EngineConfig, sizes: CacheSizes) -> None:
    cache = build_cache(model, config, sizes)
    try:
        engine = Engine(model, config, cache=cache)
        for _ in range(2):
            _ttft(engine, [i % model.config.vocab_size for i in range(1000)])
    finally:
        cache.close()


def _ttft(engine: Engine, prompt: list[int]):
    _sync(engine)
    request = engine.add_request(prompt, ONE_TOKEN)
    (output,) = engine.run()
    assert output.request_id == request.request_id
    return output.metrics


def _sync(engine: Engine) -> None:
    if engine.config.on_cuda:
        torch.cuda.synchronize()


def _median_ms(values) -> float:
    return statistics.median(values) * 1e3


def _measure(model, config, sizes, prompt, repeats, meta) -> dict:
    length = len(prompt)
    off = Engine(model, config, num_private_pages=sizes.l1_pages)
    _ttft(off, prompt)  # warm-up at this length
    cold = [_ttft(off, prompt) for _ in range(repeats)]
    del off
    cache = build_cache(model, config, sizes)
    engine = Engine(model, config, cache=cache)
    _ttft(engine, prompt)  # fills L1, backs up to L2 and L3
    cache.flush()
    from_l1 = [_ttft(engine, prompt) for _ in range(repeats)]
    from_l2 = []
    for _ in range(repeats):
        cache.evict("l1", sizes.l1_pages)
        from_l2.append(_ttft(engine, prompt))
    hit_pages = from_l2[0].hit_tokens["l2"] // config.page_size
    load_s, ceiling_s, load_bytes = _load_rates(cache, hit_pages)
    cache.flush()
    cache.close()
    from_l3, l3_reads = [], []
    for _ in range(repeats):
        cache = build_cache(model, config, sizes)
        try:
            from_l3.append(_ttft(Engine(model, config, cache=cache), prompt))
            l3_reads.append(cache.stats().gb_per_s("l3_to_l2"))
        finally:
            cache.close()
    cold_ms = _median_ms(m.ttft_s for m in cold)
    row = {"prompt_tokens": length, "cold_ms": cold_ms}
    for case, metrics in (("cold", cold), ("l1", from_l1), ("l2", from_l2), ("l3", from_l3)):
        ttft_ms = _median_ms(m.ttft_s for m in metrics)
        first = metrics[0]
        result = {
            **meta,
            "case": case,
            "prompt_tokens": length,
            "ttft_ms": round(ttft_ms, 2),
            "speedup_vs_cold": round(cold_ms / ttft_ms, 2),
            "hit_tokens": first.hit_tokens,
            "replayed_tokens": first.replayed_tokens,
            "computed_tokens": first.computed_tokens,
            "late_tokens": first.late_tokens,
        }
        if case == "l2":
            l1_ms = _median_ms(m.ttft_s for m in from_l1)
            load_ms = load_s * 1e3
            result.update(
                load_bytes=load_bytes,
                load_ms=round(load_ms, 3),
                load_gb_s=round(load_bytes / load_s / 1e9, 2),
                ceiling_gb_s=round(load_bytes / ceiling_s / 1e9, 2),
                fraction_of_ceiling=round(ceiling_s / load_s, 3),
                hidden_fraction=round(min(1.0, max(0.0, (l1_ms + load_ms - ttft_ms) / load_ms)), 3),
            )
            row.update({k: result[k] for k in ("load_gb_s", "ceiling_gb_s", "hidden_fraction")})
        if case == "l3":
            result["l3_read_gb_s"] = round(statistics.median(l3_reads), 2)  # L3 -> L2 prefetch
            row["l3_read_gb_s"] = result["l3_read_gb_s"]
        emit(result)
        row[case] = ttft_ms
    return row


def _load_rates(cache, num_pages: int) -> tuple[float, float, int]:
    """One L2 -> L1 load of `num_pages` pages through the cache's transfer engine (into
    free L1 pages, from L2 pages the hit just used), and the contiguous pinned copy of the
    same bytes. Seconds each (medians of 5), and the bytes."""
    executor = cache.executor
    transfer = executor.transfer
    num_bytes = num_pages * cache.layout.bytes_per_page
    device_ids = cache.alloc_device_pages(num_pages)
    host_ids = list(range(num_pages))
    try:
        load = _time(lambda: transfer.load_async(host_ids, device_ids).wait(), cache)
    finally:
        cache.free_device_pages(device_ids)
    pinned = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=cache.config.l1.device != "cpu")
    target = torch.empty(num_bytes, dtype=torch.uint8, device=cache.config.l1.device)
    ceiling = _time(lambda: target.copy_(pinned, non_blocking=True), cache)
    return load, ceiling, num_bytes


def _time(fn, cache) -> float:
    """Median wall time of `fn` run to completion (the device synchronised around it)."""
    on_cuda = cache.config.l1.device != "cpu"
    times = []
    for _ in range(6):
        if on_cuda:
            torch.cuda.synchronize()
        began = time.perf_counter()
        fn()
        if on_cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - began)
    return statistics.median(times[1:])


def _print_table(rows: list[dict]) -> None:
    print()
    header = (
        "prompt",
        "cold",
        "L1 hit",
        "L2 hit",
        "L3 hit",
        "L2 load",
        "ceiling",
        "hidden",
        "L3 read",
    )
    print("  ".join(f"{h:>16}" if i in (2, 3, 4) else f"{h:>9}" for i, h in enumerate(header)))
    for r in rows:
        cells = [f"{r['prompt_tokens']:>9,}", f"{r['cold']:>7.1f}ms"]
        for case in ("l1", "l2", "l3"):
            cells.append(f"{r[case]:>7.1f}ms ({r['cold'] / r[case]:>4.1f}x)".rjust(16))
        cells += [
            f"{r['load_gb_s']:>5.1f}GB/s",
            f"{r['ceiling_gb_s']:>5.1f}GB/s",
            f"{r['hidden_fraction']:>8.0%}",
            f"{r['l3_read_gb_s']:>5.1f}GB/s",
        ]
        print("  ".join(cells))


if __name__ == "__main__":
    main()
