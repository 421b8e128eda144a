"""The cache-server daemon (`hicache serve`): many engine instances share one L3 over gRPC.

    config.py   ServerConfig: flags, defaults and their checks
    store.py    the pages: a memory store per namespace, over an optional file spill
    service.py  the hicache.v1.KVStore calls, request checks, statuses
    streams.py  BatchPut streams: pages put back together, the limits on what they hold
    auth.py     bearer tokens: who calls, which namespaces it may use
    tenants.py  the tenants file (--tenants-file): tokens bound to namespaces
    errors.py   RequestError: a refused request and its status
    metrics.py  counters, the Stats snapshot, Prometheus
    daemon.py   the gRPC server, health service, graceful shutdown
    cli.py      the `hicache serve` flags

The protocol (storage_backends/proto/kvstore.proto) and the client (`grpc://`, in
storage_backends.grpc_store) live one layer down, where the engine's L3 backends are. Never
imports torch.
"""

from .config import NamespaceSpec, ServerConfig

__all__ = ["NamespaceSpec", "ServerConfig"]
