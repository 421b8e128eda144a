"""The KVStore service: requests in, statuses and pages out, over the daemon's `Store`.

Handlers take and return raw bytes: small messages are parsed with the generated protobuf
classes, the page-carrying ones with `storage_backends.pieces` (no copies of pages). Every
problem with a request is a gRPC status whose message names it:

- INVALID_ARGUMENT: a message that does not parse, a key that is not 16 bytes, pieces that do
  not add up (out of order, overlapping, past or short of their object's size);
- NOT_FOUND: a namespace this server does not have (asked by a caller that may use all);
- UNAUTHENTICATED: a missing or wrong bearer token;
- PERMISSION_DENIED: a namespace the caller's token is not bound to (`tenants`);
- RESOURCE_EXHAUSTED: too many keys in a call, an object or a BatchPut over the limits, a
  BatchPut stream over the stream limits or idle too long (`streams`); gRPC itself answers
  the same for a message over --max-message-bytes.

A page that fails verification on put is refused alone (PUT_STATUS_CORRUPT, with the reason).
An unexpected exception is INTERNAL for that call only, logged (rate-limited); the server
stays up.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator, Sequence

import grpc
from google.protobuf.message import DecodeError

from hicache import __version__
from storage_backends.buffers import KEY_BYTES, Buffer
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

from .auth import ANYONE, Refused, Tenant, TokenCheck
from .config import REFUSAL_CALLS, ServerConfig
from .errors import RequestError
from .memory import MemoryReturn, clear_frames
from .metrics import ServerMetrics, snapshot
from .shares import FairShares
from .store import NamespaceStore, PutOutcome, Store
from .streams import PutPages, StreamLimits

logger = logging.getLogger(__name__)

_GET_GROUP_KEYS = 32  # BatchGet reads this many keys, then streams them, then the next
_SEND_MARGIN_S = 0.25  # of a call's deadline, kept for sending its answer
_PUT_FLUSH_BYTES = 32 << 20  # BatchPut stores completed pages once this many are pending
_PUT_STATUS = {
    "stored": pb.PUT_STATUS_STORED,
    "rejected": pb.PUT_STATUS_REJECTED,
    "corrupt": pb.PUT_STATUS_CORRUPT,
    "error": pb.PUT_STATUS_ERROR,
}
Code = grpc.StatusCode


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
        streams: StreamLimits,
        auth: TokenCheck | None,
        started_at: float,
    ) -> None:
        self.store = store
        self.config = config
        self.metrics = metrics
        self.streams = streams
        self.auth = auth
        self.started_at = started_at
        self._warnings = RateLimitedWarnings("hicache serve", 30.0)
        self.memory = MemoryReturn()
        # Calls in flight, shared fairly among tenants (gRPC refuses past the total itself).
        self.calls = FairShares(config.budget.num_calls - REFUSAL_CALLS, config.num_tenants)

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

    async def batch_exists(self, raw: bytes, context, tenant: Tenant) -> bytes:
        request = _parse(pb.BatchExistsRequest, raw)
        namespace = self._namespace(request.namespace, tenant)
        keys = self._keys(request.keys, "BatchExists")
        count = await namespace.exists(keys) if keys else 0
        return pb.BatchExistsResponse(num_present=count).SerializeToString()

    async def batch_get(self, raw: bytes, context) -> AsyncIterator[bytes]:
        async with self._serving("BatchGet", context) as tenant:
            request = _parse(pb.BatchGetRequest, raw)
            namespace = self._namespace(request.namespace, tenant)
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
            deadline = _deadline(context)
            async for message in self._get_messages(namespace, keys, limit, deadline):
                yield message

    async def _get_messages(
        self, namespace: NamespaceStore, keys: list[bytes], limit: int, deadline: float | None
    ) -> AsyncIterator[bytes]:
        counters = self.metrics.pages[namespace.name]
        for start in range(0, len(keys), _GET_GROUP_KEYS):
            group = keys[start : start + _GET_GROUP_KEYS]
            left_s = None if deadline is None else deadline - time.monotonic()
            blobs = await namespace.get(group, left_s)
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

    async def batch_put(
        self, request_iterator: AsyncIterator[bytes], context, tenant: Tenant
    ) -> bytes:
        with self.streams.stream(context.peer(), tenant):
            deadline = _deadline(context)
            pages = PutPages(self.config)
            namespace: NamespaceStore | None = None
            charged = 0  # bytes of this stream charged to its namespace
            try:
                outcomes: list[PutOutcome] = []
                async for raw in self._messages(request_iterator):
                    namespace, pieces = self._decode_message(pages, raw, namespace, tenant)
                    flush_bytes = min(_PUT_FLUSH_BYTES, namespace.capacity_bytes // 4)
                    for piece in pieces:
                        pages.add(piece)
                        if pages.pending_bytes >= flush_bytes:
                            keys, blobs = pages.take()
                            charged = await self._release(namespace, pages, charged)
                            outcomes += await self._store(namespace, keys, blobs, deadline)
                    pages.end_message()
                    # What outlives the message: charged to the namespace, or refused.
                    charged = await self._charge(namespace, pages.held_bytes, charged)
                pages.finish()
                if namespace is not None and pages.pending_keys:
                    keys, blobs = pages.take()
                    charged = await self._release(namespace, pages, charged)
                    outcomes += await self._store(namespace, keys, blobs, deadline)
            finally:
                if namespace is not None and charged:
                    await namespace.charge(-charged)
        return pb.BatchPutResponse(
            statuses=[_PUT_STATUS[o.status] for o in outcomes],
            reasons=[o.reason for o in outcomes],
        ).SerializeToString()

    async def _messages(self, request_iterator: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        """The stream's messages; RequestError when the next one takes longer than the idle
        timeout."""
        idle_s = self.config.stream_idle_timeout_s
        iterator = aiter(request_iterator)
        while True:
            try:
                raw = await asyncio.wait_for(anext(iterator), idle_s)
            except StopAsyncIteration:
                return
            except asyncio.TimeoutError:
                self.streams.num_refused["idle"] += 1
                raise RequestError(
                    Code.RESOURCE_EXHAUSTED,
                    f"the BatchPut stream sent nothing for {idle_s:g}s "
                    "(--stream-idle-timeout); what it sent is dropped",
                ) from None
            yield raw

    def _decode_message(
        self, pages: PutPages, raw: bytes, namespace: NamespaceStore | None, tenant: Tenant
    ) -> tuple[NamespaceStore, list[Piece]]:
        try:
            name, pieces = decode_put_request(raw)
        except WireError as exc:
            raise RequestError(
                Code.INVALID_ARGUMENT, f"message {pages.num_messages}: {exc}"
            ) from None
        if namespace is None:
            namespace = self._namespace(name, tenant)
        elif name and name != namespace.name:
            raise RequestError(
                Code.INVALID_ARGUMENT,
                f"message {pages.num_messages} names namespace {name!r}; this call is "
                f"for {namespace.name!r}",
            )
        return namespace, pieces

    async def _release(self, namespace: NamespaceStore, pages: PutPages, charged: int) -> int:
        """Before pages the stream took are stored: release their charge; returns the new."""
        held = min(charged, pages.held_bytes)
        await namespace.charge(held - charged)
        return held

    async def _charge(self, namespace: NamespaceStore, held: int, charged: int) -> int:
        """Charge the namespace for the `held` bytes the stream holds now; returns the new
        charge (RequestError when the namespace's streams would hold too much)."""
        if held != charged and not await namespace.charge(held - charged):
            self.streams.num_refused["quota"] += 1
            raise RequestError(
                Code.RESOURCE_EXHAUSTED,
                f"namespace {namespace.name!r}: unfinished BatchPut pages would hold more "
                f"than its {namespace.capacity_bytes} bytes of memory "
                f"({namespace.in_flight_bytes} held by its streams); send fewer or smaller "
                "batches at once",
            )
        return held

    async def _store(
        self,
        namespace: NamespaceStore,
        keys: list[bytes],
        blobs: list[Buffer],
        deadline: float | None,
    ) -> list[PutOutcome]:
        left_s = None if deadline is None else deadline - time.monotonic()
        outcomes = await namespace.put(keys, blobs, left_s)
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

    async def delete(self, raw: bytes, context, tenant: Tenant) -> bytes:
        request = _parse(pb.DeleteRequest, raw)
        namespace = self._namespace(request.namespace, tenant)
        keys = self._keys(request.keys, "Delete")
        count = await namespace.delete(keys) if keys else 0
        return pb.DeleteResponse(num_deleted=count).SerializeToString()

    async def stats(self, raw: bytes, context, tenant: Tenant) -> bytes:
        request = _parse(pb.StatsRequest, raw)
        if request.namespace:
            wanted = {self._namespace(request.namespace, tenant).name}
        else:  # every namespace the caller may use
            wanted = {name for name in self.store.namespaces if tenant.may_use(name)}
        snap = snapshot(self.metrics, self.store, self.streams, tenant)
        reply = pb.StatsResponse(
            version=__version__,
            uptime_s=time.monotonic() - self.started_at,
            spill_mode=self.store.spill_mode,
        )
        for ns in snap.namespaces:
            if ns.name in wanted:
                reply.namespaces.append(_namespace_stats(ns))
        return reply.SerializeToString()

    # -- checks -----------------------------------------------------------------------------

    def _unary(self, method: str, call):
        """Wrap a call with one response in `_serving`."""

        @functools.wraps(call)
        async def wrapped(request, context):
            async with self._serving(method, context) as tenant:
                return await call(request, context, tenant)

        return wrapped

    @contextlib.asynccontextmanager
    async def _serving(self, method: str, context):
        """Around every call: the token check (yields the caller), refusals as statuses,
        metrics."""
        started, code = time.perf_counter(), Code.OK
        self.metrics.in_flight += 1
        tenant = None
        try:
            tenant = self._admit(self._authorize(context))
            yield tenant
        except RequestError as exc:
            code = exc.code
            clear_frames(exc)  # the messages the call read go now, not at the next collection
            await context.abort(exc.code, str(exc))
        except Exception as exc:  # noqa: BLE001 - one call fails, the server goes on
            code = Code.INTERNAL
            message = self._internal(method, exc)
            clear_frames(exc)
            await context.abort(Code.INTERNAL, message)
        finally:
            if tenant is not None:
                self.calls.give_back(tenant)
            self.metrics.in_flight -= 1
            self.metrics.observe_call(method, code.name, time.perf_counter() - started)
            self.memory.calls_ended(self.metrics.in_flight)

    def _admit(self, tenant: Tenant) -> Tenant:
        """Count a call against its tenant's share of the calls in flight (RequestError past
        it): one tenant's calls never fill what the memory budget leaves the others."""
        if not self.calls.may_take(tenant):
            raise RequestError(
                Code.RESOURCE_EXHAUSTED,
                f"this tenant has {self.calls.in_use[tenant]} calls in flight, its share of "
                f"the {self.calls.total} this server's --memory-limit allows; retry later",
            )
        self.calls.take(tenant)
        return tenant

    def _authorize(self, context) -> Tenant:
        if self.auth is None:
            return ANYONE
        try:
            return self.auth.tenant(context.invocation_metadata())
        except Refused as exc:
            raise RequestError(Code.UNAUTHENTICATED, str(exc)) from None

    def _namespace(self, name: str, tenant: Tenant) -> NamespaceStore:
        name = name or DEFAULT_NAMESPACE
        if not tenant.may_use(name):  # whether it exists is not this caller's business
            allowed = ", ".join(sorted(tenant.namespaces or ()))
            raise RequestError(
                Code.PERMISSION_DENIED,
                f"this token may not use namespace {name!r} (it may use: {allowed})",
            )
        namespace = self.store.namespaces.get(name)
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


def _deadline(context) -> float | None:
    """When the call's spill reads and writes must be done (monotonic), so that its answer,
    misses and unstored pages included, still reaches the client: its deadline less a margin
    for sending; None without one."""
    left_s = context.time_remaining()
    if left_s is None or left_s > 1e9:
        return None
    return time.monotonic() + max(left_s - _SEND_MARGIN_S, left_s / 2)


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
    out.num_spill_dropped = ns.num_spill_dropped
    out.in_flight_bytes = ns.in_flight_bytes
    out.spilling_bytes = ns.spilling_bytes
    if ns.spill is not None:
        out.spill_objects = ns.spill.num_objects or 0
        out.spill_bytes = ns.spill.stored_bytes or 0
        out.spill_capacity_bytes = ns.spill.capacity_bytes or 0
        out.num_spill_corrupt.update(ns.spill.num_corrupt)
    return out
