"""What unfinished BatchPut streams may hold in a real daemon: stream counts, bytes charged to
the namespace, idle streams. Each daemon runs under an address-space cap (RLIMIT_AS), so a
regression fails the test instead of exhausting the machine."""

from __future__ import annotations

import threading

import grpc
import pytest

from storage_backends.pieces import OutPiece, encode_put_request
from storage_backends.proto import kvstore_pb2 as pb
from storage_backends.protocol import method_path

CAP_BYTES = 1536 << 20  # the daemon's address space: ~0.7 GiB idle, 64 MiB of pages
KEY = b"s" * 16
CHUNK = 1 << 20


class SlowStream:
    """A BatchPut that sends `num_chunks` MiB of one 256 MiB page, then waits (never ends on
    its own); `result()` is the daemon's answer."""

    def __init__(self, channel: grpc.Channel, num_chunks: int, namespace: str = "default"):
        self.release = threading.Event()
        self.sent = 0

        def messages():
            for i in range(num_chunks):
                piece = OutPiece(0, KEY, 256 << 20, i * CHUNK, [b"x" * CHUNK])
                yield encode_put_request(namespace if i == 0 else "", [piece])
                self.sent += 1
            self.release.wait(30)

        call = channel.stream_unary(method_path("BatchPut"))
        self.future = call.future(messages(), timeout=30)

    def refusal(self, timeout_s: float = 20.0) -> grpc.RpcError:
        """The RpcError the daemon answered with (fails if it answered otherwise)."""
        try:
            self.future.result(timeout=timeout_s)
        except grpc.RpcError as exc:
            return exc
        except grpc.FutureTimeoutError:
            pytest.fail("the daemon held the stream without refusing it")
        pytest.fail("the stream was answered")

    def close(self) -> None:
        self.release.set()
        self.future.cancel()


def _channel(address: str) -> grpc.Channel:
    # Options that differ make separate connections: each channel is one client.
    return grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])


def _wait_until(predicate, timeout_s: float = 10.0) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def _stats(channel) -> pb.NamespaceStats:
    raw = channel.unary_unary(method_path("Stats"))(pb.StatsRequest().SerializeToString())
    return pb.StatsResponse.FromString(raw).namespaces[0]


def test_streamed_bytes_are_charged_to_the_namespace_and_refused_past_it(start_daemon):
    daemon = start_daemon("--capacity", "64MiB", address_space_bytes=CAP_BYTES)
    streams = []
    with _channel(daemon.address) as channel:
        try:
            first = SlowStream(channel, 40)  # 40 MiB of a page in progress: held, charged
            streams.append(first)
            _wait_until(lambda: first.sent == 40)
            _wait_until(lambda: _stats(channel).in_flight_bytes >= 39 << 20)
            # 6 more streams of 40 MiB each: 2.4 GiB unbounded, far past the cap.
            streams += [SlowStream(channel, 40) for _ in range(6)]
            for stream in streams[1:]:
                exc = stream.refusal()
                assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exc.details()
                assert "would hold more than its 67108864 bytes" in exc.details()
            assert daemon.alive() and daemon.rss_bytes() < 640 << 20
        finally:
            for stream in streams:
                stream.close()
        _wait_until(lambda: _stats(channel).in_flight_bytes == 0)
    assert daemon.alive() and "Traceback" not in daemon.log


def test_stream_counts_per_client_and_in_all_are_bounded(start_daemon):
    daemon = start_daemon(
        "--capacity", "64MiB", "--max-streams", "3", "--max-streams-per-client", "2",
        address_space_bytes=CAP_BYTES,
    )  # fmt: skip
    streams = []
    with _channel(daemon.address) as one, _channel(daemon.address) as other:
        try:
            streams += [SlowStream(one, 1), SlowStream(one, 1)]
            _wait_until(lambda: all(s.sent for s in streams))
            third = SlowStream(one, 1)
            streams.append(third)
            exc = third.refusal()
            assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "--max-streams-per-client 2" in exc.details()
            streams.append(SlowStream(other, 1))  # another client: its own allowance
            _wait_until(lambda: streams[-1].sent)
            fifth = SlowStream(other, 1)
            streams.append(fifth)
            exc = fifth.refusal()
            assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "--max-streams 3" in exc.details()
        finally:
            for stream in streams:
                stream.close()
    assert daemon.alive()


def test_an_idle_stream_is_dropped_and_its_bytes_released(start_daemon):
    daemon = start_daemon(
        "--capacity", "64MiB", "--stream-idle-timeout", "0.5", address_space_bytes=CAP_BYTES
    )
    with _channel(daemon.address) as channel:
        stream = SlowStream(channel, 8)
        try:
            exc = stream.refusal()
        finally:
            stream.close()
        assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "sent nothing for 0.5s (--stream-idle-timeout)" in exc.details()
        assert _stats(channel).in_flight_bytes == 0
