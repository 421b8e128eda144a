"""hicache inside vLLM: a KV connector (vLLM's `KVConnectorBase_V1`, vllm 0.33).

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "HiCacheConnector",
        "kv_connector_module_path": "engine_integration.vllm_connector",
        "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"l2_size": "64GiB", "l3_url": "redis://host:6379/0"}}'

vLLM keeps its own GPU blocks and prefix cache; behind them hicache adds a pinned host tier
(L2) and shared storage (L3) under its radix index and policies, every page verified on its
way back. vLLM builds the class twice, through `KVConnectorFactory`, as
`HiCacheConnector(vllm_config, role, kv_cache_config)`: the SCHEDULER one decides what to
load and save (`engine_integration.vllm_plan`), the WORKER one moves the bytes
(`engine_integration.vllm_worker`, `engine_integration.vllm_kv`). Both use the one
`HiCache` of the engine (`engine_integration.vllm_setup`), which the worker creates when
vLLM registers its KV tensors; this needs the worker in the scheduler's process (world
size 1 and vLLM's `uni` executor, its default for one GPU), and anything else is refused
at construction.

What the connector reads of `vllm_config`: `kv_transfer_config` (engine_id,
kv_connector_extra_config, kv_load_failure_policy), `model_config.model`,
`parallel_config.world_size` and `.distributed_executor_backend`,
`scheduler_config.max_num_batched_tokens`
(and, through vLLM's factory, `scheduler_config.disable_hybrid_kv_cache_manager`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from engine_integration import vllm_setup
from engine_integration.vllm_kv import VllmKV
from engine_integration.vllm_plan import SchedulerPlanner, StepPlan
from engine_integration.vllm_worker import WorkerStep

logger = logging.getLogger(__name__)


@dataclass
class HiCacheConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> worker, once a step: the step's loads and saves."""

    plan: StepPlan = field(default_factory=StepPlan)


class HiCacheConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM KV connector backed by a `hicache.controller.HiCache` (see the module doc)."""

    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        transfer = self._kv_transfer_config
        parallel = vllm_config.parallel_config
        backend = getattr(parallel, "distributed_executor_backend", None) or "uni"
        if parallel.world_size > 1 or backend != "uni":
            raise ValueError(
                f"HiCacheConnector: world_size {parallel.world_size} with executor backend "
                f"{backend!r} is not supported yet; the scheduler reads the cache its worker "
                "fills, in one process: one GPU per engine, distributed_executor_backend 'uni'"
            )
        if transfer.kv_load_failure_policy != "recompute":
            logger.warning(
                "HiCacheConnector: kv_load_failure_policy=%r fails a request whose cached "
                "page does not verify; 'recompute' recomputes it instead",
                transfer.kv_load_failure_policy,
            )
        self._engine_id = transfer.engine_id
        self._settings = vllm_setup.read_settings(
            transfer.kv_connector_extra_config, vllm_config.model_config.model
        )
        self._spec, self._layer_names = vllm_setup.attention_group(kv_cache_config)
        self._layout = vllm_setup.kv_layout(
            self._spec, len(self._layer_names), self._settings.page_size
        )
        self._step_tokens = vllm_config.scheduler_config.max_num_batched_tokens
        self._shared: vllm_setup.SharedCache | None = None
        self._planner = SchedulerPlanner(self._spec.block_size)
        self._worker: WorkerStep | None = None

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        return True  # loads and saves run per layer, between the graph's pieces

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a save that does not happen is a later miss

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict) -> None:
        from hicache.controller import HiCache

        kv = VllmKV(kv_caches, self._layer_names, self._spec, self._kv_cache_config.num_blocks)
        config = vllm_setup.cache_config(
            self._settings, self._layout, str(kv.device), self._step_tokens
        )
        shared = vllm_setup.SharedCache(HiCache(config), self._settings.model_id, self._layout)
        self._shared = vllm_setup.publish(self._engine_id, shared)
        self._worker = WorkerStep(shared.cache, kv, self._layout.page_size)
        logger.info(
            "HiCacheConnector: %d layers of %s, vLLM blocks of %d tokens, hicache pages of "
            "%d; L1 %d staging pages, L2 %d pages, L3 %s",
            kv.num_layers,
            self._layout.descriptor(),
            kv.block_size,
            self._layout.page_size,
            config.l1.num_pages,
            shared.cache.executor.num_host_pages,
            config.l3.url or "none",
        )

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if not isinstance(connector_metadata, HiCacheConnectorMetadata):
            raise TypeError(
                f"HiCacheConnector got {type(connector_metadata).__name__} as its metadata"
            )
        self._worker_step().bind(connector_metadata.plan)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        self._worker_step().start()

    def wait_for_layer_load(self, layer_name: str) -> None:
        worker = self._worker_step()
        worker.wait_layer(worker.kv.layer_index(layer_name))

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        worker = self._worker_step()
        worker.save_layer(worker.kv.layer_index(layer_name))

    def wait_for_save(self) -> None:
        self._worker_step().finish()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return None, None  # loads are synchronous and saves keep no blocks

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_failed_blocks() if self._worker is not None else set()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
            self._worker = None
        if self._shared is not None:
            shared, self._shared = self._shared, None
            if vllm_setup.let_go(self._engine_id, shared):
                try:
                    shared.cache.flush()  # what was saved reaches L3 before the process ends
                finally:
                    shared.cache.close()

    def _worker_step(self) -> WorkerStep:
        if self._worker is None:
            raise RuntimeError("HiCacheConnector: register_kv_caches was not called")
        return self._worker

    # ------------------------------------------------------------------ scheduler side

    def _scheduler_cache(self) -> vllm_setup.SharedCache:
        if self._shared is None:
            self._shared = vllm_setup.find(self._engine_id)
            if self._shared is None:
                raise RuntimeError(
                    "HiCacheConnector: no worker-side connector in this process; the "
                    "scheduler and its worker must share a process (world size 1, "
                    "distributed_executor_backend 'uni')"
                )
            self._planner.shared = self._shared
        return self._shared

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        self._scheduler_cache()
        return self._planner.num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        self._scheduler_cache()
        block_ids = blocks.get_block_ids()[0] if num_external_tokens else []
        self._planner.after_alloc(request, block_ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        self._scheduler_cache()
        block_state = scheduler_output.kv_connector_block_state

        def block_ids_of(req_id: str) -> list[int]:
            if block_state is not None:
                return block_state.get_block_ids(req_id)[0]
            return self._kv_cache_manager.get_block_ids(req_id)[0]

        plan = self._planner.build_metadata(scheduler_output, block_ids_of)
        return HiCacheConnectorMetadata(plan)

    def update_connector_output(self, connector_output) -> None:
        if connector_output.invalid_block_ids:
            self._planner.load_errors(set(connector_output.invalid_block_ids))

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict | None]:
        return self._planner.finished(request)

    def request_finished_all_groups(self, request, block_ids) -> tuple[bool, dict | None]:
        return self._planner.finished(request)

    def get_external_cache_hit_sources(self, request, num_external_tokens: int):
        """Split a hit by the tier that supplied it: hicache's L1 and L2 count as host
        memory, its L3 as disk (the nearest of vLLM's names for shared storage)."""
        lookup = self._planner.lookup(request.request_id)
        if not num_external_tokens or lookup is None:
            return super().get_external_cache_hit_sources(request, num_external_tokens)
        page_size = self._layout.page_size
        host_end = (lookup.tiers[0] + lookup.tiers[1]) * page_size
        host = max(0, min(host_end - lookup.first_token, num_external_tokens))
        sources = {CacheHitSource.HOST: host, CacheHitSource.DISK: num_external_tokens - host}
        return {source: count for source, count in sources.items() if count}
