"""Bad input to a real daemon: each named case gets its status and message, random and mutated
requests never get anything but a refusal or an answer, and the daemon keeps serving."""

from __future__ import annotations

import os

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from storage_backends import encode_object
from storage_backends.pieces import OutPiece, encode_put_request
from storage_backends.proto import kvstore_pb2 as pb
from storage_backends.protocol import method_path

LAYOUT = "test;layout"
Code = grpc.StatusCode
REFUSALS = {Code.INVALID_ARGUMENT, Code.NOT_FOUND, Code.RESOURCE_EXHAUSTED}


@pytest.fixture(scope="module")
def channel(shared_daemon):
    with grpc.insecure_channel(
        shared_daemon.address, options=[("grpc.max_send_message_length", 64 << 20)]
    ) as channel:
        yield channel


def _unary(channel, name: str, raw: bytes) -> bytes:
    return channel.unary_unary(method_path(name))(raw, timeout=10)


def _put(channel, messages: list[bytes]) -> pb.BatchPutResponse:
    call = channel.stream_unary(method_path("BatchPut"))
    return pb.BatchPutResponse.FromString(call(iter(messages), timeout=10))


def _get(channel, request: pb.BatchGetRequest) -> list[bytes]:
    call = channel.unary_stream(method_path("BatchGet"))
    return list(call(request.SerializeToString(), timeout=10))


def _page(key: bytes, nbytes: int = 4096) -> bytes:
    return encode_object(key, LAYOUT, os.urandom(nbytes))


def _whole(index: int, key: bytes, blob: bytes) -> OutPiece:
    return OutPiece(index, key, len(blob), 0, [blob])


def _refused(call, code: grpc.StatusCode, message: str) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        call()
    assert caught.value.code() == code, caught.value.details()
    assert message in caught.value.details()


def _assert_healthy(channel) -> None:
    """The daemon still stores and serves a page."""
    key = os.urandom(16)
    blob = _page(key)
    reply = _put(channel, [encode_put_request("default", [_whole(0, key, blob)])])
    assert list(reply.statuses) == [pb.PUT_STATUS_STORED]
    request = pb.BatchExistsRequest(keys=[key])
    exists = pb.BatchExistsResponse.FromString(
        _unary(channel, "BatchExists", request.SerializeToString())
    )
    assert exists.num_present == 1


KEY = b"k" * 16

NAMED_CASES = {
    "malformed message": (
        lambda ch: _unary(ch, "BatchExists", b"\xff\xff\xff"),
        Code.INVALID_ARGUMENT,
        "malformed BatchExistsRequest",
    ),
    "key of the wrong size": (
        lambda ch: _unary(
            ch, "BatchExists", pb.BatchExistsRequest(keys=[KEY, b"short"]).SerializeToString()
        ),
        Code.INVALID_ARGUMENT,
        "keys[1] is 5 bytes; page keys are 16 bytes",
    ),
    "unknown namespace": (
        lambda ch: _get(ch, pb.BatchGetRequest(namespace="nope", keys=[KEY])),
        Code.NOT_FOUND,
        "unknown namespace 'nope'; this server has: a, b, default",
    ),
    "too many keys": (
        lambda ch: _unary(ch, "Delete", pb.DeleteRequest(keys=[KEY] * 16385).SerializeToString()),
        Code.RESOURCE_EXHAUSTED,
        "Delete of 16385 keys; this server takes at most 16384",
    ),
    "message over --max-message-bytes": (
        lambda ch: _put(ch, [encode_put_request("", [_whole(0, KEY, _page(KEY, 2 << 20))])]),
        Code.RESOURCE_EXHAUSTED,
        "larger than max",
    ),
    "object over the size limit": (
        lambda ch: _put(ch, [encode_put_request("", [OutPiece(0, KEY, 1 << 40, 0, [b"x"])])]),
        Code.RESOURCE_EXHAUSTED,
        "an object of 1099511627776 bytes is over this server's limit",
    ),
    "stream ends inside a page": (
        lambda ch: _put(ch, [encode_put_request("", [OutPiece(0, KEY, 100, 0, [b"x" * 50])])]),
        Code.INVALID_ARGUMENT,
        "the stream ended inside page 0, after 50 of 100 bytes",
    ),
    "pieces past the object's size": (
        lambda ch: _put(ch, [encode_put_request("", [OutPiece(0, KEY, 10, 0, [b"x" * 50])])]),
        Code.INVALID_ARGUMENT,
        "pieces add up to more than its object_bytes 10",
    ),
    "pages out of order": (
        lambda ch: _put(ch, [encode_put_request("", [OutPiece(1, KEY, 10, 0, [b"x" * 10])])]),
        Code.INVALID_ARGUMENT,
        "a piece for page 1 arrived where page 0 should start",
    ),
    "piece at the wrong offset": (
        lambda ch: _put(
            ch,
            [
                encode_put_request("", [OutPiece(0, KEY, 20, 0, [b"x" * 10])]),
                encode_put_request("", [OutPiece(0, KEY, 20, 5, [b"x" * 10])]),
            ],
        ),
        Code.INVALID_ARGUMENT,
        "page 0: a piece at offset 5, expected 10",
    ),
    "namespace changes mid-stream": (
        lambda ch: _put(ch, [encode_put_request("a", []), encode_put_request("b", [])]),
        Code.INVALID_ARGUMENT,
        "message 1 names namespace 'b'; this call is for 'a'",
    ),
    "malformed put message": (
        lambda ch: _put(ch, [b"\x12\xff"]),
        Code.INVALID_ARGUMENT,
        "message 0: truncated varint",
    ),
    "put key of the wrong size": (
        lambda ch: _put(ch, [encode_put_request("", [OutPiece(0, b"abc", 3, 0, [b"xyz"])])]),
        Code.INVALID_ARGUMENT,
        "page 0: key is 3 bytes",
    ),
    "response limit below the minimum": (
        lambda ch: _get(ch, pb.BatchGetRequest(keys=[KEY], max_message_bytes=100)),
        Code.INVALID_ARGUMENT,
        "max_message_bytes 100 is below the minimum",
    ),
}


