"""A driver that calls a vLLM KV connector the way vLLM 0.33 does, on the CPU.

`VllmEngine` stands in for one vLLM engine: the real `KVTransferConfig` parsed from the
`--kv-transfer-config` JSON, the real `KVCacheConfig` / `FullAttentionSpec`, KV tensors made
by vLLM's own `create_kv_cache_views` (so in vLLM's layout, strides included), both
connectors built by `KVConnectorFactory`, real `Request`s, `KVCacheBlocks` and
`SchedulerOutput`s. `step()` makes the calls of the scheduler (`Scheduler.schedule` ->
get_num_new_matched_tokens, update_state_after_alloc, build_connector_meta) and of the
model runner (`KVConnectorModelRunnerMixin._get_kv_connector_output`: bind, start_load_kv
before the forward when a load is synchronous, per layer wait_for_layer_load -> attention
-> save_kv_layer, then wait_for_save, get_finished, get_block_ids_with_load_errors,
clear), in that order. Its "model" writes, for each computed token and layer, KV that
depends only on the token prefix, so two requests sharing a prefix compute equal KV.

`VllmEngine` cannot be a real `VllmConfig`: that infers a device, and there is none here.
`TestVllmConfig` has the fields the connector and the factory read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np
import torch
import xxhash
from vllm.config.kv_transfer import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.sampling_params import SamplingParams
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.core.sched.output import KVConnectorBlockState, SchedulerOutput
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    create_kv_cache_views,
)
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request

POISON = -7.0  # what a block holds before anything writes it


def transfer_config_json(extra: dict, engine_id: str) -> str:
    return json.dumps(
        {
            "kv_connector": "HiCacheConnector",
            "kv_connector_module_path": "engine_integration.vllm.connector",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "engine_id": engine_id,
            "kv_connector_extra_config": extra,
        }
    )


@dataclass
class TestVllmConfig:
    """The fields of VllmConfig that HiCacheConnector and KVConnectorFactory read."""

    kv_transfer_config: KVTransferConfig  # the real one, from the JSON
    model_config: SimpleNamespace  # .model
    # .tensor_parallel_size, .pipeline_parallel_size, .distributed_executor_backend, .rank
    # (and .data_parallel_rank, absent here: 0)
    parallel_config: SimpleNamespace
    scheduler_config: SimpleNamespace  # .max_num_batched_tokens, .disable_hybrid_kv_cache_manager

    __test__ = False  # not a pytest class


@dataclass(frozen=True)
class Shape:
    num_layers: int = 2
    num_blocks: int = 48
    block_size: int = 16
    num_kv_heads: int = 2
    head_size: int = 8
    dtype: torch.dtype = torch.float32
    layout: KVCacheLayout = KVCacheLayout.LBNHC
    kernel_block_size: int | None = None
    device: str = "cpu"


@dataclass
class StepResult:
    num_external_tokens: int
    failed_block_ids: set[int]
    # what each layer's attention saw: (num_tokens, H, C) of the request's first tokens
    seen: list[torch.Tensor] = field(default_factory=list)
    unloaded_before_wait: list[bool] = field(default_factory=list)
    seen_by_rank: list[list[torch.Tensor]] = field(default_factory=list)  # rank -> seen


def model_kv(tokens: list[int], start: int, end: int, layer: int, shape: Shape) -> torch.Tensor:
    """KV of positions [start, end) in `layer`: (n, H, C), a function of the prefix only."""
    width = shape.num_kv_heads * 2 * shape.head_size
    rows = []
    data = np.asarray(tokens, dtype="<u4").tobytes()
    for t in range(start, end):
        seed = xxhash.xxh64_intdigest(data[: 4 * (t + 1)], seed=layer)
        rows.append(np.random.default_rng(seed).standard_normal(width, dtype=np.float32))
    values = torch.from_numpy(np.stack(rows)) if rows else torch.empty(0, width)
    return values.view(-1, shape.num_kv_heads, 2 * shape.head_size).to(shape.dtype)


class VllmEngine:
    """One vLLM engine's connector pair, KV tensors and block allocator."""

    def __init__(
        self,
        extra: dict,
        shape: Shape = Shape(),
        *,
        engine_id: str = "engine",
        step_tokens: int = 256,
        num_ranks: int = 1,
        backend: str = "uni",
    ):
        self.shape = shape
        self.layer_names = [f"model.layers.{i}.self_attn.attn" for i in range(shape.num_layers)]
        spec = FullAttentionSpec(
            block_size=shape.block_size,
            num_kv_heads=shape.num_kv_heads,
            head_size=shape.head_size,
            dtype=shape.dtype,
        )
        transfer = KVTransferConfig(**json.loads(transfer_config_json(extra, engine_id)))

        def config(rank: int) -> TestVllmConfig:
            return TestVllmConfig(
                kv_transfer_config=transfer,
                model_config=SimpleNamespace(model="test/model"),
                parallel_config=SimpleNamespace(
                    tensor_parallel_size=num_ranks,
                    pipeline_parallel_size=1,
                    distributed_executor_backend=backend,
                    rank=rank,
                ),
                scheduler_config=SimpleNamespace(
                    max_num_batched_tokens=step_tokens, disable_hybrid_kv_cache_manager=False
                ),
            )

        # vLLM's order: each worker's connector, its KV registered, then the scheduler's.
        self.workers, self.rank_kv = [], []
        for rank in range(num_ranks):
            self.kv_cache_config, kv_caches = _kv_tensors(spec, shape, self.layer_names)
            worker = KVConnectorFactory.create_connector(
                config(rank), KVConnectorRole.WORKER, self.kv_cache_config
            )
            worker.register_kv_caches(kv_caches)
            self.workers.append(worker)
            self.rank_kv.append(kv_caches)
        self.worker, self.kv_caches = self.workers[0], self.rank_kv[0]
        self.config = config(0)
        self.scheduler = KVConnectorFactory.create_connector(
            self.config, KVConnectorRole.SCHEDULER, self.kv_cache_config
        )
        self._free = list(range(shape.num_blocks))
        self.block_ids: dict[str, list[int]] = {}
        self._finished_ids: set[str] = set()  # for the next SchedulerOutput
        self.sending: dict[str, list[int]] = {}  # finished, blocks kept for the connector

    @property
    def cache(self):
        return self.worker._shared.cache

    def cache_of(self, rank: int):
        return self.workers[rank]._shared.cache

    def request(self, req_id: str, tokens: list[int], cache_salt: str | None = None) -> Request:
        return Request(
            req_id,
            list(tokens),
            SamplingParams(max_tokens=4),
            None,
            cache_salt=cache_salt,
        )

    def step(self, request: Request, num_computed_tokens: int = 0, write_kv=None) -> StepResult:
        """Admit `request` and compute its whole prompt in one step. `write_kv(layer, start,
        end)` gives the new tokens' KV, (n, H, C) (default: `model_kv`)."""
        output, before = self.schedule_batch([(request, num_computed_tokens)], [])
        return self._execute(output, before, write_kv)[request.request_id]

    def schedule(self, request: Request, num_computed_tokens: int = 0):
        """Scheduler.schedule for one new request: (the SchedulerOutput, tokens computed
        before the step: vLLM's own hit plus the connector's)."""
        output, before = self.schedule_batch([(request, num_computed_tokens)], [])
        return output, before[request.request_id][1]  # (request, computed, ext)

    def step_batch(self, new: list, running: list, chunk_tokens: int | None = None) -> dict:
        """One step of new requests `[(request, vLLM's own hit)]` and running ones (each
        computing up to `chunk_tokens` more of its prompt); req id -> StepResult."""
        output, before = self.schedule_batch(new, running, chunk_tokens)
        return self._execute(output, before)

    def schedule_batch(self, new: list, running: list, chunk_tokens: int | None = None):
        """Scheduler.schedule: the connector's calls for each new request (its hit beyond
        vLLM's own block-aligned one, then the allocation), the step's metadata, then the
        computed-token counts advanced. Returns (SchedulerOutput, req id -> (request,
        tokens computed before the step))."""
        before, loads = {}, False
        for request, num_computed in new:
            rid = request.request_id
            ext, load_async = self.scheduler.get_num_new_matched_tokens(request, num_computed)
            assert load_async is False
            num_blocks = -(-request.num_tokens // self.shape.block_size)
            self.block_ids[rid] = [self._free.pop(0) for _ in range(num_blocks)]
            blocks = KVCacheBlocks(([KVCacheBlock(b) for b in self.block_ids[rid]],))
            self.scheduler.update_state_after_alloc(request, blocks, ext)
            request.num_computed_tokens = num_computed + ext
            before[rid] = (request, request.num_computed_tokens, ext)
            loads |= ext > 0
        for request in running:  # allocate_slots: blocks for tokens decoded since
            blocks = self.block_ids[request.request_id]
            while len(blocks) * self.shape.block_size < request.num_tokens:
                blocks.append(self._free.pop(0))
            before[request.request_id] = (request, request.num_computed_tokens, 0)
        output = SchedulerOutput.make_empty()
        for rid, (request, computed, _) in before.items():
            remaining = request.num_tokens - computed
            output.num_scheduled_tokens[rid] = min(remaining, chunk_tokens or remaining)
        output.total_num_scheduled_tokens = sum(output.num_scheduled_tokens.values())
        output.finished_req_ids, self._finished_ids = self._finished_ids, set()
        output.has_sync_kv_loads = loads
        output.kv_connector_block_state = KVConnectorBlockState(
            req_ids=set(before), resolve_block_ids=lambda r: (self.block_ids[r],),
            boundary_state_offloads={},
        )  # fmt: skip
        output.kv_connector_metadata = self.scheduler.build_connector_meta(output)
        output.kv_connector_block_state = None
        for rid, (request, _, _) in before.items():  # _update_after_schedule
            request.num_computed_tokens += output.num_scheduled_tokens[rid]
        return output, before

    def _execute(self, output, before: dict, write_kv=None) -> dict:
        """Every worker's step (the same metadata for each, as vLLM sends it); the scheduler
        gets the union of their load errors, as vLLM's output aggregator makes it."""
        results = {rid: StepResult(0, set()) for rid in before}
        failed, sent = set(), set(self.sending)
        for rank in range(len(self.workers)):
            seen, failed_here, sent_here = self._execute_rank(rank, output, before, write_kv)
            failed |= failed_here
            sent &= sent_here  # KVOutputAggregator: done when every worker says so
            for rid, result in results.items():
                result.seen_by_rank.append(seen[rid].seen)
                if rank == 0:
                    result.seen = seen[rid].seen
                    result.unloaded_before_wait = seen[rid].unloaded_before_wait
        self.scheduler.update_connector_output(
            KVConnectorOutput(invalid_block_ids=failed, finished_sending=sent)
        )
        for rid in sent:
            self._free_blocks(self.sending.pop(rid), poison=True)
        for rid, (_, _, ext) in before.items():
            results[rid].failed_block_ids = failed & set(self.block_ids[rid])
            results[rid].num_external_tokens = ext
        return results

    def _execute_rank(self, rank: int, output, before: dict, write_kv=None):
        """GPUModelRunner.execute_model's connector calls around a forward pass."""
        worker, kv_caches = self.workers[rank], self.rank_kv[rank]
        worker.bind_connector_metadata(output.kv_connector_metadata)
        if output.has_sync_kv_loads:
            worker.start_load_kv(None)
        results = {rid: StepResult(0, set()) for rid in before}
        for layer, name in enumerate(self.layer_names):
            kv = kv_caches[name]
            for rid, (_, computed, _) in before.items():
                blocks, offsets = self.slots(rid, 0, computed)
                untouched = bool((kv[blocks, :, offsets] == POISON).all())
                results[rid].unloaded_before_wait.append(untouched)
            worker.wait_for_layer_load(name)  # Attention.forward, before it reads the KV
            for rid, (request, computed, _) in before.items():
                end = computed + output.num_scheduled_tokens[rid]
                blocks, offsets = self.slots(rid, 0, end)
                results[rid].seen.append(kv[blocks[:computed], :, offsets[:computed]].clone())
                if write_kv is None:  # each rank holds other heads: other values
                    tokens = request.all_token_ids
                    new = model_kv(tokens, computed, end, layer + 1000 * rank, self.shape)
                else:
                    new = write_kv(layer, computed, end)
                # reshape_and_cache: the layer writes the new tokens' KV
                kv[blocks[computed:], :, offsets[computed:]] = new.to(kv.device)
            worker.save_kv_layer(name, kv, None)  # after the layer's attention
        if not output.has_sync_kv_loads:
            worker.start_load_kv(None)
        worker.wait_for_save()
        sending, recving = worker.get_finished(output.finished_req_ids)
        assert not recving and set(sending or ()) <= set(self.sending)
        failed = worker.get_block_ids_with_load_errors()
        worker.clear_connector_metadata()
        return results, failed, set(sending or ())

    def finish(self, request: Request, poison: bool = True) -> bool:
        """The request ends: the scheduler asks whether to keep its blocks, and frees them
        now (overwritten, with `poison`, as their next owner would) or once every worker
        reports the connector done with them (`sending`). Returns whether they were kept."""
        rid = request.request_id
        keep, params = self.scheduler.request_finished(request, self.block_ids[rid])
        assert params is None
        self._finished_ids.add(rid)
        blocks = self.block_ids.pop(rid)
        if keep:
            self.sending[rid] = blocks
        else:
            self._free_blocks(blocks, poison)
        return keep

    def idle_step(self) -> None:
        """A step with nothing scheduled (vLLM's kv_connector_no_forward)."""
        output, before = self.schedule_batch([], [])
        self._execute(output, before)

    def _free_blocks(self, blocks: list[int], poison: bool) -> None:
        ratio = self.shape.block_size // self.kv_caches[self.layer_names[0]].shape[2]
        kernel_blocks = [b * ratio + i for b in blocks for i in range(ratio)]
        for kv_caches in self.rank_kv if poison else ():
            for name in self.layer_names:
                kv_caches[name][kernel_blocks] = POISON
        self._free.extend(blocks)

    def slots(self, req_id: str, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(kernel block, offset) of tokens [start, end) of a request, as vLLM maps them."""
        tokens = torch.arange(start, end)
        size = self.shape.block_size
        kernel = self.kv_caches[self.layer_names[0]].shape[2]
        blocks = torch.tensor(self.block_ids[req_id])[tokens // size] * (size // kernel)
        return blocks + tokens % size // kernel, tokens % kernel

    def kv_of(self, req_id: str, layer: int, start: int, end: int, rank: int = 0):
        """(n, H, C) of tokens [start, end) in one layer of one rank's KV."""
        blocks, offsets = self.slots(req_id, start, end)
        return self.rank_kv[rank][self.layer_names[layer]][blocks, :, offsets].clone()

    def flush(self) -> None:
        self.cache.flush()

    def shutdown(self) -> None:
        self.scheduler.shutdown()
        for worker in self.workers:
            worker.shutdown()


def _kv_tensors(spec, shape: Shape, layer_names: list[str]):
    """KV tensors as vLLM's GPU model runner makes them: one raw buffer, one view a layer."""
    kernel = shape.kernel_block_size or shape.block_size
    page_bytes = spec.page_size_bytes
    num_layers = len(layer_names)
    if shape.layout.is_layer_compact:
        layer_stride, block_stride = page_bytes * shape.num_blocks, page_bytes
    else:
        layer_stride, block_stride = page_bytes, page_bytes * num_layers
    size = page_bytes * shape.num_blocks * num_layers
    tensor = KVCacheTensor(
        size=size, layers=layer_names, layer_stride=layer_stride, block_stride=block_stride
    )
    config = KVCacheConfig(
        num_blocks=shape.num_blocks,
        kv_cache_tensors=[tensor],
        kv_cache_groups=[KVCacheGroupSpec(layer_names, spec)],
    )
    raw = torch.zeros(size, dtype=torch.int8, device=shape.device)
    views = create_kv_cache_views(
        raw, spec, shape.num_blocks, shape.layout, tensor, kernel_block_size=kernel
    )
    for view in views:
        view.fill_(POISON)
    return config, dict(zip(layer_names, views, strict=True))
