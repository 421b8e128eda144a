"""Putting an engine together: a model (built-in, a GGUF file or a Hugging Face directory),
its tokenizer, and a HiCache sized for it.

    model, tokenizer = load_model(smollm2_path(), EngineConfig())     # SmolLM2-135M-Instruct
    model, tokenizer = load_model(gemma3_path(), EngineConfig())      # Gemma 3 270M (base)
    model, tokenizer = load_model(None, EngineConfig())               # built-in tiny model
    cache = build_cache(model, EngineConfig(), CacheSizes(l1_pages=64, l2_pages=256,
                        l3_url="file:///var/cache/kv?capacity=1GiB"))
    engine = Engine(model, EngineConfig(), cache=cache)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from engine_integration.engine.core import Engine, kv_layout_for
from engine_integration.engine.errors import CheckpointError
from engine_integration.engine.model.config import EngineConfig, ModelConfig, tiny_model_config
from engine_integration.engine.model.forward import Model
from engine_integration.engine.model.graphs import MAX_ROWS, bucket
from engine_integration.engine.model.tokenizer import (
    HFTokenizer,
    Tokenizer,
    gguf_tokenizer,
    load_tokenizer,
)
from engine_integration.engine.model.weights import load_weights, random_weights, read_model_config
from engine_integration.engine.packaged import (  # noqa: F401 (re-exported)
    GEMMA3_INSTALL,
    GEMMA3_PACKAGE,
    SMOLLM2_FILE,
    SMOLLM2_PACKAGE,
    gemma3_path,
    smollm2_path,
)
from engine_integration.engine.sampling import SamplingParams
from engine_integration.engine.scheduler import replay_reach
from hicache.config import HiCacheConfig, L1Config, L2Config, L3Config, PolicyConfig
from hicache.controller import HiCache


def load_model(
    model_path: str | Path | None,
    engine_config: EngineConfig,
    *,
    seed: int = 0,
    model_config: ModelConfig | None = None,
    num_source_layers: int | None = None,
    window_tokens: int | None = None,
    window_layers: int | None = None,
) -> tuple[Model, Tokenizer]:
    """The model at `model_path`: a `.gguf` file, or a directory with config.json and
    *.safetensors (tokenizer.json if any); without one, `model_config` (default: the built-in
    tiny model) with random weights from `seed`.

    The overrides change the model's attention plan (and so its math): `window_layers` K
    makes the last K layers sliding-window layers of `window_tokens` (default 128);
    `num_source_layers` says the same from the other end."""
    dtype = getattr(torch, engine_config.dtype_name)
    device = engine_config.device
    block_rows = engine_config.block_tokens if engine_config.invariant else None
    if model_path is None:
        config = _with_plan(
            model_config or tiny_model_config(seed), num_source_layers, window_tokens, window_layers
        )
        weights = random_weights(config, seed, dtype=dtype, device=device)
        return Model(config, weights, block_rows=block_rows), load_tokenizer(None)
    path = Path(model_path)
    if path.is_file():
        from engine_integration.engine.model.gguf_checkpoint import (
            load_gguf_weights,
            open_gguf,
            read_gguf_config,
        )

        gguf = open_gguf(path)
        config = _with_plan(read_gguf_config(gguf), num_source_layers, window_tokens, window_layers)
        weights = load_gguf_weights(gguf, config, dtype=dtype, device=device)
        tokenizer: Tokenizer = (
            gguf_tokenizer(gguf.metadata, str(path))
            if "tokenizer.ggml.model" in gguf.metadata
            else load_tokenizer(None)  # a file without a tokenizer: token ids only
        )
    else:
        config = read_model_config(path)
        config = _with_plan(config, num_source_layers, window_tokens, window_layers)
        weights = load_weights(config, path, dtype=dtype, device=device)
        tokenizer = load_tokenizer(path)
    if isinstance(tokenizer, HFTokenizer) and tokenizer.vocab_size > config.vocab_size:
        raise CheckpointError(
            f"{path}: tokenizer has {tokenizer.vocab_size} tokens, the model {config.vocab_size}"
        )
    return Model(config, weights, block_rows=block_rows), tokenizer


def _with_plan(
    config: ModelConfig,
    num_source_layers: int | None,
    window_tokens: int | None,
    window_layers: int | None,
) -> ModelConfig:
    if window_layers is not None:
        if num_source_layers is not None:
            raise ValueError("give window_layers or num_source_layers, not both")
        if not 0 <= window_layers < config.num_layers:
            raise ValueError(
                f"window_layers must be in [0, {config.num_layers}) (the cache needs at least "
                f"one full-attention layer), got {window_layers}"
            )
        num_source_layers = config.num_layers - window_layers
    changes = {"num_source_layers": num_source_layers, "window_tokens": window_tokens}
    return config.replace(**{k: v for k, v in changes.items() if v is not None})


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


def warm_up(model: Model, engine_config: EngineConfig, max_rows: int | None = None) -> None:
    """Throwaway requests on private pages (no cache), so that what first calls cost is paid
    before the first real request, as serving engines do at start: on CUDA a prompt of each
    CUDA-graph row bucket up to `max_rows` (default: a prefill chunk, at most
    `graphs.MAX_ROWS`), which captures that bucket's graphs and has cuBLAS and the
    attention kernels pick theirs; on the CPU one short request."""
    lengths = (
        warm_up_lengths(model.config, engine_config, max_rows) if engine_config.on_cuda else [100]
    )
    page_size = engine_config.page_size
    engine = Engine(model, engine_config, num_private_pages=-(-max(lengths) // page_size) + 4)
    vocab = model.config.vocab_size
    for length in lengths:
        engine.generate([[i % vocab for i in range(length)]], SamplingParams(max_new_tokens=2))


def warm_up_lengths(
    config: ModelConfig, engine_config: EngineConfig, max_rows: int | None = None
) -> list[int]:
    """The prompt lengths `warm_up` runs on CUDA: one of each row bucket up to `max_rows`,
    and those whose late rows cross a chunk boundary (`_crossing_lengths`)."""
    top = min(max_rows or engine_config.prefill_chunk_tokens, MAX_ROWS)
    lengths = [bucket(1)]
    while lengths[-1] * 2 <= top:
        lengths.append(lengths[-1] * 2)
    return lengths + _crossing_lengths(config, engine_config.prefill_chunk_tokens, lengths)


def _crossing_lengths(config: ModelConfig, chunk: int, buckets: list[int]) -> list[int]:
    """Prompt lengths whose late rows cross a chunk boundary, `rows` of them (one per
    bucket) in the later chunk: a prefill's first late rows run each late layer whole
    (`Model._fresh_window`); the later chunk's, which see the ring, run the layer-by-layer
    graphs of their bucket, which the other warm-up prompts never reach."""
    if not config.num_late_layers:
        return []
    reach = replay_reach(config.num_late_layers, config.window_tokens)
    rows = sorted({min(size, reach - 1, chunk) for size in buckets})
    return [chunk + n for n in rows if n > 0]
