"""The cache-server protocol: generated code current, the hand-written page codec equal to
protobuf's on the wire, and rendezvous hashing stable."""

from __future__ import annotations

import collections
import os
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from storage_backends.objects import CorruptReason
from storage_backends.pieces import (
    MAX_OBJECT_BYTES,
    ObjectAssembly,
    OutPiece,
    WireError,
    decode_get_response,
    decode_put_request,
    encode_get_response,
    encode_put_request,
    split_into_messages,
)
from storage_backends.proto import kvstore_pb2 as pb
from storage_backends.proto import regenerate
from storage_backends.rendezvous import Rendezvous

# -- generated code ---------------------------------------------------------------------------

_VERSION_LINES = re.compile(
    r"^(# Protobuf Python Version:.*|GRPC_GENERATED_VERSION = .*|\s*\d+,\s*$)", re.M
)


def test_generated_code_is_current(tmp_path):
    """Regenerate from kvstore.proto; the checked-in files must match (up to the generator's
    version stamps) and describe the same schema byte for byte."""
    fresh = regenerate.generate(tmp_path)
    for path in fresh:
        checked_in = regenerate.PROTO.with_name(path.name)
        assert checked_in.exists(), f"{checked_in.name} is not checked in"
        want = _VERSION_LINES.sub("", path.read_text())
        got = _VERSION_LINES.sub("", checked_in.read_text())
        assert got == want, (
            f"{checked_in.name} is stale: run python -m storage_backends.proto.regenerate"
        )
    from google.protobuf import descriptor_pb2

    compiled = descriptor_pb2.FileDescriptorProto()
    pb.DESCRIPTOR.CopyToProto(compiled)
    assert compiled.package == "hicache.v1"
    assert [m.name for m in compiled.service[0].method] == [
        "BatchExists",
        "BatchGet",
        "BatchPut",
        "Delete",
        "Stats",
    ]
    streaming = {
        m.name: (m.client_streaming, m.server_streaming) for m in compiled.service[0].method
    }
    assert streaming["BatchGet"] == (False, True)
    assert streaming["BatchPut"] == (True, False)


# -- the page codec ---------------------------------------------------------------------------

keys = st.binary(min_size=0, max_size=20)
pieces = st.builds(
    lambda index, key, object_bytes, offset, data: OutPiece(
        index, key, object_bytes, offset, [data[: len(data) // 2], data[len(data) // 2 :]]
    ),
    st.integers(0, 2**32 - 1),
    keys,
    st.integers(0, 2**64 - 1),
    st.integers(0, 2**64 - 1),
    st.binary(max_size=300),
)


def _as_tuple(piece) -> tuple:
    data = bytes(piece.data) if hasattr(piece, "data") else b"".join(piece.parts)
    return (piece.index, bytes(piece.key), piece.object_bytes, piece.offset, data)


@settings(max_examples=200, deadline=None)
@given(st.lists(pieces, max_size=5), st.lists(st.integers(0, 2**32 - 1), max_size=5))
def test_get_response_matches_protobuf_both_ways(out, missing):
    wire = encode_get_response(out, missing)
    reference = pb.BatchGetResponse.FromString(wire)
    assert [_as_tuple(p) for p in reference.pieces] == [_as_tuple(p) for p in out]
    assert list(reference.missing) == missing
    decoded, decoded_missing = decode_get_response(reference.SerializeToString())
    assert [_as_tuple(p) for p in decoded] == [_as_tuple(p) for p in out]
    assert decoded_missing == missing


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=20), st.lists(pieces, max_size=5))
def test_put_request_matches_protobuf_both_ways(namespace, out):
    wire = encode_put_request(namespace, out)
    reference = pb.BatchPutRequest.FromString(wire)
    assert reference.namespace == namespace
    assert [_as_tuple(p) for p in reference.pieces] == [_as_tuple(p) for p in out]
    assert decode_put_request(reference.SerializeToString())[0] == namespace


def test_decoding_skips_unknown_fields_and_takes_the_last_scalar():
    piece = pb.Piece(index=3, key=b"k" * 16, object_bytes=5, offset=0, data=b"hello")
    wire = bytearray(pb.BatchGetResponse(pieces=[piece]).SerializeToString())
    wire += b"\x98\x06\x07"  # field 99 (varint) = 7: unknown, skipped
    wire += bytes(pb.BatchGetResponse(missing=[4, 5]).SerializeToString())
    decoded, missing = decode_get_response(bytes(wire))
    assert [_as_tuple(p) for p in decoded] == [(3, b"k" * 16, 5, 0, b"hello")]
    assert missing == [4, 5]


