"""The C extension `storage_backends._pageio` (the page checksum, the object check, the
framing and the file backend's batch I/O) against independent oracles: its XXH3 (the xxHash
library's, with each vector unit) against the `xxhash` package, its framing against headers
packed here with `struct` and hashed with `xxhash`, its check against every way to damage an
object. The check and the framing run twice, the C ones and `portable`'s (what an install
without the extension runs): both must give the same answers."""

from __future__ import annotations

import itertools
import os
import random
import struct
import subprocess
import sys
import textwrap

import pytest
import xxhash

from storage_backends import file_read, native, objects, portable, verify
from storage_backends.file_pack import pack_table
from storage_backends.objects import (
    CorruptReason,
    encode_object,
    frame_objects,
    header_size,
    layout_bytes,
    plain_template,
)
from storage_backends.verify import _REASONS

pageio = native.pageio
CODE = {reason: code for code, reason in _REASONS.items()}  # the C check's numbers

LAYOUT = "mha;layers=2;page=16;kv_heads=2;head_dim=8;dtype=bfloat16"
READ_WINDOW = file_read._WINDOW_BYTES  # the file backend's
# Windows that cut the pack's objects everywhere: inside the fixed header and the layout, at
# and beside a 64-byte stripe, inside a short object and across several pages at once.
WINDOWS = [1, 50, 63, 64, 65, 100, 1000, 4096, 4097, 9000, READ_WINDOW]


def instruction_sets() -> list[str]:
    """Every xxh3 kernel this CPU can run (the default, the widest, is restored after)."""
    found = []
    default = pageio.simd()
    for name in ("baseline", "avx2", "avx512"):
        try:
            pageio.simd(name)
        except ValueError:
            continue
        found.append(name)
    pageio.simd(default)
    return found


@pytest.fixture(params=instruction_sets())
def simd(request):
    default = pageio.simd()
    pageio.simd(request.param)
    yield request.param
    pageio.simd(default)


@pytest.fixture(params=[*instruction_sets(), "portable"])
def impl(request, monkeypatch):
    """The checks and framing under test, installed where objects and verify call them:
    the C extension with each vector unit, or `portable`."""
    if request.param == "portable":
        chosen = portable
    else:
        default = pageio.simd()
        pageio.simd(request.param)
        request.addfinalizer(lambda: pageio.simd(default))
        chosen = pageio
    monkeypatch.setattr(objects, "checks", chosen)
    monkeypatch.setattr(verify, "checks", chosen)
    return chosen


