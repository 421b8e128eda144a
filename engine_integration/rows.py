"""How a step's token rows are laid out for the dense (row-wise) operations.

Batch invariance: on the CPU, a matmul's result for one row can depend on how many rows
are multiplied with it (BLAS picks a different kernel for 4 rows than for 400), and a
vectorised elementwise op can treat an element differently depending on where the tensor's
vector tail falls. Either would make a cached page differ, in its last bits, from the same
page computed in another batch, and a hit would then not equal a cold prefill.

So in invariant mode every row-wise op runs on fixed-shape blocks of `block_rows` rows, and
a token at position p always sits in row `p % block_rows` of its block. Elementwise ops run
block by block; a projection runs as one batched matmul over all blocks (`linear`): each
block is then its own fixed-shape gemm (the same bits whatever the number of blocks or
threads), and the threads share out the blocks, where a loop of 16-row gemms left the
second core idle. A token's numbers
then depend only on its own inputs, never on its neighbours, the chunking or the batch.
A request's run of consecutive positions fills its own blocks (block k holds positions
[k*B, k*B + B)); single decode tokens of different requests share blocks when their slots
differ. Padding rows hold zeros. Without invariance (CUDA), the rows are simply packed
densely as one block.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class RowLayout:
    """The packed tensor's rows: `index[i]` is where real row i lives."""

    index: torch.Tensor  # (num_real,) long, packed row of each real row
    positions: torch.Tensor  # (num_packed,) long, the position of every packed row (RoPE)
    num_packed: int
    block_rows: int | None  # None: one block (no padding)
    max_position: int  # the largest of `positions`, known without reading the device

    @classmethod
    def build(cls, runs: Sequence[tuple[int, int]], block_rows: int | None, device) -> RowLayout:
        """Lay out `runs` (position ranges [start, end), one per request, in row order)."""
        if block_rows is None:
            positions = [p for start, end in runs for p in range(start, end)]
            index = list(range(len(positions)))
            return cls(
                as_index(index, device),
                as_index(positions, device),
                len(positions),
                None,
                max(positions, default=0),
            )
        rows = block_rows
        index: list[int] = []
        positions: list[int] = []
        singles: list[tuple[int, int]] = []  # (real row, position) of one-token runs
        for start, end in runs:
            if end - start == 1:
                singles.append((len(index), start))
                index.append(-1)
                continue
            first = start // rows
            base = len(positions) - first * rows
            index.extend(range(base + start, base + end))
            positions.extend(range(first * rows, -(-end // rows) * rows))
        _pack_singles(singles, rows, index, positions)
        return cls(
            as_index(index, device),
            as_index(positions, device),
            len(positions),
            rows,
            max(positions, default=0),
        )

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """(num_real, ...) -> (num_packed, ...), zeros in padding rows."""
        if self.block_rows is None:
            return x
        out = x.new_zeros((self.num_packed, *x.shape[1:]))
        out.index_copy_(0, self.index, x)
        return out

    def unpack(self, packed: torch.Tensor) -> torch.Tensor:
        """(num_packed, ...) -> (num_real, ...)."""
        if self.block_rows is None:
            return packed
        return packed.index_select(0, self.index)

    def linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """`F.linear` of packed rows x (num_packed, in) by weight (out, in): one gemm per
        block, in one batched call (see the module docstring)."""
        if self.block_rows is None:
            return F.linear(x, weight, bias)
        blocks = x.view(-1, self.block_rows, x.shape[-1])  # (num_blocks, B, in)
        weight_t = weight.t().expand(blocks.shape[0], *weight.t().shape)  # (num_blocks, in, out)
        if bias is None:
            out = torch.bmm(blocks, weight_t)
        else:
            out = torch.baddbmm(bias.expand(blocks.shape[0], self.block_rows, -1), blocks, weight_t)
        return out.view(-1, weight.shape[0])

    def map_blocks(self, fn: Callable, *packed: torch.Tensor):
        """`fn` over each block of the packed tensors (one call without invariance); `fn`
        returns a tensor or a tuple of tensors, concatenated over the blocks."""
        if self.block_rows is None:
            return fn(*packed)
        blocks = zip(*(t.split(self.block_rows) for t in packed), strict=True)
        parts = [fn(*block) for block in blocks]
        if isinstance(parts[0], tuple):
            return tuple(torch.cat(column) for column in zip(*parts, strict=True))
        return torch.cat(parts)


def _pack_singles(
    singles: list[tuple[int, int]], rows: int, index: list[int], positions: list[int]
) -> None:
    """First-fit single tokens into shared blocks, each at slot position % rows."""
    blocks: list[list[bool]] = []
    base = len(positions)
    for real_row, position in singles:
        slot = position % rows
        number = next((n for n, used in enumerate(blocks) if not used[slot]), len(blocks))
        if number == len(blocks):
            blocks.append([False] * rows)
            positions.extend(range(rows))  # padding rows: any position will do
        blocks[number][slot] = True
        index[real_row] = base + number * rows + slot
        positions[base + number * rows + slot] = position


def as_index(values: list[int], device) -> torch.Tensor:
    """A long tensor on `device`, copied from pinned memory without waiting for the
    device (a plain torch.tensor(..., device='cuda') blocks until queued work is done)."""
    tensor = torch.tensor(values, dtype=torch.long)
    if torch.device(device).type != "cuda":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)
