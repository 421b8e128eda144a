"""The KVStore service: requests in, statuses and pages out, over the daemon's `Store`.

Handlers take and return raw bytes: small messages are parsed with the generated protobuf
classes, the page-carrying ones with `storage_backends.pieces` (no copies of pages). Every
problem with a request is a gRPC status whose message names it:

- INVALID_ARGUMENT: a message that does not parse, a key that is not 16 bytes, pieces that do
  not add up (out of order, overlapping, past or short of their object's size);
- NOT_FOUND: a namespace this server does not have;
- UNAUTHENTICATED: a missing or wrong bearer token;
- RESOURCE_EXHAUSTED: too many keys in a call, an object or a BatchPut over the limits
  (gRPC itself answers the same for a message over --max-message-bytes).

A page that fails verification on put is refused alone (PUT_STATUS_CORRUPT, with the reason).
An unexpected exception is INTERNAL for that call only, logged (rate-limited); the server
stays up.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator, Sequence

import grpc
from google.protobuf.message import DecodeError

from hicache import __version__
from storage_backends.objects import KEY_BYTES, Buffer
from storage_backends.pieces import (
    Piece,
    WireError,
    decode_put_request,
    encode_get_response,
    split_into_messages,
)
from storage_backends.proto import kvstore_pb2 as pb
from storage_backends.protocol import DEFAULT_NAMESPACE, MIN_MESSAGE_BYTES, SERVICE
from storage_backends.stats import RateLimitedWarnings

from .auth import TokenCheck
from .config import ServerConfig
from .metrics import ServerMetrics, snapshot
from .store import NamespaceStore, PutOutcome, Store

logger = logging.getLogger(__name__)

_GET_GROUP_KEYS = 32  # BatchGet reads this many keys, then streams them, then the next
_PUT_FLUSH_BYTES = 32 << 20  # BatchPut stores completed pages once this many are pending
_PUT_STATUS = {
    "stored": pb.PUT_STATUS_STORED,
    "rejected": pb.PUT_STATUS_REJECTED,
    "corrupt": pb.PUT_STATUS_CORRUPT,
    "error": pb.PUT_STATUS_ERROR,
}
Code = grpc.StatusCode


class RequestError(Exception):
    """A request this server refuses: becomes the call's status."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def _parse(message_class, raw: bytes):
    try:
        return message_class.FromString(raw)
    except DecodeError as exc:
        raise RequestError(
            Code.INVALID_ARGUMENT, f"malformed {message_class.__name__}: {exc}"
        ) from None


