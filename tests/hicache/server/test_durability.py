"""The spill: evicted pages read back, graceful shutdown, kill -9 mid-batch, damaged files.

What an acknowledged put promises (hicache/server/store.py):
- `--spill-mode evict`: the page is in memory; it reaches the spill when evicted or at a
  graceful shutdown. After kill -9, what had been spilled is back; the rest is lost.
- `--spill-mode write-through`: the page was in the spill before the ack. After kill -9,
  every acknowledged page is back.
In both, a page read after a crash is bitwise the page that was put, or a miss: never torn.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest

from storage_backends import encode_object, open_backend
from storage_backends.file_pack import read_table
from storage_backends.pieces import decode_get_response
from storage_backends.proto import kvstore_pb2 as pb
from storage_backends.protocol import method_path
from tests.support.deadline import wait_until
from tests.support.servers import RedisProcess, free_port

sys.path.insert(0, str(Path(__file__).parent))
from client_worker import LAYOUT, key_of, page_of  # noqa: E402

WORKER = Path(__file__).with_name("client_worker.py")
ROOT = Path(__file__).resolve().parents[3]


def _read_back(url: str, keys: list[bytes], sizes: list[int]) -> list[bytes | None]:
    """The page of each key as the daemon serves it (None: a miss)."""

    async def body():
        async with open_backend(url + "&timeout=20s", layout=LAYOUT) as store:
            into = [bytearray(n) for n in sizes]
            found = await store.batch_get(keys, into)
            return [bytes(b) if ok else None for b, ok in zip(into, found, strict=True)]

    return asyncio.run(body())


def _put(url: str, keys: list[bytes], pages: list[bytes]) -> list[bool]:
    async def body():
        async with open_backend(url, layout=LAYOUT) as store:
            return await store.batch_put(keys, pages)

    return asyncio.run(body())


def _server_stats(url: str) -> pb.StatsResponse:
    async def body():
        async with open_backend(url, layout=LAYOUT) as store:
            (reply,) = (await store.server_stats()).values()
            return reply

    return asyncio.run(body())


def _spill_written(url: str) -> bool:
    """Every evicted page has reached the spill (none is still being written)."""
    return all(ns.spilling_bytes == 0 for ns in _server_stats(url).namespaces)


def _threads_opening_fifos(pid: int) -> int:
    """The daemon's threads blocked opening a FIFO for reading (the kernel waits for a
    writer in wait_for_partner): what a read from a hung mount looks like."""
    count = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            count += (task / "wchan").read_text().strip() == "wait_for_partner"
        except OSError:  # the thread ended
            pass
    return count


def test_evicted_pages_are_spilled_and_read_back(start_daemon, tmp_path):
    daemon = start_daemon("--capacity", "2MiB", "--spill-dir", str(tmp_path / "spill"))
    url = f"grpc://{daemon.address}?namespace=default"
    keys = [key_of("evict", i) for i in range(24)]
    pages = [os.urandom(256 << 10) for _ in keys]  # 6 MiB through 2 MiB of memory
    assert _put(url, keys, pages) == [True] * 24
    wait_until(lambda: _spill_written(url), "the last evictions' spill writes (after the ack)")
    (ns,) = _server_stats(url).namespaces
    assert ns.num_evictions >= 16 and ns.spill_objects >= 16
    assert ns.stored_bytes <= 2 << 20
    assert _read_back(url, keys, [len(p) for p in pages]) == pages


def test_graceful_shutdown_flushes_memory_and_a_restart_finds_it(start_daemon, tmp_path):
    spill = tmp_path / "spill"
    daemon = start_daemon("--capacity", "64MiB", "--spill-dir", str(spill))
    url = f"grpc://{daemon.address}?namespace=default"
    keys = [key_of("graceful", i) for i in range(40)]
    pages = [page_of(k) for k in keys]
    assert _put(url, keys, pages) == [True] * 40
    assert not list(spill.rglob("*/*/*"))  # nothing evicted: all in memory only
    assert daemon.stop() == 0
    assert "stopped (40 pages written to the spill)" in daemon.log
    daemon.start()  # same port, same spill directory, empty memory
    assert _read_back(url, keys, [len(p) for p in pages]) == pages


def _crash_mid_batch(daemon, tmp_path: Path, url: str, page_bytes: int, min_acks: int) -> list[str]:
    """Run a putting client; once `min_acks` batches were acknowledged, kill -9 the daemon
    while the next batch is in flight. Returns the client's log."""
    ack_log = tmp_path / "acks.log"
    worker = subprocess.Popen(
        [sys.executable, str(WORKER), "put-until-killed", url, "7", str(ack_log), "16",
         str(page_bytes)],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            lines = ack_log.read_text().splitlines() if ack_log.exists() else []
            acks = sum(line.startswith("ack") for line in lines)
            if acks >= min_acks and lines[-1].startswith("start"):
                break
            time.sleep(0.002)
        daemon.kill()
        assert worker.wait(timeout=60) == 0
    finally:
        if worker.poll() is None:
            worker.kill()
    return ack_log.read_text().splitlines()


def _acked_and_attempted(lines: list[str]) -> tuple[set[int], set[int]]:
    """Page numbers (batch * 16 + index) acknowledged, and attempted at all."""
    acked, attempted = set(), set()
    for line in lines:
        kind, batch, *indices = line.split()
        if kind == "start":
            attempted.update(int(batch) * 16 + i for i in range(16))
        else:
            acked.update(int(batch) * 16 + int(i) for i in indices)
    return acked, attempted


@pytest.mark.parametrize("mode", ["write-through", "evict"])
def test_kill_9_mid_batch_loses_no_acknowledged_spilled_page_and_serves_no_torn_one(
    start_daemon, tmp_path, mode
):
    spill = tmp_path / "spill"
    daemon = start_daemon(
        "--capacity", "4MiB", "--spill-dir", str(spill), "--spill-mode", mode,
    )  # fmt: skip
    url = f"grpc://{daemon.address}?namespace=default&timeout=3s&retries=1"
    lines = _crash_mid_batch(daemon, tmp_path, url, page_bytes=64 << 10, min_acks=24)
    assert lines[-1].startswith("start"), "the kill must land inside a batch"
    acked, attempted = _acked_and_attempted(lines)
    assert len(acked) >= 24 * 16

    daemon.start()  # same spill directory
    numbers = sorted(attempted)
    keys = [key_of("crash7", n) for n in numbers]
    expected = [page_of(k, 64 << 10) for k in keys]
    served = _read_back(
        f"grpc://{daemon.address}?namespace=default", keys, [len(p) for p in expected]
    )
    for n, got, want in zip(numbers, served, expected, strict=True):
        assert got is None or got == want, f"page {n} came back with wrong bytes"
    back = {n for n, got in zip(numbers, served, strict=True) if got is not None}
    if mode == "write-through":  # every ack was durable before it was sent
        assert acked <= back, f"acknowledged pages lost: {sorted(acked - back)[:10]}"
    else:
        # Memory was lost. Each put acked after the pages it evicted were in the spill, so
        # every acknowledged page older than the newest 4 MiB (memory) plus the batch in
        # flight (whose evictions may not have reached the spill) is back.
        budget = 4 << 20
        budget += sum(len(expected[numbers.index(n)]) + 80 for n in attempted - acked)
        must_be_back = set()
        for n in sorted(acked, reverse=True):
            budget -= len(page_of(key_of("crash7", n), 64 << 10)) + 80  # page + header
            if budget < 0:
                must_be_back.add(n)
        assert len(must_be_back) > 100
        assert must_be_back <= back, f"spilled pages lost: {sorted(must_be_back - back)[:10]}"


def test_a_damaged_spill_file_is_a_miss_never_data(start_daemon, tmp_path):
    spill = tmp_path / "spill"
    daemon = start_daemon(
        "--capacity", "8MiB", "--spill-dir", str(spill), "--spill-mode", "write-through",
    )  # fmt: skip
    url = f"grpc://{daemon.address}?namespace=default"
    keys = [key_of("damage", i) for i in range(4)]
    pages = [page_of(k) for k in keys]
    assert _put(url, keys, pages) == [True] * 4
    daemon.stop()
    files = {p.name: p for p in spill.rglob("*") if p.is_file() and len(p.name) == 32}
    damaged = files[keys[1].hex()]  # a name of the pack that holds the page
    with open(damaged, "r+b") as f:
        table = read_table(f.fileno(), os.fstat(f.fileno()))
        offset, length = table.entries[keys[1]]
        f.seek(offset + length - 1)  # the page's last byte
        last = f.read(1)[0]
        f.seek(offset + length - 1)
        f.write(bytes([last ^ 0x10]))
    daemon.start()
    served = _read_back(url, keys, [len(p) for p in pages])
    assert served == [pages[0], None, pages[2], pages[3]]
    (ns,) = _server_stats(url).namespaces
    assert dict(ns.num_spill_corrupt) == {"checksum": 1}  # counted where an operator looks


def test_evict_mode_keeps_pages_whose_spill_write_outlived_the_evicting_call(
    start_daemon, tmp_path
):
    """Another client's put evicts A's pages; that client's deadline expires while they are
    being written to the spill. The write must finish anyway: A's acknowledged pages all
    come back (from memory or the spill)."""
    daemon = start_daemon("--capacity", "4MiB", "--spill-dir", str(tmp_path / "spill"))
    url = f"grpc://{daemon.address}?namespace=default"
    keys = [key_of("owner", i) for i in range(60)]
    pages = [os.urandom(64 << 10) for _ in keys]
    assert _put(url, keys, pages) == [True] * 60

    async def hasty_puts():
        # Deadlines from 1 to 20 ms: some expire while the put's evictions are being spilled.
        for timeout_ms in (1, 2, 3, 4, 5, 6, 8, 10, 12, 15, 20):
            hasty = f"{url}&timeout={timeout_ms}ms&retries=0"
            async with open_backend(hasty, layout=LAYOUT) as store:
                await store.connect()
                for batch in range(3):
                    batch_keys = [key_of(f"hasty{timeout_ms}:{batch}", i) for i in range(32)]
                    await store.batch_put(batch_keys, [os.urandom(64 << 10) for _ in batch_keys])

    asyncio.run(hasty_puts())
    wait_until(lambda: _spill_written(url), "the evictions' writes that outlived their call")
    served = _read_back(url, keys, [len(p) for p in pages])
    lost = [i for i, (got, want) in enumerate(zip(served, pages, strict=True)) if got != want]
    assert not lost, f"{len(lost)} of 60 acknowledged pages lost: {lost[:10]}"


def test_an_evicted_page_the_spill_cannot_take_is_counted(start_daemon, tmp_path):
    daemon = start_daemon(
        "--capacity", "1MiB", "--spill-dir", str(tmp_path / "spill"), "--spill-capacity", "64KiB",
    )  # fmt: skip
    url = f"grpc://{daemon.address}?namespace=default"
    keys = [key_of("dropped", i) for i in range(8)]
    assert _put(url, keys, [os.urandom(200 << 10) for _ in keys]) == [True] * 8
    (ns,) = _server_stats(url).namespaces
    assert ns.num_evictions >= 3
    assert ns.num_spill_dropped == ns.num_evictions  # no 200 KiB page fits a 64 KiB spill


def _hang_spill_reads(spill: Path, keys: list[bytes]) -> None:
    """Put a FIFO where each key's spill file is: opening it for reading never returns (a
    hung NFS or FUSE mount does the same)."""
    for key in keys:
        (path,) = spill.rglob(key.hex())
        path.unlink()
        os.mkfifo(path)


@pytest.mark.parametrize("num_hung", [1, 4])
def test_sigterm_is_honoured_within_its_bounds_while_spill_reads_hang(
    start_daemon, tmp_path, num_hung
):
    spill = tmp_path / "spill"
    daemon = start_daemon(
        "--capacity", "2MiB", "--spill-dir", str(spill), "--shutdown-grace", "0.5",
        "--flush-timeout", "2",
    )  # fmt: skip
    url = f"grpc://{daemon.address}?namespace=default"
    spilled = [key_of("to-hang", i) for i in range(num_hung)]
    filler = [key_of("filler", i) for i in range(12)]
    assert _put(url, spilled + filler, [os.urandom(256 << 10) for _ in spilled + filler])
    wait_until(lambda: _spill_written(url), "the evicted pages in the spill")
    _hang_spill_reads(spill, spilled)
    keys = [key_of("in-memory", i) for i in range(8)]  # acknowledged, only in memory
    pages = [page_of(k) for k in keys]
    assert _put(url, keys, pages) == [True] * 8
    channel = grpc.insecure_channel(daemon.address)
    readers = [  # one call per hung page: each holds one of the spill's 4 I/O threads
        channel.unary_stream(method_path("BatchGet"))(
            pb.BatchGetRequest(keys=[key]).SerializeToString(), timeout=60
        )
        for key in spilled
    ]
    threads = [threading.Thread(target=_drain, args=(reader,)) for reader in readers]
    try:
        for thread in threads:
            thread.start()
        wait_until(
            lambda: _threads_opening_fifos(daemon.proc.pid) >= min(num_hung, 4),
            "the reads to reach the FIFOs",
        )
        status = daemon.stop(timeout_s=60)  # past it, a SIGKILL: status -9
    finally:
        for reader in readers:
            reader.cancel()
        for thread in threads:
            thread.join()
        channel.close()
    assert status in (0, 1), f"the daemon did not exit on SIGTERM (status {status})"
    for path in spill.rglob("*"):
        if path.is_fifo():
            path.unlink()
    # With a thread of the spill free (or a spill that never hangs on a FIFO), nothing is lost.
    if num_hung == 1 or status == 0:
        assert status == 0, daemon.log
        daemon.start()
        assert _read_back(url, keys, [len(p) for p in pages]) == pages
    else:  # every spill thread is stuck: what could not be written is counted and logged
        assert status == 1, daemon.log
        lost = re.search(r"(\d+) could not be and are lost", daemon.log)
        assert lost and int(lost.group(1)) >= 8, daemon.log  # ours, and fillers in memory
        assert "pages only in memory could not be written to the spill" in daemon.log


def _drain(call) -> None:
    with contextlib.suppress(grpc.RpcError):
        list(call)


def _get_raw(channel, keys: list[bytes], timeout_s: float) -> set[int]:
    """A BatchGet under a deadline; the indices the daemon answered as misses (an RpcError,
    such as DEADLINE_EXCEEDED, fails the caller)."""
    call = channel.unary_stream(method_path("BatchGet"))
    missing: set[int] = set()
    for message in call(pb.BatchGetRequest(keys=keys).SerializeToString(), timeout=timeout_s):
        missing.update(decode_get_response(message)[1])
    return missing


def _answer_fifos(spill: Path) -> None:
    """The mount answers again: every read waiting on a FIFO gets end-of-file (a short,
    refused page), then the FIFOs are gone (those pages are lost: misses)."""
    fifos = [path for path in spill.rglob("*") if path.is_fifo()]
    for _ in range(50):
        for path in fifos:
            with contextlib.suppress(OSError):  # ENXIO: nobody is reading it now
                os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        time.sleep(0.02)
    for path in fifos:
        path.unlink()


def test_a_hung_spill_answers_misses_within_the_call_deadline_and_recovers(start_daemon, tmp_path):
    """(Reads of a hung spill used to hold each call until the client gave up.)"""
    spill = tmp_path / "spill"
    daemon = start_daemon("--capacity", "2MiB", "--spill-dir", str(spill))
    url = f"grpc://{daemon.address}?namespace=default"
    hung = [key_of("hung", i) for i in range(6)]  # more than the spill's 4 I/O threads
    healthy = [key_of("spilled", i) for i in range(4)]
    filler = [key_of("filler", i) for i in range(10)]
    pages = {k: os.urandom(256 << 10) for k in hung + healthy + filler}
    assert all(_put(url, list(pages), list(pages.values())))
    _hang_spill_reads(spill, hung)
    with grpc.insecure_channel(daemon.address) as channel:
        for key in hung:  # each: a miss, answered within its deadline
            assert _get_raw(channel, [key], timeout_s=3.0) == {0}
        # every I/O thread of the spill is stuck: a healthy spilled page misses too, in time;
        # pages in memory are served meanwhile
        assert _get_raw(channel, healthy[:1], timeout_s=3.0) == {0}
        assert _get_raw(channel, filler[-2:], timeout_s=3.0) == set()
        _answer_fifos(spill)
        deadline = time.monotonic() + 30
        while _get_raw(channel, healthy, timeout_s=10.0):  # the stuck reads drain, then hits
            assert time.monotonic() < deadline, "the spill did not serve again"
            time.sleep(0.1)
    assert _read_back(url, healthy, [len(pages[k]) for k in healthy]) == [pages[k] for k in healthy]
    assert daemon.stop() == 0, daemon.log


def _put_raw(channel, keys: list[bytes], pages: list[bytes], timeout_s: float) -> list[int]:
    """A BatchPut of `pages` under a deadline; the daemon's status of each (an RpcError,
    such as DEADLINE_EXCEEDED, fails the caller)."""
    pieces = [
        pb.Piece(index=i, key=key, object_bytes=len(blob), offset=0, data=blob)
        for i, (key, blob) in enumerate(
            (key, encode_object(key, LAYOUT, page)) for key, page in zip(keys, pages, strict=True)
        )
    ]
    request = pb.BatchPutRequest(namespace="default", pieces=pieces).SerializeToString()
    call = channel.stream_unary(method_path("BatchPut"))
    return list(pb.BatchPutResponse.FromString(call(iter([request]), timeout=timeout_s)).statuses)


@pytest.fixture
def redis_spill(tmp_path):
    server = RedisProcess(tmp_path / "redis", free_port()).start()
    yield server
    server.stop()  # (continued first, if a test failed while it was paused)


def test_a_hung_write_through_spill_answers_puts_within_the_call_deadline(
    start_daemon, redis_spill
):
    """(Write-through puts to a hung spill used to hold each call for the spill's own
    timeout, past the client's deadline.) A redis-server stopped with SIGSTOP keeps its
    connections and never answers: each put is answered within its deadline, not stored
    (never acknowledged), and once the spill answers again puts are stored and read back."""
    redis = redis_spill
    daemon = start_daemon(
        "--capacity", "8MiB", "--spill-url", f"{redis.url}?timeout=60s",
        "--spill-mode", "write-through",
    )  # fmt: skip
    url = f"grpc://{daemon.address}?namespace=default"
    keys = [key_of("through", i) for i in range(4)]
    pages = [os.urandom(64 << 10) for _ in keys]
    with grpc.insecure_channel(daemon.address) as channel:
        assert _put_raw(channel, keys[:1], pages[:1], timeout_s=10.0) == [pb.PUT_STATUS_STORED]
        with redis.paused():
            for key, page in zip(keys[1:3], pages[1:3], strict=True):
                assert _put_raw(channel, [key], [page], timeout_s=3.0) == [pb.PUT_STATUS_ERROR]
        assert _put_raw(channel, keys[3:], pages[3:], timeout_s=30.0) == [pb.PUT_STATUS_STORED]
    got = _read_back(url, [keys[0], keys[3]], [len(pages[0]), len(pages[3])])
    assert got == [pages[0], pages[3]]
    assert daemon.stop() == 0, daemon.log
