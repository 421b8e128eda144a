"""Putting an engine together: a model (built-in or from a directory), its tokenizer, and a
HiCache sized for it.

    model, tokenizer = load_model(None, EngineConfig())            # built-in tiny model
    cache = build_cache(model, EngineConfig(), CacheSizes(l1_pages=64, l2_pages=256,
                        l3_url="file:///var/cache/kv?capacity=1GiB"))
    engine = Engine(model, EngineConfig(), cache=cache)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from engine_integration.config import EngineConfig, ModelConfig, tiny_model_config
from engine_integration.engine import kv_layout_for
from engine_integration.model import Model
from engine_integration.tokenizer import HFTokenizer, Tokenizer, load_tokenizer
from engine_integration.weights import load_weights, random_weights, read_model_config
from hicache.config import HiCacheConfig, L1Config, L2Config, L3Config, PolicyConfig
from hicache.controller import HiCache


def load_model(
    model_dir: str | Path | None,
    engine_config: EngineConfig,
    *,
    seed: int = 0,
    model_config: ModelConfig | None = None,
    num_source_layers: int | None = None,
    window_tokens: int | None = None,
) -> tuple[Model, Tokenizer]:
    """The model in `model_dir` (config.json + *.safetensors, tokenizer.json if any), or,
    without one, `model_config` (default: the built-in tiny model) with random weights
    from `seed`. The overrides change the hybrid plan of a loaded model."""
    dtype = getattr(torch, engine_config.dtype_name)
    device = engine_config.device
    block_rows = engine_config.block_tokens if engine_config.invariant else None
    if model_dir is None:
        config = model_config or tiny_model_config(seed)
        changes = {"num_source_layers": num_source_layers, "window_tokens": window_tokens}
        config = config.replace(**{k: v for k, v in changes.items() if v is not None})
        weights = random_weights(config, seed, dtype=dtype, device=device)
        return Model(config, weights, block_rows=block_rows), load_tokenizer(None)
    config = read_model_config(
        model_dir, num_source_layers=num_source_layers, window_tokens=window_tokens
    )
    weights = load_weights(config, model_dir, dtype=dtype, device=device)
    tokenizer = load_tokenizer(model_dir)
    if isinstance(tokenizer, HFTokenizer) and tokenizer.vocab_size > config.vocab_size:
        raise ValueError(
            f"{model_dir}: tokenizer has {tokenizer.vocab_size} tokens, the model "
            f"{config.vocab_size}"
        )
    return Model(config, weights, block_rows=block_rows), tokenizer


@dataclass(frozen=True)
class CacheSizes:
    """l1_pages: L1 pool pages (0: size from free device memory, CUDA only).
    l2_pages: L2 host pool pages (0: no L2, and so no L3).
    l3_url:   L3 backend URL, e.g. file:///abs/dir?capacity=1GiB (None: no L3)."""

    l1_pages: int
    l2_pages: int = 0
    l3_url: str | None = None
    policy: PolicyConfig = PolicyConfig()


def build_cache(model: Model, engine_config: EngineConfig, sizes: CacheSizes) -> HiCache:
    layout = kv_layout_for(model, engine_config.page_size)
    on_cuda = engine_config.on_cuda
    config = HiCacheConfig(
        layout=layout,
        l1=L1Config(device=engine_config.device, num_pages=sizes.l1_pages),
        l2=L2Config(
            budget_bytes=sizes.l2_pages * layout.bytes_per_page,
            reserve_bytes=0 if not on_cuda else L2Config().reserve_bytes,
            pin_memory=on_cuda,
        ),
        l3=L3Config(url=sizes.l3_url),
        policy=sizes.policy,
    )
    return HiCache(config)
