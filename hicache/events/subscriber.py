"""Subscribing to KV events: `EventSubscriber` reads one publisher (publisher.py) and fills
a gap in its sequence numbers from the replay socket. The format is wire.py's.
"""

from __future__ import annotations

import logging
import time

import msgspec
import zmq

from hicache.events.wire import END_OF_REPLAY, AllBlocksCleared, KVEventBatch, decode_batch

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------- subscribing


class EventSubscriber:
    """One publisher's batches, in order and without gaps while its replay buffer lasts.

    `receive(timeout_s)` returns the batches that arrived: a gap in the sequence numbers
    (a slow join, a reconnect, dropped messages) is filled from the replay socket first.
    `lost` counts batches that neither the socket nor the replay buffer had: a consumer
    that sees it grow has an incomplete picture (the router forgets that replica's pages).
    Use from one thread.
    """

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        *,
        topic: str = "",
        secret: str | None = None,
    ) -> None:
        """`secret`: the credential of a publisher that has them (see EventPublisher)."""
        self._context = zmq.Context.instance()
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.secret = secret
        self.socket = self._context.socket(zmq.SUB)
        self.socket.setsockopt(zmq.LINGER, 0)
        self._login(self.socket)
        self.socket.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self.socket.connect(endpoint)
        self.last_seq = -1
        self.lost = 0
        self.num_replayed = 0

    def receive(self, timeout_s: float = 0.0) -> list[tuple[int, KVEventBatch]]:
        batches: list[tuple[int, KVEventBatch]] = []
        if not self.socket.poll(int(timeout_s * 1000)):
            return batches
        while True:
            try:
                _topic, seq_bytes, payload = self.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return batches
            self._accept(int.from_bytes(seq_bytes, "big"), payload, batches)

    def replay(self, timeout_s: float = 2.0) -> list[tuple[int, KVEventBatch]]:
        """Ask for every batch after the last one seen (returns them in order)."""
        batches: list[tuple[int, KVEventBatch]] = []
        for seq, payload in self._fetch_replay(self.last_seq + 1, timeout_s):
            self._accept(seq, payload, batches, replaying=True)
        return batches

    def _accept(self, seq: int, payload: bytes, out: list, *, replaying: bool = False) -> None:
        try:
            batch = decode_batch(payload)
        except msgspec.DecodeError as error:
            logger.warning("a KV event batch from %s did not decode: %s", self.endpoint, error)
            return
        restarted = seq <= self.last_seq and _starts_clean(batch)
        if seq <= self.last_seq and not restarted:
            return  # already had it (a replay overlapping what the socket delivered)
        if restarted:
            self.last_seq = seq - 1
        if seq > self.last_seq + 1 and not replaying:
            out.extend(self.replay())
            if seq <= self.last_seq:
                return
        if seq > self.last_seq + 1:
            self.lost += seq - self.last_seq - 1
        self.last_seq = seq
        out.append((seq, batch))

    def _fetch_replay(self, start_seq: int, timeout_s: float) -> list[tuple[int, bytes]]:
        if self.replay_endpoint is None:
            return []
        dealer = self._context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        self._login(dealer)
        dealer.connect(self.replay_endpoint)
        found: list[tuple[int, bytes]] = []
        try:
            dealer.send_multipart((b"", start_seq.to_bytes(8, "big")))
            deadline = time.monotonic() + timeout_s
            while True:
                remaining_ms = int((deadline - time.monotonic()) * 1000)
                if remaining_ms <= 0 or not dealer.poll(remaining_ms):
                    logger.warning("the replay from %s did not finish", self.replay_endpoint)
                    return found
                frames = dealer.recv_multipart()
                if len(frames) != 4 or frames[2] == END_OF_REPLAY:
                    self.num_replayed += len(found)
                    return found
                found.append((int.from_bytes(frames[2], "big"), frames[3]))
        finally:
            dealer.close(linger=0)

    def _login(self, socket: zmq.Socket) -> None:
        if self.secret is not None:
            socket.plain_username = b"hicache"
            socket.plain_password = self.secret.encode()

    def close(self) -> None:
        self.socket.close(linger=0)


def _starts_clean(batch: KVEventBatch) -> bool:
    return bool(batch.events) and isinstance(batch.events[0], AllBlocksCleared)
