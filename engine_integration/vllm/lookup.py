"""How vLLM's scheduler asks a worker's hicache what it holds.

`CacheLookup` runs next to a worker's `HiCache`: how many pages of a prompt's prefix each
tier holds, after one batched L3 `exists` past the index (`HiCache.prefetch`, which also
starts fetching those pages into L2). With one worker in the scheduler's process the
scheduler calls it directly; otherwise each worker serves it on a local ZeroMQ socket
(`LookupServer`, one per rank, at `lookup_address`) and the scheduler asks every rank
(`LookupClient`) and takes the shortest answer: a page counts as cached only when every
rank holds its shard.

After a lookup whose L3 part failed or ran into its timeout, the next `L3_QUIET_S` of
lookups skip L3 (L1 and L2 still answer): a hung store must not hold every new request of
vLLM's scheduler loop for the timeout. A lookup with `ask_l3=False` skips it too: the
scheduler asked about the same waiting request a moment ago (`plan.py`), and the index
holds what L3 had.
"""

from __future__ import annotations

import logging
import os
import struct
import tempfile
import threading
import time
from typing import NamedTuple

import numpy as np
import zmq

from engine_integration.vllm.config import namespace_for
from tiers.layout import KVLayout

logger = logging.getLogger(__name__)

L3_QUIET_S = 5.0


class Found(NamedTuple):
    """Pages of a prefix held in L1, L2 and L3 (the fastest tier that holds each)."""

    num_l1_pages: int
    num_l2_pages: int
    num_l3_pages: int

    @property
    def num_pages(self) -> int:
        return self.num_l1_pages + self.num_l2_pages + self.num_l3_pages


NOTHING = Found(0, 0, 0)


class CacheLookup:
    """Answers lookups from one worker's cache, for the worker's rank."""

    def __init__(self, cache, model_id: str, layout: KVLayout, rank: int, world_size: int):
        self.cache = cache
        self.model_id = model_id
        self.layout = layout
        self.rank = rank
        self.world_size = world_size
        self._l3_quiet_until = 0.0
        self._lock = threading.Lock()

    def namespace(self, extra_key: str):
        return namespace_for(
            self.model_id,
            self.layout,
            rank=self.rank,
            world_size=self.world_size,
            extra_key=extra_key,
        )

    def find(self, tokens: list[int], extra_key: str, ask_l3: bool = True) -> Found:
        namespace = self.namespace(extra_key)
        with self._lock:
            use_l3 = time.monotonic() >= self._l3_quiet_until
        if use_l3 and ask_l3:
            self._look_up_l3(tokens, namespace)
        found = self.cache.cached_prefix(tokens, namespace)
        return Found(found.num_l1_pages, found.num_l2_pages, found.num_l3_pages if use_l3 else 0)

    def _look_up_l3(self, tokens: list[int], namespace) -> None:
        cache = self.cache
        errors = _l3_errors(cache)
        start = time.monotonic()
        cache.prefetch(tokens, namespace)
        slow = time.monotonic() - start >= cache.config.l3.exists_timeout_s
        if slow or _l3_errors(cache) > errors:
            with self._lock:
                self._l3_quiet_until = time.monotonic() + L3_QUIET_S
            logger.warning(
                "hicache L3 lookup failed: lookups skip L3 for the next %.0f s", L3_QUIET_S
            )


MAX_WINDOW_PROBES = 4  # boundaries below the full groups' hit a lookup tries for windows


class ModelLookup:
    """Answers lookups for every KV group of one worker (`groups.py`): the shortest prefix
    the full-attention and MLA groups hold, cut to the deepest page boundary, at most
    `MAX_WINDOW_PROBES` pages below it, where every sliding-window group holds the window
    before it (a finished request's window may end a page or two before its last full
    page: worker.py); nothing if there is none."""

    def __init__(self, groups, lookups: list[CacheLookup], page_size: int) -> None:
        self.groups = groups
        self.lookups = lookups
        self.page_size = page_size

    def find(self, tokens: list[int], extra_key: str, ask_l3: bool = True) -> Found:
        pairs = list(zip(self.groups, self.lookups, strict=True))
        found = shortest(
            [look.find(tokens, extra_key, ask_l3) for g, look in pairs if g.window_tokens == 0]
        )
        windows = [(group, look) for group, look in pairs if group.window_tokens]
        if not windows:
            return found
        lowest = max(0, found.num_pages - MAX_WINDOW_PROBES)
        for num_pages in range(found.num_pages, lowest, -1):
            end = num_pages * self.page_size
            if all(
                self._holds_window(g, look, tokens, extra_key, end, ask_l3) for g, look in windows
            ):
                return shortest([found, Found(num_pages, 0, 0)])
        return NOTHING

    def _holds_window(self, group, look, tokens, extra_key: str, end: int, ask_l3: bool) -> bool:
        entry = group.extent(tokens, extra_key, self.page_size, end)
        window = look.find(entry.token_ids, entry.extra_key, ask_l3)
        return window.num_pages * self.page_size >= len(entry.token_ids)


