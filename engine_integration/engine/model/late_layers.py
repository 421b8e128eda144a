"""The late (sliding-window) layers of a hybrid model, as a mixin of `forward.Model`: the
boundary residual written into and read back from the pages, then the late layers over each
request's late positions and its window ring, the last one only for the rows read. The
row-wise parts come from `RowwiseParts`; the source layers and the head from `Model`."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine_integration.engine.model import deterministic_attention
from engine_integration.engine.model.attention import write_kv
from engine_integration.engine.model.norm_rope import RotaryTable
from engine_integration.engine.model.rows import RowLayout
from engine_integration.engine.model.rowwise import RowwiseParts
from engine_integration.engine.model.step_rows import (
    HeldRows,
    SeqRows,
    consecutive,
    late_logits,
)
from engine_integration.engine.model.weights import LayerWeights, ModelWeights
from engine_integration.engine.model.window_attention import (
    fresh_window_attention,
    window_attention,
)


class LateLayers(RowwiseParts):
    """The late layers. The host (`forward.Model`) sets, besides what `RowwiseParts` reads:
    weights, rope, scale, skip_unread_rows."""

    weights: ModelWeights
    rope: RotaryTable
    scale: float
    skip_unread_rows: bool

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
        wanted = late_logits(seqs, runs)  # (late row, logits row, position) of those read
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
        if consecutive(logits_rows):
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
