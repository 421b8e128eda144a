"""Authenticity (issue 17): with a tenant secret, a page written by anyone without it is a
miss, counted as forged, on every backend and every read path; without one, nothing changes.

The forger here knows everything but the secret: the page keys (computable from tokens), the
layout, the object format. It writes through the backend's own API with no secret or with
another tenant's, and by hand straight into the directory.
"""

from __future__ import annotations

import asyncio
import struct
from pathlib import Path

import pytest
import xxhash

from storage_backends import BackendConfigError, open_backend
from storage_backends.objects import (
    MAC_BYTES,
    CorruptReason,
    encode_object,
    mac_key_from_secret,
    parse_header,
)
from storage_backends.verify import decode_object, verify_object

from .conftest import BACKENDS

PAGE_BYTES = 4096
KEY = bytes(range(16))
LAYOUT = "mha;layers=2;page=16;kv_heads=2;head_dim=8;dtype=bfloat16"
TENANT = mac_key_from_secret(b"team-a: 32 bytes of real secret!")
OTHER = mac_key_from_secret(b"team-b: 32 bytes of real secret!")


def run(coro):
    return asyncio.run(coro)


def _rechecksum(blob: bytearray, header_bytes: int) -> bytearray:
    """What a forger does after changing bytes: recompute the (unkeyed) checksum."""
    body = bytes(blob[:48]) + bytes(blob[56:])
    struct.pack_into("<Q", blob, 48, xxhash.xxh3_64_intdigest(body))
    return blob


# -- the object format -----------------------------------------------------------------------


def test_a_signed_object_reads_back_only_under_its_key():
    payload = bytes(range(256)) * 16
    blob = encode_object(KEY, LAYOUT, payload, mac_key=TENANT)
    header = parse_header(blob)
    assert header.mac is not None and len(header.mac) == MAC_BYTES
    assert blob[4] == 2  # format version 2: carries a MAC
    assert bytes(decode_object(blob, KEY, LAYOUT, mac_key=TENANT)) == payload
    assert decode_object(blob, KEY, LAYOUT, mac_key=OTHER) is CorruptReason.FORGED
    plain = encode_object(KEY, LAYOUT, payload)  # written without the secret
    assert decode_object(plain, KEY, LAYOUT, mac_key=TENANT) is CorruptReason.FORGED
    # Without a key both read as before: integrity only (and the daemon's check passes both).
    assert bytes(decode_object(blob, KEY, LAYOUT)) == payload
    assert bytes(decode_object(plain, KEY, LAYOUT)) == payload
    assert verify_object(blob, KEY) is None and verify_object(plain, KEY) is None
    assert verify_object(plain, KEY, mac_key=TENANT) is CorruptReason.FORGED


@pytest.mark.parametrize("compression", ["none", "lz4"])
def test_a_changed_byte_with_its_checksum_recomputed_is_forged(compression):
    payload = b"\x01\x02" * 2048
    blob = bytearray(encode_object(KEY, LAYOUT, payload, compression, mac_key=TENANT))
    header_bytes = parse_header(blob).header_bytes
    damaged = bytearray(blob)
    damaged[-1] ^= 1
    assert decode_object(bytes(damaged), KEY, LAYOUT, mac_key=TENANT) is CorruptReason.CHECKSUM
    for at in (len(blob) - 1, header_bytes - 1, 20):  # payload, MAC, key
        forged = bytearray(blob)
        forged[at] ^= 1
        _rechecksum(forged, header_bytes)
        reason = decode_object(bytes(forged), KEY if at != 20 else bytes(forged[16:32]), LAYOUT,
                               mac_key=TENANT)  # fmt: skip
        assert reason is CorruptReason.FORGED, at


def test_a_secret_must_be_long_enough():
    with pytest.raises(ValueError, match="at least 16 bytes"):
        mac_key_from_secret(b"short")


# -- every backend --------------------------------------------------------------------------------


@pytest.fixture
def secrets(tmp_path: Path) -> dict[str, str]:
    paths = {}
    for name, secret in [
        ("a", "team-a: a long random secret 0001"),
        ("b", "another tenant's 0002"),
    ]:
        path = tmp_path / f"secret-{name}"
        path.write_text(secret + "\n")
        path.chmod(0o600)
        paths[name] = str(path)
    return paths


