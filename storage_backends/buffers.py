"""The caller's arguments as every backend's batch API takes them: page keys, and pages as
flat byte views (one buffer, or a list of its pieces), checked once where a call comes in; a
bad one is named by its position. This module knows buffers only, not the object format:
`objects` frames pages into objects and `verify` checks them, both on the views made here.
"""

from __future__ import annotations

from collections.abc import Sequence

KEY_BYTES = 16  # a page key (the object header carries one, at offset 16)
Buffer = bytes | bytearray | memoryview

# A page as a caller of batch_get / batch_put holds it: one buffer, or a list (or tuple) of
# buffers whose concatenation is the page, its pieces (an engine's page scattered over its
# pool, one piece per layer): read into and written from where they lie.
PageBuffers = Buffer | Sequence[Buffer]
PageView = memoryview | list[memoryview]  # the same, as flat byte views
MAX_PIECES = 1023  # pieces of one page at most (with its header: one preadv / writev)


def byte_view(buf: Buffer, *, writable: bool = False, what: str = "buffer") -> memoryview:
    """A flat unsigned-byte view of `buf` (any C-contiguous buffer: bytes, array, numpy...)."""
    if type(buf) is bytes and not writable:
        return memoryview(buf)  # the common case, on every read: skip the checks
    view = buf if isinstance(buf, memoryview) else memoryview(buf)
    if writable and view.readonly:
        raise ValueError(f"{what} must be writable (got a read-only {type(buf).__name__})")
    if not view.c_contiguous:
        raise ValueError(f"{what} must be C-contiguous")
    if view.format == "B" and view.ndim == 1:
        return view
    return view.cast("B")


def check_key(key: bytes, *, what: str = "page key") -> bytes:
    if not isinstance(key, bytes) or len(key) != KEY_BYTES:
        got = f"{len(key)} bytes" if isinstance(key, (bytes, bytearray)) else type(key).__name__
        raise ValueError(f"{what} must be {KEY_BYTES} bytes, got {got}")
    return key


def check_keys(keys: Sequence[bytes]) -> list[bytes]:
    """A batch's keys as a list, each 16 bytes (a bad one is named by its position)."""
    keys = list(keys)
    if all(type(key) is bytes and len(key) == KEY_BYTES for key in keys):
        return keys  # the common case, without building a message per key
    for i, key in enumerate(keys):
        check_key(key, what=f"keys[{i}]")
    return keys


def page_view(page: PageBuffers, *, writable: bool = False, what: str = "page") -> PageView:
    """A page as flat byte views: one, or one per piece where the page is in pieces."""
    if not isinstance(page, (list, tuple)):
        return byte_view(page, writable=writable, what=what)
    if not 1 <= len(page) <= MAX_PIECES:
        raise ValueError(f"{what}: a page in pieces has 1 to {MAX_PIECES}, not {len(page)}")
    try:  # (names are built only for a bad piece: a layer_first batch has thousands)
        return [byte_view(piece, writable=writable) for piece in page]
    except (TypeError, ValueError):
        return [
            byte_view(piece, writable=writable, what=f"{what} piece {j}")
            for j, piece in enumerate(page)
        ]


def page_nbytes(view: PageView) -> int:
    """The bytes of a page (of all its pieces)."""
    return len(view) if isinstance(view, memoryview) else sum(map(len, view))


def page_pieces(view: PageView) -> list[memoryview]:
    """A page's pieces (a page of one buffer is its own one piece)."""
    return [view] if isinstance(view, memoryview) else view


def joined_page(view: PageView) -> memoryview:
    """A page as one buffer: itself, or its pieces joined (one copy)."""
    if isinstance(view, memoryview):
        return view
    return view[0] if len(view) == 1 else memoryview(b"".join(view))


def scatter_page(page: Buffer, pieces: Sequence[memoryview]) -> None:
    """Copy a page, one buffer, into its pieces (exactly as long, together)."""
    offset = 0
    for piece in pieces:
        piece[:] = page[offset : offset + len(piece)]
        offset += len(piece)


def page_views(
    pages: Sequence[PageBuffers], *, writable: bool = False, what: str = "pages"
) -> list[PageView]:
    """`page_view` of each of a batch's pages; a bad one is named by its position (the names
    are built only then: this runs for every call)."""
    try:
        views = _flat_views(pages, writable)
        return views if views is not None else [page_view(p, writable=writable) for p in pages]
    except (TypeError, ValueError):
        return [
            page_view(page, writable=writable, what=f"{what}[{i}]") for i, page in enumerate(pages)
        ]


def is_flat_bytes(buf: object) -> bool:
    """Whether `buf` is a memoryview C can read as it is: one contiguous run of bytes."""
    return type(buf) is memoryview and buf.format == "B" and buf.ndim == 1 and buf.c_contiguous


def _flat_views(pages: Sequence[PageBuffers], writable: bool) -> list[memoryview] | None:
    """The common case of `page_views`, in one pass with no names built: every page a flat
    byte memoryview (writable if asked) or, to read, `bytes`. None where one is not."""
    views = []
    for page in pages:
        if is_flat_bytes(page):
            if writable and page.readonly:
                return None
            views.append(page)
        elif type(page) is bytes and not writable:
            views.append(memoryview(page))
        else:
            return None
    return views


def writable_views(buffers: Sequence[PageBuffers]) -> list[PageView]:
    """Flat writable byte views of the caller's pages (each one buffer, or its pieces)."""
    return page_views(buffers, writable=True, what="into")


def check_same_length(name: str, keys: list[bytes], values: Sequence[object]) -> None:
    if len(values) != len(keys):
        raise ValueError(f"{name} has {len(values)} entries for {len(keys)} keys")
