"""The transformer's forward pass over one engine step.

A step is a list of `SeqRows`: for each request, the consecutive positions it computes
now; `late_runs` name the positions that go through the late (sliding-window) layers; a
request that wants logits gets them for its last row.

    source layers   every row writes K/V into the request's L1 pages, then each request
                    attends over its pages (waiting for layer i's load first); a windowed
                    layer (interleaved models) writes into and attends over the request's
                    ring instead, the last `window_tokens` positions
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
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from engine_integration.engine.model import (
    deterministic,
    deterministic_attention,
    fused,
    paged_attention,
)
from engine_integration.engine.model.attention import (
    check_tile_invariance,
    fresh_window_attention,
    page_slots,
    source_attention,
    window_attention,
    write_kv,
)
from engine_integration.engine.model.config import ModelConfig
from engine_integration.engine.model.graphs import RowwiseGraphs
from engine_integration.engine.model.paged_attention import DeviceStep
from engine_integration.engine.model.rows import (
    ALIGN_ROWS,
    RowLayout,
    Workspace,
    as_index,
    gemm_row_group,
)
from engine_integration.engine.model.weights import LayerWeights, ModelWeights
from engine_integration.engine.model.window import LateWindow
from hicache.fetch_plan import COMPUTE_SAMPLES
from tiers.jit import HAVE_TRITON, INTERPRETED


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
    depends on how large the table is), grown by doubling; the two halves of a row are the
    same frequencies, so hold the same values (`apply_rope` relies on it)."""

    def __init__(
        self, config: ModelConfig, device, dtype: torch.dtype, *, local: bool = False
    ) -> None:
        """`local`: the windowed layers' table (`ModelConfig.local_rope_theta`)."""
        self._inv_freq = _inverse_frequencies(config, local=local)
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


