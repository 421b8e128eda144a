"""file:// specifics: damage on disk, restart, LRU and capacity across processes, faults."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from storage_backends import file_store as file_store_module
from storage_backends import open_backend
from storage_backends.file_space import LEDGER_NAME, page_path, temp_path
from storage_backends.objects import decode_object, encode_object, header_size

WORKER = Path(__file__).with_name("file_worker.py")
PAGE_BYTES = 4096


def run(coro):
    return asyncio.run(coro)


def page_files(root: Path) -> list[Path]:
    return [p for p in root.glob("??/??/*") if ".tmp." not in p.name]


def temp_files(root: Path) -> list[Path]:
    return [p for p in root.glob("??/??/*") if ".tmp." in p.name]


def ledger(root: Path) -> tuple[int, int]:
    """(used_bytes, num_objects) as the ledger file says."""
    _, used, num, *_ = struct.unpack("<8s5q", (root / LEDGER_NAME).read_bytes())
    return used, num


def _flip(path: str, offset: int) -> None:
    data = bytearray(Path(path).read_bytes())
    data[offset] ^= 0x01
    Path(path).write_bytes(bytes(data))


DAMAGE = {
    "payload_byte": (lambda path, other: _flip(path, os.path.getsize(path) - 1), "checksum"),
    "magic_byte": (lambda path, other: _flip(path, 0), "magic"),
    "key_byte": (lambda path, other: _flip(path, 20), "key"),
    "truncated": (lambda path, other: os.truncate(path, os.path.getsize(path) - 7), "truncated"),
    "cut_to_header": (lambda path, other: os.truncate(path, 30), "truncated"),
    "other_keys_file": (lambda path, other: shutil.copyfile(other, path), "key"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_page_damaged_on_disk_is_a_miss_with_its_reason(tmp_path, pages, damage):
    root = tmp_path / "kv"
    keys = [pages.key(0), pages.key(1)]
    data = [pages.page(k, PAGE_BYTES) for k in keys]
    make_damage, reason = DAMAGE[damage]

    async def body():
        async with open_backend(f"file://{root}?capacity=1MiB", layout=pages.LAYOUT) as store:
            await store.batch_put(keys, data)
            make_damage(page_path(str(root), keys[0]), page_path(str(root), keys[1]))
            pool, views = pages.pool_views(2, PAGE_BYTES)
            assert await store.batch_get(keys, views) == [False, True]
            assert bytes(views[1]) == data[1]
            assert store.stats().num_corrupt == {reason: 1}

    run(body())


def test_restart_finds_what_is_on_disk(tmp_path, pages):
    url = f"file://{tmp_path / 'kv'}?capacity=1MiB"
    keys = [pages.key(i) for i in range(10)]
    data = [pages.page(k, PAGE_BYTES) for k in keys]

    async def first():
        async with open_backend(url, layout=pages.LAYOUT) as store:
            assert await store.batch_put(keys, data) == [True] * 10

    async def second():
        async with open_backend(url, layout=pages.LAYOUT) as store:
            assert await store.batch_exists(keys) == 10
            pool, views = pages.pool_views(10, PAGE_BYTES)
            assert await store.batch_get(keys, views) == [True] * 10
            assert bytes(pool) == b"".join(data)
            await store.rescan()
            stats = store.stats()
            assert stats.num_objects == 10
            assert stats.stored_bytes == 10 * (header_size(pages.LAYOUT) + PAGE_BYTES)

    run(first())
    run(second())


def test_lru_evicts_the_least_recently_read(tmp_path, pages):
    object_bytes = header_size(pages.LAYOUT) + PAGE_BYTES
    root = tmp_path / "kv"
    url = f"file://{root}?capacity={4 * object_bytes}&touch_interval=0"
    keys = [pages.key(i) for i in range(6)]

    async def body():
        async with open_backend(url, layout=pages.LAYOUT) as store:
            for key in keys[:4]:  # one batch each: distinct write times
                await store.batch_put([key], [pages.page(key, PAGE_BYTES)])
            _, views = pages.pool_views(1, PAGE_BYTES)
            assert await store.batch_get(keys[:1], views) == [True]  # keys[0] is now recent
            await store.batch_put(keys[4:5], [pages.page(keys[4], PAGE_BYTES)])
            present = [await store.batch_exists([k]) for k in keys[:5]]
            assert present == [1, 0, 1, 1, 1]  # keys[1] was the least recently used
            stats = store.stats()
            assert stats.num_evictions == 1
            assert stats.stored_bytes == 4 * object_bytes == ledger(root)[0]

    run(body())


def test_a_page_larger_than_the_capacity_is_rejected(tmp_path, pages):
    async def body():
        url = f"file://{tmp_path / 'kv'}?capacity={PAGE_BYTES}"
        async with open_backend(url, layout=pages.LAYOUT) as store:
            assert await store.batch_put([pages.key(0)], [bytes(PAGE_BYTES)]) == [False]
            assert store.stats().num_put_rejected == 1
        assert temp_files(tmp_path / "kv") == []

    run(body())


def test_capacity_holds_across_many_batches(tmp_path, pages):
    root = tmp_path / "kv"
    capacity = 20 * (header_size(pages.LAYOUT) + PAGE_BYTES) + 100

    async def body():
        async with open_backend(f"file://{root}?capacity={capacity}", layout=pages.LAYOUT) as s:
            for batch in range(15):
                keys = [pages.key(i, salt=str(batch)) for i in range(8)]
                assert (
                    await s.batch_put(keys, [pages.page(k, PAGE_BYTES) for k in keys]) == [True] * 8
                )
                files = page_files(root)
                assert sum(p.stat().st_size for p in files) <= capacity
                assert ledger(root) == (sum(p.stat().st_size for p in files), len(files))
            assert s.stats().num_evictions == 15 * 8 - 20

    run(body())


def test_two_processes_share_one_directory(tmp_path, pages):
    """Concurrent writers and readers: no torn page, no exception, capacity respected."""
    root = tmp_path / "shared"
    page_bytes = 8192
    capacity = 40 * (header_size(pages.LAYOUT) + page_bytes)
    url = f"file://{root}?capacity={capacity}&touch_interval=0&scan_interval=200ms"
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(WORKER),
                url,
                pages.LAYOUT,
                str(seed),
                "400",
                str(page_bytes),
                "120",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for seed in (1, 2)
    ]
    reports = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        assert "Traceback" not in err, err
        reports.append(json.loads(out))
    for report in reports:
        assert report["wrong"] == 0
        assert report["corrupt"] == {}  # a reader never met a partial page
        assert report["errors"] == 0
        assert report["hits"] > 0
    files = page_files(root)
    on_disk = sum(p.stat().st_size for p in files)
    assert on_disk <= capacity
    assert ledger(root) == (on_disk, len(files))
    assert temp_files(root) == []
    for path in files:
        key = bytes.fromhex(path.name)
        payload = decode_object(path.read_bytes(), key, pages.LAYOUT)
        assert bytes(payload) == pages.page(key, page_bytes)  # written by either: intact


def test_the_ledger_is_rebuilt_after_drift(tmp_path, pages):
    """A writer that died between rename and ledger update, or a file removed by hand."""
    root = tmp_path / "kv"
    keys = [pages.key(i) for i in range(6)]
    object_bytes = header_size(pages.LAYOUT) + PAGE_BYTES

    async def body():
        async with open_backend(f"file://{root}?capacity=1MiB", layout=pages.LAYOUT) as store:
            await store.batch_put(keys[:5], [pages.page(k, PAGE_BYTES) for k in keys[:5]])
            for key in keys[:2]:
                os.unlink(page_path(str(root), key))  # removed by hand
            orphan = page_path(str(root), keys[5])  # renamed in by a writer that then died
            os.makedirs(os.path.dirname(orphan), exist_ok=True)
            Path(orphan).write_bytes(encode_object(keys[5], pages.LAYOUT, bytes(PAGE_BYTES)))
            assert ledger(root) == (5 * object_bytes, 5)  # stale: 4 pages are on disk
            await store.rescan()
            assert ledger(root) == (4 * object_bytes, 4)
            assert store.stats().num_objects == 4

    run(body())


def test_scans_remove_only_long_dead_temporary_files(tmp_path, pages):
    root = tmp_path / "kv"

    async def body():
        async with open_backend(f"file://{root}?capacity=1MiB", layout=pages.LAYOUT) as store:
            await store.batch_put([pages.key(0)], [bytes(100)])
            final = page_path(str(root), pages.key(1))
            os.makedirs(os.path.dirname(final), exist_ok=True)
            dead, live = temp_path(final, 1), temp_path(final, 2)
            for path in (dead, live):
                Path(path).write_bytes(b"partial")
            old = time.time() - 3600
            os.utime(dead, (old, old))
            await store.rescan()
            assert not os.path.exists(dead)
            assert os.path.exists(live)  # may be a write in progress elsewhere
            assert store.stats().num_objects == 1  # temporary files never count

    run(body())


def test_a_read_error_on_one_page_fails_that_page_only(tmp_path, pages):
    root = tmp_path / "kv"
    keys = [pages.key(0), pages.key(1)]

    async def body():
        async with open_backend(f"file://{root}?capacity=1MiB", layout=pages.LAYOUT) as store:
            await store.batch_put(keys[1:], [pages.page(keys[1], PAGE_BYTES)])
            os.makedirs(page_path(str(root), keys[0]))  # reading a directory fails: EISDIR
            _, views = pages.pool_views(2, PAGE_BYTES)
            assert await store.batch_get(keys, views) == [False, True]
            assert store.stats().num_errors == 1
            assert store.stats().num_corrupt_total == 0

    run(body())


def test_a_timed_out_read_never_writes_into_the_callers_buffer(tmp_path, pages, monkeypatch):
    root = tmp_path / "kv"
    key = pages.key(0)
    real_preadv_all = file_store_module._preadv_all

    def slow_preadv_all(fd, buffers, limit):
        time.sleep(0.6)  # a hung mount
        return real_preadv_all(fd, buffers, limit)

    async def body():
        url = f"file://{root}?capacity=1MiB&timeout=200ms"
        async with open_backend(url, layout=pages.LAYOUT) as store:
            await store.batch_put([key], [pages.page(key, PAGE_BYTES)])
            store._nowait = False  # as on NFS: every read may wait, none goes straight in
            monkeypatch.setattr(file_store_module, "_preadv_all", slow_preadv_all)
            pool, views = pages.pool_views(1, PAGE_BYTES)
            started = time.monotonic()
            assert await store.batch_get([key], views) == [False]
            assert time.monotonic() - started < 0.5
            await asyncio.sleep(0.8)  # the stuck read finishes now
            assert bytes(pool) == b"\xa5" * PAGE_BYTES
            assert store.stats().num_timeouts == 1
            monkeypatch.setattr(file_store_module, "_preadv_all", real_preadv_all)
            assert await store.batch_get([key], views) == [True]  # recovered, same object
            assert bytes(pool) == pages.page(key, PAGE_BYTES)

    run(body())


def test_fsync_mode_round_trips(tmp_path, pages):
    keys = [pages.key(i) for i in range(3)]

    async def body():
        url = f"file://{tmp_path / 'kv'}?capacity=1MiB&fsync=true"
        async with open_backend(url, layout=pages.LAYOUT) as store:
            assert await store.batch_put(keys, [pages.page(k, 999) for k in keys]) == [True] * 3
            pool, views = pages.pool_views(3, 999)
            assert await store.batch_get(keys, views) == [True] * 3
            assert bytes(pool) == b"".join(pages.page(k, 999) for k in keys)

    run(body())


def test_a_huge_file_is_refused_without_reading_it(tmp_path, pages):
    root = tmp_path / "kv"
    key = pages.key(0)

    async def body():
        async with open_backend(f"file://{root}?capacity=1MiB", layout=pages.LAYOUT) as store:
            await store.batch_put([key], [bytes(100)])
            os.truncate(page_path(str(root), key), 64 << 20)  # sparse: cheap to make
            _, views = pages.pool_views(1, 100)
            assert await store.batch_get([key], views) == [False]
            assert store.stats().num_corrupt == {"length": 1}

    run(body())


def test_pages_not_in_the_page_cache_are_read_through_the_chunk_buffer(tmp_path, pages):
    """A read that would wait for the disk never goes straight into the caller's buffer."""
    root = tmp_path / "kv"
    keys = [pages.key(i) for i in range(3)]
    sizes = [100, 300_000, 700_000]  # under, just over, and several chunks
    data = [pages.page(k, n) for k, n in zip(keys, sizes, strict=True)]

    async def body():
        async with open_backend(f"file://{root}?capacity=8MiB", layout=pages.LAYOUT) as store:
            for key, page in zip(keys, data, strict=True):
                await store.batch_put([key], [page])
            for key in keys:  # evict the pages from the page cache
                fd = os.open(page_path(str(root), key), os.O_RDONLY)
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                os.close(fd)
            for key, page in zip(keys, data, strict=True):
                into = bytearray(len(page))
                assert await store.batch_get([key], [into]) == [True]
                assert into == page

    run(body())
