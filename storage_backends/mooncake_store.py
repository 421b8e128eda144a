"""Mooncake Store: `mooncake://MASTER_HOST:PORT?...`, the distributed KV store as L3.

    mooncake://10.0.0.5:50051?protocol=rdma&device=mlx5_0&replicas=2&prefix=team-a:
    mooncake://127.0.0.1:50051                       (tcp, pages kept by other processes)
    mooncake://127.0.0.1:50051?segment=4GiB          (this process lends 4 GiB to the store)

A page is one Mooncake object, `<prefix><32 hex digits of the key>`, holding the encoded object
(header, then payload), so every read is checked like any other backend's: key, layout,
checksum and, with a tenant secret, the MAC; a damaged, foreign or truncated object is a counted
miss. Writes are Mooncake puts, which keep an object the store holds already (keys are content
addresses: the object under a key normally holds that very page; a put is cheaper than an
upsert, and a direct put needs no look first); an object a read refuses is removed
(`put_keeps_existing`: counted under `num_dropped`), so the next put of its key refills it.

Pages move through registered memory, never through Python `bytes`, in one of two ways.

- Straight, for pages of at least `direct` bytes in a pool the caller lent (`lend`: the
  engine lends its L2 pool), with no copy: mooncake_direct.py.
- Staged, for everything else: the backend allocates one staging arena (`buffer`),
  registers it with the transfer engine, and moves each round of a batch with
  `batch_put_from` / `batch_get_into` between the arena and the store. On the way out a
  page is copied into the arena and framed in the same pass (`objects.frame_objects_into`:
  its checksum taken of the copy as it is made; an lz4 or signed page is copied, then
  framed); on the way in the C check verifies each object in the arena and copies it into
  the caller's buffer in the same pass (`verify.decode_objects_into`), under the call's
  `CopyGuard`: a transfer still running when its call timed out writes only the arena
  (whose region is lent again only once the transfer is over), never the caller's pages:
  mooncake_staged.py, which also holds the objects API (whole objects, moved the same way).

Backends of one process on one store share one Mooncake client (`SharedClients`: it costs
about twenty threads and its own ports, and lends its segment once), each with its own
prefix and arena.

Mooncake keeps its capacity and evicts by itself: a page that vanished (evicted, or on a
segment whose process died) is a miss; a put the store has no room for is a rejected put.
Its client reconnects to a restarted master by itself (and re-mounts the segment it lends),
so a fault here never tears the client down; until the master answers, calls are faults.
The store does not report its contents to a client: `stats()` leaves usage unknown (the
master's metrics port has it, store-wide).

The client library is imported when a mooncake:// URL is opened, never before.
`benchmarks/bench_backends.py --backends mooncake` measures the backend against the raw
Mooncake client moving the same bytes on the same store.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
from collections.abc import Callable, Sequence
from typing import Any

from .base import PageStatus, ReadInto, StorageBackend
from .errors import BackendConfigError
from .guard import CopyGuard
from .lent import LentRegions
from .mooncake_common import (
    EXISTS,
    NO_ROOM,
    NOT_READY,
    MooncakeFault,
    Round,
    raise_if_all_failed,
    slot_sizes,
)
from .mooncake_direct import AGAIN, DirectPath
from .mooncake_options import MooncakeOptions, options_from_url
from .mooncake_staged import StagedPath
from .objects import Compression, header_size
from .options import redact_url
from .shared_clients import SharedClients
from .staging import StagingArena
from .workers import WorkerPool

logger = logging.getLogger(__name__)

_INSTALL = (
    "mooncake:// needs the Mooncake client: pip install mooncake-transfer-engine-non-cuda "
    "(mooncake-transfer-engine with CUDA) and apt-get install libibverbs1 libnuma1"
)


def _import_client() -> Any:
    """The `mooncake.store` module, or a one-line error naming what to install."""
    try:
        from mooncake import store
    except ImportError as exc:
        raise BackendConfigError(f"{_INSTALL} ({exc})") from None
    return store


class MooncakeBackend(DirectPath, StagedPath, StorageBackend):
    scheme = "mooncake"
    transient_errors = (MooncakeFault, OSError)
    put_keeps_existing = True

    def __init__(
        self, options: MooncakeOptions, layout: str | None = None, *, name: str = ""
    ) -> None:
        super().__init__(options, layout, name=name)
        self.options: MooncakeOptions = options
        self._module = _import_client()
        self._client: Any = None  # shared with the process' other backends on this store
        self._client_key: tuple = ()
        self._arena: StagingArena | None = None
        self._pool: WorkerPool | None = None
        self._round_bytes = options.buffer_bytes // 2  # two rounds move at once, at least
        self._config = self._replicate_config()
        self._complete = self._module.ReplicaStatus.COMPLETE
        self._lent = LentRegions()
        self._registering = threading.Lock()  # one thread registers lent regions at a time
        plain = self._compression is Compression.NONE  # (lz4 objects vary in size)
        self._direct_bytes = options.direct_bytes if plain else 0

    def _replicate_config(self) -> Any:
        config = self._module.ReplicateConfig()
        config.replica_num = self.options.replicas
        if self.options.soft_pin_s:
            config.soft_pin_action = self._module.SoftPinAction.ENABLE
            config.soft_pin_ttl_ms = max(1, int(self.options.soft_pin_s * 1000))
        return config

    # -- connection ---------------------------------------------------------------------------

    async def _open(self) -> None:
        """Check the master answers on its port (the client would retry for a minute and a
        half), then set the client up and register the arena, on a worker thread."""
        host, port = self.options.master
        probe = asyncio.open_connection(host, port)
        _, writer = await asyncio.wait_for(probe, self.options.connect_timeout_s)
        writer.close()
        local = self.options.local_host or _route_to(host, port)
        self._pool = WorkerPool(self.options.io_threads, thread_name_prefix="hicache-mooncake")
        self._arena = StagingArena(self.options.buffer_bytes)
        await self._in_pool(lambda: self._setup(local))

    def _setup(self, local_host: str) -> None:
        """Take the process' client for these settings (made on first use), and register
        this backend's arena with it."""
        opts = self.options
        master = f"{opts.master[0]}:{opts.master[1]}"
        key = (master, opts.metadata, opts.protocol, opts.device, local_host, opts.segment_bytes)

        def make() -> Any:
            client = self._module.MooncakeDistributedStore()
            code = client.setup(
                local_host, opts.metadata, opts.segment_bytes, 0, opts.protocol, opts.device, master
            )
            if code != 0:
                raise MooncakeFault(f"the client's setup with master {master} failed ({code})")
            return client

        client = _CLIENTS.acquire(key, make)
        code = client.register_buffer(self._arena.address, self._arena.nbytes)
        if code != 0:
            _CLIENTS.release(key, _close_client)
            raise MooncakeFault(f"registering the {self._arena.nbytes}-byte buffer failed ({code})")
        self._client, self._client_key = client, key
        self._register_lent()

    def _register_lent(self) -> None:
        """Register the regions lent since the client last registered (a worker thread).
        Calls that come at once after a lending each find the region unregistered: one
        registers it while the others wait, then find nothing left to do (a second
        registration, which the client refuses, would drop a registered region as refused)."""
        with self._registering:
            for start, end in self._lent.unregistered():
                code = self._client.register_buffer(start, end - start)
                if code != 0:
                    logger.warning(
                        "%s: the client refused to register a lent region of %d bytes (%d); "
                        "its pages move through the staging buffer",
                        self.name,
                        end - start,
                        code,
                    )
                self._lent.registered(start, code == 0)

    async def _reconnect(self) -> None:
        """The client reconnects to the master by itself: keep it (opening a second client
        would lend a second segment); only a client that never came up is set up again."""
        if self._client is None:
            await self._close()
            await self._open()

    async def _close(self) -> None:
        """Let transfers under way finish (the base bounds this by `close_grace`), then
        unregister the arena and let go of the client (the last user closes it, and it gives
        back the segment it lent)."""
        pool, client = self._pool, self._client
        self._pool = self._client = None
        if pool is None:
            return
        pool.shutdown(wait=False)
        await asyncio.wrap_future(pool.stopped())
        if client is not None:
            address, key = self._arena.address, self._client_key

            lent = self._lent.forget_registrations()

            def let_go() -> None:
                for start in lent:
                    client.unregister_buffer(start)
                client.unregister_buffer(address)
                _CLIENTS.release(key, _close_client)

            closer = WorkerPool(1, thread_name_prefix="hicache-mooncake-close")
            try:
                await asyncio.wrap_future(closer.submit(let_go))
            finally:
                closer.shutdown(wait=False)

    def _abandon(self) -> int:
        return 0 if self._pool is None else self._pool.num_pending()

    # -- running on the workers ---------------------------------------------------------------

    async def _in_pool(self, work: Callable[[], Any]) -> Any:
        return await asyncio.wrap_future(self._pool.submit(work))

    async def _rounds(
        self, slots: list[int], work: Callable[[Round, int], list[Any]], too_large: Any
    ) -> list[Any]:
        """Split a batch into rounds of at most half the arena, run `work(round, start)` on
        the workers for each (all at once), and put their outcomes back in batch order; an
        item larger than a round is `too_large`. A round's region is given back when its
        transfer is over, whether or not anyone still waits for it."""
        if not slots:
            return []
        if sum(slots) <= self._round_bytes:  # the common case: the batch is one round
            return await self._run_round(Round(list(range(len(slots))), slots), work)
        outcomes: list[Any] = [too_large] * len(slots)
        rounds, items, sizes, total = [], [], [], 0
        for i, slot in enumerate(slots):
            if slot > self._round_bytes:
                continue
            if total + slot > self._round_bytes:
                rounds.append(Round(items, sizes))
                items, sizes, total = [], [], 0
            items.append(i)
            sizes.append(slot)
            total += slot
        if items:
            rounds.append(Round(items, sizes))
        results = await asyncio.gather(*(self._run_round(r, work) for r in rounds))
        for one, result in zip(rounds, results, strict=True):
            for i, outcome in zip(one.items, result, strict=True):
                outcomes[i] = outcome
        return outcomes

    async def _run_round(self, one: Round, work: Callable[[Round, int], list[Any]]) -> list:
        arena = self._arena
        start = await arena.reserve(one.nbytes)
        try:
            future = self._pool.submit(work, one, start)
        except BaseException:
            arena.release(start)
            raise
        future.add_done_callback(lambda _: arena.release(start))  # run, failed or cancelled
        return await asyncio.wrap_future(future)

    def _names(self, keys: Sequence[bytes]) -> list[str]:
        prefix = self.options.prefix
        return [prefix + key.hex() for key in keys]

    def _addresses(self, one: Round, start: int) -> list[int]:
        base = self._arena.address + start
        return [base + offset for offset in one.offsets]

    # -- primitives ---------------------------------------------------------------------------

    async def _exists(self, keys: list[bytes]) -> int:
        codes = await self._in_pool(lambda: self._client.batch_is_exist(self._names(keys)))
        raise_if_all_failed(codes, "batch_is_exist")
        for i, code in enumerate(codes):
            if code != 1:
                return i
        return len(keys)

    async def _delete(self, keys: list[bytes]) -> int:
        codes = await self._in_pool(lambda: self._client.batch_remove(self._names(keys), True))
        raise_if_all_failed(codes, "batch_remove")
        return sum(1 for code in codes if code == 0)

    async def _frame_and_store(self, keys: list[bytes], views: list[memoryview]) -> list[bool]:
        """`batch_put`: straight from a lent pool's pages (`_put_direct`), or copied into the
        arena (only while the call runs), framed there and put."""
        head = header_size(self.layout, signed=self._mac_key is not None)
        sizes = [head + len(view) for view in views]
        guard = CopyGuard()

        def work(one: Round, start: int) -> list[PageStatus]:
            return self._put_pages(one, start, [keys[i] for i in one.items], views, head, guard)

        async def put() -> list[PageStatus]:
            addresses = await self._direct_now(views)
            if addresses is not None:
                return await self._put_direct(keys, views, addresses, head, guard)
            return await self._rounds(slot_sizes(sizes), work, PageStatus.REJECTED)

        try:
            statuses = await self._call("batch_put", put)
        finally:
            guard.close()
        return self._count_stores("batch_put", statuses, sizes)

    def _statuses(self, codes: list[int], op: str) -> list[PageStatus]:
        if codes.count(0) == len(codes):  # the common case: every page put
            return [PageStatus.STORED] * len(codes)
        raise_if_all_failed(codes, op)
        statuses = []
        for code in codes:
            if code in (0, EXISTS):
                statuses.append(PageStatus.STORED)
            elif code in (NO_ROOM, NOT_READY):  # (not_ready: someone else's put of it)
                statuses.append(PageStatus.REJECTED)
            else:
                self._note_page_error(f"{op}: Mooncake error {code}")
                statuses.append(PageStatus.ERROR)
        return statuses

    async def _fetch_into(
        self, keys: list[bytes], views: list[memoryview], guard: CopyGuard
    ) -> list[ReadInto]:
        """Read pages into the caller's buffers: straight into a lent pool's pages
        (`_fetch_direct`), or through the arena and a checked copy (`_fetch_staged`)."""
        addresses = await self._direct_now(views)
        if addresses is None:
            return await self._fetch_staged(keys, views, guard)
        outcomes = await self._fetch_direct(keys, views, addresses, guard)
        again = [i for i, outcome in enumerate(outcomes) if outcome is AGAIN]
        if again:  # another size than a page's object (damaged, signed, lz4): read staged
            staged = await self._fetch_staged(
                [keys[i] for i in again], [views[i] for i in again], guard
            )
            for i, outcome in zip(again, staged, strict=True):
                outcomes[i] = outcome
        return outcomes


# -- helpers ---------------------------------------------------------------------------------

_CLIENTS = SharedClients()  # one Mooncake client per master and settings, in this process


def _close_client(client: Any) -> None:
    client.close()


def _route_to(host: str, port: int) -> str:
    """This host's address on the route to the master (no packet is sent)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as sock:
        sock.connect((host, port))
        return sock.getsockname()[0]


# -- URLs ------------------------------------------------------------------------------------


def open_url(url: str, *, layout: str | None = None, name: str = "") -> MooncakeBackend:
    """`mooncake://MASTER_HOST:PORT?protocol=tcp&segment=0&buffer=256MiB&replicas=1&...`"""
    name = name or redact_url(url)
    return MooncakeBackend(options_from_url(url, name), layout, name=name)
