"""The trace player: a trace played through real `HiCache` controllers, one per serving
instance, in virtual time. ("Replay" elsewhere means the engine's encoder replay or a
CUDA-graph replay; a trace is played.)

Each instance is a prefill engine with its own L1 and L2 and a `VirtualExecutor`; all share
one simulated L3 (or each has its own). Events run in timestamp order:

- arrival: the router picks an instance (`hicache.routing`: round-robin, or the most
  valuable cached prefix, tier-weighted, among the instances not much busier than the
  least busy); a request that has to queue gives the
  cache its prefetch hint, as a scheduler would;
- start (the instance's GPU is free): `match` (the controller loads L2 pages, prefetches
  L3 pages and waits as its prefetch policy says, advancing the instance's clock), then
  prefill of the tokens the cache did not serve, overlapped layer by layer with the loads;
- finish: `insert` the prompt's full pages, `release` the match, and trim L1 back to its
  capacity (below).

The L1 pool is the capacity plus room for one request, trimmed back after each request:
the same contents a pool of exactly the capacity would hold between requests (a live
engine evicts just before allocating, this one just after inserting, and a finished request
is the most recently used), and it stays defined when the capacity is smaller than a
request, down to zero.

TTFT = queueing + the match's waits (L3 lookups and prefetch) + prefill, where prefill of
the uncached tokens overlaps the per-layer loads. Only prompt pages are cached (the KV a
prefill produces; as on the prefill side of a P/D deployment).

`SimulationConfig.engine_requests` plays requests as `hicache engine serve` runs them
instead: the match looks up the prompt but its last token; the L1 pool is exactly the
capacity (when it holds one request), a request reserving every page its prompt and answer
touch when it starts and freeing the partial last one when it ends; the answer's full pages
are cached with the prompt's. With a calibrated profile too (`hicache.simulate.profile`),
prefill costs the measured steps, and after its first token a request decodes on
(`DecodeSteps`), holding its pages, up to the engine's `max_running_requests` at once: its
pages reach the cache when its answer ends, a prefill that arrives meanwhile starts when
the decode step running ends, and a request that finds no L1 room waits for one to end.
`shared_device` has all instances' prefills take turns on one device. TTFT then adds the
profile's request overhead (HTTP, the hand-over to the engine thread).

This module knows the controller only through its public API, plus one side-effect-free
look at an instance's index for routing (`_cached_prefix`), scored by `hicache.routing`, the
code `hicache route` runs.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from hicache.config import HiCacheConfig, L1Config, L2Config, L3Config
from hicache.controller import CachedPrefix, HiCache, Match
from hicache.match import ask_l3_again
from hicache.routing import NOTHING_CACHED, Candidate, Router, RoutingConfig
from hicache.simulate.config import SimulationConfig
from hicache.simulate.decode import DecodeSteps
from hicache.simulate.errors import SimulationError
from hicache.simulate.executor import URL_SCHEME, Link, Links, VirtualExecutor
from hicache.simulate.l3 import SimulatedL3
from hicache.simulate.result import RequestStats, SimulationResult, summarize
from hicache.simulate.trace import Request, Trace
from radix.keys import TOKEN_BYTES, Namespace
from tiers.errors import PoolExhaustedError

ProgressCallback = Callable[[int, int], None]  # (requests done, total)
# Steps (rows, attention pairs) on a profile's compute fit, enough for the controller's
# least squares to find that fit again: three independent points.
_FIT_POINTS = ((1, 1), (64, 64 * 65 // 2), (64, 1088 * 1089 // 2 - 1024 * 1025 // 2))
_FINISH, _TICK, _PREFILLED = 0, 1, 2  # event kinds


@dataclass(eq=False)
class _Job:
    index: int
    request: Request
    data: bytes  # the prompt, encoded once
    lookup: bytes  # what the match looks up (`SimulationConfig.engine_requests`)
    cached: bytes  # what is inserted when it ends
    match: Match | None = None
    new_page_ids: list[int] | None = None
    decoded_s: float = 0.0  # when its last token is out (engine requests with a profile)
    estimate_s: float = 0.0  # prefill time without a cache (routing's load estimate)
    l3_asked_s: float | None = None  # when L3 was last asked about it (as the engine's)


def _ask_l3(job: _Job, now_s: float, ask_again_s: float) -> bool:
    """Whether the job's match asks L3 again, as the engine's admission decides
    (`engine/scheduler.py`): once its last lookup is `ask_again_s` old."""
    if not ask_l3_again(job.l3_asked_s, now_s, ask_again_s):
        return False
    job.l3_asked_s = now_s
    return True


class _Instance:
    """One serving instance: its cache, its clock, its GPU and its queue."""

    def __init__(self, index: int, cache: HiCache, executor: VirtualExecutor, l1_pages: int):
        self.index = index
        self.cache = cache
        self.executor = executor
        self.l1_capacity_pages = l1_pages
        self.running: _Job | None = None
        self.queue: deque[_Job] = deque()
        self.free_at_s = 0.0  # when the running request's prefill ends
        self.tick_pending = False
        self.queued_s = 0.0  # summed no-cache estimates of the queued requests
        self.busy_s = 0.0
        self.num_routed = 0
        self.decode = DecodeSteps()
        self.decoding: list[_Job] = []  # past their first token, holding their pages

    def backlog_s(self, now_s: float) -> float:
        return max(0.0, self.free_at_s - now_s) + self.queued_s


class TracePlayer:
    """One simulation run. `run()` once; it returns a `SimulationResult`."""

    def __init__(
        self,
        config: SimulationConfig,
        trace: Trace,
        progress: ProgressCallback | None = None,
        acknowledge: Callable[[int], int] | None = None,
    ) -> None:
        """`acknowledge(n)`: how many leading pages of an L3 write of n pages the store
        keeps (default all; a test makes L3 lose the rest, as a full disk does)."""
        if not trace.requests:
            raise SimulationError("the trace holds no requests")
        self.config = config
        self.trace = trace
        self.progress = progress
        self._acknowledge = acknowledge
        self._layout = config.model.kv_layout(config.page_size)
        if self._layout.bytes_per_page != config.page_bytes:
            raise SimulationError("the model's page layout and its KV bytes per token disagree")
        # One model on every instance: they share prefixes (and a shared L3) in one namespace.
        self._namespace = Namespace(model_id=config.model.name, layout=self._layout.descriptor())
        self._trace_pages = sum(self._cached_length(r) // config.page_size for r in trace.requests)
        self._stores = self._make_stores()
        self._decodes = config.engine_requests and config.profile is not None
        self._device_free_s = 0.0  # `shared_device`: when the device's last prefill ends
        aggregate = config.l3_aggregate_bytes_per_s
        self._shared_links = (  # the shared store's own bandwidth, one side per direction
            (Link("l3-write", aggregate), Link("l3-read", aggregate))
            if aggregate and config.l3_shared and self._stores
            else None
        )
        self._instances = [self._make_instance(i) for i in range(config.num_instances)]
        self._stats = RequestStats.empty(trace.num_requests)
        self._router = Router(RoutingConfig(config.routing, config.route_balance_s))
        # (time, seq, kind, where, the request or None)
        self._events: list[tuple[float, int, int, _Instance, _Job | None]] = []
        self._seq = itertools.count()

    @property
    def caches(self) -> list[HiCache]:
        """The instances' controllers, in instance order (to inspect after `run`)."""
        return [instance.cache for instance in self._instances]

    @property
    def request_stats(self) -> RequestStats:
        """Per-request times and hits (row i: trace request i), filled in by `run`."""
        return self._stats

    # ------------------------------------------------------------------ building

    def _make_stores(self) -> dict[str, SimulatedL3]:
        c = self.config
        if not c.l3_pages:
            return {}
        pages = min(c.l3_pages, self._trace_pages + 1)
        if c.l3_shared:
            return {"shared": SimulatedL3(pages, "shared")}
        return {
            f"instance-{i}": SimulatedL3(pages, f"instance-{i}") for i in range(c.num_instances)
        }

    def _make_links(self, index: int) -> Links:
        c, hw = self.config, self.config.hardware
        host_rate = hw.host_link_bytes_per_s * c.gpus_per_instance
        l3_write: tuple[Link, ...] = ()
        l3_read: tuple[Link, ...] = ()
        if self._stores:
            rate = c.l3_instance_bytes_per_s
            l3_write = (Link(f"nic{index}-out", rate),)
            l3_read = (Link(f"nic{index}-in", rate),)
            if self._shared_links is not None:
                l3_write += (self._shared_links[0],)
                l3_read += (self._shared_links[1],)
        return Links(
            device_to_host=Link(f"host{index}-d2h", host_rate),
            host_to_device=Link(f"host{index}-h2d", host_rate),
            host_latency_s=hw.host_link_latency_s,
            l3_write=l3_write,
            l3_read=l3_read,
            l3_latency_s=c.l3_latency_s,
        )

    def _make_instance(self, index: int) -> _Instance:
        c = self.config
        links = self._make_links(index)
        headroom = -(-max(map(self._cached_length, self.trace.requests)) // c.page_size)
        # A tier that can hold every page of the trace behaves the same at any larger size:
        # cap the pools there (a 100 TB L1 of 16-token pages would be a billion page ids).
        l1_pages = min(c.l1_pages, self._trace_pages)
        l2_pages = min(c.l2_pages, self._trace_pages)
        pool_pages = l1_pages + headroom
        if self._decodes and c.l1_pages < headroom:  # room for the requests running at once
            pool_pages = l1_pages + headroom * c.profile.max_running_requests
            if c.engine_pool_pages:  # as much as the engine's own pool holds
                pool_pages = l1_pages + max(headroom, c.engine_pool_pages)
        if c.engine_requests and c.l1_pages >= headroom:
            # The engine's own pool: a request reserves its pages (the prompt's and the
            # answer's) in it at the start, evicting cached pages to make room then.
            pool_pages = l1_pages = min(c.l1_pages, self._trace_pages + headroom)
        executor = VirtualExecutor(
            num_device_pages=pool_pages,
            num_host_pages=l2_pages,
            page_bytes=c.page_bytes,
            links=links,
            stores=self._stores,
            prefetch_chunk_pages=c.prefetch_chunk_pages,
            acknowledge=self._acknowledge,
        )
        url = None
        if self._stores:
            url = URL_SCHEME + ("shared" if c.l3_shared else f"instance-{index}")
        cache_config = HiCacheConfig(
            layout=self._layout,
            l1=L1Config(device="cpu", num_pages=pool_pages),
            l2=L2Config(budget_bytes=l2_pages * c.page_bytes, reserve_bytes=0, pin_memory=False),
            l3=L3Config(
                url=url,
                write_policy=c.l3_write_policy,
                prefetch_chunk_pages=c.prefetch_chunk_pages,
            ),
            policy=c.policy,
        )
        cache = HiCache(cache_config, executor)
        if c.profile is not None:  # its load-or-recompute choice weighs the measured steps
            for num_rows, num_pairs in _FIT_POINTS:
                cache.record_compute(num_rows, num_pairs, c.profile.step_s(num_rows, num_pairs))
        return _Instance(index, cache, executor, l1_pages)

    # ------------------------------------------------------------------ the event loop

    def run(self) -> SimulationResult:
        started = time.perf_counter()
        requests = self.trace.requests
        events = self._events
        total = len(requests)
        done = 0
        report_every = max(1, total // 200)
        next_arrival = 0
        while next_arrival < total or events:
            if events and (
                next_arrival >= total or events[0][0] <= requests[next_arrival].arrival_s
            ):
                at_s, _, kind, instance, job = heapq.heappop(events)
                if kind == _TICK:
                    self._tick(instance, at_s)
                    continue
                if kind == _PREFILLED:
                    self._prefilled(instance, job, at_s)
                    continue
                self._finish(instance, job, at_s)
                done += 1
                if self.progress is not None and done % report_every == 0:
                    self.progress(done, total)
            else:
                self._arrive(next_arrival, requests[next_arrival])
                next_arrival += 1
        for instance in self._instances:
            instance.cache.flush()
        for store in self._stores.values():
            store.settle_all()
        if self.progress is not None:
            self.progress(total, total)
        return summarize(
            self.config,
            self.trace,
            self._stats,
            [instance.cache.stats() for instance in self._instances],
            [instance.busy_s for instance in self._instances],
            [store.stats() for store in self._stores.values()],
            elapsed_s=time.perf_counter() - started,
        )

    def _cached_length(self, request: Request) -> int:
        """Tokens a request inserts when it ends (its prompt; with the answer, as the
        engine does, when `engine_requests`)."""
        if self.config.engine_requests:
            return request.input_length + max(0, request.output_length - 1)
        return request.input_length

    def _reserved_pages(self, job: _Job) -> int:
        """L1 pages a request holds while it runs: its full prompt pages; as the engine
        reserves them, every page its prompt and answer touch."""
        num_tokens = len(job.cached) // TOKEN_BYTES
        if self.config.engine_requests:
            return -(-num_tokens // self.config.page_size)
        return num_tokens // self.config.page_size

    def _job(self, index: int, request: Request) -> _Job:
        data = request.token_bytes()
        if not self.config.engine_requests:
            return _Job(index, request, data, data, data)
        # The answer: tokens of this request alone (above any prompt token a trace holds).
        answer = np.arange(max(0, request.output_length - 1), dtype="<u4")
        answer = (answer + np.uint32(0x8000_0000 + (index << 12) % 0x7FFF_0000)).tobytes()
        return _Job(index, request, data, data[:-TOKEN_BYTES], data + answer)

    def _arrive(self, index: int, request: Request) -> None:
        job = self._job(index, request)
        job.estimate_s = self.config.prefill_s(0, request.input_length)
        instance = self._route(job, request.arrival_s)
        instance.executor.advance_to(request.arrival_s)
        if (
            instance.running is None
            and not instance.queue
            and self._start(instance, job, request.arrival_s)
        ):
            return
        instance.queue.append(job)
        instance.queued_s += job.estimate_s
        if instance.executor.has_l3:
            # the scheduler's hint for a queued request
            instance.cache.prefetch(job.lookup, self._namespace)
            job.l3_asked_s = instance.executor.now()

    def _start(self, instance: _Instance, job: _Job, at_s: float) -> bool:
        """Run `job`'s match and prefill on `instance`; False (nothing changed but the
        match's side effects, as in the engine) when the engine cannot take it yet: as
        many requests as it runs at once, or no L1 pages for it until one ends."""
        c = self.config
        executor, cache = instance.executor, instance.cache
        executor.advance_to(at_s)
        decodes = self._decodes
        if decodes and len(instance.decoding) >= c.profile.max_running_requests:
            return False
        if decodes:
            executor.advance_to(executor.now() + instance.decode.wait_s(executor.now()))
        began_s = executor.now()  # later than at_s when the scheduler was blocked
        ask_l3 = _ask_l3(job, began_s, cache.config.l3.ask_again_s)
        match = cache.match(job.lookup, self._namespace, ask_l3=ask_l3)
        matched_s = executor.now()
        length = job.request.input_length
        computed_from = min(match.num_tokens, length - 1)  # the last token is always computed
        prefill_s = c.prefill_s(computed_from, length)
        compute_s = matched_s  # when its prefill starts: on a shared device, in turn
        if c.shared_device:
            compute_s = max(matched_s, self._device_free_s)
        end_s = compute_s + prefill_s
        if executor.loads_done_s > compute_s:  # layer i attends once its load is in
            last_layer_s = prefill_s / c.model.num_layers
            end_s = max(end_s, executor.loads_done_s + last_layer_s)
        num_new = self._reserved_pages(job) - match.num_pages
        try:
            job.new_page_ids = cache.alloc_device_pages(num_new)
        except PoolExhaustedError as error:  # the pool has room for one whole request
            if decodes and instance.decoding:  # the engine waits for a request to end
                cache.release(match)
                return False
            raise SimulationError(f"instance {instance.index}: {error}") from error
        if decodes:
            num_steps = max(0, job.request.output_length - 1)
            step_s = c.profile.step_s(1, length + 1)  # one row over the prompt
            instance.decode.prefilled(began_s, end_s, num_steps, step_s)
            job.decoded_s = end_s + num_steps * instance.decode.step_s
        job.match = match
        instance.running = job
        instance.free_at_s = end_s
        instance.busy_s += end_s - compute_s
        if c.shared_device:
            self._device_free_s = end_s
        self._stats.record(
            job.index,
            arrival_s=job.request.arrival_s,
            began_s=began_s,
            matched_s=matched_s,
            end_s=end_s + (c.profile.request_overhead_s if c.profile else 0.0),
            match=match,
            page_size=c.page_size,
            computed_from=computed_from,
            instance=instance.index,
        )
        kind = _PREFILLED if decodes else _FINISH
        heapq.heappush(self._events, (end_s, next(self._seq), kind, instance, job))
        return True

    def _prefilled(self, instance: _Instance, job: _Job, at_s: float) -> None:
        """Its first token: the request decodes on (holding its pages) until `decoded_s`,
        and the engine takes the next request."""
        instance.running = None
        instance.decoding.append(job)
        heapq.heappush(self._events, (job.decoded_s, next(self._seq), _FINISH, instance, job))
        self._start_queued(instance, at_s)

    def _start_queued(self, instance: _Instance, at_s: float) -> None:
        if instance.running is None and instance.queue:
            following = instance.queue.popleft()
            if self._start(instance, following, at_s):
                instance.queued_s = max(0.0, instance.queued_s - following.estimate_s)
                return
            instance.queue.appendleft(following)  # until a request ends
        if instance.running is None:
            self._schedule_tick(instance)

    def _finish(self, instance: _Instance, job: _Job, at_s: float) -> None:
        """The request ends: its full pages go into the cache, the rest back."""
        cache = instance.cache
        instance.executor.advance_to(at_s)
        page_ids = job.match.device_page_ids + job.new_page_ids
        num_full = len(job.cached) // TOKEN_BYTES // self.config.page_size
        cache.insert(job.cached, page_ids[:num_full], self._namespace)
        if num_full < len(page_ids):  # the answer's last, partial page
            cache.free_device_pages(page_ids[num_full:])
        cache.release(job.match)
        self._trim_l1(instance)
        if self._decodes:
            instance.decoding.remove(job)
        else:
            instance.running = None
        self._start_queued(instance, at_s)

    def _schedule_tick(self, instance: _Instance) -> None:
        """An idle instance looks at its cache again when its next transfer ends.

        The controller applies finished transfers (and starts the L3 writes that follow a
        backup) whenever it is called; a busy engine calls it all the time, an idle one
        would not. Without these ticks an idle instance's backups would reach L3 only with
        its next request, and the other instances would miss them meanwhile.
        """
        next_s = instance.executor.next_done_s()
        if next_s is None or instance.tick_pending:
            return
        instance.tick_pending = True
        at_s = max(next_s, instance.executor.now())
        heapq.heappush(self._events, (at_s, next(self._seq), _TICK, instance, None))

    def _tick(self, instance: _Instance, at_s: float) -> None:
        instance.tick_pending = False
        if instance.running is not None:
            return  # busy: its own calls apply what finished
        instance.executor.advance_to(at_s)
        instance.cache.poll()  # applies finished transfers, changes nothing else
        self._schedule_tick(instance)

    def _trim_l1(self, instance: _Instance) -> None:
        used = instance.cache.pages_in_use("l1")
        over = used - instance.l1_capacity_pages
        if over > 0:
            instance.cache.evict("l1", over)

    # ------------------------------------------------------------------ routing

    def _route(self, job: _Job, now_s: float) -> _Instance:
        """The live router's choice (`hicache.routing`), from the instances' own indexes
        (probed without side effects) and their backlogs in seconds."""
        instances = self._instances
        if len(instances) == 1:
            return instances[0]
        candidates = [
            Candidate(
                instance.index,
                _cached_prefix(instance.cache, job.lookup, self._namespace)
                if self.config.routing == "prefix"
                else NOTHING_CACHED,
                instance.backlog_s(now_s),
                instance.num_routed,
            )
            for instance in instances
        ]
        num_pages = job.request.input_length // self.config.page_size
        chosen = instances[self._router.choose(candidates, num_pages).index]
        chosen.num_routed += 1
        return chosen


def _cached_prefix(cache: HiCache, data: bytes, namespace: Namespace) -> CachedPrefix:
    """The prompt's prefix the instance holds, per tier, by its index.

    A match that neither touches (no eviction-order or hit-count change), nor counts, nor
    moves anything: routing must not change what the caches do.
    """
    return cache.cached_prefix(data, namespace)


__all__ = ["TracePlayer"]
