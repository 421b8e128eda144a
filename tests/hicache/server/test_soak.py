"""Soak: clients of 3 tenants put, get and delete while the daemon (write-through) is killed
with SIGKILL at random points and slow BatchPut streams come and go: 8 clients for minutes
(`slow`), and 3 clients for 20 s in the default run.

Afterwards: every page acknowledged and not deleted since is back, bitwise; no client ever
got another tenant's bytes or into another tenant's namespace; the daemon's resident memory
stayed under its --memory-limit the whole time (and it ran under an address-space cap).

    SOAK_S=180 python -m pytest -q -m slow tests/hicache/server/test_soak.py -s
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import subprocess
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
from client_worker import LAYOUT, key_of, tenant_page_of  # noqa: E402

WORKER = Path(__file__).with_name("client_worker.py")
ROOT = Path(__file__).resolve().parents[3]
TENANTS = ("t0", "t1", "t2")
TOKENS = {t: f"{t}-soak-token-{'x' * 12}" for t in TENANTS}
CAPACITY = "24MiB"
RSS_LIMIT_BYTES = 512 << 20  # the daemon's --memory-limit: 24 MiB of pages, 192 MiB for the
# process, and 49 calls in flight of 3 x 2 MiB messages (what it prints at start)
CAP_BYTES = 3 << 30  # RLIMIT_AS of the daemon: a leak fails there, not on the machine


class _RssWatch(threading.Thread):
    def __init__(self, daemon) -> None:
        super().__init__(daemon=True)
        self.target, self.max_bytes, self.samples, self.done = daemon, 0, 0, threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.1):
            with contextlib.suppress(OSError, RuntimeError, AttributeError, ValueError):
                self.max_bytes = max(self.max_bytes, self.target.rss_bytes())
                self.samples += 1


class _SlowStreams(threading.Thread):
    """Every so often, a BatchPut that sends 4-12 MiB of a 64 MiB page, then stalls."""

    def __init__(self, daemon, seed: int) -> None:
        super().__init__(daemon=True)
        self.target, self.rng, self.done = daemon, random.Random(seed), threading.Event()
        self.outcomes: dict[str, int] = {}

    def run(self) -> None:
        while not self.done.wait(self.rng.uniform(0.2, 1.0)):
            tenant = self.rng.choice(TENANTS)
            chunks = self.rng.randint(4, 12)
            stall = threading.Event()

            def messages(tenant=tenant, chunks=chunks, stall=stall):
                for i in range(chunks):
                    piece = OutPiece(0, b"z" * 16, 64 << 20, i << 20, [b"z" * (1 << 20)])
                    yield encode_put_request(f"ns-{tenant}" if i == 0 else "", [piece])
                stall.wait(6)

            metadata = (("authorization", f"Bearer {TOKENS[tenant]}"),)
            try:
                with grpc.insecure_channel(self.target.address) as channel:
                    call = channel.stream_unary(method_path("BatchPut"))
                    call(messages(), metadata=metadata, timeout=8)
                outcome = "answered"
            except grpc.RpcError as exc:
                outcome = exc.code().name
            stall.set()
            self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1


# How long a restarted daemon may take to serve again: its clients and the slow streams
# keep a 2-core machine busy (20 s, the fixture's default, was once too short in CI).
RESTART_S = 120.0


def _must_be_back(log: Path) -> set[int]:
    """Key numbers whose last event was an acknowledged put."""
    last: dict[int, str] = {}
    for line in log.read_text().splitlines():
        kind, number = line.split()
        last[int(number)] = kind
    return {n for n, kind in last.items() if kind == "ack"}


@pytest.mark.slow
def test_soak_mixed_tenants_with_kill_9_and_slow_streams(start_daemon, tmp_path):
    seconds = float(os.environ.get("SOAK_S", "150"))
    figures = _soak(start_daemon, tmp_path, seconds, num_clients=8, kill_every_s=(4, 15))
    assert figures["puts"] > 100 and figures["kills"] >= 3


def test_a_short_soak_with_kill_9_and_slow_streams(start_daemon, tmp_path):
    """The same, small enough for the default run on a loaded 2-core machine."""
    figures = _soak(start_daemon, tmp_path, 20.0, num_clients=3, kill_every_s=(3, 6))
    assert figures["puts"] > 10 and figures["kills"] >= 2


def _soak(start_daemon, tmp_path, seconds: float, *, num_clients: int, kill_every_s) -> dict:
    tenants = tmp_path / "tenants"
    tenants.write_text("".join(f"{TOKENS[t]} ns-{t}\n" for t in TENANTS))
    tenants.chmod(0o600)
    for t in TENANTS:
        (tmp_path / f"token-{t}").write_text(TOKENS[t])
    daemon = start_daemon(
        "--capacity", CAPACITY, "--tenants-file", str(tenants),
        "--spill-dir", str(tmp_path / "spill"), "--spill-mode", "write-through",
        "--stream-idle-timeout", "2", "--max-streams-per-client", "4",
        "--max-message-bytes", "2MiB", "--memory-limit", str(RSS_LIMIT_BYTES),
        address_space_bytes=CAP_BYTES,
    )  # fmt: skip
    base = f"grpc://{daemon.address}"
    clients = []
    for i in range(num_clients):
        tenant, other = TENANTS[i % 3], TENANTS[(i + 1) % 3]
        token = tmp_path / f"token-{tenant}"
        # (connect_timeout: a client's first call may come while the daemon restarts)
        first_use = "connect_timeout=30s"
        url = f"{base}?namespace=ns-{tenant}&token_file={token}&timeout=3s&down_for=0.2"
        url += f"&{first_use}"
        foreign = f"{base}?namespace=ns-{other}&token_file={token}&{first_use}"
        log = tmp_path / f"client{i}.log"
        argv = [str(seconds), str(log), tenant, f"space{i // 3}", foreign]
        clients.append((tenant, f"space{i // 3}", log, subprocess.Popen(
            [sys.executable, str(WORKER), "soak", url, str(i), *argv],
            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )))  # fmt: skip
    watch, slow = _RssWatch(daemon), _SlowStreams(daemon, seed=1)
    watch.start()
    slow.start()
    rng, kills = random.Random(7), 0
    end = time.monotonic() + seconds
    while time.monotonic() < end - min(10.0, seconds / 4):
        time.sleep(rng.uniform(*kill_every_s))
        daemon.kill()
        kills += 1
        time.sleep(rng.uniform(0, 1))
        daemon.start(timeout_s=RESTART_S)
    results = []
    for *_, worker in clients:
        out, err = worker.communicate(timeout=seconds + 120)
        assert worker.returncode == 0, err[-3000:]
        results.append(json.loads(out))
    slow.done.set()
    slow.join(timeout=30)
    daemon.kill()  # one more crash, then read everything back
    kills += 1
    daemon.start(timeout_s=RESTART_S)
    watch.done.set()
    watch.join()

    async def read_back(tenant: str, space: str, numbers: set[int]) -> int:
        token = tmp_path / f"token-{tenant}"
        url = f"{base}?namespace=ns-{tenant}&token_file={token}&timeout=30s"
        keys = [key_of(space, n) for n in sorted(numbers)]
        pages = [tenant_page_of(tenant, k) for k in keys]
        async with open_backend(url, layout=LAYOUT) as store:
            into = [bytearray(len(p)) for p in pages]
            found = await store.batch_get(keys, into)
        return sum(ok and bytes(b) == p for ok, b, p in zip(found, into, pages, strict=True))

    must, back = 0, 0
    for tenant, space, log, _ in clients:
        numbers = _must_be_back(log)
        must += len(numbers)
        back += asyncio.run(read_back(tenant, space, numbers))
    figures = {
        "seconds": seconds,
        "kills": kills,
        "puts": sum(r["puts"] for r in results),
        "pages_acked": sum(r["acked"] for r in results),
        "gets": sum(r["gets"] for r in results),
        "hits": sum(r["hits"] for r in results),
        "deletes": sum(r["deletes"] for r in results),
        "must_be_back": must,
        "back": back,
        "foreign_pages": sum(r["foreign"] for r in results),
        "foreign_namespace_allowed": sum(r["foreign_allowed"] for r in results),
        "slow_streams": slow.outcomes,
        "max_rss_mib": round(watch.max_bytes / (1 << 20), 1),
        "rss_samples": watch.samples,
    }
    print("soak:", json.dumps(figures))
    assert figures["hits"] > 0 and must > 0, figures
    assert back == must, figures
    assert figures["foreign_pages"] == 0 and figures["foreign_namespace_allowed"] == 0, figures
    assert watch.max_bytes < RSS_LIMIT_BYTES, figures
    assert sum(r["corrupt"].get("checksum", 0) for r in results) == 0, figures
    assert "Traceback" not in daemon.log
    return figures
