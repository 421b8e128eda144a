"""Triton kernels that move KV pages between the device pool (L1) and the host pool (L2).

Both pools hold the same (page, layer) chunks, `page_size x token_shape` values each, in
different orders:

    device_kv  (num_layers, num_device_pages, page_size, *token_shape)   layer-first
    host_kv    (num_host_pages, num_layers, page_size, *token_shape)     page-first, pinned

A chunk is contiguous in both, so a copy is a gather of chunks: the kernels view both pools as
flat arrays of wide integers (8 bytes when the chunk size and base pointers allow it) and move
chunk after chunk, which is why MHA and MLA layouts, and every dtype, share one kernel. On a
GPU the kernel reads and writes the pinned host pool in place through unified virtual
addressing: no staging buffer, no per-chunk `cudaMemcpyAsync`. A launch has at most
`CopyConfig.max_programs` programs (16 by default) that stride over the work, so it occupies
at most that many SMs and leaves the rest to the forward pass that runs beside it.

`backup` (L1 -> L2, all layers, one launch) and `load_layer` (L2 -> L1, one layer) check
dtypes, shapes, strides, devices and page ids before they launch; a destination page listed
twice is rejected, since the result would depend on which write lands last.
`backup_reference` and `load_layer_reference` do the same in plain torch: the tests compare
against them, and they are the path used where Triton cannot run.

This module knows tensors and page ids, never tokens or page keys.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from tiers.errors import KVTensorError, PageIdError
from tiers.jit import tl, triton  # triton, or a stand-in without it

PageIds = Sequence[int] | np.ndarray | torch.Tensor

_WIDE_DTYPES = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}
_MAX_ROWS = 2**30  # kernel row indices are int32, and run one step past the end


@dataclass(frozen=True)
class CopyConfig:
    """Launch shape of the copy kernels.

    max_programs: programs per launch, an upper bound on the SMs a launch occupies.
    num_warps:    warps per program.
    tile_bytes:   bytes one program moves per loop step (power of two); more bytes in flight
                  hide the latency of PCIe reads, at the cost of registers.
    """

    max_programs: int = 16
    num_warps: int = 8
    tile_bytes: int = 32768

    def __post_init__(self) -> None:
        if not 1 <= self.max_programs <= 4096:
            raise ValueError(
                f"CopyConfig.max_programs must be in [1, 4096], got {self.max_programs}"
            )
        if self.num_warps not in (1, 2, 4, 8, 16, 32):
            raise ValueError(
                f"CopyConfig.num_warps must be a power of two <= 32, got {self.num_warps}"
            )
        if self.tile_bytes < 8 or self.tile_bytes & (self.tile_bytes - 1):
            raise ValueError(
                f"CopyConfig.tile_bytes must be a power of two >= 8, got {self.tile_bytes}"
            )


DEFAULT_COPY_CONFIG = CopyConfig()


@dataclass(frozen=True)
class CopyPlan:
    """How one launch moves its chunks (returned by the launchers; the benchmark reports it).

    width_bytes:     access unit; chunks are moved as integers of this size.
    chunk_elems:     one (page, layer) chunk, in access units.
    row_elems:       one tile row: the largest power of two dividing chunk_elems, capped by
                     the tile; rows of a tile may come from different chunks.
    rows_per_tile:   tile rows one program moves per loop step.
    num_rows:        tile rows in the launch (pages x layers x rows per chunk).
    num_programs:    programs launched; the launch occupies at most this many SMs.
    num_warps:       warps per program.
    """

    width_bytes: int
    chunk_elems: int
    row_elems: int
    rows_per_tile: int
    num_rows: int
    num_programs: int
    num_warps: int


@triton.jit
def _tile_offsets(
    first,
    num_rows,
    src_page_ids_ptr,
    dst_page_ids_ptr,
    src_base,
    src_page_stride,
    src_layer_stride,
    dst_base,
    dst_page_stride,
    dst_layer_stride,
    NUM_LAYERS: tl.constexpr,
    ROWS_PER_CHUNK: tl.constexpr,
    ROW_ELEMS: tl.constexpr,
    ROWS_PER_TILE: tl.constexpr,
):
    """Element offsets of the tile rows `first ..` in source and destination, and their mask.

    Row r of a launch is part (r % ROWS_PER_CHUNK) of layer (r // ROWS_PER_CHUNK) % NUM_LAYERS
    of the (r // ROWS_PER_CHUNK) // NUM_LAYERS-th page pair; consecutive rows walk one page's
    layers in order, which is one contiguous block on the host side.
    """
    row = first + tl.arange(0, ROWS_PER_TILE)  # (R,)
    valid = row < num_rows
    part = row % ROWS_PER_CHUNK
    chunk = row // ROWS_PER_CHUNK
    layer = (chunk % NUM_LAYERS).to(tl.int64)
    item = chunk // NUM_LAYERS
    src_page = tl.load(src_page_ids_ptr + item, mask=valid, other=0)  # (R,) int64
    dst_page = tl.load(dst_page_ids_ptr + item, mask=valid, other=0)
    src_off = src_base + src_page * src_page_stride + layer * src_layer_stride
    dst_off = dst_base + dst_page * dst_page_stride + layer * dst_layer_stride
    src_off = tl.multiple_of(src_off + part * ROW_ELEMS, ROW_ELEMS)
    dst_off = tl.multiple_of(dst_off + part * ROW_ELEMS, ROW_ELEMS)
    return src_off, dst_off, valid


@triton.jit
def _copy_chunks_kernel(
    src_ptr,  # flat wide-int view of the source pool
    dst_ptr,  # flat wide-int view of the destination pool
    src_page_ids_ptr,  # (num_pages,) int64
    dst_page_ids_ptr,  # (num_pages,) int64
    num_rows,  # num_pages * NUM_LAYERS * ROWS_PER_CHUNK
    src_base,  # element offsets; every one a multiple of the chunk size
    src_page_stride,
    src_layer_stride,
    dst_base,
    dst_page_stride,
    dst_layer_stride,
    NUM_LAYERS: tl.constexpr,
    ROWS_PER_CHUNK: tl.constexpr,
    ROW_ELEMS: tl.constexpr,
    ROWS_PER_TILE: tl.constexpr,
):
    # Each program strides over the tiles of the launch (a persistent grid of <= 16 programs).
    # Issuing the loads of tile k+1 before the stores of tile k (two tiles in flight) was an
    # option until it measured no gain (bench_transfer --sweep); nor did 8 vs 16 programs,
    # 4-32 warps or 16-128 KiB tiles: the link, not the launch shape, is the limit of SM
    # copies of host memory (figures: docs/performance.md).
    pid = tl.program_id(0)
    step = tl.num_programs(0) * ROWS_PER_TILE
    cols = tl.arange(0, ROW_ELEMS)[None, :]  # (1, C)
    for first in range(pid * ROWS_PER_TILE, num_rows, step):
        src_off, dst_off, valid = _tile_offsets(
            first, num_rows, src_page_ids_ptr, dst_page_ids_ptr, src_base, src_page_stride,
            src_layer_stride, dst_base, dst_page_stride, dst_layer_stride,
            NUM_LAYERS, ROWS_PER_CHUNK, ROW_ELEMS, ROWS_PER_TILE,
        )  # fmt: skip
        values = tl.load(src_ptr + (src_off[:, None] + cols), mask=valid[:, None])  # (R, C)
        tl.store(dst_ptr + (dst_off[:, None] + cols), values, mask=valid[:, None])


# -- checks ---------------------------------------------------------------------------------


def check_kv_pair(
    device_kv: torch.Tensor, host_kv: torch.Tensor, *, need_pinned: bool | None = None
) -> None:
    """Raise `KVTensorError` unless the two pools hold the same chunks.

    device_kv: (num_layers, num_device_pages, page_size, *token_shape), contiguous;
    host_kv:   (num_host_pages, num_layers, page_size, *token_shape), contiguous, on the CPU,
               and pinned when `need_pinned` (a GPU kernel can only reach pinned memory;
               None: when device_kv is on a CUDA device).
    """
    for name, kv in (("device_kv", device_kv), ("host_kv", host_kv)):
        if not isinstance(kv, torch.Tensor):
            raise KVTensorError(f"{name} must be a torch.Tensor, got {type(kv).__name__}")
        if kv.dim() < 4:
            raise KVTensorError(
                f"{name} must have >= 4 dims (layers/pages, pages/layers, page_size, "
                f"*token_shape), got shape {tuple(kv.shape)}"
            )
        if not kv.is_contiguous():
            raise KVTensorError(f"{name} must be contiguous, got strides {kv.stride()}")
    if device_kv.dtype != host_kv.dtype:
        raise KVTensorError(f"dtype mismatch: device_kv {device_kv.dtype}, host_kv {host_kv.dtype}")
    dev_shape, host_shape = tuple(device_kv.shape), tuple(host_kv.shape)
    if dev_shape[0] != host_shape[1] or dev_shape[2:] != host_shape[2:]:
        raise KVTensorError(
            f"shape mismatch: device_kv {dev_shape} is (layers, pages, ...), host_kv "
            f"{host_shape} must be (pages, {dev_shape[0]}, {', '.join(map(str, dev_shape[2:]))})"
        )
    if host_kv.device.type != "cpu":
        raise KVTensorError(f"host_kv must be on the CPU, got {host_kv.device}")
    if need_pinned is None:
        need_pinned = device_kv.is_cuda
    if need_pinned and not host_kv.is_pinned():
        raise KVTensorError(
            "host_kv is not pinned: a GPU kernel reads and writes host memory only when it is "
            "pinned (use HostPool(pin=True), or the *_reference copies)"
        )


def check_page_ids(
    src_page_ids: PageIds, dst_page_ids: PageIds, num_src_pages: int, num_dst_pages: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate a copy's page ids; return them as CPU int64 tensors.

    Raises `PageIdError` when the lists differ in length, an id is out of its pool's range,
    or a destination id is listed twice. A source id may repeat. Ids given as CUDA tensors are
    copied to the host to be checked (a synchronization): pass lists or CPU tensors.

    The checks run in numpy, which keeps the GIL for arrays this small: every torch call
    lets it go and waits to take it back, and a load issued while an L3 read's threads run
    Python paid for each of those waits (tiers.copy_engine's docstring has the figures).
    """
    src = _as_id_array(src_page_ids, "source")
    dst = _as_id_array(dst_page_ids, "destination")
    if src.size != dst.size:
        raise PageIdError(f"{src.size} source page ids but {dst.size} destination page ids")
    for what, ids, num_pages in (
        ("source", src, num_src_pages),
        ("destination", dst, num_dst_pages),
    ):
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= num_pages):
            bad = int(ids[(ids < 0) | (ids >= num_pages)][0])
            raise PageIdError(f"{what} page id {bad} out of range [0, {num_pages})")
    if dst.size > 1:
        ordered = np.sort(dst)
        repeats = ordered[1:][ordered[1:] == ordered[:-1]]
        if repeats.size:
            raise PageIdError(
                f"destination page id {int(repeats[0])} listed twice; each destination page "
                "may be written once per copy"
            )
    return torch.from_numpy(src), torch.from_numpy(dst)


def _as_id_array(page_ids: PageIds, what: str) -> np.ndarray:
    """`page_ids` as a contiguous int64 numpy array of its own (the caller may change its
    list or tensor afterwards)."""
    if isinstance(page_ids, torch.Tensor):
        page_ids = page_ids.detach().cpu().numpy()
    shared = isinstance(page_ids, np.ndarray)  # else np.asarray makes an array of its own
    try:
        ids = np.asarray(page_ids)
    except (TypeError, ValueError) as exc:
        raise PageIdError(f"{what} page ids are not a list of integers: {exc}") from None
    if ids.size == 0:
        ids = ids.astype(np.int64)  # ([] is float64 to numpy)
    if ids.ndim != 1:
        raise PageIdError(f"{what} page ids must be one-dimensional, got shape {ids.shape}")
    if ids.dtype.kind not in "iu":
        raise PageIdError(f"{what} page ids must be integers, got {ids.dtype}")
    return ids.astype(np.int64, order="C", copy=shared)


# -- launchers ------------------------------------------------------------------------------


def backup(
    device_kv: torch.Tensor,
    host_kv: torch.Tensor,
    device_page_ids: PageIds,
    host_page_ids: PageIds,
    *,
    config: CopyConfig = DEFAULT_COPY_CONFIG,
    check_ids: bool = True,
) -> CopyPlan | None:
    """L1 -> L2: copy all layers of `device_page_ids[i]` to `host_page_ids[i]`, one launch.

    Asynchronous on the current CUDA stream (the caller orders it against the writers of the
    device pages and waits before it reads the host pages). Returns the launch plan, or None
    when there is nothing to copy. `check_ids=False` skips the range and duplicate checks: the
    caller has run `check_page_ids` on these exact ids and passes them as int64 tensors on the
    device of `device_kv`.
    """
    check_kv_pair(device_kv, host_kv)
    num_layers, num_device_pages, num_host_pages = (
        device_kv.shape[0],
        device_kv.shape[1],
        host_kv.shape[0],
    )
    dev_ids, host_ids = _ids_for_launch(
        device_page_ids, host_page_ids, num_device_pages, num_host_pages, device_kv, check_ids
    )
    chunk_bytes = _chunk_bytes(device_kv)
    return _launch(
        src=device_kv,
        dst=host_kv,
        src_ids=dev_ids,
        dst_ids=host_ids,
        num_layers=num_layers,
        chunk_bytes=chunk_bytes,
        src_strides=(0, 1, num_device_pages),  # base, page, layer, in chunks
        dst_strides=(0, num_layers, 1),
        config=config,
    )


def load_layer(
    host_kv: torch.Tensor,
    device_kv: torch.Tensor,
    layer: int,
    host_page_ids: PageIds,
    device_page_ids: PageIds,
    *,
    config: CopyConfig = DEFAULT_COPY_CONFIG,
    check_ids: bool = True,
) -> CopyPlan | None:
    """L2 -> L1 for one layer: copy layer `layer` of `host_page_ids[i]` to `device_page_ids[i]`.

    Asynchronous on the current CUDA stream, like `backup`; `check_ids` as there.
    """
    check_kv_pair(device_kv, host_kv)
    num_layers, num_device_pages, num_host_pages = (
        device_kv.shape[0],
        device_kv.shape[1],
        host_kv.shape[0],
    )
    _check_layer(layer, num_layers)
    host_ids, dev_ids = _ids_for_launch(
        host_page_ids, device_page_ids, num_host_pages, num_device_pages, device_kv, check_ids
    )
    return _launch(
        src=host_kv,
        dst=device_kv,
        src_ids=host_ids,
        dst_ids=dev_ids,
        num_layers=1,
        chunk_bytes=_chunk_bytes(device_kv),
        src_strides=(layer, num_layers, 1),
        dst_strides=(layer * num_device_pages, 1, num_device_pages),
        config=config,
    )


def _check_layer(layer: int, num_layers: int) -> None:
    if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < num_layers:
        raise KVTensorError(f"layer must be an int in [0, {num_layers}), got {layer!r}")


def _chunk_bytes(device_kv: torch.Tensor) -> int:
    return device_kv[0, 0].numel() * device_kv.element_size()


def _ids_for_launch(src_ids, dst_ids, num_src_pages, num_dst_pages, device_kv, check_ids):
    if check_ids:
        src, dst = check_page_ids(src_ids, dst_ids, num_src_pages, num_dst_pages)
        return src.to(device_kv.device), dst.to(device_kv.device)
    for what, ids in (("source", src_ids), ("destination", dst_ids)):
        if not (
            isinstance(ids, torch.Tensor)
            and ids.dtype == torch.int64
            and ids.dim() == 1
            and ids.device == device_kv.device
        ):
            raise PageIdError(
                f"with check_ids=False the {what} page ids must be a 1-D int64 tensor on "
                f"{device_kv.device} that check_page_ids has validated"
            )
    if src_ids.numel() != dst_ids.numel():
        raise PageIdError(f"{src_ids.numel()} source page ids but {dst_ids.numel()} destination")
    return src_ids, dst_ids


def _launch(
    *, src, dst, src_ids, dst_ids, num_layers, chunk_bytes, src_strides, dst_strides, config
):
    """Launch the copy of `len(src_ids) x num_layers` chunks. Strides are in chunks."""
    if src_ids.numel() == 0:
        return None
    if not (src.is_cuda or dst.is_cuda or triton_interpreting()):
        raise KVTensorError(
            "the Triton copy kernels need a CUDA device (or TRITON_INTERPRET=1); "
            "on the CPU use backup_reference / load_layer_reference"
        )
    width = next(
        w
        for w in (8, 4, 2, 1)
        if chunk_bytes % w == 0 and src.data_ptr() % w == 0 and dst.data_ptr() % w == 0
    )
    plan = _plan(chunk_bytes // width, width, src_ids.numel() * num_layers, config)
    if plan.num_rows > _MAX_ROWS:
        raise KVTensorError(f"copy of {plan.num_rows} rows exceeds one launch; split the batch")
    wide = _WIDE_DTYPES[width]
    chunk = plan.chunk_elems
    _copy_chunks_kernel[(plan.num_programs,)](
        src.view(-1).view(torch.uint8).view(wide),
        dst.view(-1).view(torch.uint8).view(wide),
        src_ids,
        dst_ids,
        plan.num_rows,
        *(s * chunk for s in src_strides),
        *(s * chunk for s in dst_strides),
        NUM_LAYERS=num_layers,
        ROWS_PER_CHUNK=chunk // plan.row_elems,
        ROW_ELEMS=plan.row_elems,
        ROWS_PER_TILE=plan.rows_per_tile,
        num_warps=config.num_warps,
    )
    return plan


def _plan(chunk_elems: int, width: int, num_chunks: int, config: CopyConfig) -> CopyPlan:
    tile_elems = max(1, config.tile_bytes // width)
    row_elems = min(chunk_elems & -chunk_elems, tile_elems)  # lowest set bit: largest 2^k | n
    rows_per_tile = tile_elems // row_elems
    num_rows = num_chunks * (chunk_elems // row_elems)
    num_programs = min(config.max_programs, triton.cdiv(num_rows, rows_per_tile))
    return CopyPlan(
        width_bytes=width,
        chunk_elems=chunk_elems,
        row_elems=row_elems,
        rows_per_tile=rows_per_tile,
        num_rows=num_rows,
        num_programs=num_programs,
        num_warps=config.num_warps,
    )


def triton_interpreting() -> bool:
    """True when Triton kernels run in the CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# -- plain torch reference ------------------------------------------------------------------


def backup_reference(
    device_kv: torch.Tensor,
    host_kv: torch.Tensor,
    device_page_ids: PageIds,
    host_page_ids: PageIds,
) -> None:
    """`backup` in plain torch (synchronous for pageable host memory)."""
    check_kv_pair(device_kv, host_kv, need_pinned=False)
    dev_ids, host_ids = check_page_ids(
        device_page_ids, host_page_ids, device_kv.shape[1], host_kv.shape[0]
    )
    if dev_ids.numel():
        # (L, n, S, *tok) -> (n, L, S, *tok)
        pages = device_kv[:, dev_ids.to(device_kv.device)].transpose(0, 1)
        host_kv[host_ids] = pages.to("cpu")


def load_layer_reference(
    host_kv: torch.Tensor,
    device_kv: torch.Tensor,
    layer: int,
    host_page_ids: PageIds,
    device_page_ids: PageIds,
) -> None:
    """`load_layer` in plain torch."""
    check_kv_pair(device_kv, host_kv, need_pinned=False)
    _check_layer(layer, device_kv.shape[0])
    host_ids, dev_ids = check_page_ids(
        host_page_ids, device_page_ids, host_kv.shape[0], device_kv.shape[1]
    )
    if host_ids.numel():
        pages = host_kv[host_ids, layer]  # (n, S, *tok)
        device_kv[layer][dev_ids.to(device_kv.device)] = pages.to(device_kv.device)
