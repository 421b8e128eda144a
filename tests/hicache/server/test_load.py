"""Load: 8 client processes x 2,000 mixed put/get/exists on overlapping keys, one daemon."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from storage_backends import open_backend

sys.path.insert(0, str(Path(__file__).parent))
from client_worker import LAYOUT, key_of, page_of  # noqa: E402

WORKER = Path(__file__).with_name("client_worker.py")
ROOT = Path(__file__).resolve().parents[3]
NUM_WORKERS, NUM_OPS, NUM_KEYS = 8, 2000, 400


@pytest.mark.slow  # eight clients x 2,000 ops: 40 s on a loaded 2-core machine
def test_eight_clients_mixed_ops_then_every_acknowledged_page_is_intact(start_daemon):
    daemon = start_daemon("--capacity", "256MiB")  # 400 keys of <= 16 KiB: nothing evicted
    url = f"grpc://{daemon.address}?namespace=default&timeout=30s"
    workers = [
        subprocess.Popen(
            [sys.executable, str(WORKER), "load", url, str(seed), str(NUM_OPS), str(NUM_KEYS)],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for seed in range(NUM_WORKERS)
    ]
    results = []
    for worker in workers:
        out, err = worker.communicate(timeout=300)
        assert worker.returncode == 0, err
        results.append(json.loads(out))
    for result in results:
        assert result["puts"] + result["gets"] + result["exists"] == NUM_OPS
        assert (result["errors"], result["timeouts"], result["corrupt"]) == (0, 0, {})
    assert sum(r["hits"] for r in results) > 0
    acked = sorted(set().union(*(r["acked"] for r in results)))
    assert len(acked) > NUM_KEYS // 2

    async def read_all():
        async with open_backend(url, layout=LAYOUT) as store:
            keys = [key_of("shared", i) for i in acked]
            pages = [page_of(k) for k in keys]
            into = [bytearray(len(p)) for p in pages]
            found = await store.batch_get(keys, into)
            (reply,) = (await store.server_stats()).values()
            return found, [bytes(b) == p for b, p in zip(into, pages, strict=True)], reply

    found, equal, stats = asyncio.run(read_all())
    assert stats.namespaces[0].num_evictions == 0
    assert all(found) and all(equal)
    assert daemon.alive() and "Traceback" not in daemon.log
