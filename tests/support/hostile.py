"""A hostile executor and L3 for model-based tests of the controller (torch-free).

`HostileExecutor` implements `hicache.ops.Executor` over pages of plain bytes, and does
everything the contract allows and a careless controller would not expect: it finishes ops
late and in any order (also ops of one kind), reads an op's source pages only when the op
finishes (so a source freed or reused meanwhile shows up as wrong bytes), acknowledges part
of an L3 write, times a prefetch out part way, fails an op (leaving garbage where it was
writing), and raises from `submit`. `HostileL3` is a shared store of framed objects
(`storage_backends.objects`, so reads go through the real verification) that a test can
lose, corrupt or truncate objects in.

Page contents are derived from what they hold: `page_bytes(key, num_layers)` is the KV of
the page with that key, one 8-byte value per layer, so a test can check any page a match
hands out against the key of the prefix it must hold.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import xxhash

from hicache.config import HiCacheConfig, L1Config, L2Config, L3Config, PolicyConfig
from hicache.controller import HiCache
from hicache.ops import BackupOp, Executor, LoadOp, PrefetchOp, TransferOp, WriteL3Op
from radix.keys import Namespace, page_keys
from storage_backends.objects import CorruptReason, encode_object
from storage_backends.verify import decode_object
from tiers.layout import KVLayout

URL_SCHEME = "hostile://"
VALUE_BYTES = 8  # per page and layer


def page_bytes(key: bytes, num_layers: int) -> bytes:
    """The KV a page with this key holds: one value per layer."""
    return b"".join(xxhash.xxh3_64_digest(key + bytes([layer])) for layer in range(num_layers))


def garbage(num_layers: int, rng: random.Random) -> bytes:
    return rng.randbytes(VALUE_BYTES * num_layers)


class SubmitFault(RuntimeError):
    """What a hostile `submit` raises."""


class CopyFault(RuntimeError):
    """The error a hostile op finishes with."""


@dataclass(frozen=True)
class Faults:
    """How often each fault happens (probabilities per op or per call)."""

    submit_raises: float = 0.0
    op_fails: float = 0.0  # an L1<->L2 copy or an L3 call fails (op.error)
    partial_write: float = 0.0  # L3 acknowledges only a leading part of a write
    write_unacked_extra: float = 0.5  # of those: pages past the ack are stored anyway
    prefetch_cut: float = 0.0  # a prefetch stops early (a timeout inside the backend)
    exists_fails: float = 0.0  # an existence check answers 0 (timeout)
    wait_times_out: float = 0.3  # a bounded wait returns before the op is done
    finish_on_poll: float = 0.5  # each poll finishes a random share of the ops in flight
    progress_on_poll: float = 0.5  # each poll moves a prefetch in flight on, part way
    # A cut prefetch's undelivered pages stay under a transfer that outlived its call (a
    # lent L2 pool): garbage lands in them on later polls, until the executor says they
    # are free again (`quarantined_host_pages`).
    late_write: float = 0.0

    @classmethod
    def hostile(cls) -> Faults:
        return cls(
            submit_raises=0.03,
            op_fails=0.03,
            partial_write=0.3,
            prefetch_cut=0.2,
            exists_fails=0.05,
            late_write=0.5,
        )


class HostileL3:
    """A shared L3 of framed objects, with the faults a test injects by hand."""

    def __init__(self, layout: str) -> None:
        self.layout = layout
        self.objects: dict[bytes, bytes] = {}
        self.num_corrupt = 0
        self.num_errors = 0
        self.num_timeouts = 0

    def put(self, key: bytes, payload: bytes) -> None:
        self.objects[key] = encode_object(key, self.layout, payload)

    def get(self, key: bytes) -> bytes | None:
        blob = self.objects.get(key)
        if blob is None:
            return None
        payload = decode_object(blob, key, self.layout)
        if isinstance(payload, CorruptReason):
            self.num_corrupt += 1
            return None
        return bytes(payload)

    def lose(self, rng: random.Random) -> None:
        if self.objects:
            del self.objects[rng.choice(sorted(self.objects))]

    def corrupt(self, rng: random.Random) -> None:
        if any(self.objects.values()):
            key = rng.choice(sorted(key for key, blob in self.objects.items() if blob))
            blob = bytearray(self.objects[key])
            blob[rng.randrange(len(blob))] ^= 1 << rng.randrange(8)
            self.objects[key] = bytes(blob)

    def truncate(self, rng: random.Random) -> None:
        if any(self.objects.values()):
            key = rng.choice(sorted(key for key, blob in self.objects.items() if blob))
            blob = self.objects[key]
            self.objects[key] = blob[: rng.randrange(len(blob))]

    def forge(self, rng: random.Random) -> None:
        """Store another page's object under a key (a page under a foreign key)."""
        if len(self.objects) >= 2:
            first, second = rng.sample(sorted(self.objects), 2)
            self.objects[first] = self.objects[second]

    def stats(self) -> _L3Stats:
        return _L3Stats(self.num_errors, self.num_timeouts, self.num_corrupt)


