"""The check of every stored object a backend reads, and its decoding: `check_object`.

Where a page is verified: here, in `check_object`, for every read of every backend and of
the daemon (`verify_object`), and, for a batch, in the same check called by the file
reader (`pageio.read_stretches`) and by `decode_objects_into` (`check_copy`). The check
itself (magic, version, codec, key, layout, lengths, checksum) is `native.checks`: the C
extension's `check_parts`, or where the extension is not built `portable.check_object`,
which answers the same (the tests hold the two to one damage corpus). This module names the
reason it answers (`CorruptReason`), checks the MAC of a tenant secret (HMAC-SHA256) and
decompresses lz4. A read never returns bytes that failed a check, and a destination is
written only once its object checked out.
"""

from __future__ import annotations

import hmac
from collections.abc import Sequence

from .buffers import Buffer, byte_view, is_flat_bytes
from .native import checks
from .objects import (
    CHECKSUM_OFFSET,
    CODECS,
    FIXED_HEADER,
    HEADER_FIXED_BYTES,
    MAC_BYTES,
    SIGNED_VERSION,
    Compression,
    CorruptReason,
    MacKey,
    ObjectHeader,
    ObjectParts,
    as_parts,
    layout_bytes,
    start_mac,
)

# What the check answers (`_pageio.c` check_parts, `portable`): 1 verified, else the reason.
_VERIFIED = 1
_REASONS = {
    2: CorruptReason.MAGIC,
    3: CorruptReason.VERSION,
    4: CorruptReason.KEY,
    5: CorruptReason.LAYOUT,
    6: CorruptReason.LENGTH,
    7: CorruptReason.TRUNCATED,
    8: CorruptReason.CHECKSUM,
    9: CorruptReason.COMPRESSION,
}
_SPLIT_HEADER = 10  # the header straddles two parts: joined, and asked again
_MAX_PARTS = 1024


def reason_of(code: int) -> CorruptReason | None:
    """The reason a C check's answer `code` names (None: it checked out)."""
    return None if code == _VERIFIED else _REASONS[code]


def check_object(
    obj: ObjectParts,
    expected_key: bytes,
    expected_layout: bytes | None,
    *,
    raw_bytes: int | None = None,
    mac_key: MacKey | None = None,
) -> tuple[ObjectHeader, list[memoryview]] | CorruptReason:
    """The check every read of an object goes through, in every backend and the daemon:
    (its header, its stored payload as views into `obj`), or why it is refused.

    `obj` is the whole object, as one buffer or as parts in order (a header read apart from
    its payload, a Redis hash of chunks). The check (`checks.check_object`, the same one
    the file reader and `check_copy` apply to a batch) looks at the magic, version and
    flags, the codec, the key, the layout (unless `expected_layout` is None: the daemon
    stores every layout), the lengths against the header, the bytes present and `raw_bytes`
    (the size the reader expects, where it knows it), and the checksum; here, with a
    `mac_key`, the MAC (a version 1 object, without one, is then `FORGED`). Nothing is copied.
    """
    parts = as_parts(obj)
    if not parts:
        return CorruptReason.TRUNCATED
    if len(parts) > _MAX_PARTS:
        parts = [memoryview(b"".join(parts))]
    expected_raw = -1 if raw_bytes is None else raw_bytes
    code = checks.check_object(parts, expected_key, expected_layout, expected_raw)
    if code == _SPLIT_HEADER:  # (no backend here splits a header; tolerated)
        parts = [memoryview(b"".join(parts))]
        code = checks.check_object(parts, expected_key, expected_layout, expected_raw)
    if code != _VERIFIED:
        return _REASONS[code]
    header = _verified_header(parts[0])
    payload = [parts[0][header.header_bytes :], *parts[1:]]
    if mac_key is not None and not mac_matches(mac_key, header, parts[0], payload):
        return CorruptReason.FORGED
    return header, payload


def _verified_header(first: memoryview) -> ObjectHeader:
    """The header of an object the C check has passed (its fields are sound)."""
    _, version, codec, _, layout_len, key, stored, raw, checksum = FIXED_HEADER.unpack_from(first)
    layout_end = HEADER_FIXED_BYTES + layout_len
    layout = bytes(first[HEADER_FIXED_BYTES:layout_end])
    mac = bytes(first[layout_end : layout_end + MAC_BYTES]) if version == SIGNED_VERSION else None
    return ObjectHeader(key, layout, CODECS[codec], stored, raw, checksum, mac)


def mac_matches(
    mac_key: MacKey, header: ObjectHeader, first: Buffer, payload: Sequence[Buffer]
) -> bool:
    """Whether a checked object (its `header`, its buffer `first` holding the header, its
    stored `payload` parts) carries a MAC (version 2) and it is the one `mac_key` makes."""
    if header.mac is None:
        return False
    signer = start_mac(mac_key, memoryview(first)[:CHECKSUM_OFFSET], header.layout)
    for part in payload:
        signer.update(part)
    return hmac.compare_digest(signer.digest(), header.mac)


def verify_object(
    obj: ObjectParts, expected_key: bytes, *, mac_key: MacKey | None = None
) -> CorruptReason | None:
    """`check_object` for `expected_key` without knowing its layout (the daemon's check:
    without a `mac_key`, so objects with a MAC pass on their checksum alone). None when it
    is intact; the reader compares the layout when it decodes."""
    checked = check_object(obj, expected_key, None, mac_key=mac_key)
    return checked if isinstance(checked, CorruptReason) else None


