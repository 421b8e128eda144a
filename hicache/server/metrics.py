"""What the daemon did: calls by method and status, latency, and per-namespace page counters.

`ServerMetrics` is updated by the service on the event loop, and `snapshot()` copies it with
the stores' usage into a frozen `ServerSnapshot`, also on the loop. The Stats call answers
from a snapshot; so does Prometheus (`--metrics-port`): its HTTP thread asks the loop for one
on each scrape, so no thread ever reads state the loop is changing.

/metrics is served on its own port. When the daemon has tokens, a scrape must carry one
(`Authorization: Bearer <token>`, as gRPC calls do): a tenant's token shows that tenant's
namespaces only, and none of the server-wide series (calls, latency, streams); a token that
may use every namespace, or the `--metrics-token-file` one, shows everything.
"""

from __future__ import annotations

import asyncio
import http.server
import socket
import threading
from collections import Counter, defaultdict
from collections.abc import Mapping
from dataclasses import dataclass

from hicache.metrics import Histogram
from storage_backends import BackendStats

from .auth import ANYONE, Refused, Tenant, TokenCheck
from .store import Store
from .streams import StreamLimits

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
    num_spill_dropped: int  # evicted pages the spill did not take
    spilling_bytes: int  # evicted pages still being written to the spill
    in_flight_bytes: int  # held by unfinished BatchPut streams


@dataclass(frozen=True)
class ServerSnapshot:
    calls: Mapping[tuple[str, str], int]
    latency: Mapping[str, Histogram]
    in_flight: int
    num_streams: int  # BatchPut streams open
    streams_refused: Mapping[str, int]  # by limit
    namespaces: tuple[NamespaceSnapshot, ...]


def snapshot(
    metrics: ServerMetrics, store: Store, streams: StreamLimits, tenant: Tenant = ANYONE
) -> ServerSnapshot:
    """Copy everything `tenant` may see; call on the daemon's event loop."""
    namespaces = []
    for name, namespace in store.namespaces.items():
        if not tenant.may_use(name):
            continue
        memory = namespace.memory
        namespaces.append(
            NamespaceSnapshot(
                name=name,
                memory=memory.stats(),
                spill=namespace.spill.stats() if namespace.spill is not None else None,
                pages={counter: metrics.pages[name][counter] for counter in PAGE_COUNTERS},
                corrupt=dict(metrics.corrupt[name]),
                num_spill_dropped=memory.num_spill_dropped,
                spilling_bytes=memory.spilling_bytes,
                in_flight_bytes=namespace.in_flight_bytes,
            )
        )
    return ServerSnapshot(
        calls=dict(metrics.calls),
        latency={method: hist.copy() for method, hist in metrics.latency.items()},
        in_flight=metrics.in_flight,
        num_streams=streams.num_streams,
        streams_refused=dict(streams.num_refused),
        namespaces=tuple(namespaces),
    )


