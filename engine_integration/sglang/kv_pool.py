"""The KV host pool once `HiCacheSGLangStorage` has it (`storage.py`): its page geometry
(`pages.py`), its bytes and the store, and the 16-byte object keys of its pages, a
namespace per head slice. The extra pools' counterpart is `sidecars.SidecarPool`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import xxhash

from engine_integration.sglang.pages import PageGeometry, byte_buffer
from storage_backends import SyncBackend


class Attached:
    """What exists once the host pool is registered: its geometry, its bytes, the store."""

    def __init__(
        self, pool: Any, geometry: PageGeometry, store: SyncBackend, digests: Sequence[bytes]
    ):
        self.pool = pool
        self.geometry = geometry
        self.buffer = byte_buffer(pool.kv_buffer)
        self.store = store
        # The namespaces' seeds (model, layout, shard), one per head slice of a page.
        self.digests = tuple(digests)
        if len(self.digests) != geometry.head_slices:
            raise ValueError(f"{len(self.digests)} namespaces for {geometry.head_slices} slices")

    def object_keys(self, keys: Sequence[str]) -> list[bytes]:
        """The 16-byte keys of every object of every page, page by page (slice by slice
        within a page, each slice in its own namespace)."""
        if not all(type(key) is str for key in keys):
            bad = next(i for i, key in enumerate(keys) if type(key) is not str)
            raise ValueError(f"keys[{bad}] must be a str (SGLang page hash), got {keys[bad]!r}")
        hasher = xxhash.xxh3_128()
        out = []
        per_slice = self.geometry.num_objects // len(self.digests)
        for key in keys:
            raw = key.encode()
            for digest in self.digests:
                for part in range(per_slice):
                    hasher.reset()
                    hasher.update(digest)
                    hasher.update(len(raw).to_bytes(4, "little"))
                    hasher.update(raw)
                    hasher.update(part.to_bytes(2, "little"))
                    out.append(hasher.digest())
        return out

    def per_page(self, found: Sequence[bool]) -> list[bool]:
        """Per-object outcomes -> per-page: a page is there only if all its objects (every
        part of every head slice) are."""
        n = self.geometry.num_objects
        if n == 1:
            return list(found)
        return [all(found[i : i + n]) for i in range(0, len(found), n)]
