"""What a replica measured, as a hardware profile (`GET /v1/hicache/profile`).

The document is `hicache.simulate.profile`'s (format, version, fields): the compute fit of
the engine's steps and the link and L3 rates its cache measured for the load-or-recompute
choice (`hicache.fetch_plan`), the model as the simulator's `ModelSpec` fields, the page
size and bytes per page of the engine's KV layout, its prefill chunk, the device and the
dtype. `compute` is null until the engine has run enough steps to fit it (three). A
replica without a cache (`--no-cache`) fits its model's own step costs the same way and
reports the cache's priors for the rates, with 0 samples.
`hicache simulate --calibrate URL` reads it and writes it to a file.
"""

from __future__ import annotations

import dataclasses
import platform
import time

import torch

from engine_integration.engine.core import kv_layout_for
from engine_integration.engine.model.config import EngineConfig, ModelConfig
from engine_integration.engine.model.forward import Model
from hicache.config import PolicyConfig
from hicache.controller import HiCache
from hicache.fetch_plan import FetchRates
from hicache.simulate.profile import PROFILE_FORMAT, PROFILE_VERSION


def model_fields(config: ModelConfig, dtype: str) -> dict:
    """The engine's model as the simulator's `ModelSpec` fields: its late window layers are
    the spec's sliding layers, its boundary layers ride in every page as in the engine."""
    return {
        "name": config.model_id,
        "attention": "gqa",
        "num_layers": config.num_layers,
        "hidden_size": config.hidden_size,
        "num_heads": config.num_heads,
        "vocab_size": config.vocab_size,
        "intermediate_size": config.intermediate_size,
        "head_dim": config.head_dim,
        "num_kv_heads": config.num_kv_heads,
        "tie_embeddings": config.tie_word_embeddings,
        "sliding_window": config.window_tokens if config.num_late_layers else 0,
        "num_sliding_layers": config.num_late_layers,
        "num_boundary_layers": config.num_boundary_layers,
        "weight_dtype": dtype if dtype != "float32" else "bfloat16",  # weights: sizing only
        "kv_dtype": dtype,
    }


def device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    machine = platform.processor() or platform.machine()
    return f"cpu ({machine}, {torch.get_num_threads()} torch threads)"


def replica_profile(model: Model, engine_config: EngineConfig, cache: HiCache | None) -> dict:
    """The profile document of this replica, as measured so far."""
    dtype = str(model.dtype).removeprefix("torch.")
    if cache is not None:
        rates = cache.fetch_rates()
    else:  # no cache: the model's own steps, through the same fit
        policy = PolicyConfig()
        own = FetchRates(
            l3_read_prior_bytes_per_s=policy.l3_read_prior_bytes_per_s,
            l2_load_prior_bytes_per_s=policy.l2_load_prior_bytes_per_s,
        )
        for cost in list(model.step_costs):
            own.record_compute(*cost)
        rates = own.snapshot()
    layout = kv_layout_for(model, engine_config.page_size)
    return {
        "format": PROFILE_FORMAT,
        "version": PROFILE_VERSION,
        "model": model_fields(model.config, dtype),
        "device": device_name(engine_config.device),
        "dtype": dtype,
        "page_size": engine_config.page_size,
        "page_bytes": layout.bytes_per_page,
        "prefill_chunk_tokens": engine_config.prefill_chunk_tokens,
        "max_running_requests": engine_config.max_running_requests,
        "compute": dataclasses.asdict(rates.compute) if rates.compute is not None else None,
        "num_compute_samples": rates.num_compute_samples,
        "l2_load_bytes_per_s": rates.l2_load_bytes_per_s,
        "num_load_samples": rates.num_load_samples,
        "l3_read_bytes_per_s": rates.l3_read_bytes_per_s,
        "num_read_samples": rates.num_read_samples,
        "l3_latency_s": rates.l3_latency_s,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