def decode_object(
    blob: Buffer, expected_key: bytes, expected_layout: str, *, mac_key: MacKey | None = None
) -> memoryview | bytes | CorruptReason:
    """The payload of a verified object, or why it was refused.

    Uncompressed payloads come back as a memoryview into `blob` (no copy); lz4 payloads as the
    decompressed `bytes`.
    """
    checked = check_object(blob, expected_key, layout_bytes(expected_layout), mac_key=mac_key)
    if isinstance(checked, CorruptReason):
        return checked
    header, payload = checked
    if header.compression is Compression.NONE:
        return payload[0] if len(payload) == 1 else b"".join(payload)
    return _decompress(header, payload)


def verify_payload(
    obj: ObjectParts,
    expected_key: bytes,
    expected_layout: str | bytes,
    raw_bytes: int,
    *,
    mac_key: MacKey | None = None,
) -> list[memoryview] | CorruptReason:
    """Verify an object (`check_object`) and return its payload, `raw_bytes` long, as parts
    to copy out: views into `obj` (or the decompressed bytes, for lz4), nothing copied."""
    layout = (
        expected_layout if isinstance(expected_layout, bytes) else layout_bytes(expected_layout)
    )
    checked = check_object(obj, expected_key, layout, raw_bytes=raw_bytes, mac_key=mac_key)
    if isinstance(checked, CorruptReason):
        return checked
    header, payload = checked
    if header.compression is Compression.LZ4:
        raw = _decompress(header, payload)
        if isinstance(raw, CorruptReason):
            return raw
        payload = [memoryview(raw)]
    return payload


def decode_object_into(
    obj: ObjectParts,
    expected_key: bytes,
    expected_layout: str | bytes,
    into: Buffer,
    *,
    mac_key: MacKey | None = None,
) -> CorruptReason | None:
    """Verify an object and copy its payload into `into` (exactly the raw payload's size).

    Returns None on success. On any CorruptReason `into` is left untouched: the payload is
    checked before a byte is copied.
    """
    target = byte_view(into, writable=True, what="destination buffer")
    payload = verify_payload(obj, expected_key, expected_layout, len(target), mac_key=mac_key)
    if isinstance(payload, CorruptReason):
        return payload
    if len(payload) == 1:
        target[:] = payload[0]
        return None
    offset = 0
    for part in payload:
        target[offset : offset + len(part)] = part
        offset += len(part)
    return None


def decode_objects_into(
    objs: Sequence[ObjectParts],
    expected_keys: Sequence[bytes],
    expected_layout: bytes,
    intos: Sequence[memoryview],
    *,
    threads: int = 1,
    mac_key: MacKey | None = None,
) -> list[CorruptReason | None]:
    """`decode_object_into` for a batch: one None (verified and copied) or reason per object.

    Objects held as one buffer each (the common reply of a network backend, what memory://
    holds) are checked and copied in one call (`checks.check_copy`, the same check as
    `check_object`'s: with the C extension, on up to `threads` threads); objects in parts,
    intact lz4 ones and, with a `mac_key`, all of them (that check knows no MAC) go through
    `decode_object_into`. Either way a destination is written only once its object checked
    out.
    """
    results: list[CorruptReason | None | bool] = [False] * len(objs)  # False: not decoded yet
    buffers = _one_buffers(objs) if mac_key is None else []
    whole = [i for i, buf in enumerate(buffers) if buf is not None]
    if whole:
        every = len(whole) == len(objs)  # (the common case: no lists to pick from)
        codes = bytearray(len(whole))
        checks.check_copy(
            buffers if every else [buffers[i] for i in whole],
            list(intos) if every else [intos[i] for i in whole],
            b"".join(expected_keys if every else [expected_keys[i] for i in whole]),
            expected_layout,
            codes,
            threads,
        )
        if every and codes.count(_VERIFIED) == len(codes):
            return [None] * len(codes)  # the common case: every one verified and copied
        for i, code in zip(whole, codes, strict=True):
            if code:  # (0: intact but lz4, decoded below)
                results[i] = reason_of(code)
    for i, result in enumerate(results):
        if result is False:
            results[i] = decode_object_into(
                objs[i], expected_keys[i], expected_layout, intos[i], mac_key=mac_key
            )
    return results


def _one_buffers(objs: Sequence[ObjectParts]) -> list[memoryview | None]:
    """`_one_buffer` of each object, without a call per object where each is a flat byte
    view already (a network backend's replies in its arena)."""
    if all(is_flat_bytes(obj) for obj in objs):
        return list(objs)
    return [_one_buffer(obj) for obj in objs]


def _one_buffer(obj: ObjectParts) -> memoryview | None:
    """The object as one flat byte view where it is one buffer (alone, or the only part)
    that C can read as it is; else None."""
    part = obj if isinstance(obj, (bytes, bytearray, memoryview)) else None
    if part is None and len(obj) == 1:
        part = obj[0]
    if isinstance(part, (bytes, bytearray)):
        return memoryview(part)
    if isinstance(part, memoryview) and part.c_contiguous:
        return part.cast("B") if part.format != "B" or part.ndim != 1 else part
    return None


def _decompress(header: ObjectHeader, payload: list[memoryview]) -> bytes | CorruptReason:
    import lz4.block

    packed = payload[0] if len(payload) == 1 else b"".join(payload)
    try:
        raw = lz4.block.decompress(packed, uncompressed_size=header.raw_bytes)
    except lz4.block.LZ4BlockError:
        return CorruptReason.COMPRESSION
    if len(raw) != header.raw_bytes:
        return CorruptReason.COMPRESSION
    return raw
