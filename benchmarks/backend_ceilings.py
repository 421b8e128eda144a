"""The ceilings of bench_backends.py: for each backend, the raw baseline it is held to
(memcpy, raw file writes and reads, bare os calls per file and per pack, aiofiles, plain
redis-py, the raw Mooncake client, SGLang's own Mooncake backend), each as the timed put and
get of a `Workload` (backend_workload.py). The runner in bench_backends.py pairs them with the
backend under test."""

from __future__ import annotations

import asyncio
import importlib.util
import itertools
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np

from benchmarks.backend_servers import raw_mooncake_client
from benchmarks.backend_workload import LAYOUT, Timed, Workload
from storage_backends.native import checks
from storage_backends.objects import header_size


def memcpy_ops(work: Workload) -> tuple[Timed, Timed]:
    stored: dict[bytes, bytes] = {}

    async def put() -> None:
        for keys in work.batches:
            for key, page in zip(keys, work.pages, strict=True):
                stored[key] = bytes(memoryview(page))  # a copy: bytes(bytes) would not be

    async def get() -> None:
        for keys in work.batches:
            for key, view in zip(keys, work.into, strict=True):
                view[:] = stored[key]

    return put, get


def raw_file_ops(directory: Path, work: Workload, *, fsync: str) -> tuple[Timed, Timed]:
    """Write / read one large file of the workload's bytes; `fsync`: "none", "end" (once,
    after the last byte: the issue's ceiling) or "batch" (after each batch's bytes)."""

    def path() -> Path:
        return directory / f"ceiling-{fsync}-{work.rep}.bin"

    async def put() -> None:
        fd = os.open(path(), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for _ in work.batches:
                for page in work.pages:
                    os.write(fd, page)
                if fsync == "batch":
                    os.fsync(fd)
            if fsync == "end":
                os.fsync(fd)
        finally:
            os.close(fd)

    async def get() -> None:
        fd = os.open(path(), os.O_RDONLY)
        try:
            for _ in work.batches:
                for view in work.into:
                    os.readv(fd, [view])
        finally:
            os.close(fd)

    return put, get


def per_file_ops(directory: Path, work: Workload) -> tuple[Timed, Timed]:
    """The file backend's layout with bare os calls (temp + rename, open + read): what one
    file per page costs on this filesystem before any of hicache's work."""
    header = bytes(header_size(LAYOUT))
    made: set[Path] = set()

    def path_of(key: bytes) -> Path:
        name = key.hex()
        return directory / "per-file" / name[:2] / name[2:4] / name

    async def put() -> None:
        for keys in work.batches:
            for key, page in zip(keys, work.pages, strict=True):
                final = path_of(key)
                if final.parent not in made:
                    final.parent.mkdir(parents=True, exist_ok=True)
                    made.add(final.parent)
                tmp = f"{final}.tmp"
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.writev(fd, [header, page])
                os.close(fd)
                os.rename(tmp, final)

    async def get() -> None:
        head = bytearray(len(header))
        for keys in work.batches:
            for key, view in zip(keys, work.into, strict=True):
                fd = os.open(path_of(key), os.O_RDONLY)
                os.preadv(fd, [head, view], 0)
                os.close(fd)

    return put, get


def bare_pack_ops(directory: Path, work: Workload) -> tuple[Timed, Timed]:
    """A file per batch read as the file backend reads a pack (one preadv of headers and pages
    per 512 KiB, hicache's xxh3 (native.checks) over every page, one thread) with bare os calls and
    nothing else: the floor of a verified read through packs on this machine (context, not a
    ceiling)."""
    header = bytes(header_size(LAYOUT))
    folder = directory / "bare-packs"
    folder.mkdir(exist_ok=True)
    per_stretch = max(1, (512 << 10) // (len(header) + work.page_bytes))

    async def put() -> None:
        for b, _ in enumerate(work.batches):
            fd = os.open(folder / f"{work.rep}-{b}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.writev(fd, [part for page in work.pages for part in (header, page)])
            os.close(fd)

    async def get() -> None:
        heads = [bytearray(len(header)) for _ in work.into]
        record = len(header) + work.page_bytes
        for b, _ in enumerate(work.batches):
            fd = os.open(folder / f"{work.rep}-{b}", os.O_RDONLY)
            for start in range(0, len(work.into), per_stretch):
                pages = range(start, min(start + per_stretch, len(work.into)))
                os.preadv(fd, [x for i in pages for x in (heads[i], work.into[i])], start * record)
                for i in pages:
                    checks.xxh3_64(heads[i], work.into[i])  # the page checksum hicache uses
            os.close(fd)

    return put, get


def aiofiles_ops(directory: Path, work: Workload) -> tuple[Timed, Timed]:
    """The same files as the file backend (header + page, temp + rename), via aiofiles."""
    import aiofiles
    import aiofiles.os

    header = bytes(header_size(LAYOUT))

    def path_of(key: bytes) -> Path:
        name = key.hex()
        return directory / "aio" / name[:2] / name[2:4] / name

    async def put_one(key: bytes, page: bytes) -> None:
        final = path_of(key)
        await aiofiles.os.makedirs(final.parent, exist_ok=True)
        tmp = final.with_name(final.name + ".tmp")
        async with aiofiles.open(tmp, "wb") as f:
            await f.write(header)
            await f.write(page)
        await aiofiles.os.rename(tmp, final)

    async def get_one(key: bytes, view: memoryview) -> None:
        async with aiofiles.open(path_of(key), "rb", buffering=0) as f:
            await f.read(len(header))
            await f.readinto(view)

    async def put() -> None:
        for keys in work.batches:
            await asyncio.gather(*(put_one(k, p) for k, p in zip(keys, work.pages, strict=True)))

    async def get() -> None:
        for keys in work.batches:
            await asyncio.gather(*(get_one(k, v) for k, v in zip(keys, work.into, strict=True)))

    return put, get


def plain_redis_ops(port: int, work: Workload) -> tuple[Timed, Timed, Timed]:
    import redis.asyncio as aredis

    client = aredis.Redis(host="127.0.0.1", port=port)

    async def put() -> None:
        for keys in work.batches:
            pipe = client.pipeline(transaction=False)
            for key, page in zip(keys, work.pages, strict=True):
                pipe.set(b"plain:" + key, page)
            await pipe.execute()

    async def get() -> None:
        for keys in work.batches:
            pipe = client.pipeline(transaction=False)
            for key in keys:
                pipe.get(b"plain:" + key)
            values = await pipe.execute()
            assert all(v is not None for v in values)

    async def close() -> None:
        await client.flushdb()
        await client.aclose()

    return put, get, close


def raw_mooncake_ops(
    address: str, work: Workload, *, extra_bytes: int = 0, threaded: bool = False
) -> tuple[Timed, Timed, Timed]:
    """The Mooncake client alone: the batch's pages in one registered buffer, put with
    `batch_put_from` under fresh names each repetition, read back with `batch_get_into` into
    the workload's pool (registered too). With `extra_bytes`, objects that much larger than
    a page (a framed page's size: context), from and into buffers of their own. `threaded`:
    each call made on a worker thread and awaited, as an asyncio caller must make a blocking
    call (context: what the hand-off to a thread and back costs). With the workload's
    `streams` > 1, every call is made on a thread, one for each stream, all at once."""
    from storage_backends.workers import WorkerPool

    threaded = threaded or work.streams > 1
    streams = range(work.streams if threaded else 0)  # calls made inline need no thread
    pools = [WorkerPool(1, thread_name_prefix=f"raw-mooncake-{j}") for j in streams]
    client = raw_mooncake_client(address, pools[0] if pools else None)
    size, num = work.page_bytes + extra_bytes, len(work.pages)
    if extra_bytes:
        rng = np.random.default_rng(work.seed)
        source = rng.integers(0, 256, size * num * work.streams, dtype=np.uint8)
        target = np.zeros(size * num * work.streams, dtype=np.uint8)
    else:
        source = np.frombuffer(work.source, dtype=np.uint8)
        target = np.frombuffer(work.pool, dtype=np.uint8)
    for array in (source, target):
        if client.register_buffer(array.ctypes.data, array.nbytes) != 0:
            raise RuntimeError("the raw Mooncake client could not register a buffer")
    sources, targets = (
        [
            [array.ctypes.data + (j * num + i) * size for i in range(num)]
            for j in range(work.streams)
        ]
        for array in (source, target)
    )
    sizes = [size] * num
    prefix = f"raw{extra_bytes}{'t' if threaded else ''}:"

    def names(keys: list[bytes]) -> list[str]:
        return [prefix + key.hex() for key in keys]

    async def call(stream: int, method: Callable, *args: object) -> list[int]:
        if not threaded:
            return method(*args)
        return await asyncio.wrap_future(pools[stream].submit(method, *args))

    def moving(method: Callable, addresses: list[list[int]], want: int, op: str) -> Timed:
        """Every stream's batches moved by `method` at once, each code checked for `want`."""

        async def stream(j: int, batches: list[list[bytes]]) -> None:
            for keys in batches:
                codes = await call(j, method, names(keys), addresses[j], sizes)
                assert all(code == want for code in codes), f"raw {op} failed: {codes}"

        async def run() -> None:
            await asyncio.gather(
                *itertools.starmap(stream, enumerate(work.streams_of(work.batches)))
            )

        return run

    put = moving(client.batch_put_from, sources, 0, "put")
    get = moving(client.batch_get_into, targets, size, "get")

    async def forget(batches: list[list[bytes]]) -> None:
        for keys in batches:
            client.batch_remove(names(keys), True)

    work.forgetters.append(forget)

    async def close() -> None:
        for keys in work.all_batches:
            client.batch_remove(names(keys), True)
        client.unregister_buffer(source.ctypes.data)
        client.unregister_buffer(target.ctypes.data)
        client.close()
        for pool in pools:
            pool.shutdown()

    return put, get, close


SGLANG_LAYER_BYTES = 2 * 16 * 8 * 128 * 2  # K and V of 16 tokens, 8 heads of 128, bf16


def sglang_mooncake_ops(address: str, work: Workload) -> tuple[Timed, Timed, Timed]:
    """SGLang's own Mooncake backend (`MooncakeStore`, v1 API) on the same store, with its
    real host pool on the CPU (tests/support/sglang_cpu): an MHA page_first pool whose pages
    are the workload's size (16 tokens, 8 heads of 128, bf16; one layer per 64 KiB). It
    puts a batch's pages from the pool's first half and reads them into its second, as its
    HiCache controller does: no header, no checksum (its K and V are an object each)."""
    tokens, layers = 16, work.page_bytes // SGLANG_LAYER_BYTES
    if layers < 1 or layers * SGLANG_LAYER_BYTES != work.page_bytes:
        raise ValueError(f"no SGLang MHA page of {work.page_bytes} bytes (64 KiB multiples)")
    from tests.support import sglang_cpu

    sglang_cpu.install()  # the guards SGLang's host pools need on a CPU-only machine
    import torch
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
    from sglang.srt.mem_cache.storage.mooncake_store.mooncake_store import MooncakeStore

    num_pages = len(work.pages)
    pool = sglang_cpu.host_pool(
        "mha", "page_first", layer_num=layers, page_size=tokens, num_pages=2 * num_pages,
        head_num=8, head_dim=128,
    )  # fmt: skip
    raw = pool.kv_buffer.view(torch.uint8)
    seeded = torch.Generator().manual_seed(work.seed)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=seeded))
    os.environ.update(
        MOONCAKE_MASTER=address, MOONCAKE_PROTOCOL="tcp", MOONCAKE_DEVICE="",
        MOONCAKE_TE_META_DATA_SERVER="P2PHANDSHAKE", MOONCAKE_GLOBAL_SEGMENT_SIZE="0",
        MOONCAKE_LOCAL_HOSTNAME="127.0.0.1",
    )  # fmt: skip
    config = HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
        model_name="bench/sglang", extra_config={},
    )  # fmt: skip
    store = MooncakeStore(config, pool)
    store.register_mem_pool_host(pool)
    written = torch.arange(num_pages * tokens)
    read = torch.arange(num_pages * tokens, 2 * num_pages * tokens)

    def names(keys: list[bytes]) -> list[str]:
        return ["sglang-" + key.hex() for key in keys]

    async def put() -> None:
        for keys in work.batches:
            assert all(store.batch_set_v1(names(keys), written)), "sglang put failed"

    async def get() -> None:
        for keys in work.batches:
            assert all(store.batch_get_v1(names(keys), read)), "sglang get missed"

    async def forget(batches: list[list[bytes]]) -> None:
        for keys in batches:
            objects = [f"{n}_{store.mha_suffix}_{kv}" for n in names(keys) for kv in "kv"]
            store.store.batch_remove(objects, True)

    work.forgetters.append(forget)

    async def close() -> None:
        await forget(work.all_batches)
        store.close()

    return put, get, close


def sglang_missing() -> str | None:
    """Why SGLang's Mooncake backend cannot be measured here, or None."""
    if importlib.util.find_spec("sglang") is None:
        return "sglang is not installed"
    from tests.support.sglang_cpu import TEST_SITE

    if importlib.util.find_spec("torchvision") is None and not TEST_SITE.is_dir():
        return f"no torchvision for SGLang's imports (.ci/run puts one in {TEST_SITE.name})"
    return None
