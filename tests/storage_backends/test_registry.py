"""Opening backends by URL: typed options, clear errors, lazy client imports."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest

from storage_backends import (
    BackendConfigError,
    BackendUnavailableError,
    known_schemes,
    open_backend,
    parse_duration,
    parse_size,
    register_backend,
)
from storage_backends.file_store import FileBackend
from storage_backends.memory_store import MemoryBackend
from storage_backends.options import redact_url
from storage_backends.redis_store import RedisBackend

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "text, expected",
    [
        ("8GiB", 8 << 30),
        ("100GB", 100 * 10**9),
        ("512MiB", 512 << 20),
        ("64kib", 64 << 10),
        ("1.5GiB", 3 << 29),
        ("4096", 4096),
        ("10 B", 10),
        ("2TB", 2 * 10**12),
    ],
)
def test_sizes(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["8 gigs", "GiB", "-1GiB", "1.3B", "", "8Gi", "0x10"])
def test_bad_sizes_name_the_option(text):
    with pytest.raises(BackendConfigError, match="capacity: .* is not"):
        parse_size(text, name="capacity")


@pytest.mark.parametrize(
    "text, seconds", [("250ms", 0.25), ("2s", 2.0), ("1.5", 1.5), ("5m", 300.0), ("1h", 3600.0)]
)
def test_durations(text, seconds):
    assert parse_duration(text) == pytest.approx(seconds)


def test_memory_url_options():
    store = open_backend("memory://?capacity=8GiB&timeout=250ms&compression=lz4", layout="L")
    assert isinstance(store, MemoryBackend)
    assert store.options.capacity_bytes == 8 << 30
    assert store.options.timeout_s == pytest.approx(0.25)
    assert store.options.compression == "lz4"


def test_file_url_options(tmp_path):
    url = f"file://{tmp_path}/kv?capacity=100GiB&fsync=true&io_threads=8&scan_interval=1m"
    store = open_backend(url, layout="L")
    assert isinstance(store, FileBackend)
    assert store.root == f"{tmp_path}/kv"
    assert (store.options.capacity_bytes, store.options.fsync) == (100 << 30, True)
    assert (store.options.io_threads, store.options.scan_interval_s) == (8, 60.0)


def test_redis_url_options():
    store = open_backend("redis://alice:s3cret@cache.local:6380/3?prefix=ns1:&ttl=1h", layout="L")
    assert isinstance(store, RedisBackend)
    opts = store.options
    assert (opts.nodes, opts.db, opts.username, opts.password) == (
        (("cache.local", 6380),),
        3,
        "alice",
        "s3cret",
    )
    assert (opts.prefix, opts.ttl_s, opts.tls, opts.cluster) == ("ns1:", 3600.0, False, False)
    assert "s3cret" not in store.name and "s3cret" not in repr(opts)
    tls = open_backend("rediss://h/0?tls_verify=false", layout="L").options
    assert (tls.tls, tls.tls_verify, tls.nodes) == (True, False, (("h", 6379),))
    cluster = open_backend("redis+cluster://a:7000,b:7001,[::1]:7002", layout="L").options
    assert cluster.cluster and cluster.nodes == (("a", 7000), ("b", 7001), ("::1", 7002))


@pytest.mark.parametrize(
    "url, message",
    [
        ("memory://?capasity=1GiB", r"unknown option 'capasity'; known options: .*capacity"),
        ("memory://?capacity=lots", "capacity: 'lots' is not a size"),
        ("memory://?capacity=0", "capacity must be >= 1"),
        ("memory://?timeout=0", r"timeout must be in \[0.001, 3600.0\]"),
        ("memory://?compression=zstd", "compression must be 'none' or 'lz4'"),
        ("memory://?capacity=1GiB&capacity=2GiB", "given twice"),
        ("memory://host", "takes no host or path"),
        ("file:///tmp/kv", r"needs \?capacity=<size>"),
        ("file://relative/kv?capacity=1GiB", "takes a local path"),
        ("redis://h:notaport/0", "bad port"),
        ("redis://h/zero", "must be a database number"),
        ("redis://a:1,b:2/0", r"use redis\+cluster://"),
        ("redis+cluster://a:1/2", "only database 0"),
        ("redis://h/0?chunk_size=10", r"chunk_size must be in \[1024"),
        (  # the known schemes, sorted (tests in the same process may have added their own)
            "zstd://x",
            r"unknown storage backend 'zstd'; known: (.+, )?file, (.+, )?grpc, grpcs, "
            r"(.+, )?memory, (.+, )?mooncake, (.+, )?redis\b",
        ),
        ("no-scheme", "not a backend URL"),
    ],
)
def test_bad_urls_name_what_is_wrong(url, message):
    with pytest.raises(BackendConfigError, match=message):
        open_backend(url, layout="L")


def test_passwords_never_reach_names_or_errors():
    assert redact_url("redis://u:pw@h:1/0") == "redis://u:***@h:1/0"
    assert redact_url("redis://h:1/0") == "redis://h:1/0"
    with pytest.raises(BackendConfigError) as info:
        open_backend("redis://u:pw@h:1/0?nope=1", layout="L")
    assert "pw" not in str(info.value).replace("***", "")


def test_unreachable_server_fails_loudly_on_first_use(unused_port):
    store = open_backend(f"redis://127.0.0.1:{unused_port}/0?connect_timeout=1s", layout="L")

    async def body():
        with pytest.raises(BackendUnavailableError, match="cannot be reached"):
            await store.batch_exists([bytes(16)])
        await store.close()

    asyncio.run(body())


def test_unwritable_directory_fails_loudly_on_first_use(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    store = open_backend(f"file://{blocker}/kv?capacity=1MiB", layout="L")

    async def body():
        with pytest.raises(BackendUnavailableError, match="cannot be reached"):
            await store.batch_put([bytes(16)], [b"x"])
        await store.close()

    asyncio.run(body())


def test_register_backend():
    calls = []

    def factory(url, *, layout, name):
        calls.append((url, layout, name))
        return open_backend("memory://", layout=layout)

    register_backend("testscheme", factory)
    assert "testscheme" in known_schemes()
    store = open_backend("testscheme://somewhere", layout="L")
    assert isinstance(store, MemoryBackend)
    assert calls == [("testscheme://somewhere", "L", "testscheme://somewhere")]
    with pytest.raises(ValueError, match="already registered"):
        register_backend("testscheme", lambda *a, **k: None)
    with pytest.raises(ValueError, match="bare name"):
        register_backend("grpc://", factory)


def test_client_libraries_are_imported_only_when_their_scheme_is_opened():
    code = (
        "import sys, storage_backends as sb; "
        "sb.open_backend('memory://', layout='L'); "
        "assert 'redis' not in sys.modules, 'redis imported for memory://'; "
        "sb.open_backend('redis://127.0.0.1:1/0', layout='L'); "
        "assert 'redis' in sys.modules; print('ok')"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_a_negative_byte_count_is_not_a_size():
    with pytest.raises(BackendConfigError, match="capacity: -1 is not a size"):
        parse_size(-1, name="capacity")


@pytest.mark.parametrize(
    "url",
    [
        "file:///tmp/kv\x00x?capacity=1MiB",
        "file:///tmp/kv%00x?capacity=1MiB",
        "file:///tmp/kv\nx?capacity=1MiB",
        "redis://127.0.0.1:6379/0?timeout=1\x00",
        "grpc://[::1",
        "redis://[::1",
    ],
)
def test_every_url_mistake_is_a_config_error_naming_the_url(url):
    """(A file:// URL with an embedded NUL used to raise a bare ValueError on first use.)"""
    with pytest.raises(BackendConfigError) as caught:
        open_backend(url, layout="x")
    assert url.split("://")[0] + "://" in str(caught.value)
    assert "\x00" not in str(caught.value) and "\n" not in str(caught.value)


@pytest.mark.parametrize("value", ["1e308", "1000000h", "inf", "nan"])
def test_a_duration_out_of_range_is_refused_by_name(value):
    with pytest.raises(BackendConfigError, match="timeout"):
        open_backend(f"memory://?capacity=1MiB&timeout={value}", layout="x")
