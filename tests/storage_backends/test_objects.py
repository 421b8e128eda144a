"""The L3 object format: round trips, every refusal reason, and no corruption ever accepted."""

from __future__ import annotations

import os
import struct

import hypothesis.strategies as st
import pytest
import xxhash
from hypothesis import given, settings

from storage_backends.buffers import page_views, writable_views
from storage_backends.objects import (
    HEADER_FIXED_BYTES,
    MAGIC,
    Compression,
    CorruptReason,
    encode_object,
    frame_object,
    frame_objects_into,
    header_size,
    join_parts,
    layout_bytes,
    parse_header,
    split_object,
)
from storage_backends.verify import (
    decode_object,
    decode_object_into,
    decode_objects_into,
    verify_object,
)

KEY = bytes(range(16))
LAYOUT = "mha;layers=32;page=64;kv_heads=8;head_dim=128;dtype=bfloat16"


def test_header_fields_are_where_the_format_says():
    payload = os.urandom(300)
    blob = encode_object(KEY, LAYOUT, payload)
    layout = LAYOUT.encode()
    assert len(blob) == HEADER_FIXED_BYTES + len(layout) + len(payload) == header_size(LAYOUT) + 300
    magic, version, codec, flags, layout_len = struct.unpack_from("<4sHBBH", blob)
    assert (magic, version, codec, flags, layout_len) == (MAGIC, 1, 0, 0, len(layout))
    assert blob[10:16] == bytes(6)
    assert blob[16:32] == KEY
    assert struct.unpack_from("<QQQ", blob, 32)[:2] == (300, 300)
    expected = xxhash.xxh3_64_intdigest(blob[:48] + layout + payload)
    assert struct.unpack_from("<Q", blob, 48)[0] == expected
    assert blob[56 : 56 + len(layout)] == layout
    assert blob[-300:] == payload


def test_round_trip_returns_a_view_without_copying():
    payload = os.urandom(1000)
    blob = encode_object(KEY, LAYOUT, payload)
    out = decode_object(blob, KEY, LAYOUT)
    assert isinstance(out, memoryview) and out.obj is blob
    assert bytes(out) == payload


def test_frame_object_keeps_the_callers_buffer():
    page = bytearray(os.urandom(512))
    framed = frame_object(KEY, LAYOUT, page)
    assert framed.payload.obj is page  # no copy on the write path
    assert framed.nbytes == header_size(LAYOUT) + 512
    assert join_parts(framed) == encode_object(KEY, LAYOUT, page)


def test_frame_objects_into_writes_whole_objects_that_decode():
    pages = [memoryview(os.urandom(n)) for n in (0, 300, 70_000)]
    keys = [bytes([i]) * 16 for i in range(len(pages))]
    size = header_size(LAYOUT)
    offsets = [0, size + 8, 2 * size + 320]  # (the first, empty page's object is its header)
    out = memoryview(bytearray(offsets[-1] + size + len(pages[-1])))
    frame_objects_into(keys, LAYOUT, pages, out, offsets)
    for key, page, at in zip(keys, pages, offsets, strict=True):
        obj = out[at : at + size + len(page)]
        assert bytes(obj) == encode_object(key, LAYOUT, page)
        assert bytes(decode_object(obj, key, LAYOUT)) == page
    with pytest.raises(ValueError, match="page key"):
        frame_objects_into([b"short", *keys[1:]], LAYOUT, pages, out, offsets)
    with pytest.raises(ValueError, match="2 keys for 3 pages"):
        frame_objects_into(keys[:2], LAYOUT, pages, out, offsets)


def test_page_views_take_any_buffer_and_name_a_bad_one():
    flat = memoryview(bytearray(8))
    grid = memoryview(bytearray(8)).cast("B", (2, 4))
    views = page_views([b"ab", flat, bytearray(b"cd"), grid, [b"x", b"y"]])
    assert views[1] is flat and bytes(views[0]) == b"ab" and bytes(views[2]) == b"cd"
    assert views[3].ndim == 1 and len(views[3]) == 8
    assert [bytes(piece) for piece in views[4]] == [b"x", b"y"]
    assert writable_views([flat])[0] is flat
    with pytest.raises(ValueError, match=r"pages\[1\] must be C-contiguous"):
        page_views([b"ok", memoryview(bytearray(8))[::2]])
    with pytest.raises(ValueError, match=r"into\[1\] must be writable"):
        writable_views([bytearray(2), b"read-only"])
    with pytest.raises(ValueError, match=r"into\[0\] must be writable"):
        writable_views([memoryview(b"read-only")])


