"""storage_backends: L3, bytes in and bytes out by page key (memory, file, redis, grpc).

Never imports torch: pages are bytes and memoryviews. Page keys are opaque 16-byte strings
(radix computes them); the KV layout is an opaque descriptor string (tiers defines it).
Every stored page is a self-describing object (`objects`), verified on every read.

    backend = open_backend("file:///data/kv?capacity=100GiB", layout=layout.descriptor())
    ok = await backend.batch_put(keys, pages)
    n = await backend.batch_exists(keys)
    found = await backend.batch_get(keys[:n], into=host_page_views)

Client libraries (redis) are imported only when a URL of their scheme is opened.

Where things live: a page is verified by `verify.check_object` (every backend's reads, the
daemon's puts and gets; it names the reason and checks the MAC of a tenant secret), whose
check is `native.checks`: the C check `check_parts` of `_pageio.c` (also run by the C reader
and `check_copy` for a batch), or where the C extension is not built `portable`, which
answers the same. A `file://` batch is read by `file_read.BatchRead` and written by
`file_write.BatchWrite`, whose bytes reach the disk in one place, the C writer `write_packs`
(`write_one` in `_pageio.c`); `file://` needs the extension and says so when it is missing.
"""

from .base import PageStatus, StorageBackend
from .errors import (
    BackendClosedError,
    BackendConfigError,
    BackendUnavailableError,
    StorageError,
)
from .objects import (
    Compression,
    CorruptReason,
    FramedObject,
    ObjectHeader,
    encode_object,
    frame_object,
    frame_objects,
    mac_key_from_secret,
    parse_header,
)
from .options import BackendOptions, parse_duration, parse_size
from .registry import known_schemes, open_backend, register_backend
from .stats import BackendStats, Usage
from .sync import SyncBackend
from .verify import (
    check_object,
    decode_object,
    decode_object_into,
    verify_object,
    verify_payload,
)

__all__ = [
    "BackendClosedError",
    "BackendConfigError",
    "BackendOptions",
    "BackendStats",
    "BackendUnavailableError",
    "Compression",
    "CorruptReason",
    "FramedObject",
    "ObjectHeader",
    "PageStatus",
    "StorageBackend",
    "StorageError",
    "SyncBackend",
    "Usage",
    "decode_object",
    "decode_object_into",
    "encode_object",
    "frame_object",
    "frame_objects",
    "known_schemes",
    "mac_key_from_secret",
    "open_backend",
    "parse_duration",
    "parse_header",
    "parse_size",
    "register_backend",
    "check_object",
    "verify_object",
    "verify_payload",
]
