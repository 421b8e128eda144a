"""The embedded decoding engine: a model, a scheduler, and hicache (or a private pool).

    engine = Engine(model, EngineConfig(), cache=cache)
    outputs = engine.generate([prompt_ids], SamplingParams(max_new_tokens=16))

or, step by step (continuous batching): `add_request(...)` at any time, `step()` until
`has_work` is false; each step returns the requests that finished in it.

With `cache=None` the engine keeps its KV in a private pool and shares nothing: the
cache-off baseline, which a cache-on run must equal (bitwise on the CPU): a hit changes
which rows are computed, never the model.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence

import numpy as np
import torch

from engine_integration.engine.errors import EngineError
from engine_integration.engine.model.config import EngineConfig
from engine_integration.engine.model.forward import Model
from engine_integration.engine.pages import CachedPages, PrivatePages
from engine_integration.engine.request import Request, RequestMetrics, RequestOutput, RequestState
from engine_integration.engine.sampling import SamplingParams, sample
from engine_integration.engine.scheduler import Scheduler
from engine_integration.engine.sidecar import SidecarShape
from hicache.controller import HiCache
from hicache.fetch_plan import attention_pairs
from radix.keys import Namespace, encode_tokens
from tiers.layout import KVLayout


def numerics_key(model: Model) -> str:
    """What a page's bits depend on beyond the model and layout: the deterministic path's
    kernels round otherwise than the default path's, so its pages live apart (a hit on a
    page the other path wrote would be right only to rounding, which it promises more than)."""
    return "numerics=deterministic" if model.deterministic else ""


def kv_layout_for(model: Model, page_size: int) -> KVLayout:
    """The KV layout hicache holds for `model`: its source layers' KV (an interleaved
    model's full-attention layers only: its windowed layers' KV goes to sidecars), then (a
    hybrid model) the boundary residual in `num_boundary_layers` more layers of the same
    shape."""
    config = model.config
    return KVLayout(
        kind="mha",
        num_layers=config.num_page_layers,
        page_size=page_size,
        dtype=str(model.dtype).removeprefix("torch."),
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
    )


class Engine:
    def __init__(
        self,
        model: Model,
        config: EngineConfig,
        *,
        cache: HiCache | None = None,
        namespace: Namespace | None = None,
        num_private_pages: int | None = None,
    ) -> None:
        self.model = model
        self.config = config
        self.cache = cache
        layout = kv_layout_for(model, config.page_size)
        if cache is not None:
            if cache.device_pool.device != model.device:
                raise EngineError(
                    f"the cache's L1 is on {cache.device_pool.device}, the model on {model.device}"
                )
            if cache.layout != layout:
                raise EngineError(
                    f"the cache holds {cache.layout.descriptor()}, the model needs "
                    f"{layout.descriptor()}"
                )
            self.namespace = namespace or Namespace(
                model_id=model.config.model_id,
                layout=layout.descriptor(),
                extra_key=numerics_key(model),
            )
            shape = SidecarShape.of(model.config, layout.page_size)
            pages = CachedPages(cache, self.namespace, shape)
            num_pages = cache.executor.num_device_pages
            for cost in model.step_costs:  # what this model's steps cost so far (warm-up)
                cache.record_compute(*cost)
        else:
            if not num_private_pages:
                raise EngineError("an engine without a cache needs num_private_pages")
            self.namespace = None
            pages = PrivatePages(layout, num_private_pages, config.device)
            num_pages = num_private_pages
        self.pages = pages
        self.scheduler = Scheduler(config, model.config, pages, num_pages, dtype=model.dtype)
        self._ids = itertools.count()
        self._requests: dict[str, Request] = {}

    # ------------------------------------------------------------------ requests

    def add_request(
        self,
        prompt: Sequence[int],
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
    ) -> Request:
        """Queue a request."""
        ids = np.asarray(prompt)
        if ids.ndim != 1 or not ids.size:
            raise ValueError("a request needs a flat, non-empty list of prompt token ids")
        if ids.dtype.kind not in "iu":
            raise ValueError(f"prompt token ids must be integers, got {ids.dtype}")
        vocab = self.model.config.vocab_size
        if int(ids.min()) < 0 or int(ids.max()) >= vocab:
            bad = ids[(ids < 0) | (ids >= vocab)].tolist()
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        request = Request(
            request_id=request_id,
            prompt=ids.tolist(),
            encoded_prompt=encode_tokens(ids),
            params=params or SamplingParams(),
            metrics=RequestMetrics(prompt_tokens=len(prompt), arrival_s=time.perf_counter()),
        )
        self.scheduler.add(request)
        self._requests[request_id] = request
        return request

    def abort(self, request_id: str) -> None:
        request = self._requests.pop(request_id)
        self.scheduler.abort(request)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    # ------------------------------------------------------------------ running

    def step(self) -> list[RequestOutput]:
        """One forward pass over every running request; returns those that finished."""
        plan = self.scheduler.schedule()
        if not plan:
            return []
        began, graphs = time.perf_counter(), self.model.num_graphs
        logits = self.model.forward([rows for _, rows in plan], self.pages.layer).cpu()
        if self.model.num_graphs == graphs:  # a step that captured CUDA graphs is no sample
            self._report_compute(plan, time.perf_counter() - began)
        finished, next_logits = [], 0
        for request, rows in plan:
            if request.state == RequestState.PREFILL:
                self.scheduler.prefilled(request, rows.end)
            if not rows.want_logits:
                continue
            self._append_token(request, logits[next_logits])
            next_logits += 1
            if request.finish_reason is not None:
                self.scheduler.finish(request)
                del self._requests[request.request_id]
                finished.append(request.to_output())
        return finished

    def _report_compute(self, plan, seconds: float) -> None:
        """Tell the cache what a step cost (its load-or-recompute choice weighs L3 reads
        against it), and the model (`Model.step_costs`: a cache of a later engine starts
        from them); a step that waited for a load says nothing about compute."""
        for request, rows in plan:
            if rows.wait_layer is not None and request.match.has_loads:
                return
        num_rows = sum(rows.num_rows for _, rows in plan)
        num_pairs = sum(attention_pairs(rows.start, rows.end) for _, rows in plan)
        self.model.step_costs.append((num_rows, num_pairs, seconds))
        if self.cache is not None:
            self.cache.record_compute(num_rows, num_pairs, seconds)

    def _append_token(self, request: Request, logits: torch.Tensor) -> None:
        params = request.params
        token = sample(logits, params, request.generator)
        if request.state == RequestState.PREFILL:
            request.state = RequestState.DECODE
            request.metrics.first_token_s = time.perf_counter()
        request.output.append(token)
        if params.return_logits:
            request.logits.append(logits.clone())
        if token in params.stop_token_ids:
            request.finish_reason = "stop"
        elif len(request.output) >= params.max_new_tokens:
            request.finish_reason = "length"

    def run(self) -> list[RequestOutput]:
        """Step until every queued request has finished; outputs in finishing order."""
        outputs = []
        while self.has_work:
            outputs.extend(self.step())
        return outputs

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams | None = None
    ) -> list[RequestOutput]:
        """Run `prompts` together (continuous batching); outputs in prompt order."""
        ids = [self.add_request(prompt, params).request_id for prompt in prompts]
        by_id = {output.request_id: output for output in self.run()}
        return [by_id[request_id] for request_id in ids]
