"""BatchPut streams: their pages put back together, and the limits on what they may hold.

A stream's unfinished pages live in the daemon's memory until they are complete and stored,
so they are bounded like everything else there:

- at most `max_streams` BatchPut streams at once, shared fairly among tenants (`shares`: a
  tenant at its limit never takes another's share), and `max_streams_per_client` from one
  client connection (its gRPC peer address): one more is refused at once;
- the bytes a stream holds (pieces of its page in progress, completed pages not stored yet)
  are charged to its namespace, as memory the namespace uses (`NamespaceStore.charge`): the
  namespace's stored pages make room for them, and a charge that would take a namespace's
  streams past its quota is refused;
- a stream that sends nothing for `stream_idle_timeout_s` is dropped.

Every refusal is RESOURCE_EXHAUSTED with a message that names the limit (and its flag); what
the stream held is released at once. The limits are checked between messages, so no single
message (at most --max-message-bytes) is held past them.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator

import grpc

from storage_backends.buffers import KEY_BYTES, Buffer
from storage_backends.pieces import Piece

from .config import ServerConfig
from .errors import RequestError
from .shares import FairShares

Code = grpc.StatusCode


class StreamLimits:
    """How many BatchPut streams are open, in all, per tenant and per client."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.num_streams = 0
        self.by_client: Counter[str] = Counter()
        self.by_tenant = FairShares(config.max_streams, config.num_tenants)
        self.num_refused: Counter[str] = Counter()  # by limit: "streams", "client", "quota"...

    @contextlib.contextmanager
    def stream(self, client: str, tenant: object = None) -> Iterator[None]:
        """Hold one stream slot of `client` (of `tenant`) for the block; RequestError when
        none is left."""
        config = self.config
        if not self.by_tenant.may_take(tenant):
            self.num_refused["tenant"] += 1
            raise RequestError(
                Code.RESOURCE_EXHAUSTED,
                f"this tenant has {self.by_tenant.in_use[tenant]} BatchPut streams open, its "
                f"share of --max-streams {config.max_streams} among {config.num_tenants} "
                "tenants; retry later",
            )
        if self.num_streams >= config.max_streams:
            self.num_refused["streams"] += 1
            raise RequestError(
                Code.RESOURCE_EXHAUSTED,
                f"{self.num_streams} BatchPut streams are open, this server's limit "
                f"(--max-streams {config.max_streams}); retry later",
            )
        if self.by_client[client] >= config.max_streams_per_client:
            self.num_refused["client"] += 1
            raise RequestError(
                Code.RESOURCE_EXHAUSTED,
                f"this client has {self.by_client[client]} BatchPut streams open, the limit "
                f"per client (--max-streams-per-client {config.max_streams_per_client})",
            )
        self.num_streams += 1
        self.by_client[client] += 1
        self.by_tenant.take(tenant)
        try:
            yield
        finally:
            self.num_streams -= 1
            _decrement(self.by_client, client)
            self.by_tenant.give_back(tenant)


def _decrement(counter: Counter, key: object) -> None:
    counter[key] -= 1
    if not counter[key]:
        del counter[key]


class PutPages:
    """Puts a BatchPut stream's pieces back into pages, checking that they add up.

    Pages are numbered 0, 1, 2... in stream order; each arrives as consecutive pieces from
    offset 0 to its `object_bytes`. A completed page whose object came in one piece stays a
    view into its message (no copy).
    """

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.num_messages = 0
        self.num_pages = 0  # pages started
        self.total_bytes = 0
        self.pending_keys: list[bytes] = []
        self.pending_blobs: list[Buffer] = []
        self.pending_bytes = 0
        self._in_page = False
        self._key = b""
        self._size = 0
        self._parts: list[memoryview] = []
        self._got = 0

    @property
    def held_bytes(self) -> int:
        """Bytes this stream holds: completed pages not stored yet, and the page in progress."""
        return self.pending_bytes + self._got

    def end_message(self) -> None:
        self.num_messages += 1

    def add(self, piece: Piece) -> None:
        """One piece, in stream order (RequestError when it does not fit the pages so far)."""
        page = self.num_pages - 1  # the page in progress, if any
        if not self._in_page:
            if piece.index != self.num_pages:
                self._fail(
                    f"a piece for page {piece.index} arrived where page {self.num_pages} should "
                    "start (pages are numbered 0, 1, 2... in stream order)"
                )
            self._start(piece)
        elif piece.index != page:
            self._fail(
                f"page {page} ended after {self._got} of its {self._size} bytes: a piece for "
                f"page {piece.index} came next"
            )
        elif piece.key != self._key or piece.object_bytes != self._size:
            self._fail(f"page {page}: a later piece changes its key or object_bytes")
        elif piece.offset != self._got:
            self._fail(f"page {page}: a piece at offset {piece.offset}, expected {self._got}")
        if self._got + len(piece.data) > self._size:
            self._fail(
                f"page {piece.index}: pieces add up to more than its object_bytes {self._size}"
            )
        self._parts.append(piece.data)
        self._got += len(piece.data)
        if self._got == self._size:
            blob = self._parts[0] if len(self._parts) == 1 else b"".join(self._parts)
            self.pending_keys.append(self._key)
            self.pending_blobs.append(blob)
            self.pending_bytes += self._size
            self._in_page, self._parts, self._got = False, [], 0

    def _start(self, piece: Piece) -> None:
        page = piece.index
        if len(piece.key) != KEY_BYTES:
            self._fail(f"page {page}: key is {len(piece.key)} bytes; page keys are {KEY_BYTES}")
        if piece.offset != 0:
            self._fail(f"page {page}: its first piece starts at offset {piece.offset}, not 0")
        if piece.object_bytes == 0:
            self._fail(f"page {page}: object_bytes is 0")
        if piece.object_bytes > self.config.max_object_bytes:
            raise RequestError(
                Code.RESOURCE_EXHAUSTED,
                f"page {page}: an object of {piece.object_bytes} bytes is over this server's "
                f"limit of {self.config.max_object_bytes}",
            )
        if self.num_pages >= self.config.max_batch_keys:
            raise RequestError(
                Code.RESOURCE_EXHAUSTED,
                f"BatchPut of more than {self.config.max_batch_keys} pages; this server takes "
                "at most that many per call",
            )
        self.total_bytes += piece.object_bytes
        if self.total_bytes > self.config.max_put_bytes:
            raise RequestError(
                Code.RESOURCE_EXHAUSTED,
                f"BatchPut of more than {self.config.max_put_bytes} bytes; split the batch",
            )
        self.num_pages += 1
        self._in_page = True
        self._key, self._size = piece.key, piece.object_bytes

    def finish(self) -> None:
        if self._in_page:
            self._fail(
                f"the stream ended inside page {self.num_pages - 1}, after {self._got} of "
                f"{self._size} bytes"
            )

    def take(self) -> tuple[list[bytes], list[Buffer]]:
        taken = (self.pending_keys, self.pending_blobs)
        self.pending_keys, self.pending_blobs, self.pending_bytes = [], [], 0
        return taken

    def _fail(self, message: str) -> None:
        raise RequestError(Code.INVALID_ARGUMENT, message)
