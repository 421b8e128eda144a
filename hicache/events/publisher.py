"""Publishing KV events: `EventPublisher` batches what is queued and sends it on a PUB
socket, keeps it for replay and logs subscribers in; `TierEvents`, the index's listener,
queues an event per run of pages. The format is wire.py's; subscriber.py reads it.
"""

from __future__ import annotations

import hmac
import logging
import threading
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import zmq

from hicache.events.wire import (
    END_OF_REPLAY,
    EVENT_FORMATS,
    MEDIUM_OF_TIER,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
    encode_batch,
    extra_keys_of,
)
from radix.node import Tier

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------- publishing


@dataclass(frozen=True)
class EventsConfig:
    """endpoint:         the PUB socket, e.g. "tcp://127.0.0.1:5557" (bound here; port 0
                      picks a free one, see `EventPublisher.endpoint`).
    replay_endpoint:  the ROUTER socket for replays (None: no replay).
    buffer_batches:   batches kept for replay (per channel) ...
    buffer_bytes:     ... and their bytes, all channels together (each an equal share).
    batch_interval_s: how long an event may wait for others to share its batch.
    max_batch_events: a batch is sent as soon as this many events are queued.
    topic:            the first frame of every message (`default_topic`: llm-d's
                      `kv@<pod>@<model>`, which it reads the replica's identity from; with
                      credentials: its prefix, the channel's name and "/" follow).
    format:           "vllm" (vLLM's schema, as above) or "sglang" (SGLang 0.5.23's:
                      `encode_batch`)."""

    endpoint: str
    replay_endpoint: str | None = None
    buffer_batches: int = 10_000
    buffer_bytes: int = 64 << 20
    batch_interval_s: float = 0.01
    max_batch_events: int = 1024
    topic: str = ""
    format: str = "vllm"

    def __post_init__(self) -> None:
        if self.format not in EVENT_FORMATS:
            raise ValueError(
                f"EventsConfig.format must be one of {EVENT_FORMATS}, got {self.format!r}"
            )
        if not self.endpoint.startswith(("tcp://", "ipc://", "inproc://")):
            raise ValueError(f"EventsConfig.endpoint must be a ZMQ address, got {self.endpoint!r}")
        if self.buffer_batches < 1:
            raise ValueError(f"EventsConfig.buffer_batches must be >= 1, got {self.buffer_batches}")
        if not 1 <= self.buffer_bytes <= 1 << 40:
            raise ValueError(
                f"EventsConfig.buffer_bytes must be in [1, 2**40], got {self.buffer_bytes}"
            )
        if not 0 < self.batch_interval_s <= 10:
            raise ValueError(
                f"EventsConfig.batch_interval_s must be in (0, 10], got {self.batch_interval_s}"
            )
        if self.max_batch_events < 1:
            raise ValueError(
                f"EventsConfig.max_batch_events must be >= 1, got {self.max_batch_events}"
            )


_ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # where libzmq asks who may connect (ZAP, RFC 27)
_REPLAY_HWM = 1024  # batches queued to one replay peer; past it the ROUTER drops them


class _Channel:
    """One audience's events: its topic, its sequence numbers, its replay buffer."""

    def __init__(self, topic: bytes, buffer_batches: int, buffer_bytes: int) -> None:
        self.topic = topic
        self.pending: list[KVEvent] = [AllBlocksCleared()]
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_batches)
        self.buffer_bytes = 0
        self.max_buffer_bytes = buffer_bytes
        self.next_seq = 0

    def keep(self, seq: int, payload: bytes) -> None:
        if len(self.buffer) == self.buffer.maxlen:
            self.buffer_bytes -= len(self.buffer[0][1])
        self.buffer.append((seq, payload))
        self.buffer_bytes += len(payload)
        while self.buffer_bytes > self.max_buffer_bytes and self.buffer:
            self.buffer_bytes -= len(self.buffer.popleft()[1])


