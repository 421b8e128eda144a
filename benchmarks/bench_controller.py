"""The controller under a multi-turn workload, and L2->L1 loads hidden behind compute.

Part 1 (`--part policies`, any device): users hold multi-turn conversations, some sharing a
system prompt; each turn is matched, its new pages allocated and inserted. L1 holds a
fraction of the working set, L2 more, L3 is a file:// directory. For each write policy it
prints hit tokens per tier and the controller's own time per request, with the time spent
inside the executor (the data copies) taken out.

Part 2 (`--part overlap`, CUDA): a Llama-3.1-8B-like layout; a prefix is evicted to L2 and
matched again while a simulated forward pass runs layer by layer (a matmul sized to a given
time per layer), waiting on each layer's load just before its compute. It reports how much
of the load time the compute hides: (load + compute - overlapped) / load.

    python benchmarks/bench_controller.py --part policies
    python benchmarks/bench_controller.py --part overlap --device cuda
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import device_name, emit  # noqa: E402
from hicache.config import HiCacheConfig, L1Config, L2Config, L3Config, PolicyConfig  # noqa: E402
from hicache.controller import HiCache  # noqa: E402
from hicache.executor import RealExecutor  # noqa: E402
from radix.keys import Namespace
from tiers.layout import KVLayout  # noqa: E402

NS = Namespace(model_id="bench-controller", layout="bench")  # every prompt's namespace


class TimedExecutor(RealExecutor):
    """The real executor, counting the time spent in it (the data copies, on the CPU)."""

    inside_s = 0.0

    def _timed(name):  # noqa: N805 - a decorator factory used in the class body
        def call(self, *args, **kwargs):
            start = time.perf_counter()
            try:
                return getattr(RealExecutor, name)(self, *args, **kwargs)
            finally:
                self.inside_s += time.perf_counter() - start

        return call

    submit = _timed("submit")
    poll = _timed("poll")
    wait = _timed("wait")
    l3_exists = _timed("l3_exists")


def conversations(num_users: int, turns: int, seed: int = 0) -> list[list[int]]:
    """Prompts in arrival order: each user's turn appends a question and an answer."""
    rng = random.Random(seed)
    system_prompts = [[rng.randrange(32000) for _ in range(512)] for _ in range(3)]
    histories = [list(system_prompts[user % 3]) for user in range(num_users)]
    prompts = []
    for _turn in range(turns):
        order = list(range(num_users))
        rng.shuffle(order)
        for user in order:
            histories[user] += [rng.randrange(32000) for _ in range(rng.randrange(48, 160))]
            prompts.append(list(histories[user]))
            histories[user] += [rng.randrange(32000) for _ in range(rng.randrange(32, 128))]
    return prompts


def run_policy(layout, prompts, policy: str, l1_pages: int, l2_pages: int, l3_dir: str) -> dict:
    config = HiCacheConfig(
        layout=layout,
        l1=L1Config(device="cpu", num_pages=l1_pages),
        l2=L2Config(budget_bytes=l2_pages * layout.bytes_per_page, reserve_bytes=0),
        l3=L3Config(url=f"file://{l3_dir}?capacity=4GiB"),
        policy=PolicyConfig(write_policy=policy, prefetch_policy="wait_complete"),
    )
    executor = TimedExecutor(config)
    cache = HiCache(config, executor)
    start = time.perf_counter()
    for tokens in prompts:
        match = cache.match(tokens[:-1], NS)
        new_pages = len(tokens) // layout.page_size - match.num_pages
        ids = cache.alloc_device_pages(new_pages)
        cache.insert(tokens, match.device_page_ids + ids, NS)
        cache.release(match)
    cache.flush()
    elapsed = time.perf_counter() - start
    stats = cache.stats()
    cache.close()
    controller_s = elapsed - executor.inside_s
    return {
        "write_policy": policy,
        "requests": stats.requests,
        "requested_tokens": stats.requested_tokens,
        "hit_tokens": stats.hit_tokens,
        "hit_rate": round(stats.hit_rate, 4),
        "controller_us_per_request": round(controller_s / len(prompts) * 1e6, 1),
        "executor_us_per_request": round(executor.inside_s / len(prompts) * 1e6, 1),
        "pages_moved": stats.pages_moved,
        "evicted_pages": stats.evicted_pages,
    }


