"""file:// under faults from outside the process (issue 17): a hung mount, the cache directory
removed while in use, a directory where a page's name should be. Real files, real FIFOs."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from storage_backends import open_backend
from storage_backends.file_space import LEDGER_NAME, page_path

from .test_file_store import ledger, on_disk

PAGE_BYTES = 4096


def run(coro):
    return asyncio.run(coro)


# -- a hung mount --------------------------------------------------------------------------------

_HUNG_READER = textwrap.dedent(
    """
    import asyncio, json, os, sys, time
    import xxhash
    from storage_backends import open_backend
    from storage_backends.file_space import page_path

    async def main(root, layout):
        keys = [xxhash.xxh3_128_digest(b"hung:%d" % i) for i in range(3)]
        url = "file://" + root + "?capacity=64MiB&timeout=1s&close_grace=1s"
        store = open_backend(url, layout=layout)
        for key in keys:  # a pack each: a name of its own is opened to read it
            assert await store.batch_put([key], [bytes({page}) + key]) == [True]
        hung = page_path(root, keys[0])
        os.unlink(hung)
        os.mkfifo(hung)  # opening it for reading waits for a writer: a hung NFS server
        view = bytearray({page} + 16)
        got = [await store.batch_get([keys[0]], [view]) for _ in range(2)]
        later = await store.batch_get([keys[1]], [view])  # other names still read
        await store.close()
        stats = store.stats()
        print(json.dumps({{"got": got, "later": later, "timeouts": stats.num_timeouts,
                          "abandoned": stats.num_abandoned}}))

    asyncio.run(main(sys.argv[1], sys.argv[2]))
    """
)


def test_a_hung_open_costs_a_timeout_and_close_still_finishes(tmp_path, pages):
    """A FIFO at a page's name stands in for a hung mount: opening it never returns. Reads
    of it time out (the event loop's thread never makes a call that can block), other pages
    still read, close() returns after its grace, and the process exits (the stuck worker
    is abandoned, and counted)."""
    script = _HUNG_READER.format(page=PAGE_BYTES)
    root = tmp_path / "kv"
    try:
        result = subprocess.run(
            [sys.executable, "-c", script, str(root), pages.LAYOUT],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except subprocess.TimeoutExpired:
        pytest.fail("a read of a page whose open hangs never returned (or close() did not)")
    assert result.returncode == 0, result.stderr[-3000:]
    outcome = json.loads(result.stdout.strip().splitlines()[-1])
    assert outcome["got"] == [[False], [False]]
    assert outcome["later"] == [True]
    assert outcome["timeouts"] >= 1
    assert outcome["abandoned"] >= 1


# -- the directory removed ---------------------------------------------------------------------


def test_a_removed_cache_directory_is_recreated_with_one_ledger(tmp_path, pages):
    """`rm -rf` of the directory under a running store: its later puts are stored (the
    directory is made again), and a second store opened on the new directory shares one
    ledger with the first, so the disk stays within the capacity and the ledger matches."""
    root = tmp_path / "kv"
    object_bytes = PAGE_BYTES + 200
    capacity = 24 * object_bytes
    url = f"file://{root}?capacity={capacity}&io_threads=2"
    keys = [pages.key(i, "gone") for i in range(120)]
    data = {key: pages.page(key, PAGE_BYTES) for key in keys}

    async def body():
        async with open_backend(url, layout=pages.LAYOUT) as first:
            assert await first.batch_put(keys[:4], [data[k] for k in keys[:4]]) == [True] * 4
            shutil.rmtree(root)
            batch = keys[4:8]
            assert await first.batch_put(batch, [data[k] for k in batch]) == [True] * 4
            pool, views = pages.pool_views(4, PAGE_BYTES)
            assert await first.batch_get(batch, views) == [True] * 4
            assert (root / LEDGER_NAME).exists()
            async with open_backend(url, layout=pages.LAYOUT) as second:
                for n, start in enumerate(range(8, len(keys), 4)):
                    store = (first, second)[n % 2]
                    batch = keys[start : start + 4]
                    assert await store.batch_put(batch, [data[k] for k in batch]) == [True] * 4
                    used, _ = on_disk(root)
                    assert used <= capacity
                assert ledger(root) == on_disk(root)

    run(body())


# -- a directory at a page's name ------------------------------------------------------------------


def test_a_directory_at_a_page_name_fails_that_page_alone(tmp_path, pages):
    """A directory where a page's name should be used to fail the whole delete (and so
    every later delete of a batch holding that key): now that name alone fails, counted."""
    root = tmp_path / "kv"
    keys = [pages.key(i, "dir") for i in range(3)]

    async def body():
        async with open_backend(f"file://{root}?capacity=64MiB", layout=pages.LAYOUT) as store:
            assert (
                await store.batch_put(keys, [pages.page(k, PAGE_BYTES) for k in keys]) == [True] * 3
            )
            odd = page_path(str(root), keys[1])
            os.unlink(odd)
            os.mkdir(odd)
            Path(odd, "inside").write_bytes(b"x")
            assert await store.delete(keys) == 2
            assert not os.path.exists(page_path(str(root), keys[0]))
            assert not os.path.exists(page_path(str(root), keys[2]))
            assert os.path.isdir(odd)  # not ours to remove
            assert store.stats().num_errors == 1
            pool, views = pages.pool_views(3, PAGE_BYTES)
            assert await store.batch_get(keys, views) == [False] * 3

    run(body())
