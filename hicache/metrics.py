"""What a HiCache did: counters and histograms, a `HiCacheStats` snapshot, Prometheus export.

The controller updates a `Metrics` object under its own lock; `stats()` copies it into a
frozen `HiCacheStats`. `PrometheusCollector` turns any object with a `stats()` method into
Prometheus metrics on each scrape, for a process that wants an HTTP endpoint
(`serve_prometheus`). Nothing here is global: each cache has its own numbers.
"""

from __future__ import annotations

import bisect
import dataclasses
from dataclasses import dataclass, field

TIERS = ("l1", "l2", "l3")
DIRECTIONS = ("l1_to_l2", "l2_to_l1", "l2_to_l3", "l3_to_l2")
# Upper bounds, seconds: transfers from 10 us to 10 s.
SECONDS_BUCKETS = (1e-5, 1e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0)


@dataclass
class Histogram:
    buckets: tuple[float, ...] = SECONDS_BUCKETS
    counts: list[int] = field(default_factory=list)  # per bucket, plus one for +Inf
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.count += 1

    def copy(self) -> Histogram:
        return Histogram(self.buckets, list(self.counts), self.total, self.count)


@dataclass(frozen=True)
class HiCacheStats:
    """A snapshot of one cache's counters. Tokens and pages count full pages only."""

    requests: int
    requested_tokens: int
    hit_tokens: dict[str, int]  # by tier the hit came from: l1, l2, l3
    hit_pages: dict[str, int]
    inserted_pages: int
    duplicate_pages: int
    ops: dict[str, int]  # transfer ops completed, by direction
    pages_moved: dict[str, int]
    bytes_moved: dict[str, int]
    transfer_seconds: dict[str, float]  # summed op durations, by direction
    prefetches_issued: int
    prefetches_completed: int
    prefetches_cut_short: int  # the request went ahead before all its L3 pages arrived
    prefetch_pages_missing: int  # promised by an L3 lookup, then absent or corrupt
    l3_lookups: int  # existence lookups sent to L3
    l3_lookups_spared: int  # not sent: the caller's recent lookup of the request stood
    shortened_tokens: int  # matched, then cut by the engine (`HiCache.shorten`: KV missing)
    evicted_pages: dict[str, int]  # by tier
    writes_skipped: int  # backups or L3 writes skipped for lack of room
    background_errors: int
    l3_errors: int
    l3_corrupt_pages: int
    l1_pages_used: int
    l1_pages_total: int
    l2_pages_used: int
    l2_pages_total: int
    index_nodes: int
    transfer_latency: dict[str, Histogram]  # op durations, by direction

    @property
    def total_hit_tokens(self) -> int:
        return sum(self.hit_tokens.values())

    @property
    def hit_rate(self) -> float:
        return self.total_hit_tokens / self.requested_tokens if self.requested_tokens else 0.0

    def gb_per_s(self, direction: str) -> float:
        """Bytes over summed op time: the achieved rate of one direction."""
        seconds = self.transfer_seconds[direction]
        return self.bytes_moved[direction] / seconds / 1e9 if seconds else 0.0

    def as_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["transfer_latency"] = {
            direction: {"count": h.count, "sum_s": h.total}
            for direction, h in self.transfer_latency.items()
        }
        out["hit_rate"] = self.hit_rate
        return out


class Metrics:
    """The mutable counters behind `HiCacheStats`; the owner serialises updates."""

    def __init__(self) -> None:
        self.requests = 0
        self.requested_tokens = 0
        self.hit_tokens = dict.fromkeys(TIERS, 0)
        self.hit_pages = dict.fromkeys(TIERS, 0)
        self.inserted_pages = 0
        self.duplicate_pages = 0
        self.ops = dict.fromkeys(DIRECTIONS, 0)
        self.pages_moved = dict.fromkeys(DIRECTIONS, 0)
        self.bytes_moved = dict.fromkeys(DIRECTIONS, 0)
        self.transfer_seconds = dict.fromkeys(DIRECTIONS, 0.0)
        self.transfer_latency = {direction: Histogram() for direction in DIRECTIONS}
        self.prefetches_issued = 0
        self.prefetches_completed = 0
        self.prefetches_cut_short = 0
        self.prefetch_pages_missing = 0
        self.l3_lookups = 0
        self.l3_lookups_spared = 0
        self.shortened_tokens = 0
        self.evicted_pages = dict.fromkeys(TIERS, 0)
        self.writes_skipped = 0
        self.background_errors = 0

    def record_hit(self, tier: str, num_pages: int, page_size: int) -> None:
        self.hit_pages[tier] += num_pages
        self.hit_tokens[tier] += num_pages * page_size

    def record_transfer(
        self, direction: str, num_pages: int, num_bytes: int, seconds: float
    ) -> None:
        self.ops[direction] += 1
        self.pages_moved[direction] += num_pages
        self.bytes_moved[direction] += num_bytes
        self.transfer_seconds[direction] += seconds
        self.transfer_latency[direction].observe(seconds)

    def snapshot(self, **gauges) -> HiCacheStats:
        """Copy the counters, adding point-in-time values (pool usage, L3 counters)."""
        copied = {}
        for f in dataclasses.fields(HiCacheStats):
            if f.name in gauges:
                continue
            value = getattr(self, f.name)
            if f.name == "transfer_latency":
                value = {direction: hist.copy() for direction, hist in value.items()}
            elif isinstance(value, dict):
                value = dict(value)
            copied[f.name] = value
        return HiCacheStats(**copied, **gauges)


