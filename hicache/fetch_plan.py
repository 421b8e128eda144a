"""Load or recompute: how much of an L3 run a request should fetch, from measured rates.

A run found only in L3 is worth fetching while reading it (L3 -> L2, then L2 -> L1,
pipelined batch by batch) takes less time than the engine would spend computing its
tokens. `FetchRates` holds what that choice needs, each measured online by the cache that
owns it, with a prior until measured:

    L3 read      bytes/s of finished prefetches (the first excepted: its one-time costs),
                 net of the L3 round trip (`l3_latency_s`, timed on the existence lookups)
    L2 -> L1     bytes/s of finished loads, as the executor timed them on the link
    compute      seconds of an engine step = per_step + per_row * rows + per_pair * pairs,
                 fitted by least squares to the steps the engine reports (`pairs`: the
                 (row, attended position) pairs of the step's attention, which makes the
                 cost of a long prefix grow with its square, as it does)

`plan_fetch` then evaluates the time to first token of fetching the first n pages and
recomputing the rest, for n at every read batch's end and the whole run, and returns the
fastest.
Until the compute rate has been measured it fetches the whole run (what a cache without this
choice does). Before L3 has been read once, a read is not free: it is weighed at the prior
read rate, with the prior latency (`l3_latency_prior_s`, what a store's first read costs
once: its reader's threads starting, its tables read) as its round trip, so a short run is
recomputed until a read has measured the store, and a new cache's first hit is never slower
than cold; a run worth even that read is fetched (and measures the store). A run declined
on the prior alone has its first read batch read into L2 in the background once the engine
has run its next step (`probe_pages`; one probe at a time, none once measured): its request
recomputes, and the store is measured off any request's path, so a prior far below the
store's real rate costs two hits, not every hit until a probe.
A match asks `worth_looking` before its L3 lookup: when no fetch of the run could pay even
if L3 held every page of it, the lookup is skipped too (on the H200 a 1K-token L3 hit that
fetched nothing cost 0.9x of cold in its lookup and decision). Every `PROBE_EVERY` runs
declined in a row (looked up or not), one is looked up and probed with one read batch, so a
store, or a model, that got faster is seen again. Measured end to end by
benchmarks/bench_engine.py (an L3 hit against recomputing it) and under load by
benchmarks/bench_serving.py; the figures are in docs/performance.md.

The same weighing decides whether a match loads the L2 run that ends its prefix into L1
(`worth_loading`, `PolicyConfig.l2_load_policy`): all of it when its pages' trip over the
L2 -> L1 link takes less than recomputing its tokens, else none (SmolLM2-135M on the H200,
whose step costs the same at any length, took 0.8x of cold for a 1K-token L2 hit). The
estimate adds the load to the compute, though the engine overlaps them layer by layer: a
pessimistic bound, so an L2 hit it keeps is faster than cold.

Torch-free, clock-free: every time is given in seconds by the caller.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from dataclasses import dataclass

import numpy as np

_ALPHA = 0.3  # weight of a new sample in a rate's moving average
_MIN_READ_BYTES = 1 << 20  # smaller prefetches are all latency: no bandwidth sample
COMPUTE_SAMPLES = 64  # engine steps the compute fit uses (the latest)
_MIN_COMPUTE_SAMPLES = 3
PROBE_EVERY = 32  # runs declined in a row before one is looked up and one read batch fetched


class _Average:
    """An exponential moving average with a prior (used until the first sample)."""

    def __init__(self, prior: float) -> None:
        self.value = prior
        self.num_samples = 0

    def add(self, sample: float) -> None:
        self.value = sample if not self.num_samples else (1 - _ALPHA) * self.value + _ALPHA * sample
        self.num_samples += 1


@dataclass(frozen=True)
class ComputeFit:
    """Seconds of one engine step: per_step_s + per_row_s * rows + per_pair_s * pairs."""

    per_step_s: float
    per_row_s: float
    per_pair_s: float

    def seconds(self, num_rows: int, num_pairs: int) -> float:
        return self.per_step_s + self.per_row_s * num_rows + self.per_pair_s * num_pairs


def attention_pairs(start: int, end: int) -> int:
    """(row, attended position) pairs of causal attention of rows [start, end): row p
    attends to positions 0..p."""
    return (end * (end + 1) - start * (start + 1)) // 2


def fit_compute(samples) -> ComputeFit | None:
    """Least squares over (rows, pairs, seconds) samples, coefficients kept >= 0 (a term
    that fits negative is dropped and the rest refitted); None without enough samples."""
    if len(samples) < _MIN_COMPUTE_SAMPLES:
        return None
    data = np.array(samples, dtype=np.float64)
    columns = [np.ones(len(data)), data[:, 0], data[:, 1]]
    kept = [0, 1, 2]
    while kept:
        matrix = np.stack([columns[i] for i in kept], axis=1)
        solution, *_ = np.linalg.lstsq(matrix, data[:, 2], rcond=None)
        if (solution >= 0).all():
            coefficients = [0.0, 0.0, 0.0]
            for index, value in zip(kept, solution, strict=True):
                coefficients[index] = float(value)
            if coefficients[1] == 0.0 and coefficients[2] == 0.0:
                return None  # no cost per token: nothing to weigh a read against
            return ComputeFit(*coefficients)
        kept.remove(kept[int(np.argmin(solution))])
    return None


@dataclass(frozen=True)
class FetchPlan:
    """How many leading pages of an L3 run to fetch, and the estimates behind it."""

    num_pages: int
    fetch_s: float  # estimated time to first token fetching those pages
    recompute_s: float  # ... fetching none (recomputing the whole run)
    measured: bool  # False: a rate not measured yet (the whole run, or the prior's share)


@dataclass(frozen=True)
class FetchRatesSnapshot:
    l3_read_bytes_per_s: float
    l3_latency_s: float
    l2_load_bytes_per_s: float
    compute: ComputeFit | None
    num_read_samples: int
    num_load_samples: int
    num_compute_samples: int
    pages_declined: int  # L3 pages left to recompute because fetching them was slower
    lookups_skipped: int  # runs not looked up in L3: no fetch of them could have paid
    l2_pages_declined: int  # L2 pages recomputed because loading them was slower


class FetchRates:
    """The rates one cache measured (see the module docstring). The owner serialises calls."""

    def __init__(
        self,
        *,
        l3_read_prior_bytes_per_s: float,
        l2_load_prior_bytes_per_s: float,
        l3_latency_prior_s: float,
    ):
        self.l3_read = _Average(l3_read_prior_bytes_per_s)
        self.l3_latency = _Average(0.0)
        self.l3_latency_prior_s = l3_latency_prior_s
        self.l2_load = _Average(l2_load_prior_bytes_per_s)
        self._steps: deque[tuple[int, int, float]] = deque(maxlen=COMPUTE_SAMPLES)
        self._fit: ComputeFit | None = None
        self._fit_stale = False
        self._declined_in_a_row = 0
        self._probe_due = False  # a skipped lookup's turn came: the next declined plan probes
        self._first_read_seen = False
        self.pages_declined = 0
        self.lookups_skipped = 0
        self.l2_pages_declined = 0

    # ------------------------------------------------------------------ measurements

    def record_lookup(self, seconds: float) -> None:
        """One L3 existence lookup's round trip."""
        if seconds >= 0:
            self.l3_latency.add(seconds)

    def record_read(self, num_bytes: int, seconds: float) -> None:
        """A finished prefetch: the bytes that arrived, submit to done. The first one is no
        sample: it pays what a backend's first read costs once (its reader's threads
        starting, the packs' tables read), and one low sample would have every later run
        declined until a probe (seen in bench_engine: docs/performance.md)."""
        if num_bytes < _MIN_READ_BYTES:
            return
        if not self._first_read_seen:
            self._first_read_seen = True
            return
        net = seconds - self.l3_latency.value
        self.l3_read.add(num_bytes / max(net, seconds / 4, 1e-9))

    def record_load(self, num_bytes: int, seconds: float) -> None:
        """A finished L2 -> L1 load, timed on the link."""
        if num_bytes and seconds > 0:
            self.l2_load.add(num_bytes / seconds)

    def record_compute(self, num_rows: int, num_pairs: int, seconds: float) -> None:
        """One engine step with no load in it: rows run, attention pairs, wall seconds."""
        if num_rows > 0 and seconds > 0:
            self._steps.append((num_rows, num_pairs, seconds))
            self._fit_stale = True

    @property
    def compute(self) -> ComputeFit | None:
        if self._fit_stale:
            self._fit = fit_compute(self._steps)
            self._fit_stale = False
        return self._fit

    def snapshot(self) -> FetchRatesSnapshot:
        return FetchRatesSnapshot(
            l3_read_bytes_per_s=self.l3_read.value,
            l3_latency_s=self.l3_latency.value,
            l2_load_bytes_per_s=self.l2_load.value,
            compute=self.compute,
            num_read_samples=self.l3_read.num_samples,
            num_load_samples=self.l2_load.num_samples,
            num_compute_samples=len(self._steps),
            pages_declined=self.pages_declined,
            lookups_skipped=self.lookups_skipped,
            l2_pages_declined=self.l2_pages_declined,
        )

    # ------------------------------------------------------------------ the choice

    def _store_rates(self) -> tuple[float, float, bool]:
        """(read bytes/s, latency s, measured): what an L3 read is weighed at. Until a read
        is measured: the prior rate, and the prior latency or the lookups' if longer."""
        if self.l3_read.num_samples:
            return self.l3_read.value, self.l3_latency.value, True
        latency = max(self.l3_latency.value, self.l3_latency_prior_s)
        return self.l3_read.value, latency, False

    def worth_looking(self, best_case: RunToFetch) -> bool:
        """Whether to look `best_case` up in L3 at all: the run as long as L3 could hold it
        (every page past the cached prefix). False when fetching no part of it could beat
        recomputing it, so that the plan after a lookup would fetch nothing anyway; then
        every PROBE_EVERY declined runs one is looked up all the same (and probed)."""
        compute = self.compute
        if compute is None or best_case.num_pages == 0:
            return best_case.num_pages > 0  # unmeasured: the whole run is fetched
        read_bytes_per_s, latency_s, measured = self._store_rates()
        if not measured and self._worth_probing(best_case, compute):
            return True  # what L3 holds may be read in the background (`probe_pages`)
        if _any_fetch_pays(best_case, compute, read_bytes_per_s, latency_s, self.l2_load.value):
            return True
        self._declined_in_a_row += 1
        if self._declined_in_a_row >= PROBE_EVERY:  # look at the store again
            self._declined_in_a_row = 0
            self._probe_due = True
            return True
        self.lookups_skipped += 1
        return False

    def probe_pages(self, run: RunToFetch) -> int:
        """Pages of `run`, which a request recomputes, to read into L2 in the background while
        the store's read rate is still the prior: one read batch, enough for a sample. Its
        request never waits for it; the next plans weigh what the store measured instead of a
        prior that may be far off either way (a file:// store on NVMe read at 29 GB/s against
        the prior's 2 on the H200, so every L3 hit was recomputed). 0 once a read is
        measured, when the batch is too small to be a sample, or when no store however fast
        could make a fetch of the run pay."""
        compute = self.compute
        if self.l3_read.num_samples or compute is None or not self._worth_probing(run, compute):
            return 0
        return min(run.num_pages, run.batch_pages)

    def _worth_probing(self, run: RunToFetch, compute: ComputeFit) -> bool:
        """Whether measuring the store could change a plan for `run`: its first batch is big
        enough to be a sample, and a fetch would pay from a store of no cost."""
        if min(run.num_pages, run.batch_pages) * run.page_bytes < _MIN_READ_BYTES:
            return False
        return _any_fetch_pays(run, compute, math.inf, 0.0, self.l2_load.value)

    def worth_loading(self, run: RunToFetch) -> bool:
        """Whether loading all of `run`, an L2 run past the L1 hit, into L1 beats
        recomputing its tokens: T(N) <= T(0) with the pages already in host memory (no
        read, no latency), only the L2 -> L1 link between them and the engine. True until
        the compute rate is measured."""
        compute = self.compute
        if compute is None or run.num_pages == 0:
            return True
        rates = (math.inf, 0.0, self.l2_load.value)
        load_s = _time_to_first_token(run, compute, run.num_pages, *rates)
        if load_s <= _time_to_first_token(run, compute, 0, *rates):
            return True
        self.l2_pages_declined += run.num_pages
        return False

    def plan(self, run: RunToFetch) -> FetchPlan:
        """How much of `run` to fetch (the leading part that is fastest in all)."""
        compute = self.compute
        if compute is None or run.num_pages == 0:
            return FetchPlan(run.num_pages, 0.0, 0.0, measured=False)
        read_bytes_per_s, latency_s, measured = self._store_rates()
        plan = plan_fetch(
            run,
            compute,
            read_bytes_per_s=read_bytes_per_s,
            latency_s=latency_s,
            load_bytes_per_s=self.l2_load.value,
        )
        if not measured:
            plan = dataclasses.replace(plan, measured=False)
        if plan.num_pages == 0:
            self._declined_in_a_row += 1
            if self._probe_due or self._declined_in_a_row >= PROBE_EVERY:  # look again
                self._declined_in_a_row = 0
                self._probe_due = False
                probe = min(run.num_pages, run.batch_pages)
                return FetchPlan(probe, plan.fetch_s, plan.recompute_s, measured=True)
        else:
            self._declined_in_a_row = 0
            self._probe_due = False
        self.pages_declined += run.num_pages - plan.num_pages
        return plan


