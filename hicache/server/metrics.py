"""What the daemon did: calls by method and status, latency, and per-namespace page counters.

`ServerMetrics` is updated by the service on the event loop, and `snapshot()` copies it with
the stores' usage into a frozen `ServerSnapshot`, also on the loop. The Stats call answers
from a snapshot; so does Prometheus (`--metrics-port`): its HTTP thread asks the loop for one
on each scrape, so no thread ever reads state the loop is changing.
"""

from __future__ import annotations

import asyncio
from collections import Counter, defaultdict
from collections.abc import Mapping
from dataclasses import dataclass

from hicache.metrics import Histogram
from storage_backends import BackendStats

from .store import Store

PAGE_COUNTERS = (
    "hits",
    "misses",
    "puts",
    "put_rejected",
    "put_corrupt",
    "put_errors",
    "read_bytes",
    "written_bytes",
)
_SCRAPE_TIMEOUT_S = 5.0


class ServerMetrics:
    def __init__(self) -> None:
        self.calls: Counter[tuple[str, str]] = Counter()  # (method, status code name)
        self.latency: dict[str, Histogram] = defaultdict(Histogram)  # by method, seconds
        self.pages: dict[str, Counter[str]] = defaultdict(Counter)  # namespace -> PAGE_COUNTERS
        self.corrupt: dict[str, Counter[str]] = defaultdict(Counter)  # namespace -> reason
        self.in_flight = 0

    def observe_call(self, method: str, code: str, seconds: float) -> None:
        self.calls[method, code] += 1
        self.latency[method].observe(seconds)


@dataclass(frozen=True)
class NamespaceSnapshot:
    name: str
    memory: BackendStats
    spill: BackendStats | None
    pages: Mapping[str, int]  # PAGE_COUNTERS
    corrupt: Mapping[str, int]  # refused puts, by reason


@dataclass(frozen=True)
class ServerSnapshot:
    calls: Mapping[tuple[str, str], int]
    latency: Mapping[str, Histogram]
    in_flight: int
    namespaces: tuple[NamespaceSnapshot, ...]


def snapshot(metrics: ServerMetrics, store: Store) -> ServerSnapshot:
    """Copy everything; call on the daemon's event loop."""
    namespaces = []
    for name, namespace in store.namespaces.items():
        namespaces.append(
            NamespaceSnapshot(
                name=name,
                memory=namespace.memory.stats(),
                spill=namespace.spill.stats() if namespace.spill is not None else None,
                pages={counter: metrics.pages[name][counter] for counter in PAGE_COUNTERS},
                corrupt=dict(metrics.corrupt[name]),
            )
        )
    return ServerSnapshot(
        calls=dict(metrics.calls),
        latency={method: hist.copy() for method, hist in metrics.latency.items()},
        in_flight=metrics.in_flight,
        namespaces=tuple(namespaces),
    )


class ServerCollector:
    """Prometheus metrics of one daemon, from a snapshot taken on its loop at scrape time."""

    def __init__(
        self,
        metrics: ServerMetrics,
        store: Store,
        loop: asyncio.AbstractEventLoop,
        prefix: str = "hicache_server",
    ) -> None:
        self._metrics = metrics
        self._store = store
        self._loop = loop
        self._prefix = prefix

    async def _snapshot(self) -> ServerSnapshot:
        return snapshot(self._metrics, self._store)

    def collect(self):
        from prometheus_client.core import CounterMetricFamily as Counter_
        from prometheus_client.core import GaugeMetricFamily as Gauge
        from prometheus_client.core import HistogramMetricFamily as Histogram_

        future = asyncio.run_coroutine_threadsafe(self._snapshot(), self._loop)
        snap = future.result(timeout=_SCRAPE_TIMEOUT_S)
        p = self._prefix
        calls = Counter_(f"{p}_calls", "Calls answered", labels=["method", "code"])
        for (method, code), count in sorted(snap.calls.items()):
            calls.add_metric([method, code], count)
        latency = Histogram_(f"{p}_call_seconds", "Call durations", labels=["method"])
        for method, hist in sorted(snap.latency.items()):
            latency.add_metric([method], _buckets(hist), hist.total)
        yield from (calls, latency)
        yield Gauge(f"{p}_calls_in_flight", "Calls being served", value=snap.in_flight)
        pages = Counter_(f"{p}_pages", "Pages by outcome", labels=["namespace", "outcome"])
        corrupt = Counter_(
            f"{p}_corrupt_objects", "Objects refused on put", labels=["namespace", "reason"]
        )
        tier_labels = ["namespace", "tier"]
        objects = Gauge(f"{p}_objects", "Objects held", labels=tier_labels)
        stored = Gauge(f"{p}_stored_bytes", "Bytes held, headers included", labels=tier_labels)
        capacity = Gauge(f"{p}_capacity_bytes", "Bytes a namespace may hold", labels=tier_labels)
        evictions = Counter_(f"{p}_evictions", "Objects evicted", labels=tier_labels)
        for ns in snap.namespaces:
            for outcome, count in ns.pages.items():
                pages.add_metric([ns.name, outcome], count)
            for reason, count in sorted(ns.corrupt.items()):
                corrupt.add_metric([ns.name, reason], count)
            for tier, stats in (("memory", ns.memory), ("spill", ns.spill)):
                if stats is not None:
                    objects.add_metric([ns.name, tier], stats.num_objects or 0)
                    stored.add_metric([ns.name, tier], stats.stored_bytes or 0)
                    capacity.add_metric([ns.name, tier], stats.capacity_bytes or 0)
                    evictions.add_metric([ns.name, tier], stats.num_evictions)
        yield from (pages, corrupt, objects, stored, capacity, evictions)


def _buckets(hist: Histogram) -> list[tuple[str, int]]:
    cumulative, out = 0, []
    for bound, count in zip((*hist.buckets, float("inf")), hist.counts, strict=True):
        cumulative += count
        out.append(("+Inf" if bound == float("inf") else repr(bound), cumulative))
    return out


def start_metrics_server(collector: ServerCollector, host: str, port: int):
    """Serve Prometheus metrics at http://host:port/metrics; returns (server, bound port)."""
    from prometheus_client import CollectorRegistry, start_http_server

    registry = CollectorRegistry()
    registry.register(collector)
    server, _thread = start_http_server(port, addr=host, registry=registry)
    return server, server.server_address[1]