class PrometheusCollector:
    """Exposes `source.stats()` (a HiCacheStats) as Prometheus metrics on every scrape."""

    def __init__(self, source, prefix: str = "hicache") -> None:
        self._source = source
        self._prefix = prefix

    def collect(self):
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )

        stats: HiCacheStats = self._source.stats()
        p = self._prefix

        def counter(name, doc, value, labels=None):
            family = CounterMetricFamily(f"{p}_{name}", doc, labels=list(labels or {}))
            family.add_metric(list((labels or {}).values()), value)
            return family

        def by_label(name, doc, label, values, kind=CounterMetricFamily):
            family = kind(f"{p}_{name}", doc, labels=[label])
            for key, value in values.items():
                family.add_metric([key], value)
            return family

        yield counter("requests", "Match calls", stats.requests)
        yield counter("requested_tokens", "Full-page tokens asked for", stats.requested_tokens)
        yield by_label("hit_tokens", "Tokens served, by source tier", "tier", stats.hit_tokens)
        yield by_label("hit_pages", "Pages served, by source tier", "tier", stats.hit_pages)
        yield counter("inserted_pages", "Pages added to the index", stats.inserted_pages)
        yield by_label("transfer_ops", "Transfer ops completed", "direction", stats.ops)
        yield by_label("transfer_pages", "Pages moved", "direction", stats.pages_moved)
        yield by_label("transfer_bytes", "Bytes moved", "direction", stats.bytes_moved)
        yield counter("prefetches_issued", "L3 prefetches started", stats.prefetches_issued)
        yield counter("prefetches_completed", "L3 prefetches finished", stats.prefetches_completed)
        yield counter(
            "prefetches_cut_short",
            "Requests that went ahead before their L3 prefetch finished",
            stats.prefetches_cut_short,
        )
        yield counter("l3_lookups", "L3 existence lookups sent", stats.l3_lookups)
        yield counter(
            "l3_lookups_spared",
            "L3 lookups not sent: the caller's recent lookup of the request stood",
            stats.l3_lookups_spared,
        )
        yield by_label("evicted_pages", "Pages evicted, by tier", "tier", stats.evicted_pages)
        yield counter("l3_errors", "L3 calls that failed or timed out", stats.l3_errors)
        yield counter("l3_corrupt_pages", "L3 pages rejected on read", stats.l3_corrupt_pages)
        yield counter(
            "background_errors", "Failures in background transfers", stats.background_errors
        )
        usage = GaugeMetricFamily(f"{p}_pages_used", "Pages in use, by tier", labels=["tier"])
        usage.add_metric(["l1"], stats.l1_pages_used)
        usage.add_metric(["l2"], stats.l2_pages_used)
        yield usage
        total = GaugeMetricFamily(f"{p}_pages_total", "Pool size in pages", labels=["tier"])
        total.add_metric(["l1"], stats.l1_pages_total)
        total.add_metric(["l2"], stats.l2_pages_total)
        yield total
        latency = HistogramMetricFamily(
            f"{p}_transfer_seconds", "Transfer op durations", labels=["direction"]
        )
        for direction, hist in stats.transfer_latency.items():
            cumulative, buckets = 0, []
            for bound, count in zip((*hist.buckets, float("inf")), hist.counts, strict=True):
                cumulative += count
                buckets.append(("+Inf" if bound == float("inf") else repr(bound), cumulative))
            latency.add_metric([direction], buckets, hist.total)
        yield latency


def serve_prometheus(source, port: int, addr: str = "127.0.0.1"):
    """Serve `source.stats()` at http://addr:port/metrics; returns the server."""
    from prometheus_client import CollectorRegistry, start_http_server

    registry = CollectorRegistry()
    registry.register(PrometheusCollector(source))
    server, _thread = start_http_server(port, addr=addr, registry=registry)
    return server
