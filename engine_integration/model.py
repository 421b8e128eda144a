"""The transformer's forward pass over one engine step.

A step is a list of `SeqRows`: for each request, the consecutive positions it computes
now; `late_runs` name the positions that go through the late (sliding-window) layers; a
request that wants logits gets them for its last row.

    source layers   every row writes K/V into the request's L1 pages, then each request
                    attends over its pages (waiting for layer i's load first)
    boundary        (a hybrid model) every row writes its source output, the boundary
                    residual, into the pages' boundary layers (`num_boundary_layers`)
    late layers     only the late positions, over the request's window ring; positions
                    before the step's rows (a hit's *replay*) read their input back from
                    the boundary layers instead of running the source layers again
    head            final norm and LM head for the rows that want logits

This module knows no cache, scheduler or sampling: it reads and writes pages through the
`page_table` of each request and the layer tensors it is handed.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from engine_integration.attention import (
    check_tile_invariance,
    page_slots,
    source_attention,
    window_attention,
    write_kv,
)
from engine_integration.config import ModelConfig
from engine_integration.graphs import RowwiseGraphs
from engine_integration.rows import RowLayout, as_index, check_gemm_invariance
from engine_integration.weights import LayerWeights, ModelWeights
from engine_integration.window import LateWindow


@dataclass
class SeqRows:
    """One request's rows in a step: positions [start, end) of `token_ids`."""

    token_ids: Sequence[int]  # the tokens at positions start .. end - 1
    start: int
    end: int
    page_table: torch.Tensor  # (num_pages,) long: the request's L1 page ids, on the device
    window: LateWindow | None
    late_runs: list[tuple[int, int]] = field(default_factory=list)  # ascending, below end
    want_logits: bool = False
    wait_layer: Callable[[int], None] | None = None  # before reading layer i of the hit's pages

    @property
    def num_rows(self) -> int:
        return self.end - self.start


class RotaryTable:
    """cos/sin of every position, computed per position in float64 (so a value never
    depends on how large the table is), grown by doubling."""

    def __init__(self, config: ModelConfig, device, dtype: torch.dtype) -> None:
        self._inv_freq = _inverse_frequencies(config)
        self._device = device
        self._dtype = dtype
        self._cos = self._sin = torch.empty(0, config.head_dim, dtype=dtype, device=device)

    def lookup(self, positions: torch.Tensor, max_position: int):
        """cos, sin (n, 1, D) of `positions`, all <= max_position (given by the caller, so
        that no device value is read back here)."""
        if max_position >= self._cos.shape[0]:
            size = max(max_position + 1, 2 * self._cos.shape[0], 4096)
            angles = torch.outer(torch.arange(size, dtype=torch.float64), self._inv_freq)
            angles = torch.cat([angles, angles], dim=-1)
            self._cos = angles.cos().to(self._dtype).to(self._device)
            self._sin = angles.sin().to(self._dtype).to(self._device)
        return self._cos[positions][:, None, :], self._sin[positions][:, None, :]


def _flat(layer: torch.Tensor) -> torch.Tensor:
    """A pool layer (pages, page_size, 2, H, D) as one row per slot (pages * page_size, 2, H, D)."""
    return layer.view(-1, *layer.shape[2:])