class KVStoreService:
    def __init__(
        self,
        store: Store,
        config: ServerConfig,
        metrics: ServerMetrics,
        auth: TokenCheck | None,
        started_at: float,
    ) -> None:
        self.store = store
        self.config = config
        self.metrics = metrics
        self.auth = auth
        self.started_at = started_at
        self._warnings = RateLimitedWarnings("hicache serve", 30.0)

    def handler(self) -> grpc.GenericRpcHandler:
        unary = grpc.unary_unary_rpc_method_handler
        return grpc.method_handlers_generic_handler(
            SERVICE,
            {
                "BatchExists": unary(self._unary("BatchExists", self.batch_exists)),
                "BatchGet": grpc.unary_stream_rpc_method_handler(self.batch_get),
                "BatchPut": grpc.stream_unary_rpc_method_handler(
                    self._unary("BatchPut", self.batch_put)
                ),
                "Delete": unary(self._unary("Delete", self.delete)),
                "Stats": unary(self._unary("Stats", self.stats)),
            },
        )

    # -- the calls --------------------------------------------------------------------------

    async def batch_exists(self, raw: bytes, context) -> bytes:
        request = _parse(pb.BatchExistsRequest, raw)
        namespace = self._namespace(request.namespace)
        keys = self._keys(request.keys, "BatchExists")
        count = await namespace.exists(keys) if keys else 0
        return pb.BatchExistsResponse(num_present=count).SerializeToString()

    async def batch_get(self, raw: bytes, context) -> AsyncIterator[bytes]:
        async with self._serving("BatchGet", context):
            request = _parse(pb.BatchGetRequest, raw)
            namespace = self._namespace(request.namespace)
            keys = self._keys(request.keys, "BatchGet")
            limit = self.config.max_message_bytes
            if request.max_message_bytes:
                if request.max_message_bytes < MIN_MESSAGE_BYTES:
                    raise RequestError(
                        Code.INVALID_ARGUMENT,
                        f"max_message_bytes {request.max_message_bytes} is below the minimum "
                        f"{MIN_MESSAGE_BYTES}",
                    )
                limit = min(limit, request.max_message_bytes)
            async for message in self._get_messages(namespace, keys, limit):
                yield message

    async def _get_messages(
        self, namespace: NamespaceStore, keys: list[bytes], limit: int
    ) -> AsyncIterator[bytes]:
        counters = self.metrics.pages[namespace.name]
        for start in range(0, len(keys), _GET_GROUP_KEYS):
            group = keys[start : start + _GET_GROUP_KEYS]
            blobs = await namespace.get(group)
            missing = [start + i for i, blob in enumerate(blobs) if blob is None]
            found = [(start + i, keys[start + i], (blob,)) for i, blob in enumerate(blobs) if blob]
            counters["hits"] += len(found)
            counters["misses"] += len(missing)
            counters["read_bytes"] += sum(len(blob) for _, _, (blob,) in found)
            first = True
            for pieces in split_into_messages(found, limit):
                yield encode_get_response(pieces, missing if first else ())
                first = False
            if first and missing:
                yield encode_get_response((), missing)

    async def batch_put(self, request_iterator: AsyncIterator[bytes], context) -> bytes:
        pages = _PutPages(self.config)
        namespace: NamespaceStore | None = None
        outcomes: list[PutOutcome] = []
        async for raw in request_iterator:
            try:
                name, pieces = decode_put_request(raw)
            except WireError as exc:
                raise RequestError(
                    Code.INVALID_ARGUMENT, f"message {pages.num_messages}: {exc}"
                ) from None
            if namespace is None:
                namespace = self._namespace(name)
            elif name and name != namespace.name:
                raise RequestError(
                    Code.INVALID_ARGUMENT,
                    f"message {pages.num_messages} names namespace {name!r}; this call is "
                    f"for {namespace.name!r}",
                )
            pages.add(pieces)
            if pages.pending_bytes >= _PUT_FLUSH_BYTES:
                outcomes += await self._store(namespace, *pages.take())
        pages.finish()
        if namespace is not None and pages.pending_keys:
            outcomes += await self._store(namespace, *pages.take())
        return pb.BatchPutResponse(
            statuses=[_PUT_STATUS[o.status] for o in outcomes],
            reasons=[o.reason for o in outcomes],
        ).SerializeToString()

    async def _store(
        self, namespace: NamespaceStore, keys: list[bytes], blobs: list[Buffer]
    ) -> list[PutOutcome]:
        outcomes = await namespace.put(keys, blobs)
        counters = self.metrics.pages[namespace.name]
        for outcome, blob in zip(outcomes, blobs, strict=True):
            if outcome.stored:
                counters["puts"] += 1
                counters["written_bytes"] += len(blob)
            elif outcome.status == "corrupt":
                counters["put_corrupt"] += 1
                self.metrics.corrupt[namespace.name][outcome.check] += 1
            elif outcome.status == "rejected":
                counters["put_rejected"] += 1
            else:
                counters["put_errors"] += 1
        return outcomes

    async def delete(self, raw: bytes, context) -> bytes:
        request = _parse(pb.DeleteRequest, raw)
        namespace = self._namespace(request.namespace)
        keys = self._keys(request.keys, "Delete")
        count = await namespace.delete(keys) if keys else 0
        return pb.DeleteResponse(num_deleted=count).SerializeToString()

    async def stats(self, raw: bytes, context) -> bytes:
        request = _parse(pb.StatsRequest, raw)
        wanted = {self._namespace(request.namespace).name} if request.namespace else None
        snap = snapshot(self.metrics, self.store)
        reply = pb.StatsResponse(
            version=__version__,
            uptime_s=time.monotonic() - self.started_at,
            spill_mode=self.store.spill_mode,
        )
        for ns in snap.namespaces:
            if wanted is None or ns.name in wanted:
                reply.namespaces.append(_namespace_stats(ns))
        return reply.SerializeToString()

    # -- checks -----------------------------------------------------------------------------

    def _unary(self, method: str, call):
        """Wrap a call with one response in `_serving`."""

        @functools.wraps(call)
        async def wrapped(request, context):
            async with self._serving(method, context):
                return await call(request, context)

        return wrapped

    @contextlib.asynccontextmanager
    async def _serving(self, method: str, context):
        """Around every call: the token check, refusals as statuses, metrics."""
        started, code = time.perf_counter(), Code.OK
        self.metrics.in_flight += 1
        try:
            self._authorize(context)
            yield
        except RequestError as exc:
            code = exc.code
            await context.abort(exc.code, str(exc))
        except Exception as exc:  # noqa: BLE001 - one call fails, the server goes on
            code = Code.INTERNAL
            await context.abort(Code.INTERNAL, self._internal(method, exc))
        finally:
            self.metrics.in_flight -= 1
            self.metrics.observe_call(method, code.name, time.perf_counter() - started)

    def _authorize(self, context) -> None:
        if self.auth is None:
            return
        refusal = self.auth.refusal(context.invocation_metadata())
        if refusal is not None:
            raise RequestError(Code.UNAUTHENTICATED, refusal)

    def _namespace(self, name: str) -> NamespaceStore:
        namespace = self.store.namespaces.get(name or DEFAULT_NAMESPACE)
        if namespace is None:
            known = ", ".join(sorted(self.store.namespaces))
            raise RequestError(
                Code.NOT_FOUND, f"unknown namespace {name!r}; this server has: {known}"
            )
        return namespace

    def _keys(self, keys: Sequence[bytes], method: str) -> list[bytes]:
        if len(keys) > self.config.max_batch_keys:
            raise RequestError(
                Code.RESOURCE_EXHAUSTED,
                f"{method} of {len(keys)} keys; this server takes at most "
                f"{self.config.max_batch_keys} per call",
            )
        for i, key in enumerate(keys):
            if len(key) != KEY_BYTES:
                raise RequestError(
                    Code.INVALID_ARGUMENT,
                    f"keys[{i}] is {len(key)} bytes; page keys are {KEY_BYTES} bytes",
                )
        return list(keys)

    def _internal(self, method: str, exc: Exception) -> str:
        logger.error("%s failed", method, exc_info=exc)
        self._warnings.warn(f"internal:{method}", f"{method}: {type(exc).__name__}: {exc}")
        return f"internal error in {method}: {type(exc).__name__}: {exc}"


class _PutPages:
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

    def add(self, pieces: list[Piece]) -> None:
        for piece in pieces:
            self._add(piece)
        self.num_messages += 1

    def _add(self, piece: Piece) -> None:
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


def _namespace_stats(ns) -> pb.NamespaceStats:
    out = pb.NamespaceStats(
        name=ns.name,
        num_objects=ns.memory.num_objects or 0,
        stored_bytes=ns.memory.stored_bytes or 0,
        capacity_bytes=ns.memory.capacity_bytes or 0,
        num_hits=ns.pages["hits"],
        num_misses=ns.pages["misses"],
        num_puts=ns.pages["puts"],
        num_put_rejected=ns.pages["put_rejected"] + ns.pages["put_corrupt"],
        num_evictions=ns.memory.num_evictions,
        num_errors=ns.pages["put_errors"] + ns.memory.num_errors,
        read_bytes=ns.pages["read_bytes"],
        written_bytes=ns.pages["written_bytes"],
    )
    out.num_corrupt.update(ns.corrupt)
    if ns.spill is not None:
        out.spill_objects = ns.spill.num_objects or 0
        out.spill_bytes = ns.spill.stored_bytes or 0
        out.spill_capacity_bytes = ns.spill.capacity_bytes or 0
    return out
