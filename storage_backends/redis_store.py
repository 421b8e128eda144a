"""Redis and Redis Cluster: `redis://host:port/db`, `rediss://`, `redis+cluster://host:port`.

A page is one string value, `<prefix>{<32 hex digits of the key>}`, holding the encoded object
(header, then payload). A payload longer than `chunk_size` continues in `...}:1`, `...}:2`, ...:
chunks keep every value under Redis's bulk limit and bound the latency one value adds for
other clients. The braces are a hash tag: a page's chunks share its hash slot, so in a cluster
one node holds the whole page. A page that fits one chunk (the common case: 4 MiB by default)
is written atomically; a reader that catches a multi-chunk page half rewritten gets a checksum
miss, never mixed bytes.

Every batch is one round trip (per node, in a cluster). On a single server the batch goes
through one pooled redis-py connection as packed commands: the header and the caller's page
are sent as the parts of one value, never joined, and replies are read without redis-py's
per-command pipeline machinery (which costs more than the framing and checksum that this
backend adds). Redis Cluster goes through redis-py's cluster pipeline, which routes by slot.

Capacity and eviction are Redis's own: run the server with `maxmemory` and
`maxmemory-policy allkeys-lru`; a write refused for lack of memory is a rejected put. `ttl`
(optional) expires pages. If a key is rewritten with fewer chunks (after changing
`chunk_size` or `compression`), its old tail chunks stay until they expire or are evicted;
readers stop at the header's payload length, so they never read them.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import islice
from urllib.parse import unquote

import redis.asyncio as aredis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import OutOfMemoryError, RedisClusterException, RedisError, ResponseError

from .base import Fetched, PageStatus, StorageBackend
from .errors import BackendConfigError
from .objects import HEADER_FIXED_BYTES, MAX_PAYLOAD_BYTES, FramedObject, peek_sizes
from .options import BackendOptions, check_range, options_from_query, redact_url, url_option

_DEFAULT_PORT = 6379
_MAX_BULK_BYTES = 512 << 20  # Redis's proto-max-bulk-len default
_MIN_CHUNK_BYTES = 1024  # the smallest chunk_size: a writer's chunks are never shorter
_MAX_CHUNKS = 4096  # values one page may span (a larger page is refused on put)

Arg = bytes | Sequence[bytes | memoryview]  # one argument: a buffer, or parts sent as one value


@dataclass(frozen=True)
class RedisOptions(BackendOptions):
    nodes: tuple[tuple[str, int], ...] = (("127.0.0.1", _DEFAULT_PORT),)
    db: int = 0
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    tls: bool = False
    cluster: bool = False
    prefix: str = url_option("prefix", "str", "hicache:", doc="key prefix: one per namespace")
    ttl_s: float = url_option("ttl", "duration", 0.0, doc="expire pages after this; 0: never")
    chunk_bytes: int = url_option("chunk_size", "size", 4 << 20, doc="largest value sent")
    max_connections: int = url_option("max_connections", "int", 32, doc="per server")
    connect_timeout_s: float = url_option("connect_timeout", "duration", 2.0)
    ca_certs: str = url_option("ca_certs", "str", "", doc="TLS: CA bundle file")
    tls_verify: bool = url_option("tls_verify", "bool", True, doc="TLS: check the certificate")

    def __post_init__(self) -> None:
        super().__post_init__()
        check_range("chunk_size", self.chunk_bytes, low=1024, high=_MAX_BULK_BYTES)
        check_range("max_connections", self.max_connections, low=1)
        check_range("ttl", self.ttl_s, low=0.0)
        check_range("connect_timeout", self.connect_timeout_s, low=0.001)
        check_range("db", self.db, low=0)
        if not self.nodes:
            raise BackendConfigError("a Redis URL needs host:port")
        if not self.cluster and len(self.nodes) != 1:
            raise BackendConfigError("redis:// takes one host:port; use redis+cluster:// for more")
        if self.cluster and self.db != 0:
            raise BackendConfigError("Redis Cluster has only database 0")


class RedisBackend(StorageBackend):
    scheme = "redis"
    transient_errors = (RedisError, RedisClusterException, OSError)

    def __init__(self, options: RedisOptions, layout: str | None = None, *, name: str = "") -> None:
        super().__init__(options, layout, name=name)
        self.options: RedisOptions = options
        self._prefix = options.prefix.encode()
        self._ttl_args: list[bytes] = [b"PX", b"%d" % int(options.ttl_s * 1000)]
        if not options.ttl_s:
            self._ttl_args = []
        self._client: aredis.Redis | RedisCluster | None = None

    # -- connection ---------------------------------------------------------------------------

    def _make_client(self) -> aredis.Redis | RedisCluster:
        opts = self.options
        common = dict(
            username=opts.username,
            password=opts.password,
            # No per-read socket timeout: every call already runs under the base's deadline,
            # and redis-py would arm a timer for each reply of a batch.
            socket_timeout=None,
            socket_connect_timeout=opts.connect_timeout_s,
            retry=Retry(NoBackoff(), 1),  # one quick retry; the next call reconnects anyway
        )
        if opts.tls:
            common.update(
                ssl_ca_certs=opts.ca_certs or None,
                ssl_cert_reqs="required" if opts.tls_verify else "none",
                ssl_check_hostname=opts.tls_verify,
            )
        if opts.cluster:
            nodes = [ClusterNode(host, port) for host, port in opts.nodes]
            return RedisCluster(
                startup_nodes=nodes,
                max_connections=opts.max_connections,
                require_full_coverage=False,  # keys on live shards keep working
                ssl=opts.tls,
                **common,
            )
        ((host, port),) = opts.nodes
        if opts.tls:
            common["connection_class"] = aredis.SSLConnection
        pool = aredis.BlockingConnectionPool(
            host=host,
            port=port,
            db=opts.db,
            max_connections=opts.max_connections,
            timeout=opts.timeout_s,  # wait this long for a free connection
            **common,
        )
        return aredis.Redis(connection_pool=pool)

    async def _open(self) -> None:
        client = self._make_client()
        self._client = client
        if isinstance(client, RedisCluster):
            await client.initialize()
        else:
            await client.ping()

    async def _close(self) -> None:
        client, self._client = self._client, None
        if client is None:
            return
        await client.aclose()
        if not isinstance(client, RedisCluster):
            await client.connection_pool.disconnect()

    # -- one round trip -------------------------------------------------------------------------

    async def _run(self, commands: list[list[Arg]]) -> list[object]:
        """Send commands as one batch; one reply per command, an error reply as an exception."""
        if isinstance(self._client, RedisCluster):
            pipe = self._client.pipeline(transaction=False)
            for name, *args in commands:  # the cluster client routes by command name: a str
                pipe.execute_command(name.decode(), *(_joined(arg) for arg in args))
            return await pipe.execute(raise_on_error=False)
        pool = self._client.connection_pool
        conn = await _get_connection(pool)
        try:
            await conn.send_packed_command(_pack(commands), check_health=False)
            replies: list[object] = []
            for _ in commands:
                try:
                    replies.append(await conn.read_response(disable_decoding=True))
                except ResponseError as exc:  # a whole error reply: the stream stays in step
                    replies.append(exc)
            return replies
        except BaseException:
            await conn.disconnect()  # a half-read connection must not be reused
            raise
        finally:
            await pool.release(conn)

    # -- keys -------------------------------------------------------------------------------

    def _redis_key(self, key: bytes) -> bytes:
        return b"%s{%s}" % (self._prefix, key.hex().encode())

    @staticmethod
    def _chunk_key(redis_key: bytes, index: int) -> bytes:
        return redis_key if index == 0 else b"%s:%d" % (redis_key, index)

    # -- primitives ---------------------------------------------------------------------------

    async def _exists(self, keys: list[bytes]) -> int:
        replies = await self._run([[b"EXISTS", self._redis_key(key)] for key in keys])
        for i, reply in enumerate(replies):
            if reply != 1:
                return i
        return len(keys)

    async def _store(self, keys: list[bytes], objects: list[FramedObject]) -> list[PageStatus]:
        commands: list[list[Arg]] = []
        owner: list[int] = []  # which page each command writes
        statuses = [PageStatus.STORED] * len(keys)
        for i, (key, obj) in enumerate(zip(keys, objects, strict=True)):
            if len(obj.payload) > _MAX_CHUNKS * self.options.chunk_bytes:
                statuses[i] = PageStatus.REJECTED  # readers never fetch that many values
                continue
            for chunk_key, parts in self._values(self._redis_key(key), obj):
                commands.append([b"SET", chunk_key, parts, *self._ttl_args])
                owner.append(i)
        replies = await self._run(commands) if commands else []
        for i, reply in zip(owner, replies, strict=True):
            if isinstance(reply, OutOfMemoryError):
                statuses[i] = PageStatus.REJECTED  # maxmemory reached, no eviction policy
            elif isinstance(reply, Exception):
                self._note_page_error(f"{type(reply).__name__}: {reply}")
                statuses[i] = PageStatus.ERROR
        return statuses

    def _values(self, redis_key: bytes, obj: FramedObject) -> list[tuple[bytes, list]]:
        """(key, value parts) per chunk: header and the payload's first chunk, then the rest."""
        payload = memoryview(obj.payload)
        chunk = self.options.chunk_bytes
        values = [(redis_key, [obj.header, payload[:chunk]])]
        for index, offset in enumerate(range(chunk, len(payload), chunk), start=1):
            values.append((self._chunk_key(redis_key, index), [payload[offset : offset + chunk]]))
        return values

    async def _fetch(self, keys: list[bytes], sizes: list[int] | None) -> list[Fetched]:
        """GET a page's value and the chunks its expected size needs, in one round trip; a
        page written with smaller chunks than we expect costs a second one."""
        chunk = self.options.chunk_bytes
        wanted = [1 + max(0, -(-(size - chunk) // chunk)) for size in sizes or [0] * len(keys)]
        commands = []
        for key, num in zip(keys, wanted, strict=True):
            redis_key = self._redis_key(key)
            commands += [[b"GET", self._chunk_key(redis_key, i)] for i in range(num)]
        replies = iter(await self._run(commands))
        fetched: list[Fetched] = []
        missing: list[tuple[int, int, list]] = []  # (page, first chunk index, parts so far)
        for i, num in enumerate(wanted):
            parts, more_from = _assemble([next(replies) for _ in range(num)])
            fetched.append(parts)
            if more_from:
                missing.append((i, more_from, parts))
        if missing:
            await self._fetch_rest(keys, sizes, missing)
        return fetched

    async def _fetch_rest(
        self, keys: list[bytes], sizes: list[int] | None, missing: list[tuple[int, int, list]]
    ) -> None:
        """Fetch the chunks past those asked for (their count is now known from the header,
        once it is bounded: the header is data from outside)."""
        commands, spans = [], []
        for i, first, parts in missing:
            limit = sizes[i] if sizes is not None else MAX_PAYLOAD_BYTES
            total = _chunks_to_fetch(parts[0], limit)
            if total <= first:
                continue  # not a page we would take: the decoder names what is wrong
            redis_key = self._redis_key(keys[i])
            commands += [[b"GET", self._chunk_key(redis_key, j)] for j in range(first, total)]
            spans.append((parts, total - first))
        if not commands:
            return
        replies = iter(await self._run(commands))
        for parts, count in spans:
            chunks = [next(replies) for _ in range(count)]  # all of them: keep in step
            for reply in chunks:
                if not isinstance(reply, bytes):
                    break  # absent or failed: the decoder will find the page short
                parts.append(reply)

    async def _delete(self, keys: list[bytes]) -> int:
        """Delete each page and every chunk it spans. A page's chunks are consecutive keys
        (`:1`, `:2`...), so the delete goes on until one is absent: the header's lengths
        (read first) only size the first round, which reaches one past the end they imply,
        so a damaged header costs further rounds, never chunks left behind."""
        redis_keys = [self._redis_key(key) for key in keys]
        probe = []
        for redis_key in redis_keys:
            probe += [[b"GETRANGE", redis_key, b"0", b"%d" % (HEADER_FIXED_BYTES - 1)]]
            probe += [[b"STRLEN", redis_key]]
        replies = await self._run(probe)
        # page -> (first chunk index of the next round, chunks in it)
        rounds = {
            j: (0, _num_chunks(replies[2 * j], replies[2 * j + 1]) + 1)
            for j in range(len(redis_keys))
        }
        removed = 0
        while rounds:
            commands, spans = [], []
            for j, (first, count) in rounds.items():
                count = min(count, _MAX_CHUNKS - first)
                spans.append((j, first, count))
                commands += [
                    [b"DEL", self._chunk_key(redis_keys[j], i)] for i in range(first, first + count)
                ]
            replies = iter(await self._run(commands))
            next_rounds = {}
            for j, first, count in spans:
                gone = [isinstance(reply, int) and reply > 0 for reply in islice(replies, count)]
                removed += first == 0 and gone[0]
                if gone[-1] and first + count < _MAX_CHUNKS:  # the run goes on past this round
                    next_rounds[j] = (first + count, 2 * count)
            rounds = next_rounds
        return removed


# -- wire helpers ----------------------------------------------------------------------------


def _pack(commands: list[list[Arg]]) -> list[bytes | memoryview]:
    """RESP arrays of bulk strings; an argument given as parts is sent as one value, unjoined."""
    out: list[bytes | memoryview] = []
    for command in commands:
        head = [b"*%d\r\n" % len(command)]
        for arg in command:
            if isinstance(arg, bytes):
                head.append(b"$%d\r\n%s\r\n" % (len(arg), arg))
                continue
            head.append(b"$%d\r\n" % sum(len(part) for part in arg))
            out.append(b"".join(head))
            out.extend(arg)
            head = [b"\r\n"]
        out.append(b"".join(head))
    return out


def _joined(arg: Arg) -> bytes | memoryview:
    if isinstance(arg, bytes):
        return arg
    return arg[0] if len(arg) == 1 else b"".join(arg)


async def _get_connection(pool):
    """pool.get_connection(): redis-py >= 6 takes no arguments, 5.x needs a command name."""
    if _GET_CONNECTION_NEEDS_NAME:
        return await pool.get_connection("GET")
    return await pool.get_connection()


_GET_CONNECTION_NEEDS_NAME = (
    inspect.signature(aredis.ConnectionPool.get_connection).parameters["command_name"].default
    is inspect.Parameter.empty
)


def _assemble(replies: list[object]) -> tuple[Fetched, int]:
    """A page's parts from its GET replies; and, if more chunks exist than were asked for,
    the index of the first one still to fetch (else 0)."""
    head = replies[0]
    if isinstance(head, Exception):
        return PageStatus.ERROR, 0
    if head is None:
        return None, 0
    sizes = peek_sizes(head)
    if sizes is None:
        return [head], 0  # the decoder names the reason
    header_bytes, stored_bytes = sizes
    parts: list = [head]
    got = len(head) - header_bytes
    for reply in replies[1:]:
        if got >= stored_bytes or not isinstance(reply, bytes):
            break
        parts.append(reply)
        got += len(reply)
    more = 0 < got < stored_bytes and len(parts) == len(replies)
    return parts, (len(parts) if more else 0)


def _chunk_count(header_bytes: int, stored_bytes: int, value_bytes: int, limit: int) -> int:
    """How many values a page spans, from its header's lengths and its first value's size,
    at most `_MAX_CHUNKS`; 1 where the lengths cannot be a page of at most `limit` payload
    bytes written in chunks (a damaged or forged header: nothing is sized by it)."""
    first = value_bytes - header_bytes  # payload bytes in the first value: the chunk size
    if stored_bytes <= first or stored_bytes > limit or first < _MIN_CHUNK_BYTES:
        return 1
    return min(_MAX_CHUNKS, 1 + -(-(stored_bytes - first) // first))


def _chunks_to_fetch(head: bytes, limit: int) -> int:
    """`_chunk_count` of a page whose first value is `head`."""
    sizes = peek_sizes(head)
    return 1 if sizes is None else _chunk_count(*sizes, len(head), limit)


def _num_chunks(fixed_header: object, value_bytes: object) -> int:
    """How many keys a page spans, from its header's fixed part and its first value's length
    (for deletes: whatever the page's size, never past `_MAX_CHUNKS`)."""
    sizes = peek_sizes(fixed_header) if isinstance(fixed_header, bytes) else None
    if sizes is None or not isinstance(value_bytes, int):
        return 1
    return _chunk_count(*sizes, value_bytes, MAX_PAYLOAD_BYTES)


# -- URLs ------------------------------------------------------------------------------------


def parse_redis_url(url: str) -> tuple[str, dict]:
    """Split a Redis URL into its query and the fixed RedisOptions fields it names."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        raise BackendConfigError(f"{redact_url(url)}: not a URL")
    scheme = scheme.lower()
    rest, _, query = rest.partition("?")
    netloc, _, path = rest.partition("/")
    userinfo, at, hosts = netloc.rpartition("@")
    fixed: dict = {"tls": scheme.startswith("rediss"), "cluster": scheme.endswith("+cluster")}
    if at:
        user, colon, password = userinfo.partition(":")
        fixed["username"] = unquote(user) or None
        fixed["password"] = unquote(password) if colon else None
    fixed["nodes"] = tuple(_parse_host(h, url) for h in hosts.split(",") if h)
    if path.strip("/"):
        try:
            fixed["db"] = int(path.strip("/"))
        except ValueError:
            raise BackendConfigError(
                f"{redact_url(url)}: the path must be a database number, got {path!r}"
            ) from None
    return query, fixed


def _parse_host(text: str, url: str) -> tuple[str, int]:
    if text.startswith("["):  # [::1]:6379
        host, _, port = text[1:].partition("]")
        port = port.lstrip(":")
    else:
        host, _, port = text.rpartition(":") if ":" in text else (text, "", "")
    try:
        return host, int(port) if port else _DEFAULT_PORT
    except ValueError:
        raise BackendConfigError(f"{redact_url(url)}: bad port in {text!r}") from None


def open_url(url: str, *, layout: str | None = None, name: str = "") -> RedisBackend:
    """`redis://[user:password@]host:port/db?prefix=hicache:&ttl=1h&chunk_size=4MiB&timeout=2s`,
    `rediss://` for TLS, `redis+cluster://host:port[,host:port...]` for Redis Cluster."""
    name = name or redact_url(url)
    query, fixed = parse_redis_url(url)
    options = options_from_query(RedisOptions, query, url=name, **fixed)
    return RedisBackend(options, layout, name=name)
