"""hicache inside vLLM: a KV connector (vLLM's `KVConnectorBase_V1`, vllm 0.33).

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "HiCacheConnector",
        "kv_connector_module_path": "engine_integration.vllm.connector",
        "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"l2_size": "64GiB", "l3_url": "redis://host:6379/0"}}'

vLLM keeps its own GPU blocks and prefix cache; behind them hicache adds a pinned host tier
(L2) and shared storage (L3) under its radix index and policies, every page verified on its
way back. vLLM builds the class twice, through `KVConnectorFactory`, as
`HiCacheConnector(vllm_config, role, kv_cache_config)`: the SCHEDULER one decides what to
load and save (`engine_integration.vllm.plan`), each WORKER one (one per tensor-parallel
rank) moves the bytes (`engine_integration.vllm.worker`, `engine_integration.vllm.kv`) of
its own `HiCache`, created when vLLM registers its KV tensors, under a namespace of its
rank. The scheduler learns what the caches hold through `engine_integration.vllm.lookup`:
directly when the one worker shares its process (world size 1, vLLM's `uni` executor, its
default for one GPU), else from every rank over a local socket. Pipeline parallelism is
refused at construction.

What the connector reads of `vllm_config`: `kv_transfer_config` (engine_id,
kv_connector_extra_config, kv_load_failure_policy), `model_config.model`,
`parallel_config.tensor_parallel_size`, `.pipeline_parallel_size`,
`.distributed_executor_backend`, `.data_parallel_rank` and `.rank` (a worker's rank
before vLLM's groups exist),
`scheduler_config.max_num_batched_tokens` (and, through vLLM's factory,
`scheduler_config.disable_hybrid_kv_cache_manager`).
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

from engine_integration.vllm import config as vllm_setup
from engine_integration.vllm.kv import VllmKV
from engine_integration.vllm.lookup import (
    CacheLookup,
    Found,
    LookupClient,
    LookupServer,
    ask_all,
    lookup_address,
)
from engine_integration.vllm.plan import SchedulerPlanner, StepPlan
from engine_integration.vllm.worker import WorkerStep
from hicache.controller import HiCache

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
        if getattr(parallel, "pipeline_parallel_size", 1) > 1:
            raise ValueError(
                "HiCacheConnector: pipeline parallelism is not supported yet "
                f"(pipeline_parallel_size {parallel.pipeline_parallel_size})"
            )
        if transfer.kv_load_failure_policy != "recompute":
            logger.warning(
                "HiCacheConnector: kv_load_failure_policy=%r fails a request whose cached "
                "page does not verify; 'recompute' recomputes it instead",
                transfer.kv_load_failure_policy,
            )
        self._engine_id = transfer.engine_id
        self._data_parallel_rank = getattr(parallel, "data_parallel_rank", 0) or 0
        self._num_ranks = getattr(parallel, "tensor_parallel_size", 1)
        backend = getattr(parallel, "distributed_executor_backend", None) or "uni"
        # One worker in the scheduler's process: both halves share the cache directly.
        self._in_process = self._num_ranks == 1 and backend == "uni"
        self._settings = vllm_setup.read_settings(
            transfer.kv_connector_extra_config, vllm_config.model_config.model
        )
        self._spec, self._layer_names = vllm_setup.attention_group(kv_cache_config)
        self._layout = vllm_setup.kv_layout(
            self._spec, len(self._layer_names), self._settings.page_size
        )
        self._step_tokens = vllm_config.scheduler_config.max_num_batched_tokens
        # The settings checked on both sides; the worker makes its cache with them.
        self._config = vllm_setup.cache_config(
            self._settings, self._layout, "cpu", self._step_tokens
        )
        self._rank = _tensor_parallel_rank(parallel) if role == KVConnectorRole.WORKER else 0
        self._shared: vllm_setup.SharedCache | None = None
        self._server: LookupServer | None = None
        self._clients: list[LookupClient] = []
        self._planner: SchedulerPlanner | None = None
        self._worker: WorkerStep | None = None

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config) -> bool:
        return False  # the worker holds views of the KV tensors registered at start

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        return True  # loads and saves run per layer, between the graph's pieces

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a save that does not happen is a later miss

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict) -> None:
        kv = VllmKV(kv_caches, self._layer_names, self._spec, self._kv_cache_config.num_blocks)
        config = vllm_setup.cache_config(
            self._settings, self._layout, str(kv.device), self._step_tokens
        )
        cache = HiCache(config)
        lookup = CacheLookup(
            cache, self._settings.model_id, self._layout, self._rank, self._num_ranks
        )
        self._shared = vllm_setup.SharedCache(cache, lookup)
        if self._in_process:
            vllm_setup.publish(self._engine_id, self._shared)
        else:
            address = lookup_address(self._engine_id, self._rank, self._data_parallel_rank)
            self._server = LookupServer(lookup, address)
        self._worker = WorkerStep(cache, kv, self._layout.page_size, lookup.namespace)
        logger.info(
            "HiCacheConnector rank %d of %d: %d layers of %s, vLLM blocks of %d tokens, "
            "hicache pages of %d; L1 %d staging pages, L2 %d pages, L3 %s",
            self._rank,
            self._num_ranks,
            kv.num_layers,
            self._layout.descriptor(),
            kv.block_size,
            self._layout.page_size,
            config.l1.num_pages,
            cache.executor.num_host_pages,
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
        """Requests whose final save is done (loads are synchronous: none to report)."""
        sent = self._worker.take_finished_sending() if self._worker is not None else set()
        return sent or None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_failed_blocks() if self._worker is not None else set()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
            self._worker = None
        if self._server is not None:
            self._server.close()
            self._server = None
        for client in self._clients:
            client.close()
        self._clients = []
        shared, self._shared = self._shared, None
        if shared is None:
            return
        # In one process the last of the two halves closes it; else the worker owns it.
        last = vllm_setup.let_go(self._engine_id, shared) if self._in_process else True
        if last:
            try:
                shared.cache.flush()  # what was saved reaches L3 before the process ends
            finally:
                shared.cache.close()

    def _worker_step(self) -> WorkerStep:
        if self._worker is None:
            raise RuntimeError("HiCacheConnector: register_kv_caches was not called")
        return self._worker

    # ------------------------------------------------------------------ scheduler side

    def _scheduler(self) -> SchedulerPlanner:
        """The planner, over the worker's cache in this process or the workers' sockets."""
        if self._planner is not None:
            return self._planner
        if self._in_process:
            self._shared = vllm_setup.find(self._engine_id)
            if self._shared is None:
                raise RuntimeError(
                    "HiCacheConnector: no worker-side connector in this process, and vLLM's "
                    "executor is 'uni': register_kv_caches has not run"
                )
            find = self._shared.lookup.find
        else:
            timeout_s = self._config.l3.exists_timeout_s + 1.0
            self._clients = [
                LookupClient(
                    lookup_address(self._engine_id, r, self._data_parallel_rank), timeout_s
                )
                for r in range(self._num_ranks)
            ]

            def find(tokens: list[int], extra_key: str) -> Found:
                return ask_all(self._clients, tokens, extra_key)

        self._planner = SchedulerPlanner(
            find, self._layout.page_size, self._spec.block_size, self._config.l1.num_pages
        )
        return self._planner

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        return self._scheduler().num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        block_ids = blocks.get_block_ids()[0] if num_external_tokens else []
        self._scheduler().after_alloc(request, block_ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        planner = self._scheduler()
        block_state = scheduler_output.kv_connector_block_state

        def block_ids_of(req_id: str) -> list[int]:
            if block_state is not None:
                return block_state.get_block_ids(req_id)[0]
            return self._kv_cache_manager.get_block_ids(req_id)[0]

        return HiCacheConnectorMetadata(planner.build_metadata(scheduler_output, block_ids_of))

    def update_connector_output(self, connector_output) -> None:
        if connector_output.invalid_block_ids:
            self._scheduler().load_errors(set(connector_output.invalid_block_ids))
        if connector_output.finished_sending:
            self._scheduler().sent(connector_output.finished_sending)

    def has_pending_block_frees(self) -> bool:
        """Blocks kept for final saves come back within a step: worth waiting for."""
        return self._planner is not None and bool(self._planner.sending)

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict | None]:
        return self._scheduler().finished(request, block_ids)

    def request_finished_all_groups(self, request, block_ids) -> tuple[bool, dict | None]:
        return self._scheduler().finished(request, block_ids[0])

    def get_external_cache_hit_sources(self, request, num_external_tokens: int):
        """Split a hit by the tier that supplied it: hicache's L1 and L2 count as host
        memory, its L3 as disk (the nearest of vLLM's names for shared storage)."""
        lookup = self._scheduler().lookup(request.request_id)
        if not num_external_tokens or lookup is None:
            return super().get_external_cache_hit_sources(request, num_external_tokens)
        page_size = self._layout.page_size
        host_end = (lookup.found.num_l1_pages + lookup.found.num_l2_pages) * page_size
        host = max(0, min(host_end - lookup.first_token, num_external_tokens))
        sources = {CacheHitSource.HOST: host, CacheHitSource.DISK: num_external_tokens - host}
        return {source: count for source, count in sources.items() if count}


def _tensor_parallel_rank(parallel) -> int:
    """This worker's rank among the tensor-parallel workers (vLLM's group once it exists,
    else the config's rank)."""
    from vllm.distributed import parallel_state

    if parallel_state.model_parallel_is_initialized():
        return parallel_state.get_tensor_model_parallel_rank()
    return getattr(parallel, "rank", 0)