@dataclass(frozen=True)
class RunToFetch:
    """An L3 run past a request's cached prefix.

    hit_tokens:    tokens of the prefix already in L1 or L2
    num_pages:     pages L3 holds right after them
    total_tokens:  the request's tokens (what the engine computes beyond the hit)
    batch_pages:   pages per read batch (the pipeline's grain)
    """

    hit_tokens: int
    num_pages: int
    page_size: int
    page_bytes: int
    total_tokens: int
    batch_pages: int = 1


def _time_to_first_token(
    run: RunToFetch,
    compute: ComputeFit,
    num_pages: int,
    read_bytes_per_s: float,
    latency_s: float,
    load_bytes_per_s: float,
) -> float:
    """T(num_pages) of `plan_fetch`."""
    io = 0.0
    if num_pages:
        slow = min(read_bytes_per_s, load_bytes_per_s)
        fast = max(read_bytes_per_s, load_bytes_per_s)
        io = (
            latency_s
            + num_pages * run.page_bytes / slow
            + min(num_pages, max(1, run.batch_pages)) * run.page_bytes / fast
        )
    start = min(run.hit_tokens + num_pages * run.page_size, run.total_tokens)
    rows = run.total_tokens - start
    return io + compute.seconds(rows, attention_pairs(start, run.total_tokens))