def test_decode_objects_into_answers_each_object_of_a_batch():
    """Views into one buffer (a network backend's arena) checked and copied in one call: all
    verified, or each answered alone (damaged, another key's, lz4 decoded, in parts)."""
    pages = [os.urandom(4096) for _ in range(4)] + [bytes(4096)]
    keys = [bytes([i]) * 16 for i in range(5)]
    blobs = [encode_object(k, LAYOUT, p) for k, p in zip(keys[:4], pages[:4], strict=True)]
    blobs.append(encode_object(keys[4], LAYOUT, pages[4], "lz4"))
    arena = memoryview(bytearray(b"".join(blobs)))
    starts = [sum(map(len, blobs[:i])) for i in range(len(blobs))]
    objs = [arena[at : at + len(blob)] for at, blob in zip(starts, blobs, strict=True)]
    layout = layout_bytes(LAYOUT)

    def decode(objects, expected_keys):
        into = [memoryview(bytearray(4096)) for _ in objects]
        return decode_objects_into(objects, expected_keys, layout, into), into

    results, into = decode(objs[:4], keys[:4])
    assert results == [None] * 4 and [bytes(b) for b in into] == pages[:4]
    arena[starts[1] + len(blobs[1]) - 1] ^= 1  # a flipped byte in the second payload
    parts = [objs[3][:100], objs[3][100:]]
    results, into = decode(
        [objs[0], objs[1], objs[2], parts, objs[4]], [*keys[:2], bytes(16), *keys[3:]]
    )
    assert results == [None, CorruptReason.CHECKSUM, CorruptReason.KEY, None, None]
    assert bytes(into[1]) == bytes(into[2]) == bytes(4096)  # left as they were
    assert [bytes(into[i]) for i in (0, 3, 4)] == [pages[0], pages[3], pages[4]]


def test_decode_into_accepts_parts_and_fills_the_buffer():
    payload = os.urandom(5000)
    blob = encode_object(KEY, LAYOUT, payload)
    cut = header_size(LAYOUT)
    parts = [blob[:cut], blob[cut : cut + 1000], blob[cut + 1000 :]]
    into = bytearray(5000)
    assert decode_object_into(parts, KEY, LAYOUT, into) is None
    assert into == payload


def test_lz4_only_when_smaller():
    compressible = b"\x01\x02" * 4096
    packed = encode_object(KEY, LAYOUT, compressible, "lz4")
    assert parse_header(packed).compression is Compression.LZ4
    assert len(packed) < len(compressible) // 10
    assert decode_object(packed, KEY, LAYOUT) == compressible
    noise = os.urandom(4096)
    kept_raw = encode_object(KEY, LAYOUT, noise, "lz4")
    assert parse_header(kept_raw).compression is Compression.NONE
    assert kept_raw == encode_object(KEY, LAYOUT, noise)


def _flip(blob: bytes, offset: int, bit: int = 0) -> bytes:
    out = bytearray(blob)
    out[offset] ^= 1 << bit
    return bytes(out)


def test_each_refusal_names_its_reason():
    payload = os.urandom(2000)
    blob = encode_object(KEY, LAYOUT, payload)
    other_key = bytes(16)
    cases = {
        CorruptReason.MAGIC: b"GARBAGE!" * 20,
        CorruptReason.VERSION: blob[:4] + b"\x03\x00" + blob[6:],
        CorruptReason.KEY: encode_object(other_key, LAYOUT, payload),
        CorruptReason.LAYOUT: encode_object(KEY, LAYOUT + ";x=1", payload),
        CorruptReason.TRUNCATED: blob[:-1],
        CorruptReason.LENGTH: blob + b"\0",
        CorruptReason.CHECKSUM: _flip(blob, len(blob) - 1),
        CorruptReason.COMPRESSION: blob[:6] + b"\x07" + blob[7:],
    }
    for reason, bad in cases.items():
        assert decode_object(bad, KEY, LAYOUT) is reason, reason
        into = bytearray(b"\xa5" * 2000)
        assert decode_object_into(bad, KEY, LAYOUT, into) is reason, reason
        assert into == b"\xa5" * 2000  # untouched on refusal
    assert decode_object(b"", KEY, LAYOUT) is CorruptReason.TRUNCATED
    assert decode_object(MAGIC + b"\x01", KEY, LAYOUT) is CorruptReason.TRUNCATED


