"""A client process of the daemon tests, through the grpc:// backend.

    python client_worker.py load <url> <seed> <num_ops> <num_keys>
    python client_worker.py put-until-killed <url> <seed> <ack_log> <batch_pages> <page_bytes>
    python client_worker.py soak <url> <seed> <seconds> <log> <tenant> <key_space> <foreign_url>

Every key's page is a function of the key (its size too), so any process can check any hit
byte for byte: a torn, mixed-up or foreign page shows up as a refused (corrupt) read or as
wrong bytes, which this worker never allows.

`load`: mixed batch_put / batch_get / batch_exists on a key space shared with the other
workers; prints one JSON line (counts, the keys whose put was acknowledged, backend stats);
exits non-zero on any wrong byte or exception.

`put-until-killed`: puts batches of fresh keys until the daemon dies under it. Before each
batch it appends "start <batch>" to `ack_log`, after the ack "ack <batch> <indices stored>",
each line flushed and fsynced, so the test knows exactly what was acknowledged when it
killed the daemon.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import sys

import xxhash

from storage_backends import open_backend

LAYOUT = "test;worker"


def key_of(name: str, i: int) -> bytes:
    return xxhash.xxh3_128_digest(f"{name}:{i}".encode())


def page_of(key: bytes, max_bytes: int = 16 << 10) -> bytes:
    rng = random.Random(key)
    return rng.randbytes(rng.randint(1, max_bytes))


async def load(url: str, seed: int, num_ops: int, num_keys: int) -> dict:
    rng = random.Random(seed)
    keys = [key_of("shared", i) for i in range(num_keys)]
    acked: set[int] = set()
    counts = {"puts": 0, "gets": 0, "exists": 0, "hits": 0}
    async with open_backend(url, layout=LAYOUT) as store:
        for _ in range(num_ops):
            batch = rng.sample(range(num_keys), rng.randint(1, 8))
            batch_keys = [keys[i] for i in batch]
            op = rng.random()
            if op < 0.4:
                stored = await store.batch_put(batch_keys, [page_of(k) for k in batch_keys])
                acked.update(i for i, ok in zip(batch, stored, strict=True) if ok)
                counts["puts"] += 1
            elif op < 0.8:
                expected = [page_of(k) for k in batch_keys]
                into = [bytearray(len(page)) for page in expected]
                found = await store.batch_get(batch_keys, into)
                for ok, got, want in zip(found, into, expected, strict=True):
                    if ok and bytes(got) != want:
                        raise AssertionError("a hit returned wrong bytes")
                counts["gets"] += 1
                counts["hits"] += sum(found)
            else:
                count = await store.batch_exists(batch_keys)
                if not 0 <= count <= len(batch_keys):
                    raise AssertionError(f"exists counted {count} of {len(batch_keys)}")
                counts["exists"] += 1
        stats = store.stats()
    return {
        **counts,
        "acked": sorted(acked),
        "errors": stats.num_errors,
        "timeouts": stats.num_timeouts,
        "corrupt": dict(stats.num_corrupt),
    }


async def put_until_killed(
    url: str, seed: int, ack_log: str, batch_pages: int, page_bytes: int
) -> None:
    with open(ack_log, "a") as log:
        async with open_backend(url, layout=LAYOUT) as store:
            for batch in range(1_000_000):
                keys = [key_of(f"crash{seed}", batch * batch_pages + i) for i in range(batch_pages)]
                pages = [page_of(k, page_bytes) for k in keys]
                _log(log, f"start {batch}")
                stored = await store.batch_put(keys, pages)
                if not any(stored):
                    return  # the daemon is gone
                _log(log, f"ack {batch} " + " ".join(str(i) for i, ok in enumerate(stored) if ok))


def tenant_page_of(tenant: str, key: bytes) -> bytes:
    """The page a tenant stores under `key`: tenants share key names, never bytes."""
    return page_of(key_of(tenant, int.from_bytes(key[:8], "little")), 16 << 10)


async def soak(
    url: str, seed: int, seconds: float, log_path: str, tenant: str, space: str, foreign: str
) -> dict:
    """Puts, gets and deletes for `seconds` while the daemon is killed and restarted under
    it. Logs "ack <i>" once a put of key i is acknowledged and "del <i>" before a delete of
    it, so the test knows which pages must be back. A hit with other bytes than this
    tenant's page is counted as foreign; `foreign` (another tenant's namespace with this
    tenant's token) must be refused."""
    import time

    from storage_backends import BackendConfigError

    rng = random.Random(seed)
    keys = [key_of(space, i) for i in range(200)]
    counts = {"puts": 0, "acked": 0, "gets": 0, "hits": 0, "deletes": 0, "foreign": 0}
    try:
        async with open_backend(foreign, layout=LAYOUT) as store:
            await store.connect()
        counts["foreign_allowed"] = 1
    except BackendConfigError as exc:
        counts["foreign_allowed"] = 0 if "PERMISSION_DENIED" in str(exc) else 1
    end = time.monotonic() + seconds
    with open(log_path, "a") as log:
        async with open_backend(url, layout=LAYOUT) as store:
            while time.monotonic() < end:
                batch = rng.sample(range(len(keys)), rng.randint(1, 8))
                batch_keys = [keys[i] for i in batch]
                op = rng.random()
                if op < 0.45:
                    pages = [tenant_page_of(tenant, k) for k in batch_keys]
                    stored = await store.batch_put(batch_keys, pages)
                    for i, ok in zip(batch, stored, strict=True):
                        if ok:
                            _log(log, f"ack {i}", sync=False)
                    counts["puts"] += 1
                    counts["acked"] += sum(stored)
                elif op < 0.9:
                    into = [bytearray(len(tenant_page_of(tenant, k))) for k in batch_keys]
                    found = await store.batch_get(batch_keys, into)
                    for ok, got, k in zip(found, into, batch_keys, strict=True):
                        if ok and bytes(got) != tenant_page_of(tenant, k):
                            counts["foreign"] += 1
                    counts["gets"] += 1
                    counts["hits"] += sum(found)
                else:
                    for i in batch:
                        _log(log, f"del {i}", sync=False)
                    await store.delete(batch_keys)
                    counts["deletes"] += 1
                if not rng.randrange(20):
                    await asyncio.sleep(0.01)
        stats = store.stats()
    return {**counts, "errors": stats.num_errors, "corrupt": dict(stats.num_corrupt)}


def _log(log, line: str, *, sync: bool = True) -> None:
    log.write(line + "\n")
    log.flush()
    if sync:
        os.fsync(log.fileno())


def main(argv: list[str]) -> int:
    mode, url, seed = argv[0], argv[1], int(argv[2])
    if mode == "load":
        result = asyncio.run(load(url, seed, int(argv[3]), int(argv[4])))
        print(json.dumps(result))
    elif mode == "soak":
        result = asyncio.run(soak(url, seed, float(argv[3]), *argv[4:8]))
        print(json.dumps(result))
    elif mode == "put-until-killed":
        asyncio.run(put_until_killed(url, seed, argv[3], int(argv[4]), int(argv[5])))
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