@pytest.mark.parametrize(
    "wire, message",
    [
        (b"\x0a\x05abc", "claims 5 bytes, only 3 remain"),
        (b"\x0a", "truncated varint"),
        (b"\x08" + b"\xff" * 11, "longer than 10 bytes"),
        (b"\x0b", "unsupported wire type 3"),
        (b"\x00\x01", "field number 0"),
        (b"\x09\x01\x02", "truncated fixed-width"),
        (b"\x0a\x02\x08\x80", "truncated varint"),
        (b"\x0a\x02\x12\x05", "claims 5 bytes, only 0 remain"),
    ],
)
def test_malformed_messages_raise_wire_errors_that_say_where(wire, message):
    with pytest.raises(WireError, match=message):
        decode_get_response(wire)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_any_bytes_decode_or_raise_wire_error(wire):
    for decode in (decode_get_response, decode_put_request):
        try:
            decode(wire)
        except WireError:
            pass


@pytest.mark.parametrize("limit", [64 << 10, 100_000, 1 << 20])
def test_split_into_messages_respects_the_limit_and_keeps_every_byte(limit):
    sizes = [0, 1, 5000, 70_000, 300_000, 2 << 20, 17]
    objects = [(i, bytes([i]) * 16, [os.urandom(56), os.urandom(n)]) for i, n in enumerate(sizes)]
    got: dict[int, bytearray] = collections.defaultdict(bytearray)
    num_messages = 0
    for batch in split_into_messages(objects, limit):
        wire = encode_get_response(batch)
        assert len(wire) <= limit
        num_messages += 1
        for piece in decode_get_response(wire)[0]:
            assert piece.offset == len(got[piece.index])
            assert piece.object_bytes == 56 + sizes[piece.index]
            got[piece.index] += piece.data
    assert {i: bytes(v) for i, v in got.items()} == {i: b"".join(p) for i, _, p in objects}
    assert num_messages <= len(sizes) + sum(56 + n for n in sizes) // (limit - 200)


def test_small_objects_share_messages_evenly_and_one_that_fits_is_never_cut():
    objects = [(i, bytes(16), [bytes(300 << 10)]) for i in range(4)]
    batches = list(split_into_messages(objects, 1 << 20))
    assert [len(b) for b in batches] == [2, 2]  # not 3 + 1
    assert all(p.offset == 0 for b in batches for p in b)
    pages = [(i, bytes(16), [bytes(100), bytes(256 << 10)]) for i in range(32)]
    batches = list(split_into_messages(pages, 4 << 20))
    assert [len(b) for b in batches] == [11, 11, 10]  # not 15 + 15 + 2
    assert [p.index for b in batches for p in b] == list(range(32))


# -- rendezvous hashing -----------------------------------------------------------------------


def test_rendezvous_spreads_keys_and_moves_few_when_a_server_goes():
    keys = [os.urandom(16) for _ in range(4000)]
    three = Rendezvous(["a:1", "b:1", "c:1"])
    owners = [three.servers[three.owner(k)] for k in keys]
    counts = collections.Counter(owners)
    assert all(1100 < counts[s] < 1600 for s in three.servers), counts
    two = Rendezvous(["a:1", "c:1"])  # b leaves: only b's keys move
    moved = sum(1 for k, o in zip(keys, owners, strict=True) if two.servers[two.owner(k)] != o)
    assert moved == counts["b:1"]
    # The order servers are listed in does not matter.
    shuffled = Rendezvous(["c:1", "a:1", "b:1"])
    assert all(shuffled.servers[shuffled.owner(k)] == o for k, o in zip(keys, owners, strict=True))


def test_rendezvous_split_keeps_key_order_per_server():
    ring = Rendezvous(["a:1", "b:1"])
    keys = [os.urandom(16) for _ in range(50)]
    groups = ring.split(keys)
    assert sorted(p for ps in groups.values() for p in ps) == list(range(50))
    assert all(ps == sorted(ps) for ps in groups.values())
    with pytest.raises(ValueError, match="listed twice"):
        Rendezvous(["a:1", "a:1"])


def test_an_object_claiming_more_than_a_page_can_be_is_refused_at_its_first_piece():
    """A server's `object_bytes` is bounded before its pieces are held for it."""
    key = b"k" * 16
    settled = {}
    assembly = ObjectAssembly([key], settled.__setitem__)
    piece = OutPiece(0, key, MAX_OBJECT_BYTES + 1, 0, [b"x" * 100])
    assembly.add(encode_get_response([piece]))
    assert settled == {0: CorruptReason.LENGTH} and not assembly.partial
