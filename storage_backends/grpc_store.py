"""`grpc://host:port[,host:port...]`: the hicache cache-server daemon (`hicache serve`) as L3.

    grpc://10.0.0.5:50051,10.0.0.6:50051?namespace=team-a&token_file=/etc/hicache/token
    grpcs://cache.internal:50051?ca_file=/etc/hicache/ca.pem   (TLS)

With several servers, each key belongs to one of them by rendezvous hashing (`rendezvous`), so
every client agrees where a page lives and a batch is split into one call per server, all in
flight at once. A server that is down, slow or refusing becomes misses (and per-page errors)
for its keys only: the others answer as usual. A server that failed is skipped for `down_for`
(its keys miss at once, instead of each call waiting on it), then tried again.

One channel per server, opened on first use and kept: calls multiplex over its HTTP/2
connection, and gRPC reconnects it by itself (within a second) after the server comes back.
Every call carries a deadline inside the backend's `timeout`; one refused as UNAVAILABLE is
retried with exponential backoff while the deadline allows. At most `put_streams` BatchPut
streams are open to one server at once (the daemon refuses a client more than its
`--max-streams-per-client`); more puts wait for a slot, within their deadline. Pages travel
in pieces of at most `max_message` bytes (BatchGet streams them down, BatchPut streams them
up), framed by hand (`pieces`) so a page is copied once on the way out and never on the way
in before the verified copy into the caller's buffer. gRPC compression stays off: pages are
checked by their xxh3 checksum, and lz4 (the backend's `compression` option) is applied per
page.
gRPC Python itself copies each message through fresh heap buffers; on first use the backend
sets glibc's malloc policy so that those reuse warm pages instead of faulting in new ones
(`allocator`; `tune_malloc=false` leaves malloc alone).

The first use checks every server: a refused token or an unknown namespace raises
`BackendConfigError` (the server's message says which), no server answering raises
`BackendUnavailableError`; some servers down is only a warning.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator

import grpc

from .allocator import tune_for_large_messages
from .base import Fetched, PageStatus, ReadInto, StorageBackend
from .errors import BackendConfigError
from .grpc_options import GrpcOptions, options_from_url, read_file
from .guard import CopyGuard
from .objects import FramedObject
from .pieces import ObjectAssembly, WireError, encode_put_request, split_into_messages
from .proto import kvstore_pb2 as pb
from .protocol import (
    bearer_metadata,
    method_path,
)
from .rendezvous import Rendezvous
from .stats import RateLimitedWarnings

_DEADLINE_SHARE = 0.9  # RPC deadlines end before the backend's own, so one server's miss stays
_RETRYABLE = (grpc.StatusCode.UNAVAILABLE,)
_SERVER_DOWN = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
_MISCONFIGURED = (
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.INVALID_ARGUMENT,
)
_PUT_STATUS = {
    pb.PUT_STATUS_STORED: PageStatus.STORED,
    pb.PUT_STATUS_REJECTED: PageStatus.REJECTED,
    pb.PUT_STATUS_CORRUPT: PageStatus.REJECTED,  # refused: the object failed its check
}


class _ServerFailed(Exception):
    """One server's call failed as a whole; `status` is its gRPC code (None: a bad reply)."""

    def __init__(self, status: grpc.StatusCode | None, detail: str) -> None:
        super().__init__(detail)
        self.status = status


class _Server:
    """One cache-server: its channel, its callables, and when it may be tried again."""

    def __init__(self, name: str, channel: grpc.aio.Channel, put_streams: int) -> None:
        self.name = name
        self.channel = channel
        # The daemon bounds a client's open BatchPut streams: queue here rather than be refused.
        self.put_slots = asyncio.Semaphore(put_streams)
        self.exists = channel.unary_unary(
            method_path("BatchExists"),
            request_serializer=pb.BatchExistsRequest.SerializeToString,
            response_deserializer=pb.BatchExistsResponse.FromString,
        )
        self.get = channel.unary_stream(method_path("BatchGet"))  # raw bytes: see `pieces`
        self.put = channel.stream_unary(
            method_path("BatchPut"), response_deserializer=pb.BatchPutResponse.FromString
        )
        self.delete = channel.unary_unary(
            method_path("Delete"),
            request_serializer=pb.DeleteRequest.SerializeToString,
            response_deserializer=pb.DeleteResponse.FromString,
        )
        self.stats = channel.unary_unary(
            method_path("Stats"),
            request_serializer=pb.StatsRequest.SerializeToString,
            response_deserializer=pb.StatsResponse.FromString,
        )
        self.down_until = 0.0
        self.failures = 0


