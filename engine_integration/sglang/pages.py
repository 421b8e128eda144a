"""Where a page of an SGLang host pool lies in memory: the byte ranges behind one page.

SGLang's host pools (`MHATokenToKVPoolHost`, `MLATokenToKVPoolHost`) keep their KV in one
contiguous tensor, `kv_buffer`, whose shape depends on the host layout:

    MHA  layer_first        (2, layers, tokens, heads, head_dim)
         page_first         (2, tokens, layers, heads, head_dim)     SGLang's default
         page_first_direct  (2, pages, layers, page, heads, head_dim)
         page_head          (2, pages, heads, page, layers, head_dim)
    MLA  layer_first        (layers, tokens, 1, kv_cache_dim)
         page_first         (tokens, layers, 1, kv_cache_dim)
         page_first_direct  (pages, layers, page, 1, kv_cache_dim)

A page is therefore not one range of bytes but a few: K and V (MHA page_first), or one per
layer (layer_first). `PageGeometry` finds those *parts* from the pool's own view of a page
(`get_data_page(index, flat=False)`), so it follows the pool rather than restating its
shapes, and checks that every part is contiguous and that parts move by a fixed stride from
one page to the next. The parts of a page, in order, are exactly the bytes of SGLang's flat
page (`get_data_page(index, flat=True)`), so the zero-copy calls and the flat-page calls
store the same objects.

Head slices (`page_head` only, for SGLang's `tp_lcm_size`): a page of H heads is cut into S
slices of H/S heads, each slice's K and V contiguous in `page_head`; the parts are then
ordered slice by slice (K, V of slice 0, then of slice 1...), and the descriptor names the
shape of one slice, so a rank of another tp size whose heads are one slice reads the same
objects.

This module knows torch tensors and byte offsets; not keys, not storage.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from storage_backends import BackendConfigError

HOST_LAYOUTS = ("page_first", "layer_first", "page_first_direct", "page_head")
MHA_ONLY_LAYOUTS = ("page_head",)  # SGLang's MLA host pool has no page_head
# A page of more parts than this is stored as ONE object whose payload is its parts in order
# (the storage API's page in pieces: read into and written from the parts where they lie):
# one object per layer (layer_first: 61 for DeepSeek-V3's MLA, 64 for Llama-8B's K and V)
# made many small files and requests, slower than SGLang's one file per page. Up to this
# many, each part is an object of its own.
MAX_ZERO_COPY_PARTS = 2


@dataclass(frozen=True)
class PageGeometry:
    """The byte ranges of every page of one host pool's `kv_buffer`.

    Part j of the page that starts at token index t covers
    `[first_offsets[j] + (t // page_size) * page_stride_bytes, ... + part_bytes[j])`.
    """

    page_size: int  # tokens per page
    first_offsets: tuple[int, ...]  # byte offset of each part of page 0 in kv_buffer
    part_bytes: tuple[int, ...]  # bytes of each part
    page_stride_bytes: int  # how far every part moves from one page to the next
    num_pages: int  # pages the buffer holds
    descriptor: str  # what the bytes of a page mean (the L3 layout descriptor)
    flat_offsets: tuple[int, ...]  # byte offset of each part in SGLang's flat page
    head_slices: int = 1  # slices of heads a page is cut into (parts come slice by slice)

    @property
    def num_parts(self) -> int:
        return len(self.part_bytes)

    @property
    def page_bytes(self) -> int:
        return sum(self.part_bytes)

    @property
    def gathered(self) -> bool:
        """Whether a page is one object (its parts gathered) rather than one per part."""
        return self.num_parts // self.head_slices > MAX_ZERO_COPY_PARTS

    @property
    def num_objects(self) -> int:
        """Objects per page in L3 (over all its head slices)."""
        return 1 if self.gathered else self.num_parts

    @classmethod
    def of_host_pool(cls, pool: object, *, attention: str, head_slices: int = 1) -> PageGeometry:
        """The geometry of `pool` (an SGLang host pool; attributes used: `layout`,
        `page_size`, `dtype`, `kv_buffer`, `get_data_page`). `attention` is "mha" or "mla";
        `head_slices` > 1 cuts each page's heads into that many slices (`page_head` only)."""
        layout = pool.layout
        if layout not in HOST_LAYOUTS or (attention == "mla" and layout in MHA_ONLY_LAYOUTS):
            usable = [x for x in HOST_LAYOUTS if attention == "mha" or x not in MHA_ONLY_LAYOUTS]
            raise BackendConfigError(
                f"SGLang host layout {layout!r} is not supported by hicache's storage backend "
                f"for {attention}; use --hicache-mem-layout {' or '.join(usable)}"
            )
        if head_slices != 1 and layout != "page_head":
            raise BackendConfigError(
                f"extra config: tp_lcm_size splits each page's heads {head_slices} ways, which "
                f"needs --hicache-mem-layout page_head (the host layout is {layout!r})"
            )
        buffer = getattr(pool, "kv_buffer", None)
        if buffer is None:
            raise BackendConfigError(
                f"SGLang host pool {type(pool).__name__} holds no KV bytes of its own (a "
                "logical anchor, as DeepSeek-V4's): hicache's SGLang backend needs a KV pool"
            )
        if not isinstance(buffer, torch.Tensor) or buffer.device.type != "cpu":
            raise BackendConfigError("the SGLang host pool has no CPU kv_buffer tensor")
        if not buffer.is_contiguous():
            raise BackendConfigError("the SGLang host pool's kv_buffer is not contiguous")
        page_size = int(pool.page_size)
        item = buffer.element_size()
        num_pages = _num_pages(buffer, layout, attention, page_size)

        def page_view(index: int) -> torch.Tensor:
            return _sliced(pool.get_data_page(index, flat=False), head_slices)

        first = _parts(page_view(0), buffer)
        stride = 0
        if num_pages > 1:
            second = _parts(page_view(page_size), buffer)
            stride = _common_stride(first, second)
            last_page = num_pages - 1
            last = _parts(page_view(last_page * page_size), buffer)
            if [o + last_page * stride for o, _ in first] != [o for o, _ in last]:
                raise BackendConfigError(
                    f"SGLang host layout {layout!r}: pages are not evenly spaced in kv_buffer"
                )
        view = page_view(0)
        shape = view.shape[1:] if head_slices > 1 else view.shape  # one slice's
        page_shape = "x".join(str(d) for d in shape)
        parts = len(first) // head_slices
        descriptor = (
            f"sglang;attn={attention};host_layout={layout};dtype={_dtype_name(pool.dtype)};"
            f"page={page_size};page_shape={page_shape};parts={parts}"
        )
        if parts > MAX_ZERO_COPY_PARTS:
            descriptor += ";objects=1"
        # The flat page holds the parts in the order they lie in kv_buffer.
        flat = [sum(n for o2, n in first if o2 < o) for o, _ in first]
        return cls(
            page_size=page_size,
            first_offsets=tuple(o * item for o, _ in first),
            part_bytes=tuple(n * item for _, n in first),
            page_stride_bytes=stride * item,
            num_pages=num_pages,
            descriptor=descriptor,
            flat_offsets=tuple(f * item for f in flat),
            head_slices=head_slices,
        )

    def page_numbers(self, host_indices: torch.Tensor, num_keys: int) -> np.ndarray:
        """The page numbers of a batch's `host_indices` (token indices, `page_size` per key,
        each page's run consecutive and page-aligned, as SGLang allocates them)."""
        if not isinstance(host_indices, torch.Tensor) or host_indices.dim() != 1:
            raise ValueError("host_indices must be a 1-D tensor of host token indices")
        if host_indices.numel() != num_keys * self.page_size:
            raise ValueError(
                f"host_indices has {host_indices.numel()} entries for {num_keys} keys of "
                f"{self.page_size} tokens"
            )
        if num_keys == 0:
            return np.zeros(0, dtype=np.int64)
        tokens = host_indices.to(device="cpu", dtype=torch.int64).view(num_keys, self.page_size)
        starts = tokens[:, 0]
        runs = starts[:, None] + torch.arange(self.page_size, dtype=torch.int64)
        if bool((starts % self.page_size).any()) or not torch.equal(tokens, runs):
            raise ValueError("host_indices are not whole, page-aligned pages of the host pool")
        pages = (starts // self.page_size).numpy()
        if int(pages.min()) < 0 or int(pages.max()) >= self.num_pages:
            raise ValueError(f"host_indices reach outside the host pool's {self.num_pages} pages")
        return pages

    def page_views(self, buffer: memoryview, pages: np.ndarray) -> list[memoryview]:
        """Views of the parts of `pages` in `buffer` (the pool's bytes), page by page."""
        starts = pages[:, None] * self.page_stride_bytes + np.asarray(self.first_offsets)
        sizes = self.part_bytes
        return [
            buffer[start : start + size]
            for row in starts.tolist()
            for start, size in zip(row, sizes, strict=True)
        ]

    def split_flat_page(self, page: memoryview) -> list[memoryview]:
        """A flat page (SGLang's `get_data_page(i, flat=True)`) cut into its objects: its
        parts, or itself whole where the page is gathered into one object."""
        if len(page) != self.page_bytes:
            raise ValueError(f"a flat page must be {self.page_bytes} bytes, got {len(page)}")
        if self.gathered:
            return [page]
        return [
            page[start : start + size]
            for start, size in zip(self.flat_offsets, self.part_bytes, strict=True)
        ]


def is_logical_anchor(pool: object) -> bool:
    """A KV pool of page slots but no bytes (DeepSeek-V4's `LogicalHostPool`)."""
    return getattr(pool, "kv_buffer", False) is None and getattr(pool, "size_per_token", 1) == 0


def byte_buffer(tensor: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory (no copy; any dtype)."""
    flat = tensor.detach().reshape(-1)
    if not tensor.is_contiguous() or flat.data_ptr() != tensor.data_ptr():
        raise ValueError("tensor must be contiguous")
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


def _sliced(page: torch.Tensor, head_slices: int) -> torch.Tensor:
    """A page_head page (2, 1, heads, page, layers, head_dim) as (slices, 2, 1, heads/slices,
    page, layers, head_dim): its C order is slice by slice, K then V. Unchanged if 1 slice."""
    if head_slices == 1:
        return page
    heads = page.shape[2]
    if page.dim() != 6 or heads % head_slices:
        raise BackendConfigError(
            f"extra config: tp_lcm_size splits each page's {heads} KV heads {head_slices} "
            "ways; the heads must divide evenly"
        )
    return page.unflatten(2, (head_slices, heads // head_slices)).permute(2, 0, 1, 3, 4, 5, 6)


def _parts(view: torch.Tensor, base: torch.Tensor) -> list[tuple[int, int]]:
    """(element offset in `base`, elements) of each contiguous block of `view`, in C order."""
    shape, strides = list(view.shape), list(view.stride())
    block, split = 1, len(shape)
    for dim in reversed(range(len(shape))):
        if shape[dim] != 1 and strides[dim] != block:
            break
        block *= shape[dim]
        split = dim
    origin = view.storage_offset() - base.storage_offset()
    leading = [range(n) for n in shape[:split]]
    return [
        (origin + sum(i * s for i, s in zip(index, strides, strict=False)), block)
        for index in itertools.product(*leading)
    ]


def _common_stride(first: Sequence[tuple[int, int]], second: Sequence[tuple[int, int]]) -> int:
    strides = {b - a for (a, _), (b, _) in zip(first, second, strict=True)}
    if len(strides) != 1 or [n for _, n in first] != [n for _, n in second]:
        raise BackendConfigError("SGLang host pool: the parts of two pages are not alike")
    return strides.pop()


def _num_pages(buffer: torch.Tensor, layout: str, attention: str, page_size: int) -> int:
    """Pages in `kv_buffer`, from its shape (the tokens or pages axis of the layout)."""
    axis = {"layer_first": 1, "page_first": 0, "page_first_direct": 0, "page_head": 0}[layout]
    if attention == "mha":
        axis += 1  # the leading K/V axis
    if buffer.dim() <= axis:
        raise BackendConfigError(
            f"SGLang host pool: kv_buffer of shape {tuple(buffer.shape)} does not fit "
            f"{attention} {layout}"
        )
    length = buffer.shape[axis]
    return length if layout in ("page_first_direct", "page_head") else length // page_size


def _dtype_name(dtype: object) -> str:
    return str(dtype).removeprefix("torch.")
