"""Which kernel paths implement a model's block: the dense CUDA path's own kernels
(`dense_kernels`) and the deterministic path's (`check_deterministic`, which refuses by name
what they cannot run). `forward.Model` asks both when it is built."""

from __future__ import annotations

import torch

from engine_integration.engine.model.config import ModelConfig
from tiers.jit import HAVE_TRITON, INTERPRETED


def _dense_missing(config: ModelConfig) -> list[str]:
    """What of `config` the dense CUDA path (and the deterministic one) does not implement."""
    missing = []
    if config.gemma:
        missing.append("Gemma 3's block (1 + w norms, query/key norms, GELU gating)")
    if config.windowed_layers:
        missing.append("windowed source layers (interleaved sliding windows)")
    return missing


def dense_kernels(config: ModelConfig) -> bool:
    """Whether the dense CUDA path's own kernels (fused norm and RoPE, paged attention,
    CUDA graphs of whole layers) implement this model's block. A model they do not (Gemma
    3: `_dense_missing`) still runs dense batches on CUDA, through torch's ops, as the CPU's
    dense path does: never through the batch-invariant blocks, whose per-block calls made a
    4,096-token Gemma 3 270M prefill take 2.9 s on the H200."""
    return not _dense_missing(config)


def check_deterministic(config: ModelConfig, device: torch.device, block_rows: int | None) -> None:
    """Refuse, by name, a deterministic model its kernels cannot run: what the dense CUDA
    path's kernels do not implement (`dense_kernels`), head shapes the attention kernel does not
    take, the CPU outside Triton's interpreter, no triton at all."""
    where = f"{config.model_id}: EngineConfig.deterministic"
    if block_rows is not None:
        raise ValueError(f"{where} runs dense batches, not blocks of {block_rows} rows")
    if not HAVE_TRITON:
        raise ValueError(f"{where} needs triton (pip install 'hicache[gpu]')")
    if device.type == "cpu" and not INTERPRETED:
        raise ValueError(
            f"{where} runs its Triton kernels on CUDA (on the CPU only under "
            "TRITON_INTERPRET=1, for tests); the CPU's own bitwise path is batch_invariant"
        )
    dim = config.head_dim
    if dim < 16 or dim & (dim - 1) or config.num_heads // config.num_kv_heads > 128:
        raise ValueError(
            f"{where}: its attention takes a power-of-two head_dim >= 16 and at most 128 "
            f"query heads a KV head, got head_dim {dim}, {config.num_heads} over "
            f"{config.num_kv_heads}"
        )
    missing = _dense_missing(config)
    if missing:
        raise ValueError(f"{where} does not implement {' or '.join(missing)}")