def _inverse_frequencies(config: ModelConfig, *, local: bool = False) -> torch.Tensor:
    dim = config.head_dim
    theta = (config.local_rope_theta or config.rope_theta) if local else config.rope_theta
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    scaling = None if local else config.rope_scaling
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


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS norm over the last dim. A float32 weight on lower-precision x (Gemma 3's 1 + w)
    scales in float32 before the cast back, as Gemma's norm does; otherwise (Llama) the
    normalised x is cast first."""
    variance = x.float().pow(2).mean(-1, keepdim=True)
    if weight.dtype != x.dtype:
        return (weight * (x.float() * torch.rsqrt(variance + eps))).to(x.dtype)
    return weight * (x.float() * torch.rsqrt(variance + eps)).to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, out: torch.Tensor):
    """out = x * cos + rotate_half(x) * sin (rotate_half(x) = [-x2, x1] of the halves x1,
    x2 of the last dim), bit for bit, in fewer passes over memory: cos and sin hold the
    same values in both halves (`RotaryTable`), and -(a * b) == a * -b, a + -b == a - b
    exactly, so the first half is x1 * c - x2 * s and the second x2 * c + x1 * s."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    sin_half = sin[..., :half]
    torch.mul(x, cos, out=out)
    out[..., :half].sub_(x2 * sin_half)
    out[..., half:].add_(x1 * sin_half)


class Model:
    """Weights plus the forward pass. `block_rows` is the batch-invariant block size
    (None: dense batches, for CUDA). `cuda_graphs`: dense batches on CUDA replay the
    row-wise halves of each layer as CUDA graphs (`graphs.py`); False runs
    every kernel eagerly. `deterministic`: dense batches through batch-invariant kernels
    (`EngineConfig.deterministic`; on CUDA, or on the CPU under Triton's interpreter)."""

    def __init__(
        self,
        config: ModelConfig,
        weights: ModelWeights,
        *,
        block_rows: int | None,
        cuda_graphs: bool = True,
        deterministic: bool = False,
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
        self.deterministic = deterministic
        if deterministic:
            check_deterministic(config, self.device, block_rows)
        self.scale = config.attention_scale
        self.rope = RotaryTable(config, self.device, self.dtype)
        # The windowed layers' rotary table, where their base differs (Gemma 3).
        self.local_rope = (
            RotaryTable(config, self.device, self.dtype, local=True)
            if config.windowed_layers and config.local_rope_theta not in (None, config.rope_theta)
            else None
        )
        self._windowed = frozenset(config.windowed_layers)
        # Gemma scales the embedding by sqrt(hidden) in the weights' dtype.
        self._embed_scale = (
            torch.tensor(config.hidden_size**0.5, dtype=self.dtype, device=self.device)
            if config.gemma
            else None
        )
        # Dense batches on CUDA replay the row-wise halves of each layer as CUDA graphs.
        # Batch invariance rests on measured properties of the CPU's gemm (rows.py) and of its
        # attention kernel (attention.py): checked at the model's shapes, once per process.
        row_group = None
        if block_rows is not None:
            row_group = gemm_row_group(_projection_shapes(config), self.dtype, block_rows)
        # Rows are laid out in groups of the measured G (rows.py), or of the default.
        self.align_rows = row_group or ALIGN_ROWS
        # Whether a hit gives the cold prefill's bits: the CPU's measured premises, or the
        # deterministic path's kernels (`deterministic*.py`).
        self.bitwise_invariant = deterministic or row_group is not None
        if row_group is not None and self.device.type == "cpu":
            self.bitwise_invariant = check_tile_invariance(
                config.num_heads, config.num_kv_heads, config.head_dim, block_rows, self.dtype
            )
        # Dense batches on CUDA, through this path's kernels where they implement the block
        # (`dense_kernels`); otherwise through torch's ops, as on the CPU, with the row-wise
        # halves of each layer replayed as graphs all the same.
        dense_on_cuda = block_rows is None and self.device.type == "cuda"
        dense_cuda = dense_on_cuda and dense_kernels(config)
        # The last layer computes only the rows whose output is read (`logits_runs`); False:
        # every row, the reference the tests compare it with.
        self.skip_unread_rows = True
        self._graphs = RowwiseGraphs() if dense_on_cuda and cuda_graphs else None
        # Dense batches on CUDA norm and rotate in one kernel each (`fused`); elsewhere the
        # torch ops, whose bits the CPU's batch invariance rests on.
        # The deterministic path uses them too: a program per row, one order per row.
        self.fused_kernels = dense_cuda or deterministic
        # ... and attend a few queries (a hit's step, a decode step) straight over the pages
        # (`paged_attention`), not through a gathered copy of them; the deterministic path
        # through its own kernel over the pages (`deterministic_attention`), always.
        self.attend_pages = dense_cuda and not deterministic
        # ... and a one-request step of few rows runs each source layer as one graph, which
        # reads the step's position, rows and pages from the device (`DeviceStep`); on the
        # deterministic path one graph per count of key partitions too (`_device_slots`).
        self.layer_steps = dense_cuda
        self._step: DeviceStep | None = None
        # The CPU reuses its per-layer gemm outputs (rows.Workspace); None: fresh tensors.
        cpu_gemms = self.device.type == "cpu" and not deterministic
        self.workspace = Workspace() if cpu_gemms else None
        # (rows, attention pairs, seconds) of the latest steps engines ran on this model,
        # newest last (`Engine`): a cache attached later starts from this compute rate. As
        # many as its compute fit uses.
        self.step_costs: deque[tuple[int, int, float]] = deque(maxlen=COMPUTE_SAMPLES)

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
        ropes = self._ropes(layout)
        ids = as_index([t for s in seqs for t in s.token_ids], self.device)
        embedded = self.weights.embed.index_select(0, ids)
        if self._embed_scale is not None:
            embedded = embedded * self._embed_scale
        x = layout.pack(embedded)  # (packed, hidden)
        page_size = page_layer(0).shape[1]
        slots = [page_slots(s.page_table, page_size, s.end) for s in seqs]
        every_row = [[(s.start, s.end)] for s in seqs]
        last = config.num_source_layers - 1
        q, kv = self._project(self.weights.layers[0], x, layout, ropes[0])
        step = self._device_step(seqs, page_layer)
        if step is not None:  # one graph replay a layer; every K/V is in the pool after it
            x, q = self._source_layers_on_device(
                x, q, kv, layout, ropes[0], seqs[0], page_layer, step
            )
            kv = None
        else:
            for i in range(last):
                attn = self._source_attention(i, q, kv, seqs, slots, page_layer, every_row)
                x, q, kv = self._finish_and_project(i, x, layout, attn, ropes[i + 1])
        # A hybrid model stores every row's source output (the boundary residual): its last
        # source layer computes every row; otherwise only the rows that want logits (a
        # windowed one: every row, whose KV its ring keeps).
        if self.skip_unread_rows and not config.num_late_layers and last not in self._windowed:
            held = HeldRows([logits_runs(s) for s in seqs])
        else:
            held = HeldRows(every_row)
        attn = self._source_attention(last, q, kv, seqs, slots, page_layer, held.runs)
        hidden = self._last_source_layer(last, x, layout, seqs, attn, held, every_row)
        if not config.num_late_layers:
            return self._head(self._pick(hidden, held.logit_rows(seqs)), seqs)
        first = config.num_source_layers
        boundary = [_flat(page_layer(first + k)) for k in range(config.num_boundary_layers)]
        self._store_boundary(hidden, seqs, slots, boundary)
        return self._head(self._late_layers(hidden, held, seqs, slots, boundary), seqs)

    def _ropes(self, layout: RowLayout) -> list:
        """cos, sin of the step's rows for each source layer (its layer type's table)."""
        rope = self.rope.lookup(layout.positions, layout.max_position)
        if self.local_rope is None:
            return [rope] * self.config.num_source_layers
        local = self.local_rope.lookup(layout.positions, layout.max_position)
        return [
            local if i in self._windowed else rope for i in range(self.config.num_source_layers)
        ]

    # ------------------------------------------------------------------ layers

    def _finish_and_project(self, i, x, layout: RowLayout, attn, rope):
        """Source layer i's rest after attention, then layer i + 1's norm, q/k/v projection
        and RoPE: on CUDA one graph replay, not two. -> (layer i's output; q and kv of
        layer i + 1, as `_project` gives them)."""
        weights, following = self.weights.layers[i], self.weights.layers[i + 1]

        def layer(x, attn, cos, sin):
            out = self._finish_rows(weights, x, layout, attn)
            return (out, *self._project_rows(following, out, layout, (cos, sin)))

        if self._graphs is None:
            return layer(x, attn, *rope)
        return self._graphs.run(("finish, project", id(weights)), layer, (x, attn), shared=rope)

    def _device_step(self, seqs, page_layer) -> DeviceStep | None:
        """The step, set where the kernels read it, when its source layers run as one graph
        replay each (`_source_layers_on_device`): one request of few rows (a hit's step, a
        decode step) on the dense CUDA path. None: layer by layer."""
        config = self.config
        if not self.layer_steps or len(seqs) != 1 or config.num_source_layers < 2:
            return None
        if config.windowed_layers:  # (not on the kernels' path: dense_kernels)
            return None
        seq, pool = seqs[0], page_layer(0)
        if not paged_attention.takes(seq.num_rows, self.config.num_heads, pool):
            return None
        if self._step is None:
            self._step = DeviceStep(self.config.num_source_layers, pool.dtype, self.device)
        layers = [page_layer(i) for i in range(self.config.num_source_layers)]
        self._step.set(seq.start, seq.num_rows, seq.page_table, layers)
        return self._step

    def _source_layers_on_device(self, x, q, kv, layout, rope, seq, page_layer, step):
        """Layer 0's K/V into the pool, then every source layer but the last as one call
        (on CUDA one graph replay, whatever the request's length): attention over the
        pages, the rest of the layer, the next layer's projection and its K/V into the pool,
        all reading the step from `step` on the device. -> (x, q) of the last source layer."""
        pool = page_layer(0)  # (for the layers' shape and dtype: `step` names each layer)
        slots = self._device_slots(seq)
        paged_attention.write_step_kv(kv, pool, 0, step)
        for i in range(self.config.num_source_layers - 1):
            if seq.wait_layer is not None:
                seq.wait_layer(i)
            weights, following = self.weights.layers[i], self.weights.layers[i + 1]

            def layer(x, q, cos, sin, i=i, weights=weights, following=following):
                attn = self._attend_on_device(q, pool, i, step, slots)
                out = self._finish_rows(weights, x, layout, attn)
                q, kv = self._project_rows(following, out, layout, (cos, sin))
                paged_attention.write_step_kv(kv, pool, i + 1, step)
                return out, q

            if self._graphs is None:
                x, q = layer(x, q, *rope)
            else:
                key = ("layer on device", id(weights), slots)
                x, q = self._graphs.run(key, layer, (x, q), shared=rope)
        return x, q

    def _device_slots(self, seq: SeqRows) -> int | None:
        """The key partitions a deterministic device step's attention covers for `seq`
        (a graph per count: `deterministic_attention.slots_for`); None on the default path."""
        if not self.deterministic:
            return None
        return deterministic_attention.slots_for(seq.end, self.config.head_dim)

    def _attend_on_device(self, q, pool, layer: int, step: DeviceStep, slots: int | None):
        """Attention of a device step's rows over pool layer `layer` (`step` names it)."""
        if slots is None:
            return paged_attention.paged_attention_on_device(q, pool, layer, step, scale=self.scale)
        return deterministic_attention.paged_attention_on_device(
            q, pool, layer, step, scale=self.scale, num_slots=slots
        )

    def _last_source_layer(self, i, x, layout, seqs, attn, held, every_row):
        """The last source layer's rest after attention (`attn`, of the rows `held` names:
        those a late layer or the head reads), for those rows. -> hidden (held rows)."""
        weights = self.weights.layers[i]
        if held.runs == every_row:
            return layout.unpack(self._finish_layer(weights, x, layout, attn))
        runs = [run for seq_runs in held.runs for run in seq_runs]
        return self._finish_some(weights, layout.unpack(x), held.step_rows(seqs), runs, attn)

    def _source_attention(self, i, q, kv, seqs, slots, page_layer, runs) -> torch.Tensor:
        """Write the step's K/V of source layer i (kv; None: in the pool already), then
        attend the queries of `runs` (per request, position ranges) over each request's
        pages; a windowed layer over the request's ring instead (`_windowed_attention`).
        -> (rows of runs, Hq, D)."""
        if i in self._windowed:
            return self._windowed_attention(i, q, kv, seqs, runs)
        kv_layer = page_layer(self.config.page_layer(i))
        flat_kv = _flat(kv_layer)
        outputs, row = [], 0
        for seq, seq_slots, seq_runs in zip(seqs, slots, runs, strict=True):
            seq_q = q[row : row + seq.num_rows]
            if kv is not None:  # (None: written already)
                write_kv(flat_kv, seq_slots[seq.start : seq.end], kv[row : row + seq.num_rows])
            row += seq.num_rows
            if seq.wait_layer is not None:
                seq.wait_layer(self.config.page_layer(i))
            for start, end in seq_runs:  # queries at [start, end) see the keys [0, end)
                run_q = seq_q[start - seq.start : end - seq.start]
                if self.deterministic:
                    out = deterministic_attention.paged_attention(
                        run_q, start, kv_layer, seq.page_table, scale=self.scale
                    )
                elif self.attend_pages and paged_attention.takes(len(run_q), q.shape[1], kv_layer):
                    out = paged_attention.paged_attention(
                        run_q, start, kv_layer, seq.page_table, scale=self.scale
                    )
                else:
                    out = source_attention(
                        run_q,
                        start,
                        flat_kv,
                        seq_slots[:end],
                        end,
                        scale=self.scale,
                        block_rows=self.block_rows,
                    )
                outputs.append(out)
        if not outputs:
            return q.new_empty((0, *q.shape[1:]))
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs)

    def _windowed_attention(self, i, q, kv, seqs, runs) -> torch.Tensor:
        """Windowed source layer i of an interleaved model: each request's rows write their
        K/V into its ring (`SeqRows.window`, which holds the last positions of every
        windowed layer: a hit's came from its sidecar) and attend over the keys of the last
        `window_tokens` positions there, as a late layer does (`window_attention`). Every
        row of the step is a query (the ring needs each row's K/V); the rows of `runs` are
        returned. -> (rows of runs, Hq, D)."""
        ring_layer = self.config.window_ring_layer(i)
        outputs, row = [], 0
        for seq, seq_runs in zip(seqs, runs, strict=True):
            n = seq.num_rows
            out = window_attention(
                q[row : row + n],
                kv[row : row + n],
                seq.start,
                seq.window,
                ring_layer,
                scale=self.scale,
                block_rows=self.block_rows,
            )
            row += n
            if seq_runs == [(seq.start, seq.end)]:
                outputs.append(out)
            else:
                outputs.extend(out[start - seq.start : end - seq.start] for start, end in seq_runs)
        if not outputs:
            return q.new_empty((0, *q.shape[1:]))
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs)

    def _finish_some(self, weights: LayerWeights, x, rows: list[int], runs, attn) -> torch.Tensor:
        """`_finish_layer` for some rows only: `rows` of x (real rows), at the positions
        `runs`, in order, whose attention output is attn. A row's result is the one it gets
        among all the rows (rows.py: no row's bits depend on the others).
        -> (len(rows), hidden)."""
        if not runs:
            return x.new_empty((0, x.shape[1]))
        layout = self._layout(runs)
        packed = layout.pack(self._pick(x, rows))
        return layout.unpack(self._finish_layer(weights, packed, layout, attn))

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

    def _late_layers(self, hidden: torch.Tensor, held: HeldRows, seqs, slots, boundary):
        """The late layers over each request's late positions: those of the step from
        `hidden` (every row of the step), those before it (a hit's replay) from the stored
        boundary residual; the last layer only for the rows that want logits.
        -> (logits rows, hidden): their output of the late layers (of the source layers for
        a row in no late run)."""
        runs = [(k, seq, start, end) for k, seq in enumerate(seqs) for start, end in seq.late_runs]
        out = self._pick(hidden, held.logit_rows(seqs), own=True)
        if not runs:
            return out
        inputs = []
        for k, seq, start, end in runs:
            if start < seq.start:  # a hit's replay: the input is stored in its pages
                replayed = min(end, seq.start)
                inputs.append(self._stored_boundary(seq, slots[k][start:replayed], boundary))
                start = replayed
            if start < end:
                rows = held.rows(k, start, end)
                inputs.append(hidden[rows.start : rows.stop])
        layout = self._layout([(start, end) for _, _, start, end in runs])
        rope = self.rope.lookup(layout.positions, layout.max_position)
        x = layout.pack(inputs[0] if len(inputs) == 1 else torch.cat(inputs))
        first, num_late = self.config.num_source_layers, self.config.num_late_layers
        for j in range(num_late):
            weights = self.weights.layers[first + j]
            finish = j < num_late - 1 or not self.skip_unread_rows
            if self._fresh_window(runs, j):
                _, seq, start, _ = runs[0]
                result, kv = self._fresh_window_layer(weights, x, layout, rope, finish)
                seq.window.write(j, start, kv)
                x, attn = (result, None) if finish else (x, result)
                continue
            q, kv = self._project(weights, x, layout, rope)
            outputs, offset = [], 0
            for _, seq, start, end in runs:
                n = end - start
                attend = self._deterministic_window if self.deterministic else window_attention
                outputs.append(
                    attend(
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
            attn = torch.cat(outputs)
            if finish:
                x = self._finish_layer(weights, x, layout, attn)
        wanted = _late_logits(seqs, runs)  # (late row, logits row, position) of those read
        if not wanted:
            return out
        rows = [row for row, _, _ in wanted]
        if self.skip_unread_rows:  # the last layer's rest for them alone
            runs_wanted = [(position, position + 1) for _, _, position in wanted]
            finished = self._finish_some(
                weights, layout.unpack(x), rows, runs_wanted, self._pick(attn, rows)
            )
        else:
            finished = self._pick(layout.unpack(x), rows)
        logits_rows = [n for _, n, _ in wanted]
        if _consecutive(logits_rows):
            out[logits_rows[0] : logits_rows[0] + len(logits_rows)] = finished
        else:
            out.index_copy_(0, self._rows(logits_rows), finished)
        return out

    def _fresh_window(self, runs, layer: int) -> bool:
        """Whether late layer `layer` runs whole (`_fresh_window_layer`) this step: dense
        batches, one request's late rows (a prefill's first: a hit's replay with its new
        rows, or a cold prompt's last rows), whose ring holds no key they see."""
        if self.block_rows is not None or self.deterministic or len(runs) != 1:
            return False
        _, seq, start, _ = runs[0]
        return not seq.window.holds_from(layer, start - self.config.window_tokens + 1)

    def _fresh_window_layer(self, weights: LayerWeights, x, layout: RowLayout, rope, finish):
        """A late layer whose window attention sees only the step's own rows (`_fresh_window`)
        as one call, on CUDA one graph replay: projection, attention, and (`finish`) the
        rest of the layer. -> (the layer's output, or its attention output when not
        `finish`; the rows' K/V, which the caller writes into the ring)."""
        width = self.config.window_tokens

        def layer(x, cos, sin):
            q, kv = self._project_rows(weights, x, layout, (cos, sin))
            attn = fresh_window_attention(q, kv, width, scale=self.scale)
            return (self._finish_rows(weights, x, layout, attn) if finish else attn), kv

        if self._graphs is None:
            return layer(x, *rope)
        key = ("fresh window", id(weights), finish)
        return self._graphs.run(key, layer, (x,), shared=rope)

    def _deterministic_window(self, q, kv, start, window, layer, *, scale, block_rows):
        """`window_attention` through the deterministic kernel."""
        return deterministic_attention.window_attention(q, kv, start, window, layer, scale=scale)

    def _rows(self, rows: list[int]) -> torch.Tensor:
        return as_index(rows, self.device)

    def _pick(self, x: torch.Tensor, rows: list[int], *, own: bool = False) -> torch.Tensor:
        """Rows `rows` of x: consecutive ones as a slice (a view; a copy with `own`, for a
        caller that writes into the result), no index sent to the device; others through an
        index (a new tensor)."""
        if _consecutive(rows):
            part = x[rows[0] : rows[0] + len(rows)]
            return part.clone() if own else part
        return x.index_select(0, self._rows(rows))

    def _head(self, last: torch.Tensor, seqs) -> torch.Tensor:
        """Final norm and LM head of `last` (the hidden state of each request's last row,
        for those that want logits)."""
        runs = [(seq.end - 1, seq.end) for seq in seqs if seq.want_logits]
        if not runs:
            return torch.empty(0, self.config.vocab_size, device=self.device)
        layout = RowLayout.build(runs, self.block_rows, self.device, align_rows=self.align_rows)
        normed = self._norm(layout, layout.pack(last), self.weights.final_norm)
        logits = layout.unpack(self._linear(layout, normed, self.weights.lm_head))
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits.float()

    # ------------------------------------------------------------------ row-wise parts

    def _layout(self, runs) -> RowLayout:
        """The rows of a layer stack (the MLP's activation is the elementwise op)."""
        return RowLayout.build(
            runs,
            self.block_rows,
            self.device,
            pointwise_width=self.config.intermediate_size,
            align_rows=self.align_rows,
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

    def _norm(self, layout: RowLayout, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        eps = self.config.rms_norm_eps
        if self.fused_kernels:
            return fused.rms_norm(x, weight, eps)
        return layout.rowwise(lambda block: rms_norm(block, weight, eps), x)

    def _project_rows(self, weights: LayerWeights, x, layout: RowLayout, rope):
        config = self.config
        sizes = [config.q_size, config.kv_size, config.kv_size]
        normed = self._norm(layout, x, weights.input_norm)
        qkv = self._linear(layout, normed, weights.qkv, weights.qkv_bias, name="qkv")
        if self.fused_kernels:
            return fused.rope_qkv(qkv, *rope, config.num_heads, config.num_kv_heads)

        def rotate(block, cos, sin):
            q, k, v = block.split(sizes, dim=-1)
            q = q.reshape(-1, config.num_heads, config.head_dim)
            k = k.reshape(-1, config.num_kv_heads, config.head_dim)
            v = v.reshape(-1, config.num_kv_heads, config.head_dim)
            if weights.q_norm is not None:  # Gemma 3: each head normed before RoPE
                q = rms_norm(q, weights.q_norm, config.rms_norm_eps)
                k = rms_norm(k, weights.k_norm, config.rms_norm_eps)
            rotated_q = q.new_empty(q.shape)
            kv = k.new_empty((k.shape[0], 2, *k.shape[1:]))  # (rows, 2, H, D)
            apply_rope(q, cos, sin, out=rotated_q)
            apply_rope(k, cos, sin, out=kv[:, 0])
            kv[:, 1] = v
            return rotated_q, kv

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

    def _linear(self, layout: RowLayout, x, weight, bias=None, *, name: str | None = None):
        """x (packed rows, in) by weight (out, in): the deterministic path's batch-invariant
        matmul, or `layout.linear` (into the workspace's buffer `name`, if any)."""
        if self.deterministic:
            return deterministic.matmul(x, weight, bias)
        out = self._buffer(name, x, weight) if name is not None else None
        return layout.linear(x, weight, bias, out=out)

    def _buffer(self, name: str, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
        """The workspace's buffer for the gemm of x by weight (None without a workspace)."""
        if self.workspace is None:
            return None
        return self.workspace.take(name, x.shape[0], weight.shape[0], x)

    def _finish_rows(self, weights: LayerWeights, x, layout: RowLayout, attn) -> torch.Tensor:
        attn = layout.pack(attn.flatten(1))
        out = self._linear(layout, attn, weights.o, weights.o_bias, name="o")
        if weights.attn_out_norm is not None:  # Gemma 3
            out = self._norm(layout, out, weights.attn_out_norm)
        x = x + out
        normed = self._norm(layout, x, weights.post_norm)
        gate_up = self._linear(layout, normed, weights.gate_up, name="gate_up")

        def swiglu(block):  # in place: the gate half of `block` becomes the activation
            gate, up = block.chunk(2, dim=-1)
            return F.silu(gate, inplace=True).mul_(up)

        def geglu(block):  # Gemma's: GELU (tanh approximation) of the gate, times up
            gate, up = block.chunk(2, dim=-1)
            return gate.copy_(F.gelu(gate, approximate="tanh")).mul_(up)

        gated = geglu if self.config.gemma else swiglu
        if self.deterministic:  # (not Gemma: `check_deterministic`)
            activated = deterministic.silu_mul(gate_up)
        else:
            activated = layout.pointwise(gated, gate_up, width=self.config.intermediate_size)
        out = self._linear(layout, activated, weights.down, name="down")
        if weights.mlp_out_norm is not None:  # Gemma 3
            out = self._norm(layout, out, weights.mlp_out_norm)
        return x + out


def logits_runs(seq: SeqRows) -> list[tuple[int, int]]:
    """The positions of `seq` whose output of a full-attention model's last layer is read:
    its last row when it wants logits. The other rows of the last layer only write their
    K/V."""
    return [(seq.end - 1, seq.end)] if seq.want_logits else []


class HeldRows:
    """The rows a hidden tensor holds: for each request of the step, runs of its positions
    (disjoint, ascending), one row per position, request after request."""

    def __init__(self, runs: list[list[tuple[int, int]]]) -> None:
        self.runs = runs
        self._firsts: list[list[tuple[int, int, int]]] = []  # (start, end, row of start)
        row = 0
        for seq_runs in runs:
            self._firsts.append([])
            for start, end in seq_runs:
                self._firsts[-1].append((start, end, row))
                row += end - start

    def rows(self, k: int, start: int, end: int) -> range:
        """The rows of request k's positions [start, end), which lie in one run."""
        for run_start, run_end, row in self._firsts[k]:
            if run_start <= start and end <= run_end:
                return range(row + start - run_start, row + end - run_start)
        raise ValueError(f"positions [{start}, {end}) of request {k} are not held")

    def logit_rows(self, seqs: Sequence[SeqRows]) -> list[int]:
        """The row of the last position of each request that wants logits."""
        return [self.rows(k, s.end - 1, s.end)[0] for k, s in enumerate(seqs) if s.want_logits]

    def step_rows(self, seqs: Sequence[SeqRows]) -> list[int]:
        """Where the held positions are among the step's rows (every row of each request)."""
        rows, base = [], 0
        for seq, seq_runs in zip(seqs, self.runs, strict=True):
            rows.extend(base + p - seq.start for start, end in seq_runs for p in range(start, end))
            base += seq.num_rows
        return rows


def _consecutive(rows: list[int]) -> bool:
    """Whether `rows` are n, n + 1, ... in order (an empty list is not)."""
    return bool(rows) and rows == list(range(rows[0], rows[0] + len(rows)))


def _late_logits(seqs: Sequence[SeqRows], runs) -> list[tuple[int, int, int]]:
    """For late `runs` (k, seq, start, end) of `seqs`, the late rows that want logits:
    (row among the late rows, row among the logits rows, position)."""
    logits_row = {k: n for n, k in enumerate(k for k, s in enumerate(seqs) if s.want_logits)}
    wanted, offset = [], 0
    for k, seq, start, end in runs:
        last = seq.end - 1
        if seq.want_logits and start <= last < end:
            wanted.append((offset + last - start, logits_row[k], last))
        offset += end - start
    return wanted
