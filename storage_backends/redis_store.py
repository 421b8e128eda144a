"""Redis and Redis Cluster: `redis://host:port/db`, `rediss://`, `redis+cluster://host:port`.

One page is one Redis hash, `<prefix><32 hex digits of the key>`, with the object header in
field `h` and the payload in fields `0`, `1`, ... of at most `chunk_size` bytes each. A hash
lets one `HSET` carry the header and the caller's page as separate arguments, so a page goes
to the socket without being joined to its header or copied (redis-py sends large arguments as
they are), while it stays a single key: written atomically, expired and evicted as a whole,
and routed to one hash slot in a cluster. Chunks keep each value under Redis's bulk limit and
bound the latency one value adds for other clients.

Every batch is one pipeline (one round trip per node in a cluster). Capacity and eviction are
Redis's own: run the server with `maxmemory` and `maxmemory-policy allkeys-lru`; a write
Redis refuses for lack of memory is a rejected put. `ttl` (optional) expires pages.

If the same key is rewritten with fewer chunks (after changing `chunk_size` or
`compression`), the old tail fields stay in the hash until it expires or is deleted; readers
stop at the header's payload length, so they never read them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import unquote

import redis.asyncio as aredis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import OutOfMemoryError, RedisClusterException, RedisError

from .base import Fetched, PageStatus, StorageBackend
from .errors import BackendConfigError
from .objects import CorruptReason, FramedObject, parse_header
from .options import BackendOptions, check_range, options_from_query, redact_url, url_option

_HEADER_FIELD = b"h"
_DEFAULT_PORT = 6379
_MAX_BULK_BYTES = 512 << 20  # Redis's proto-max-bulk-len default


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
        self._ttl_ms = int(options.ttl_s * 1000)
        self._client: aredis.Redis | RedisCluster | None = None
        self._chunk_fields = [str(i).encode() for i in range(64)]

    # -- connection ---------------------------------------------------------------------------

    def _make_client(self) -> aredis.Redis | RedisCluster:
        opts = self.options
        common = dict(
            username=opts.username,
            password=opts.password,
            socket_timeout=opts.timeout_s,
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

    # -- primitives ---------------------------------------------------------------------------

    def _redis_key(self, key: bytes) -> bytes:
        return self._prefix + key.hex().encode()

    def _pipeline(self):
        return self._client.pipeline(transaction=False)

    async def _exists(self, keys: list[bytes]) -> int:
        pipe = self._pipeline()
        for key in keys:
            pipe.execute_command("EXISTS", self._redis_key(key))
        replies = await pipe.execute(raise_on_error=False)
        for i, reply in enumerate(replies):
            if reply != 1:
                return i
        return len(keys)

    async def _store(self, keys: list[bytes], objects: list[FramedObject]) -> list[PageStatus]:
        pipe = self._pipeline()
        for key, obj in zip(keys, objects, strict=True):
            redis_key = self._redis_key(key)
            pipe.execute_command("HSET", redis_key, *self._fields(obj))
            if self._ttl_ms:
                pipe.execute_command("PEXPIRE", redis_key, self._ttl_ms)
        replies = await pipe.execute(raise_on_error=False)
        self._note_errors(replies)
        per_page = 2 if self._ttl_ms else 1
        return [_put_status(replies[i * per_page : (i + 1) * per_page]) for i in range(len(keys))]

    def _note_errors(self, replies: list) -> None:
        for reply in replies:
            if isinstance(reply, Exception) and not isinstance(reply, OutOfMemoryError):
                self._note_page_error(f"{type(reply).__name__}: {reply}")

    def _fields(self, obj: FramedObject) -> list[bytes | memoryview]:
        payload = memoryview(obj.payload)
        chunk = self.options.chunk_bytes
        fields: list[bytes | memoryview] = [_HEADER_FIELD, obj.header]
        for i, offset in enumerate(range(0, max(len(payload), 1), chunk)):
            fields += [self._chunk_field(i), payload[offset : offset + chunk]]
        return fields

    def _chunk_field(self, i: int) -> bytes:
        return self._chunk_fields[i] if i < len(self._chunk_fields) else str(i).encode()

    async def _fetch(self, keys: list[bytes], sizes: list[int] | None) -> list[Fetched]:
        pipe = self._pipeline()
        asked: list[int] = []
        for i, key in enumerate(keys):
            redis_key = self._redis_key(key)
            if sizes is None:
                pipe.execute_command("HGETALL", redis_key)
                continue
            num_chunks = max(1, -(-sizes[i] // self.options.chunk_bytes))
            fields = [self._chunk_field(j) for j in range(num_chunks)]
            pipe.execute_command("HMGET", redis_key, _HEADER_FIELD, *fields)
            asked.append(num_chunks)
        replies = await pipe.execute(raise_on_error=False)
        self._note_errors(replies)
        if sizes is None:
            return [_from_hash(reply) for reply in replies]
        fetched: list[Fetched] = []
        incomplete: list[int] = []
        for i, (reply, num_chunks) in enumerate(zip(replies, asked, strict=True)):
            if isinstance(reply, Exception):
                fetched.append(PageStatus.ERROR)
                continue
            parts, more = _assemble(reply[0], reply[1:], num_chunks)
            fetched.append(parts)
            if more:
                incomplete.append(i)
        if incomplete:  # written with a smaller chunk_size than ours: fetch whole hashes
            whole = await self._fetch([keys[i] for i in incomplete], None)
            for i, parts in zip(incomplete, whole, strict=True):
                fetched[i] = parts
        return fetched

    async def _delete(self, keys: list[bytes]) -> int:
        pipe = self._pipeline()
        for key in keys:
            pipe.execute_command("DEL", self._redis_key(key))
        replies = await pipe.execute(raise_on_error=False)
        return sum(reply for reply in replies if isinstance(reply, int))


def _put_status(replies: list) -> PageStatus:
    for reply in replies:
        if isinstance(reply, OutOfMemoryError):
            return PageStatus.REJECTED  # maxmemory reached under a no-eviction policy
        if isinstance(reply, Exception):
            return PageStatus.ERROR
    return PageStatus.STORED


def _assemble(header: bytes | None, chunks: list, num_asked: int) -> tuple[Fetched, bool]:
    """The object's parts, trimmed to the header's payload length; and whether to ask for more."""
    if header is None:
        return None, False
    parsed = parse_header(header)
    if isinstance(parsed, CorruptReason):
        return [header], False  # the decoder names the reason
    parts: list = [header]
    got = 0
    for chunk in chunks:
        if chunk is None or got >= parsed.stored_bytes:
            break
        parts.append(chunk)
        got += len(chunk)
    more = got < parsed.stored_bytes and len(parts) - 1 == num_asked
    return parts, more


def _from_hash(reply: object) -> Fetched:
    if isinstance(reply, Exception):
        return PageStatus.ERROR
    if not reply:
        return None
    fields = dict(reply)
    chunks = []
    while (field_name := str(len(chunks)).encode()) in fields:
        chunks.append(fields[field_name])
    parts, _ = _assemble(fields.get(_HEADER_FIELD), chunks, len(chunks) + 1)
    return parts


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
