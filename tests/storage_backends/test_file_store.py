"""file:// specifics: packs and their links, damage on disk, restart, LRU and capacity across
processes, faults."""

from __future__ import annotations

import asyncio
import errno
import json
import os
import shutil
import struct
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import pytest

from storage_backends import file_read as file_read_module
from storage_backends import file_space as file_space_module
from storage_backends import file_write as file_write_module
from storage_backends import open_backend
from storage_backends.file_pack import ENTRY_BYTES, entry_position, read_table, table_bytes
from storage_backends.file_space import LEDGER_NAME, page_path, temp_path
from storage_backends.objects import encode_object, header_size
from storage_backends.verify import decode_object

WORKER = Path(__file__).with_name("file_worker.py")
PAGE_BYTES = 4096


def run(coro):
    return asyncio.run(coro)


def page_files(root: Path) -> list[Path]:
    """Every page's name (each a hard link to the pack that holds the page)."""
    return [p for p in root.glob("?/?/*") if ".tmp." not in p.name]


def temp_files(root: Path) -> list[Path]:
    return [p for p in root.glob("?/?/*") if ".tmp." in p.name]


def on_disk(root: Path) -> tuple[int, int]:
    """(bytes of the packs, each counted once; page links), as the ledger should say."""
    sizes = {}
    links = page_files(root)
    for path in links:
        st = path.stat()
        sizes[st.st_ino] = st.st_size
    return sum(sizes.values()), len(links)


def ledger(root: Path) -> tuple[int, int]:
    """(used_bytes, num_objects) as the ledger file says."""
    _, used, num, *_ = struct.unpack("<8s5q", (root / LEDGER_NAME).read_bytes())
    return used, num


def locate(path: str, key: bytes) -> tuple[int, int]:
    """(offset, length) of `key`'s object in the pack at `path`."""
    fd = os.open(path, os.O_RDONLY)
    try:
        table = read_table(fd, os.fstat(fd))
        return table.entries[key]
    finally:
        os.close(fd)


def read_object(path: str, key: bytes) -> bytes:
    offset, length = locate(path, key)
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(length)


def pack_bytes(*page_sizes: int, layout: str) -> int:
    """Size of one pack holding pages of these sizes."""
    return table_bytes(len(page_sizes)) + sum(header_size(layout) + n for n in page_sizes)


def _flip(path: str, offset: int) -> None:
    data = bytearray(Path(path).read_bytes())
    data[offset] ^= 0x01
    Path(path).write_bytes(bytes(data))


def _object_byte(offset_in_object):
    """Flip a byte of the damaged page's own object (not of the pack's table)."""

    def damage(path: str, other: str, key: bytes) -> None:
        offset, _ = locate(path, key)
        _flip(path, offset + offset_in_object)

    return damage


