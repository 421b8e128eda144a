"""A process hammering one file:// directory, for test_file_store's two-process test.

    python file_worker.py <url> <layout> <seed> <num_rounds> <page_bytes> <num_keys>

Puts and gets random batches over a key space shared with the other worker. Every key's
page is a function of the key, so any hit can be checked byte for byte: a torn or foreign
page would show up as corrupt (refused) or as wrong bytes (never allowed). Prints one JSON
line of counts; exits non-zero on any wrong byte or exception.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys

import xxhash

from storage_backends import open_backend


def key_of(i: int) -> bytes:
    return xxhash.xxh3_128_digest(f"shared:{i}".encode())


def page_of(key: bytes, nbytes: int) -> bytes:
    return random.Random(key).randbytes(nbytes)


async def main(url: str, layout: str, seed: int, rounds: int, page_bytes: int, num_keys: int):
    rng = random.Random(seed)
    wrong = 0
    async with open_backend(url, layout=layout) as store:
        for _ in range(rounds):
            keys = [key_of(rng.randrange(num_keys)) for _ in range(rng.randint(1, 12))]
            keys = list(dict.fromkeys(keys))
            await store.batch_put(keys, [page_of(k, page_bytes) for k in keys])
            probe = [key_of(rng.randrange(num_keys)) for _ in range(12)]
            pool = bytearray(len(probe) * page_bytes)
            views = [memoryview(pool)[i * page_bytes : (i + 1) * page_bytes] for i in range(12)]
            found = await store.batch_get(probe, views)
            for key, view, ok in zip(probe, views, found, strict=True):
                if ok and bytes(view) != page_of(key, page_bytes):
                    wrong += 1
        stats = store.stats()
    print(
        json.dumps(
            {
                "wrong": wrong,
                "hits": stats.num_hits,
                "puts": stats.num_puts,
                "errors": stats.num_errors,
                "corrupt": dict(stats.num_corrupt),
                "rejected": stats.num_put_rejected,
            }
        )
    )
    return 1 if wrong else 0


if __name__ == "__main__":
    url, layout, seed, rounds, page_bytes, num_keys = sys.argv[1:7]
    sys.exit(asyncio.run(main(url, layout, int(seed), int(rounds), int(page_bytes), int(num_keys))))
