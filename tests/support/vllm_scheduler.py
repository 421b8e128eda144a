"""vLLM's real `Scheduler` with HiCacheConnector, and a model runner that checks what every
layer's attention reads, on the CPU.

`ServingEngine` is one vLLM engine as `vllm serve` assembles it, minus the GPU: a real
`VllmConfig` (the model part is a stand-in: a real `ModelConfig` inspects the architecture
in a subprocess that needs the GPU build), the real `KVCacheConfig` with one or more KV
cache groups, KV tensors from vLLM's `create_kv_cache_views`, the worker's connector made by
`KVConnectorFactory` and registered, and vLLM's `Scheduler`, which makes the scheduler's
connector itself. `step()` is `EngineCore.step`: `schedule()`, the model runner's
connector calls around a forward (`KVConnectorModelRunnerMixin`: bind, start_load_kv,
per layer wait_for_layer_load -> attention -> save_kv_layer, wait_for_save,
get_transfer_results, get_block_ids_with_load_errors, clear), then `update_from_output`.

The "model" writes, for each token and layer, KV that depends only on the token prefix
(`model_kv`), so any KV a layer reads can be checked: before each layer writes, the runner
compares every position its attention reads (all earlier positions for full attention, the
last `window - 1` for a sliding window) against `model_kv`, and records each mismatch in
`engine.wrong_reads`. A test asserts that list is empty: wrong KV from the connector, at any
step, in any layer, fails it.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import torch
import xxhash
from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.config.kv_events import KVEventsConfig
from vllm.config.kv_transfer import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    MLAAttentionSpec,
    SlidingWindowSpec,
    create_kv_cache_views,
)
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

POISON = -7.0
VOCAB = 1000


class ModelStandIn(SimpleNamespace):
    """The fields of `ModelConfig` the scheduler and the connector read: those given, else
    `ModelConfig`'s declared default; anything else (a derived property) is an error naming
    it, so a vLLM upgrade that reads more fails loudly here."""

    def __getattr__(self, name):
        field = _MODEL_FIELDS.get(name)
        if field is None or field.default is dataclasses.MISSING:
            raise AttributeError(f"ModelStandIn has no model_config.{name}")
        return field.default


_MODEL_FIELDS = {field.name: field for field in dataclasses.fields(ModelConfig)}


@dataclass(frozen=True)
class GroupShape:
    """One KV cache group: `kind` full | sliding | mla, its layers, its window."""

    kind: str = "full"
    num_layers: int = 2
    window: int = 0  # sliding: tokens a query attends (itself included)


@dataclass(frozen=True)
class EngineShape:
    groups: tuple[GroupShape, ...] = (GroupShape(),)
    num_blocks: int = 64
    block_size: int = 16
    num_kv_heads: int = 2
    head_size: int = 8
    dtype: torch.dtype = torch.float32
    step_tokens: int = 256
    max_num_seqs: int = 8
    max_model_len: int = 2048


def transfer_config(extra: dict, engine_id: str, policy: str = "recompute") -> KVTransferConfig:
    return KVTransferConfig(
        **json.loads(
            json.dumps(
                {
                    "kv_connector": "HiCacheConnector",
                    "kv_connector_module_path": "engine_integration.vllm.connector",
                    "kv_role": "kv_both",
                    "kv_load_failure_policy": policy,
                    "engine_id": engine_id,
                    "kv_connector_extra_config": extra,
                }
            )
        )
    )


def make_vllm_config(
    transfer: KVTransferConfig, shape: EngineShape, kv_events: bool = False
) -> VllmConfig:
    events = KVEventsConfig(enable_kv_cache_events=True, publisher="null") if kv_events else None
    config = VllmConfig(
        kv_events_config=events,
        device_config=DeviceConfig(device="cpu"),
        cache_config=CacheConfig(block_size=shape.block_size, enable_prefix_caching=True),
        scheduler_config=SchedulerConfig(
            max_num_batched_tokens=shape.step_tokens,
            max_num_seqs=shape.max_num_seqs,
            max_model_len=shape.max_model_len,
            is_encoder_decoder=False,
        ),
        kv_transfer_config=transfer,
    )
    model = ModelStandIn(
        model="test/model",
        max_model_len=shape.max_model_len,
        uses_mrope=False,
        is_encoder_decoder=False,
        runner_type="generate",
        is_diffusion=False,
        supports_multimodal_inputs=False,
        skip_tokenizer_init=True,
        multimodal_config=None,
    )
    object.__setattr__(config, "model_config", model)  # see the module doc
    # vLLM turns the hybrid manager off on a CPU platform; the KV groups here are the GPU's.
    config.scheduler_config.disable_hybrid_kv_cache_manager = False
    config.cache_config.num_gpu_blocks = shape.num_blocks  # the profiler's answer on a GPU
    return config


def group_spec(group: GroupShape, shape: EngineShape):
    common = dict(block_size=shape.block_size, head_size=shape.head_size, dtype=shape.dtype)
    if group.kind == "full":
        return FullAttentionSpec(num_kv_heads=shape.num_kv_heads, **common)
    if group.kind == "sliding":
        return SlidingWindowSpec(
            num_kv_heads=shape.num_kv_heads, sliding_window=group.window, **common
        )
    if group.kind == "mla":
        return MLAAttentionSpec(num_kv_heads=1, **common)
    raise ValueError(f"unknown group kind {group.kind!r}")


def model_kv(tokens, start: int, end: int, layer: int, width: int, dtype) -> torch.Tensor:
    """KV of positions [start, end) of `layer`: (n, width), a function of the prefix only."""
    data = np.asarray(tokens, dtype="<u4").tobytes()
    rows = [
        np.random.default_rng(
            xxhash.xxh64_intdigest(data[: 4 * (t + 1)], seed=layer)
        ).standard_normal(width, dtype=np.float32)
        for t in range(start, end)
    ]
    values = torch.from_numpy(np.stack(rows)) if rows else torch.empty(0, width)
    return values.to(dtype)


def next_token(tokens) -> int:
    return xxhash.xxh64_intdigest(np.asarray(tokens, dtype="<u4").tobytes()) % VOCAB


@dataclass
class _Layer:
    name: str
    group: int
    index: int  # across all groups: the seed of its KV
    view: torch.Tensor  # (B, H, N, C)
    window: int  # 0: full attention


class ServingEngine:
    """One vLLM engine: real scheduler, connector pair and KV tensors (see the module doc)."""

    def __init__(
        self,
        extra: dict,
        shape: EngineShape = EngineShape(),
        *,
        engine_id: str = "engine",
        policy: str = "recompute",
        kv_events: bool = False,
        num_ranks: int = 1,
    ) -> None:
        """`num_ranks` > 1: tensor-parallel workers, each with its own KV tensors and
        connector, in vLLM's `mp` executor's arrangement (the scheduler asks them over their
        sockets); each rank's KV differs (other heads) except MLA's, which ranks share."""
        init_none_hash(sha256)
        self.shape = shape
        transfer = transfer_config(extra, engine_id, policy)
        self.config = make_vllm_config(transfer, shape, kv_events)
        if num_ranks > 1:
            self.config.parallel_config.tensor_parallel_size = num_ranks
            self.config.parallel_config.distributed_executor_backend = "mp"
        self.workers, self.rank_layers = [], []
        for rank in range(num_ranks):
            self.kv_cache_config, layers = _kv_tensors(shape)
            config = copy.copy(self.config)
            config.parallel_config = copy.copy(self.config.parallel_config)
            config.parallel_config.rank = rank
            worker = KVConnectorFactory.create_connector(
                config, KVConnectorRole.WORKER, self.kv_cache_config
            )
            worker.register_kv_caches({layer.name: layer.view for layer in layers})
            self.workers.append(worker)
            self.rank_layers.append(layers)
        self.worker, self.layers = self.workers[0], self.rank_layers[0]
        self.scheduler = Scheduler(
            self.config,
            self.kv_cache_config,
            StructuredOutputManager(self.config),
            block_size=shape.block_size,
        )
        self._hasher = get_request_block_hasher(shape.block_size, sha256)
        self._block_ids: dict[str, list[list[int]]] = {}
        self.wrong_reads: list[tuple] = []  # (req id, layer, first wrong position)
        self.invalid_block_ids: list[set[int]] = []  # what the worker reported, per step
        self.num_steps = 0
        self.before_execute = None  # called with each SchedulerOutput, before the runner
        self.connector_stats: list[dict] = []  # the worker's get_kv_connector_stats, per step
        self.finished: dict[str, list[int]] = {}  # req id -> all its tokens

    @property
    def connector(self):
        return self.scheduler.connector

    @property
    def cache(self):
        return self.worker._shared.cache

    def add(self, req_id: str, prompt: list[int], max_tokens: int = 4, salt=None) -> Request:
        request = Request(
            req_id,
            list(prompt),
            SamplingParams(max_tokens=max_tokens, ignore_eos=True),
            None,
            cache_salt=salt,
            block_hasher=self._hasher,
        )
        self.scheduler.add_request(request)
        return request

    def step(self):
        """One engine step; returns the SchedulerOutput."""
        output = self.scheduler.schedule()
        if self.before_execute is not None:
            self.before_execute(output)
        runner_output = self._execute(output)
        self.scheduler.update_from_output(output, runner_output)
        self.num_steps += 1
        return output

    def run(self, max_steps: int = 200) -> None:
        """Step until every request is done and every block is back."""
        for _ in range(max_steps):
            if not self.scheduler.has_unfinished_requests() and not self._pending_frees():
                return
            self.step()
        raise AssertionError(f"requests still running after {max_steps} steps")

    def _pending_frees(self) -> bool:
        return bool(getattr(self.connector._planner, "sending", None))

    # ------------------------------------------------------------------ the model runner

    def _execute(self, output) -> ModelRunnerOutput:
        for req_id in output.finished_req_ids:
            self._block_ids.pop(req_id, None)
        for req_id in getattr(output, "preempted_req_ids", None) or ():
            self._block_ids.pop(req_id, None)
        scheduled = {}  # req id -> (tokens, computed)
        for new in output.scheduled_new_reqs:
            self._block_ids[new.req_id] = [list(ids) for ids in new.block_ids]
            scheduled[new.req_id] = new.num_computed_tokens
        cached = output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                self._block_ids[req_id] = [list(ids) for ids in new_ids]
            elif new_ids is not None:
                for group, ids in enumerate(new_ids):
                    self._block_ids[req_id][group].extend(ids)
            scheduled[req_id] = cached.num_computed_tokens[i]
        before = len(self.wrong_reads)
        outputs = [self._execute_rank(rank, output, scheduled) for rank in range(len(self.workers))]
        # vLLM's KVOutputAggregator: a transfer is done when every worker says so; errors
        # from any worker count.
        sending = set.intersection(*(set(o[0].finished_sending) for o in outputs))
        recving = set.intersection(*(set(o[0].finished_recving) for o in outputs))
        failed_recving = set().union(*(o[0].failed_recving for o in outputs))
        invalid = set().union(*(o[1] for o in outputs))
        stats = outputs[0][2]
        for other in outputs[1:]:
            stats = stats.aggregate(other[2]) if stats is not None else other[2]
        self.connector_stats.append(stats.data if stats is not None else {})
        self.invalid_block_ids.append(set(invalid))
        # A request whose load failed ran on blocks the load did not fill; vLLM drops that
        # step's output and recomputes from the first bad block, so those reads never count.
        failed = {r for r in scheduled if invalid & {b for ids in self._block_ids[r] for b in ids}}
        kept = [read for read in self.wrong_reads[before:] if read[0] not in failed]
        self.wrong_reads[before:] = kept
        req_ids = list(scheduled)
        sampled = []
        for req_id in req_ids:
            request = self.scheduler.requests[req_id]
            end = scheduled[req_id] + output.num_scheduled_tokens[req_id]
            done = end >= request.num_tokens
            sampled.append([next_token(request.all_token_ids)] if done else [])
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled,
            kv_connector_output=KVConnectorOutput(
                finished_sending=sending or None,
                finished_recving=recving or None,
                invalid_block_ids=set(invalid),
                failed_recving=failed_recving,
                kv_connector_stats=stats,
            ),
        )

    def _execute_rank(self, rank: int, output, scheduled: dict):
        """One worker's connector calls around its forward (the same metadata for every
        rank, as vLLM sends it): (transfer results, failed blocks, stats)."""
        worker = self.workers[rank]
        worker.bind_connector_metadata(output.kv_connector_metadata)
        worker.start_load_kv(None)
        for layer in self.rank_layers[rank]:
            worker.wait_for_layer_load(layer.name)
            # As vLLM's layer does: the batch's new KV first (reshape_and_cache), then the
            # attention; a request may read a block another one fills in this step.
            for req_id, computed in scheduled.items():
                num_new = output.num_scheduled_tokens[req_id]
                self._write(req_id, layer, computed, num_new, rank)
            for req_id, computed in scheduled.items():
                self._check_reads(req_id, layer, computed, rank)
            worker.save_kv_layer(layer.name, layer.view, None)
        worker.wait_for_save()
        results = worker.get_transfer_results(output.finished_req_ids)
        invalid = worker.get_block_ids_with_load_errors()
        stats = worker.get_kv_connector_stats()
        worker.clear_connector_metadata()
        return results, set(invalid), stats

    def _seed(self, layer: _Layer, rank: int) -> int:
        """Each rank holds other heads, so other values; MLA's latent is every rank's."""
        mla = self.shape.groups[layer.group].kind == "mla"
        return layer.index + (0 if mla else 1000 * rank)

    def _check_reads(self, req_id: str, layer: _Layer, computed: int, rank: int = 0) -> None:
        """What the first new token's attention reads: [lo, computed)."""
        lo = 0 if not layer.window else max(0, computed - layer.window + 1)
        if computed <= lo:
            return
        tokens = self.scheduler.requests[req_id].all_token_ids
        width = layer.view.shape[1] * layer.view.shape[3]
        blocks, offsets = self._slots(req_id, layer.group, lo, computed)
        read = layer.view[blocks, :, offsets].reshape(computed - lo, width)
        want = model_kv(tokens, lo, computed, self._seed(layer, rank), width, read.dtype)
        rows_ok = (read == want).all(dim=1)
        if not bool(rows_ok.all()):
            first = lo + int((~rows_ok).nonzero()[0])
            self.wrong_reads.append((req_id, layer.name, first, self.num_steps, rank))

    def _write(self, req_id: str, layer: _Layer, computed: int, num_new: int, rank: int) -> None:
        tokens = self.scheduler.requests[req_id].all_token_ids
        end = computed + num_new
        width = layer.view.shape[1] * layer.view.shape[3]
        blocks, offsets = self._slots(req_id, layer.group, computed, end)
        new = model_kv(tokens, computed, end, self._seed(layer, rank), width, layer.view.dtype)
        layer.view[blocks, :, offsets] = new.view(num_new, layer.view.shape[1], -1)

    def _slots(self, req_id: str, group: int, start: int, end: int):
        positions = torch.arange(start, end)
        block_ids = torch.tensor(self._block_ids[req_id][group], dtype=torch.long)
        return block_ids[positions // self.shape.block_size], positions % self.shape.block_size

    def shutdown(self) -> None:
        self.scheduler.shutdown()
        for worker in self.workers:
            worker.shutdown()


def _kv_tensors(shape: EngineShape):
    """One raw buffer per layer, viewed as vLLM's model runner views it (LBNHC)."""
    groups, tensors, layers = [], [], []
    index = 0
    for g, group in enumerate(shape.groups):
        spec = group_spec(group, shape)
        names = [f"model.layers.{index + i}.attn" for i in range(group.num_layers)]
        groups.append(KVCacheGroupSpec(names, spec))
        for name in names:
            size = spec.page_size_bytes * shape.num_blocks
            tensor = KVCacheTensor(
                size=size, layers=[name], layer_stride=size, block_stride=spec.page_size_bytes
            )
            raw = torch.zeros(size, dtype=torch.int8)
            (view,) = create_kv_cache_views(
                raw, spec, shape.num_blocks, KVCacheLayout.LBNHC, tensor
            )
            view.fill_(POISON)
            tensors.append(tensor)
            window = group.window if group.kind == "sliding" else 0
            layers.append(_Layer(name, g, index, view, window))
            index += 1
    config = KVCacheConfig(
        num_blocks=shape.num_blocks, kv_cache_tensors=tensors, kv_cache_groups=groups
    )
    return config, layers