def _l3_errors(cache) -> int:
    stats = cache.executor.l3_stats()
    return stats.num_errors + stats.num_timeouts if stats is not None else 0


def lookup_address(engine_id: str, rank: int, data_parallel_rank: int = 0) -> str:
    """The rank's socket: a file in the temp directory (the scheduler's host only)."""
    safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in engine_id)
    name = f"hicache-{safe}-dp{data_parallel_rank}-rank{rank}.sock"
    return f"ipc://{os.path.join(tempfile.gettempdir(), name)}"


# The wire format: a request is three frames, the extra key (UTF-8), the tokens
# (little-endian uint32) and whether to ask L3 (b"1" or b"0"); a reply is three little-endian
# uint64 page counts. No pickle: the socket is a file others on the host may reach.
_REPLY = struct.Struct("<3Q")
MAX_REQUEST_BYTES = 64 << 20  # 16M tokens: larger requests are dropped by ZeroMQ


def _encode_request(tokens: list[int], extra_key: str, ask_l3: bool) -> list[bytes]:
    flag = b"1" if ask_l3 else b"0"
    return [extra_key.encode(), np.asarray(tokens, dtype="<u4").tobytes(), flag]


def _decode_request(frames: list[bytes]) -> tuple[list[int], str, bool]:
    if len(frames) != 3 or len(frames[1]) % 4 or frames[2] not in (b"0", b"1"):
        raise ValueError(
            f"a lookup is 3 frames: key, tokens in whole uint32s, b'0' or b'1'; got {len(frames)}"
        )
    return np.frombuffer(frames[1], dtype="<u4").tolist(), frames[0].decode(), frames[2] == b"1"


class LookupServer:
    """Serves `lookup.find` on `address` from a thread of its own, until `close()`."""

    def __init__(self, lookup: CacheLookup, address: str) -> None:
        self._lookup = lookup
        self._path = address.removeprefix("ipc://")
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.REP)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES)
        self._socket.bind(address)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="hicache-lookup", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            frames = self._socket.recv_multipart()
            try:
                found = self._lookup.find(*_decode_request(frames))
            except Exception as error:  # a failed lookup is a miss for the scheduler
                logger.warning("hicache lookup failed: %r", error)
                found = NOTHING
            self._socket.send(_REPLY.pack(*found))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._socket.close()
        self._context.term()
        try:
            os.unlink(self._path)
        except OSError:
            pass  # gone already


class LookupClient:
    """Asks one rank's `LookupServer`; no answer within `timeout_s` is a miss."""

    def __init__(self, address: str, timeout_s: float) -> None:
        self._address = address
        self._timeout_ms = int(timeout_s * 1000)
        self._context = zmq.Context()
        self._socket = None

    def ask(self, tokens: list[int], extra_key: str, ask_l3: bool = True) -> None:
        """Send a lookup; `answer()` waits for it (ask every rank first, then wait)."""
        if self._socket is None:
            self._socket = self._context.socket(zmq.REQ)
            self._socket.setsockopt(zmq.LINGER, 0)
            self._socket.connect(self._address)
        self._socket.send_multipart(_encode_request(tokens, extra_key, ask_l3))

    def answer(self) -> Found:
        if not self._socket.poll(self._timeout_ms):
            logger.warning("hicache lookup at %s: no answer in %d ms", self._address,
                           self._timeout_ms)  # fmt: skip
            self._socket.close()  # a REQ socket waiting for a reply takes no new request
            self._socket = None
            return NOTHING
        reply = self._socket.recv()
        if len(reply) != _REPLY.size:
            logger.warning("hicache lookup at %s: a reply of %d bytes", self._address, len(reply))
            return NOTHING
        return Found(*_REPLY.unpack(reply))

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close()
        self._context.term()


def ask_all(
    clients: list[LookupClient], tokens: list[int], extra_key: str, ask_l3: bool = True
) -> Found:
    """Every rank's answer at once (a slow rank costs its timeout once), shortest first."""
    for client in clients:
        client.ask(tokens, extra_key, ask_l3)
    return shortest([client.answer() for client in clients])


def shortest(answers: list[Found]) -> Found:
    """What every rank holds: the shortest prefix, tiers taken from the fastest down."""
    num_pages = min(found.num_pages for found in answers)
    l1 = min(min(found.num_l1_pages for found in answers), num_pages)
    l2 = min(min(found.num_l1_pages + found.num_l2_pages for found in answers), num_pages) - l1
    return Found(l1, l2, num_pages - l1 - l2)