def _inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    dim = config.head_dim
    inv_freq = 1.0 / config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    low_wavelen = scaling.original_max_position_tokens / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_tokens / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (scaling.original_max_position_tokens / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _projection_shapes(config: ModelConfig) -> list[tuple[int, int]]:
    """(in, out) of every projection: q/k/v, output, gate/up, down, LM head."""
    hidden = config.hidden_size
    qkv = config.q_size + 2 * config.kv_size
    return [
        (hidden, qkv),
        (config.q_size, hidden),
        (hidden, 2 * config.intermediate_size),
        (config.intermediate_size, hidden),
        (hidden, config.vocab_size),
    ]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    variance = x.float().pow(2).mean(-1, keepdim=True)
    return weight * (x.float() * torch.rsqrt(variance + eps)).to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


class Model:
    """Weights plus the forward pass. `block_rows` is the batch-invariant block size
    (None: dense batches, for CUDA). `cuda_graphs`: dense batches on CUDA replay the
    row-wise halves of each layer as CUDA graphs (`engine_integration.graphs`); False runs
    every kernel eagerly."""

    def __init__(
        self,
        config: ModelConfig,
        weights: ModelWeights,
        *,
        block_rows: int | None,
        cuda_graphs: bool = True,
    ):
        if len(weights.layers) != config.num_layers:
            raise ValueError(
                f"weights hold {len(weights.layers)} layers, the config {config.num_layers}"
            )
        self.config = config
        self.weights = weights
        self.block_rows = block_rows
        self.device = weights.device
        self.dtype = weights.dtype
        self.scale = config.head_dim**-0.5
        self.rope = RotaryTable(config, self.device, self.dtype)
        # Dense batches on CUDA replay the row-wise halves of each layer as CUDA graphs.
        # Batch invariance rests on measured properties of the CPU's gemm (rows.py) and of its
        # attention kernel (attention.py): checked at the model's shapes, once per process.
        self.bitwise_invariant = block_rows is not None and check_gemm_invariance(
            _projection_shapes(config), self.dtype
        )
        if self.bitwise_invariant and self.device.type == "cpu":
            self.bitwise_invariant = check_tile_invariance(
                config.num_heads, config.num_kv_heads, config.head_dim, block_rows, self.dtype
            )
        dense_cuda = block_rows is None and self.device.type == "cuda"
        self._graphs = RowwiseGraphs() if dense_cuda and cuda_graphs else None

    @property
    def num_graphs(self) -> int:
        """CUDA graphs captured so far (0 without them)."""
        return self._graphs.num_graphs if self._graphs is not None else 0

    @torch.inference_mode()
    def forward(self, seqs: Sequence[SeqRows], page_layer: Callable[[int], torch.Tensor]):
        """Run one step; `page_layer(i)` is layer i of the L1 pool, (pages, page_size, 2, H,
        D): the source layers, then the boundary layers. Returns logits (float32, one row
        per request with want_logits, in order)."""
        config = self.config
        layout = self._layout([(s.start, s.end) for s in seqs])
        rope = self.rope.lookup(layout.positions, layout.max_position)
        ids = as_index([t for s in seqs for t in s.token_ids], self.device)
        x = layout.pack(self.weights.embed.index_select(0, ids))  # (packed, hidden)
        page_size = page_layer(0).shape[1]
        slots = [page_slots(s.page_table, page_size, s.end) for s in seqs]
        for i in range(config.num_source_layers):
            x = self._source_layer(i, x, layout, rope, seqs, slots, page_layer(i))
        hidden = layout.unpack(x)  # (rows, hidden)
        if config.num_late_layers:
            first = config.num_source_layers
            boundary = [_flat(page_layer(first + k)) for k in range(config.num_boundary_layers)]
            self._store_boundary(hidden, seqs, slots, boundary)
            hidden = self._late_layers(hidden, seqs, slots, boundary)
        return self._head(hidden, seqs)

    # ------------------------------------------------------------------ layers

    def _source_layer(self, i, x, layout: RowLayout, rope, seqs, slots, kv_layer):
        weights = self.weights.layers[i]
        q, kv = self._project(weights, x, layout, rope)
        flat_kv = _flat(kv_layer)
        outputs, row = [], 0
        for seq, seq_slots in zip(seqs, slots, strict=True):
            seq_q, seq_kv = q[row : row + seq.num_rows], kv[row : row + seq.num_rows]
            row += seq.num_rows
            write_kv(flat_kv, seq_slots[seq.start : seq.end], seq_kv)
            if seq.wait_layer is not None:
                seq.wait_layer(i)
            outputs.append(
                source_attention(
                    seq_q,
                    seq.start,
                    flat_kv,
                    seq_slots,
                    seq.end,
                    scale=self.scale,
                    block_rows=self.block_rows,
                )
            )
        attn = outputs[0] if len(outputs) == 1 else torch.cat(outputs)
        return self._finish_layer(weights, x, layout, attn)

    def _store_boundary(self, hidden: torch.Tensor, seqs, slots, boundary) -> None:
        """Write every row's source output into its page slot of the boundary layers (in
        `num_boundary_layers` pieces of one KV slot each, zero-padded)."""
        width = boundary[0].shape[1:].numel()
        padded = F.pad(hidden, (0, len(boundary) * width - hidden.shape[1]))
        pieces = padded.view(hidden.shape[0], len(boundary), *boundary[0].shape[1:])
        parts = [seq_slots[s.start : s.end] for s, seq_slots in zip(seqs, slots, strict=True)]
        targets = parts[0] if len(parts) == 1 else torch.cat(parts)
        for k, layer in enumerate(boundary):
            write_kv(layer, targets, pieces[:, k])

    def _stored_boundary(self, seq: SeqRows, slots: torch.Tensor, boundary) -> torch.Tensor:
        """The source output of the positions at `slots`, read back from the boundary layers
        (after their load into L1)."""
        if seq.wait_layer is not None:
            for k in range(len(boundary)):
                seq.wait_layer(self.config.num_source_layers + k)
        pieces = [layer.index_select(0, slots).flatten(1) for layer in boundary]
        return torch.cat(pieces, dim=1)[:, : self.config.hidden_size]

    def _late_layers(self, hidden: torch.Tensor, seqs, slots, boundary) -> torch.Tensor:
        """The late layers over each request's late positions; returns `hidden` with the
        step's late rows replaced (rows that skip the late layers keep their source output;
        replayed positions before the step only rebuild the window)."""
        runs, inputs, rows, kept = [], [], [], []
        row = packed = 0
        for seq, seq_slots in zip(seqs, slots, strict=True):
            for start, end in seq.late_runs:
                runs.append((seq, start, end))
                if start < seq.start:  # a hit's replay: the input is stored in its pages
                    replayed = min(end, seq.start)
                    inputs.append(self._stored_boundary(seq, seq_slots[start:replayed], boundary))
                    packed += replayed - start
                    start = replayed
                first, last = row + start - seq.start, row + end - seq.start
                inputs.append(hidden[first:last])
                rows.extend(range(first, last))
                kept.extend(range(packed, packed + last - first))
                packed += last - first
            row += seq.num_rows
        if not runs:
            return hidden
        layout = self._layout([(s, e) for _, s, e in runs])
        rope = self.rope.lookup(layout.positions, layout.max_position)
        x = layout.pack(inputs[0] if len(inputs) == 1 else torch.cat(inputs))
        first = self.config.num_source_layers
        for j in range(self.config.num_late_layers):
            weights = self.weights.layers[first + j]
            q, kv = self._project(weights, x, layout, rope)
            outputs, offset = [], 0
            for seq, start, end in runs:
                n = end - start
                outputs.append(
                    window_attention(
                        q[offset : offset + n],
                        kv[offset : offset + n],
                        start,
                        seq.window,
                        j,
                        scale=self.scale,
                        block_rows=self.block_rows,
                    )
                )
                offset += n
            x = self._finish_layer(weights, x, layout, torch.cat(outputs))
        if not rows:
            return hidden
        out = layout.unpack(x)
        if len(kept) < out.shape[0]:
            out = out.index_select(0, as_index(kept, self.device))
        hidden = hidden.clone()
        hidden.index_copy_(0, as_index(rows, self.device), out)
        return hidden

    def _head(self, hidden: torch.Tensor, seqs) -> torch.Tensor:
        rows, runs, row = [], [], 0
        for seq in seqs:
            row += seq.num_rows
            if seq.want_logits:
                rows.append(row - 1)
                runs.append((seq.end - 1, seq.end))
        if not rows:
            return torch.empty(0, self.config.vocab_size, device=self.device)
        layout = RowLayout.build(runs, self.block_rows, self.device)
        last = hidden.index_select(0, as_index(rows, self.device))
        eps = self.config.rms_norm_eps
        normed = layout.rowwise(
            lambda block: rms_norm(block, self.weights.final_norm, eps), layout.pack(last)
        )
        return layout.unpack(layout.linear(normed, self.weights.lm_head)).float()

    # ------------------------------------------------------------------ row-wise parts

    def _layout(self, runs) -> RowLayout:
        """The rows of a layer stack (the MLP's activation is the elementwise op)."""
        return RowLayout.build(
            runs, self.block_rows, self.device, pointwise_width=self.config.intermediate_size
        )

    def _project(self, weights: LayerWeights, x, layout: RowLayout, rope):
        """Norm, q/k/v projection and RoPE.
        -> q (rows, Hq, D) and kv (rows, 2, H, D) of the real rows."""
        if self._graphs is not None:
            return self._graphs.run(
                ("project", id(weights)),
                lambda x, cos, sin: self._project_rows(weights, x, layout, (cos, sin)),
                (x,),
                shared=rope,
            )
        return self._project_rows(weights, x, layout, rope)

    def _project_rows(self, weights: LayerWeights, x, layout: RowLayout, rope):
        config = self.config
        eps = config.rms_norm_eps
        sizes = [config.q_size, config.kv_size, config.kv_size]
        normed = layout.rowwise(lambda block: rms_norm(block, weights.input_norm, eps), x)
        qkv = layout.linear(normed, weights.qkv, weights.qkv_bias)

        def rotate(block, cos, sin):
            q, k, v = block.split(sizes, dim=-1)
            q = q.reshape(-1, config.num_heads, config.head_dim)
            k = k.reshape(-1, config.num_kv_heads, config.head_dim)
            v = v.reshape(-1, config.num_kv_heads, config.head_dim)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            return q, torch.stack([k, v], dim=1)

        q, kv = layout.rowwise(rotate, qkv, *rope)
        return layout.unpack(q), layout.unpack(kv)

    def _finish_layer(self, weights: LayerWeights, x, layout: RowLayout, attn) -> torch.Tensor:
        """Output projection, residual, norm, SwiGLU MLP, residual."""
        if self._graphs is not None:
            return self._graphs.run(
                ("finish", id(weights)),
                lambda x, attn: self._finish_rows(weights, x, layout, attn),
                (x, attn),
            )
        return self._finish_rows(weights, x, layout, attn)

    def _finish_rows(self, weights: LayerWeights, x, layout: RowLayout, attn) -> torch.Tensor:
        eps = self.config.rms_norm_eps
        x = x + layout.linear(layout.pack(attn.flatten(1)), weights.o, weights.o_bias)
        normed = layout.rowwise(lambda block: rms_norm(block, weights.post_norm, eps), x)
        gate_up = layout.linear(normed, weights.gate_up)

        def swiglu(block):
            gate, up = block.chunk(2, dim=-1)
            return F.silu(gate) * up

        activated = layout.pointwise(swiglu, gate_up, width=self.config.intermediate_size)
        return x + layout.linear(activated, weights.down)