class ServerCollector:
    """Prometheus metrics of one daemon, from a snapshot taken on its loop at scrape time."""

    def __init__(
        self,
        metrics: ServerMetrics,
        store: Store,
        streams: StreamLimits,
        loop: asyncio.AbstractEventLoop,
        prefix: str = "hicache_server",
        tenant: Tenant = ANYONE,
    ) -> None:
        self._metrics = metrics
        self._store = store
        self._streams = streams
        self._loop = loop
        self._prefix = prefix
        self._tenant = tenant

    def for_tenant(self, tenant: Tenant) -> ServerCollector:
        """The same metrics as `tenant` may see them."""
        return ServerCollector(
            self._metrics, self._store, self._streams, self._loop, self._prefix, tenant
        )

    async def _snapshot(self) -> ServerSnapshot:
        return snapshot(self._metrics, self._store, self._streams, self._tenant)

    def collect(self):
        future = asyncio.run_coroutine_threadsafe(self._snapshot(), self._loop)
        snap = future.result(timeout=_SCRAPE_TIMEOUT_S)
        if self._tenant.namespaces is None:  # server-wide series: for who sees everything
            yield from self._server_series(snap)
        yield from self._namespace_series(snap)

    def _server_series(self, snap: ServerSnapshot):
        from prometheus_client.core import CounterMetricFamily as Counter_
        from prometheus_client.core import GaugeMetricFamily as Gauge
        from prometheus_client.core import HistogramMetricFamily as Histogram_

        p = self._prefix
        calls = Counter_(f"{p}_calls", "Calls answered", labels=["method", "code"])
        for (method, code), count in sorted(snap.calls.items()):
            calls.add_metric([method, code], count)
        latency = Histogram_(f"{p}_call_seconds", "Call durations", labels=["method"])
        for method, hist in sorted(snap.latency.items()):
            latency.add_metric([method], _buckets(hist), hist.total)
        yield from (calls, latency)
        yield Gauge(f"{p}_calls_in_flight", "Calls being served", value=snap.in_flight)
        yield Gauge(f"{p}_put_streams", "BatchPut streams open", value=snap.num_streams)
        refused = Counter_(
            f"{p}_put_streams_refused", "BatchPut streams refused by a limit", labels=["limit"]
        )
        for limit, count in sorted(snap.streams_refused.items()):
            refused.add_metric([limit], count)
        yield refused

    def _namespace_series(self, snap: ServerSnapshot):
        from prometheus_client.core import CounterMetricFamily as Counter_
        from prometheus_client.core import GaugeMetricFamily as Gauge

        p = self._prefix
        pages = Counter_(f"{p}_pages", "Pages by outcome", labels=["namespace", "outcome"])
        corrupt = Counter_(
            f"{p}_corrupt_objects", "Objects refused on put", labels=["namespace", "reason"]
        )
        tier_labels = ["namespace", "tier"]
        objects = Gauge(f"{p}_objects", "Objects held", labels=tier_labels)
        stored = Gauge(f"{p}_stored_bytes", "Bytes held, headers included", labels=tier_labels)
        capacity = Gauge(f"{p}_capacity_bytes", "Bytes a namespace may hold", labels=tier_labels)
        evictions = Counter_(f"{p}_evictions", "Objects evicted", labels=tier_labels)
        spill_corrupt = Counter_(
            f"{p}_spill_corrupt_objects", "Damaged spill pages read", labels=["namespace", "reason"]
        )
        dropped = Counter_(
            f"{p}_spill_dropped", "Evicted pages the spill did not take", labels=["namespace"]
        )
        held = Gauge(
            f"{p}_held_bytes",
            "Bytes held outside the page store",
            labels=["namespace", "what"],  # what: streams (unfinished puts), spilling
        )
        for ns in snap.namespaces:
            for outcome, count in ns.pages.items():
                pages.add_metric([ns.name, outcome], count)
            for reason, count in sorted(ns.corrupt.items()):
                corrupt.add_metric([ns.name, reason], count)
            for reason, count in sorted((ns.spill.num_corrupt if ns.spill else {}).items()):
                spill_corrupt.add_metric([ns.name, reason], count)
            dropped.add_metric([ns.name], ns.num_spill_dropped)
            held.add_metric([ns.name, "streams"], ns.in_flight_bytes)
            held.add_metric([ns.name, "spilling"], ns.spilling_bytes)
            for tier, stats in (("memory", ns.memory), ("spill", ns.spill)):
                if stats is not None:
                    objects.add_metric([ns.name, tier], stats.num_objects or 0)
                    stored.add_metric([ns.name, tier], stats.stored_bytes or 0)
                    capacity.add_metric([ns.name, tier], stats.capacity_bytes or 0)
                    evictions.add_metric([ns.name, tier], stats.num_evictions)
        yield from (pages, corrupt, objects, stored, capacity, evictions)
        yield from (spill_corrupt, dropped, held)


def _buckets(hist: Histogram) -> list[tuple[str, int]]:
    cumulative, out = 0, []
    for bound, count in zip((*hist.buckets, float("inf")), hist.counts, strict=True):
        cumulative += count
        out.append(("+Inf" if bound == float("inf") else repr(bound), cumulative))
    return out


def start_metrics_server(
    collector: ServerCollector, auth: TokenCheck | None, host: str, port: int
) -> tuple[http.server.ThreadingHTTPServer, int]:
    """Serve Prometheus metrics at http://host:port/metrics on a thread; with `auth`, a scrape
    needs a token and sees what that token's tenant may. Returns (server, bound port)."""
    from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the http.server spelling
            if self.path.split("?")[0] not in ("/metrics", "/"):
                return self._reply(404, b"not found: scrape /metrics\n", "text/plain")
            tenant = ANYONE
            if auth is not None:
                try:
                    tenant = auth.http_tenant(self.headers.get("Authorization"))
                except Refused as exc:
                    return self._reply(401, f"{exc}\n".encode(), "text/plain")
            registry = CollectorRegistry(auto_describe=False)
            registry.register(collector.for_tenant(tenant))
            self._reply(200, generate_latest(registry), CONTENT_TYPE_LATEST)

        def _reply(self, status: int, body: bytes, content_type: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            if status == 401:
                self.send_header("WWW-Authenticate", "Bearer")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args) -> None:  # noqa: A002 - scrapes are not news
            pass

    server_class = _HTTPServer6 if ":" in host else http.server.ThreadingHTTPServer
    server = server_class((host.strip("[]"), port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="hicache-metrics", daemon=True).start()
    return server, server.server_address[1]


class _HTTPServer6(http.server.ThreadingHTTPServer):
    address_family = socket.AF_INET6
