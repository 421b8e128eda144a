"""The daemon's memory budget (--memory-limit) under slow BatchPut streams, and the share of
streams and calls each tenant gets. Real daemons (subprocesses); RSS read from /proc."""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest

from storage_backends import open_backend
from storage_backends.pieces import OutPiece, encode_put_request
from storage_backends.protocol import method_path

sys.path.insert(0, str(Path(__file__).parent))
from client_worker import LAYOUT, key_of, page_of  # noqa: E402

TOKENS = {"a": "tenant-a-token-0123456789", "b": "tenant-b-token-0123456789"}
PIECE_BYTES = 4 << 20
MEMORY_LIMIT_BYTES = 576 << 20
CAP_BYTES = 3 << 30  # RLIMIT_AS: a regression fails here, not on the machine


@pytest.fixture
def two_tenants(tmp_path):
    """A tenants file (a -> ns-a, b -> ns-b) and a token file per tenant."""
    tenants = tmp_path / "tenants"
    tenants.write_text(f"{TOKENS['a']} ns-a\n{TOKENS['b']} ns-b\n")
    tenants.chmod(0o600)
    files = {}
    for name, token in TOKENS.items():
        files[name] = tmp_path / f"token-{name}"
        files[name].write_text(token)
        files[name].chmod(0o600)
    return tenants, files


class Stream:
    """A BatchPut of tenant `name` that sends `num_pieces` pieces of one page that never
    ends (each `piece_bytes`, `gap_s` apart), then waits."""

    def __init__(self, channel, name, num_pieces, piece_bytes=PIECE_BYTES, gap_s=0.0):
        self.release = threading.Event()
        self.sent = 0

        def messages():
            for i in range(num_pieces):
                piece = OutPiece(0, b"s" * 16, 256 << 20, i * piece_bytes, [b"x" * piece_bytes])
                yield encode_put_request(f"ns-{name}" if i == 0 else "", [piece])
                self.sent += 1
                if self.release.wait(gap_s):
                    return
            self.release.wait(60)

        metadata = (("authorization", f"Bearer {TOKENS[name]}"),)
        call = channel.stream_unary(method_path("BatchPut"))
        self.future = call.future(messages(), metadata=metadata, timeout=60)

    def code(self) -> grpc.StatusCode | None:
        """The status it ended with (None: still open)."""
        if not self.future.done():
            return None
        try:
            self.future.result()
        except grpc.RpcError as exc:
            return exc.code()
        return grpc.StatusCode.OK

    def close(self) -> None:
        self.release.set()
        self.future.cancel()


def _channel(address: str) -> grpc.Channel:
    return grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])


class Healthy(threading.Thread):
    """Tenant b's client: put and read back a few pages at a time, each call with a
    deadline, until stopped; every failure is kept."""

    def __init__(self, address: str, token_file) -> None:
        super().__init__(daemon=True)
        self.url = f"grpc://{address}?namespace=ns-b&token_file={token_file}&retries=0&timeout=10"
        self.done, self.rounds, self.failures = threading.Event(), 0, []

    def run(self) -> None:
        asyncio.run(self._body())

    async def _body(self) -> None:
        async with open_backend(self.url, layout=LAYOUT) as store:
            while not self.done.is_set():
                keys = [key_of("healthy", self.rounds * 4 + i) for i in range(4)]
                pages = [page_of(k) for k in keys]
                stored = await store.batch_put(keys, pages)
                into = [bytearray(len(p)) for p in pages]
                found = await store.batch_get(keys, into)
                if not all(stored) or not all(found):
                    self.failures.append((self.rounds, stored, found, store.stats()))
                elif [bytes(b) for b in into] != pages:
                    self.failures.append((self.rounds, "wrong bytes"))
                self.rounds += 1
                await asyncio.sleep(0.05)


def _watch_rss(daemon, seconds: float, until=lambda: False) -> int:
    peak, deadline = 0, time.monotonic() + seconds
    while time.monotonic() < deadline and daemon.alive() and not until():
        peak = max(peak, daemon.rss_bytes())
        time.sleep(0.05)
    return peak