@dataclass(frozen=True)
class _L3Stats:
    num_errors: int
    num_timeouts: int
    num_corrupt_total: int


class HostileExecutor(Executor):
    """See the module docstring. `stores` are the L3s `attach_l3("hostile://NAME")` finds."""

    device_pool = None

    def __init__(
        self,
        *,
        num_device_pages: int,
        num_host_pages: int,
        num_layers: int,
        seed: int,
        faults: Faults = Faults(),
        stores: dict[str, HostileL3] | None = None,
    ) -> None:
        self.num_layers = num_layers
        self.rng = random.Random(seed)
        self.faults = faults
        self.device = [garbage(num_layers, self.rng) for _ in range(num_device_pages)]
        self.host = [garbage(num_layers, self.rng) for _ in range(num_host_pages)]
        self._stores = stores or {}
        self.store: HostileL3 | None = None
        self._inflight: list[TransferOp] = []
        self._finished: list[TransferOp] = []
        self._clock = 0.0
        self.num_submitted = 0
        self.num_faults: dict[str, int] = {}
        self.ack_pages: int | None = None  # scripted: every write acknowledges this many
        self.late: dict[int, int] = {}  # host page -> polls a late transfer still writes it

    # ------------------------------------------------------------------ faults

    def _chance(self, probability: float, what: str) -> bool:
        if probability and self.rng.random() < probability:
            self.num_faults[what] = self.num_faults.get(what, 0) + 1
            return True
        return False

    # ------------------------------------------------------------------ Executor

    def now(self) -> float:
        self._clock += 0.001
        return self._clock

    def submit(self, op: TransferOp) -> None:
        if isinstance(op, (WriteL3Op, PrefetchOp)) and self.store is None:
            raise AssertionError(f"{op.kind.value} submitted with no L3 attached")
        if self._chance(self.faults.submit_raises, "submit_raises"):
            raise SubmitFault(f"hostile submit of a {op.kind.value} op")
        if isinstance(op, (BackupOp, PrefetchOp)):
            reused = sorted(set(op.host_page_ids) & self.late.keys())
            if reused:  # its bytes would be overwritten by the late transfer: wrong KV
                raise AssertionError(f"L2 pages {reused} reused while a late transfer writes them")
        self.num_submitted += 1
        self._inflight.append(op)

    def poll(self) -> list[TransferOp]:
        for host_id, polls in list(self.late.items()):  # a late transfer writes on, then ends
            self.host[host_id] = garbage(self.num_layers, self.rng)
            if polls <= 1:
                del self.late[host_id]
            else:
                self.late[host_id] = polls - 1
        for op in list(self._inflight):
            if self.rng.random() < self.faults.finish_on_poll:
                self.finish(op)
        for op in self._inflight:
            if isinstance(op, PrefetchOp) and self.rng.random() < self.faults.progress_on_poll:
                self._progress(op)
        finished, self._finished = self._finished, []
        return finished

    def wait(self, op: TransferOp, timeout_s: float | None) -> bool:
        if op.done:
            return True
        if op not in self._inflight:
            return False
        if timeout_s is not None and self._chance(self.faults.wait_times_out, "wait_times_out"):
            if isinstance(op, PrefetchOp) and self.rng.random() < self.faults.progress_on_poll:
                self._progress(op)
            return False
        self.finish(op)
        return True

    def wait_layer(self, op: LoadOp, layer: int) -> None:
        if op in self._inflight:
            self.finish(op)

    def l3_exists(self, keys: list[bytes], timeout_s: float) -> int:
        if self.store is None or not keys:
            return 0
        if self._chance(self.faults.exists_fails, "exists_fails"):
            self.store.num_timeouts += 1
            return 0
        count = 0
        for key in keys:
            if key not in self.store.objects:
                break
            count += 1
        return count

    def attach_l3(self, url: str | None) -> None:
        if self._inflight:
            raise AssertionError("attach_l3 called with ops in flight")
        if url is None:
            self.store = None
            return
        if not url.startswith(URL_SCHEME):
            raise ValueError(f"hostile L3 URLs are {URL_SCHEME}NAME, got {url!r}")
        self.store = self._stores[url[len(URL_SCHEME) :]]

    @property
    def has_l3(self) -> bool:
        return self.store is not None

    def l3_stats(self):
        return self.store.stats() if self.store is not None else None

    def l3_capacity_pages(self) -> int | None:
        return None

    @property
    def num_device_pages(self) -> int:
        return len(self.device)

    @property
    def num_host_pages(self) -> int:
        return len(self.host)

    def quarantined_host_pages(self, host_page_ids: list[int]) -> list[bool]:
        return [host_id in self.late for host_id in host_page_ids]

    def close(self) -> None:
        if self._inflight:
            raise AssertionError("close with ops in flight: the controller must drain first")
        self.store = None

    # ------------------------------------------------------------------ the work

    @property
    def num_inflight(self) -> int:
        return len(self._inflight)

    def finish_some(self, count: int) -> None:
        """Finish up to `count` ops in flight, picked at random (any order, any kind)."""
        for _ in range(min(count, len(self._inflight))):
            self.finish(self.rng.choice(self._inflight))

    def finish(self, op: TransferOp) -> None:
        self._inflight.remove(op)
        fails = self._chance(self.faults.op_fails, "op_fails")
        if isinstance(op, (BackupOp, LoadOp)):
            self._copy(op, fails)
        elif isinstance(op, WriteL3Op):
            self._write(op, fails)
        else:
            self._progress(op, final=True, fails=fails)
        if fails:
            op.error = CopyFault(f"hostile failure of a {op.kind.value} op")
        op.finished_s = self.now()
        op.done = True
        self._finished.append(op)

    def _copy(self, op: BackupOp | LoadOp, fails: bool) -> None:
        if isinstance(op, BackupOp):
            source, target = self.device, self.host
            pairs = zip(op.device_page_ids, op.host_page_ids, strict=True)
        else:
            source, target = self.host, self.device
            pairs = zip(op.host_page_ids, op.device_page_ids, strict=True)
        for src, dst in pairs:
            target[dst] = garbage(self.num_layers, self.rng) if fails else source[src]

    def _write(self, op: WriteL3Op, fails: bool) -> None:
        count = len(op.keys)
        acked = count if self.ack_pages is None else min(count, self.ack_pages)
        if fails or self._chance(self.faults.partial_write, "partial_write"):
            acked = self.rng.randrange(count + 1) if count else 0
        stored = acked
        if acked < count and self.rng.random() < self.faults.write_unacked_extra:
            stored = self.rng.randrange(acked, count + 1)
        for key, host_id in zip(op.keys[:stored], op.host_page_ids[:stored], strict=True):
            self.store.put(key, self.host[host_id])
        op.num_written = 0 if fails else acked

    def _progress(self, op: PrefetchOp, *, final: bool = False, fails: bool = False) -> None:
        """Read the next pages of a prefetch into L2 (all of them when `final`)."""
        if fails or (final and self._chance(self.faults.prefetch_cut, "prefetch_cut")):
            self._scribble_past(op)
            return
        end = op.num_pages if final else self.rng.randrange(op.num_ready, op.num_pages + 1)
        for index in range(op.num_ready, end):
            payload = self.store.get(op.keys[index])
            if payload is None:
                self._scribble_past(op)
                return
            self.host[op.host_page_ids[index]] = payload
            op.num_ready = index + 1  # after the bytes, as the contract says
        if final:
            self._scribble_past(op)

    def _scribble_past(self, op: PrefetchOp) -> None:
        """Pages a prefetch did not deliver may hold anything, and may go on changing for a
        while after the op is done (`late_write`)."""
        late = self._chance(self.faults.late_write, "late_write")
        for host_id in op.host_page_ids[op.num_ready :]:
            self.host[host_id] = garbage(self.num_layers, self.rng)
            if late:
                self.late[host_id] = self.rng.randint(1, 40)


