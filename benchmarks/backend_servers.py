"""The stores bench_backends.py runs its cases against, started on free loopback ports
(redis-server; a Mooncake master and one holder), and a probe of the Mooncake store's
one-page latency through the backend and through the raw client."""

from __future__ import annotations

import socket
import statistics
import subprocess
import time
from pathlib import Path

import numpy as np

from benchmarks.backend_workload import LAYOUT, Workload
from benchmarks.common import sig
from storage_backends import open_backend


def start_redis(workdir: Path) -> tuple[subprocess.Popen, int]:
    from tests.support.servers import free_port  # (not one the kernel may hand out meanwhile)

    port = free_port()
    proc = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
         "--appendonly", "no", "--dir", str(workdir), "--logfile", str(workdir / "redis.log")],
        stdout=subprocess.DEVNULL,
    )  # fmt: skip
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2) as conn:
                conn.sendall(b"PING\r\n")
                if conn.recv(16).startswith(b"+PONG"):
                    return proc, port
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("redis-server did not start")


def start_mooncake(workdir: Path, segment_bytes: int):
    """A master and one holder lending `segment_bytes`, on loopback (tests/support/servers)."""
    from tests.support.servers import MooncakeHolder, MooncakeMaster

    master = MooncakeMaster(workdir / "mooncake", client_ttl_s=10).start()
    try:
        holder = MooncakeHolder(master, segment_bytes).start()
    except BaseException:
        master.stop()
        raise
    return master, holder


def raw_mooncake_client(address: str, pool=None):
    """A raw Mooncake client set up with the master at `address` on loopback, lending nothing
    (set up on `pool`'s thread where one is given, as the backend's client is)."""
    from mooncake.store import MooncakeDistributedStore

    client = MooncakeDistributedStore()
    args = ("127.0.0.1", "P2PHANDSHAKE", 0, 0, "tcp", "", address)
    code = client.setup(*args) if pool is None else pool.submit(client.setup, *args).result()
    if code != 0:
        raise RuntimeError(f"the raw Mooncake client could not set up with {address}")
    return client


async def mooncake_latency(url: str, address: str, work: Workload, num: int = 50) -> dict:
    """Median seconds of a one-page `batch_get` through the backend and of the raw client's
    `batch_get_into` of the same page: the per-request latency `hicache simulate` models."""
    key, page, view = work.batches[0][0], work.pages[0], work.into[0]
    backend = open_backend(url, layout=LAYOUT)
    raw = None
    try:
        await backend.connect()
        assert await backend.batch_put([key], [page]) == [True]
        raw = raw_mooncake_client(address)
        target = np.frombuffer(work.pool, dtype=np.uint8)
        raw.register_buffer(target.ctypes.data, target.nbytes)
        name = "latency:" + key.hex()
        raw.batch_put_from([name], [np.frombuffer(page, np.uint8).ctypes.data], [len(page)])
        ours, theirs = [], []
        for _ in range(num):
            started = time.perf_counter()
            assert await backend.batch_get([key], [view]) == [True]
            ours.append(time.perf_counter() - started)
            started = time.perf_counter()
            assert raw.batch_get_into([name], [target.ctypes.data], [len(page)]) == [len(page)]
            theirs.append(time.perf_counter() - started)
        raw.batch_remove([name], True)
        await backend.delete([key])
    finally:
        await backend.close()
        if raw is not None:
            raw.close()
    return {
        "one_page_get_us": sig(statistics.median(ours) * 1e6),
        "raw_one_page_get_us": sig(statistics.median(theirs) * 1e6),
    }
