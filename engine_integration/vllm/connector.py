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
rank (one `HiCache` per KV cache group of a hybrid model: `engine_integration.vllm.groups`).
The scheduler learns what the caches hold through `engine_integration.vllm.lookup`:
directly when the one worker shares its process (world size 1, vLLM's `uni` executor, its
default for one GPU), else from every rank over a local socket. Pipeline parallelism is
refused at construction. Loads run layer by layer inside the step, or whole before it
(`load_async`, and always for several groups); hicache's L2/L3 residency goes out in vLLM's
KV events (`engine_integration.vllm.events`), its counters in vLLM's stats and Prometheus
registry (`engine_integration.vllm.metrics`).

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
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from engine_integration.vllm import config as vllm_setup
from engine_integration.vllm.events import GroupEvents, event_queue
from engine_integration.vllm.groups import kv_groups
from engine_integration.vllm.kv import VllmKV
from engine_integration.vllm.lookup import (
    CacheLookup,
    Found,
    LookupClient,
    LookupServer,
    ModelLookup,
    ask_all,
    lookup_address,
)
from engine_integration.vllm.metrics import COUNTERS, HiCacheConnectorStats, HiCachePromMetrics
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
        for name in ("decode_context_parallel_size", "prefill_context_parallel_size"):
            if (getattr(parallel, name, 1) or 1) > 1:  # each rank holds other tokens' KV
                raise ValueError(
                    f"HiCacheConnector: context parallelism is not supported yet "
                    f"({name} {getattr(parallel, name)})"
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
        self._groups = kv_groups(kv_cache_config)
        self._spec = self._groups[0].spec
        page_size = self._settings.page_size
        self._layouts = [
            vllm_setup.kv_layout(g.spec, len(g.layer_names), page_size) for g in self._groups
        ]
        self._layout = self._layouts[0]
        # Several groups load asynchronously: vLLM maps a failed load of such a model back
        # to its request only through `failed_recving`, which it reads for waiting requests.
        self._load_async = self._settings.load_async or len(self._groups) > 1
        # L2 is split between the groups' caches by their bytes per token.
        total_bytes = sum(layout.bytes_per_token for layout in self._layouts)
        self._l2_shares = [layout.bytes_per_token / total_bytes for layout in self._layouts]
        self._step_tokens = vllm_config.scheduler_config.max_num_batched_tokens
        # The settings checked on both sides; the worker makes its caches with them.
        self._configs = [
            vllm_setup.cache_config(self._settings, layout, "cpu", self._step_tokens, share)
            for layout, share in zip(self._layouts, self._l2_shares, strict=True)
        ]
        self._config = self._configs[0]
        self._rank = _tensor_parallel_rank(parallel) if role == KVConnectorRole.WORKER else 0
        self._shared: vllm_setup.SharedCache | None = None
        self._server: LookupServer | None = None
        self._clients: list[LookupClient] = []
        self._planner: SchedulerPlanner | None = None
        self._workers: list[WorkerStep] = []
        self._layer_worker: dict[str, WorkerStep] = {}
        self._failed_recving: set[str] = set()

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
        num_groups = len(self._groups)
        caches, lookups = [], []
        for group, layout, share in zip(self._groups, self._layouts, self._l2_shares, strict=True):
            kv = VllmKV(
                kv_caches, list(group.layer_names), group.spec, self._kv_cache_config.num_blocks
            )
            config = vllm_setup.cache_config(
                self._settings, layout, str(kv.device), self._step_tokens, share
            )
            cache = HiCache(config)
            model_id = vllm_setup.group_model_id(self._settings.model_id, group.index, num_groups)
            lookup = CacheLookup(cache, model_id, layout, self._rank, self._num_ranks)
            # MLA's latent is the same on every rank: rank 0 alone writes it.
            writes = layout.kind != "mla" or self._rank == 0
            worker = WorkerStep(cache, kv, layout.page_size, lookup.namespace, group, writes=writes)
            self._workers.append(worker)
            self._layer_worker.update({name: worker for name in group.layer_names})
            caches.append(cache)
            lookups.append(lookup)
            logger.info(
                "HiCacheConnector rank %d of %d, KV group %d (%s): %d layers of %s, vLLM "
                "blocks of %d tokens, hicache pages of %d; L1 %d staging pages, L2 %d pages, "
                "L3 %s",
                self._rank,
                self._num_ranks,
                group.index,
                group.kind,
                kv.num_layers,
                layout.descriptor(),
                kv.block_size,
                layout.page_size,
                config.l1.num_pages,
                cache.executor.num_host_pages,
                config.l3.url or "none",
            )
        lookup = ModelLookup(self._groups, lookups, self._layout.page_size)
        self._shared = vllm_setup.SharedCache(caches, lookup)
        if self._in_process and _publishes_kv_events(self._vllm_config):
            self._shared.events = event_queue()
            for group, cache in zip(self._groups, caches, strict=True):
                cache.set_residency_listener(
                    GroupEvents(self._shared.events, group, self._layout.page_size)
                )
        if self._in_process:
            vllm_setup.publish(self._engine_id, self._shared)
        else:
            address = lookup_address(self._engine_id, self._rank, self._data_parallel_rank)
            self._server = LookupServer(lookup, address)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if not isinstance(connector_metadata, HiCacheConnectorMetadata):
            raise TypeError(
                f"HiCacheConnector got {type(connector_metadata).__name__} as its metadata"
            )
        for worker in self._worker_steps():
            worker.bind(connector_metadata.plan)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        for worker in self._worker_steps():
            worker.start()

    def wait_for_layer_load(self, layer_name: str) -> None:
        worker = self._layer_worker_step(layer_name)
        worker.wait_layer(worker.kv.layer_index(layer_name))

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        worker = self._layer_worker_step(layer_name)
        worker.save_layer(worker.kv.layer_index(layer_name))

    def wait_for_save(self) -> None:
        for worker in self._worker_steps():
            worker.finish()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Requests whose final save is done (in every group), and asynchronous loads done
        (in every group; a failed one is also in `get_transfer_results`' failed_recving)."""
        if not self._workers:
            return None, None
        sent = set.intersection(*(w.take_finished_sending() for w in self._workers))
        received, failed = set(), set()
        for worker in self._workers:
            done, bad = worker.take_received()
            received |= done
            failed |= bad
        self._failed_recving |= failed
        return sent or None, received or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        sent, received = self.get_finished(finished_req_ids)
        failed, self._failed_recving = self._failed_recving, set()
        if len(self._groups) == 1:
            failed = set()  # one group: reported by block (recomputed from the first bad one)
        return KVConnectorTransferResults(
            finished_sending=set(sent or ()),
            finished_recving=set(received or ()),
            failed_recving=failed,
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        """One group: the blocks a load did not fill. Several: none (vLLM cannot map a block
        id back to its group); the failed requests go out as failed_recving instead."""
        failed = set()
        for worker in self._workers:
            failed |= worker.take_failed_blocks()
        return failed if len(self._groups) == 1 else set()

    def get_kv_connector_stats(self) -> HiCacheConnectorStats | None:
        """The worker's loads and saves since the last call (metrics.py)."""
        if not self._workers:
            return None
        data = dict.fromkeys(COUNTERS, 0)
        for worker in self._workers:
            for name, value in worker.take_counters().items():
                data[name] += value
        return HiCacheConnectorStats(data=data)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None):
        return HiCacheConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return HiCachePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._planner is not None:
            self._planner.close()
        for worker in self._workers:
            worker.close()
        self._workers, self._layer_worker = [], {}
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
                for cache in shared.caches:
                    cache.flush()  # what was saved reaches L3 before the process ends
            finally:
                for cache in shared.caches:
                    cache.close()

    def _worker_steps(self) -> list[WorkerStep]:
        if not self._workers:
            raise RuntimeError("HiCacheConnector: register_kv_caches was not called")
        return self._workers

    def _layer_worker_step(self, layer_name: str) -> WorkerStep:
        worker = self._layer_worker.get(layer_name)
        if worker is None:
            self._worker_steps()
            raise KeyError(f"HiCacheConnector: no registered KV for layer {layer_name!r}")
        return worker

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

            def find(tokens: list[int], extra_key: str, ask_l3: bool) -> Found:
                return ask_all(self._clients, tokens, extra_key, ask_l3)

        self._planner = SchedulerPlanner(
            find,
            self._layout.page_size,
            self._spec.block_size,
            min(config.l1.num_pages for config in self._configs),
            self._load_async,
            ask_again_s=self._config.l3.ask_again_s,
        )
        return self._planner

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        return self._scheduler().num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        block_ids = blocks.get_block_ids() if num_external_tokens else ()
        self._scheduler().after_alloc(request, block_ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        planner = self._scheduler()
        block_state = scheduler_output.kv_connector_block_state

        def block_ids_of(req_id: str) -> tuple[list[int], ...]:
            if block_state is not None:
                return block_state.get_block_ids(req_id)
            return self._kv_cache_manager.get_block_ids(req_id)

        return HiCacheConnectorMetadata(planner.build_metadata(scheduler_output, block_ids_of))

    def update_connector_output(self, connector_output) -> None:
        if connector_output.invalid_block_ids:
            self._scheduler().load_errors(set(connector_output.invalid_block_ids))
        if connector_output.failed_recving:
            self._scheduler().failed_loads(connector_output.failed_recving)
        if connector_output.finished_sending:
            self._scheduler().sent(connector_output.finished_sending)

    def has_pending_block_frees(self) -> bool:
        """Blocks kept for final saves come back within a step: worth waiting for."""
        return self._planner is not None and bool(self._planner.sending)

    def take_events(self):
        """hicache's L2 and L3 residency since the last call, as vLLM's KV events
        (events.py); nothing unless vLLM publishes KV events and the workers share this
        process."""
        self._scheduler()
        queue = self._shared.events if self._shared is not None else None
        taken = []
        while queue:
            taken.append(queue.popleft())
        return taken

    def reset_cache(self) -> bool:
        """vLLM's reset_prefix_cache(reset_connector=True): empty this engine's L1 and L2
        (what is not yet in L3 is written there first, as any eviction does). L3 is shared
        storage and stays; pages of other weights need another `model_id`. With the workers
        in other processes the scheduler cannot reach their caches: False."""
        if not self._in_process:
            logger.warning("HiCacheConnector.reset_cache: the caches live in the workers")
            return False
        shared = self._shared or vllm_setup.find(self._engine_id)
        if shared is None:
            return False
        if self._shared is None:
            self._shared = shared  # keep the use find() took; shutdown gives it back
        for cache in shared.caches:
            cache.evict("l1", cache.config.l1.num_pages)
            cache.evict("l2", cache.executor.num_host_pages)
        return True

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict | None]:
        return self._scheduler().finished(request, (block_ids,))

    def request_finished_all_groups(self, request, block_ids) -> tuple[bool, dict | None]:
        return self._scheduler().finished(request, tuple(block_ids))

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


def _publishes_kv_events(vllm_config) -> bool:
    events = getattr(vllm_config, "kv_events_config", None)
    return bool(events is not None and getattr(events, "enable_kv_cache_events", False))


def _tensor_parallel_rank(parallel) -> int:
    """This worker's rank among the tensor-parallel workers (vLLM's group once it exists,
    else the config's rank)."""
    from vllm.distributed import parallel_state

    if parallel_state.model_parallel_is_initialized():
        return parallel_state.get_tensor_model_parallel_rank()
    return getattr(parallel, "rank", 0)