def part_policies(args) -> None:
    layout = KVLayout(
        kind="mha", num_layers=4, page_size=16, dtype="float32", num_kv_heads=2, head_dim=16
    )
    prompts = conversations(args.users, args.turns)
    working_set = len({tuple(p[: (i + 1) * 16]) for p in prompts for i in range(len(p) // 16)})
    l1_pages = max(64, int(working_set * args.l1_fraction))
    l2_pages = max(128, int(working_set * args.l2_fraction))
    rows = []
    for policy in ("write_through", "write_through_selective", "write_back"):
        with tempfile.TemporaryDirectory() as l3_dir:
            run_policy(layout, prompts[:20], policy, l1_pages, l2_pages, l3_dir)  # warm-up
        with tempfile.TemporaryDirectory() as l3_dir:
            row = run_policy(layout, prompts, policy, l1_pages, l2_pages, l3_dir)
        row.update(working_set_pages=working_set, l1_pages=l1_pages, l2_pages=l2_pages)
        emit({"bench": "controller_policies", "device": device_name(), **row})
        rows.append(row)
    print(f"{'write policy':26} {'hit rate':>8} {'L1 tok':>8} {'L2 tok':>8} {'L3 tok':>8} "
          f"{'ctl us/req':>10} {'copy us/req':>11}")  # fmt: skip
    for row in rows:
        hits = row["hit_tokens"]
        print(f"{row['write_policy']:26} {row['hit_rate']:8.3f} {hits['l1']:8d} {hits['l2']:8d} "
              f"{hits['l3']:8d} {row['controller_us_per_request']:10.1f} "
              f"{row['executor_us_per_request']:11.1f}")  # fmt: skip


def part_overlap(args) -> None:
    import torch

    layout = KVLayout(
        kind="mha", num_layers=32, page_size=64, dtype="bfloat16", num_kv_heads=8, head_dim=128
    )
    num_pages = args.prefix_tokens // layout.page_size
    config = HiCacheConfig(
        layout=layout,
        l1=L1Config(device="cuda", num_pages=2 * num_pages),
        l2=L2Config(budget_bytes=2 * num_pages * layout.bytes_per_page, reserve_bytes=1 << 30),
        policy=PolicyConfig(write_policy="write_through"),
    )
    cache = HiCache(config)
    tokens = list(range(num_pages * layout.page_size + 1))
    ids = cache.alloc_device_pages(num_pages)
    cache.device_pool.kv[:, ids].normal_()
    cache.insert(tokens, ids, NS)
    cache.flush()
    work = torch.randn(args.compute_rows, 4096, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)

    def layer_compute(repeats: int) -> None:
        for _ in range(repeats):
            torch.mm(work, weight)

    repeats = calibrate(layer_compute, args.layer_ms)

    def timed(body) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        body()
        torch.cuda.synchronize()
        return time.perf_counter() - start

    def load_only():
        cache.evict("l1", num_pages)
        match = cache.match(tokens, NS)
        for layer in range(layout.num_layers):
            cache.wait_layer(match, layer)
        torch.cuda.current_stream().synchronize()
        cache.release(match)
        assert match.num_l2_pages == num_pages

    def overlapped():
        cache.evict("l1", num_pages)
        match = cache.match(tokens, NS)
        for layer in range(layout.num_layers):
            cache.wait_layer(match, layer)  # the compute stream waits for this layer only
            layer_compute(repeats)
        torch.cuda.current_stream().synchronize()
        cache.release(match)

    def compute_only():
        for _layer in range(layout.num_layers):
            layer_compute(repeats)

    for body in (load_only, overlapped, compute_only):
        timed(body)  # warm-up
    load_s = median(timed(load_only) for _ in range(5))
    compute_s = median(timed(compute_only) for _ in range(5))
    overlap_s = median(timed(overlapped) for _ in range(5))
    hidden = (load_s + compute_s - overlap_s) / load_s
    result = {
        "bench": "controller_overlap",
        "device": device_name("cuda"),
        "layout": layout.descriptor(),
        "prefix_tokens": num_pages * layout.page_size,
        "kv_bytes": num_pages * layout.bytes_per_page,
        "layer_compute_ms": round(compute_s / layout.num_layers * 1e3, 3),
        "load_ms": round(load_s * 1e3, 2),
        "load_gbps": round(num_pages * layout.bytes_per_page / load_s / 1e9, 2),
        "compute_ms": round(compute_s * 1e3, 2),
        "overlapped_ms": round(overlap_s * 1e3, 2),
        "hidden_fraction": round(max(0.0, min(1.0, hidden)), 3),
    }
    emit(result)
    cache.close()


def calibrate(layer_compute, layer_ms: float) -> int:
    import torch

    layer_compute(3)
    torch.cuda.synchronize()
    start = time.perf_counter()
    layer_compute(20)
    torch.cuda.synchronize()
    per_repeat = (time.perf_counter() - start) / 20
    return max(1, round(layer_ms / 1e3 / per_repeat))


def median(values) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=["policies", "overlap"], default="policies")
    parser.add_argument("--users", type=int, default=24)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--l1-fraction", type=float, default=0.25)
    parser.add_argument("--l2-fraction", type=float, default=0.6)
    parser.add_argument("--prefix-tokens", type=int, default=16384)
    parser.add_argument("--layer-ms", type=float, nargs="+", default=[0.5])
    parser.add_argument("--compute-rows", type=int, default=2048)
    args = parser.parse_args()
    if args.part == "policies":
        part_policies(args)
        return
    for layer_ms in args.layer_ms:
        part_overlap(argparse.Namespace(**{**vars(args), "layer_ms": layer_ms}))


if __name__ == "__main__":
    main()