def _huge_length(path: str, other: str, key: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(entry_position(0) + ENTRY_BYTES - 8)
        f.write(struct.pack("<Q", 64 << 20))


DAMAGE = {
    "payload_byte": (lambda path, other, key: _flip(path, os.path.getsize(path) - 1), "checksum"),
    "pack_magic": (lambda path, other, key: _flip(path, 0), "magic"),
    "pack_version": (lambda path, other, key: _flip(path, 4), "version"),
    "table_key": (lambda path, other, key: _flip(path, entry_position(0) + 3), "key"),
    "object_magic": (_object_byte(0), "magic"),
    "object_key": (_object_byte(20), "key"),
    "object_raw_length": (_object_byte(40), "length"),
    # 256 bytes more of layout than written: the header then reaches into the payload
    "object_layout_length": (_object_byte(9), "layout"),
    "truncated": (
        lambda path, other, key: os.truncate(path, os.path.getsize(path) - 7),
        "truncated",
    ),
    "cut_to_table": (lambda path, other, key: os.truncate(path, 30), "truncated"),
    "other_keys_pack": (lambda path, other, key: shutil.copyfile(other, path), "key"),
    "huge_length_in_table": (_huge_length, "length"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_page_damaged_on_disk_is_a_miss_with_its_reason(tmp_path, pages, damage):
    root = tmp_path / "kv"
    keys = [pages.key(0), pages.key(1)]
    data = [pages.page(k, PAGE_BYTES) for k in keys]
    make_damage, reason = DAMAGE[damage]

    async def body():
        async with open_backend(f"file://{root}?capacity=1MiB", layout=pages.LAYOUT) as store:
            for key, page in zip(keys, data, strict=True):  # one pack each
                await store.batch_put([key], [page])
            path, other = page_path(str(root), keys[0]), page_path(str(root), keys[1])
            make_damage(path, other, keys[0])
            pool, views = pages.pool_views(2, PAGE_BYTES)
            assert await store.batch_get(keys, views) == [False, True]
            assert bytes(views[1]) == data[1]
            assert store.stats().num_corrupt == {reason: 1}

    run(body())


def test_damage_to_one_page_of_a_pack_spares_the_others(tmp_path, pages):
    root = tmp_path / "kv"
    keys = [pages.key(i) for i in range(4)]
    data = [pages.page(k, PAGE_BYTES) for k in keys]

    async def body():
        async with open_backend(f"file://{root}?capacity=1MiB", layout=pages.LAYOUT) as store:
            await store.batch_put(keys, data)  # one pack
            path = page_path(str(root), keys[2])
            offset, length = locate(path, keys[2])
            _flip(path, offset + length - 1)
            pool, views = pages.pool_views(4, PAGE_BYTES)
            assert await store.batch_get(keys, views) == [True, True, False, True]
            assert [bytes(views[i]) for i in (0, 1, 3)] == [data[i] for i in (0, 1, 3)]
            assert store.stats().num_corrupt == {"checksum": 1}

    run(body())


def test_restart_finds_what_is_on_disk(tmp_path, pages):
    url = f"file://{tmp_path / 'kv'}?capacity=1MiB"
    keys = [pages.key(i) for i in range(10)]
    data = [pages.page(k, PAGE_BYTES) for k in keys]

    async def first():
        async with open_backend(url, layout=pages.LAYOUT) as store:
            assert await store.batch_put(keys[:6], data[:6]) == [True] * 6
            assert await store.batch_put(keys[6:], data[6:]) == [True] * 4

    async def second():
        async with open_backend(url, layout=pages.LAYOUT) as store:
            assert await store.batch_exists(keys) == 10
            pool, views = pages.pool_views(10, PAGE_BYTES)
            assert await store.batch_get(keys, views) == [True] * 10
            assert bytes(pool) == b"".join(data)
            await store.rescan()
            stats = store.stats()
            assert stats.num_objects == 10
            six, four = [PAGE_BYTES] * 6, [PAGE_BYTES] * 4
            assert stats.stored_bytes == pack_bytes(*six, layout=pages.LAYOUT) + pack_bytes(
                *four, layout=pages.LAYOUT
            )

    run(first())
    run(second())


def test_a_batch_is_one_pack_with_a_link_per_page(tmp_path, pages):
    root = tmp_path / "kv"
    keys = [pages.key(i) for i in range(5)]

    async def body():
        async with open_backend(f"file://{root}?capacity=1MiB", layout=pages.LAYOUT) as store:
            await store.batch_put(keys, [pages.page(k, PAGE_BYTES) for k in keys])
            stats = [os.stat(page_path(str(root), key)) for key in keys]
            assert len({st.st_ino for st in stats}) == 1
            assert stats[0].st_nlink == 5
            assert stats[0].st_size == pack_bytes(*[PAGE_BYTES] * 5, layout=pages.LAYOUT)
            assert ledger(root) == on_disk(root) == (stats[0].st_size, 5)
            assert temp_files(root) == []

    run(body())


def test_packs_stay_small_next_to_the_capacity(tmp_path, pages):
    root = tmp_path / "kv"
    keys = [pages.key(i) for i in range(32)]
    capacity = 64 * pack_bytes(PAGE_BYTES, layout=pages.LAYOUT)  # a pack: at most 1/16 of it

    async def body():
        async with open_backend(f"file://{root}?capacity={capacity}", layout=pages.LAYOUT) as s:
            assert await s.batch_put(keys, [pages.page(k, PAGE_BYTES) for k in keys]) == [True] * 32
            packs = {os.stat(page_path(str(root), key)).st_ino for key in keys}
            assert len(packs) == 8  # 4 pages a pack
            pool, views = pages.pool_views(32, PAGE_BYTES)
            assert await s.batch_get(keys, views) == [True] * 32
            assert bytes(pool) == b"".join(pages.page(k, PAGE_BYTES) for k in keys)

    run(body())


def test_deleting_pages_of_a_pack(tmp_path, pages):
    """A deleted page is gone even though its pack lives on for the others; the pack's bytes
    go with its last page."""
    root = tmp_path / "kv"
    keys = [pages.key(i) for i in range(3)]
    size = pack_bytes(*[PAGE_BYTES] * 3, layout=pages.LAYOUT)

    async def body():
        async with open_backend(f"file://{root}?capacity=1MiB", layout=pages.LAYOUT) as store:
            await store.batch_put(keys, [pages.page(k, PAGE_BYTES) for k in keys])
            assert await store.delete(keys[1:2]) == 1
            pool, views = pages.pool_views(3, PAGE_BYTES)
            assert await store.batch_get(keys, views) == [True, False, True]
            assert store.stats().num_corrupt_total == 0
            assert ledger(root) == on_disk(root) == (size, 2)
            assert await store.delete(keys) == 2
            assert ledger(root) == on_disk(root) == (0, 0)
            assert await store.batch_get(keys, views) == [False] * 3

    run(body())


def test_rewriting_a_page_leaves_its_old_pack_to_the_others(tmp_path, pages):
    root = tmp_path / "kv"
    keys = [pages.key(i) for i in range(3)]
    data = [pages.page(k, PAGE_BYTES) for k in keys]
    first = pack_bytes(*[PAGE_BYTES] * 3, layout=pages.LAYOUT)
    second = pack_bytes(PAGE_BYTES, layout=pages.LAYOUT)

    async def body():
        async with open_backend(f"file://{root}?capacity=1MiB", layout=pages.LAYOUT) as store:
            await store.batch_put(keys, data)
            await store.batch_put(keys[1:2], data[1:2])  # the same page, written again
            assert ledger(root) == on_disk(root) == (first + second, 3)
            pool, views = pages.pool_views(3, PAGE_BYTES)
            assert await store.batch_get(keys, views) == [True] * 3
            assert bytes(pool) == b"".join(data)
            await store.delete(keys[1:2])  # gone from both packs
            assert await store.batch_get(keys, views) == [True, False, True]
            await store.batch_put(keys[1:2], data[1:2])
            await store.batch_put(keys[0:3:2], [data[0], data[2]])  # the old pack's last pages
            assert ledger(root) == on_disk(root) == (second + pack_bytes(
                PAGE_BYTES, PAGE_BYTES, layout=pages.LAYOUT
            ), 3)  # fmt: skip

    run(body())


def test_compressed_pages_in_a_pack_take_the_full_path(tmp_path, pages):
    root = tmp_path / "kv"
    keys = [pages.key(i) for i in range(4)]
    data = [bytes([i]) * PAGE_BYTES if i % 2 else pages.page(k, PAGE_BYTES)
            for i, k in enumerate(keys)]  # fmt: skip

    async def body():
        url = f"file://{root}?capacity=1MiB&compression=lz4"
        async with open_backend(url, layout=pages.LAYOUT) as store:
            await store.batch_put(keys, data)
            assert os.path.getsize(page_path(str(root), keys[0])) < pack_bytes(
                *[PAGE_BYTES] * 4, layout=pages.LAYOUT
            )
            pool, views = pages.pool_views(4, PAGE_BYTES)
            assert await store.batch_get(keys, views) == [True] * 4
            assert bytes(pool) == b"".join(data)

    run(body())


@pytest.mark.parametrize("io_threads, cpus", [(1, 8), (4, 8), (4, 1)])
def test_large_batches_read_with_helper_threads_or_without(
    tmp_path, pages, monkeypatch, io_threads, cpus
):
    """A batch of 6 MiB shares its page-cache copies with the C reader's threads, one per
    512 KiB; at most one per core and per worker, none with one core or one worker."""
    monkeypatch.setattr(file_read_module, "CPUS", cpus)
    asked = []
    real = file_read_module.pageio

    class Spy:
        def read_stretches(self, *args):
            asked.append(args[4])  # (work, keys, layout, codes, threads, window_bytes)
            return real.read_stretches(*args)

    monkeypatch.setattr(file_read_module, "pageio", Spy())
    root = tmp_path / "kv"
    page_bytes = 256 << 10
    keys = [pages.key(i) for i in range(24)]
    data = [pages.page(k, page_bytes) for k in keys]

    async def body():
        url = f"file://{root}?capacity=1GiB&io_threads={io_threads}"
        async with open_backend(url, layout=pages.LAYOUT) as store:
            assert await store.batch_put(keys[:12], data[:12]) == [True] * 12
            assert await store.batch_put(keys[12:], data[12:]) == [True] * 12
            order = keys[6:] + [pages.key(99)] + keys[:6]  # two batches, a gap, out of order
            pool, views = pages.pool_views(len(order), page_bytes)
            expected = [True] * 18 + [False] + [True] * 6
            for _ in range(3):
                assert await store.batch_get(order, views) == expected
                got = [bytes(v) for v, ok in zip(views, expected, strict=True) if ok]
                assert got == data[6:] + data[:6]
            threads = min(12, io_threads, cpus)
            assert asked and set(asked) == {threads}
            assert store.stats().num_corrupt_total == 0

    run(body())


def test_a_stretch_read_in_part_keeps_its_checked_pages_and_reads_the_rest_again(
    tmp_path, pages, monkeypatch
):
    """Where the C reader leaves some pages of a stretch unread (the page cache gave it only in
    part: code 0), the pages it read and checked are served as they are and only the others
    are read again, page by page (their buffers poisoned here first, so a page that was not
    read again would be served wrong)."""
    real = file_read_module.pageio
    left_unread = []

    class InPart:
        def read_stretches(self, work, keys, layout, codes, threads, window_bytes):
            got = real.read_stretches(work, keys, layout, codes, threads, window_bytes)
            for _, _, buffers, first in work:
                last = first + len(buffers) // 2 - 1
                if last > first:  # the stretch's last page "did not arrive"
                    codes[last] = 0
                    buffers[-1][:] = b"\xee" * len(buffers[-1])
                    left_unread.append(last)
            return got

    read_again = []
    real_read_page = file_read_module.BatchRead._read_page

    def read_page(self, i):
        read_again.append(i)
        return real_read_page(self, i)

    monkeypatch.setattr(file_read_module, "pageio", InPart())
    monkeypatch.setattr(file_read_module.BatchRead, "_read_page", read_page)
    root = tmp_path / "kv"
    keys = [pages.key(i) for i in range(16)]
    data = [pages.page(k, PAGE_BYTES) for k in keys]

    async def body():
        async with open_backend(f"file://{root}?capacity=1MiB", layout=pages.LAYOUT) as store:
            assert await store.batch_put(keys, data) == [True] * 16  # one pack
            pool, views = pages.pool_views(16, PAGE_BYTES)
            assert await store.batch_get(keys, views) == [True] * 16
            assert [bytes(v) for v in views] == data
            assert left_unread and sorted(read_again) == sorted(left_unread)
            assert store.stats().num_corrupt_total == 0

    run(body())


def test_helpers_that_never_start_do_not_hold_up_a_read(tmp_path, pages, monkeypatch):
    """With every other worker busy, the worker reading a batch copies all of it itself and
    returns without waiting for its queued helpers (were it to wait, the read would time out
    into misses)."""
    monkeypatch.setattr(file_read_module, "CPUS", 8)
    monkeypatch.setattr(file_read_module, "_HELPER_BYTES", 64 << 10)
    page_bytes = 64 << 10
    keys = [pages.key(i) for i in range(16)]
    data = [pages.page(k, page_bytes) for k in keys]

    async def body():
        url = f"file://{tmp_path}/kv?capacity=1GiB&io_threads=2&timeout=5s"
        async with open_backend(url, layout=pages.LAYOUT) as store:
            assert await store.batch_put(keys, data) == [True] * 16
            release = threading.Event()
            busy = [store._io.submit(release.wait, 30)]  # the read takes the other worker
            try:
                pool, views = pages.pool_views(16, page_bytes)
                for _ in range(3):
                    assert await store.batch_get(keys, views) == [True] * 16
                    assert bytes(pool) == b"".join(data)
            finally:
                release.set()
            assert all(f.result() for f in busy)
            assert await store.batch_get(keys, views) == [True] * 16  # helpers run again

    run(body())


def test_lru_evicts_the_least_recently_read(tmp_path, pages):
    object_bytes = pack_bytes(PAGE_BYTES, layout=pages.LAYOUT)
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


def test_eviction_takes_a_whole_pack(tmp_path, pages):
    root = tmp_path / "kv"
    size = pack_bytes(*[PAGE_BYTES] * 3, layout=pages.LAYOUT)
    batches = [[pages.key(i, salt=str(b)) for i in range(3)] for b in range(17)]

    async def body():
        url = f"file://{root}?capacity={16 * size + 100}"  # 16 packs of 3 pages
        async with open_backend(url, layout=pages.LAYOUT) as store:
            for keys in batches:
                await store.batch_put(keys, [pages.page(k, PAGE_BYTES) for k in keys])
            assert [await store.batch_exists(keys) for keys in batches] == [0] + [3] * 16
            assert store.stats().num_evictions == 3
            assert ledger(root) == on_disk(root) == (16 * size, 48)

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
    capacity = 20 * pack_bytes(PAGE_BYTES, layout=pages.LAYOUT) + 100

    async def body():
        async with open_backend(f"file://{root}?capacity={capacity}", layout=pages.LAYOUT) as s:
            for batch in range(15):
                keys = [pages.key(i, salt=str(batch)) for i in range(8)]
                assert (
                    await s.batch_put(keys, [pages.page(k, PAGE_BYTES) for k in keys]) == [True] * 8
                )
                assert on_disk(root)[0] <= capacity
                assert ledger(root) == on_disk(root)
            assert s.stats().num_evictions == 15 * 8 - on_disk(root)[1]

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
    stored_bytes, links = on_disk(root)
    assert stored_bytes <= capacity
    assert ledger(root) == (stored_bytes, links)
    assert temp_files(root) == []
    for path in page_files(root):
        key = bytes.fromhex(path.name)
        payload = decode_object(read_object(str(path), key), key, pages.LAYOUT)
        assert bytes(payload) == pages.page(key, page_bytes)  # written by either: intact


def test_the_ledger_is_rebuilt_after_drift(tmp_path, pages):
    """A writer that died between linking and its ledger update, or names removed by hand."""
    root = tmp_path / "kv"
    keys = [pages.key(i) for i in range(6)]
    five = pack_bytes(*[PAGE_BYTES] * 5, layout=pages.LAYOUT)

    async def body():
        async with open_backend(f"file://{root}?capacity=1MiB", layout=pages.LAYOUT) as store:
            await store.batch_put(keys[:5], [pages.page(k, PAGE_BYTES) for k in keys[:5]])
            for key in keys[:2]:
                os.unlink(page_path(str(root), key))  # removed by hand
            orphan = page_path(str(root), keys[5])  # linked in by a writer that then died
            os.makedirs(os.path.dirname(orphan), exist_ok=True)
            Path(orphan).write_bytes(encode_object(keys[5], pages.LAYOUT, bytes(PAGE_BYTES)))
            assert ledger(root) == (five, 5)  # stale: 4 names, two files
            await store.rescan()
            assert ledger(root) == on_disk(root) == (five + os.path.getsize(orphan), 4)
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
    real_read = file_read_module._read_waiting

    stuck, finished = threading.Event(), threading.Event()

    def slow_read(*args):
        stuck.wait(60)  # a hung mount, until the test lets it go on
        try:
            return real_read(*args)
        finally:
            finished.set()

    async def body():
        url = f"file://{root}?capacity=1MiB&timeout=200ms"
        async with open_backend(url, layout=pages.LAYOUT) as store:
            await store.batch_put([key], [pages.page(key, PAGE_BYTES)])
            store._reader.nowait = False  # as on NFS: every read may wait, none goes straight in
            monkeypatch.setattr(file_read_module, "_read_waiting", slow_read)
            pool, views = pages.pool_views(1, PAGE_BYTES)
            # the read is stuck until let go: a miss here is the call's own timeout
            assert await asyncio.wait_for(store.batch_get([key], views), 60) == [False]
            stuck.set()
            assert await asyncio.to_thread(finished.wait, 60)  # the stuck read finishes now
            assert bytes(pool) == b"\xa5" * PAGE_BYTES
            assert store.stats().num_timeouts == 1
            monkeypatch.setattr(file_read_module, "_read_waiting", real_read)
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


def hook_fsyncs(monkeypatch, seen, *, failing) -> None:
    """Route the file backend's fsyncs (os.fsync, and the C extension's sync_all) through
    `seen(target)`, an fd or a path, each then synced for real; while `failing()`, each fails
    with EIO instead (as a disk that refuses a flush: os.fsync raises, sync_all reports it)."""
    real_fsync = os.fsync

    def fsync(fd):
        seen(fd)
        if failing():
            raise OSError(errno.EIO, "injected")
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    real = file_write_module.pageio

    class Hooked:
        def __getattr__(self, name):
            return getattr(real, name)

        @staticmethod
        def sync_all(targets, threads):
            for target in targets:
                seen(target)
            return [errno.EIO] * len(targets) if failing() else real.sync_all(targets, threads)

    monkeypatch.setattr(file_write_module, "pageio", Hooked())


def test_fsync_mode_syncs_every_pack_and_folder_before_answering(tmp_path, pages, monkeypatch):
    """What put made durable, seen from the calls themselves (they still run): the inode of
    every pack and every folder that got a page name, fsynced before batch_put returned."""
    root = tmp_path / "kv"
    keys = [pages.key(i) for i in range(40)]
    synced: set[int] = set()

    def note(target) -> None:
        synced.add(os.fstat(target).st_ino if isinstance(target, int) else os.stat(target).st_ino)

    hook_fsyncs(monkeypatch, note, failing=lambda: False)

    async def body():
        url = f"file://{root}?capacity=64MiB&fsync=true&io_threads=4"
        async with open_backend(url, layout=pages.LAYOUT) as store:
            views = [pages.page(k, 128 << 10) for k in keys]  # 5 MiB: several packs
            assert await store.batch_put(keys, views) == [True] * len(keys)
            paths = [page_path(str(root), key) for key in keys]
            assert len({os.stat(p).st_ino for p in paths}) > 1
            assert {os.stat(p).st_ino for p in paths} <= synced
            assert {os.stat(os.path.dirname(p)).st_ino for p in paths} <= synced

    run(body())


def test_fsync_mode_makes_every_folder_durable_when_it_opens(tmp_path, pages, monkeypatch):
    """With fsync=true the 256 page folders are made at open and the folders above them
    fsynced (a put then syncs only the folders its names went into); without, none is made
    before a page needs it."""
    synced: set[str] = set()

    def note(target) -> None:
        path = f"/proc/self/fd/{target}" if isinstance(target, int) else target
        synced.add(os.path.realpath(path))

    hook_fsyncs(monkeypatch, note, failing=lambda: False)
    hexes = "0123456789abcdef"

    async def body():
        for fsync in ("true", "false"):
            root = tmp_path / fsync / "kv"
            url = f"file://{root}?capacity=1MiB&fsync={fsync}"
            async with open_backend(url, layout=pages.LAYOUT) as store:
                await store.connect()
            folders = sorted(p.relative_to(root).as_posix() for p in root.glob("*/*"))
            if fsync == "true":
                assert folders == [f"{a}/{b}" for a in hexes for b in hexes]
                above = [root.parent, root, *(root / a for a in hexes)]
                assert {os.path.realpath(p) for p in above} <= synced
            else:
                assert folders == []

    run(body())


def test_a_failed_fsync_fails_the_batch_and_the_next_one_stores(tmp_path, pages, monkeypatch):
    """The disk refuses a flush (EIO, injected at the fsync calls): a put with fsync=true that
    cannot be made durable is not acknowledged, all False; the store goes on. (The batch is
    synced in one round after it is linked: one fault, as on the C path before.)"""
    root = tmp_path / "kv"
    keys = [pages.key(i) for i in range(8)]
    failing = [False]
    hook_fsyncs(monkeypatch, lambda target: None, failing=lambda: failing[0])

    async def body():
        url = f"file://{root}?capacity=64MiB&fsync=true"
        async with open_backend(url, layout=pages.LAYOUT) as store:
            await store.connect()
            failing[0] = True
            data = [pages.page(k, 64 << 10) for k in keys]
            assert await store.batch_put(keys[:4], data[:4]) == [False] * 4
            assert store.stats().num_errors == 1
            failing[0] = False
            assert await store.batch_put(keys[4:], data[4:]) == [True] * 4
            assert await store.batch_put(keys[:4], data[:4]) == [True] * 4
            assert temp_files(root) == [] and ledger(root) == on_disk(root)

    run(body())


def test_a_pack_grown_on_disk_still_serves_its_pages(tmp_path, pages):
    """Bytes past a pack's objects are never read (a table that points past the page's size
    is refused unread: `huge_length_in_table` above)."""
    root = tmp_path / "kv"
    key = pages.key(0)

    async def body():
        async with open_backend(f"file://{root}?capacity=1MiB", layout=pages.LAYOUT) as store:
            await store.batch_put([key], [pages.page(key, 100)])
            os.truncate(page_path(str(root), key), 64 << 20)  # sparse: cheap to make
            _, views = pages.pool_views(1, 100)
            assert await store.batch_get([key], views) == [True]
            assert bytes(views[0]) == pages.page(key, 100)

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


def test_writes_that_stop_short_are_resumed(tmp_path, pages, monkeypatch):
    """A write may take fewer bytes than asked (a signal, a nearly full disk)."""
    real_writev = os.writev

    def short_writev(fd, buffers):
        return real_writev(fd, [memoryview(buffers[0])[:777]])

    keys = [pages.key(i) for i in range(3)]
    data = [pages.page(k, 5000) for k in keys]

    async def body():
        url = f"file://{tmp_path / 'kv'}?capacity=1MiB"
        async with open_backend(url, layout=pages.LAYOUT) as s:
            monkeypatch.setattr(os, "writev", short_writev)
            assert await s.batch_put(keys, data) == [True] * 3
            monkeypatch.setattr(os, "writev", real_writev)
            pool, views = pages.pool_views(3, 5000)
            assert await s.batch_get(keys, views) == [True] * 3
            assert bytes(pool) == b"".join(data)

    run(body())


def test_a_key_twice_in_one_batch(tmp_path, pages):
    root = tmp_path / "kv"
    keys = [pages.key(0), pages.key(1), pages.key(0)]
    data = [pages.page(k, PAGE_BYTES) for k in keys]

    async def body():
        async with open_backend(f"file://{root}?capacity=1MiB", layout=pages.LAYOUT) as store:
            assert await store.batch_put(keys, data) == [True] * 3
            size = pack_bytes(*[PAGE_BYTES] * 3, layout=pages.LAYOUT)
            assert ledger(root) == on_disk(root) == (size, 2)
            assert temp_files(root) == []
            pool, views = pages.pool_views(2, PAGE_BYTES)
            assert await store.batch_get(keys[:2], views) == [True, True]
            assert await store.delete(keys[:2]) == 2
            assert ledger(root) == on_disk(root) == (0, 0)

    run(body())


def test_a_filesystem_without_hard_links_gets_a_file_per_page(tmp_path, pages, monkeypatch):
    """Some FUSE mounts refuse link(2): every pack then holds one page, renamed into place."""

    def no_links(source, target):
        raise PermissionError(1, "Operation not permitted", source)

    monkeypatch.setattr(file_space_module.os, "link", no_links)
    root = tmp_path / "kv"
    keys = [pages.key(i) for i in range(4)]
    data = [pages.page(k, PAGE_BYTES) for k in keys]

    async def body():
        async with open_backend(f"file://{root}?capacity=1MiB", layout=pages.LAYOUT) as store:
            assert await store.batch_put(keys, data) == [True] * 4
            assert await store.batch_put(keys[:1], data[:1]) == [True]  # replaced
            stats = [os.stat(page_path(str(root), key)) for key in keys]
            assert len({st.st_ino for st in stats}) == 4
            assert {st.st_nlink for st in stats} == {1}
            one = pack_bytes(PAGE_BYTES, layout=pages.LAYOUT)
            assert ledger(root) == on_disk(root) == (4 * one, 4)
            pool, views = pages.pool_views(4, PAGE_BYTES)
            assert await store.batch_get(keys, views) == [True] * 4
            assert bytes(pool) == b"".join(data)
            assert await store.delete(keys[1:3]) == 2
            assert ledger(root) == on_disk(root) == (2 * one, 2)
            assert temp_files(root) == []

    run(body())


def test_one_failed_pack_of_a_batch_fails_its_pages_alone(tmp_path, pages, monkeypatch):
    """A pack whose write fails (a full disk: the C writer's answer for it, its temporary
    file removed) loses its pages only; the batch's other packs are stored, no temporary
    file is left and the ledger matches the disk. (The C writer's own half-way failure is
    test_pageio's, with a real file size limit.)"""
    monkeypatch.setattr(file_write_module, "CPUS", 8)
    root = tmp_path / "kv"
    page_bytes = 256 << 10
    keys = [pages.key(i) for i in range(24)]  # three packs of eight pages
    data = [pages.page(k, page_bytes) for k in keys]
    real = file_write_module.pageio

    class DiskFullForTheMiddlePack:
        def __getattr__(self, name):
            return getattr(real, name)

        @staticmethod
        def write_packs(work, *args):
            errors = real.write_packs(work, *args)
            for i, pack in enumerate(work):
                if keys[12] in bytes(pack[1]):  # the pack's table names its keys
                    os.unlink(pack[0])
                    errors[i] = errno.ENOSPC
            return errors

    monkeypatch.setattr(file_write_module, "pageio", DiskFullForTheMiddlePack())

    async def body():
        url = f"file://{root}?capacity=1GiB&io_threads=3"
        async with open_backend(url, layout=pages.LAYOUT) as store:
            assert await store.batch_put(keys, data) == [True] * 8 + [False] * 8 + [True] * 8
            assert store.stats().num_errors == 8
            assert temp_files(root) == []
            assert ledger(root) == on_disk(root)
            pool, views = pages.pool_views(24, page_bytes)
            assert await store.batch_get(keys, views) == [True] * 8 + [False] * 8 + [True] * 8

    run(body())


def test_a_pack_whose_file_cannot_be_made_fails_its_pages_alone(tmp_path, pages, monkeypatch):
    """The middle pack's folder is a file: that pack cannot be created, and a page of another
    pack named in that folder cannot be linked; every other page is stored."""
    monkeypatch.setattr(file_write_module, "CPUS", 8)
    root = tmp_path / "kv"
    keys = [pages.key(i) for i in range(24)]  # three packs of eight pages
    data = [pages.page(k, 256 << 10) for k in keys]
    blocked = os.path.dirname(page_path(str(root), keys[8]))  # the middle pack's temp goes here
    os.makedirs(os.path.dirname(blocked))
    Path(blocked).write_bytes(b"")
    expected = [
        not 8 <= i < 16 and os.path.dirname(page_path(str(root), key)) != blocked
        for i, key in enumerate(keys)
    ]

    async def body():
        url = f"file://{root}?capacity=1GiB&io_threads=3"
        async with open_backend(url, layout=pages.LAYOUT) as store:
            assert await store.batch_put(keys, data) == expected
            assert store.stats().num_errors == expected.count(False)
            assert temp_files(root) == []
            assert ledger(root) == on_disk(root)
            pool, views = pages.pool_views(24, 256 << 10)
            assert await store.batch_get(keys, views) == expected

    run(body())


def test_writes_past_the_file_size_limit_fail_and_count_nothing(tmp_path, pages, file_size_limit):
    """Every pack fails half-way (a real write error: the process's file size limit): all
    pages False and counted as errors, no temporary file left, the ledger as before; once
    the limit is lifted the same batch is stored."""
    root = tmp_path / "kv"
    keys = [pages.key(i) for i in range(16)]
    data = [pages.page(k, 256 << 10) for k in keys]

    async def body():
        async with open_backend(f"file://{root}?capacity=1GiB", layout=pages.LAYOUT) as store:
            assert await store.batch_put(keys[:2], data[:2]) == [True, True]
            before = ledger(root)
            with file_size_limit(64 << 10):
                assert await store.batch_put(keys[2:], data[2:]) == [False] * 14
            assert store.stats().num_errors == 14
            assert temp_files(root) == []
            assert ledger(root) == before == on_disk(root)
            assert await store.batch_put(keys[2:], data[2:]) == [True] * 14
            assert ledger(root) == on_disk(root)

    run(body())


def test_a_large_batch_is_framed_and_written_in_parallel_packs(tmp_path, pages, monkeypatch):
    """Each pack of a large batch is framed, written and linked by its own thread."""
    monkeypatch.setattr(file_write_module, "CPUS", 8)
    root = tmp_path / "kv"
    page_bytes = 256 << 10
    keys = [pages.key(i) for i in range(24)]  # 6 MiB: three packs of about 2 MiB
    data = [pages.page(k, page_bytes) for k in keys]

    async def body():
        url = f"file://{root}?capacity=1GiB&io_threads=3"
        async with open_backend(url, layout=pages.LAYOUT) as store:
            assert await store.batch_put(keys, data) == [True] * 24
            packs = [os.stat(page_path(str(root), key)).st_ino for key in keys]
            assert len(set(packs)) == 3
            assert packs == sorted(packs, key=packs.index)  # each pack a run of the batch
            assert ledger(root) == on_disk(root)
            object_bytes = header_size(pages.LAYOUT) + page_bytes
            assert store.stats().written_bytes == 24 * object_bytes
            pool, views = pages.pool_views(24, page_bytes)
            assert await store.batch_get(keys, views) == [True] * 24
            assert bytes(pool) == b"".join(data)

    run(body())


@pytest.mark.parametrize("way", ["stretches", "page_by_page", "lz4"])
def test_pages_in_pieces_are_read_straight_into_them_every_way(tmp_path, pages, way, monkeypatch):
    """A page in pieces (an engine's page, one piece per layer) is read into its pieces by
    each of the reader's ways: the C reader's stretches (200 pieces a page: a stretch stops
    at 1024 buffers), page by page through the chunk buffer (as on NFS), and whole and
    decoded aside (lz4). A damaged one is a miss whichever way, its reason counted."""
    root = tmp_path / "kv"
    num_pages, num_pieces, piece_bytes = 12, 200, 301
    keys = [pages.key(i) for i in range(num_pages)]
    data = [pages.page(k, num_pieces * piece_bytes) for k in keys]
    query = ""
    if way == "lz4":  # pages that compress: stored lz4, so never of the size read in place
        query = "&compression=lz4"
        data = [(pages.page(k, 600) * num_pieces)[: num_pieces * piece_bytes] for k in keys]
    checked_in_c = []  # pages the C reader's stretches checked, per call
    real = file_read_module.pageio

    def read_stretches(work, *args):
        got = real.read_stretches(work, *args)
        checked_in_c.append(sum(code == 1 for code in args[2]))
        assert all(len(buffers) // 2 * (1 + num_pieces) <= 1024 for _, _, buffers, _ in work)
        return got

    monkeypatch.setattr(
        file_read_module, "pageio", types.SimpleNamespace(read_stretches=read_stretches)
    )

    def scattered(buffer: bytearray) -> list[list[memoryview]]:  # a gap of 3 between pieces
        view, stride = memoryview(buffer), piece_bytes + 3
        return [
            [view[(p * num_pieces + j) * stride :][:piece_bytes] for j in range(num_pieces)]
            for p in range(num_pages)
        ]

    source = bytearray(num_pages * num_pieces * (piece_bytes + 3))
    for pieces, page in zip(scattered(source), data, strict=True):
        for j, piece in enumerate(pieces):
            piece[:] = page[j * piece_bytes : (j + 1) * piece_bytes]

    async def body():
        async with open_backend(
            f"file://{root}?capacity=64MiB{query}", layout=pages.LAYOUT
        ) as store:
            assert await store.batch_put(keys, scattered(source)) == [True] * num_pages
            if way == "page_by_page":
                store._reader.nowait = False
            target = bytearray(len(source))
            assert await store.batch_get(keys, scattered(target)) == [True] * num_pages
            assert target == source  # the pieces got their bytes; the gaps stayed zero
            assert sum(checked_in_c) == (num_pages if way == "stretches" else 0)
            bad = bytearray(encode_object(keys[4], pages.LAYOUT, data[4]))
            bad[-7] ^= 0x01
            assert await store.batch_put_objects(keys[4:5], [bytes(bad)], verify=False) == [True]
            found = await store.batch_get(keys, scattered(bytearray(len(source))))
            assert found == [i != 4 for i in range(num_pages)]
            assert store.stats().num_corrupt == {"checksum": 1}

    run(body())