class EventPublisher:
    """Batches queued events and publishes them from its own thread (the only one that
    touches its sockets). `add` is safe from any thread and never blocks on the network.

    Without `credentials` there is one channel, "", that anyone who connects receives. With
    them (`{secret: channel name}`), a subscriber and a replay requester must log in with
    ZMQ's PLAIN mechanism (any user name, a secret as the password), and receive only the
    channel their secret names, whatever they subscribe to: each channel's messages carry
    the topic `topic + name + "/"`, and the publisher (an XPUB socket in manual mode)
    subscribes each peer to its own channel's topic alone. PLAIN sends the secret in clear:
    on anything but loopback, put the socket behind TLS or a trusted network.
    """

    def __init__(self, config: EventsConfig, credentials: dict[str, str] | None = None) -> None:
        self.config = config
        self._context = zmq.Context.instance()
        self._credentials = {
            secret.encode(): name.encode() for secret, name in (credentials or {}).items()
        }
        names = sorted(set(self._credentials.values())) or [b""]
        if any(b"/" in name for name in names):
            raise ValueError("an event channel's name may not hold '/'")
        prefix = config.topic.encode()
        share = max(config.buffer_bytes // len(names), 1)
        self._channels = {
            name: _Channel(prefix + name + b"/" if self._credentials else prefix,
                           config.buffer_batches, share)
            for name in names
        }  # fmt: skip
        self._zap = None
        if self._credentials:
            self._zap = self._context.socket(zmq.REP)
            self._zap.setsockopt(zmq.LINGER, 0)
            self._zap.bind(_ZAP_ENDPOINT)
        # An XPUB, so that subscriptions reach this thread: counted (`num_subscriptions`),
        # and with credentials decided here (manual mode).
        self._pub = self._context.socket(zmq.XPUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.setsockopt(zmq.XPUB_VERBOSE, 1)  # every subscription, not only a topic's first
        if self._credentials:
            self._pub.setsockopt(zmq.XPUB_MANUAL, 1)
            self._secure(self._pub)
        self.endpoint = _bind(self._pub, config.endpoint)
        self._replay = None
        self.replay_endpoint = None
        if config.replay_endpoint is not None:
            self._replay = self._context.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.setsockopt(zmq.SNDHWM, _REPLAY_HWM)
            if self._credentials:
                self._secure(self._replay)
            self.replay_endpoint = _bind(self._replay, config.replay_endpoint)
        self._lock = threading.Lock()
        self._num_added = len(self._channels)
        self.num_events = 0  # events published so far
        self.num_refused = 0  # logins refused (wrong or missing secret)
        self.num_subscriptions = 0  # subscriptions in force now (each one already filters)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hicache-events", daemon=True)
        self._thread.start()

    def _secure(self, socket: zmq.Socket) -> None:
        socket.plain_server = True
        socket.zap_domain = b"hicache-events"

    def add(self, events: Iterable[KVEvent], channel: str = "") -> None:
        """Queue events for `channel`'s subscribers (ValueError: not a channel)."""
        target = self._channels.get(channel.encode())
        if target is None:
            raise ValueError(f"no event channel {channel!r}")
        with self._lock:
            before = len(target.pending)
            target.pending.extend(events)
            self._num_added += len(target.pending) - before

    @property
    def next_seq(self) -> int:
        """The sequence number the next batch of channel "" (or the only one) will carry."""
        return next(iter(self._channels.values())).next_seq

    def buffered_bytes(self) -> int:
        """Bytes kept for replay, all channels."""
        with self._lock:
            return sum(channel.buffer_bytes for channel in self._channels.values())

    def flush(self, timeout_s: float = 5.0) -> None:
        """Wait until every event added so far has been published."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            target = self._num_added
        while True:
            if self.num_events >= target:
                return
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise TimeoutError("the event publisher did not send its queued events")
            time.sleep(0.001)

    def close(self) -> None:
        """Publish what is queued, then close the sockets."""
        self._stop.set()
        self._thread.join(timeout=5.0)
        for sock in (self._pub, self._replay, self._zap):
            if sock is not None:
                sock.close(linger=0)

    def _run(self) -> None:
        poller = zmq.Poller()
        for sock in (self._replay, self._zap, self._pub):
            if sock is not None:
                poller.register(sock, zmq.POLLIN)
        interval_ms = self.config.batch_interval_s * 1000
        while True:
            stopping = self._stop.is_set()
            ready = dict(poller.poll(0 if stopping else interval_ms)) if poller.sockets else {}
            if not poller.sockets and not stopping:
                self._stop.wait(self.config.batch_interval_s)
            if self._zap is not None and ready.get(self._zap):
                self._answer_login()
            if ready.get(self._pub):
                self._subscribe()
            if self._replay is not None and ready.get(self._replay):
                self._serve_replay()
            self._send_pending()
            if stopping:
                return

    def _answer_login(self) -> None:
        """A ZAP request: PLAIN with a known secret logs in as its channel; nothing else."""
        frames = self._zap.recv_multipart()
        if len(frames) < 6:
            return
        version, request_id, _domain, _address, _identity, mechanism = frames[:6]
        credentials = frames[6:]
        name = None
        if mechanism == b"PLAIN" and len(credentials) == 2:
            name = self._by_secret(credentials[1])
        if name is None:
            self.num_refused += 1
        status = (b"200", b"OK") if name is not None else (b"400", b"refused")
        self._zap.send_multipart([version, request_id, *status, name or b"", b""])

    def _by_secret(self, secret: bytes) -> bytes | None:
        found = None
        for known, name in self._credentials.items():
            if hmac.compare_digest(known, secret):
                found = name
        return found

    def _subscribe(self) -> None:
        """A peer (un)subscribes. With credentials: whatever it asked, to its own channel's
        topic only (none: nothing). Without, the socket has applied it already."""
        frame = self._pub.recv(copy=False)
        if not frame.bytes or frame.bytes[0] not in (0, 1):
            return
        joining = frame.bytes[0] == 1
        if self._credentials:
            channel = self._channels.get(_user_id(frame))
            if channel is None:
                return
            self._pub.setsockopt(zmq.SUBSCRIBE if joining else zmq.UNSUBSCRIBE, channel.topic)
        self.num_subscriptions += 1 if joining else -1

    def _send_pending(self) -> None:
        limit = self.config.max_batch_events
        for channel in self._channels.values():
            while True:
                with self._lock:
                    if not channel.pending:
                        break
                    events = channel.pending[:limit]
                    channel.pending = channel.pending[limit:]
                batch = KVEventBatch(ts=time.time(), events=events)
                payload = encode_batch(batch, self.config.format)
                seq = channel.next_seq
                self._pub.send_multipart((channel.topic, seq.to_bytes(8, "big"), payload))
                with self._lock:
                    channel.keep(seq, payload)
                channel.next_seq += 1
                self.num_events += len(events)

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart(copy=False)
        if len(frames) != 3 or len(frames[2].bytes) != 8:
            logger.warning("ignored a malformed replay request (%d frames)", len(frames))
            return
        client, _, start = frames
        channel = self._channels.get(_user_id(start) if self._credentials else b"")
        if channel is None:
            return
        start_seq = int.from_bytes(start.bytes, "big")
        with self._lock:
            kept = [(seq, payload) for seq, payload in channel.buffer if seq >= start_seq]
        for seq, payload in kept:
            self._replay.send_multipart(
                (client.bytes, b"", channel.topic, seq.to_bytes(8, "big"), payload)
            )
        self._replay.send_multipart((client.bytes, b"", b"", END_OF_REPLAY, b""))


def _user_id(frame: zmq.Frame) -> bytes:
    """The channel name the peer that sent `frame` logged in as (b"": none)."""
    try:
        return (frame.get("User-Id") or "").encode()
    except zmq.ZMQError:
        return b""


def _bind(socket: zmq.Socket, endpoint: str) -> str:
    """Bind; a tcp port of 0 picks a free one. Returns the address actually bound."""
    try:
        if endpoint.startswith("tcp://") and endpoint.endswith(":0"):
            host = endpoint[len("tcp://") : -len(":0")]
            port = socket.bind_to_random_port(f"tcp://{host}")
            return f"tcp://{host}:{port}"
        socket.bind(endpoint)
    except zmq.ZMQError as error:
        raise OSError(f"cannot bind the KV event socket at {endpoint}: {error}") from None
    return endpoint


class TierEvents:
    """The index's listener: each run that gains or loses a tier becomes one event."""

    def __init__(self, publisher: EventPublisher, page_size: int) -> None:
        self.publisher = publisher
        self.page_size = page_size

    def pages_stored(
        self, tier: Tier, keys: list[bytes], parent_key: bytes | None, data: bytes, namespace
    ) -> None:
        tokens = np.frombuffer(data, dtype="<u4").tolist()
        event = BlockStored(
            keys,
            parent_key,
            tokens,
            self.page_size,
            None,
            MEDIUM_OF_TIER[tier],
            None,
            extra_keys=extra_keys_of(namespace, len(keys)),
        )
        self.publisher.add((event,))

    def pages_removed(self, tier: Tier, keys: list[bytes], namespace=None) -> None:
        self.publisher.add((BlockRemoved(keys, MEDIUM_OF_TIER[tier]),))
