"""The row-wise parts of a layer (norm, q/k/v projection and RoPE; output projection and
MLP) and the row picking around them, as a mixin of `forward.Model`: each part runs eagerly
or as a CUDA graph replay (`graphs.py`), through the fused, deterministic or torch ops that
`Model.__init__` chose. No row's result depends on the others (`rows.py`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine_integration.engine.model import deterministic, fused
from engine_integration.engine.model.config import ModelConfig
from engine_integration.engine.model.graphs import RowwiseGraphs
from engine_integration.engine.model.norm_rope import apply_rope, rms_norm
from engine_integration.engine.model.rows import RowLayout, Workspace, as_index
from engine_integration.engine.model.step_rows import consecutive
from engine_integration.engine.model.weights import LayerWeights


class RowwiseParts:
    """The row-wise halves of a layer. The host (`forward.Model`) sets what they read:
    config, device, block_rows, align_rows, deterministic, fused_kernels, workspace, _graphs."""

    config: ModelConfig
    device: torch.device
    block_rows: int | None
    align_rows: int
    deterministic: bool
    fused_kernels: bool
    workspace: Workspace | None
    _graphs: RowwiseGraphs | None

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

    # ------------------------------------------------------------------ some rows

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

    def _rows(self, rows: list[int]) -> torch.Tensor:
        return as_index(rows, self.device)

    def _pick(self, x: torch.Tensor, rows: list[int], *, own: bool = False) -> torch.Tensor:
        """Rows `rows` of x: consecutive ones as a slice (a view; a copy with `own`, for a
        caller that writes into the result), no index sent to the device; others through an
        index (a new tensor)."""
        if consecutive(rows):
            part = x[rows[0] : rows[0] + len(rows)]
            return part.clone() if own else part
        return x.index_select(0, self._rows(rows))
