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
`page_table` of each request and the layer tensors it is handed. `Model` runs the source
layers and the head here; the boundary and late layers are its `LateLayers` mixin
(`late_layers.py`), the row-wise parts of a layer its `RowwiseParts` (`rowwise.py`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

import torch

from engine_integration.engine.model import deterministic_attention, paged_attention
from engine_integration.engine.model.attention import page_slots, source_attention, write_kv
from engine_integration.engine.model.config import ModelConfig
from engine_integration.engine.model.graphs import RowwiseGraphs
from engine_integration.engine.model.kernel_support import check_deterministic, dense_kernels
from engine_integration.engine.model.late_layers import LateLayers
from engine_integration.engine.model.norm_rope import RotaryTable
from engine_integration.engine.model.paged_attention import DeviceStep
from engine_integration.engine.model.rows import (
    ALIGN_ROWS,
    RowLayout,
    Workspace,
    as_index,
    gemm_row_group,
)
from engine_integration.engine.model.rowwise import RowwiseParts
from engine_integration.engine.model.step_rows import HeldRows, SeqRows, logits_runs
from engine_integration.engine.model.tile_attention import check_tile_invariance
from engine_integration.engine.model.weights import ModelWeights
from engine_integration.engine.model.window_attention import window_attention
from hicache.fetch_plan import COMPUTE_SAMPLES


def _flat(layer: torch.Tensor) -> torch.Tensor:
    """A pool layer (pages, page_size, 2, H, D) as one row per slot (pages * page_size, 2, H, D)."""
    return layer.view(-1, *layer.shape[2:])


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


class Model(LateLayers, RowwiseParts):
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
        # attention kernel (tile_attention.py): checked at the model's shapes, once per process.
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
