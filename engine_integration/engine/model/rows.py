"""How a step's token rows are laid out for the dense (row-wise) operations.

Batch invariance: on the CPU, a token's numbers must depend only on its own inputs, never on
its neighbours, the chunking or the batch, or a cached page would differ in its last bits
from the same page computed in another batch, and a hit would not equal a cold prefill.
Two things can break that:

- a matmul's result for one row can depend on how many rows are multiplied with it. MKL's
  sgemm (torch's CPU BLAS) gives a row the same bits in any call whose row count is a
  multiple of some small group G, at any offset, whether the rows are contiguous or a
  strided view (the MLP's activation is computed in place in the gate half of the gate/up
  output); calls of fewer rows give some rows other bits. G depends on the CPU and the
  shape (MKL picks its kernels by both): 4 on some AVX-512 machines, 16 on others. So G is
  measured, not assumed: `gemm_row_group` finds the smallest G of `ROW_GROUPS` that holds at
  every projection shape of the model, once per process, and the model lays its rows out in
  groups of G. `tests/engine_integration/engine/test_rows.py` checks the premise on the
  machine it runs on;
- a vectorised elementwise op computes the elements of its scalar tail (past the last full
  vector of a thread's share) with another formula, e.g. `silu` through `std::exp`, so an
  element's bits depend on where the tensor's tails fall.

So in invariant mode a request's run of consecutive positions fills whole groups of G rows
aligned to absolute positions (group k holds positions [Gk, Gk + G): a prompt of a multiple
of G tokens needs no padding at all), padding rows hold zeros, and the packed tensor always
has a multiple of G rows. A projection is one gemm over all packed rows (`linear`).
Row-wise work made of exactly rounded operations (norms, RoPE, residuals) runs once over the
whole tensor (`rowwise`); an elementwise op with a transcendental function runs once where
no thread's share of the tensor ends in a scalar tail (`pointwise`); where it would, the
runs fill whole blocks of `block_rows` rows instead (block k holds positions [k*B, k*B + B))
and the op runs block by block, so that a row always falls at the same place of its call.
Single tokens (decode steps) need no block: they go one after another in runs of G rows.
Without invariance (CUDA), the rows are simply packed densely as one block.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)


# The row groups tried, smallest first (each divides the next, and the block sizes).
ROW_GROUPS = (4, 8, 16)
# A run of positions fills whole groups of G rows, the gemm's smallest row count that gives a
# row its bits in any larger call (`gemm_row_group`); this G where none was measured.
ALIGN_ROWS = 4


@dataclass
class RowLayout:
    """The packed tensor's rows: `index[i]` is where real row i lives."""

    index: torch.Tensor | None  # (num_real,) long, packed row of each real row (None: dense)
    positions: torch.Tensor  # (num_packed,) long, the position of every packed row (RoPE)
    num_packed: int
    block_rows: int | None  # None: one block (no padding)
    max_position: int  # the largest of `positions`, known without reading the device
    padded: bool = True  # False: the packed rows are the real rows, in order
    aligned_rows: int | None = None  # runs fill whole groups of this many positions

    @classmethod
    def build(
        cls,
        runs: Sequence[tuple[int, int]],
        block_rows: int | None,
        device,
        *,
        pointwise_width: int | None = None,
        align_rows: int = ALIGN_ROWS,
    ) -> RowLayout:
        """Lay out `runs` (position ranges [start, end), one per request, in row order).
        A run of several positions fills the groups of `align_rows` positions it touches
        where an elementwise op over `pointwise_width` columns (`pointwise`) then runs in one
        call with no scalar tail (or none is run), else the whole blocks it touches."""
        if block_rows is None:  # the real rows themselves: no index to pack by
            return cls(
                None,
                run_positions(runs, device),
                sum(end - start for start, end in runs),
                None,
                max((end - 1 for start, end in runs if end > start), default=0),
                padded=False,
            )
        index, positions = _aligned_rows(runs, align_rows)
        aligned = align_rows
        width = pointwise_width
        if width is not None and not tail_free(len(positions) * width, width):
            index, positions = _aligned_rows(runs, block_rows, align_rows)
            aligned = block_rows
        return cls(
            as_index(index, device),
            as_index(positions, device),
            len(positions),
            block_rows,
            max(positions, default=0),
            padded=index != list(range(len(positions))),
            aligned_rows=aligned,
        )

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """(num_real, ...) -> (num_packed, ...), zeros in padding rows."""
        if not self.padded:
            return x
        out = x.new_zeros((self.num_packed, *x.shape[1:]))
        out.index_copy_(0, self.index, x)
        return out

    def unpack(self, packed: torch.Tensor) -> torch.Tensor:
        """(num_packed, ...) -> (num_real, ...)."""
        if not self.padded:
            return packed
        return packed.index_select(0, self.index)

    def linear(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        *,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`F.linear` of packed rows x (num_packed, in) by weight (out, in): one gemm over all
        the rows, whose count is a multiple of 4 (see the module docstring). `out`, a
        (num_packed, out) buffer, receives it: the gemm `F.linear` itself calls, so the same
        bits."""
        if out is None:
            return F.linear(x, weight, bias)
        if bias is None:
            return torch.mm(x, weight.t(), out=out)
        return torch.addmm(bias, x, weight.t(), out=out)

    def rowwise(self, fn: Callable, *packed: torch.Tensor):
        """`fn` over the packed tensors at once: for row-wise work whose operations round
        exactly (add, multiply, divide, square root) or reduce a row of fixed length, so that
        no row's bits depend on the others."""
        return fn(*packed)

    def pointwise(self, fn: Callable, x: torch.Tensor, *, width: int) -> torch.Tensor:
        """`fn` over packed x, where `fn` applies a transcendental elementwise op (silu) to a
        (num_packed, width) view: in one call where no element falls in a vectorised loop's
        scalar tail, else block by block."""
        if self.block_rows is None or tail_free(self.num_packed * width, width):
            return fn(x)
        if self.aligned_rows != self.block_rows:
            raise ValueError(
                f"a pointwise op over {width} columns needs a layout built with "
                f"pointwise_width={width} (its runs in whole blocks)"
            )
        return self.map_blocks(fn, x)

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


class Workspace:
    """Buffers that a CPU forward pass reuses for its largest short-lived tensors (a layer's
    four gemm outputs: q/k/v, output, gate/up and down projections, each dead before the
    next layer makes its own), one per name, grown to the most rows a step has had.

    Why: a fresh multi-megabyte tensor a layer is memory the allocator maps, the kernel
    zero-fills page by page on first touch and the heap later gives back; SmolLM2 prefilling
    700 tokens on one thread took ~10,800 page faults a pass, and 13 % less time without
    any (glibc told never to give memory back); these buffers take the largest of those
    allocations out of it. Not for CUDA (its caching allocator reuses memory already), and
    not re-entrant: one forward pass at a time uses a model, as its CUDA graphs' static
    buffers require too.
    """

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def take(self, name: str, rows: int, width: int, like: torch.Tensor) -> torch.Tensor:
        """A (rows, width) contiguous buffer of like's dtype and device, reused across calls
        of the same name (its previous contents are overwritten by the caller)."""
        buffer = self._buffers.get(name)
        if (
            buffer is None
            or buffer.shape[0] < rows
            or buffer.shape[1] != width
            or buffer.dtype != like.dtype
        ):
            grown = rows if buffer is None else max(rows, buffer.shape[0])
            buffer = self._buffers[name] = like.new_empty((grown, width))
        return buffer[:rows]


def _aligned_rows(
    runs: Sequence[tuple[int, int]], rows: int, single_rows: int | None = None
) -> tuple[list[int], list[int]]:
    """(index, positions) of `runs` whose runs of several positions fill the groups of
    `rows` positions they touch (group k: positions [k * rows, k * rows + rows)); single
    tokens after them, in runs of `single_rows` (default `rows`; `_pack_singles`)."""
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
    _pack_singles(singles, index, positions, single_rows or rows)
    return index, positions


def _pack_singles(
    singles: list[tuple[int, int]], index: list[int], positions: list[int], group: int
) -> None:
    """Single tokens one after another, padded to a multiple of `group` rows: the smallest
    row count whose gemm gives each row the bits it gets in any larger call (the module
    docstring), so that a decode step costs G rows, not a whole block."""
    base = len(positions)
    for number, (real_row, position) in enumerate(singles):
        index[real_row] = base + number
        positions.append(position)
    positions.extend([0] * (-len(singles) % group))  # padding rows: any position


def run_positions(runs: Sequence[tuple[int, int]], device) -> torch.Tensor:
    """The positions of `runs` (ranges [start, end)) one after another, a long tensor on
    `device`: one run, the most common step (a prefill chunk, one request's hit), is an
    arange made on the device, with no host copy."""
    if len(runs) == 1:
        start, end = runs[0]
        return torch.arange(start, end, device=device)
    return as_index([p for start, end in runs for p in range(start, end)], device)


def as_index(values: list[int], device) -> torch.Tensor:
    """A long tensor on `device`, copied from pinned memory without waiting for the
    device (a plain torch.tensor(..., device='cuda') blocks until queued work is done)."""
    tensor = torch.tensor(values, dtype=torch.long)
    if torch.device(device).type != "cuda":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


# torch's elementwise loops split a tensor of n elements into ceil(n / t) per thread (t =
# min(threads, ceil(n / GRAIN))) and each share runs in vectors of 2 * Vec elements then a
# scalar tail: with every share a multiple of 64 elements (2 * 16 floats with AVX-512) and
# each row a multiple of 64 (a strided view restarts the loop per row), nothing is a tail.
_GRAIN = 32768
_VECTOR_STEP = 64


def tail_free(num_elements: int, row_elements: int | None = None) -> bool:
    """Whether an elementwise op over `num_elements` (rows of `row_elements`) runs every
    element in full vectors at the current thread count."""
    threads = min(torch.get_num_threads(), max(1, -(-num_elements // _GRAIN)))
    share = -(-num_elements // threads)
    rows_ok = row_elements is None or row_elements % _VECTOR_STEP == 0
    return rows_ok and share % _VECTOR_STEP == 0 and num_elements % _VECTOR_STEP == 0


@functools.cache
def _gemm_rows_invariant(
    num_in: int, num_out: int, dtype: torch.dtype, threads: int, group: int = ALIGN_ROWS
) -> bool:
    """Whether calls of several multiples of `group` rows, at several offsets, give each row
    the bits one large call gives it, contiguous and strided."""
    calls = ((1, 0), (1, 8), (3, 36), (5, 140), (16, 96), (25, 4))  # (multiple, offset)
    num_rows = max(multiple * group + offset for multiple, offset in calls)
    num_rows += -num_rows % group  # the large call is a multiple of the group too
    generator = torch.Generator().manual_seed(num_in * 31 + num_out)
    weight = torch.randn(num_out, num_in, generator=generator).to(dtype)
    x = torch.randn(num_rows, num_in, generator=generator).to(dtype)
    full = F.linear(x, weight)
    strided = torch.cat([x, x], dim=1)[:, :num_in]  # rows 2 * num_in apart (the MLP's gate)
    for multiple, offset in calls:
        rows = slice(offset, offset + multiple * group)
        if not torch.equal(F.linear(x[rows], weight), full[rows]):
            return False
        if not torch.equal(F.linear(strided[rows], weight), full[rows]):
            return False
    return True


def gemm_row_group(
    shapes: Sequence[tuple[int, int]], dtype: torch.dtype, block_rows: int
) -> int | None:
    """The smallest group G of `ROW_GROUPS` (dividing `block_rows`) for which this CPU's gemm
    gives a row the same bits in any call of a multiple of G rows, at every (in, out)
    projection shape given, at the current thread count (the premise above); once per
    shape and group. None where no group does: then a cached page can differ from a cold
    prefill's in its last bits, and that is said once, loudly, rather than left for a hit
    to show."""
    threads = torch.get_num_threads()
    for group in ROW_GROUPS:
        if block_rows % group == 0 and all(
            _gemm_rows_invariant(*shape, dtype, threads, group) for shape in shapes
        ):
            return group
    logger.warning(
        "this CPU's matmul gives a row different bits in calls of different row counts "
        "(projections %s, %d threads, row groups up to %d): cache hits will equal cold "
        "prefills only to rounding, not bit for bit",
        list(shapes),
        threads,
        max(g for g in ROW_GROUPS if block_rows % g == 0),
    )
    return None
