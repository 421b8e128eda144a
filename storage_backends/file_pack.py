"""The pack: how `file://` stores a batch of pages in one file.

A pack holds the objects of several pages back to back, after a table that says where each
one is (little-endian):

    offset   bytes  field
    0        4      magic b"HCPK"
    4        2      pack format version (1)
    6        2      reserved (zero)
    8        4      n, number of pages
    12       4      reserved (zero)
    16       32*n   n entries: page key (16), object offset (8), object length (8)
    ...             the objects (the format of `objects.py`), at the offsets the table gives

Each page key's name in the directory (`<root>/a/b/<key hex>`) is a hard link to the pack
that holds it, so a page is found with one lookup, a batch is read from one open file, and
the filesystem counts the links: the pack's bytes are free once its last page is evicted.

The table carries no checksum of its own: every object it points to is verified as usual
(key, layout, lengths, checksum), so a damaged table can only make a page a miss.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Sequence

from .buffers import KEY_BYTES
from .objects import CorruptReason

PACK_MAGIC = b"HCPK"
PACK_VERSION = 1
_HEAD = struct.Struct("<4sHHII")
_ENTRY = struct.Struct(f"<{KEY_BYTES}sQQ")
HEAD_BYTES = _HEAD.size
ENTRY_BYTES = _ENTRY.size
MAX_PAGES = 1 << 20  # a table larger than this is damage, not a pack
_DELETED = bytes(KEY_BYTES)  # the key of a deleted page's entry
_FIRST_READ = 4096  # the head and the first 127 entries


def table_bytes(num_pages: int) -> int:
    return HEAD_BYTES + ENTRY_BYTES * num_pages


def pack_table(keys: Sequence[bytes], lengths: Sequence[int]) -> bytes:
    """The head and table of a pack whose objects, of these lengths, follow it in order."""
    parts = [_HEAD.pack(PACK_MAGIC, PACK_VERSION, 0, len(keys), 0)]
    offset = table_bytes(len(keys))
    for key, length in zip(keys, lengths, strict=True):
        parts.append(_ENTRY.pack(key, offset, length))
        offset += length
    return b"".join(parts)


class PackTable:
    """One open pack: where each of its pages is (key -> object offset, object length)."""

    __slots__ = ("entries", "fd", "file_bytes", "ino", "mtime_ns", "path", "served")

    def __init__(
        self, entries: dict[bytes, tuple[int, int]], fd: int, st: os.stat_result, path: str
    ) -> None:
        self.entries = entries
        self.fd = fd
        self.path = path
        self.file_bytes = st.st_size
        self.ino = st.st_ino
        self.mtime_ns = st.st_mtime_ns
        self.served = False  # a page was read from it (the reader then marks it used)

    def find(self, key: bytes, max_length: int) -> tuple[int, int] | CorruptReason:
        """(offset, length) of the key's object, or why this pack can't serve it. An object
        longer than `max_length` (the most the reader expects) is refused unread."""
        entry = self.entries.get(key)
        if entry is None:
            return CorruptReason.KEY  # the key's name links to a pack without it
        offset, length = entry
        if length > max_length:
            return CorruptReason.LENGTH
        if offset + length > self.file_bytes:
            return CorruptReason.TRUNCATED
        return entry


def read_table(fd: int, st: os.stat_result, path: str = "") -> PackTable | CorruptReason:
    """Read and check the table of the pack open as `fd` (whose fstat is `st`).

    Deleted pages' entries (the key zeroed, see `tombstone`) are left out.
    """
    raw = _read_entries(fd, st.st_size)
    if isinstance(raw, CorruptReason):
        return raw
    entries = {key: (offset, length) for key, offset, length in _ENTRY.iter_unpack(raw)}
    entries.pop(_DELETED, None)
    return PackTable(entries, fd, st, path)


def tombstone(fd: int, key: bytes) -> bool:
    """Zero `key`'s entry in the table of the pack open (read-write) as `fd`, so that no read
    finds that page through the pack's other names any more. False if it has no entry."""
    raw = _read_entries(fd, os.fstat(fd).st_size)
    if isinstance(raw, CorruptReason):
        return False
    for index, (found, _, _) in enumerate(_ENTRY.iter_unpack(raw)):
        if found == key:
            os.pwrite(fd, _DELETED, entry_position(index))
            return True
    return False


def _read_entries(fd: int, file_bytes: int) -> bytes | CorruptReason:
    """The raw table entries of a pack, its head checked (one read for most packs)."""
    if file_bytes < HEAD_BYTES:
        return CorruptReason.TRUNCATED if file_bytes else CorruptReason.MAGIC
    first = os.pread(fd, min(file_bytes, _FIRST_READ), 0)
    if len(first) < HEAD_BYTES:
        return CorruptReason.TRUNCATED
    magic, version, reserved, count, reserved2 = _HEAD.unpack_from(first)
    if magic != PACK_MAGIC:
        return CorruptReason.MAGIC
    if version != PACK_VERSION or reserved or reserved2:
        return CorruptReason.VERSION
    if count > MAX_PAGES:
        return CorruptReason.LENGTH
    end = table_bytes(count)
    if end > file_bytes:
        return CorruptReason.TRUNCATED
    if end <= len(first):
        return first[HEAD_BYTES:end]
    rest = os.pread(fd, end - len(first), len(first))
    raw = first[HEAD_BYTES:] + rest
    return raw if len(raw) == end - HEAD_BYTES else CorruptReason.TRUNCATED


def entry_position(index: int) -> int:
    """Byte offset of the table entry of the pack's `index`-th page (tools and tests)."""
    return HEAD_BYTES + ENTRY_BYTES * index
