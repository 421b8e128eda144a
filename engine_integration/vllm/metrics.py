"""The connector's counters in vLLM's stats and its Prometheus registry.

Each worker reports, every step, what its loads and saves did since the last step
(`HiCacheConnectorStats`: tokens loaded, tokens whose load failed, pages saved, saves
skipped); vLLM aggregates the workers' reports, logs them with its transfer metrics and
hands them to `HiCachePromMetrics`, which counts them in vLLM's `/metrics` as
`vllm:hicache_<name>_total` with vLLM's engine labels.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

COUNTERS = {
    "loaded_tokens": "Tokens hicache loaded into vLLM's blocks",
    "failed_tokens": "Tokens hicache promised but could not load (recomputed by vLLM)",
    "saved_pages": "Pages hicache saved from vLLM's blocks",
    "saves_skipped": "Saves hicache skipped (L1 full, a failed load, a released window)",
}


@dataclass
class HiCacheConnectorStats(KVConnectorStats):
    """Counts since the last report: `data` maps each of `COUNTERS` to an int."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> HiCacheConnectorStats:
        for name, value in other.data.items():
            self.data[name] = self.data.get(name, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())


class HiCachePromMetrics(KVConnectorPromMetrics):
    """One counter per `COUNTERS` entry and vLLM engine."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.counters = {}
        for name, documentation in COUNTERS.items():
            counter = self._counter_cls(
                name=f"vllm:hicache_{name}", documentation=documentation, labelnames=labelnames
            )
            for engine, values in per_engine_labelvalues.items():
                self.counters[(name, engine)] = counter.labels(*values)

    def observe(self, transfer_stats_data: dict, engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.items():
            counter = self.counters.get((name, engine_idx))
            if counter is not None and value:
                counter.inc(value)
