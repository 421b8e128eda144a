"""`hicache serve --spill-url mooncake://...`: the daemon as a front of Mooncake Store.

The daemon keeps its tokens, namespaces and quotas; the pages live in Mooncake, each
namespace under a prefix of its own. With `--spill-mode write-through` every acknowledged page
is in Mooncake before the ack, so a daemon killed with -9 and started again (empty memory)
serves them all, and a second daemon on the same store serves them too.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys

from storage_backends import encode_object, open_backend
from tests.hicache.server.client_worker import LAYOUT, key_of, page_of

PAGE_BYTES = 64 << 10


def _put(url: str, keys: list[bytes], pages: list[bytes]) -> list[bool]:
    async def body():
        async with open_backend(url, layout=LAYOUT) as store:
            return await store.batch_put(keys, pages)

    return asyncio.run(body())


def _get(url: str, keys: list[bytes]) -> list[bytes | None]:
    async def body():
        async with open_backend(url + "&timeout=20s", layout=LAYOUT) as store:
            into = [bytearray(PAGE_BYTES) for _ in keys]
            found = await store.batch_get(keys, into)
            return [bytes(b) if ok else None for b, ok in zip(into, found, strict=True)]

    return asyncio.run(body())


def _objects_in_mooncake(address: str, prefix: str, keys: list[bytes]) -> list[bytes | None]:
    async def body():
        async with open_backend(f"mooncake://{address}?prefix={prefix}&buffer=4MiB") as store:
            return await store.batch_get_objects(keys)

    return asyncio.run(body())


def test_write_through_to_mooncake_survives_kill_9_and_keeps_namespaces_apart(
    start_daemon, mooncake_store
):
    prefix = f"spill{id(mooncake_store) % 10000}:"
    spill = f"mooncake://{mooncake_store.address}?prefix={prefix}&buffer=8MiB"
    flags = ("--capacity", "1MiB", "--namespace", "a", "--namespace", "b")
    daemon = start_daemon(*flags, "--spill-url", spill, "--spill-mode", "write-through")
    url_a = f"grpc://{daemon.address}?namespace=a"
    url_b = f"grpc://{daemon.address}?namespace=b"
    keys = [key_of("shared-spill", i) for i in range(24)]  # 1.5 MiB through 1 MiB of memory
    pages = [page_of(k)[:PAGE_BYTES].ljust(PAGE_BYTES, b"\0") for k in keys]
    assert _put(url_a, keys, pages) == [True] * 24

    # In Mooncake, under the namespace's prefix, as the object the client framed.
    stored = _objects_in_mooncake(mooncake_store.address, f"{prefix}a/", keys[:2])
    assert stored == [encode_object(k, LAYOUT, p) for k, p in zip(keys[:2], pages[:2], strict=True)]
    assert _objects_in_mooncake(mooncake_store.address, f"{prefix}b/", keys[:2]) == [None] * 2
    assert _get(url_b, keys[:4]) == [None] * 4  # another tenant's namespace

    daemon.kill()
    daemon.start()  # same flags and port, empty memory
    assert _get(url_a, keys) == pages
    other = start_daemon(*flags, "--spill-url", spill)  # a second front of the same store
    assert _get(f"grpc://{other.address}?namespace=a", keys[:3]) == pages[:3]


def test_spill_url_mistakes_are_one_line_and_exit_2(tmp_path):
    for args, message in [
        (["--spill-url", "file:///tmp/x"], "--spill-url takes a store shared by prefix"),
        (["--spill-url", "mooncake://127.0.0.1:1", "--spill-dir", str(tmp_path)], "give one"),
        (["--spill-url", "mooncake://127.0.0.1:1", "--spill-fsync"], "--spill-fsync needs"),
        (["--spill-url", "mooncake://127.0.0.1:1?replicas=0"], "--spill-url: "),
    ]:
        result = subprocess.run(
            [sys.executable, "-m", "hicache", "serve", "--port", "0", *args],
            capture_output=True,
            text=True,
            timeout=120,
        )
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        assert result.returncode == 2, result.stderr
        assert lines[-1].startswith("hicache serve: error: ") and message in lines[-1], lines
