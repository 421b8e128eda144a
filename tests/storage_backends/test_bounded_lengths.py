"""Lengths read from stored bytes are bounded before anything is sized by them (issue 17).

A header is data from outside: anyone who can write a key into the Redis (or a file into the
directory) picks its length fields. Each test damages one field of a real stored object and
reads it in a subprocess whose address space is capped (`RLIMIT_AS`), so a regression shows up
as a MemoryError in that process, never as the machine running out of memory.
"""

from __future__ import annotations

import asyncio
import json
import struct
import subprocess
import sys
import textwrap
from urllib.parse import parse_qs, urlsplit

import pytest
import redis
import xxhash

from storage_backends import open_backend
from storage_backends.objects import encode_object
from storage_backends.verify import decode_object, verify_object

PAGE_BYTES = 5000
_STORED_AT = 32  # the stored payload length in the fixed header (objects.py)
_LAYOUT_LEN_AT = 8
_READER_AS_BYTES = 1536 << 20  # the reading process's whole address space

_READER = textwrap.dedent(
    """
    import asyncio, json, resource, sys
    resource.setrlimit(resource.RLIMIT_AS, ({limit}, {limit}))
    from storage_backends import open_backend

    async def main(url, layout, key_hex, page_bytes):
        key = bytes.fromhex(key_hex)
        async with open_backend(url, layout=layout) as store:
            got = await store.batch_get([key], [bytearray(page_bytes)])
            blobs = await store.batch_get_objects([key])
            deleted = await store.delete([key])
            stats = store.stats()
        print(json.dumps({{"got": got, "blob": blobs[0] is not None, "deleted": deleted,
                          "corrupt": dict(stats.num_corrupt), "errors": stats.num_errors}}))

    asyncio.run(main(*sys.argv[1:4], int(sys.argv[4])))
    """
)


def read_in_capped_process(url: str, layout: str, key: bytes, page_bytes: int) -> dict:
    script = _READER.format(limit=_READER_AS_BYTES)
    result = subprocess.run(
        [sys.executable, "-c", script, url, layout, key.hex(), str(page_bytes)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def _set_u64(value: bytes, offset: int, number: int) -> bytes:
    out = bytearray(value)
    struct.pack_into("<Q", out, offset, number)
    return bytes(out)


@pytest.mark.parametrize(
    "field, damage",
    [
        ("stored_high_bit", lambda v: _set_u64(v, _STORED_AT, (1 << 62) | PAGE_BYTES)),
        ("stored_one_more_chunk_count", lambda v: _set_u64(v, _STORED_AT, 1 << 40)),
        ("layout_length", lambda v: v[:_LAYOUT_LEN_AT] + b"\xff\xff" + v[_LAYOUT_LEN_AT + 2 :]),
    ],
)
def test_a_damaged_redis_length_is_a_miss_not_a_crash(redis_url, pages, field, damage):
    """One changed length field in a multi-chunk page's header: the reader, the objects API
    and delete finish within the timeout, refuse the page, and allocate nothing from it."""
    url = redis_url(chunk_size="1KiB", timeout="5s")
    key = pages.key(1)

    async def put() -> None:
        async with open_backend(url, layout=pages.LAYOUT) as store:
            assert await store.batch_put([key], [pages.page(key, PAGE_BYTES)]) == [True]

    asyncio.run(put())
    client = redis.Redis(port=urlsplit(url).port)
    prefix = parse_qs(urlsplit(url).query)["prefix"][0].encode()
    redis_key = prefix + b"{" + key.hex().encode() + b"}"
    client.set(redis_key, damage(client.get(redis_key)))
    outcome = read_in_capped_process(url, pages.LAYOUT, key, PAGE_BYTES)
    client.close()
    assert outcome["got"] == [False]
    assert outcome["blob"] is False
    assert sum(outcome["corrupt"].values()) == 2, outcome  # batch_get and batch_get_objects
    assert outcome["deleted"] == 1  # the page's value itself goes, whatever its header says


def test_an_lz4_object_claiming_a_huge_raw_length_is_refused_unallocated():
    """The raw length of an lz4 object sizes its decompression buffer: bounded by what the
    stored bytes could hold, checked before lz4 is asked (the checksum takes no secret, so a
    forger recomputes it)."""
    key = bytes(range(16))
    layout = "mha;layers=1;page=4"
    blob = encode_object(key, layout, bytes(4096), "lz4")
    raw_at = 40
    forged = bytearray(_set_u64(blob, raw_at, 1 << 50))

    body = bytes(forged[:48]) + layout.encode() + bytes(forged[56 + len(layout) :])
    struct.pack_into("<Q", forged, 48, xxhash.xxh3_64_intdigest(body))
    assert verify_object(bytes(forged), key) is not None
    assert decode_object(bytes(forged), key, layout) is not None