# ---------------------------------------------------------------------- a cache over it

LAYOUT = KVLayout(
    kind="mha", num_layers=2, page_size=4, dtype="float32", num_kv_heads=1, head_dim=2
)
CALM = Faults(
    finish_on_poll=0.0, progress_on_poll=0.0, wait_times_out=0.0
)  # ops finish only when a test says


def namespace(model_id: str = "model-a", tenant: str = "") -> Namespace:
    return Namespace(model_id=model_id, layout=LAYOUT.descriptor(), tenant=tenant)


def hostile_cache(
    *,
    l1_pages: int = 8,
    l2_pages: int = 16,
    store: HostileL3 | None = None,
    seed: int = 0,
    faults: Faults = CALM,
    l3: dict | None = None,
    **policy,
) -> tuple[HiCache, HostileExecutor]:
    """A controller over a hostile executor (and `store` as its L3, when given)."""
    executor = HostileExecutor(
        num_device_pages=l1_pages,
        num_host_pages=l2_pages,
        num_layers=LAYOUT.num_layers,
        seed=seed,
        faults=faults,
        stores={"l3": store} if store is not None else {},
    )
    config = HiCacheConfig(
        layout=LAYOUT,
        l1=L1Config(num_pages=l1_pages),
        l2=L2Config(budget_bytes=l2_pages * LAYOUT.bytes_per_page, reserve_bytes=0),
        l3=L3Config(url=f"{URL_SCHEME}l3" if store is not None else None, **(l3 or {})),
        policy=PolicyConfig(**policy),
    )
    return HiCache(config, executor), executor


