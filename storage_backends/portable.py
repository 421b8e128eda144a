"""The checks and the framing of objects held in memory, in Python: what an install without
the C extension runs (`native.checks` is this module there, `_pageio` where it is built).

It answers exactly as `_pageio`'s functions of the same names do (same arguments, same
numbers: `verify._REASONS`), with the `xxhash` package's XXH3-64 (the xxHash library, as in
the extension) as the checksum. The tests run one damage corpus through both and require the
same answers (tests/storage_backends/test_pageio.py). What the C extension alone does, and
why: the `file://` backend's batch reads and writes (`read_stretches`, `write_packs`,
`link_all`, `sync_all`), which pay for it (benchmarks/bench_file_read.py); `file://` says
what to install where it is missing (`native.require_pageio`).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import xxhash

# The format's numbers (objects.py): the extension repeats them, and the tests hold both to
# the format's table.
_MAGIC = b"HCKV"
_PLAIN_BYTES = 48  # what the checksum covers before the layout
_FIXED_BYTES = 56
_KEY_BYTES = 16
_SIGNED_VERSION = 2
_MAC_BYTES = 32
_MAX_PAYLOAD_BYTES = 1 << 30
_LZ4_MAX_RATIO = 255
_MAX_PARTS = 1024
_MAX_LAYOUT_BYTES = 0xFFFF
_FIELDS = struct.Struct("<4sHBBH6x16sQQQ")
_LENGTH = struct.Struct("<Q")
_CODEC_OFFSET = 6

# What a check answers (the C check's numbers).
_UNCHECKED, VERIFIED, _MAGIC_BAD, _VERSION, _KEY, _LAYOUT, _LENGTH_BAD = range(7)
_TRUNCATED, _CHECKSUM, _COMPRESSION, _SPLIT_HEADER = range(7, 11)


def xxh3_64(first: bytes | memoryview, second: bytes | memoryview = b"") -> int:
    """XXH3 64-bit (seed 0) of first + second, without joining them."""
    if not len(second):
        return xxhash.xxh3_64_intdigest(first)
    hasher = xxhash.xxh3_64(first)
    hasher.update(second)
    return hasher.intdigest()


def check_object(
    parts: Sequence[memoryview], key: bytes, layout: bytes | None, raw_bytes: int
) -> int:
    """`_pageio.check_object`: 1 when the object in `parts` checked out, else the number of
    the first thing wrong (10: its header straddles two parts; join them and ask again)."""
    if len(key) != _KEY_BYTES or not 1 <= len(parts) <= _MAX_PARTS:
        raise ValueError("check_object: a key is 16 bytes, an object 1 to 1024 parts")
    code, header_bytes, _ = _check_head(parts, key, layout, raw_bytes)
    if code != VERIFIED:
        return code
    first = parts[0]
    hasher = xxhash.xxh3_64(first[:_PLAIN_BYTES])
    hasher.update(first[_FIXED_BYTES:])
    for part in parts[1:]:
        hasher.update(part)
    stored = _LENGTH.unpack_from(first, _PLAIN_BYTES)[0]
    return VERIFIED if hasher.intdigest() == stored else _CHECKSUM


def _check_head(
    parts: Sequence[memoryview], key: bytes, layout: bytes | None, raw_bytes: int
) -> tuple[int, int, int]:
    """The checks before the checksum, in the C check's order, so the reason named is the
    first thing wrong: (VERIFIED or the reason, the header's bytes, the codec)."""
    first = parts[0]
    total = sum(len(part) for part in parts)
    if len(first) < _FIXED_BYTES:
        if total >= _FIXED_BYTES and len(parts) > 1:
            return _SPLIT_HEADER, 0, 0
        head = bytes(first[:4])
        return (_TRUNCATED if _MAGIC.startswith(head) else _MAGIC_BAD), 0, 0
    magic, version, codec, flags, layout_len, stored_key, stored, raw, _ = _FIELDS.unpack_from(
        first
    )
    if magic != _MAGIC:
        return _MAGIC_BAD, 0, 0
    if version not in (1, _SIGNED_VERSION) or flags != 0:
        return _VERSION, 0, 0
    if codec > 1:
        return _COMPRESSION, 0, 0
    header_bytes = _FIXED_BYTES + layout_len + (_MAC_BYTES if version == _SIGNED_VERSION else 0)
    if len(first) < header_bytes:
        split = total >= header_bytes and len(parts) > 1
        return (_SPLIT_HEADER if split else _TRUNCATED), 0, 0
    if stored_key != key:
        return _KEY, 0, 0
    if layout is not None and first[_FIXED_BYTES : _FIXED_BYTES + layout_len] != layout:
        return _LAYOUT, 0, 0
    return _check_lengths(total - header_bytes, stored, raw, codec, raw_bytes), header_bytes, codec


def _check_lengths(present: int, stored: int, raw: int, codec: int, raw_bytes: int) -> int:
    """The header's lengths against the bytes present and the size the reader expects."""
    if present < stored:
        return _TRUNCATED
    if present > stored or (codec == 0 and raw != stored):
        return _LENGTH_BAD
    if raw > min(_LZ4_MAX_RATIO * stored + 64, _MAX_PAYLOAD_BYTES):
        return _LENGTH_BAD
    if raw_bytes >= 0 and raw != raw_bytes:
        return _LENGTH_BAD
    return VERIFIED


def check_copy(
    objects: list[memoryview],
    into: list[memoryview],
    keys: bytes,
    layout: bytes,
    results: bytearray,
    threads: int,
) -> None:
    """`_pageio.check_copy`, on this thread: check each whole object against its key (16
    bytes each, joined in `keys`), `layout` and the size of into[i], and only then copy its
    payload into into[i] (results[i] = 1); else results[i] is the reason, or 0 for an intact
    lz4 object (the caller decompresses it)."""
    del threads  # (one thread: the GIL is held throughout)
    if len(into) != len(objects) or len(keys) != _KEY_BYTES * len(objects):
        raise ValueError("check_copy: one destination and 16 key bytes per object")
    targets = [memoryview(target) for target in into]
    if any(target.readonly for target in targets):
        raise TypeError("check_copy: every destination must be writable")
    for i, (obj, target) in enumerate(zip(objects, targets, strict=True)):
        key = keys[_KEY_BYTES * i : _KEY_BYTES * (i + 1)]
        code = check_object([obj], key, layout, len(target))
        if code == VERIFIED and obj[_CODEC_OFFSET] != 0:
            code = _UNCHECKED  # intact, but lz4
        elif code == VERIFIED:
            target[:] = obj[len(obj) - len(target) :]
        results[i] = code


def frame_headers(
    keys: bytes,
    plain: bytes,
    layout: bytes,
    pages: list[memoryview],
    headers: bytearray,
    threads: int,
) -> None:
    """`_pageio.frame_headers`, on this thread: into `headers` ((56 + len(layout)) bytes per
    page), the header of each uncompressed page: `plain` with the page's key and lengths, the
    checksum, the layout."""
    del threads
    size = _FIXED_BYTES + len(layout)
    room = len(keys) == _KEY_BYTES * len(pages) and len(headers) >= size * len(pages)
    if len(plain) != _PLAIN_BYTES or not room:
        raise ValueError(
            "frame_headers: plain must be 48 bytes, keys 16 bytes per page, headers 56 + "
            "len(layout) per page"
        )
    if len(layout) > _MAX_LAYOUT_BYTES:
        raise ValueError("frame_headers: the layout is at most 65535 bytes")
    out = memoryview(headers)
    for i, page in enumerate(pages):
        key = keys[_KEY_BYTES * i : _KEY_BYTES * (i + 1)]
        out[size * i : size * (i + 1)] = _plain_header(plain, key, layout, page)


def frame_copies(
    keys: bytes,
    plain: bytes,
    layout: bytes,
    pages: list[memoryview],
    out: bytearray | memoryview,
    offsets: list[int],
    threads: int,
) -> None:
    """`_pageio.frame_copies`, on this thread: into `out` at offsets[i], the whole object of
    each uncompressed page: its header (as `frame_headers` makes it), then a copy of the
    page, the checksum taken of the copy. Every object is checked to fit `out` first."""
    del threads
    if (
        len(plain) != _PLAIN_BYTES
        or len(keys) != _KEY_BYTES * len(pages)
        or len(offsets) != len(pages)
    ):
        raise ValueError(
            "frame_copies: plain must be 48 bytes, keys 16 bytes and one offset per page"
        )
    if len(layout) > _MAX_LAYOUT_BYTES:
        raise ValueError("frame_copies: the layout is at most 65535 bytes")
    target = memoryview(out)
    if target.readonly:
        raise TypeError("frame_copies: `out` must be writable")
    size = _FIXED_BYTES + len(layout)
    for i, (at, page) in enumerate(zip(offsets, pages, strict=True)):
        if at < 0 or at + size + len(page) > len(target):
            raise ValueError(f"frame_copies: object {i} does not fit the bytes of `out`")
    for i, (at, page) in enumerate(zip(offsets, pages, strict=True)):
        copy = target[at + size : at + size + len(page)]
        copy[:] = page
        key = keys[_KEY_BYTES * i : _KEY_BYTES * (i + 1)]
        target[at : at + size] = _plain_header(plain, key, layout, copy)


def _plain_header(plain: bytes, key: bytes, layout: bytes, page: memoryview) -> bytes:
    """The header of an uncompressed page: `plain` with its key and lengths, the checksum
    (of those 48 bytes, the layout and the page), the layout."""
    length = _LENGTH.pack(len(page))
    head = b"".join((plain[:16], key, length, length))
    return head + _LENGTH.pack(xxh3_64(head + layout, page)) + layout