@pytest.fixture(params=[b for b in BACKENDS if b != "memory"])
def backend_url(request: pytest.FixtureRequest):
    """Every shared backend (memory:// is one process's own: nobody else can write to it; the
    daemon's memory store is tested through grpc://)."""
    return request.getfixturevalue(BACKENDS[request.param])


def test_pages_forged_without_the_secret_are_misses_counted_as_forged(backend_url, pages, secrets):
    """team-a writes and reads with its secret; a forger replaces some keys' objects with
    objects of no secret and others with team-b's: team-a's reader misses exactly those,
    counts them as forged (not corrupt), and reads its own pages. The objects API refuses
    them too. A backend whose put keeps what it holds removes them on the first read."""
    base = backend_url()
    sep = "&" if "?" in base else "?"
    url_a = f"{base}{sep}secret_file={secrets['a']}"
    url_b = f"{base}{sep}secret_file={secrets['b']}"
    keys = [pages.key(i, "mac") for i in range(8)]
    data = [pages.page(k, PAGE_BYTES) for k in keys]
    fake = [bytes(PAGE_BYTES) for _ in keys]

    async def body():
        async with open_backend(url_a, layout=pages.LAYOUT) as tenant:
            assert await tenant.batch_put(keys, data) == [True] * 8
            async with open_backend(base, layout=pages.LAYOUT) as nobody:
                assert await nobody.delete(keys[:3]) == 3
                assert await nobody.batch_put(keys[:3], fake[:3]) == [True] * 3
            async with open_backend(url_b, layout=pages.LAYOUT) as other:
                assert await other.delete(keys[3:5]) == 2
                assert await other.batch_put(keys[3:5], fake[3:5]) == [True] * 2
            pool, views = pages.pool_views(8, PAGE_BYTES)
            for _ in range(2):  # (the file backend's second read is a page-cache hit)
                got = await tenant.batch_get(keys, views)
                assert got == [False] * 5 + [True] * 3
                assert [bytes(v) for v in views[5:]] == data[5:]
            objects = await tenant.batch_get_objects(keys)
            assert [blob is None for blob in objects] == [True] * 5 + [False] * 3
            stats = tenant.stats()
            drops = tenant.put_keeps_existing  # refused on the first read, then absent
            assert stats.num_forged == (5 if drops else 3 * 5)
            assert stats.num_dropped == (5 if drops else 0)
            assert sum(stats.num_corrupt.values()) == 0  # forged, not damaged
            assert stats.num_corrupt_total == stats.num_forged  # (what HiCache counts refused)
            assert await tenant.batch_put(keys[:5], data[:5]) == [True] * 5
            assert await tenant.batch_get(keys, views) == [True] * 8
            assert b"".join(bytes(v) for v in views) == b"".join(data)

    run(body())


def test_a_forged_object_written_into_the_directory_by_hand(tmp_path, pages, secrets):
    """The C fast path checks no MAC: with a secret, a page-cache hit of a page written
    without it (here: a valid version 1 object copied into a pack's place) is still a miss."""
    root = tmp_path / "kv"
    url = f"file://{root}?capacity=64MiB&secret_file={secrets['a']}"
    plain_url = f"file://{root}?capacity=64MiB"
    keys = [pages.key(i, "hand") for i in range(4)]
    data = [pages.page(k, PAGE_BYTES) for k in keys]

    async def body():
        async with open_backend(plain_url, layout=pages.LAYOUT) as writer:
            assert await writer.batch_put(keys, data) == [True] * 4
        async with open_backend(url, layout=pages.LAYOUT) as tenant:
            pool, views = pages.pool_views(4, PAGE_BYTES)
            for _ in range(3):
                assert await tenant.batch_get(keys, views) == [False] * 4
            assert tenant.stats().num_forged == 12

    run(body())


def test_a_secret_file_that_cannot_be_used_is_a_config_error(tmp_path):
    with pytest.raises(BackendConfigError, match="secret_file"):
        open_backend(f"memory://?secret_file={tmp_path}/missing", layout=LAYOUT)
    short = tmp_path / "short"
    short.write_text("abc\n")
    with pytest.raises(BackendConfigError, match="secret_file.*at least 16 bytes"):
        open_backend(f"memory://?secret_file={short}", layout=LAYOUT)
