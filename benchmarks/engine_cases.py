"""One model's measurement for bench_engine.py: a cache-off and a cache-on engine over one
cache (`Bench`), each prompt's TTFT cold and from every tier, its decode step, and the L3
read and L2 load rates against their ceilings, as one row. bench_engine.py owns the command
line, the run over the models (engine_models.py) and the tables."""

from __future__ import annotations

import concurrent.futures
import os
import statistics
import time
from pathlib import Path

import torch

from benchmarks.common import parallel_read_s, write_random_file
from engine_integration.engine.core import Engine, kv_layout_for
from engine_integration.engine.sampling import SamplingParams
from engine_integration.engine.sidecar import SidecarShape
from hicache.config import HiCacheConfig, L1Config, L2Config, L3Config, PolicyConfig
from hicache.controller import HiCache

CPUS = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
POLICY = PolicyConfig(write_policy="write_through", prefetch_policy="wait_complete")
ONE_TOKEN = SamplingParams(max_new_tokens=1)


class Bench:
    """One model: a cache-off engine (the baseline), and a cache-on engine over one cache."""

    def __init__(self, model, config, url, l1_pages, args, ceiling_file: Path) -> None:
        self.model, self.config, self.url, self.args = model, config, url, args
        self.l1_pages = l1_pages
        self.ceiling_file = ceiling_file
        self.page_size = config.page_size
        # Room in L2 for every length's pages and, for an interleaved model, its sidecars (a
        # whole one and a delta each): a 32K Gemma 3 prompt's 512 pages and 40-page sidecars
        # did not fit the pages alone, and its first L2 hit found nothing there.
        shape = SidecarShape.of(model.config, self.page_size)
        sidecar_pages = 2 * shape.num_pages(max(args.lengths)) if shape is not None else 0
        l2_pages = sum(-(-n // self.page_size) + sidecar_pages for n in args.lengths) + 64
        self.off = Engine(model, config, num_private_pages=l1_pages)
        self.cache = self._new_cache(l2_pages)
        self.engine = Engine(model, config, cache=self.cache)
        warm = [i % model.config.vocab_size for i in range(1000)]
        for _ in range(2):
            _ttft(self.off, warm)
            _ttft(self.engine, warm)  # (a cold step and a hit step: the compute rate's first)

    def _new_cache(self, l2_pages: int) -> HiCache:
        """A cache as `embedded.build_cache` makes one, with this run's L3 read batches."""
        layout = kv_layout_for(self.model, self.page_size)
        on_cuda = self.config.on_cuda
        return HiCache(
            HiCacheConfig(
                layout=layout,
                l1=L1Config(device=self.config.device, num_pages=self.l1_pages),
                l2=L2Config(
                    budget_bytes=l2_pages * layout.bytes_per_page,
                    reserve_bytes=L2Config().reserve_bytes if on_cuda else 0,
                    pin_memory=on_cuda,
                ),
                l3=L3Config(
                    url=self.url,
                    read_batches=self.args.read_batches,
                    read_chunk_bytes=self.args.read_chunk,
                ),
                policy=POLICY,
            )
        )

    def close(self) -> None:
        self.cache.close()

    def measure(self, prompt: list[int]) -> dict:
        repeats, cache, engine = self.args.repeats, self.cache, self.engine
        _ttft(self.off, prompt)  # warm-up at this length
        cold = [_ttft(self.off, prompt) for _ in range(repeats)]
        _ttft(engine, prompt)  # cold on the cache: fills L1, backs up to L2 and L3
        cache.flush()
        decode_s = _decode_step_s(self.off, prompt, self.args.decode_steps, repeats)
        from_l1 = [_ttft(engine, prompt) for _ in range(repeats)]
        from_l2 = []
        for _ in range(repeats):
            cache.evict("l1", self.l1_pages)
            from_l2.append(_ttft(engine, prompt))
        hit_pages = _median_run(from_l2).hit_tokens["l2"] // self.page_size
        load_s, link_s, load_bytes = _load_rates(cache, hit_pages)
        before = cache.stats()
        from_l3 = []
        for _ in range(repeats):
            cache.flush()
            cache.evict("l1", self.l1_pages)
            cache.evict("l2", cache.executor.num_host_pages)
            from_l3.append(_ttft(engine, prompt))
        read_bytes, read_s = _moved(before, cache.stats(), "l3_to_l2")
        new_cache = []
        num_pages = len(prompt) // self.page_size + 1
        for _ in range(repeats):
            fresh = self._new_cache(num_pages + 64)
            try:
                new_cache.append(_ttft(Engine(self.model, self.config, cache=fresh), prompt))
            finally:
                fresh.close()
        l3_bytes = max(read_bytes // max(1, repeats), hit_pages * cache.layout.bytes_per_page)
        ceiling_s = _read_ceiling(self.ceiling_file, l3_bytes, self.config.on_cuda)
        row = _row(
            prompt,
            cold,
            from_l1,
            from_l2,
            from_l3,
            new_cache,
            {
                "l2_load_gb_s": load_bytes / load_s / 1e9,
                "l2_ceiling_gb_s": load_bytes / link_s / 1e9,
                "l3_read_gb_s": read_bytes / read_s / 1e9 if read_s else 0.0,
                "l3_ceiling_gb_s": l3_bytes / ceiling_s / 1e9,
                "l3_fetched": _median(m.hit_tokens["l3"] for m in from_l3) / len(prompt),
                "l3_rates": cache.fetch_rates(),
            },
        )
        row["decode_ms"] = round(decode_s * 1e3, 3)
        return row


def _row(prompt, cold, from_l1, from_l2, from_l3, new_cache, rates: dict) -> dict:
    row = {"prompt_tokens": len(prompt)}
    for case, metrics in (
        ("cold", cold),
        ("l1", from_l1),
        ("l2", from_l2),
        ("l3", from_l3),
        ("l3_new", new_cache),
    ):
        row[f"{case}_ms"] = round(_median(m.ttft_s for m in metrics) * 1e3, 2)
        row[f"{case}_hit_tokens"] = _median_run(metrics).hit_tokens  # (the run timed)
    snapshot = rates.pop("l3_rates")
    row.update({k: round(v, 3) for k, v in rates.items()})
    row["measured_l3_read_gb_s"] = round(snapshot.l3_read_bytes_per_s / 1e9, 2)
    row["measured_l2_load_gb_s"] = round(snapshot.l2_load_bytes_per_s / 1e9, 2)
    row["l3_pages_declined"] = snapshot.pages_declined
    return row


def _ttft(engine: Engine, prompt: list[int]):
    _sync(engine)
    request = engine.add_request(prompt, ONE_TOKEN)
    (output,) = engine.run()
    assert output.request_id == request.request_id
    return output.metrics


def _decode_step_s(engine: Engine, prompt: list[int], steps: int, repeats: int) -> float:
    """The median time of one decode step after `prompt` (cache off): a request of
    `steps` + 1 new tokens, its steps after the first token timed together, `repeats` times."""
    params = SamplingParams(max_new_tokens=steps + 1, stop_token_ids=())
    times = []
    for _ in range(repeats):
        _sync(engine)
        engine.add_request(prompt, params)
        (output,) = engine.run()
        metrics = output.metrics
        times.append((metrics.finish_s - metrics.first_token_s) / steps)
    return _median(times)


def _sync(engine: Engine) -> None:
    if engine.config.on_cuda:
        torch.cuda.synchronize()


def _median_run(metrics: list):
    """The run whose TTFT is the median (of an odd count; the lower middle of an even one):
    the run a row's TTFT is, whose hit tokens the row shows."""
    return sorted(metrics, key=lambda m: m.ttft_s)[(len(metrics) - 1) // 2]


def _median(values) -> float:
    return statistics.median(list(values))


def _moved(before, after, direction: str) -> tuple[int, float]:
    """Bytes and summed op seconds of one direction between two stats snapshots."""
    return (
        after.bytes_moved[direction] - before.bytes_moved[direction],
        after.transfer_seconds[direction] - before.transfer_seconds[direction],
    )


def _read_ceiling(path: Path, num_bytes: int, pinned: bool) -> float:
    """Seconds (median of 5, after a warm-up) to read one file of `num_bytes` from the page
    cache into one buffer, a thread per core (`common.parallel_read_s`)."""
    num_bytes = max(num_bytes, 1 << 20)
    write_random_file(path, num_bytes)
    buffer = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=pinned)
    view = memoryview(buffer.numpy())
    try:
        with concurrent.futures.ThreadPoolExecutor(CPUS) as pool:
            times = [parallel_read_s(path, view, pool, CPUS) for _ in range(6)]
    finally:
        path.unlink()
    return statistics.median(times[1:])


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
