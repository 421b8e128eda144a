"""The self-describing L3 object: one page, framed so that a wrong page is never served.

Every page a backend stores is one object (little-endian):

    offset  bytes  field
    0       4      magic b"HCKV"
    4       2      format version: 1, or 2 for an object that carries a MAC
    6       1      compression: 0 none, 1 lz4 (block format; the raw length is in the header)
    7       1      flags (0; readers reject anything else until a version defines them)
    8       2      L, length of the layout descriptor in bytes (UTF-8)
    10      6      reserved (zero)
    16      16     page key
    32      8      stored payload length (after compression)
    40      8      raw payload length (before compression)
    48      8      xxh3-64 of every other byte of the object: [0, 48), then [56, end)
    56      L      layout descriptor, an opaque string such as "mha;layers=32;page=64;..."
    56+L    M      version 2 only (M = 32): the MAC, HMAC-SHA256 under the tenant's key of
                   a fixed label, bytes [0, 48), the layout descriptor and the stored payload
    56+L+M  N      stored payload

The checksum covers every byte of the object except itself, so a flipped byte anywhere, a
page copied under another key, a truncated or an extended object is always detected. A read
names what was wrong with a `CorruptReason`; it never returns bytes that failed a check.

The checksum takes no secret: it catches damage, not a forger, who can compute a page's key
from its tokens and write any bytes under it with a valid checksum. A tenant configured with
a secret (`mac_key_from_secret`) writes version 2 and reads only version 2 objects whose MAC
checks out under its key: anything else is `CorruptReason.FORGED`, a miss. A reader without
a key reads both versions as before (integrity only; the MAC is covered by the checksum but
not checked), and so does the daemon, which stores clients' objects as opaque bytes.

The checksum is the xxHash library's XXH3-64, and it and the check of a stored object
(header, lengths, checksum) are `native.checks`: the C extension's where it is built, else
`portable`'s, which answer the same. This module holds the format and frames objects;
`verify` checks and decodes them; `buffers` checks the caller's keys and pages.

This module knows bytes and buffers only: not what a layout means, not where objects live.
An object may arrive as one buffer or as several parts whose concatenation is the object
(a Redis hash of header and chunks, a header read apart from its payload); every reader here
takes either, so backends never join parts just to check them.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import struct
from collections.abc import Sequence
from typing import NamedTuple

from .buffers import KEY_BYTES, Buffer, byte_view, check_key
from .errors import BackendConfigError
from .native import checks

MAGIC = b"HCKV"
FORMAT_VERSION = 1
SIGNED_VERSION = 2  # a MAC follows the layout descriptor
MAC_BYTES = 32
HEADER_FIXED_BYTES = 56
MAX_LAYOUT_BYTES = 0xFFFF
MAX_PAYLOAD_BYTES = 1 << 30  # a payload larger than this is not a page: refused unread
_LZ4_MAX_RATIO = 255  # an lz4 block never expands its input more than this (plus a little)

FIXED_HEADER = struct.Struct("<4sHBBH6x16sQQQ")
CHECKSUM_OFFSET = 48
_CHECKSUM = struct.Struct("<Q")
_PLAIN = struct.Struct("<4sHBBH6x16sQQ")  # the fixed header up to the checksum
assert FIXED_HEADER.size == HEADER_FIXED_BYTES

ObjectParts = Buffer | Sequence[Buffer]
MacKey = bytes  # a tenant's MAC key (`mac_key_from_secret`); None where there is no secret
_MAC_LABEL = b"hicache page object v2\0"  # these MACs are of pages, and of nothing else


class Compression(enum.IntEnum):
    NONE = 0
    LZ4 = 1

    @classmethod
    def parse(cls, name: str | Compression) -> Compression:
        if isinstance(name, Compression):
            return name
        try:
            return cls[str(name).upper()]
        except KeyError:
            raise ValueError(f"compression must be 'none' or 'lz4', got {name!r}") from None


CODECS = (Compression.NONE, Compression.LZ4)  # by header value


class CorruptReason(str, enum.Enum):
    """Why a stored object was refused. The value is the counter name in `BackendStats`."""

    MAGIC = "magic"  # not an hicache object at all
    VERSION = "version"  # a format version (or flags) this reader does not know
    KEY = "key"  # the object belongs to another page key
    LAYOUT = "layout"  # written under another KV layout descriptor
    LENGTH = "length"  # longer than its header says, or not the size the reader expects
    TRUNCATED = "truncated"  # shorter than its header says
    CHECKSUM = "checksum"  # some byte changed after it was written
    COMPRESSION = "compression"  # unknown codec, or the payload does not decompress
    FORGED = "forged"  # intact, but not written with this tenant's secret (no or a wrong MAC)


class ObjectHeader(NamedTuple):
    key: bytes
    layout: bytes  # the descriptor as stored (UTF-8 bytes)
    compression: Compression
    stored_bytes: int  # payload bytes in the object
    raw_bytes: int  # payload bytes once decompressed
    checksum: int
    mac: bytes | None = None  # version 2: the MAC as stored

    @property
    def header_bytes(self) -> int:
        return HEADER_FIXED_BYTES + len(self.layout) + (MAC_BYTES if self.mac is not None else 0)

    @property
    def object_bytes(self) -> int:
        return self.header_bytes + self.stored_bytes


class FramedObject(NamedTuple):
    """An encoded object as two parts, so a page is framed without copying it."""

    header: bytes  # fixed header + layout descriptor
    payload: memoryview | bytes  # the caller's page (uncompressed) or the lz4 block

    @property
    def nbytes(self) -> int:
        return len(self.header) + len(self.payload)


# -- layouts and MAC keys --------------------------------------------------------------------


def layout_bytes(layout: str) -> bytes:
    if not isinstance(layout, str):
        raise ValueError(f"layout descriptor must be a str, got {type(layout).__name__}")
    encoded = layout.encode()
    if len(encoded) > MAX_LAYOUT_BYTES:
        raise ValueError(f"layout descriptor is {len(encoded)} bytes; at most {MAX_LAYOUT_BYTES}")
    return encoded


def header_size(layout: str, *, signed: bool = False) -> int:
    """Bytes of the header an object of this layout carries in front of its payload (with a
    MAC: `signed`)."""
    return HEADER_FIXED_BYTES + len(layout_bytes(layout)) + (MAC_BYTES if signed else 0)


def load_secret(path: str, name: str) -> MacKey | None:
    """The MAC key of the secret in `path` (read once, when backend `name` is built); None
    for no secret. The file holds the secret alone (surrounding whitespace is ignored)."""
    if not path:
        return None
    try:
        with open(path, "rb") as f:
            secret = f.read(1 << 16).strip()
    except OSError as exc:
        raise BackendConfigError(f"{name}: secret_file {path!r}: {exc.strerror}") from None
    try:
        return mac_key_from_secret(secret)
    except ValueError as exc:
        raise BackendConfigError(f"{name}: secret_file {path!r}: {exc}") from None


def mac_key_from_secret(secret: bytes) -> MacKey:
    """The MAC key of a tenant's secret (any length, at least 16 bytes), derived with
    HMAC-SHA256, so that the secret itself is never the key of anything stored."""
    if not isinstance(secret, bytes) or len(secret) < 16:
        raise ValueError("a tenant secret must be at least 16 bytes")
    return hmac.digest(secret, b"hicache tenant MAC key", hashlib.sha256)


def start_mac(mac_key: MacKey, plain: Buffer, layout: bytes) -> hmac.HMAC:
    """HMAC-SHA256 (SHA-256 runs on the CPU's SHA instructions where it has them, and
    without the GIL), fed with the label, the plain header and the layout; the payload next."""
    mac = hmac.new(mac_key, _MAC_LABEL, hashlib.sha256)
    mac.update(plain)
    mac.update(layout)
    return mac


# -- encoding --------------------------------------------------------------------------------


def frame_object(
    key: bytes,
    layout: str,
    payload: Buffer,
    compression: str | Compression = "none",
    *,
    mac_key: MacKey | None = None,
) -> FramedObject:
    """Frame one page without copying it (unless lz4 is asked for and saves space); with a
    `mac_key`, as a version 2 object carrying its MAC."""
    codec = Compression.parse(compression)
    return _frame(check_key(key), layout_bytes(layout), payload, codec, mac_key)


def encode_object(
    key: bytes,
    layout: str,
    payload: Buffer,
    compression: str | Compression = "none",
    *,
    mac_key: MacKey | None = None,
) -> bytes:
    """The whole object as one `bytes` (one copy of the payload). lz4 is kept only if smaller."""
    framed = frame_object(key, layout, payload, compression, mac_key=mac_key)
    return b"".join((framed.header, framed.payload))


def frame_objects(
    keys: Sequence[bytes],
    layout: str,
    payloads: Sequence[Buffer],
    compression: str | Compression = "none",
    *,
    threads: int = 1,
    mac_key: MacKey | None = None,
) -> list[FramedObject]:
    """`frame_object` for a batch, the layout and the codec checked once. Uncompressed pages
    without a MAC are framed in one call (`checks.frame_headers`: with the C extension, hashed
    on up to `threads` threads); lz4 and MACs are applied here page by page."""
    encoded = layout_bytes(layout)
    codec = Compression.parse(compression)
    if codec is Compression.NONE and mac_key is None:
        return _frame_plain(keys, encoded, payloads, threads)
    return [
        _frame(check_key(key), encoded, payload, codec, mac_key)
        for key, payload in zip(keys, payloads, strict=True)
    ]


def _frame_plain(
    keys: Sequence[bytes], layout: bytes, payloads: Sequence[Buffer], threads: int
) -> list[FramedObject]:
    """Uncompressed version 1 pages framed in one call (`checks.frame_headers`)."""
    pages = [byte_view(payload, what="page") for payload in payloads]
    joined = b"".join([check_key(key) for key in keys])
    if len(joined) != KEY_BYTES * len(pages):
        raise ValueError(f"{len(keys)} keys for {len(pages)} pages")
    size = HEADER_FIXED_BYTES + len(layout)
    headers = bytearray(size * len(pages))
    checks.frame_headers(joined, plain_template(layout), layout, pages, headers, threads)
    view = memoryview(headers)
    return [
        FramedObject(bytes(view[size * i : size * (i + 1)]), page) for i, page in enumerate(pages)
    ]


def frame_objects_into(
    keys: Sequence[bytes],
    layout: str,
    pages: list[memoryview],
    out: memoryview,
    offsets: list[int],
    *,
    threads: int = 1,
) -> None:
    """Uncompressed version 1 pages as whole objects in `out`, each (header, then a copy of
    its page) at offsets[i]: the same bytes as `frame_objects` and a copy, in one call and
    one pass over each page (`checks.frame_copies`: its checksum is taken of the copy as it
    is made; with the C extension, on up to `threads` threads). For a store that sends
    objects from memory of its own (Mooncake's staging arena)."""
    encoded = layout_bytes(layout)
    joined = b"".join([check_key(key) for key in keys])
    if len(joined) != KEY_BYTES * len(pages):
        raise ValueError(f"{len(keys)} keys for {len(pages)} pages")
    checks.frame_copies(joined, plain_template(encoded), encoded, pages, out, offsets, threads)


def plain_template(layout: bytes) -> bytes:
    """The first 48 bytes of the header of an uncompressed version 1 page of `layout`, with
    the key and the lengths zero: what `frame_headers` fills in per page (key at 16, lengths
    at 32 and 40)."""
    return _PLAIN.pack(MAGIC, FORMAT_VERSION, Compression.NONE, 0, len(layout), b"", 0, 0)


def _frame(
    key: bytes,
    layout: bytes,
    payload: Buffer,
    compression: Compression,
    mac_key: MacKey | None = None,
) -> FramedObject:
    raw = byte_view(payload, what="page")
    if compression is not Compression.LZ4 and mac_key is None:
        return _frame_plain([key], layout, [raw], 1)[0]
    stored: memoryview | bytes = raw
    if compression is Compression.LZ4 and len(raw) > 0:
        import lz4.block  # optional codec, imported when first used

        packed = lz4.block.compress(raw, store_size=False)
        if len(packed) < len(raw):
            stored = packed
        else:
            compression = Compression.NONE
    elif compression is not Compression.NONE:
        compression = Compression.NONE
    return FramedObject(_header(key, layout, stored, len(raw), compression, mac_key), stored)


def _header(
    key: bytes,
    layout: bytes,
    stored: Buffer,
    raw_bytes: int,
    compression: Compression,
    mac_key: MacKey | None = None,
) -> bytes:
    """The whole header of an object storing `stored`: fixed fields, checksum, layout, and
    with a `mac_key` the MAC (version 2)."""
    version = FORMAT_VERSION if mac_key is None else SIGNED_VERSION
    prefix = _PLAIN.pack(MAGIC, version, compression, 0, len(layout), key, len(stored), raw_bytes)
    tail = layout
    if mac_key is not None:
        mac = start_mac(mac_key, prefix, layout)
        mac.update(stored)
        tail = layout + mac.digest()
    checksum = checks.xxh3_64(prefix + tail, stored)
    return prefix + _CHECKSUM.pack(checksum) + tail


# -- decoding --------------------------------------------------------------------------------


def parse_header(buf: Buffer) -> ObjectHeader | CorruptReason:
    """Parse the header at the start of `buf` (fixed part and layout). Checks no payload."""
    view = byte_view(buf)
    if len(view) < HEADER_FIXED_BYTES:
        start = bytes(view[: len(MAGIC)])
        return CorruptReason.TRUNCATED if MAGIC.startswith(start) else CorruptReason.MAGIC
    magic, version, codec, flags, layout_len, key, stored, raw, checksum = FIXED_HEADER.unpack_from(
        view
    )
    if magic != MAGIC:
        return CorruptReason.MAGIC
    if version not in (FORMAT_VERSION, SIGNED_VERSION) or flags != 0:
        return CorruptReason.VERSION
    if codec >= len(CODECS):
        return CorruptReason.COMPRESSION
    layout_end = HEADER_FIXED_BYTES + layout_len
    mac_bytes = MAC_BYTES if version == SIGNED_VERSION else 0
    if len(view) < layout_end + mac_bytes:
        return CorruptReason.TRUNCATED
    layout = bytes(view[HEADER_FIXED_BYTES:layout_end])
    mac = bytes(view[layout_end : layout_end + MAC_BYTES]) if mac_bytes else None
    return ObjectHeader(key, layout, CODECS[codec], stored, raw, checksum, mac)


def peek_sizes(buf: Buffer) -> tuple[int, int] | None:
    """(header bytes, stored payload bytes) from the fixed part alone; None if not an object.

    Unchecked (the checksum is not looked at): for sizing reads and deletes, never for data.
    """
    view = byte_view(buf)
    if len(view) < HEADER_FIXED_BYTES:
        return None
    magic, version, _, _, layout_len, _, stored, _, _ = FIXED_HEADER.unpack_from(view)
    if magic != MAGIC:
        return None
    mac_bytes = MAC_BYTES if version == SIGNED_VERSION else 0
    return HEADER_FIXED_BYTES + layout_len + mac_bytes, stored


def split_object(blob: Buffer) -> FramedObject | CorruptReason:
    """An encoded object as (header, payload) views into `blob`, without copying it."""
    view = byte_view(blob)
    header = parse_header(view)
    if isinstance(header, CorruptReason):
        return header
    return FramedObject(view[: header.header_bytes], view[header.header_bytes :])


def as_parts(obj: ObjectParts) -> list[memoryview]:
    """An object's parts (one buffer, or several in order) as flat byte views."""
    if isinstance(obj, (bytes, bytearray, memoryview)):
        return [byte_view(obj)]
    return [byte_view(part) for part in obj]


def join_parts(obj: ObjectParts) -> bytes:
    """The object as one `bytes`: free when it already is one, else one copy."""
    if isinstance(obj, bytes):
        return obj
    parts = as_parts(obj)
    if len(parts) == 1 and isinstance(parts[0].obj, bytes) and len(parts[0]) == len(parts[0].obj):
        return parts[0].obj
    return b"".join(parts)