def new_store() -> HostileL3:
    return HostileL3(LAYOUT.descriptor())


def expected_pages(tokens, ns: Namespace) -> list[bytes]:
    """The KV every full page of `tokens` must hold, page by page."""
    return [page_bytes(key, LAYOUT.num_layers) for key in page_keys(tokens, ns, LAYOUT.page_size)]


def compute(executor: HostileExecutor, tokens, ns: Namespace, ids: list[int], first: int) -> None:
    """The engine's prefill: write pages `first, first+1, ...` of `tokens` into `ids`."""
    expected = expected_pages(tokens, ns)
    for offset, page_id in enumerate(ids):
        executor.device[page_id] = expected[first + offset]


def wrong_pages(cache: HiCache, executor: HostileExecutor, tokens, ns: Namespace, match) -> list:
    """Wait for a match's loads, then list the pages that do not hold their own prefix's KV."""
    for layer in range(LAYOUT.num_layers):
        cache.wait_layer(match, layer)
    expected = expected_pages(tokens, ns)
    return [
        (page, page_id)
        for page, page_id in enumerate(match.device_page_ids)
        if executor.device[page_id] != expected[page]
    ]


def put(cache: HiCache, executor: HostileExecutor, tokens, ns: Namespace) -> None:
    """A request with no cache hit: allocate, compute, insert."""
    num_pages = len(tokens) // LAYOUT.page_size
    ids = cache.alloc_device_pages(num_pages)
    compute(executor, tokens, ns, ids, 0)
    cache.insert(tokens, ids, ns)
