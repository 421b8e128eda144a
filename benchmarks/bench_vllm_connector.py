"""Benchmark: per-layer loads of a cached prefix into vLLM-layout KV tensors, through the
vLLM connector, against the host->device link.

Claim (issue 20): on an H200, loading a 16K-token prefix of a Llama-3.1-8B-like model
(32 layers, 8 KV heads of 128, bf16; vLLM blocks of 16 tokens in its LBNHC layout,
hicache pages of 64) from hicache's L2 into vLLM's blocks runs at >= 85 % of a contiguous
pinned host->device copy of the same bytes, measured in the same run; and a per-layer
compute stand-in (a bf16 matmul sized to a given time) hides most of it.

The load is what vLLM's model runner does with a connector: bind the step's metadata,
`start_load_kv`, then for each layer `wait_for_layer_load` (layer i's copy event, then
its copy from hicache's L1 staging pages into vLLM's blocks on the compute stream) before
that layer's compute, then `wait_for_save`. The prefix is in L2 every time (L1 evicted
first). Cases:

    ceiling      one contiguous pinned copy_ of the prefix's bytes (host -> device)
    load         the connector's load, layers back to back, no compute
    hicache      hicache's own L2 -> L1 load of the same pages (match + wait_layer): the
                 connector's cost on top of it is its copy into vLLM's blocks
    overlap      the load with the compute stand-in after each layer's wait
    compute      the compute stand-in alone

It reports GB/s, load / ceiling, and hidden = (load + compute - overlap) / min(load,
compute): the share of the shorter of the two that runs under the other (1.0: the step
takes as long as the longer alone), one JSON line per case with the git revision and
device, then a table.

    python benchmarks/bench_vllm_connector.py                    # CUDA: the claim
    python benchmarks/bench_vllm_connector.py --layer-ms 0.5 1 2
    python benchmarks/bench_vllm_connector.py --smoke            # tiny, on the CPU
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402

from benchmarks.common import device_name, emit  # noqa: E402
from tests.support.vllm_driver import Shape, VllmEngine  # noqa: E402


def llama_shape(prefix_tokens: int, device: str) -> Shape:
    blocks = prefix_tokens // 16 + 64
    return Shape(num_layers=32, num_blocks=blocks, block_size=16, num_kv_heads=8,
                 head_size=128, dtype=torch.bfloat16, layout=KVCacheLayout.LBNHC,
                 device=device)  # fmt: skip


def smoke_shape(prefix_tokens: int) -> Shape:
    return Shape(num_layers=4, num_blocks=prefix_tokens // 16 + 8, block_size=16,
                 num_kv_heads=2, head_size=16, dtype=torch.float32)  # fmt: skip


class Bench:
    """One vLLM engine with a prefix of `prefix_tokens` saved in hicache's L2."""

    def __init__(self, shape: Shape, prefix_tokens: int, page_size: int) -> None:
        self.shape = shape
        self.prefix_tokens = prefix_tokens
        pages = prefix_tokens // page_size
        bytes_per_page = 2 * shape.num_kv_heads * shape.head_size * shape.num_layers * page_size
        bytes_per_page *= torch.empty(0, dtype=shape.dtype).element_size()
        extra = {
            "page_size": page_size,
            "l1_pages": 2 * pages,
            "l2_size": 2 * pages * bytes_per_page,
            "l2_reserve": 0 if shape.device == "cpu" else 1 << 30,
        }
        self.engine = VllmEngine(extra, shape, engine_id="bench", step_tokens=prefix_tokens + 64)
        self.prompt = [(7 * i + 3) % 50000 for i in range(prefix_tokens + 1)]
        width = shape.num_kv_heads * 2 * shape.head_size
        generator = torch.Generator(device=shape.device).manual_seed(0)

        def random_kv(layer, start, end):  # (n, H, C)
            size = (end - start, shape.num_kv_heads, 2 * shape.head_size)
            return torch.randn(size, device=shape.device, generator=generator).to(shape.dtype)

        request = self.engine.request("a", self.prompt)
        self.engine.step(request, write_kv=random_kv)
        self.engine.finish(request)
        self.engine.flush()
        self.num_bytes = prefix_tokens * width * shape.num_layers
        self.num_bytes *= torch.empty(0, dtype=shape.dtype).element_size()
        self._serial = 0

    def schedule(self) -> None:
        """The scheduler's side for a request B that hits the whole prefix (not timed: vLLM
        schedules while the previous step runs). L1 is emptied first: B loads from L2."""
        engine = self.engine
        engine.cache.evict("l1", 10**9)
        self._serial += 1
        self._request = engine.request(f"b{self._serial}", self.prompt[: self.prefix_tokens] + [1])
        self._output, computed = engine.schedule(self._request)
        assert computed == self.prefix_tokens, computed

    def load(self, layer_compute=None) -> None:
        """B's step on the worker, as vLLM's model runner makes it (timed)."""
        worker = self.engine.worker
        worker.bind_connector_metadata(self._output.kv_connector_metadata)
        worker.start_load_kv(None)
        for name in self.engine.layer_names:
            worker.wait_for_layer_load(name)
            if layer_compute is not None:
                layer_compute()
        worker.wait_for_save()
        assert not worker.get_block_ids_with_load_errors()
        worker.clear_connector_metadata()

    def finish(self) -> None:
        self.engine.finish(self._request, poison=False)

    def hicache_only(self) -> None:
        """hicache's own L2 -> L1 load of the same pages, for the connector's overhead."""
        cache = self.engine.cache
        lookup = self.engine.worker._shared.lookup.lookups[0]  # the model's one KV group
        namespace = lookup.namespace("")
        match = cache.match(self.prompt[: self.prefix_tokens], namespace)
        for layer in range(self.shape.num_layers):
            cache.wait_layer(match, layer)
        sync(self.shape.device)
        cache.release(match)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(body, device: str, repeats: int, before=None, after=None) -> float:
    """Median seconds of `body` (device work included); `before` / `after` run untimed."""
    times = []
    for _ in range(repeats + 1):  # the first is a warm-up
        if before is not None:
            before()
        sync(device)
        start = time.perf_counter()
        body()
        sync(device)
        times.append(time.perf_counter() - start)
        if after is not None:
            after()
    return statistics.median(times[1:])