@pytest.mark.parametrize("case", list(NAMED_CASES))
def test_each_bad_request_gets_a_status_that_names_it(channel, case):
    call, code, message = NAMED_CASES[case]
    _refused(lambda: call(channel), code, message)
    _assert_healthy(channel)


def test_a_corrupt_page_is_refused_alone(channel):
    keys = [os.urandom(16) for _ in range(3)]
    blobs = [_page(k) for k in keys]
    damaged = bytearray(blobs[1])
    damaged[-1] ^= 1
    blobs[1] = bytes(damaged)
    foreign = _page(os.urandom(16))  # a good object, under the wrong key
    keys.append(os.urandom(16))
    blobs.append(foreign)
    pieces = [_whole(i, k, b) for i, (k, b) in enumerate(zip(keys, blobs, strict=True))]
    reply = _put(channel, [encode_put_request("", pieces)])
    assert list(reply.statuses) == [
        pb.PUT_STATUS_STORED,
        pb.PUT_STATUS_CORRUPT,
        pb.PUT_STATUS_STORED,
        pb.PUT_STATUS_CORRUPT,
    ]
    assert list(reply.reasons) == [
        "",
        "the object failed its checksum check",
        "",
        "the object failed its key check",
    ]
    exists = pb.BatchExistsRequest(keys=keys[2:3])
    assert (
        pb.BatchExistsResponse.FromString(
            _unary(channel, "BatchExists", exists.SerializeToString())
        ).num_present
        == 1
    )


def test_namespaces_are_isolated_and_quotas_hold(channel):
    key = os.urandom(16)
    blob = _page(key)
    assert list(_put(channel, [encode_put_request("a", [_whole(0, key, blob)])]).statuses) == [
        pb.PUT_STATUS_STORED
    ]
    for namespace, present in (("a", 1), ("b", 0), ("default", 0), ("", 0)):
        request = pb.BatchExistsRequest(namespace=namespace, keys=[key])
        reply = pb.BatchExistsResponse.FromString(
            _unary(channel, "BatchExists", request.SerializeToString())
        )
        assert reply.num_present == present, namespace
    # b holds 1 MiB: a 2 MiB object is refused there, smaller ones evict b's own pages only.
    big_key = os.urandom(16)
    big = encode_object(big_key, LAYOUT, os.urandom(900 << 10))
    pieces = [OutPiece(0, big_key, len(big), 0, [big[: 600 << 10]])]
    rest = [OutPiece(0, big_key, len(big), 600 << 10, [big[600 << 10 :]])]
    reply = _put(channel, [encode_put_request("b", pieces), encode_put_request("", rest)])
    assert list(reply.statuses) == [pb.PUT_STATUS_STORED]
    small = [os.urandom(16) for _ in range(3)]
    messages = [
        encode_put_request("b", [_whole(i, k, _page(k, 300 << 10)) for i, k in enumerate(small)])
    ]
    assert list(_put(channel, messages).statuses) == [pb.PUT_STATUS_STORED] * 3
    stats = pb.StatsResponse.FromString(
        _unary(channel, "Stats", pb.StatsRequest(namespace="b").SerializeToString())
    )
    (b_stats,) = stats.namespaces
    assert b_stats.capacity_bytes == 1 << 20
    assert b_stats.stored_bytes <= 1 << 20 and b_stats.num_evictions >= 1
    request = pb.BatchExistsRequest(namespace="a", keys=[key])
    assert (
        pb.BatchExistsResponse.FromString(
            _unary(channel, "BatchExists", request.SerializeToString())
        ).num_present
        == 1
    )  # b's evictions never touch a


