"""L3 in trouble: unreachable, slow past its timeout, or returning corrupt pages.

Engine-facing calls then return shorter matches; they never raise for it, never hang, and
the counters say what happened.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from storage_backends.file_pack import read_table
from tests.support.caches import NS, put, read_pages, tokens_for
from tests.support.deadline import within_deadline
from tests.support.servers import RedisProcess, free_port
from tests.support.slow_backend import slow_file_url


def write_to_l3(cache_factory, url, tokens, seed=1):
    writer = cache_factory(write_policy="write_through", l3_url=url)
    values = put(writer, tokens, seed=seed)
    writer.flush()
    return values


def test_l3_going_down_makes_misses_not_errors(cache_factory, tmp_path):
    server = RedisProcess(tmp_path / "redis", free_port()).start()
    try:
        url = server.url + "?timeout=300ms"
        tokens = tokens_for(1, 4)
        cache = cache_factory(
            l3_url=url, write_policy="write_through", prefetch_policy="wait_complete"
        )
        put(cache, tokens, seed=1)
        cache.flush()
        cache.evict("l1", 100)
        cache.evict("l2", 100)
        server.kill()
        match = within_deadline(cache.match, tokens, NS)  # the index believes L3 has it; gone
        assert match.num_tokens == 0
        cache.release(match)
        other = cache.match(tokens_for(2, 4), NS)  # a lookup past the index fails quietly too
        assert other.num_tokens == 0
        stats = cache.stats()
        assert stats.l3_errors >= 1
        assert stats.prefetch_pages_missing == 4
        # Writes while it is down are dropped, not raised.
        put(cache, tokens_for(3, 2), seed=3)
        cache.flush()
        cache.check_invariants()
    finally:
        server.stop()


def test_slow_l3_past_its_timeout_is_a_miss(cache_factory, tmp_path):
    directory = tmp_path / "l3"
    tokens = tokens_for(4, 4)
    write_to_l3(cache_factory, f"file://{directory}?capacity=1GiB", tokens)
    url = slow_file_url(directory, delay_s=1.0, timeout="200ms")
    cache = cache_factory(l3_url=url, prefetch_policy="wait_complete")
    match = within_deadline(cache.match, tokens, NS)
    assert match.num_tokens == 0  # (after the read's 1 s it would have been a hit)
    assert cache.stats().l3_errors >= 1


def page_names(directory: Path) -> list[Path]:
    """The file backend's page names (each a hard link to the pack holding the page)."""
    return [p for p in directory.rglob("*") if p.is_file() and len(p.name) == 32]


def locate(path: Path) -> tuple[int, int]:
    """(offset, length) of the page named `path` in its pack."""
    with open(path, "rb") as f:
        return read_table(f.fileno(), os.fstat(f.fileno())).entries[bytes.fromhex(path.name)]


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0xFF]))


def corrupt_every_page(directory: Path, how: str) -> int:
    """Flip a byte near the end of every page, or cut every pack in the middle of its first
    page; returns how many pages were damaged."""
    names = page_names(directory)
    cuts: dict[int, tuple[Path, int]] = {}
    for path in names:
        offset, length = locate(path)
        if how == "flip":
            flip_byte(path, offset + length - 5)
        else:
            ino = path.stat().st_ino
            cut = offset + length // 2
            if ino not in cuts or cut < cuts[ino][1]:
                cuts[ino] = (path, cut)
    for path, cut in cuts.values():
        os.truncate(path, cut)
    return len(names)


@pytest.mark.parametrize("how", ["flip", "truncate"])
def test_corrupt_l3_pages_are_never_served(cache_factory, tmp_path, how):
    directory = tmp_path / "l3"
    tokens = tokens_for(5, 3)
    write_to_l3(cache_factory, f"file://{directory}?capacity=1GiB", tokens)
    assert corrupt_every_page(directory, how) == 3
    cache = cache_factory(
        l3_url=f"file://{directory}?capacity=1GiB", prefetch_policy="wait_complete"
    )
    match = cache.match(tokens, NS)
    assert match.num_tokens == 0
    stats = cache.stats()
    assert stats.l3_corrupt_pages >= 1
    assert stats.prefetch_pages_missing == 3


def test_a_corrupt_page_in_the_middle_cuts_the_match_there(cache_factory, tmp_path):
    directory = tmp_path / "l3"
    tokens = tokens_for(6, 4)
    written = write_to_l3(cache_factory, f"file://{directory}?capacity=1GiB", tokens)
    reader = cache_factory(
        l3_url=f"file://{directory}?capacity=1GiB", prefetch_policy="wait_complete"
    )
    from radix.keys import page_keys

    third = page_keys(tokens, NS, reader.page_size)[2].hex()
    victims = [p for p in page_names(directory) if p.name == third]
    assert len(victims) == 1
    offset, length = locate(victims[0])
    flip_byte(victims[0], offset + length - 1)
    match = reader.match(tokens, NS)
    assert match.num_l3_pages == 2
    for layer in range(reader.layout.num_layers):
        reader.wait_layer(match, layer)
    assert torch.equal(read_pages(reader, match.device_page_ids), written[:, :2])