def test_slow_streams_of_many_connections_stay_within_the_memory_limit(start_daemon, two_tenants):
    """8 connections x 8 streams of tenant a, each sending 4 MiB pieces of a page that never
    ends (today's main: ~1 GiB and more for this daemon of 64 MiB of pages)."""
    tenants, files = two_tenants
    daemon = start_daemon(
        "--capacity", "64MiB", "--tenants-file", str(tenants), "--max-message-bytes", "4MiB",
        "--memory-limit", str(MEMORY_LIMIT_BYTES), address_space_bytes=CAP_BYTES,
    )  # fmt: skip
    healthy = Healthy(daemon.address, files["b"])
    healthy.start()
    channels = [_channel(daemon.address) for _ in range(8)]
    streams = [Stream(channel, "a", 64) for channel in channels for _ in range(8)]
    try:
        peak = _watch_rss(daemon, 8.0, until=lambda: all(s.code() for s in streams))
        peak = max(peak, _watch_rss(daemon, 1.0))
        # and tenant b has made its rounds meanwhile: waited for by count, not by time
        peak = max(peak, _watch_rss(daemon, 60.0, until=lambda: healthy.rounds >= 3))
    finally:
        healthy.done.set()
        for stream in streams:
            stream.close()
        for channel in channels:
            channel.close()
    healthy.join(30)
    assert daemon.alive(), daemon.log
    print(f"peak RSS {peak >> 20} MiB under a limit of {MEMORY_LIMIT_BYTES >> 20} MiB")
    assert peak < MEMORY_LIMIT_BYTES, f"peak RSS {peak >> 20} MiB"
    assert healthy.rounds >= 3 and not healthy.failures, healthy.failures
    # The calls ended: what they held is given back (the process itself, 64 MiB of pages
    # at most, and what malloc keeps).
    deadline = time.monotonic() + 10
    while daemon.rss_bytes() > 320 << 20 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert daemon.rss_bytes() <= 320 << 20, f"RSS after {daemon.rss_bytes() >> 20} MiB"


def test_one_tenant_at_its_stream_limit_never_refuses_another(start_daemon, two_tenants):
    """Tenant a holds every stream it may (slow: 1 KiB every 2 s); tenant b still puts."""
    tenants, files = two_tenants
    daemon = start_daemon(
        "--capacity", "64MiB", "--tenants-file", str(tenants), "--max-streams", "4",
        "--max-streams-per-client", "4", "--stream-idle-timeout", "30",
    )  # fmt: skip
    channels = [_channel(daemon.address) for _ in range(3)]
    streams = [Stream(c, "a", 100, piece_bytes=1024, gap_s=2.0) for c in channels for _ in range(4)]
    healthy = Healthy(daemon.address, files["b"])
    try:
        deadline = time.monotonic() + 60
        while sum(s.code() is None and s.sent > 0 for s in streams) < 2:
            assert time.monotonic() < deadline, [(s.code(), s.sent) for s in streams]
            time.sleep(0.05)
        # Every stream past a's share (2 of the 4 while b may come) is refused as it opens:
        # wait for all those answers (a loaded machine delivers them late; counting them
        # when 8 had come left refusals still on their way counted as held streams).
        while sum(s.code() is not None for s in streams) < len(streams) - 2:
            assert time.monotonic() < deadline, (
                f"tenant a holds more than 2 of --max-streams 4: {[s.code() for s in streams]}"
            )
            time.sleep(0.05)
        open_streams = sum(s.code() is None for s in streams)
        assert 1 <= open_streams <= 2, f"tenant a holds {open_streams} of --max-streams 4"
        refused = [s.code() for s in streams if s.code() is not None]
        assert set(refused) == {grpc.StatusCode.RESOURCE_EXHAUSTED}, refused
        healthy.start()
        # tenant b's rounds run while a still holds its streams (each lives ~200 s): waited
        # for by count, not by time, so a loaded machine only makes it slower
        deadline = time.monotonic() + 60
        while healthy.rounds < 3 and not healthy.failures and healthy.is_alive():
            assert time.monotonic() < deadline, f"tenant b made {healthy.rounds} rounds"
            time.sleep(0.05)
        assert sum(s.code() is None for s in streams) == open_streams
    finally:
        healthy.done.set()
        if healthy.is_alive():
            healthy.join(30)
        for stream in streams:
            stream.close()
        for channel in channels:
            channel.close()
    assert healthy.rounds >= 3 and not healthy.failures, healthy.failures


def test_the_budget_is_derived_checked_and_named():
    from hicache.server.config import ServerConfig

    default = ServerConfig(capacity_bytes=64 << 20)
    budget = default.budget
    assert budget.limit_bytes == default.memory_limit_bytes
    assert budget.num_calls >= default.max_streams + 16
    limited = ServerConfig(capacity_bytes=64 << 20, memory_limit_bytes=1 << 30)
    assert limited.max_streams == limited.budget.num_calls - 16 >= 1
    with pytest.raises(ValueError, match="--memory-limit 134217728 is too small"):
        ServerConfig(capacity_bytes=64 << 20, memory_limit_bytes=128 << 20)
    with pytest.raises(ValueError, match=r"64 BatchPut streams \(--max-streams\)"):
        ServerConfig(capacity_bytes=64 << 20, max_streams=64, memory_limit_bytes=1 << 30)