def ceiling_copy(num_bytes: int, device: str):
    """One contiguous copy of `num_bytes` from (pinned) host memory to the device."""
    source = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=device.startswith("cuda"))
    source.fill_(1)
    target = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    return lambda: target.copy_(source, non_blocking=True)


def compute_stand_in(device: str, layer_ms: float, rows: int):
    """A per-layer compute of about `layer_ms`: a bf16 (fp32 on the CPU) matmul, repeated."""
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    size = 4096 if device.startswith("cuda") else 256
    work = torch.randn(rows, size, device=device, dtype=dtype)
    weight = torch.randn(size, size, device=device, dtype=dtype)
    one = timed(lambda: torch.mm(work, weight), device, 9)
    repeats = max(1, round(layer_ms / 1e3 / one))
    return lambda: [torch.mm(work, weight) for _ in range(repeats)], repeats * one


def measure(bench: Bench, args) -> list[dict]:
    """The cases of the module doc, as rows: case, seconds, and the ratios."""
    device, num_layers = args.device, bench.shape.num_layers
    ceiling_s = timed(ceiling_copy(bench.num_bytes, device), device, args.repeats)
    steps = {"before": bench.schedule, "after": bench.finish}
    load_s = timed(bench.load, device, args.repeats, **steps)
    empty_l1 = lambda: bench.engine.cache.evict("l1", 10**9)  # noqa: E731
    hicache_s = timed(bench.hicache_only, device, args.repeats, before=empty_l1)
    rows = [
        {"case": "ceiling", "seconds": ceiling_s},
        {"case": "load", "seconds": load_s, "of_ceiling": ceiling_s / load_s},
        {"case": "hicache", "seconds": hicache_s, "of_ceiling": ceiling_s / hicache_s},
    ]
    for layer_ms in args.layer_ms:
        layer_compute, layer_s = compute_stand_in(device, layer_ms, args.compute_rows)

        def compute_only(layer_compute=layer_compute):
            for _ in range(num_layers):
                layer_compute()

        compute_s = timed(compute_only, device, args.repeats)
        overlap_s = timed(lambda f=layer_compute: bench.load(f), device, args.repeats, **steps)
        hidden = max(0.0, min(1.0, (load_s + compute_s - overlap_s) / min(load_s, compute_s)))
        layer_ms = round(layer_s * 1e3, 3)
        rows.append({"case": "compute", "layer_ms": layer_ms, "seconds": compute_s})
        rows.append(
            {"case": "overlap", "layer_ms": layer_ms, "seconds": overlap_s, "hidden": hidden}
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--prefix-tokens", type=int, default=16384)
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--layer-ms", type=float, nargs="+", default=[0.5, 1.0, 2.0])
    parser.add_argument("--compute-rows", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, on the CPU")
    args = parser.parse_args()
    if args.smoke:
        args.device, args.prefix_tokens, args.page_size = "cpu", 256, 32
        args.layer_ms, args.compute_rows, args.repeats = [0.5], 64, 2
        shape = smoke_shape(args.prefix_tokens)
    else:
        shape = llama_shape(args.prefix_tokens, args.device)
    bench = Bench(shape, args.prefix_tokens, args.page_size)
    name = device_name(args.device)
    common = {"bench": "vllm_connector", "device": name, "prefix_tokens": args.prefix_tokens,
              "layout": bench.engine.worker._layout.descriptor(), "vllm_block": shape.block_size,
              "vllm_layout": shape.layout.name, "bytes": bench.num_bytes}  # fmt: skip
    gb = bench.num_bytes / 1e9
    rows = measure(bench, args)
    for row in rows:
        row["gb_per_s"] = round(gb / row["seconds"], 3) if row["case"] != "compute" else None
        row["seconds"] = round(row["seconds"], 6)
        for key in ("of_ceiling", "hidden"):
            if key in row:  # three significant digits: a loaded CPU's 0.0004 is not 0.0
                row[key] = float(f"{row[key]:.3g}")
        emit({**common, **row})
    print(f"\n{name}: {args.prefix_tokens}-token prefix, {gb:.3f} GB, {shape.num_layers} layers")
    print(f"{'case':10} {'layer ms':>9} {'ms':>9} {'GB/s':>8} {'of ceiling':>10} {'hidden':>7}")
    for row in rows:
        print(f"{row['case']:10} {row.get('layer_ms', ''):>9} {row['seconds'] * 1e3:9.2f} "
              f"{row['gb_per_s'] or '':>8} {row.get('of_ceiling', ''):>10} "
              f"{row.get('hidden', ''):>7}")  # fmt: skip
    bench.engine.shutdown()


if __name__ == "__main__":
    main()
