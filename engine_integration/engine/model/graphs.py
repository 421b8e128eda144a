"""CUDA graphs of the row-wise halves of a layer, so a short step costs its math.

A hit's step on a GPU is a few hundred rows (the replayed window plus the new tokens), and
eager PyTorch launches ~45 kernels a layer for it: on an H200 the CPU then takes ~2 ms a
layer to issue what the GPU runs in ~0.3 ms, and the step waits on the CPU. Most of those
launches are the row-wise parts: norm, q/k/v projection and RoPE before attention; output
projection, residual, norm and MLP after it. Each is captured once per layer and per row
bucket (a power of two from 16 to `MAX_ROWS`) and replayed: one launch instead of ~35.
Attention, which reads the paged KV of each request, stays eager in a step of several
requests; a step of one request and few rows (a hit's, a decode step) runs each source layer
whole as one graph, attention over the pages included, the step's position, rows and pages
read from the device (`Model._source_layers_on_device`, `paged_attention.DeviceStep`); and a
late layer whose window sees only the step's own rows (a prefill's first late rows, one
request) has no paged KV to read, and is captured whole (`Model._fresh_window_layer`).

Rows are independent in these parts, so a step of n rows runs in the bucket above n: rows
past n compute on whatever the static input held and are never read. Inputs every layer of a
step shares (RoPE's cos and sin) sit in static tensors that all graphs of a bucket read, and
are copied in once per step rather than once per layer. The static tensors of every graph
come from one shared memory pool; graphs run one after another on one stream, and each
one's inputs and outputs stay alive, so no graph's intermediates can land on another's live
tensors. A graph's outputs are overwritten by its next replay: callers use
them before the same layer runs again (the next step).

Only for dense batches on CUDA (`Model(..., block_rows=None)` on a CUDA device); on the
CPU, and for steps larger than `MAX_ROWS`, the eager code runs.
"""

from __future__ import annotations

import torch

MAX_ROWS = 4096
_MIN_ROWS = 16


def bucket(rows: int) -> int | None:
    """The row count of the graph a step of `rows` rows replays (None: run eagerly)."""
    if rows > MAX_ROWS:
        return None
    return max(_MIN_ROWS, 1 << (rows - 1).bit_length())


class _Graph:
    """One captured call: static inputs (its own, then the bucket's shared ones), the graph,
    its static outputs."""

    def __init__(self, fn, inputs: tuple[torch.Tensor, ...], shared, pool) -> None:
        self.inputs = tuple(t.clone() for t in inputs)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up: cuBLAS picks its kernels outside capture
            fn(*self.inputs, *shared)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.outputs = fn(*self.inputs, *shared)

    def __call__(self, inputs: tuple[torch.Tensor, ...], rows: int):
        for static, value in zip(self.inputs, inputs, strict=True):
            static[:rows].copy_(value)
        self.graph.replay()
        if isinstance(self.outputs, tuple):
            return tuple(t[:rows] for t in self.outputs)
        return self.outputs[:rows]


class RowwiseGraphs:
    """Graphs of row-wise calls, captured on first use of a (key, bucket)."""

    def __init__(self) -> None:
        self._graphs: dict[tuple, _Graph] = {}
        self._pool = torch.cuda.graph_pool_handle()
        # (bucket, shapes) -> the static tensors of shared inputs, and the values last
        # copied into them (held, so that `is` tells a new value from the same one)
        self._shared: dict[tuple, tuple[tuple[torch.Tensor, ...], tuple]] = {}

    def run(self, key, fn, inputs: tuple[torch.Tensor, ...], shared: tuple = ()):
        """`fn(*inputs, *shared)` (each tensor (rows, ...), rows independent) through the
        graph of `key` (the part and layer `fn` computes) for its bucket, or eagerly when
        the step is too large or a capture is under way. `shared`: inputs that many calls of
        a step pass as the very same tensors (copied in only when they change)."""
        rows = inputs[0].shape[0]
        size = bucket(rows)
        if size is None or torch.cuda.is_current_stream_capturing():
            return fn(*inputs, *shared)
        statics = self._shared_statics(size, rows, shared)
        graph = self._graphs.get((key, size))
        if graph is None:
            padded = tuple(_padded(t, size) for t in inputs)
            graph = self._graphs[(key, size)] = _Graph(fn, padded, statics, self._pool)
        return graph(inputs, rows)

    def _shared_statics(self, size: int, rows: int, shared: tuple) -> tuple[torch.Tensor, ...]:
        if not shared:
            return ()
        key = (size, tuple((t.shape[1:], t.dtype) for t in shared))
        entry = self._shared.get(key)
        if entry is None:
            statics = tuple(_padded(t, size) for t in shared)
        else:
            statics, last = entry
            if any(new is not old for new, old in zip(shared, last, strict=True)):
                for static, value in zip(statics, shared, strict=True):
                    static[:rows].copy_(value)
        self._shared[key] = (statics, shared)
        return statics

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)


def _padded(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    out = tensor.new_zeros((rows, *tensor.shape[1:]))
    out[: tensor.shape[0]] = tensor
    return out