def test_objects_of_every_shape_decode_or_name_their_damage():
    """decode_object_into: whole objects, one-part and two-part replies, lz4, and every kind
    of damage; a refused page is left untouched."""
    keys = [bytes([i]) * 16 for i in range(9)]
    payloads = [os.urandom(3000) for _ in keys]
    blobs = [encode_object(k, LAYOUT, p) for k, p in zip(keys, payloads, strict=True)]
    packed = encode_object(keys[3], LAYOUT, b"z" * 3000, compression="lz4")
    objs = [
        blobs[0],  # whole bytes
        [blobs[1]],  # the one part of a reply
        [blobs[2][:100], memoryview(blobs[2])[100:]],  # two parts
        packed,  # lz4
        _flip(blobs[4], len(blobs[4]) - 1),  # checksum
        encode_object(keys[0], LAYOUT, payloads[5]),  # another key's page
        encode_object(keys[6], LAYOUT + ";x=1", payloads[6]),  # another layout
        blobs[7][:-1],  # truncated
        bytearray(blobs[8]),
    ]
    want = [None, None, None, None, CorruptReason.CHECKSUM, CorruptReason.KEY]
    want += [CorruptReason.LAYOUT, CorruptReason.TRUNCATED, None]
    pool = bytearray(b"\xa5" * 3000 * len(keys))
    intos = [memoryview(pool)[3000 * i : 3000 * (i + 1)] for i in range(len(keys))]
    got = [
        decode_object_into(obj, key, layout_bytes(LAYOUT), into)
        for obj, key, into in zip(objs, keys, intos, strict=True)
    ]
    assert got == want
    expected = [*payloads[:3], b"z" * 3000, *[b"\xa5" * 3000] * 4, payloads[8]]
    assert [bytes(into) for into in intos] == expected


def test_verify_object_checks_all_but_the_layout():
    blob = encode_object(KEY, "some other layout", b"x" * 100)
    assert verify_object(blob, KEY) is None
    assert verify_object(blob, bytes(16)) is CorruptReason.KEY
    assert verify_object(_flip(blob, 60), KEY) is CorruptReason.CHECKSUM  # layout byte
    assert verify_object(blob[:-3], KEY) is CorruptReason.TRUNCATED


def test_a_destination_of_another_size_is_a_length_miss():
    blob = encode_object(KEY, LAYOUT, b"y" * 64)
    assert decode_object_into(blob, KEY, LAYOUT, bytearray(63)) is CorruptReason.LENGTH
    assert decode_object_into(blob, KEY, LAYOUT, bytearray(65)) is CorruptReason.LENGTH


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="16 bytes, got 15 bytes"):
        encode_object(KEY[:15], LAYOUT, b"x")
    with pytest.raises(ValueError, match="compression must be 'none' or 'lz4'"):
        encode_object(KEY, LAYOUT, b"x", "zstd")
    with pytest.raises(ValueError, match="layout descriptor must be a str"):
        encode_object(KEY, b"bytes", b"x")
    with pytest.raises(ValueError, match="must be writable"):
        decode_object_into(encode_object(KEY, LAYOUT, b"x"), KEY, LAYOUT, b"x")


def test_split_object_is_views_into_the_blob():
    blob = encode_object(KEY, LAYOUT, b"z" * 10)
    header, payload = split_object(blob)
    assert header.obj is blob and payload.obj is blob
    assert bytes(payload) == b"z" * 10
    assert split_object(b"nope") is CorruptReason.MAGIC


@settings(max_examples=200, deadline=None)
@given(
    payload=st.binary(min_size=0, max_size=3000),
    layout=st.text(max_size=40),
    key=st.binary(min_size=16, max_size=16),
    compression=st.sampled_from(["none", "lz4"]),
)
def test_property_round_trip(payload, layout, key, compression):
    blob = encode_object(key, layout, payload, compression)
    assert bytes(decode_object(blob, key, layout)) == payload
    into = bytearray(len(payload))
    assert decode_object_into(blob, key, layout, into) is None
    assert into == payload
    assert verify_object(blob, key) is None


@settings(max_examples=300, deadline=None)
@given(
    payload=st.binary(min_size=1, max_size=2000),
    compression=st.sampled_from(["none", "lz4"]),
    data=st.data(),
)
def test_property_any_flipped_bit_is_refused(payload, compression, data):
    """The checksum covers every byte but itself, so one flipped bit is never accepted."""
    blob = encode_object(KEY, LAYOUT, payload, compression)
    offset = data.draw(st.integers(0, len(blob) - 1), label="offset")
    bit = data.draw(st.integers(0, 7), label="bit")
    bad = _flip(blob, offset, bit)
    assert isinstance(decode_object(bad, KEY, LAYOUT), CorruptReason)
    assert isinstance(verify_object(bad, KEY), CorruptReason)


@settings(max_examples=100, deadline=None)
@given(payload=st.binary(min_size=1, max_size=2000), cut=st.integers(0, 10_000))
def test_property_any_truncation_is_refused(payload, cut):
    blob = encode_object(KEY, LAYOUT, payload)
    short = blob[: cut % len(blob)]
    assert isinstance(decode_object(short, KEY, LAYOUT), CorruptReason)