class GrpcBackend(StorageBackend):
    scheme = "grpc"
    transient_errors = (grpc.RpcError, OSError)

    def __init__(self, options: GrpcOptions, layout: str | None = None, *, name: str = "") -> None:
        super().__init__(options, layout, name=name)
        self.options: GrpcOptions = options
        self._ring = Rendezvous(options.servers)
        self._metadata = bearer_metadata(options.token)
        self._servers: list[_Server] = []
        self._server_warnings = RateLimitedWarnings(self.name, options.warn_interval_s)

    # -- connection ---------------------------------------------------------------------------

    def _channel(self, target: str) -> grpc.aio.Channel:
        opts = self.options
        limit = opts.max_message_bytes + 4096
        channel_options = [
            ("grpc.max_send_message_length", limit),
            ("grpc.max_receive_message_length", limit),
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.min_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 1000),
            ("grpc.enable_retries", 0),  # retries are ours: only UNAVAILABLE, within the deadline
        ]
        if not opts.tls:
            return grpc.aio.insecure_channel(target, options=channel_options)
        if opts.server_name:
            channel_options.append(("grpc.ssl_target_name_override", opts.server_name))
        roots = read_file(opts.ca_file, "ca_file") if opts.ca_file else None
        credentials = grpc.ssl_channel_credentials(root_certificates=roots)
        return grpc.aio.secure_channel(target, credentials, options=channel_options)

    async def _open(self) -> None:
        if self.options.tune_malloc:
            tune_for_large_messages()
        if not self._servers:
            self._servers = [
                _Server(name, self._channel(name), self.options.put_streams)
                for name in self.options.servers
            ]
        request = pb.StatsRequest(namespace=self.options.namespace)
        timeout = self.options.connect_timeout_s
        replies = await asyncio.gather(
            *(self._probe(server, request, timeout) for server in self._servers)
        )
        refused = [(s, exc) for s, exc in zip(self._servers, replies, strict=True) if exc]
        for server, exc in refused:
            if exc.code() in _MISCONFIGURED:
                await self._close()
                raise BackendConfigError(
                    f"{self.name}: {server.name} refused the client: {exc.code().name}: "
                    f"{exc.details()}"
                )
        if len(refused) == len(self._servers):
            await self._close()
            detail = "; ".join(f"{s.name}: {e.code().name} {e.details()}" for s, e in refused)
            raise ConnectionError(f"no cache-server answered ({detail})")
        for server, exc in refused:
            self._mark_down(server, f"{exc.code().name}: {exc.details()}")

    async def _probe(
        self, server: _Server, request: pb.StatsRequest, timeout: float
    ) -> grpc.aio.AioRpcError | None:
        try:
            await server.stats(
                request, timeout=timeout, metadata=self._metadata, wait_for_ready=True
            )
        except grpc.aio.AioRpcError as exc:
            return exc
        return None

    async def _close(self) -> None:
        servers, self._servers = self._servers, []
        for server in servers:
            await server.channel.close(grace=None)

    async def _reconnect(self) -> None:
        """Nothing to redo: each channel reconnects on its own, and a failed server is
        skipped for `down_for`, then tried again."""

    # -- primitives ---------------------------------------------------------------------------

    async def _exists(self, keys: list[bytes]) -> int:
        groups = self._ring.split(keys)
        deadline = self._deadline()
        servers = list(groups)
        counts = await asyncio.gather(
            *(self._exists_on(s, [keys[p] for p in groups[s]], deadline) for s in servers)
        )
        present = dict(zip(servers, counts, strict=True))
        owner = {p: s for s, positions in groups.items() for p in positions}
        seen = dict.fromkeys(servers, 0)
        for position in range(len(keys)):
            server = owner[position]
            if seen[server] >= present[server]:
                return position
            seen[server] += 1
        return len(keys)

    async def _exists_on(self, index: int, keys: list[bytes], deadline: float) -> int:
        request = pb.BatchExistsRequest(namespace=self.options.namespace, keys=keys)
        server = self._servers[index]

        async def call(timeout: float) -> int:
            reply = await server.exists(request, timeout=timeout, metadata=self._metadata)
            return min(reply.num_present, len(keys))

        try:
            return await self._with_retries(server, deadline, call)
        except _ServerFailed:
            return 0

    async def _fetch(self, keys: list[bytes], sizes: list[int] | None) -> list[Fetched]:
        results: list[Fetched] = [None] * len(keys)

        def deliver(position: int, item: Fetched) -> None:
            results[position] = item

        await self._get_all(keys, deliver)
        return results

    async def _fetch_into(
        self, keys: list[bytes], views: list[memoryview], guard: CopyGuard
    ) -> list[ReadInto]:
        """Verify and copy each page into its buffer as soon as its last piece arrives, on the
        event loop, within the call (so the guard is not needed), while gRPC receives the
        next ones."""
        results: list[ReadInto] = [None] * len(keys)

        def deliver(position: int, item: Fetched) -> None:
            results[position] = self._decode_into(keys[position], views[position], item)

        await self._get_all(keys, deliver)
        return results

    async def _store(self, keys: list[bytes], objects: list[FramedObject]) -> list[PageStatus]:
        groups = self._ring.split(keys)
        deadline = self._deadline()
        statuses: list[PageStatus] = [PageStatus.ERROR] * len(keys)

        async def one(index: int, positions: list[int]) -> None:
            sub = await self._put_on(
                index, [keys[p] for p in positions], [objects[p] for p in positions], deadline
            )
            for position, status in zip(positions, sub, strict=True):
                statuses[position] = status

        await asyncio.gather(*(one(index, positions) for index, positions in groups.items()))
        return statuses

    async def _delete(self, keys: list[bytes]) -> int:
        groups = self._ring.split(keys)
        deadline = self._deadline()

        async def one(index: int, positions: list[int]) -> int:
            server = self._servers[index]
            request = pb.DeleteRequest(
                namespace=self.options.namespace, keys=[keys[p] for p in positions]
            )

            async def call(timeout: float) -> int:
                reply = await server.delete(request, timeout=timeout, metadata=self._metadata)
                return reply.num_deleted

            try:
                return await self._with_retries(server, deadline, call)
            except _ServerFailed:
                return 0

        counts = await asyncio.gather(*(one(i, positions) for i, positions in groups.items()))
        return sum(counts)

    # -- BatchGet -------------------------------------------------------------------------------

    async def _get_all(self, keys: list[bytes], deliver: Callable[[int, Fetched], None]) -> None:
        groups = self._ring.split(keys)
        deadline = self._deadline()

        async def one(index: int, positions: list[int]) -> None:
            done: set[int] = set()

            def on_object(sub_index: int, item: Fetched) -> None:
                done.add(sub_index)
                deliver(positions[sub_index], item)

            sub_keys = [keys[p] for p in positions]
            try:
                await self._get_on(index, sub_keys, on_object, deadline)
            except _ServerFailed:
                for sub_index, position in enumerate(positions):
                    if sub_index not in done:
                        deliver(position, PageStatus.ERROR)

        await asyncio.gather(*(one(index, positions) for index, positions in groups.items()))

    async def _get_on(
        self,
        index: int,
        keys: list[bytes],
        on_object: Callable[[int, Fetched], None],
        deadline: float,
    ) -> None:
        server = self._servers[index]
        request = pb.BatchGetRequest(
            namespace=self.options.namespace,
            keys=keys,
            max_message_bytes=self.options.max_message_bytes,
        ).SerializeToString()

        async def call(timeout: float) -> None:
            assembly = ObjectAssembly(keys, on_object)
            stream = server.get(request, timeout=timeout, metadata=self._metadata)
            try:
                async for message in stream:
                    assembly.add(message)
            except grpc.aio.AioRpcError as exc:
                if assembly.started:  # part of the batch arrived: retrying would repeat it
                    raise _ServerFailed(exc.code(), _describe(exc)) from None
                raise
            assembly.finish()

        await self._with_retries(server, deadline, call)

    # -- BatchPut -------------------------------------------------------------------------------

    async def _put_on(
        self, index: int, keys: list[bytes], objects: list[FramedObject], deadline: float
    ) -> list[PageStatus]:
        server = self._servers[index]

        def messages() -> Iterator[bytes]:
            namespace = self.options.namespace
            pages = [
                (i, key, (obj.header, obj.payload))
                for i, (key, obj) in enumerate(zip(keys, objects, strict=True))
            ]
            for pieces in split_into_messages(pages, self.options.max_message_bytes):
                yield encode_put_request(namespace, pieces)
                namespace = ""

        async def call(timeout: float) -> pb.BatchPutResponse:
            return await server.put(messages(), timeout=timeout, metadata=self._metadata)

        try:
            async with server.put_slots:
                reply = await self._with_retries(server, deadline, call)
        except _ServerFailed:
            return [PageStatus.ERROR] * len(keys)
        if len(reply.statuses) != len(keys):
            self._note_page_error(
                f"{server.name}: answered {len(reply.statuses)} statuses for {len(keys)} pages"
            )
            return [PageStatus.ERROR] * len(keys)
        statuses = [_PUT_STATUS.get(status, PageStatus.ERROR) for status in reply.statuses]
        for status, reason in zip(reply.statuses, reply.reasons, strict=False):
            if status != pb.PUT_STATUS_STORED:
                self._note_page_error(f"{server.name}: {reason or 'page not stored'}")
        return statuses

    # -- shared machinery -------------------------------------------------------------------

    def _deadline(self) -> float:
        return time.monotonic() + self.options.timeout_s * _DEADLINE_SHARE

    async def _with_retries(self, server: _Server, deadline: float, call):
        """Run `call(timeout)` against one server; retry UNAVAILABLE with backoff while the
        deadline allows. Raises _ServerFailed (and marks the server down when it is)."""
        if time.monotonic() < server.down_until:
            raise _ServerFailed(grpc.StatusCode.UNAVAILABLE, f"{server.name} is marked down")
        delay = self.options.backoff_s
        for attempt in range(self.options.retries + 1):
            remaining = deadline - time.monotonic()
            if remaining <= 0:  # spent by an earlier attempt's backoff: not this server's fault
                raise _ServerFailed(grpc.StatusCode.DEADLINE_EXCEEDED, "no time left")
            try:
                result = await call(remaining)
            except grpc.aio.AioRpcError as exc:
                failure = _ServerFailed(exc.code(), _describe(exc))
                if exc.code() in _RETRYABLE and attempt < self.options.retries:
                    if deadline - time.monotonic() > delay:
                        await asyncio.sleep(delay)
                        delay *= 2
                        continue
            except (_ServerFailed, WireError) as exc:
                failure = exc if isinstance(exc, _ServerFailed) else _ServerFailed(None, str(exc))
            else:
                server.failures = 0
                return result
            self._server_failed(server, failure)
            raise failure
        raise AssertionError("unreachable")

    def _server_failed(self, server: _Server, failure: _ServerFailed) -> None:
        detail = f"{failure.status.name if failure.status else 'bad reply'}: {failure}"
        if failure.status in _SERVER_DOWN:
            self._mark_down(server, detail)
        else:
            self._note_page_error(f"{server.name}: {detail}")
            self._server_warnings.warn(f"failed:{server.name}", f"{server.name}: {detail}")

    def _mark_down(self, server: _Server, detail: str) -> None:
        server.failures += 1
        server.down_until = time.monotonic() + self.options.down_s
        self._note_page_error(f"{server.name}: {detail}")
        self._server_warnings.warn(
            f"down:{server.name}",
            f"{server.name} is down ({detail}); its keys miss for {self.options.down_s}s",
        )

    async def server_stats(self) -> dict[str, pb.StatsResponse | None]:
        """Each server's Stats reply for this namespace (None where the server failed)."""
        self._check_open()
        await self.connect()
        request = pb.StatsRequest(namespace=self.options.namespace)
        deadline = self._deadline()

        async def one(server: _Server) -> pb.StatsResponse | None:
            async def call(timeout: float) -> pb.StatsResponse:
                return await server.stats(request, timeout=timeout, metadata=self._metadata)

            try:
                return await self._with_retries(server, deadline, call)
            except _ServerFailed:
                return None

        replies = await asyncio.gather(*(one(server) for server in self._servers))
        return {server.name: reply for server, reply in zip(self._servers, replies, strict=True)}


def _describe(exc: grpc.aio.AioRpcError) -> str:
    return exc.details() or exc.code().name


def open_url(url: str, *, layout: str | None = None, name: str = "") -> GrpcBackend:
    """`grpc://host:port[,host:port...]?namespace=...&token_file=...&timeout=...` (or
    `grpcs://` for TLS)."""
    return GrpcBackend(options_from_url(url, name), layout, name=name or url)