def test_xxh3_matches_the_xxhash_package_at_every_length_and_split(simd):
    rng = random.Random(7)
    lengths = [*range(0, 1300), 2047, 2048, 2049, 4096 + 63, 65536, 65536 + 57, 1 << 20]
    for length in lengths:
        data = rng.randbytes(length)
        want = xxhash.xxh3_64_intdigest(data)
        assert pageio.xxh3_64(data) == want, length
        for cut in {0, 1, 63, 64, 65, 100, 200, length // 2, length}:
            cut = min(cut, length)
            assert pageio.xxh3_64(data[:cut], data[cut:]) == want, (length, cut)
    # a first part longer than the stack copy it straddles with
    data = rng.randbytes(10_000)
    assert pageio.xxh3_64(data[:5000], data[5000:]) == xxhash.xxh3_64_intdigest(data)


def test_xxh3_of_many_pieces_matches_the_xxhash_package(impl):
    """The check hashes an object as pieces (header fields, layout, payload chunks): every
    cut of an object into parts, stripes straddling any of them, hashes as the whole."""
    rng = random.Random(9)
    for length in (300, 1100, 5000, 70_000):
        page = rng.randbytes(length)
        key = rng.randbytes(16)
        obj = encode_object(key, LAYOUT, page)
        layout = layout_bytes(LAYOUT)
        cuts = sorted({rng.randrange(header_size(LAYOUT), len(obj)) for _ in range(6)})
        parts = [obj[a:b] for a, b in zip([0, *cuts], [*cuts, len(obj)], strict=True)]
        assert impl.check_object(parts, key, layout, length) == 1, (length, cuts)


def oracle_header(key: bytes, layout: bytes, page: bytes) -> bytes:
    """An uncompressed version 1 header, packed by the format's table and hashed by the
    `xxhash` package: what the C framing must make."""
    plain = struct.pack("<4sHBBH6x16sQQ", b"HCKV", 1, 0, 0, len(layout), key, len(page), len(page))
    checksum = xxhash.xxh3_64_intdigest(plain + layout + page)
    return plain + struct.pack("<Q", checksum) + layout


@pytest.mark.parametrize("layout", [LAYOUT, "x" * 700, ""])
def test_framing_matches_the_object_format(impl, layout):
    rng = random.Random(3)
    sizes = [0, 1, 17, 100, 200, 241, 4096, 65536 + 3]
    keys = [rng.randbytes(16) for _ in sizes]
    pages = [rng.randbytes(n) for n in sizes]
    framed = frame_objects(keys, layout, pages)
    encoded = layout_bytes(layout)
    for key, page, obj in zip(keys, pages, framed, strict=True):
        assert obj.header == oracle_header(key, encoded, page)
        assert bytes(obj.payload) == page
        assert impl.check_object([obj.header, page], key, encoded, len(page)) == 1


def test_the_check_names_the_first_thing_wrong(impl):
    """Each damage of an object, as the C check numbers it (verify._REASONS names them)."""
    key, page = os.urandom(16), os.urandom(5000)
    layout = layout_bytes(LAYOUT)
    good = bytearray(encode_object(key, LAYOUT, page))

    def check(obj, *, want_key=key, want_layout=layout, raw=None):
        raw = len(page) if raw is None else raw
        return impl.check_object([bytes(obj)], want_key, want_layout, raw)

    def flipped(at, bit=0x40):
        bad = bytearray(good)
        bad[at] ^= bit
        return bad

    assert check(good) == 1
    assert check(good, want_layout=None, raw=-1) == 1  # the daemon's check: any layout, size
    assert check(b"HCK") == CODE[CorruptReason.TRUNCATED]
    assert check(b"nope") == CODE[CorruptReason.MAGIC]
    assert check(flipped(0)) == CODE[CorruptReason.MAGIC]
    assert check(flipped(4)) == CODE[CorruptReason.VERSION]
    assert check(flipped(7, 1)) == CODE[CorruptReason.VERSION]  # flags
    assert check(flipped(6, 2)) == CODE[CorruptReason.COMPRESSION]
    assert check(good[:70]) == CODE[CorruptReason.TRUNCATED]  # inside the layout
    assert check(good, want_key=bytes(16)) == CODE[CorruptReason.KEY]
    assert check(good, want_layout=layout[:-1]) == CODE[CorruptReason.LAYOUT]
    assert check(flipped(60)) == CODE[CorruptReason.LAYOUT]
    assert check(good[:-1]) == CODE[CorruptReason.TRUNCATED]
    assert check(good + b"x") == CODE[CorruptReason.LENGTH]
    assert check(flipped(40)) == CODE[CorruptReason.LENGTH]  # raw != stored, uncompressed
    assert check(good, raw=len(page) - 1) == CODE[CorruptReason.LENGTH]
    assert check(flipped(len(good) - 1)) == CODE[CorruptReason.CHECKSUM]
    assert check(flipped(12)) == CODE[CorruptReason.CHECKSUM]  # a reserved byte
    assert check(flipped(49)) == CODE[CorruptReason.CHECKSUM]
    split = [bytes(good[:30]), bytes(good[30:])]  # a header across two parts
    assert impl.check_object(split, key, layout, len(page)) == 10


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("layout", [LAYOUT, "x" * 700, ""])
def test_frame_copies_writes_what_frame_objects_frames(impl, layout, threads):
    """Each object frame_copies writes (header, then the page copied) is `frame_objects`'
    header and the page, byte for byte, at every size around the 64 KiB copy chunk and the
    hash's stripes; the bytes between objects are left alone."""
    rng = random.Random(11)
    sizes = [0, 1, 63, 64, 65, 241, 4096, 65535, 65536, 65537, 2 * 65536 + 5, 200_000]
    keys = [rng.randbytes(16) for _ in sizes]
    pages = [memoryview(rng.randbytes(n)) for n in sizes]
    size = header_size(layout)
    offsets, at = [], 5  # gaps of 7 bytes, the first object off any alignment
    for page in pages:
        offsets.append(at)
        at += size + len(page) + 7
    out = bytearray(b"\xa5" * at)
    encoded = layout_bytes(layout)
    impl.frame_copies(
        b"".join(keys), plain_template(encoded), encoded, pages, out, offsets, threads
    )
    framed = frame_objects(keys, layout, pages)
    ends = [0]
    for start, obj in zip(offsets, framed, strict=True):
        assert out[start : start + size] == obj.header
        assert out[start + size : start + obj.nbytes] == bytes(obj.payload)
        ends.append(start + obj.nbytes)
    gaps = [out[end:start] for end, start in zip(ends, [*offsets, len(out)], strict=True)]
    assert all(gap == b"\xa5" * len(gap) for gap in gaps)


def test_frame_copies_of_c_and_portable_agree():
    """The same work through the C extension and `portable`: the same bytes."""
    rng = random.Random(12)
    encoded = layout_bytes(LAYOUT)
    pages = [memoryview(rng.randbytes(n)) for n in (0, 100, 65536, 1 << 20)]
    keys = b"".join(rng.randbytes(16) for _ in pages)
    size = header_size(LAYOUT)
    offsets = [sum(size + len(p) for p in pages[:i]) for i in range(len(pages))]
    outs = []
    for chosen in (pageio, portable):
        out = bytearray(offsets[-1] + size + len(pages[-1]))
        chosen.frame_copies(keys, plain_template(encoded), encoded, pages, out, offsets, 2)
        outs.append(out)
    assert outs[0] == outs[1]


def test_frame_copies_refuses_what_does_not_fit_and_writes_nothing(impl):
    encoded = layout_bytes(LAYOUT)
    plain, size = plain_template(encoded), header_size(LAYOUT)
    pages = [memoryview(b"p" * 100), memoryview(b"q" * 100)]
    keys = b"k" * 32
    out = bytearray(2 * (size + 100))
    for offsets in ([0, size + 101], [-1, size + 100], [0, 2 * (size + 100)]):
        with pytest.raises(ValueError, match="does not fit"):
            impl.frame_copies(keys, plain, encoded, pages, out, offsets, 1)
        assert out == bytearray(len(out))  # the first object fit, and was not written either
    with pytest.raises(ValueError, match="one offset per page"):
        impl.frame_copies(keys, plain, encoded, pages, out, [0], 1)
    with pytest.raises(ValueError, match="keys 16"):
        impl.frame_copies(keys[:31], plain, encoded, pages, out, [0, size + 100], 1)
    with pytest.raises(ValueError, match="plain must be 48 bytes"):
        impl.frame_copies(keys, b"short", encoded, pages, out, [0, size + 100], 1)
    with pytest.raises(TypeError):
        impl.frame_copies(keys, plain, encoded, pages, bytes(len(out)), [0, size + 100], 1)


def test_frame_headers_refuses_wrong_sizes(impl):
    encoded = layout_bytes(LAYOUT)
    headers = bytearray(header_size(LAYOUT))
    with pytest.raises(ValueError, match="plain must be 48 bytes"):
        impl.frame_headers(b"k" * 16, b"short", encoded, [b"page"], headers, 1)
    with pytest.raises(ValueError, match="a key is 16 bytes"):
        impl.check_object([b"object"], b"k" * 15, encoded, -1)
    with pytest.raises(ValueError, match="1 to 1024 parts"):
        impl.check_object([], b"k" * 16, encoded, -1)
    with pytest.raises(ValueError, match="keys 16"):
        impl.frame_headers(b"k" * 15, plain_template(encoded), encoded, [b"p"], headers, 1)
    with pytest.raises(TypeError):
        impl.frame_headers(b"k" * 16, plain_template(encoded), encoded, [3], headers, 1)
    with pytest.raises(ValueError, match="keys must be 16 bytes|page key"):
        frame_objects([b"short"], LAYOUT, [b"page"])


class Pack:
    """Objects written back to back in one file, as a pack holds them (after a table)."""

    def __init__(self, path, keys, pages, layout=LAYOUT, *, offset=4096):
        self.layout = layout_bytes(layout)
        self.keys, self.pages = keys, pages
        framed = frame_objects(keys, layout, pages)
        blob = bytearray(offset)
        self.offsets = []
        for obj in framed:
            self.offsets.append(len(blob))
            blob += obj.header + bytes(obj.payload)
        self.blob = blob
        path.write_bytes(blob)
        self.fd = os.open(path, os.O_RDWR)

    def buffers(self, first, end):
        """(stretch buffers, heads, views) for pages [first, end)."""
        size = header_size(self.layout.decode())
        heads = [bytearray(size) for _ in range(first, end)]
        views = [bytearray(len(self.pages[i])) for i in range(first, end)]
        buffers = [b for pair in zip(heads, views, strict=True) for b in pair]
        return buffers, heads, views

    def read(self, stretches, threads=1, keys=None, window=READ_WINDOW):
        """Read [(first, end), ...] as stretches, `window` bytes a read; (codes, got, views by
        page)."""
        keys = keys or self.keys
        verified = bytearray(len(keys))
        work, views = [], {}
        for first, end in stretches:
            buffers, _, got_views = self.buffers(first, end)
            work.append((self.fd, self.offsets[first], buffers, first))
            views.update(zip(range(first, end), got_views, strict=True))
        got = pageio.read_stretches(work, b"".join(keys), self.layout, verified, threads, window)
        return verified, got, views

    def close(self):
        os.close(self.fd)


@pytest.fixture
def pack(tmp_path):
    rng = random.Random(11)
    keys = [rng.randbytes(16) for _ in range(12)]
    pages = [rng.randbytes(n) for n in [4096] * 8 + [300, 65536, 100, 4096]]
    made = Pack(tmp_path / "pack", keys, pages)
    yield made
    made.close()


@pytest.mark.parametrize("threads", [1, 3, 8])
@pytest.mark.parametrize("window", WINDOWS)
def test_read_stretches_reads_and_verifies_every_page(pack, threads, simd, window):
    """Whatever the window, each page's checksum takes in every byte once, in order: the
    pack's pages are of 100 to 65,536 bytes (some hashed by XXH3's short path)."""
    spans = [(0, 4), (4, 8), (8, 10), (10, 12)]
    verified, got, views = pack.read(spans, threads, window=window)
    assert list(verified) == [1] * 12
    for (first, end), n in zip(spans, got, strict=True):
        sizes = [header_size(LAYOUT) + len(pack.pages[i]) for i in range(first, end)]
        assert n == sum(sizes)
    assert all(bytes(views[i]) == pack.pages[i] for i in range(12))


@pytest.mark.parametrize(
    "damage, reason",
    [
        ("payload", CorruptReason.CHECKSUM),
        ("checksum", CorruptReason.CHECKSUM),
        ("magic", CorruptReason.MAGIC),
        ("length", CorruptReason.TRUNCATED),  # the header says more than the page's buffer
        ("layout", CorruptReason.LAYOUT),
        ("key", CorruptReason.KEY),
    ],
)
@pytest.mark.parametrize("window", [64, 4097, READ_WINDOW])
def test_a_damaged_page_is_not_verified_and_spares_its_neighbours(
    tmp_path, pack, damage, reason, window
):
    """Each damage fails the check of page 5 only, and names what is wrong."""
    size = header_size(LAYOUT)
    start = pack.offsets[5]
    at = {
        "payload": start + size + 1000,  # a flipped byte of the page
        "checksum": start + 48,
        "magic": start,
        "length": start + 32,  # the stored length
        "layout": start + 56 + 3,
    }
    keys = list(pack.keys)
    if damage == "key":
        keys[5] = b"\x01" * 16  # asked for under another key
    else:
        os.pwrite(pack.fd, bytes([pack.blob[at[damage]] ^ 0x40]), at[damage])
    verified, _, views = pack.read([(0, 8)], threads=2, keys=keys, window=window)
    assert list(verified[:8]) == [1] * 5 + [CODE[reason]] + [1] * 2
    assert all(bytes(views[i]) == pack.pages[i] for i in range(8) if i != 5)


@pytest.mark.parametrize("window", [100, 4097, READ_WINDOW])
def test_a_short_pack_is_read_short_and_only_its_whole_pages_verified(tmp_path, pack, window):
    """The pages read whole before the cut are checked; the cut one is left to the closer
    look (0), as is every page after it."""
    os.ftruncate(pack.fd, pack.offsets[3] + 100)
    verified, got, views = pack.read([(0, 5)], window=window)
    assert got[0] == pack.offsets[3] + 100 - pack.offsets[0]
    assert list(verified[:5]) == [1, 1, 1, 0, 0]
    assert all(bytes(views[i]) == pack.pages[i] for i in range(3))


def test_a_header_longer_than_its_buffer_is_left_to_the_closer_look(tmp_path, pack):
    """A layout length that says more than the header buffer holds (one flipped bit of it)
    makes the header straddle header and payload: left unchecked (0) for the page by page
    read, which joins the two (the C check's 'split header' is no reason of its own)."""
    at = pack.offsets[5] + 9  # the high byte of the layout length
    os.pwrite(pack.fd, bytes([pack.blob[at] ^ 0x01]), at)  # 256 bytes longer
    verified, _, _ = pack.read([(0, 8)], window=100)
    assert list(verified[:8]) == [1] * 5 + [0] + [1] * 2


def test_a_read_error_is_minus_one_for_its_stretch_only(pack):
    verified = bytearray(12)
    buffers, _, _ = pack.buffers(0, 2)
    other, _, _ = pack.buffers(2, 4)
    bad_fd = os.open(os.devnull, os.O_WRONLY)  # not readable: EBADF
    try:
        got = pageio.read_stretches(
            [(bad_fd, 0, buffers, 0), (pack.fd, pack.offsets[2], other, 2)],
            b"".join(pack.keys),
            pack.layout,
            verified,
            2,
            READ_WINDOW,
        )
    finally:
        os.close(bad_fd)
    assert got[0] == -1 and got[1] > 0
    assert list(verified[:4]) == [0, 0, 1, 1]


def test_read_stretches_refuses_malformed_work(pack):
    layout = pack.layout
    keys = b"".join(pack.keys)
    buffers, _, _ = pack.buffers(0, 2)
    verified = bytearray(12)
    with pytest.raises(TypeError, match="fd, offset, buffers, first_page"):
        pageio.read_stretches([(pack.fd, 0, buffers)], keys, layout, verified, 1, READ_WINDOW)
    with pytest.raises(ValueError, match="outside the batch"):
        pageio.read_stretches([(pack.fd, 0, buffers, 11)], keys, layout, verified, 1, READ_WINDOW)
    with pytest.raises(ValueError, match="header buffer"):
        short = [bytearray(10), buffers[1]]
        pageio.read_stretches([(pack.fd, 0, short, 0)], keys, layout, verified, 1, READ_WINDOW)
    with pytest.raises(TypeError, match="writable"):
        frozen = [bytes(buffers[0]), buffers[1]]
        pageio.read_stretches([(pack.fd, 0, frozen, 0)], keys, layout, verified, 1, READ_WINDOW)
    with pytest.raises(ValueError, match="pairs"):
        pageio.read_stretches(
            [(pack.fd, 0, buffers[:1], 0)], keys, layout, verified, 1, READ_WINDOW
        )
    with pytest.raises(ValueError, match="results one byte per key"):
        pageio.read_stretches([], keys, layout, bytearray(3), 1, READ_WINDOW)
    with pytest.raises(ValueError, match="window_bytes at least 1"):
        pageio.read_stretches([(pack.fd, 0, buffers, 0)], keys, layout, verified, 1, 0)
    assert pageio.read_stretches([], keys, layout, verified, 4, READ_WINDOW) == []


def test_concurrent_callers_share_the_pool_safely(pack):
    """Callers on several Python threads at once post their batches to one pool; each asks for
    its own number of threads, so the pool grows while others' batches are in flight."""
    import concurrent.futures

    def one(n):
        spans = [(i, i + 1) for i in range(12)] if n % 3 else [(0, 3), (3, 6), (6, 9), (9, 12)]
        verified, _, views = pack.read(spans, threads=2 + n % 7)
        return bytes(verified), [bytes(views[i]) for i in range(12)]

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        results = list(pool.map(one, range(120)))
    for verified, views in results:
        assert verified == b"\x01" * 12
        assert views == pack.pages


def test_the_pool_works_in_a_forked_child(pack):
    pack.read([(0, 6), (6, 12)], threads=4)  # the parent's pool threads exist now
    pid = os.fork()
    if pid == 0:  # the child has none of them; its pool starts afresh
        verified, _, _ = pack.read([(0, 6), (6, 12)], threads=4)
        os._exit(0 if verified == b"\x01" * 12 else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_header_offsets_match_the_object_format():
    """The C side fills the key at 16 and the lengths at 32 and 40 of `plain_template`."""
    encoded = layout_bytes(LAYOUT)
    key, page = os.urandom(16), os.urandom(1000)
    python = oracle_header(key, encoded, page)
    plain = plain_template(encoded)
    assert python[:16] == plain[:16]
    assert python[16:32] == key
    assert python[32:48] == len(page).to_bytes(8, "little") * 2


@pytest.mark.parametrize("threads", [1, 4])
def test_link_all_links_free_names_and_reports_the_rest(tmp_path, threads):
    import errno

    packs = [tmp_path / "pack0", tmp_path / "pack1"]
    for source in packs:
        source.write_bytes(source.name.encode())
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "taken").write_bytes(b"other")
    free = [str(tmp_path / "a" / f"n{i}") for i in range(20)]
    paths = [*free, str(tmp_path / "a" / "taken"), str(tmp_path / "missing" / "x")]
    sources = [str(packs[i % 2]) for i in range(len(paths))]
    errors = pageio.link_all(sources, paths, threads)
    assert errors == [0] * 20 + [errno.EEXIST, errno.ENOENT]
    assert all(os.path.samefile(path, packs[i % 2]) for i, path in enumerate(free))
    assert (tmp_path / "a" / "taken").read_bytes() == b"other"
    assert [os.stat(source).st_nlink for source in packs] == [11, 11]
    with pytest.raises(TypeError):
        pageio.link_all(sources[:1], [3], 1)
    with pytest.raises(ValueError, match="one source per path"):
        pageio.link_all(sources[:1], paths, 1)


@pytest.mark.parametrize("threads", [1, 4])
def test_sync_all_fsyncs_paths_and_open_files_and_reports_each(tmp_path, threads):
    import errno

    (tmp_path / "a").mkdir()
    (tmp_path / "f").write_bytes(b"page")
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    not_open = 1 << 30  # past any limit: a number that no open() reuses meanwhile
    try:
        targets = [str(tmp_path / "a"), str(tmp_path), fd, str(tmp_path / "gone"), not_open]
        assert pageio.sync_all(targets, threads) == [0, 0, 0, errno.ENOENT, errno.EBADF]
        os.fstat(fd)  # an fd given is left open
    finally:
        os.close(fd)
    assert pageio.sync_all([], threads) == []
    with pytest.raises(TypeError):
        pageio.sync_all([1.5], threads)
    with pytest.raises(ValueError):
        pageio.sync_all([-1], threads)


@pytest.mark.parametrize("threads", [1, 4])
def test_check_copy_copies_only_what_checks_out(impl, threads):
    encoded = layout_bytes(LAYOUT)
    keys = [bytes([i]) * 16 for i in range(6)]
    pages = [os.urandom(size) for size in (0, 1, 4096, 70_000, 1 << 20, 5000)]
    objects = [encode_object(k, LAYOUT, p) for k, p in zip(keys, pages, strict=True)]
    objects[3] = objects[3][:-1] + bytes([objects[3][-1] ^ 1])  # a flipped payload byte
    objects[5] = encode_object(keys[0], LAYOUT, pages[5])  # another key's object
    into = [bytearray(b"\xa5" * len(p)) for p in pages]
    verified = bytearray(len(keys))
    impl.check_copy(objects, into, b"".join(keys), encoded, verified, threads)
    checksum, key = CODE[CorruptReason.CHECKSUM], CODE[CorruptReason.KEY]
    assert list(verified) == [1, 1, 1, checksum, 1, key]
    assert [bytes(b) for b in into] == [*pages[:3], b"\xa5" * 70_000, pages[4], b"\xa5" * 5000]
    short = [bytearray(len(pages[2]) - 1)]  # a destination of another size: not verified
    verified = bytearray(1)
    impl.check_copy([objects[2]], short, keys[2], encoded, verified, threads)
    assert verified[0] == CODE[CorruptReason.LENGTH] and short == [bytearray(len(pages[2]) - 1)]
    packed_page = encode_object(keys[2], LAYOUT, bytes(4096), "lz4")  # intact, compressed
    target = bytearray(b"\xa5" * 4096)
    impl.check_copy([packed_page], [target], keys[2], encoded, verified, threads)
    assert verified == b"\0" and target == b"\xa5" * 4096  # left to the caller to decode
    with pytest.raises(ValueError, match="one destination"):
        impl.check_copy(objects, into[:1], b"".join(keys), encoded, verified, 1)
    with pytest.raises(TypeError):
        impl.check_copy(objects[:1], [b"read-only"], keys[0], encoded, verified, 1)


def write_work(root, keys, pages, layout=LAYOUT, *, serial=0):
    """write_packs' work for one pack of `keys`: (temp, table, keys, pages, headers)."""
    size = header_size(layout)
    temp = str(root / keys[0].hex()[0] / keys[0].hex()[1] / f"{keys[0].hex()}.tmp.{serial}")
    table = pack_table(keys, [size + len(page) for page in pages])
    return (temp, table, b"".join(keys), pages, bytearray(size * len(keys)))


def packed(work, layout=LAYOUT):
    """The bytes a pack of `work` holds, framed as the object format says (`oracle_header`)."""
    _, table, keys, pages, _ = work
    encoded = layout_bytes(layout)
    blob = bytearray(table)
    for i, page in enumerate(pages):
        blob += oracle_header(keys[16 * i : 16 * (i + 1)], encoded, page) + page
    return bytes(blob)


@pytest.mark.parametrize("threads", [1, 3])
def test_write_packs_writes_what_the_object_format_says(tmp_path, simd, threads):
    """Each pack framed and written (pages past 256 KiB take several write calls), the
    folders made where missing."""
    rng = random.Random(5)
    sizes = [[4096] * 5, [0, 300 << 10, 17], [1 << 20], [65536 + 3] * 9]
    work = []
    for serial, pack_sizes in enumerate(sizes):
        keys = [rng.randbytes(16) for _ in pack_sizes]
        pages = [rng.randbytes(n) for n in pack_sizes]
        work.append(write_work(tmp_path, keys, pages, serial=serial))
    encoded = layout_bytes(LAYOUT)
    assert pageio.write_packs(work, plain_template(encoded), encoded, threads) == [0] * 4
    size = header_size(LAYOUT)
    for item in work:
        temp, _, keys, pages, headers = item
        with open(temp, "rb") as f:
            assert f.read() == packed(item)
        for i, page in enumerate(pages):
            key = keys[16 * i : 16 * (i + 1)]
            head = headers[size * i : size * (i + 1)]
            assert pageio.check_object([head, page], key, encoded, len(page)) == 1


@pytest.mark.parametrize("before_boundary", [0, 4, 8, 52, 56, 60, 300])
def test_write_packs_checksums_each_write_calls_share_and_mends_headers_written(
    tmp_path, before_boundary
):
    """Pages are hashed a write call's share at a time, just before the call: a page whose
    header went out in an earlier call (its checksum field before, across or after the
    256 KiB boundary of a call) gets its checksum written in place. Pages in pieces (a list
    of buffers) are hashed and written from the pieces: the pack is the pages joined."""
    rng = random.Random(before_boundary)
    size = header_size(LAYOUT)
    keys = [rng.randbytes(16) for _ in range(3)]
    table_len = len(pack_table(keys, [0, 0, 0]))
    first = (256 << 10) - before_boundary - table_len - size  # page 1's header ends there
    joined = [rng.randbytes(first), rng.randbytes(600 << 10), rng.randbytes(5000)]
    cuts = sorted(rng.sample(range(1, 600 << 10), 40))
    pieces = [joined[1][a:b] for a, b in itertools.pairwise([0, *cuts, 600 << 10])]
    pages = [joined[0], [memoryview(p) for p in pieces], [joined[2][:7], joined[2][7:]]]
    temp, table, joined_keys, _, headers = write_work(tmp_path, keys, joined)
    work = (temp, table, joined_keys, pages, headers)
    encoded = layout_bytes(LAYOUT)
    assert pageio.write_packs([work], plain_template(encoded), encoded, 1) == [0]
    with open(temp, "rb") as f:
        assert f.read() == packed((temp, table, joined_keys, joined, headers))


def test_write_packs_writes_objects_framed_already_as_they_are(tmp_path):
    """A pack of lz4 objects (framed in Python): keys and headers None, its parts written in
    order after the table."""
    rng = random.Random(6)
    keys = [rng.randbytes(16) for _ in range(3)]
    objects = frame_objects(keys, LAYOUT, [bytes(8192)] * 3, "lz4")
    parts = [part for obj in objects for part in (obj.header, obj.payload)]
    table = pack_table(keys, [obj.nbytes for obj in objects])
    temp = str(tmp_path / "a" / "b" / "pack.tmp")
    encoded = layout_bytes(LAYOUT)
    assert pageio.write_packs(
        [(temp, table, None, parts, None)], plain_template(encoded), encoded, 2
    ) == [0]
    with open(temp, "rb") as f:
        assert f.read() == table + b"".join(bytes(part) for part in parts)


def test_a_pack_that_cannot_be_written_is_removed_and_spares_the_others(tmp_path, file_size_limit):
    """A write that fails half-way (here: the process's file size limit) removes that pack's
    temporary file; a pack whose folder is a file is not made; the others are written."""
    import errno

    rng = random.Random(8)
    small = write_work(
        tmp_path,
        [rng.randbytes(16) for _ in range(4)],
        [rng.randbytes(100 << 10) for _ in range(4)],
    )
    big = write_work(tmp_path, [rng.randbytes(16)], [rng.randbytes(3 << 20)], serial=1)
    blocked = write_work(tmp_path, [rng.randbytes(16)], [b"page"], serial=2)
    folder = os.path.dirname(blocked[0])
    assert not os.path.exists(folder)  # (the seeded keys have folders of their own)
    os.makedirs(os.path.dirname(folder), exist_ok=True)
    with open(folder, "wb"):  # a file where the folder should be
        pass
    encoded = layout_bytes(LAYOUT)
    with file_size_limit(1 << 20):
        errors = pageio.write_packs([small, big, blocked], plain_template(encoded), encoded, 3)
    assert errors == [0, errno.EFBIG, errno.ENOTDIR]
    assert not os.path.exists(big[0])
    with open(small[0], "rb") as f:
        assert f.read() == packed(small)


def test_write_packs_refuses_malformed_work(tmp_path):
    encoded = layout_bytes(LAYOUT)
    plain = plain_template(encoded)
    work = write_work(tmp_path, [b"k" * 16, b"j" * 16], [b"page", b"page"])
    with pytest.raises(ValueError, match="plain must be 48 bytes"):
        pageio.write_packs([work], b"short", encoded, 1)
    with pytest.raises(TypeError, match=r"\(temp, table, keys, pages, headers\)"):
        pageio.write_packs([work[:4]], plain, encoded, 1)
    with pytest.raises(ValueError, match="1 to 2\\*\\*20 pages"):
        pageio.write_packs([(*work[:3], [], work[4])], plain, encoded, 1)
    with pytest.raises(ValueError, match="keys must be 16 bytes per page"):
        pageio.write_packs([(work[0], work[1], b"k" * 17, *work[3:])], plain, encoded, 1)
    with pytest.raises(ValueError, match="headers 56"):
        pageio.write_packs([(*work[:4], bytearray(3))], plain, encoded, 1)
    with pytest.raises(TypeError, match="write_packs: page"):
        pageio.write_packs([(*work[:3], [b"page", 7], work[4])], plain, encoded, 1)
    with pytest.raises(TypeError, match="writable"):
        pageio.write_packs([(*work[:4], bytes(work[4]))], plain, encoded, 1)
    assert list(tmp_path.iterdir()) == []  # refused before anything was written


_OVERSIZED_LAYOUT = textwrap.dedent(
    """
    import os, sys, tempfile
    from storage_backends import native
    from storage_backends.objects import plain_template
    pageio = native.pageio
    layout = b"x" * 70000  # more than a header's u16 length can say
    plain = plain_template(b"")
    page = bytes(4096)
    refused = []
    try:
        headers = bytearray(56 + len(layout))
        pageio.frame_headers(b"k" * 16, plain, layout, [page], headers, 1)
    except ValueError as exc:
        refused.append(str(exc))
    with tempfile.TemporaryFile() as f:
        f.write(bytes(56 + len(layout)) + page)
        f.flush()
        buffers = [bytearray(56 + len(layout)), bytearray(len(page))]
        try:
            pageio.read_stretches([(f.fileno(), 0, buffers, 0)], b"k" * 16, layout,
                                  bytearray(1), 1, 1 << 18)
        except ValueError as exc:
            refused.append(str(exc))
    print(len(refused), "|".join(refused))
    """
)


def test_a_layout_longer_than_a_header_can_hold_is_refused_not_copied_onto_the_stack():
    """frame_headers and read_stretches once hashed the layout through a fixed stack buffer
    of 48 + 65535 bytes without checking its length (an ASan build reported the overflow);
    both refuse such a layout. Run in a child: on a build with the bug, the child may crash
    rather than raise."""
    result = subprocess.run(
        [sys.executable, "-c", _OVERSIZED_LAYOUT], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr[-2000:]
    count, _, messages = result.stdout.strip().partition(" ")
    assert count == "2", result.stdout
    assert messages.count("at most 65535") == 2