def _any_fetch_pays(
    run: RunToFetch,
    compute: ComputeFit,
    read_bytes_per_s: float,
    latency_s: float,
    load_bytes_per_s: float,
) -> bool:
    """Whether fetching some n in [1, run.num_pages] pages is at least as fast as none.

    T(n) - T(0) is concave in n over [1, N] while hit + N * page_size <= total (io(n) is
    concave: linear, then less steep past one batch; the compute saved is convex: rows
    linear, attention pairs quadratic), so its least value is at n = 1 or n = N: checking
    both answers for every n, and for every shorter run L3 may turn out to hold."""
    rates = (read_bytes_per_s, latency_s, load_bytes_per_s)
    recompute_s = _time_to_first_token(run, compute, 0, *rates)
    return any(
        _time_to_first_token(run, compute, n, *rates) <= recompute_s for n in {1, run.num_pages}
    )


def plan_fetch(
    run: RunToFetch,
    compute: ComputeFit,
    *,
    read_bytes_per_s: float,
    latency_s: float,
    load_bytes_per_s: float,
) -> FetchPlan:
    """The n in [0, run.num_pages] with the least estimated time to first token:

        io(n)      = latency + n * page_bytes / min(read, load)
                     + min(n, batch) * page_bytes / max(read, load)   (a two-stage pipeline)
        compute(n) = one step over the rows [min(hit + n * page_size, total), total)
        T(n)       = io(n) + compute(n)          (io(0) = 0)

    Ties go to the larger n (the same time, and the GPU is left to other requests)."""
    batch = max(1, run.batch_pages)
    rates = (read_bytes_per_s, latency_s, load_bytes_per_s)
    candidates = set(range(0, run.num_pages, batch)) | {run.num_pages}
    times = {n: _time_to_first_token(run, compute, n, *rates) for n in candidates}
    best = max(candidates, key=lambda n: (-times[n], n))
    return FetchPlan(num_pages=best, fetch_s=times[best], recompute_s=times[0], measured=True)