def test_a_get_streams_pieces_that_rebuild_each_object(channel):
    keys = [os.urandom(16) for _ in range(4)]
    blobs = [_page(k, 700 << 10) for k in keys]  # 4 x 700 KiB through 1 MiB messages
    for key, blob in zip(keys, blobs, strict=True):
        _put(channel, [encode_put_request("", [_whole(0, key, blob)])])
    missing_key = os.urandom(16)
    messages = _get(
        channel, pb.BatchGetRequest(keys=[*keys, missing_key], max_message_bytes=256 << 10)
    )
    rebuilt: dict[int, bytearray] = {}
    missing: list[int] = []
    for raw in messages:
        assert len(raw) <= 256 << 10
        reply = pb.BatchGetResponse.FromString(raw)
        missing += reply.missing
        for piece in reply.pieces:
            assert piece.key == keys[piece.index]
            part = rebuilt.setdefault(piece.index, bytearray())
            assert piece.offset == len(part)
            part += piece.data
    assert missing == [4]
    assert [bytes(rebuilt[i]) for i in range(4)] == blobs


# -- fuzzing ----------------------------------------------------------------------------------


def _valid_put() -> bytes:
    key = b"f" * 16
    return encode_put_request("default", [_whole(0, key, _page(key, 256))])


VALID = {
    "BatchExists": pb.BatchExistsRequest(namespace="a", keys=[KEY, KEY]).SerializeToString(),
    "BatchGet": pb.BatchGetRequest(keys=[KEY], max_message_bytes=1 << 20).SerializeToString(),
    "Delete": pb.DeleteRequest(namespace="b", keys=[KEY]).SerializeToString(),
    "Stats": pb.StatsRequest(namespace="a").SerializeToString(),
    "BatchPut": _valid_put(),
}


def _mutate(data: bytes, flips: list[tuple[int, int]], cut: int | None) -> bytes:
    out = bytearray(data)
    for position, bit in flips:
        if out:
            out[position % len(out)] ^= 1 << bit
    return bytes(out[:cut] if cut is not None else out)


def _call_raw(channel, method: str, payload: bytes) -> None:
    if method == "BatchPut":
        channel.stream_unary(method_path(method))(iter([payload, payload[:7]]), timeout=10)
    elif method == "BatchGet":
        list(channel.unary_stream(method_path(method))(payload, timeout=10))
    else:
        channel.unary_unary(method_path(method))(payload, timeout=10)


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    method=st.sampled_from(sorted(VALID)),
    random_bytes=st.binary(max_size=300),
    flips=st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 7)), max_size=4),
    cut=st.none() | st.integers(0, 400),
    mutate=st.booleans(),
)
def test_fuzzed_requests_are_answered_or_refused_never_crash(
    channel, method, random_bytes, flips, cut, mutate
):
    payload = _mutate(VALID[method], flips, cut) if mutate else random_bytes
    try:
        _call_raw(channel, method, payload)
    except grpc.RpcError as exc:
        assert exc.code() in REFUSALS, f"{exc.code()}: {exc.details()}"
        assert exc.details()


def test_the_daemon_is_healthy_after_the_fuzzing(channel, shared_daemon):
    assert shared_daemon.alive()
    shared_daemon.wait_serving(timeout_s=5)
    _assert_healthy(channel)
    assert "Traceback" not in shared_daemon.log, shared_daemon.log
